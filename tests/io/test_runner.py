import json
from pathlib import Path
import subprocess
import sys

import papermill
import pytest
import yaml

from attnum import runs
from attnum.paths import params_dir

STUDY = "length_scaling"


def test_every_study_has_schema_sets_and_typed_documented_parameters():
    assert STUDY in runs.studies()
    for study in runs.studies():
        declared = runs.declared_parameters(study)
        assert set(runs.schema(study)) == set(declared), f"{study}: schema.yaml and notebook disagree"
        for common in runs.COMMON_PARAMETERS:
            assert common in declared, f"{study} must declare {common}"
        for name, info in declared.items():
            assert info["type"] in runs.TYPES, f"{study}.{name} lacks a checkable type annotation"
            assert info["help"], f"{study}.{name} lacks a trailing comment"
        assert {"smoke", "default", "full"} <= set(runs.param_sets(study))
        for name in runs.param_sets(study):
            values = runs.resolve_parameters(study, name, machine=False)  # every committed set is valid
            estimate = runs.memory_estimate(study, values)
            assert estimate is not None and estimate[0] > 0, f"{study} declares no memory estimate"


def test_default_set_is_the_notebook_parameters_cell():
    """Run All in JupyterLab must give what `make reproduce` gives: one statement of the default tier."""
    for study in runs.studies():
        assert not (params_dir() / study / "default.yaml").exists(), "the notebook holds the default tier"
        declared = runs.declared_parameters(study)
        default = runs.load_param_set(study, "default")
        for key, value in default.items():
            assert yaml.safe_load(declared[key]["default"]) == value, f"{study}.{key}"
        assert set(declared) - set(default) == set(runs.RUNNER_SET)
        assert "default" in runs.param_sets(study)


@pytest.mark.parametrize("overrides,message", [
    ({"seq_length": [128]}, "unknown parameter 'seq_length'.*allowed parameters"),
    ({"heads": "two"}, "parameter 'heads' must be of type int"),
    ({"heads": 1.5}, "parameter 'heads' must be of type int"),
    ({"heads": 0}, r"parameter 'heads'.*out of range.*1 <= value <= 64"),
    ({"device": "tpu"}, r"parameter 'device'.*'tpu' is not allowed; allowed values: \['cpu', 'cuda'"),
    ({"dtypes": ["bf16", "fp8"]}, r"parameter 'dtypes'\[1\].*'fp8'.*allowed values: \['bf16', 'fp16', 'fp32'\]"),
    ({"seq_lens": [128, 300, 512]}, r"parameter 'seq_lens'\[1\].*power of two"),
    ({"seq_lens": [128]}, "at least 3 entries"),
    ({"output_dir": "/tmp/x"}, "set by the runner"),
])
def test_bad_parameters_are_named_and_nothing_is_written(outputs, overrides, message):
    with pytest.raises(runs.ParameterError, match=message):
        runs.run(STUDY, "smoke", overrides)
    assert not outputs.exists()


def test_unknown_study_and_set_are_named(outputs):
    with pytest.raises(runs.ParameterError, match="unknown study 'lengths'.*length_scaling"):
        runs.run("lengths", "smoke")
    with pytest.raises(runs.ParameterError, match="no parameter set 'tiny'.*smoke"):
        runs.run(STUDY, "tiny")
    assert not outputs.exists()


def test_cli_bad_parameter_exits_nonzero_naming_the_key(outputs):
    proc = subprocess.run([sys.executable, "-m", "attnum", "run", STUDY, "--params", "smoke", "-p", "heads", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "parameter 'heads'" in proc.stderr and "1 <= value <= 64" in proc.stderr
    assert not outputs.exists()


def test_failed_run_keeps_earlier_results_and_marks_itself(outputs, monkeypatch):
    final = outputs / STUDY / "smoke"
    final.mkdir(parents=True)  # a plain folder, like the committed GPU run
    (final / "results.nc").write_text("earlier results")

    def crash(input_path, output_path, **kwargs):
        Path(output_path).write_text("{}")
        raise RuntimeError("kernel died in cell 5")

    monkeypatch.setattr(papermill, "execute_notebook", crash)
    with pytest.raises(runs.RunError, match="kernel died in cell 5"):
        runs.run(STUDY, "smoke", progress=False)
    assert (final / "results.nc").read_text() == "earlier results"
    failed = outputs / STUDY / "smoke.failed"
    assert "kernel died in cell 5" in (failed / "FAILED").read_text()
    assert json.loads((failed / "RUN.json").read_text())["status"] == "failed"
    assert not [p for p in (outputs / STUDY).iterdir() if ".running-" in p.name]


def test_interrupted_run_keeps_earlier_results(outputs, monkeypatch):
    final = outputs / STUDY / "smoke"
    final.mkdir(parents=True)
    (final / "results.nc").write_text("earlier results")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(papermill, "execute_notebook", interrupt)
    with pytest.raises(KeyboardInterrupt):
        runs.run(STUDY, "smoke", progress=False)
    assert (final / "results.nc").read_text() == "earlier results"
    assert (outputs / STUDY / "smoke.failed" / "FAILED").exists()


def test_a_run_that_writes_no_results_fails(outputs, monkeypatch):
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: None)
    with pytest.raises(runs.RunError, match="without writing results.nc"):
        runs.run(STUDY, "smoke", progress=False)
    assert not (outputs / STUDY / "smoke").exists()


def test_run_names_grids_and_sweep_checks():
    assert runs.run_name("default") == "default"
    assert runs.run_name("smoke", {"head_dim": 32, "dtypes": ["bf16"]}) == "smoke__dtypes=bf16__head_dim=32"
    assert runs.sweep_point_name("smoke", {"head_dim": 32, "heads": 2}, {"head_dim": 32}) == "smoke__heads=2@head_dim=32"
    grid = runs.parse_grid("head_dim=32,64; block_k=16")
    assert grid == {"head_dim": [32, 64], "block_k": [16]}
    assert runs.grid_points(grid) == [{"block_k": 16, "head_dim": 32}, {"block_k": 16, "head_dim": 64}]
    with pytest.raises(runs.ParameterError, match="key=value"):
        runs.parse_grid("head_dim")
    with pytest.raises(runs.ParameterError, match="'seeds' is a list"):
        runs.sweep(STUDY, {"seeds": [[0], [1]]}, "smoke")
    with pytest.raises(runs.ParameterError, match="parameter 'head_dim'.*out of range"):
        runs.sweep(STUDY, {"head_dim": [32, 100000]}, "smoke")


def test_param_files_only_hold_declared_keys():
    for study in runs.studies():
        for path in (params_dir() / study).glob("*.yaml"):
            if path.stem != "schema":
                assert set(yaml.safe_load(path.read_text())) <= set(runs.schema(study)), path
            else:
                for key, rule in runs.schema(study).items():
                    assert set(rule) <= set(runs.params.RULE_KEYS), f"{path}: {key} has unknown rule keys"
