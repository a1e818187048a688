"""Study 03 end to end: the smoke tier through the runner; and the study's helpers on small inputs."""
import json
import math

import numpy as np
import pytest

import attnum.runs.params  # noqa: F401  (runs.params below)
import xarray as xr
from scipy import stats as sps

from attnum import drift, glue, ncio, paths, runs
from attnum.model import GPT, GPTConfig
from attnum.studies import wasserstein_weight_drift as study
from attnum.studies.wasserstein_weight_drift import aggregates, experiments, readings
from attnum.train import Task

STUDY = "wasserstein_weight_drift"
POLICY = dict(kernel_policy="fa2_bf16", perturbation=1e-6, noise_seed_offset=1000)  # the parameters cell's


@pytest.mark.slow
def test_smoke_run_writes_results_with_dims_pair_step_tensor(smoke_run):
    path = smoke_run
    assert json.loads((path / "RUN.json").read_text())["status"] == "ok"
    # every key the committed notebook's markdown refers to is glued by its code cells on this tier, the
    # sources' numbers as the constants the figures and verdicts use
    executed = json.loads((path / "notebook.ipynb").read_text())
    committed = json.loads((paths.project_root() / "notebooks/03_wasserstein_weight_drift.ipynb").read_text())
    assert glue.referenced_keys(committed) <= glue.glued_keys(executed)
    glued = glue.read_glued(executed)
    sources = {f"s03_{k}": v for k, v in readings.source_values().items()}
    assert {k: glued[k] for k in sources} == sources
    assert (glued["s03_golden_ratio_low"], glued["s03_golden_ratio_high"]) == study.GOLDEN_RATIO_RANGE == (2.0, 5.0)
    assert {"drift_over_training.png", "training_loss.png", "drift_rates.png", "drift_ratios.png",
            "drift_by_group.png", "drift_vs_attention.png"} <= {p.name for p in path.glob("*.png")}
    ds = ncio.open_results(path / "results.nc")
    params = runs.load_param_set(STUDY, "smoke")
    for metric in ("wasserstein", "max_abs", "rel_l2"):
        assert ds[metric].dims == ("pair", "seed", "step", "tensor")
        assert ds[f"kind_{metric}"].dims == ("pair", "seed", "step", "kind")
        assert ds[f"layer_{metric}"].dims == ("pair", "seed", "step", "layer")
        assert ds[f"model_{metric}"].dims == ("pair", "seed", "step")
    assert ds["pair"].values.tolist() == params["pairs"]
    assert ds["seed"].values.tolist() == params["seeds"]
    assert ds["step"].values.tolist() == list(range(0, params["steps"] + 1, params["checkpoint_every"]))
    task = Task(params["task"], context=params["context"], n_symbols=params["n_symbols"])
    model = GPT(GPTConfig(vocab_size=task.vocab_size, context=params["context"], n_layer=params["n_layer"],
                          n_head=params["n_head"], d_model=params["d_model"]))
    state = model.state_dict()
    assert ds["tensor"].values.tolist() == list(state)
    assert ds["tensor_numel"].values.tolist() == [t.numel() for t in state.values()]
    assert set(ds["tensor_kind"].values) == set(drift.KINDS) == set(ds["kind"].values)
    assert ds["layer"].values.tolist() == list(range(params["n_layer"]))
    assert ds["train_loss"].dims == ("run", "seed", "train_step")
    assert ds["train_max_logit"].dims == ("run", "seed", "train_step", "layer")
    assert len(ds["run"]) == 11  # shared runs trained once per seed (flash_bf16 is the flash pair's runs)
    assert ds["drift_ratio"].dims == ("comparison", "metric", "step")
    assert {"bf16_training/flash", "fp16_training/flash", "flash/init_seed", "bf16_training/flash_bf16",
            "fp16_training/flash_fp16"} <= set(ds["comparison"].values)
    # the matched bf16 pair is the flash pair itself under fa2_bf16: the same drift, bit for bit
    for metric in ("wasserstein", "max_abs", "rel_l2"):
        np.testing.assert_array_equal(ds[metric].sel(pair="flash").values, ds[metric].sel(pair="flash_bf16").values)
    # Golden et al.'s per-call comparison: every flash pair, seed, checkpoint and layer
    assert ds["call_max_abs"].dims == ("call_pair", "seed", "step", "layer")
    assert ds["call_pair"].values.tolist() == ["flash", "flash_fp32", "flash_bf16", "flash_fp16"]
    assert ds["call_run"].values.tolist() == ["flash_fa2_bf16", "flash_fp32", "flash_fa2_bf16", "flash_fa2_fp16"]
    calls = ds["call_max_abs"]
    assert (calls > 0).all() and bool(calls.notnull().all())
    # fp32 kernels differ far less per call than bf16 ones; fp16 (10 significand bits) less than bf16 (7)
    assert float(calls.sel(call_pair="flash_fp32").max()) < 1e-3 * float(calls.sel(call_pair="flash").min())
    assert float(calls.sel(call_pair="flash_fp16").median()) < float(calls.sel(call_pair="flash").median())
    summary = readings.call_summary(ds)
    assert summary["same_run_as"].tolist() == ["flash", "flash_fp32", "flash", "flash_fp16"]  # flash_bf16 is flash's run
    dev = ds["call_max_abs"].sel(call_pair="flash_fp32").mean("layer").median("seed")
    assert summary.loc["flash_fp32", "max_abs_last"] == pytest.approx(float(dev.isel(step=-1)))
    assert summary.loc["flash_fp32", "non_decreasing"] == bool((dev.diff("step") >= 0).all())
    ranges = readings.matched_ranges(ds)
    assert ranges.loc[("bf16_training/flash_bf16", "wasserstein"), "matched_is_flash"]  # under fa2_bf16
    assert not ranges.loc[("fp16_training/flash_fp16", "wasserstein"), "matched_is_flash"]
    r = ds["drift_ratio"].sel(comparison="fp16_training/flash_fp16", metric="rel_l2")
    assert ranges.loc[("fp16_training/flash_fp16", "rel_l2"), "max"] == pytest.approx(float(r.isel(step=slice(1, None)).max()))
    contrast = readings.precision_contrast(ds)
    assert list(contrast.index) == ["flash_fp32", "flash_fp16"] and (contrast["per_call"] > 1).all()
    values = readings.prose_values(ds)
    assert values["repeat_zero"] == "yes" and values["n_runs"] == 11 and values["n_seeds"] == 2 and values["dof"] == 1
    assert values["n_params"] == sum(t.numel() for t in state.values())
    assert "per_call.png" in {p.name for p in path.glob("*.png")}
    assert ds.attrs["headline_figure"] == "drift_over_training.png" and ds.attrs["study"] == STUDY
    for name, var in ds.data_vars.items():
        # CF: every variable has a long_name; numbers have units, strings none
        assert var.attrs.get("long_name") and (var.attrs.get("units") or var.dtype.kind in "OUS"), name
    # what must hold on any tier
    for metric in ("wasserstein", "max_abs", "rel_l2"):
        assert (ds[metric].sel(pair="repeat") == 0).all()  # same configuration: bitwise the same weights
        start = ds[metric].sel(step=0).drop_sel(pair=["init_seed", "init_perturbation"])
        assert (start == 0).all()  # every other pair starts from the same weights
        last = ds[f"model_{metric}"].isel(step=-1).drop_sel(pair="repeat")
        assert (last > 0).all()
    assert 0 < float(ds["max_abs"].sel(pair="init_perturbation", step=0).max()) < 1e-5
    low, mid, high = (ds[name].values for name in ("drift_ratio_low", "drift_ratio", "drift_ratio_high"))
    ok = np.isfinite(low)
    assert ok.any() and np.isnan(mid[..., 0]).all()  # step 0: the flash pairs have not drifted, no ratio is defined
    assert (low[ok] <= mid[ok] * (1 + 1e-12)).all() and (mid[ok] <= high[ok] * (1 + 1e-12)).all()


