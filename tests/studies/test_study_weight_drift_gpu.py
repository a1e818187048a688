"""Study 03's gpu_training tier on tiny CPU records made with attnum.train.train_corpus: the gathered dataset,
the values read from it, the early error for a folder without records, and one runner (papermill) run of
the notebook on those records."""
import json
import math

import numpy as np
import pytest
import xarray as xr

from attnum import ncio
from attnum.train import record
from attnum.train import train as _train
from attnum.studies.wasserstein_weight_drift import aggregates, experiments, figures, readings, readings_gpu


def train(cfg, out_dir, progress=None):  # a corpus run: its record's path
    return _train(cfg, out_dir=out_dir, progress=False).path

RUNS = {
    "s03_flash_vs_fp32_s0": dict(pair=True, pair_kernel="sdpa:math"),
    "s03_flash_vs_fp32_s1": dict(pair=True, pair_kernel="sdpa:math", seed=1, data_seed=1),
    "s03_noise_floor_s0": dict(pair=True, pair_seed=1),
    "s03_repeat_s0": dict(pair=True),
    "s03_lowprec_s0": dict(pair=True, kernel="sdpa:math", autocast="off", pair_kernel="sdpa:flash", pair_autocast="bf16",
                           steps=15, snapshot_every=5),
}


def _gathered(folder):
    return experiments.gpu_training_dataset(folder, confidence=0.95)

# -- the early error ---------------------------------------------------------------------------------

def test_a_folder_without_records_fails_at_once_naming_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        experiments.check_gpu_records(tmp_path / "nope")
    for name in record.campaign_runs("s03_"):
        assert name in str(err.value)
    (tmp_path / "other.nc").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no records lm_s03_\*\.nc") as err:
        experiments.check_gpu_records(tmp_path)
    assert "other.nc" in str(err.value) and "s03_flash" in str(err.value)
    with pytest.raises(FileNotFoundError):
        _gathered(tmp_path)


def test_the_study_takes_only_its_own_records(records, tmp_path, tiny_corpus_config):
    import shutil

    for path in records.glob("lm_s03_*.nc"):
        shutil.copy(path, tmp_path / path.name)
    train(tiny_corpus_config(tag="s04_flash_lr1e-3", kernel="sdpa:flash", steps=10), tmp_path, progress=lambda s: None)
    ds = _gathered(tmp_path)
    assert all(str(r).startswith("lm_s03_") for r in ds["run"].values) and ds.sizes["run"] == len(RUNS)

# -- study 03 ------------------------------------------------------------------------------------------

def test_study03_classifies_pairs_and_measures_their_drift(records):
    ds = _gathered(records)
    comp = dict(zip(ds["run"].values, ds["gpu_comparison_of_run"].values))
    assert comp == {"lm_s03_flash_vs_fp32_s0_s0_d0": "flash_vs_fp32", "lm_s03_flash_vs_fp32_s1_s1_d1": "flash_vs_fp32",
                    "lm_s03_noise_floor_s0_s0_d0": "noise_floor", "lm_s03_repeat_s0_s0_d0": "gpu_repeat",
                    "lm_s03_lowprec_s0_s0_d0": "bf16_training"}
    assert list(ds["snapshot"].values) == [0, 5, 10, 15, 20, 30]  # the union of the pairs' snapshots
    # on the CPU the repeat pair is bitwise identical; the others drift
    rep = ds["gpu_model_wasserstein"].sel(run="lm_s03_repeat_s0_s0_d0")
    assert float(rep.max()) == 0.0
    last = ds["gpu_model_wasserstein"].sel(snapshot=30)
    assert float(last.sel(run="lm_s03_noise_floor_s0_s0_d0")) > float(last.sel(run="lm_s03_flash_vs_fp32_s0_s0_d0")) > 0
    # the model-level W1 is the element-weighted mean of the record's own exact per-tensor W1
    run = ds.sel(run="lm_s03_flash_vs_fp32_s0_s0_d0", snapshot=30)
    numel = run["tensor_numel"].values.astype(float)
    assert float(run["gpu_model_wasserstein"]) == pytest.approx(float((run["pair_w1"].values * numel).sum() / numel.sum()))
    assert set(ds["kind"].values) == {"embedding", "attention", "mlp", "norm", "head"}
    # two flash seeds: a geometric mean inside its interval; one noise-floor seed: no interval
    flash = ds.sel(gpu_comparison="flash_vs_fp32", gpu_metric="wasserstein", snapshot=30)
    a, b = last.sel(run=["lm_s03_flash_vs_fp32_s0_s0_d0", "lm_s03_flash_vs_fp32_s1_s1_d1"]).values
    assert float(flash["gpu_drift"]) == pytest.approx(math.sqrt(a * b))
    assert float(flash["gpu_drift_low"]) < float(flash["gpu_drift"]) < float(flash["gpu_drift_high"])
    assert int(flash["gpu_n_seeds"]) == 2
    assert np.isnan(float(ds["gpu_drift_low"].sel(gpu_comparison="noise_floor", gpu_metric="wasserstein",
                                                  snapshot=30)))


