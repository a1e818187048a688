"""The committed notebooks: output-free, a parameters cell first, a title; what git commits, not the working file.

A notebook executed and saved in JupyterLab keeps its outputs in the working tree; the nbstripout git
filter (``make setup``, ``.gitattributes``) strips them when it is committed. So these tests read the
notebook as committed (``git show HEAD:<path>``, and the staged version if it differs), falling back to
the working file only outside a git checkout.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from attnum import runs

ROOT = Path(__file__).resolve().parents[2]


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _in_git() -> bool:
    return shutil.which("git") is not None and _git("rev-parse", "--verify", "HEAD").returncode == 0


def committed_notebooks():
    """(label, notebook) for every study notebook as git has it (HEAD and the index), else the working file."""
    out = []
    for path in runs.studies().values():
        rel = path.relative_to(ROOT).as_posix()
        versions = []
        if _in_git():
            for ref in (f"HEAD:{rel}", f":{rel}"):
                shown = _git("show", ref)
                if shown.returncode == 0 and shown.stdout not in versions:
                    versions.append(shown.stdout)
                    out.append((f"{rel} ({'committed' if ref.startswith('HEAD') else 'staged'})",
                                nbformat.reads(shown.stdout, as_version=4)))
        if not versions:  # not yet committed, or no git: the file itself
            out.append((rel, nbformat.read(path, as_version=4)))
    return out


def test_committed_notebooks_have_no_outputs_and_a_parameters_cell_first():
    for label, nb in committed_notebooks():
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert "parameters" in code[0].metadata.get("tags", []), f"{label}: first code cell must be tagged"
        for cell in code:
            assert not cell.outputs and cell.execution_count is None, f"{label} carries outputs"
        assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
        first_md = next(c for c in nb.cells if c.cell_type == "markdown")
        assert first_md.source.startswith("# "), f"{label} must open with a title"


def test_parameters_cell_only_declares_values():
    """Derived values belong in a later cell: papermill does not recompute the parameters cell."""
    for label, nb in committed_notebooks():
        cell = next(c for c in nb.cells if c.cell_type == "code")
        for line in cell.source.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                assert ":" in line.split("=")[0] and "#" in line, f"{label}: {line!r} is not 'name: type = value  # help'"


def test_code_cells_are_tagged_hide_input_for_the_site():
    for label, nb in committed_notebooks():
        for cell in nb.cells[1:]:
            tags = cell.metadata.get("tags", [])
            if cell.cell_type == "code" and "parameters" not in tags:
                assert "hide-input" in tags, f"{label}: a code cell without the hide-input tag"


def test_the_git_filter_strips_a_notebook_saved_with_outputs_and_keeps_everything_else():
    """What ``.gitattributes`` names: nbstripout, run as ``make setup`` configures it (``--keep-id``)."""
    attributes = (ROOT / ".gitattributes").read_text().split("\n")
    assert "*.ipynb filter=nbstripout" in attributes
    if _in_git():  # executed runs under outputs/ keep their outputs (their sha256 is in RUN.json)
        for rel, want in (("outputs/length_scaling/gpu/notebook.ipynb", "unspecified"),
                          ("notebooks/02_extreme_inputs.ipynb", "nbstripout")):
            assert _git("check-attr", "filter", "--", rel).stdout.strip().endswith(f"filter: {want}"), rel
    nbstripout = Path(sys.executable).with_name("nbstripout")
    assert nbstripout.exists(), "nbstripout is not installed (pip install -r requirements.txt)"
    path = runs.notebook_path("extreme_inputs")
    committed = path.read_text() if not _in_git() else _git("show", f"HEAD:{path.relative_to(ROOT).as_posix()}").stdout
    nb = nbformat.reads(committed, as_version=4)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):  # as JupyterLab saves a Run All
        cell.execution_count = i + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stderr", text="families:  40%|####  | 12/30\n"),
                        nbformat.v4.new_output("display_data", data={"text/plain": "table"})]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    saved = nbformat.writes(nb)
    proc = subprocess.run([str(nbstripout), "--keep-id"], input=saved, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == committed, "the filter's output differs from the committed notebook"


def test_raw_papermill_with_a_misspelled_parameter_fails_at_once_with_the_runners_message(tmp_path):
    """papermill only warns about an unknown name and injects it; runs.start refuses it before any work."""
    papermill = Path(sys.executable).with_name("papermill")
    study = "wasserstein_weight_drift"
    env = {**os.environ, "ATTNUM_OUTPUTS": str(tmp_path / "outputs")}
    t0 = time.monotonic()
    proc = subprocess.run([str(papermill), str(runs.notebook_path(study)), str(tmp_path / "out.ipynb"),
                           "-f", str(ROOT / "params" / study / "smoke.yaml"), "-p", "n_sed", "3",
                           "--cwd", str(ROOT / "notebooks")], capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert f"unknown parameter 'n_sed' for study '{study}'" in proc.stdout + proc.stderr
    assert "allowed parameters:" in proc.stdout + proc.stderr
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.nc")), "it ran"
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    executed = [c for c in out.cells if c.cell_type == "code" and c.execution_count]
    assert len(executed) <= 3, "cells after the set-up cell ran"  # parameters, injected, set-up
    print(f"raw papermill refused in {elapsed:.1f} s")


@pytest.mark.parametrize("name", ["n_sed"])
def test_runner_start_names_injected_undeclared_parameters(name):
    namespace = {n: None for n in runs.parameter_names("gproj_fix")}
    namespace["In"] = ["", "x: int = 1  # a parameter", f"# Parameters\n{name} = 3\nseeds = [0]\n"]
    with pytest.raises(runs.ParameterError, match=f"unknown parameter '{name}'.*allowed parameters"):
        runs.start("gproj_fix", namespace)
    assert runs.injected_parameter_names(namespace) == [name, "seeds"]
    assert runs.injected_parameter_names({"In": ["", "a = 1"]}) == []