# -- helpers --------------------------------------------------------------------------------------

def test_runs_are_shared_between_pairs():
    assert len(experiments.runs_needed(list(study.PAIRS), **POLICY)) == 11
    assert experiments.runs_needed(["flash", "flash_bf16"], **POLICY) == ["reference_fa2_bf16", "flash_fa2_bf16"]
    assert experiments.runs_needed(["flash_fp16"], **POLICY) == ["reference_fa2_fp16", "flash_fa2_fp16"]
    assert ("fp16_training", "flash_fp16") in aggregates.comparisons(["flash", "flash_fp16", "fp16_training"])
    assert ("fp16_training", "flash_fp16") not in aggregates.comparisons(["flash", "fp16_training"])
    assert experiments.runs_needed(["flash"], **POLICY) == ["reference_fa2_bf16", "flash_fa2_bf16"]
    assert experiments.runs_needed(["init_seed", "bf16_training", "repeat"], **POLICY) == [
        "reference_fp32", "reference_fp32_other_seed", "bf16_training", "reference_fp32_repeat"]
    specs = experiments.run_specs(**POLICY)
    assert set(experiments.runs_needed(list(study.PAIRS), **POLICY)) <= set(specs)
    assert specs["reference_fp32_repeat"] != specs["reference_fp32"]  # trained again, not reused
    assert specs["fp16_training"].autocast == "fp16" and specs["reference_fp32_perturbed"].perturbation == 1e-6
    with pytest.raises(ValueError, match="unknown pair"):
        experiments.runs_needed(["flash", "fp8_training"], **POLICY)