def test_study03_ratio_interpolates_the_flash_drift_and_is_stated_against_golden(records):
    ds = _gathered(records)
    ratio = ds["gpu_ratio"].sel(gpu_lowprec="bf16_training", gpu_metric="wasserstein")
    flash = ds["gpu_drift"].sel(gpu_comparison="flash_vs_fp32", gpu_metric="wasserstein")
    low = ds["gpu_model_wasserstein"].sel(run="lm_s03_lowprec_s0_s0_d0")
    # step 10: both pairs have a snapshot; step 15: the flash drift interpolated between 10 and 20
    assert float(ratio.sel(snapshot=10)) == pytest.approx(float(low.sel(snapshot=10) / flash.sel(snapshot=10)))
    mid = 0.5 * (float(flash.sel(snapshot=10)) + float(flash.sel(snapshot=20)))
    assert float(ratio.sel(snapshot=15)) == pytest.approx(float(low.sel(snapshot=15)) / mid)
    assert np.isnan(float(ratio.sel(snapshot=5)))  # before the flash pair's first snapshot > 0
    table = readings_gpu.gpu_golden_table(ds)
    row = table.loc[("bf16_training", "wasserstein")]
    # one low-precision seed: no interval; the point value at its last snapshot, placed against 2-5x
    assert row["seeds"] == 1 and row["step"] == 15 and math.isnan(row["ci low"])
    assert row["ratio"] == pytest.approx(float(ratio.sel(snapshot=15)))
    r = float(ratio.sel(snapshot=15))
    assert row["against Golden et al."] == ("below" if r < 2 else "above" if r > 5 else "inside")
    values = readings_gpu.gpu_prose_values(ds)
    assert values["golden_bf16_training_wasserstein_ratio"] == pytest.approx(r)
    floor = readings_gpu.gpu_ratio_series(ds, "flash_vs_fp32", "noise_floor")
    assert values["flash_over_floor_n"] == len(floor) and values["flash_below_floor_n"] == int((floor < 1).sum())


