"""Run names of one's own (--name), a study named by its notebook, --params FILE.yaml: checked before any work.

Every refusal here happens before a run starts: papermill's execute_notebook is replaced by a stub that
records the call (or a fake run that writes a record), so no notebook kernel is started."""
import json
import subprocess
import sys
from pathlib import Path

import papermill
import pytest

from attnum import ncio, runs
from attnum.cli import main
from attnum.paths import notebooks_dir, params_dir, project_root
from attnum.runs import batch, plan

STUDY = "length_scaling"
SMOKE = params_dir() / STUDY / "smoke.yaml"


@pytest.fixture
def fake_papermill(monkeypatch):
    """papermill.execute_notebook replaced: each call is recorded; it writes a notebook and a results.nc the
    runner can verify, so a run 'finishes' in milliseconds with the folder and record a real one leaves."""
    import numpy as np
    import xarray as xr

    calls = []

    def execute(input_path, output_path, parameters=None, **kwargs):
        calls.append({"input": input_path, "parameters": dict(parameters or {}), "kwargs": kwargs})
        out = Path(parameters["output_dir"])
        Path(output_path).write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
        ds = xr.Dataset({"err": ("n", np.arange(3.0), {"units": "1", "long_name": "error"})}, coords={"n": [1, 2, 3]})
        ncio.write_results(ds, out / "results.nc", study=STUDY, params=parameters, device="cpu")

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    return calls


@pytest.mark.parametrize("name", ["a b", "x" * (plan.MAX_LABEL + 1), "lab-1", "@x", "a@b", ".hidden", "-x", "ok.failed",
                                  "a/b", "a=b", "é"])