def test_ratio_interval_is_a_t_interval_on_log_ratios():
    centre, low, high = aggregates.ratio_interval([2.0, 8.0], confidence=0.95)
    assert centre == pytest.approx(4.0)
    half = sps.t.ppf(0.975, 1) * np.std(np.log([2.0, 8.0]), ddof=1) / math.sqrt(2)
    assert low == pytest.approx(4.0 * math.exp(-half)) and high == pytest.approx(4.0 * math.exp(half))
    assert aggregates.ratio_interval([3.0, 3.0, 3.0], 0.95) == pytest.approx((3.0, 3.0, 3.0))
    centre, low, high = aggregates.ratio_interval([5.0, np.nan, 0.0], 0.95)  # one usable ratio: no interval
    assert centre == pytest.approx(5.0) and math.isnan(low) and math.isnan(high)
    assert all(math.isnan(v) for v in aggregates.ratio_interval([np.nan, np.nan], 0.95))


def _ratios(per_seed, steps=(0, 10, 20, 30)):
    """A drift_ratios-like dataset for one comparison and metric from per-seed ratios (seed, step)."""
    per_seed = np.asarray(per_seed, dtype=float)
    summary = np.array([aggregates.ratio_interval(per_seed[:, j], 0.95) for j in range(per_seed.shape[1])]).T
    coords = {"comparison": ["flash/init_seed"], "metric": ["wasserstein"], "step": list(steps),
              "seed": list(range(per_seed.shape[0]))}
    dims = ("comparison", "metric", "step")
    return xr.Dataset({"drift_ratio": (dims, summary[None, None, 0]), "drift_ratio_low": (dims, summary[None, None, 1]),
                       "drift_ratio_high": (dims, summary[None, None, 2]),
                       "drift_ratio_per_seed": (("comparison", "metric", "seed", "step"), per_seed[None, None])},
                      coords=coords)