def test_study03_golden_ratio_is_stated_where_two_low_precision_seeds_give_an_interval(records, tmp_path, tiny_corpus_config):
    import shutil

    for path in records.glob("lm_*.nc"):
        shutil.copy(path, tmp_path / path.name)
    # a second low-precision seed that stops earlier (step 10) than the first (step 15)
    train(tiny_corpus_config(tag="s03_lowprec_s1", pair=True, kernel="sdpa:math", autocast="off", pair_kernel="sdpa:flash",
                pair_autocast="bf16", seed=1, data_seed=1, steps=10, snapshot_every=5), tmp_path, progress=lambda s: None)
    ds = _gathered(tmp_path)
    ratio = ds.sel(gpu_lowprec="bf16_training", gpu_metric="wasserstein")
    assert np.isfinite(float(ratio["gpu_ratio_low"].sel(snapshot=10)))
    assert np.isnan(float(ratio["gpu_ratio_low"].sel(snapshot=15)))  # one seed there
    row = readings_gpu.gpu_golden_table(ds).loc[("bf16_training", "wasserstein")]
    assert row["step"] == 10 and row["seeds"] == 2 and row["ratio"] == pytest.approx(float(ratio["gpu_ratio"].sel(snapshot=10)))
    assert row["ci low"] == pytest.approx(float(ratio["gpu_ratio_low"].sel(snapshot=10)))
    assert row["against Golden et al."] == readings.verdict(row["ci low"], row["ci high"])
    assert row["last step"] == 15 and row["ratio at last step"] == pytest.approx(float(ratio["gpu_ratio"].sel(snapshot=15)))
    # paired by seed: each low-precision record over the flash record of its own seeds (s0 and s1 both have one)
    model = ds["gpu_model_wasserstein"]
    per_seed = [float(model.sel(run=f"lm_s03_lowprec_s{k}_s{k}_d{k}", snapshot=10)
                      / model.sel(run=f"lm_s03_flash_vs_fp32_s{k}_s{k}_d{k}", snapshot=10)) for k in (0, 1)]
    assert float(ratio["gpu_ratio_paired"].sel(snapshot=10)) == pytest.approx(math.sqrt(per_seed[0] * per_seed[1]))
    assert int(ratio["gpu_ratio_paired_n_seeds"].sel(snapshot=10)) == 2
    assert np.isfinite(float(ratio["gpu_ratio_paired_low"].sel(snapshot=10)))
    assert row["paired step"] == 10 and row["paired seeds"] == 2
    assert row["paired ratio"] == pytest.approx(math.sqrt(per_seed[0] * per_seed[1]))
    # a third seed that runs as far as the first: step 15 now has two seeds (an interval) and step 10 three;
    # the sentence stays at the snapshot with the most seeds, and names how many it has
    train(tiny_corpus_config(tag="s03_lowprec_s2", pair=True, kernel="sdpa:math", autocast="off", pair_kernel="sdpa:flash",
                pair_autocast="bf16", seed=2, data_seed=2, steps=15, snapshot_every=5), tmp_path, progress=lambda s: None)
    ds = _gathered(tmp_path)
    ratio = ds.sel(gpu_lowprec="bf16_training", gpu_metric="wasserstein")
    assert int(ratio["gpu_ratio_n_seeds"].sel(snapshot=10)) == 3 and int(ratio["gpu_ratio_n_seeds"].sel(snapshot=15)) == 2
    assert np.isfinite(float(ratio["gpu_ratio_low"].sel(snapshot=15)))
    row = readings_gpu.gpu_golden_table(ds).loc[("bf16_training", "wasserstein")]
    assert row["step"] == 10 and row["seeds"] == 3  # the snapshot with the most seeds
    assert row["last step"] == 15 and row["ratio at last step"] == pytest.approx(float(ratio["gpu_ratio"].sel(snapshot=15)))
    # the third seed has no flash record of its seeds: it is not in the paired ratio
    assert int(ratio["gpu_ratio_paired_n_seeds"].sel(snapshot=10)) == 2


