import json
import re
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


# -- rules between parameters and the memory estimate: each study's rules(p) and memory_estimate(p) --

RULE_CASES = [  # (study, overrides that break exactly one rule, the parameters its message must name)
    ("extreme_inputs", {"onset_logit_min": -40000.0, "onset_logit_max": -50000.0},
     ("onset_logit_min", "onset_logit_max")),
    ("gproj_fix", {"fixes": ["gproj_dq", "mean_key"]}, ("fixes",)),
    ("gproj_fix", {"d_model": 30, "n_head": 4}, ("d_model", "n_head")),
    ("gproj_fix", {"step_d_model": 30, "step_n_head": 4}, ("step_d_model", "step_n_head")),
    ("gproj_fix", {"real_timing_seq_len": 1024, "real_timing_tokens": 512}, ("real_timing_tokens", "real_timing_seq_len")),
    ("late_training_gradient_blowup", {"steps": 40, "checkpoint_steps": [0, 50]}, ("checkpoint_steps", "steps")),
    ("late_training_gradient_blowup", {"d_model": 30, "n_head": 4}, ("d_model", "n_head")),
    ("wasserstein_weight_drift", {"d_model": 30, "n_head": 4}, ("d_model", "n_head")),
]


def _full(study: str, name: str, overrides: dict) -> dict:
    return {**runs.notebook_defaults(study), **runs.load_param_set(study, name), **overrides}


@pytest.mark.parametrize("study,overrides,named", RULE_CASES, ids=[f"{c[0]}-{'-'.join(c[2])}" for c in RULE_CASES])
def test_a_broken_rule_is_refused_naming_its_parameters_before_anything_runs(outputs, study, overrides, named):
    messages = runs.params.study_module(study).rules(_full(study, "smoke", overrides))
    assert len(messages) == 1
    for name in named:
        assert re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", messages[0]), (name, messages[0])
    got = ", ".join(f"{n}={overrides[n]!r}" for n in sorted(named))
    with pytest.raises(runs.ParameterError, match=re.escape(f"{messages[0]} (got {got})")):
        runs.run(study, "smoke", overrides, progress=False)
    assert not outputs.exists()


def test_every_committed_parameter_set_breaks_no_rule():
    for study in runs.studies():
        rules = runs.params.study_module(study).rules
        for name in runs.param_sets(study):
            assert rules(_full(study, name, {})) == [], (study, name)


# Each case sets every parameter its estimate reads, so the bytes follow from the formula alone:
# (study, parameters, bytes computed here from the study's formula)
MEMORY_CASES = [
    # batch * heads * N_max * (reference rows * 4 + golden_chunk * 8) * 3; reference rows: reference_chunk,
    # or 0 -> the largest N of the experiments that run the unblocked reference (block_seq_len does not)
    ("length_scaling", {"batch": 2, "heads": 3, "seq_lens": [16, 32, 64], "causal_seq_len": 128,
                        "block_seq_len": 256, "real_seq_lens": [512], "golden_chunk": 64, "reference_chunk": 0},
     2 * 3 * 512 * (512 * 4 + 64 * 8) * 3),
    ("length_scaling", {"batch": 2, "heads": 3, "seq_lens": [16, 32, 64], "causal_seq_len": 128,
                        "block_seq_len": 1024, "real_seq_lens": [512], "golden_chunk": 64, "reference_chunk": 0},
     2 * 3 * 1024 * (512 * 4 + 64 * 8) * 3),
    ("length_scaling", {"batch": 1, "heads": 1, "seq_lens": [16, 32, 64], "causal_seq_len": 128,
                        "block_seq_len": 256, "real_seq_lens": [512], "golden_chunk": 64, "reference_chunk": 32},
     1 * 1 * 512 * (32 * 4 + 64 * 8) * 3),
    # batch * heads * N * (N * 4 + golden_chunk * 8) * 3, N the largest length of any experiment
    ("extreme_inputs", {"batch": 1, "heads": 2, "seq_lens": [16, 32], "det_seq_lens": [64], "sentinel_seq_len": 128,
                        "overflow_seq_len": 16, "real_seq_len": 256, "golden_chunk": 8},
     1 * 2 * 256 * (256 * 4 + 8 * 8) * 3),
    # N^2 * 8 bytes * 8 matrices + batch_size * n_head * context^2 * 4 bytes * n_layer * 16 maps
    ("gproj_fix", {"seq_lens": [8, 64], "regime_seq_len": 128, "timing_seq_len": 32, "batch_size": 4, "n_head": 2,
                   "context": 16, "n_layer": 3},
     128 ** 2 * 8 * 8 + 4 * 2 * 16 ** 2 * 4 * 3 * 16),
    ("late_training_gradient_blowup", {"seq_lens": [8, 16], "real_seq_lens": [32], "tie_seq_len": 64, "src_seq_len": 8,
                                       "batch_size": 4, "n_head": 2, "context": 16, "n_layer": 3},
     64 ** 2 * 8 * 8 + 4 * 2 * 16 ** 2 * 4 * 3 * 16),
    # attention maps + seeds * pairs * 2 sides * (checkpoints + 2) * (12 n_layer d^2 + 2 (n_symbols + 4) d) * 4 bytes
    ("wasserstein_weight_drift", {"batch_size": 4, "n_head": 2, "context": 16, "n_layer": 3, "seeds": [0, 1],
                                  "pairs": ["repeat", "flash", "init_seed"], "steps": 100, "checkpoint_every": 25,
                                  "d_model": 32, "n_symbols": 12},
     4 * 2 * 16 ** 2 * 4 * 3 * 16 + 2 * 3 * 2 * (100 // 25 + 2) * (12 * 3 * 32 ** 2 + 2 * (12 + 4) * 32) * 4),
]


@pytest.mark.parametrize("study,values,expected", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_memory_estimate_in_bytes_and_the_machine_check(monkeypatch, study, values, expected):
    runs.check_parameters(study, values)  # a valid set: the estimate alone decides below
    need, note = runs.memory_estimate(study, values)
    assert need == expected and isinstance(need, int) and note
    monkeypatch.delenv(runs.params.ALLOW_LARGE_ENV, raising=False)
    monkeypatch.setattr(runs.params, "machine_memory", lambda device="cpu": expected)
    runs.check_machine(study, values)  # exactly the machine's memory: accepted
    monkeypatch.setattr(runs.params, "machine_memory", lambda device="cpu": expected - 1)
    with pytest.raises(runs.ParameterError, match="estimated peak memory .* exceeds"):
        runs.check_machine(study, values)
    runs.check_machine(study, values, allow_large=True)
