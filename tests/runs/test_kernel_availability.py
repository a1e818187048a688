"""The kernels a parameter set asks for, and whether each can run here: ``runs.requested_kernels``,
``runs.kernel_availability``, ``python -m attnum kernels --study`` and the check ``.ci/gpu tier`` makes before a
run meant to be committed (a kernel whose package is missing would otherwise be recorded as unavailable and the
run would finish without it)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnum import runs
from attnum.cli import main
from attnum.kernels import get
from attnum.paths import project_root

STUDY = "length_scaling"


def test_every_kernel_parameter_of_a_set_is_asked_for_once_in_parameter_order():
    values = runs.load_param_set("gproj_fix", "gpu")
    asked = runs.requested_kernels("gproj_fix", values)
    assert len(asked) == len(set(asked))
    assert asked[0] == values["baseline_attention"]  # declared before the lists
    listed = [name for key in ("real_kernels", "real_timing_fp32_kernels", "step_kernels", "step_fp32_kernels")
              for name in values[key]]
    assert set(asked) == {values["baseline_attention"], *listed}
    # the first list declared after it follows in its own order
    rest = [name for name in values["real_kernels"] if name != values["baseline_attention"]]
    assert asked[1:1 + len(rest)] == rest


def test_the_notebook_defaults_fill_what_a_set_leaves_out():
    defaults = runs.notebook_defaults(STUDY)
    assert runs.requested_kernels(STUDY, {}) == list(dict.fromkeys(defaults["real_kernels"]))
    assert runs.requested_kernels(STUDY, {"real_kernels": ["sdpa:math"]}) == ["sdpa:math"]


def test_availability_is_that_of_each_kernel_on_the_sets_device():
    device, reasons = runs.kernel_availability(STUDY, "smoke", {"real_kernels": ["sdpa:math", "fa4", "flex"]})
    assert device == "cpu"
    assert list(reasons) == ["sdpa:math", "fa4", "flex"]
    for name, reason in reasons.items():
        assert reason == get(name).unavailable_reason("cpu")
    assert reasons["sdpa:math"] is None
    assert isinstance(reasons["fa4"], str) and reasons["fa4"]


def test_a_bad_set_is_refused_before_any_kernel_is_asked():
    with pytest.raises(runs.ParameterError, match="real_kernels"):
        runs.kernel_availability(STUDY, "smoke", {"real_kernels": ["no_such_family:x"]})


def _set_file(tmp_path, kernels):
    path = tmp_path / "mine.yaml"
    path.write_text("device: cpu\nreal_kernels: [" + ", ".join(f'"{k}"' for k in kernels) + "]\n")
    return str(path)


def test_the_cli_exits_0_when_every_kernel_runs(tmp_path, capsys):
    assert main(["kernels", "--study", STUDY, "--params", _set_file(tmp_path, ["sdpa:math"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[:-1]] == ["sdpa:math"]
    assert "runs on cpu" in out[0]


def test_the_cli_exits_1_naming_each_kernel_that_cannot_run(tmp_path, capsys):
    assert main(["kernels", "--study", STUDY, "--params", _set_file(tmp_path, ["sdpa:math", "flex"])]) == 1
    captured = capsys.readouterr()
    lines = {line.split()[0]: line for line in captured.out.splitlines()}
    assert "runs on cpu" in lines["sdpa:math"]
    assert get("flex").unavailable_reason("cpu") in lines["flex"]
    missing = captured.err.split("here: ", 1)[1].split(";", 1)[0]
    assert missing.split(", ") == ["flex"]


def test_the_cli_exits_2_for_an_unknown_set(capsys):
    assert main(["kernels", "--study", STUDY, "--params", "no_such_set"]) == 2
    assert "no_such_set" in capsys.readouterr().err


def test_the_gpu_tier_refuses_to_start_when_a_kernel_cannot_run(tmp_path):
    """On this machine (no CUDA) every kernel of the gpu set fails the check: the tier exits 3 before any run,
    and its logs name the kernels; with ALLOW_UNAVAILABLE=1 it would start (not run here: it would execute the
    study)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"  # the script calls python3: this interpreter (a venv's, so exec'd, not linked)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "out"
    res = subprocess.run(["bash", str(project_root() / ".ci" / "gpu"), "tier", "late_training_gradient_blowup",
                          str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 3, res.stdout + res.stderr
    kernels_log = (out / "late_training_gradient_blowup_gpu_kernels.log").read_text()
    asked = runs.requested_kernels("late_training_gradient_blowup",
                                   runs.load_param_set("late_training_gradient_blowup", "gpu"))
    assert {line.split()[0] for line in kernels_log.splitlines() if line.startswith("    ")} == set(asked)
    assert "not started" in (out / "late_training_gradient_blowup_gpu.log").read_text()
    assert not Path(out / "late_training_gradient_blowup_gpu.tar").exists()
