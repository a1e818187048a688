"""Runs and results that survive anything: atomic swaps, locks, checks before any work,
checksums, failure records, clean, publish, CF compliance, grouping.

Runs use ``robust_helpers.fake_execute`` in place of papermill (a real results.nc in
milliseconds); the CF check runs the real smoke notebook (marked slow).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import papermill
import pytest
import xarray as xr

import attnum.site
from attnum import ncio, runs
from attnum.paths import notebooks_dir, params_dir

import robust_helpers as rh

STUDY = "length_scaling"
HELPER = Path(rh.__file__)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(papermill, "execute_notebook", rh.fake_execute)
    monkeypatch.setattr(runs.store, "_SWAP_HOOK", None)
    return rh.fake_execute


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A private project root (notebooks linked, params copied) for parameter files the tests break."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "notebooks").symlink_to(notebooks_dir())
    shutil.copytree(params_dir(), root / "params")
    monkeypatch.setenv("ATTNUM_ROOT", str(root))
    return root


def _value(folder: Path) -> float:
    return float(ncio.open_results(folder / "results.nc")["rel_l2_err"][0, 0])


_wait_for = rh.wait_for


# -- every kind of bad input is refused before any folder exists --

BIG_N = [128, 256, 65536]
BAD_INPUTS = [
    # (kind, study, overrides, message)
    ("nan", "wasserstein_weight_drift", {"confidence": float("nan")}, r"'confidence'.*not a finite number"),
    ("inf", "wasserstein_weight_drift", {"perturbation": float("inf")}, r"'perturbation'.*not a finite number"),
    ("nan in a list", "late_training_gradient_blowup", {"mu_norms": [0.0, float("nan")]}, r"'mu_norms'\[1\].*finite"),
    ("duplicate seeds", STUDY, {"seeds": [0, 0]}, r"'seeds': 0 appears twice"),
    ("duplicate seq_lens", STUDY, {"seq_lens": [64, 128, 128]}, r"'seq_lens': 128 appears twice"),
    ("huge N", STUDY, {"seq_lens": BIG_N}, r"estimated peak memory .* exceeds"),
    ("unknown kernel name", "late_training_gradient_blowup", {"train_attention": "emulator:fa9_bf16"},
     r"'train_attention'.*'emulator:fa9_bf16' is not a known kernel"),
    ("rule onset", "extreme_inputs", {"onset_logit_min": -49000.0, "onset_logit_max": -50000.0},
     r"must be below onset_logit_max.*onset_logit_min=-49000.0"),
    ("rule checkpoints", "late_training_gradient_blowup", {"checkpoint_steps": [0, 50]},
     r"checkpoint_steps must not go past the last step.*steps=40"),
    ("rule fixes", "gproj_fix", {"fixes": ["gproj_dq", "mean_key"]}, r"fixes must include 'none'"),
    ("rule heads", "wasserstein_weight_drift", {"n_head": 3}, r"d_model must be a multiple of n_head.*n_head=3"),
]


@pytest.fixture
def small_machine(monkeypatch):
    monkeypatch.setattr(runs.params, "machine_memory", lambda device="cpu": 8 * 2**30)
    monkeypatch.delenv(runs.params.ALLOW_LARGE_ENV, raising=False)


@pytest.mark.parametrize("kind,study,overrides,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_before_any_folder(outputs, fake, small_machine, kind, study, overrides, message):
    with pytest.raises(runs.ParameterError, match=message):
        runs.run(study, "smoke", overrides, progress=False)
    assert not outputs.exists()


def test_nan_from_the_command_line_is_refused(outputs):
    proc = subprocess.run([sys.executable, "-m", "attnum", "run", "wasserstein_weight_drift", "--params", "smoke",
                           "-p", "confidence", ".nan"], capture_output=True, text=True)
    assert proc.returncode == 2 and "not a finite number" in proc.stderr
    assert not outputs.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_a_device_that_is_not_there_is_refused(outputs, fake):
    with pytest.raises(runs.ParameterError, match=r"'device': 'cuda' .*no CUDA device"):
        runs.run(STUDY, "smoke", {"device": "cuda"}, progress=False)
    assert not outputs.exists()


def test_allow_large_passes_the_memory_check(outputs, fake, small_machine):
    assert runs.run(STUDY, "smoke", {"seq_lens": BIG_N}, progress=False, allow_large=True).exists()


def test_a_sweep_with_one_bad_point_runs_nothing(outputs, fake, small_machine):
    with pytest.raises(runs.ParameterError, match="estimated peak memory"):
        runs.sweep(STUDY, {"causal_seq_len": [64, 65536]}, "smoke")
    assert not outputs.exists()


def test_yaml_errors_name_the_file_and_line(project, outputs, tmp_path):
    bad = project / "params" / STUDY / "broken.yaml"
    bad.write_text("heads: 1\nseeds: [0, 1\nbatch: 1\n")
    with pytest.raises(runs.ParameterError, match=r"broken.yaml, line \d+"):
        runs.run(STUDY, "broken")
    dup = project / "params" / STUDY / "dup.yaml"
    dup.write_text("heads: 1\nbatch: 1\nheads: 2\n")
    with pytest.raises(runs.ParameterError, match=r"dup.yaml, line 3.*'heads' appears twice \(first on line 1\)"):
        runs.run(STUDY, "dup")
    grid = tmp_path / "grid.yaml"
    grid.write_text("head_dim: [32, 64]\nhead_dim: [16]\n")
    with pytest.raises(runs.ParameterError, match=r"grid.yaml, line 2.*appears twice"):
        runs.parse_grid(str(grid))
    grid.write_text("head_dim: [32, 64\n")
    with pytest.raises(runs.ParameterError, match=r"grid.yaml, line \d+"):
        runs.parse_grid(str(grid))
    with pytest.raises(runs.ParameterError, match="repeats the value 32"):
        runs.parse_grid("head_dim=32,32")
    with pytest.raises(runs.ParameterError, match="appears twice"):
        runs.parse_value("{a: 1, a: 2}")
    assert not outputs.exists()


# -- names: short, unique, and a single run never takes a sweep point's folder --

def test_long_overrides_get_a_short_unique_name(outputs, fake):
    seeds = list(range(100))
    name = runs.run_name("smoke", {"seeds": seeds})
    assert len(name) <= runs.plan.MAX_NAME and name != runs.run_name("smoke", {"seeds": seeds[:-1]})
    assert runs.run(STUDY, "smoke", {"seeds": seeds}, progress=False).name == name


def test_names_that_clean_to_the_same_text_stay_apart():
    a = runs.run_name("smoke", {"train_attention": "flash:fa2_bf16:fused"})
    b = runs.run_name("smoke", {"train_attention": "flash:fa2_bf16fused"})
    c = runs.run_name("smoke", {"train_attention": "flashfa2_bf16:fused"})
    assert len({a, b, c}) == 3
    assert runs.run_name("smoke", {"x": ["a,b"]}) != runs.run_name("smoke", {"x": ["a", "b"]})


def test_a_single_run_never_replaces_a_sweep_point(outputs, fake):
    point = runs.run(STUDY, "smoke", {"head_dim": 32}, sweep_dims=["head_dim"], progress=False)
    single = runs.run(STUDY, "smoke", {"head_dim": 32}, progress=False)
    assert point != single and "@" in point.name and "@" not in single.name
    assert point.exists() and single.exists()
    with pytest.raises(runs.ParameterError, match="marks sweep points"):
        runs.run(STUDY, "smoke", {"head_dim": 32}, name=point.name, progress=False)


# -- the swap: at every step the run folder is the old complete run or the new one --

@pytest.mark.parametrize("plain", [False, True], ids=["versioned", "plain-folder"])
@pytest.mark.parametrize("step", runs.store.SWAP_STEPS)
def test_interruption_at_each_step_of_the_swap(outputs, fake, monkeypatch, step, plain):
    final = outputs / STUDY / "smoke"
    if plain:  # like the committed outputs/length_scaling/gpu/: a plain folder in git
        final.parent.mkdir(parents=True)
        ncio.write_results(rh.dataset(0.001), final / "results.nc", study=STUDY, params={}, variables=rh.TABLE)
    else:
        monkeypatch.setenv("FAKE_VALUE", "0.001")
        runs.run(STUDY, "smoke", progress=False)
    assert _value(final) == 0.001
    monkeypatch.setenv("FAKE_VALUE", "0.002")

    def hook(at):
        if at == step:
            raise KeyboardInterrupt(f"killed at {step}")

    monkeypatch.setattr(runs.store, "_SWAP_HOOK", hook)
    with pytest.raises(KeyboardInterrupt):
        runs.run(STUDY, "smoke", progress=False)
    # the folder holds one complete run: the old before the pointer moved, the new after
    assert _value(final) == (0.001 if step in ("before-link", "link-created") else 0.002)
    if not plain or step not in ("before-link", "link-created"):
        ncio.verify_run(final, require_record=not plain or _value(final) == 0.002)
    # clean keeps what the pointer names, removes the rest; the next run goes through
    monkeypatch.setattr(runs.store, "_SWAP_HOOK", None)
    before = _value(final)
    runs.clean()
    assert _value(final) == before
    assert not list((outputs / STUDY).glob(".*.link-*"))
    monkeypatch.setenv("FAKE_VALUE", "0.003")
    runs.run(STUDY, "smoke", progress=False)
    assert _value(final) == 0.003
    assert len(list((outputs / STUDY / runs.store.VERSIONS / "smoke").iterdir())) == 1


def test_concurrent_runs_of_one_name_fail_clearly(outputs, tmp_path):
    started, release = tmp_path / "started", tmp_path / "release"
    env = dict(os.environ, FAKE_STARTED=str(started), FAKE_RELEASE=str(release))
    first = subprocess.Popen([sys.executable, str(HELPER), str(outputs), "{}"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(started, first)
        second = subprocess.run([sys.executable, str(HELPER), str(outputs), "{}"], capture_output=True, text=True,
                                env=dict(os.environ), timeout=300)
        assert second.returncode == 3, second.stderr
        assert "is already running (pid" in second.stderr and "length_scaling/smoke" in second.stderr
        release.write_text("go")
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    ncio.verify_run(outputs / STUDY / "smoke")
    with runs.store.run_lock(outputs / STUDY, "smoke"):  # released again
        pass


def test_sigterm_leaves_a_failure_record_and_the_earlier_results(outputs, tmp_path, monkeypatch, fake):
    monkeypatch.setenv("FAKE_VALUE", "0.001")
    runs.run(STUDY, "smoke", progress=False)
    proc = rh.sigterm_run(outputs, tmp_path, FAKE_VALUE="0.002")
    assert proc.returncode != 0
    failed = outputs / STUDY / "smoke.failed"
    record = json.loads((failed / "RUN.json").read_text())
    assert record["status"] == "interrupted" and "SIGTERM" in record["error"]
    assert "SIGTERM" in (failed / "FAILED").read_text()
    assert _value(outputs / STUDY / "smoke") == 0.001


def test_a_full_disk_still_leaves_the_first_record(outputs, fake, monkeypatch):
    real = ncio.write_record
    calls = []

    def full_disk(folder, record):
        calls.append(record["status"])
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(folder, record)

    monkeypatch.setattr(ncio, "write_record", full_disk)
    with pytest.raises(runs.RunError, match="No space left"):
        runs.run(STUDY, "smoke", progress=False)
    failed = outputs / STUDY / "smoke.failed"
    assert json.loads((failed / "RUN.json").read_text())["status"] == "running"  # written first, at start
    assert not (outputs / STUDY / "smoke").exists()


# -- clean never touches a live run --

def test_clean_keeps_live_runs_and_removes_dead_leftovers(outputs, fake, monkeypatch):
    final = runs.run(STUDY, "smoke", progress=False)
    versions = outputs / STUDY / runs.store.VERSIONS / "smoke"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live_dir, dead_dir, locked_dir = versions / "live", versions / "dead", outputs / STUDY / runs.store.VERSIONS / "other"
    for folder, pid in ((live_dir, os.getpid()), (dead_dir, int(dead))):
        folder.mkdir()
        ncio.write_record(folder, {"status": "running", "pid": pid, "host": os.uname().nodename})
    (locked_dir / "v1").mkdir(parents=True)
    legacy = outputs / STUDY / f".smoke.running-{dead}-1"
    legacy.mkdir()
    with runs.store.run_lock(outputs / STUDY, "other"):
        removed = runs.clean()
        assert (locked_dir / "v1").exists()  # its name is locked: a run is in progress
    assert live_dir.exists() and not dead_dir.exists() and not legacy.exists()
    assert str(dead_dir) in removed and final.exists()
    ncio.verify_run(final)


def test_clean_recovers_a_run_the_old_swap_left_without_a_folder(outputs):
    """A kill between the two renames of the old swap: the new results sat in .running-, the old in .old-."""
    study = outputs / STUDY
    new, old = study / ".smoke.running-999999999-1", study / ".smoke.old-999999999"
    for folder, value in ((new, 0.002), (old, 0.001)):
        ncio.write_results(rh.dataset(value), folder / "results.nc", study=STUDY, params={}, variables=rh.TABLE)
        ncio.write_record(folder, {"status": "ok", "results_sha256": ncio.file_sha256(folder / "results.nc")})
    runs.clean()
    assert _value(study / "smoke") == 0.002 and not new.exists() and not old.exists()


def test_make_clean_runs_the_python_clean(outputs):
    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    clean = text.split("\nclean:", 1)[1].split("\n\n", 1)[0]
    assert "-m attnum clean" in clean
    assert not [line for line in clean.splitlines() if "rm " in line and "outputs" in line]
    proc = subprocess.run([sys.executable, "-m", "attnum", "clean", "--outputs", str(outputs)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with runs.store.run_lock(outputs / STUDY, "smoke"):
        proc = subprocess.run([sys.executable, "-m", "attnum", "idle", "--outputs", str(outputs)],
                              capture_output=True, text=True)
        assert proc.returncode == 1 and f"{STUDY}/smoke" in proc.stderr


# -- integrity: checksums, damaged runs named and skipped --

def _runs(outputs, monkeypatch, *head_dims):
    monkeypatch.delenv("FAKE_VALUE", raising=False)
    return [runs.run(STUDY, "smoke", {"head_dim": d}, sweep_dims=["head_dim"], progress=False) for d in head_dims]


def test_every_variable_has_a_fletcher32_checksum_and_the_record_hashes(outputs, fake, monkeypatch):
    (run,) = _runs(outputs, monkeypatch, 32)
    with xr.open_dataset(run / "results.nc", engine="netcdf4") as ds:
        for name, var in ds.variables.items():
            if var.ndim:
                assert var.encoding.get("fletcher32") is True, name
    record = json.loads((run / "RUN.json").read_text())
    assert record["results_sha256"] == ncio.file_sha256(run / "results.nc")
    assert record["notebook_sha256"] == ncio.file_sha256(run / "notebook.ipynb")
    assert record["checksum"] == ncio.record_checksum(record)


@pytest.mark.parametrize("damage", ["truncated results", "truncated record", "altered record",
                                    "missing record", "flipped bit", "missing notebook"])
def test_damaged_runs_are_named_and_skipped(outputs, fake, monkeypatch, damage):
    good, bad = _runs(outputs, monkeypatch, 32, 64)
    results, record = bad / "results.nc", bad / "RUN.json"
    if damage == "truncated results":
        results.write_bytes(results.read_bytes()[: results.stat().st_size // 2])
    elif damage == "truncated record":
        record.write_text(record.read_text()[:40])
    elif damage == "altered record":
        record.write_text(record.read_text().replace('"head_dim": 64', '"head_dim": 65'))
    elif damage == "missing record":
        record.unlink()
    elif damage == "flipped bit":
        data = bytearray(results.read_bytes())
        data[len(data) // 2] ^= 0x10
        results.write_bytes(bytes(data))
    elif damage == "missing notebook":
        (bad / "notebook.ipynb").unlink()
    with pytest.raises(ncio.DamagedRunError, match=bad.name):
        ncio.verify_run(bad)
    with pytest.warns(ncio.DamagedRunWarning, match=bad.name):  # a run without its record is damaged too
        merged = ncio.open_study(STUDY)
    assert merged["head_dim"].values.tolist() == [32] and bad.name in json.loads(merged.attrs["skipped_runs"])
    # publish goes on with the rest, names the damaged run, and fails at the end
    with pytest.raises(attnum.site.PublishError, match=bad.name):
        attnum.site.publish()
    index = (outputs / "site" / "index.html").read_text()
    assert good.name in index and "DAMAGED" in index
    assert (outputs / "site" / STUDY / good.name / "results.nc").exists()
    proc = subprocess.run([sys.executable, "-m", "attnum", "publish", "--outputs", str(outputs)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and bad.name in proc.stderr


def test_single_bit_flips_never_change_values_silently(outputs, fake, monkeypatch):
    """Every flip is caught by the sha256 of RUN.json; read without a record, Fletcher-32 stops any flip
    in the data from reaching a value (flips in metadata may pass it: the sha256 is the whole-file check)."""
    (run,) = _runs(outputs, monkeypatch, 32)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("measure_corruption.py")), str(run),
                           "120"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["sha256_detected"] == counts["flips"]
    assert counts["silent_value_changes"] == 0, counts


def test_publish_refuses_a_missing_outputs_folder_and_runs_one_at_a_time(tmp_path, outputs, fake, monkeypatch):
    with pytest.raises(attnum.site.PublishError, match="does not exist"):
        attnum.site.publish(tmp_path / "typo")
    assert not (tmp_path / "typo").exists()
    proc = subprocess.run([sys.executable, "-m", "attnum", "publish", "--outputs", str(tmp_path / "typo")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "does not exist" in proc.stderr
    _runs(outputs, monkeypatch, 32)
    with open(outputs / attnum.site.LOCK, "a+") as fh:  # a publish in progress holds the lock
        import fcntl

        fcntl.flock(fh, fcntl.LOCK_EX)
        assert attnum.site.publish_lock_held(outputs)
        runs.clean()
        assert attnum.site.publish_lock_held(outputs)
    index = attnum.site.publish()
    assert index.exists() and not list(outputs.glob(".site.building*"))


# -- what the files say --

def test_parameters_record_the_run_folder_not_the_staging_path(outputs, fake, monkeypatch):
    a = runs.run(STUDY, "smoke", progress=False)
    params_a = json.loads(ncio.open_results(a / "results.nc").attrs["parameters"])
    monkeypatch.setattr(runs.store, "_SWAP_HOOK", None)
    runs.run(STUDY, "smoke", progress=False)
    params_b = json.loads(ncio.open_results(a / "results.nc").attrs["parameters"])
    assert params_a["output_dir"] == f"{STUDY}/smoke" and params_a == params_b
    assert ".versions" not in json.dumps(params_a)


def test_open_study_groups_runs_and_keeps_each_runs_parameters(outputs, fake, monkeypatch):
    default = runs.run(STUDY, "smoke", name="default", progress=False)
    gpu = outputs / STUDY / "gpu"  # a plain folder, like the committed GPU run: other coordinates
    ds = rh.dataset(0.5).assign_coords(seq_len=[1024, 2048, 4096])
    ncio.write_results(ds, gpu / "results.nc", study=STUDY, params={"device": "cuda"}, variables=rh.TABLE)
    ncio.write_record(gpu, {"status": "ok", "sweep_dims": []})
    points = _runs(outputs, monkeypatch, 32, 64)
    groups = ncio.study_groups(STUDY)
    assert groups == {"default": ["default"], "gpu": ["gpu"], "smoke@head_dim": [p.name for p in points]}
    merged = ncio.open_study(STUDY)
    assert merged.attrs["group"] == "default" and json.loads(merged.attrs["runs"]) == ["default"]
    assert json.loads(merged.attrs["parameters"])["output_dir"] == f"{STUDY}/default"
    sweep = ncio.open_study(STUDY, group="smoke@head_dim")
    assert sweep.sizes["head_dim"] == 2
    per_run = [json.loads(str(v)) for v in sweep["run_parameters"].values]
    assert [p["head_dim"] for p in per_run] == [32, 64]
    shutil.rmtree(default.resolve()), default.unlink()
    with pytest.raises(ValueError, match="groups of runs that do not belong together"):
        ncio.open_study(STUDY)


def test_a_lab_run_gets_its_own_new_folder(outputs):
    namespace = dict(runs.notebook_defaults("length_scaling"), output_dir="", sweep_dims=[])
    params, out = runs.start(STUDY, namespace)
    params2, out2 = runs.start(STUDY, namespace)
    assert out != out2 and out.name.startswith("lab-") and out.parent == outputs / STUDY
    assert params["output_dir"] == f"{STUDY}/{out.name}"
    assert json.loads((out / "RUN.json").read_text())["status"] == "lab"
    ncio.write_results(rh.dataset(1.0), out / "results.nc", study=STUDY, params=params, variables=rh.TABLE)
    assert ncio.verify_run(out)["verified"]
    assert ncio.study_groups(STUDY) == {out.name: [out.name]}
    with pytest.raises(runs.ParameterError, match="appears twice"):
        runs.start(STUDY, dict(namespace, seeds=[0, 0]))
    assert len(list((outputs / STUDY).glob("lab-*"))) == 2


# -- CF compliance --

def _cf_problems(path: Path) -> list[str]:
    checker = Path(sys.executable).with_name("cchecker.py")
    report = path.with_suffix(".cf.json")
    subprocess.run([str(checker), "--test", ncio.CONVENTIONS.replace("CF-", "cf:"), "-f", "json", "-o",
                    str(report), str(path)], capture_output=True, text=True, timeout=300)
    result = json.loads(report.read_text())[ncio.CONVENTIONS.replace("CF-", "cf:")]
    return [f"{e['name']}: {e['msgs']}" for level in ("high_priorities", "medium_priorities")
            for e in result[level] if e["value"][0] < e["value"][1]]


def test_the_writer_makes_cf_compliant_files(tmp_path):
    pytest.importorskip("compliance_checker")
    ds = rh.dataset(1.0)
    ds["rate"] = ("seq_len", np.ones(3))
    ds["flops"] = ("seq_len", np.arange(3, dtype=np.int64))
    ds["passed"] = ("seed", np.array([True, False]))
    table = dict(rh.TABLE, rate=("1/step", "growth per step"), flops=("FLOP", "work"), passed=("1", "passed"))
    path = ncio.write_results(ds, tmp_path / "results.nc", study=STUDY, params={"head_dim": 32},
                              sweep_dims=["head_dim"], variables=table)
    assert _cf_problems(path) == []
    back = ncio.open_results(path)
    assert back["max_ulp_err"].attrs["units"] == "1" and "ulp" in back["max_ulp_err"].attrs["long_name"]
    assert back["seed"].attrs["long_name"] == "random seed"


@pytest.mark.slow
def test_a_smoke_run_passes_the_cf_checker(outputs):
    pytest.importorskip("compliance_checker")
    run = runs.run(STUDY, "smoke", {"seq_lens": [32, 64, 128], "attribution_seq_lens": [64],
                                      "block_configs": ["16x16"], "dtypes": ["bf16"], "loop_orders": ["q_outer"]},
                     progress=False)
    assert _cf_problems(run / "results.nc") == []
    params = json.loads(ncio.open_results(run / "results.nc").attrs["parameters"])
    assert params["output_dir"] == f"{STUDY}/{run.name}"