def test_study03_looks_before_the_shared_snapshots_with_the_records_that_have_early_ones(records, tmp_path, tiny_corpus_config):
    import shutil

    ds = _gathered(records)
    assert readings_gpu.gpu_early_table(ds).empty  # no repeat or flash record has a snapshot before step 10
    assert readings_gpu.gpu_prose_values(ds)["early_n"] == 0
    for path in records.glob("lm_s03_*.nc"):
        shutil.copy(path, tmp_path / path.name)
    for tag, kw in (("s03_repeat_s2", {}), ("s03_flash_vs_fp32_s2", dict(pair_kernel="sdpa:math"))):
        train(tiny_corpus_config(tag=tag, pair=True, seed=2, data_seed=2, snapshot_early=5, **kw), tmp_path,
              progress=lambda s: None)
    ds = _gathered(tmp_path)
    early = readings_gpu.gpu_early_table(ds)
    # step 5: the two new records (early snapshots) and the low-precision pair (snapshot_every 5) have it
    assert list(early.index) == [5]
    vals = {}
    for comp in ("gpu_repeat", "flash_vs_fp32", "bf16_training"):
        vals[comp] = float(ds["gpu_drift"].sel(gpu_comparison=comp, gpu_metric="wasserstein", snapshot=5))
        assert early.loc[5, comp] == pytest.approx(vals[comp]) and early.loc[5, f"n {comp}"] == 1
    positive = [v for v in vals.values() if v > 0]
    factor = max(positive) / min(positive)
    assert early.loc[5, "factor"] == pytest.approx(factor) and early.loc[5, "alike"] == (factor < 2)
    # two repeat records, both exactly 0 on this deterministic CPU: no geometric mean or interval
    seeds = readings_gpu.gpu_seed_table(ds)
    assert seeds.loc["gpu_repeat", "seeds"] == 2 and seeds.loc["gpu_repeat", "exactly 0"] == 2
    assert math.isnan(seeds.loc["gpu_repeat", "geometric mean"])


def test_study03_common_step_is_the_last_snapshot_every_pair_record_has(records):
    ds = _gathered(records)
    # the low-precision pair stops at step 15 (snapshots 0, 5, 10, 15), the others at 30 (0, 10, 20, 30)
    assert list(readings_gpu.gpu_common_steps(ds)) == [10] and readings_gpu.gpu_common_step(ds) == 10
    assert list(readings_gpu.gpu_common_steps(ds, ["flash_vs_fp32", "noise_floor"])) == [10, 20, 30]
    assert readings_gpu.gpu_common_step(ds, ["bf16_training"]) == 15
    # by definition: every record of every pair has a drift there, and at no later snapshot
    finite = np.isfinite(ds["gpu_model_wasserstein"].transpose("run", "snapshot").values).all(0)
    later = ds["snapshot"].values > readings_gpu.gpu_common_step(ds)
    assert finite[list(ds["snapshot"].values).index(10)] and not finite[later].any()
    table = readings_gpu.gpu_kind_table(ds, 10)
    flash = ["lm_s03_flash_vs_fp32_s0_s0_d0", "lm_s03_flash_vs_fp32_s1_s1_d1"]
    want = ds["gpu_kind_wasserstein_rel"].sel(run=flash, snapshot=10).median("run").to_pandas()
    assert np.allclose(table.loc["flash_vs_fp32"].values, want.values)
    assert set(table.index) == set(ds["gpu_comparison"].values)
    assert readings_gpu.gpu_kind_table(ds).equals(table)  # default: the last snapshot every pair record shares
    values = readings_gpu.gpu_prose_values(ds)
    assert values["kind_step"] == 10 and values["kind_flash_largest"] == table.loc["flash_vs_fp32"].idxmax()
    # the CPU repeat pair is exactly 0, so the flash pair drifts more in every kind with a drift
    assert values["kind_flash_above_repeat_n"] == int((table.loc["flash_vs_fp32"] > 0).sum())


def _repeat_stops_early(ds, factor=(0.5, 2.0)):
    """The dataset with a repeat pair that drifts (factor x the flash drift at steps 10, 20) and stops at 20."""
    ds = ds.copy(deep=True)
    rep, steps = "lm_s03_repeat_s0_s0_d0", [10, 20]
    flash = ds["gpu_drift"].sel(gpu_comparison="flash_vs_fp32", gpu_metric="wasserstein", snapshot=steps).values
    for var in ("gpu_model_wasserstein", "gpu_kind_wasserstein_rel"):
        ds[var].loc[dict(run=rep, snapshot=30)] = np.nan
    ds["gpu_drift"].loc[dict(gpu_comparison="gpu_repeat", gpu_metric="wasserstein", snapshot=steps)] = \
        flash * np.array(factor)
    ds["gpu_drift"].loc[dict(gpu_comparison="gpu_repeat", snapshot=30)] = np.nan
    return ds


def test_study03_repeat_ratio_is_taken_over_the_common_steps_and_says_what_it_means(records):
    ds = _gathered(records)
    # on the CPU the repeat pair is bitwise identical: none of the flash drift is non-determinism
    values = readings_gpu.gpu_prose_values(ds)
    assert values["repeat_bitwise_identical"] == "yes" and values["repeat_last_w1"] == 0
    assert values["repeat_over_flash_first_step"] == 10 and values["repeat_over_flash_last_step"] == 30
    assert values["repeat_over_flash_max"] == 0 and values["repeat_at_or_above_flash_n"] == 0
    early = _repeat_stops_early(ds)
    ratio = readings_gpu.gpu_ratio_series(early, "gpu_repeat", "flash_vs_fp32")
    assert list(ratio.index) == [10, 20] and np.allclose(ratio.values, [0.5, 2.0])  # step 30: the repeat has none
    values = readings_gpu.gpu_prose_values(early)
    assert values["repeat_over_flash_min"] == pytest.approx(0.5) and values["repeat_over_flash_max"] == pytest.approx(2.0)
    assert values["repeat_over_flash_last"] == pytest.approx(2.0) and values["repeat_over_flash_last_step"] == 20
    assert values["repeat_at_or_above_flash_n"] == 1 and values["repeat_over_flash_n"] == 2
    table = readings_gpu.gpu_pair_ratio_table(early)
    assert np.allclose(table["gpu_repeat / flash_vs_fp32"].dropna().values, [0.5, 2.0])


def test_study03_spread_of_the_repeat_flash_and_low_precision_drifts(records):
    ds = _gathered(records)
    # step 10 is the last snapshot the repeat, flash and bf16-training pairs share; the CPU repeat is exactly 0
    drift = {c: float(ds["gpu_drift"].sel(gpu_comparison=c, gpu_metric="wasserstein", snapshot=10))
             for c in ("gpu_repeat", "flash_vs_fp32", "bf16_training")}
    assert drift["gpu_repeat"] == 0 and drift["flash_vs_fp32"] > 0 and drift["bf16_training"] > 0
    table = readings_gpu.gpu_spread_table(ds)
    factor = max(drift["flash_vs_fp32"], drift["bf16_training"]) / min(drift["flash_vs_fp32"], drift["bf16_training"])
    assert list(table.index) == [10] and table.loc[10, "factor"] == pytest.approx(factor)  # the 0 is left out
    assert table.loc[10, "gpu_repeat"] == 0 and table.loc[10, "alike"] == (factor < 2)
    # the verdict follows the factor: alike within 2x
    for scale, alike in ((1.5, True), (3.0, False)):
        changed = _repeat_stops_early(ds, (1.0, 1.0)).copy(deep=True)
        flash = drift["flash_vs_fp32"]
        changed["gpu_drift"].loc[dict(gpu_comparison="bf16_training", gpu_metric="wasserstein", snapshot=10)] = flash * scale
        row = readings_gpu.gpu_spread_table(changed).loc[10]
        assert row["factor"] == pytest.approx(scale) and row["alike"] == alike
        values = readings_gpu.gpu_prose_values(changed)
        assert values["spread_last_alike"] == ("yes" if alike else "no") and values["spread_last_step"] == 10
    # a second shared snapshot (20): apart at the first, alike at the last
    low, flash = "lm_s03_lowprec_s0_s0_d0", drift["flash_vs_fp32"]
    two = ds.copy(deep=True)
    two["gpu_model_wasserstein"].loc[dict(run=low, snapshot=20)] = 1.0
    two["gpu_kind_wasserstein_rel"].loc[dict(run=low, snapshot=20)] = 1.0
    two["gpu_drift"].loc[dict(gpu_comparison="bf16_training", gpu_metric="wasserstein", snapshot=10)] = 3 * flash
    flash20 = float(two["gpu_drift"].sel(gpu_comparison="flash_vs_fp32", gpu_metric="wasserstein", snapshot=20))
    two["gpu_drift"].loc[dict(gpu_comparison="bf16_training", gpu_metric="wasserstein", snapshot=20)] = 1.2 * flash20
    values = readings_gpu.gpu_prose_values(two)
    assert (values["spread_first_step"], values["spread_last_step"]) == (10, 20)
    assert values["spread_first_factor"] == pytest.approx(3.0) and values["spread_last_factor"] == pytest.approx(1.2)
    assert (values["spread_first_alike"], values["spread_last_alike"]) == ("no", "yes")
    # without a low-precision or repeat pair there is nothing to set side by side
    only = ds.sel(gpu_comparison=["flash_vs_fp32", "noise_floor"])
    assert readings_gpu.gpu_spread_table(only).empty


def test_study03_seed_sentence_gives_each_seed_and_the_interval(records):
    ds = _gathered(records)
    seeds = readings_gpu.gpu_seed_table(ds)
    assert list(seeds.index) == ["flash_vs_fp32"] and seeds.loc["flash_vs_fp32", "step"] == 30
    a, b = ds["gpu_model_wasserstein"].sel(run=["lm_s03_flash_vs_fp32_s0_s0_d0", "lm_s03_flash_vs_fp32_s1_s1_d1"],
                                           snapshot=30).values
    row = seeds.loc["flash_vs_fp32"]
    assert row["geometric mean"] == pytest.approx(math.sqrt(a * b)) and row["max / min"] == pytest.approx(max(a, b) / min(a, b))
    assert (row["min"], row["max"]) == (min(a, b), max(a, b)) and row["ci low"] < row["geometric mean"] < row["ci high"]


@pytest.fixture(scope="module")
def records_without_lowprec(records, tmp_path_factory):
    import shutil

    folder = tmp_path_factory.mktemp("records_without_lowprec")
    for path in records.glob("lm_s03_*.nc"):
        if "lowprec" not in path.name:
            shutil.copy(path, folder / path.name)
    return folder


def test_study03_gpu_figure_with_and_without_a_low_precision_pair(records, records_without_lowprec):
    import matplotlib.pyplot as plt

    for folder, common in ((records, 10), (records_without_lowprec, 30)):
        ds = _gathered(folder)
        fig = figures.plot_gpu_drift(ds)
        left, middle, right = fig.axes[:3]
        assert f"step {common}, the last snapshot every pair shares" in middle.get_title()
        table = readings_gpu.gpu_kind_table(ds, common)
        heights = [bar.get_height() for bar in middle.patches]
        kinds = len(ds["kind"])
        for i, comp in enumerate(ds["gpu_comparison"].values):  # bars in comparison order, NaN where 0
            want = table.loc[str(comp)].values
            assert np.allclose(heights[i * kinds:(i + 1) * kinds], np.where(want > 0, want, np.nan), equal_nan=True)
        texts = " ".join(t.get_text() for t in right.texts)
        legend = right.get_legend()
        if "bf16_training" in ds["gpu_comparison"].values:
            assert readings_gpu.gpu_lowprec_missing(ds) is None and not texts
            assert "their claim" in " ".join(t.get_text() for t in legend.get_texts())
            assert right.lines  # the ratio itself
        else:
            assert "bf16_training or fp16_training" in texts.replace("\n", " ") and legend is None and not right.patches
            assert readings_gpu.gpu_lowprec_missing(ds) == "bf16_training or fp16_training"
            assert readings_gpu.gpu_golden_table(ds).empty
            assert readings_gpu.gpu_prose_values(ds)["lowprec_missing"] == "bf16_training or fp16_training"
        plt.close(fig)


def test_results_write_with_provenance(records, tmp_path):
    ds = _gathered(records)
    path = ncio.write_results(ds, tmp_path / "r.nc", study="wasserstein_weight_drift", params={},
                              variables=experiments.VARIABLES)
    back = ncio.open_results(path)
    assert back.sizes["run"] == 5 and "prov_version_gpu" in back.coords
    assert np.allclose(back["gpu_model_wasserstein"].values, ds["gpu_model_wasserstein"].values, equal_nan=True)


# -- the notebooks, through the runner ------------------------------------------------------------------

def test_notebook_gpu_training_tier_gathers_the_records(records, tmp_path):
    study, figure, needle = "wasserstein_weight_drift", "gpu_drift.png", "s03_gpu_golden_bf16_training_wasserstein_ratio"
    import nbformat

    from attnum import runs

    folder = runs.run(study, "gpu_training", {"gpu_records": str(records)}, outputs=tmp_path, progress=False)
    folder = __import__("pathlib").Path(folder)
    ds = ncio.open_results(folder / "results.nc")
    assert all(str(r).startswith("lm_s03_") for r in ds["run"].values)
    assert float(ds["campaign_gpu_s"]) > 0 and "mech_dq_err" not in ds and "drift_ratio" not in ds
    assert (folder / figure).exists()
    nb = nbformat.read(folder / "notebook.ipynb", 4)
    text = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert needle in text and '"ename"' not in text
    # one code path: the CPU sections ran too, with empty tables and n/a values (nothing was trained)
    assert (folder / "drift_over_training.png").exists() and "s03_floor_largest_wasserstein" in text



def test_pair_records_are_classified_by_their_members():
    import xarray as xr

    def pair(att, amp=("bf16", "bf16"), seed=(0, 0)):
        return xr.Dataset(coords={"member": ["a", "b"], "member_attention": ("member", list(att)),
                                  "member_amp": ("member", list(amp)), "member_seed": ("member", list(seed))})

    assert aggregates.gpu_comparison(pair(["sdpa:flash@bf16", "sdpa:math@fp32"])) == "flash_vs_fp32"
    assert aggregates.gpu_comparison(pair(["sdpa:math@fp32", "sdpa:flash@bf16"])) == "flash_vs_fp32"
    assert aggregates.gpu_comparison(pair(["triton:fa2@bf16", "sdpa:math@fp32"])) == \
        "attention_triton:fa2@bf16_vs_sdpa:math@fp32"
    assert aggregates.gpu_comparison(pair(["sdpa:flash@bf16"] * 2, seed=(0, 1))) == "noise_floor"
    assert aggregates.gpu_comparison(pair(["sdpa:flash@bf16"] * 2)) == "gpu_repeat"
    assert aggregates.gpu_comparison(pair(["sdpa:math@fp32", "sdpa:flash@fp16"], amp=("off", "fp16"))) == "fp16_training"
    with pytest.raises(ValueError, match="one member"):
        aggregates.gpu_comparison(pair(["sdpa:flash@bf16"] * 2).isel(member=[0]))



def test_study03_ratio_by_every_metric_at_the_last_shared_snapshot(records):
    ds = _gathered(records)
    values = readings_gpu.gpu_prose_values(ds)
    assert values["bf16_training_step"] == 10  # the last snapshot both pairs have (the low-precision pair stops at 15)
    assert math.isnan(values["fp16_training_step"]) and values["fp16_training_ratio_max_abs_place"] == "n/a"
    r = readings_gpu.gpu_metric_ratios(ds, "bf16_training", 10)
    flash = ["lm_s03_flash_vs_fp32_s0_s0_d0", "lm_s03_flash_vs_fp32_s1_s1_d1"]
    for metric in ("wasserstein", "rel_l2", "max_abs"):
        low = float(ds[f"gpu_model_{metric}"].sel(run="lm_s03_lowprec_s0_s0_d0", snapshot=10))
        den = math.sqrt(np.prod(ds[f"gpu_model_{metric}"].sel(run=flash, snapshot=10).values))
        assert r[metric] == pytest.approx(low / den)
    missing = readings_gpu.gpu_prose_values(None)
    assert missing.pop("lowprec_missing") == "records" and missing.pop("merged_factor") == readings_gpu.MERGED_FACTOR
    assert all(v == "n/a" if isinstance(v, str) else math.isnan(v) for v in missing.values()), missing