def test_first_step_above_needs_the_ratio_to_stay_above_one():
    ds = _ratios([[np.nan, 0.5, 2.0, 3.0], [np.nan, 0.6, 2.2, 3.3], [np.nan, 0.4, 1.9, 2.8]])
    assert readings.first_step_above(ds, "flash/init_seed", rule="all_seeds") == 20
    assert readings.first_step_above(ds, "flash/init_seed", rule="ci") == 20
    ds = _ratios([[np.nan, 2.0, 0.5, 3.0], [np.nan, 2.0, 0.5, 3.0], [np.nan, 2.0, 0.5, 3.0]])
    assert readings.first_step_above(ds, "flash/init_seed", rule="all_seeds") == 30  # dipped below at 20
    ds = _ratios([[np.nan, 2.0, 3.0, 0.9], [np.nan, 2.0, 3.0, 3.0], [np.nan, 2.0, 3.0, 3.0]])
    assert math.isnan(readings.first_step_above(ds, "flash/init_seed", rule="all_seeds"))
    with pytest.raises(ValueError, match="rule"):
        readings.first_step_above(ds, "flash/init_seed", rule="median")


def test_verdict_places_an_interval_against_the_claim():
    assert readings.verdict(2.5, 4.0) == "inside"
    assert readings.verdict(1.0, 3.0) == "overlaps"
    assert readings.verdict(0.5, 1.5) == "below"
    assert readings.verdict(6.0, 9.0) == "above"
    assert readings.verdict(math.nan, math.nan) == "n/a"
    assert [readings.place(v) for v in (1.9, 2.0, 5.0, 5.1, math.nan)] == ["below", "inside", "inside", "above", "n/a"]


def test_tables_and_values_of_a_run_without_cpu_drift_are_empty_or_missing():
    assert readings.ratio_table(None).empty and readings.call_summary(None).empty and readings.checks(None) == {}
    assert readings.matched_ranges(None).empty and readings.precision_contrast(None).empty
    values = readings.prose_values(None)
    assert math.isnan(values["n_params"]) and math.isnan(values["call_flash_max_abs_last"])
    assert values["bf16_training_matched_is_flash"] == "n/a"
    size = readings.run_size(None, dict(n_layer=2, d_model=16, steps=20, batch_size=4, context=16,
                                        perturbation=1e-6, kernel_policy="fa2_bf16"))
    assert math.isnan(size["tokens_per_run"]) and size["kernel_policy"] == "n/a"


def test_drift_rate_and_rank_correlation():
    da = xr.DataArray([0.0, 1.0, 4.0, 3.0], coords={"step": [0, 10, 20, 40]}, dims="step")
    rate = aggregates.drift_rate(da)
    assert np.isnan(rate.values[0]) and rate.values[1:].tolist() == pytest.approx([0.1, 0.3, -0.05])
    assert aggregates._spearman([1.0, 2.0], [5.0, 3.0]) == pytest.approx(-1.0)  # two layers: sign agreement
    assert aggregates._spearman([1.0, 2.0, 3.0, 4.0], [1.0, 4.0, 9.0, 16.0]) == pytest.approx(1.0)
    assert math.isnan(aggregates._spearman([1.0, 1.0], [2.0, 3.0]))


def test_drift_ratios_pair_seeds_and_skip_zero_denominators():
    steps, seeds = [0, 10], [0, 1]
    values = {"flash": [[0.0, 1.0], [0.0, 2.0]], "bf16_training": [[0.0, 4.0], [0.0, 2.0]],
              "init_seed": [[1.0, 4.0], [1.0, 8.0]]}
    ds = xr.Dataset(coords={"pair": list(values), "seed": seeds, "step": steps})
    for metric in study.DRIFT_METRICS:
        ds[f"model_{metric}"] = (("pair", "seed", "step"), np.array(list(values.values())))
    out = aggregates.drift_ratios(ds, confidence=0.95)
    assert out["comparison"].values.tolist() == ["bf16_training/flash", "flash/init_seed"]
    per_seed = out["drift_ratio_per_seed"].sel(comparison="bf16_training/flash", metric="wasserstein")
    assert np.isnan(per_seed.sel(step=0)).all() and per_seed.sel(step=10).values.tolist() == [4.0, 1.0]
    assert float(out["drift_ratio"].sel(comparison="bf16_training/flash", metric="rel_l2", step=10)) == pytest.approx(2.0)
    assert float(out["drift_ratio"].sel(comparison="flash/init_seed", metric="max_abs", step=10)) == pytest.approx(0.25)


def test_the_package_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; import attnum.studies.wasserstein_weight_drift as s; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(s.STUDY)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# -- values for the prose ------------------------------------------------------------------------

def _model_drift(values, steps=(0, 10, 20)):
    ds = xr.Dataset(coords={"pair": list(values), "seed": [0, 1], "step": list(steps)})
    for metric in study.DRIFT_METRICS:
        ds[f"model_{metric}"] = (("pair", "seed", "step"), np.array(list(values.values()), dtype=float))
    return xr.merge([ds, aggregates.drift_ratios(ds, confidence=0.95)])


def test_noise_floor_exceedances_and_ratio_extremes_are_read_from_the_drift():
    ds = _model_drift({"repeat": [[0, 0, 0], [0, 0, 0]], "flash": [[0, 1, 2], [0, 1, 2]],
                       "init_seed": [[1, 4, 8], [1, 4, 3]], "bf16_training": [[0, 2, 8], [0, 2, 6]]})
    ex = readings.noise_floor_exceedances(ds, "wasserstein")
    assert ex[["pair", "seed", "step"]].values.tolist() == [["bf16_training", 0, 20], ["bf16_training", 1, 20]]
    ext = readings.ratio_extremes(ds, "bf16_training/flash", "wasserstein")
    assert ext["min"] == pytest.approx(2.0) and ext["max"] == pytest.approx(math.sqrt(4 * 3)) and ext["max_step"] == 20
    assert math.isnan(readings.ratio_extremes(ds, "fp16_training/flash", "wasserstein")["max"])
    values = readings.prose_values(ds)
    assert values["floor_largest_wasserstein"] == "no" and values["floor_exceeded_n_wasserstein"] == 2
    assert math.isnan(values["n_params"]) and math.isnan(values["grows_wasserstein"])  # no per-tensor drift here
    assert values["floor_exceeded_first_wasserstein"] == 20 and values["floor_exceeded_seeds_wasserstein"] == "0, 1"
    assert values["bf16_training_over_flash_wasserstein_max"] == pytest.approx(math.sqrt(12))
    assert values["flash_over_init_seed_max"] == pytest.approx(math.sqrt(0.25 * 2 / 3))
    assert values["flash_over_init_seed_first_max"] == pytest.approx(0.25)
    assert math.isnan(values["flash_over_init_perturbation_last_min"])  # no chaos-baseline pair
    assert math.isnan(readings.prose_values(None)["floor_exceeded_n_rel_l2"])


def test_source_values_are_golden_et_als_numbers_and_the_notebook_states_them():
    values = readings.source_values()
    assert values["golden_range"] == "2–5x" and values["golden_flash_over_baseline"] == study.GOLDEN_FLASH_OVER_BASELINE
    assert values["fp16_extra_bits"] == 3  # 11 significand bits against 8
    committed = json.loads((paths.project_root() / "notebooks/03_wasserstein_weight_drift.ipynb").read_text())
    assert {f"s03_{k}" for k in ("golden_range", "golden_flash_over_baseline", "fp16_extra_bits")} <= \
        glue.referenced_keys(committed)
    low, high = study.GOLDEN_RATIO_RANGE  # the verdicts place an interval against the same constant
    assert readings.verdict(low, high) == "inside" and readings.verdict(high * 1.01, high * 2) == "above"