def test_the_cli_exits_2_naming_the_rule_for_a_bad_name(outputs, fake_papermill, capsys, name):
    with pytest.raises(SystemExit) as exc:
        main(["run", STUDY, "--params", "smoke", f"--name={name}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --name" in err and f"at most {plan.MAX_LABEL} characters" in err
    assert not fake_papermill and not outputs.exists()


@pytest.mark.parametrize("name", ["hd32", "A", "smoke-2026.12+cpu", "x" * plan.MAX_LABEL])
def test_good_names_pass_unchanged(name):
    assert plan.check_label(name) == name


def test_a_named_run_gets_that_folder_and_a_rerun_of_the_same_parameters_replaces_it(outputs, fake_papermill):
    first = runs.run(STUDY, "smoke", {"head_dim": 32}, progress=False, name="hd32", named=True)
    assert first == outputs / STUDY / "hd32"
    record = ncio.verify_run(first)
    assert (record["name"], record["param_set"], record["overrides"]) == ("hd32", "smoke", {"head_dim": 32})
    again = runs.run(STUDY, "smoke", {"head_dim": 32}, progress=False, name="hd32", named=True)
    assert again == first and len(fake_papermill) == 2
    assert ncio.read_record(again)["started"] >= record["started"]


@pytest.mark.parametrize("param_set,overrides", [("smoke", {"head_dim": 64}), ("smoke", {}), ("full", {"head_dim": 32})])
def test_a_name_held_by_a_run_of_other_parameters_is_refused_before_the_run_starts(outputs, fake_papermill,
                                                                                    param_set, overrides):
    runs.run(STUDY, "smoke", {"head_dim": 32}, progress=False, name="hd32", named=True)
    before = sorted(p.name for p in (outputs / STUDY / ".versions" / "hd32").iterdir())
    with pytest.raises(runs.ParameterError, match=r"'hd32' is already used by a run .*other parameters"):
        runs.run(STUDY, param_set, overrides, progress=False, name="hd32", named=True)
    assert len(fake_papermill) == 1  # the second run never started
    assert sorted(p.name for p in (outputs / STUDY / ".versions" / "hd32").iterdir()) == before
    assert ncio.read_record(outputs / STUDY / "hd32")["overrides"] == {"head_dim": 32}


def test_the_cli_refuses_a_used_name_with_exit_2_and_a_generated_name_is_never_refused(outputs, fake_papermill, capsys):
    assert main(["run", STUDY, "--params", "smoke", "--name", "mine", "--no-progress"]) == 0
    assert main(["run", STUDY, "--params", "smoke", "-p", "head_dim", "64", "--name", "mine", "--no-progress"]) == 2
    assert "already used" in capsys.readouterr().err
    assert len(fake_papermill) == 1
    assert main(["run", STUDY, "--params", "smoke", "--no-progress"]) == 0  # generated: 'smoke'
    assert sorted(p.name for p in (outputs / STUDY).iterdir() if not p.name.startswith(".")) == ["mine", "smoke"]


def test_a_sweep_name_prefixes_every_point_and_a_second_sweep_of_other_parameters_is_refused(outputs, fake_papermill,
                                                                                           capsys):
    tasks = batch.plan_sweep(STUDY, {"head_dim": [16, 32]}, "smoke", {"heads": 2}, prefix="hd")
    assert [t.name for t in tasks] == ["hd@head_dim=16", "hd@head_dim=32"]
    assert all(t.named for t in tasks)
    assert main(["sweep", STUDY, "--params", "smoke", "-p", "heads", "2", "--grid", "head_dim=16,32", "--name", "hd",
                 "--workers", "1", "--no-progress"]) == 0
    assert sorted(p.name for p in (outputs / STUDY).iterdir() if not p.name.startswith(".")) == \
        ["hd@head_dim=16", "hd@head_dim=32"]
    assert ncio.study_groups(STUDY, outputs) == {"hd@head_dim": ["hd@head_dim=16", "hd@head_dim=32"]}
    # more points of the same sweep join the group
    assert main(["sweep", STUDY, "--params", "smoke", "-p", "heads", "2", "--grid", "head_dim=64", "--name", "hd",
                 "--workers", "1", "--no-progress"]) == 0
    assert len(fake_papermill) == 3
    capsys.readouterr()
    # another fixed override, or another swept key, under the same prefix: refused, nothing submitted (dry run too)
    for extra in (["-p", "heads", "4", "--grid", "head_dim=128"], ["--grid", "heads=1,2"],
                  ["-p", "heads", "4", "--grid", "head_dim=128", "--dry-run"]):
        assert main(["sweep", STUDY, "--params", "smoke", *extra, "--name", "hd", "--workers", "1",
                     "--no-progress"]) == 2
        assert "'hd' is already used by sweep points" in capsys.readouterr().err
    assert len(fake_papermill) == 3


def test_a_named_run_with_an_unreadable_record_in_its_place_is_refused(outputs, fake_papermill):
    folder = outputs / STUDY / "hd32"
    folder.mkdir(parents=True)
    (folder / "RUN.json").write_text("{not json")
    with pytest.raises(runs.ParameterError, match="record cannot be read"):
        runs.run(STUDY, "smoke", progress=False, name="hd32", named=True)
    assert not fake_papermill


@pytest.mark.parametrize("given", ["01_length_scaling", "notebooks/01_length_scaling.ipynb", "length_scaling",
                                   str(notebooks_dir() / "01_length_scaling.ipynb")])
def test_a_study_is_named_by_its_notebook_stem_or_path(given):
    assert runs.resolve_study(given) == STUDY


def test_a_study_path_from_another_folder_resolves_and_a_copy_elsewhere_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the path is then read relative to the project root
    assert runs.resolve_study("notebooks/01_length_scaling.ipynb") == STUDY
    copy = tmp_path / "01_length_scaling.ipynb"
    copy.write_text((notebooks_dir() / "01_length_scaling.ipynb").read_text())
    with pytest.raises(runs.ParameterError, match="is not the project's notebook of study 'length_scaling'"):
        runs.resolve_study(str(copy))
    with pytest.raises(runs.ParameterError, match="no notebook elsewhere/01_length_scaling.ipynb"):
        runs.resolve_study("elsewhere/01_length_scaling.ipynb")
    with pytest.raises(runs.ParameterError, match=r"unknown study '01_length_scalin'.*did you mean '01_length_scaling'"):
        runs.resolve_study("01_length_scalin")


def test_run_by_notebook_stem_writes_the_studys_folder(outputs, fake_papermill):
    assert main(["run", "01_length_scaling", "--params", "smoke", "--no-progress"]) == 0
    assert main(["run", "notebooks/01_length_scaling.ipynb", "--params", "smoke", "-p", "head_dim", "32",
                 "--no-progress"]) == 0
    assert [Path(c["input"]).name for c in fake_papermill] == ["01_length_scaling.ipynb"] * 2
    assert sorted(p.name for p in (outputs / STUDY).iterdir() if not p.name.startswith(".")) == \
        ["smoke", "smoke__head_dim=32"]


def test_a_params_file_is_checked_like_a_named_set_and_named_after_the_file(outputs, fake_papermill, tmp_path):
    mine = tmp_path / "sets" / "mine.yaml"
    mine.parent.mkdir()
    mine.write_text(SMOKE.read_text().replace("head_dim: 32", "head_dim: 16"))
    expected = {**runs.load_param_set(STUDY, "smoke"), "head_dim": 16}
    assert runs.load_param_set(STUDY, str(mine)) == expected
    assert main(["run", STUDY, "--params", str(mine), "--no-progress"]) == 0
    record = ncio.verify_run(outputs / STUDY / "mine.yaml")
    assert record["param_set"] == str(mine.resolve())
    assert record["parameters"] == expected
    injected = fake_papermill[0]["parameters"]
    assert injected["head_dim"] == 16 and injected["seq_lens"] == expected["seq_lens"]


@pytest.mark.parametrize("text,message", [
    ("heads: 0\n", r"parameter 'heads'.*out of range"),
    ("seq_length: [128]\n", r"unknown parameter 'seq_length'.*did you mean 'seq_lens'"),
    ("heads: 2\nheads: 3\n", r"key 'heads' appears twice"),
    ("a: &x [1]\nb: *x\n", "anchors and aliases"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("output_dir: /tmp/x\n", "set by the runner"),
])
def test_a_bad_params_file_is_refused_by_the_schema_checks_before_anything_is_written(outputs, fake_papermill,
                                                                                      tmp_path, capsys, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["run", STUDY, "--params", str(bad), "--no-progress"]) == 2
    import re

    assert re.search(message, capsys.readouterr().err)
    assert not fake_papermill and not outputs.exists()


def test_a_params_file_of_the_study_is_that_named_set_and_schema_or_a_missing_file_is_refused(tmp_path, monkeypatch):
    assert runs.normalize_param_set(STUDY, str(SMOKE)) == "smoke"
    monkeypatch.chdir(project_root())
    assert runs.normalize_param_set(STUDY, "params/length_scaling/smoke.yaml") == "smoke"
    monkeypatch.chdir(tmp_path)  # no smoke.yaml here: the study's own
    assert runs.normalize_param_set(STUDY, "smoke.yaml") == "smoke"
    (tmp_path / "smoke.yaml").write_text("heads: 2\n")  # one here: that file, not the named set
    assert runs.normalize_param_set(STUDY, "smoke.yaml") == str((tmp_path / "smoke.yaml").resolve())
    assert runs.run_name(runs.normalize_param_set(STUDY, str(SMOKE))) == "smoke"
    with pytest.raises(runs.ParameterError, match="schema"):
        runs.normalize_param_set(STUDY, str(params_dir() / STUDY / "schema.yaml"))
    with pytest.raises(runs.ParameterError, match="does not exist"):
        runs.resolve_parameters(STUDY, str(tmp_path / "none.yaml"))


def test_a_sweep_and_run_all_take_a_params_file(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("heads: 2\n")
    tasks = batch.plan_sweep("01_length_scaling", {"head_dim": [16, 32]}, str(mine))
    assert [t.name for t in tasks] == ["mine.yaml@head_dim=16", "mine.yaml@head_dim=32"]
    assert {t.param_set for t in tasks} == {str(mine.resolve())}
    assert all(t.parameters["heads"] == 2 for t in tasks)


@pytest.mark.slow
def test_a_real_cli_run_by_notebook_name_with_a_name_prints_no_kernel_transport_warning(outputs):
    """One real run (the notebook kernel starts): its folder is the --name, and the runner's captured stderr
    holds no "Kernel is running over TCP without encryption" from ipykernel (the kernel is on IPC)."""
    proc = subprocess.run([sys.executable, "-m", "attnum", "run", "notebooks/01_length_scaling.ipynb", "--params",
                           "smoke", "-p", "seq_lens", "[16, 32, 64]", "-p", "attribution_seq_lens", "[32]",
                           "--name", "quick", "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "without encryption" not in proc.stderr and "IPKernelApp" not in proc.stderr, proc.stderr[-2000:]
    assert ncio.verify_run(outputs / STUDY / "quick")["name"] == "quick"


@pytest.mark.parametrize("name,param_set,overrides", [("default", "smoke", {}), ("smoke", "smoke", {"head_dim": 16}),
                                                      ("full", "smoke", {})])
def test_the_name_of_a_parameter_set_is_refused_for_any_other_run(outputs, fake_papermill, name, param_set, overrides):
    with pytest.raises(runs.ParameterError, match=f"'{name}' is a parameter set of study 'length_scaling'"):
        runs.run(STUDY, param_set, overrides, progress=False, name=name, named=True)
    assert not fake_papermill


def test_the_name_of_a_parameter_set_is_accepted_for_that_sets_plain_run(outputs, fake_papermill):
    assert runs.run(STUDY, "smoke", progress=False, name="smoke", named=True) == outputs / STUDY / "smoke"
