"""``.ci/device-tree``: moves the committed runs out of what the device tool sends and back, in a scratch git
repository with a copy of the script, never losing a file and never overwriting one."""
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "device-tree"


@pytest.fixture
def repo(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("no git on this machine")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".ci").mkdir()
    shutil.copy(SCRIPT, tmp_path / ".ci" / "device-tree")
    (tmp_path / "outputs" / "study" / "gpu").mkdir(parents=True)
    (tmp_path / "outputs" / "study" / "gpu" / "results.nc").write_bytes(b"run data")
    return tmp_path


def _run(repo, *args):
    return subprocess.run(["bash", str(repo / ".ci" / "device-tree"), *args], capture_output=True, text=True)


def test_hide_leaves_an_empty_outputs_and_restore_brings_every_file_back(repo):
    assert _run(repo, "status").stdout.strip() == "in place"
    hidden = _run(repo, "hide")
    assert hidden.returncode == 0, hidden.stderr
    assert (repo / "outputs").is_dir() and not any((repo / "outputs").iterdir())
    held = Path(subprocess.run(["git", "rev-parse", "--absolute-git-dir"], cwd=repo, capture_output=True,
                               text=True, check=True).stdout.strip()) / "attnum-outputs-held"
    assert (held / "study" / "gpu" / "results.nc").read_bytes() == b"run data"
    assert _run(repo, "status").stdout.startswith("held in")
    again = _run(repo, "hide")
    assert again.returncode == 1 and "already held" in again.stderr  # a second hide would bury the first
    restored = _run(repo, "restore")
    assert restored.returncode == 0, restored.stderr
    assert (repo / "outputs" / "study" / "gpu" / "results.nc").read_bytes() == b"run data" and not held.exists()
    assert _run(repo, "restore").returncode == 1  # nothing held


def test_restore_refuses_while_outputs_holds_new_files(repo):
    assert _run(repo, "hide").returncode == 0
    (repo / "outputs" / "new.txt").write_text("written while held")
    refused = _run(repo, "restore")
    assert refused.returncode == 1 and "outputs/new.txt" in refused.stderr
    assert (repo / "outputs" / "new.txt").read_text() == "written while held"  # nothing overwritten
    (repo / "outputs" / "new.txt").unlink()
    assert _run(repo, "restore").returncode == 0
    assert (repo / "outputs" / "study" / "gpu" / "results.nc").exists()


def test_an_unknown_command_is_refused_with_the_usage():
    result = subprocess.run(["bash", str(SCRIPT), "stash"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr
