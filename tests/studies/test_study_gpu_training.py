"""The gpu_training tiers of studies 03 and 04 (issue 13) on tiny CPU records made with attnum.lm's
trainer: the gathered datasets, the computed answers, the early error for a folder without records,
and one runner (papermill) run of each notebook on those records."""
import json
import math

import numpy as np
import pytest
import xarray as xr

from attnum import ncio
from attnum.lm import record
from attnum.lm.train import TrainConfig, train
from attnum.studies import late_training_gradient_blowup as s04
from attnum.studies import wasserstein_weight_drift as s03

RUNS = {
    "s04_flash_lr1e-3": dict(kernel="sdpa:flash"),
    "s04_fp32_lr1e-3": dict(kernel="sdpa:math"),
    "s03_flash_vs_fp32_s0": dict(pair=True, pair_kernel="sdpa:math"),
    "s03_flash_vs_fp32_s1": dict(pair=True, pair_kernel="sdpa:math", seed=1, data_seed=1),
    "s03_noise_floor_s0": dict(pair=True, pair_seed=1),
    "s03_repeat_s0": dict(pair=True),
    "s03_lowprec_s0": dict(pair=True, kernel="sdpa:math", amp="off", pair_kernel="sdpa:flash", pair_amp="bf16",
                           steps=15, snapshot_every=5),
}


def _tiny(**kw):
    base = dict(n_layer=2, n_head=2, d_model=32, context=32, batch_size=8, steps=30, log_every=5, eval_every=10,
                snapshot_every=10, corpus_max_bytes=2_000_000, val_windows=8, diag_batch=2, warmup=2, lr=3e-3,
                sketch_size=16, device="cpu", budget_s=300.0, time_attention=False)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("records")
    for tag, kw in RUNS.items():
        train(_tiny(tag=tag, **kw), folder, progress=lambda s: None)
    return folder


# -- the early error ---------------------------------------------------------------------------------

@pytest.mark.parametrize("study, prefix", [(s03, "s03_"), (s04, "s04_")])
def test_a_folder_without_records_fails_at_once_naming_what_is_missing(tmp_path, study, prefix):
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        study.check_gpu_records(tmp_path / "nope")
    for name in record.campaign_runs(prefix):
        assert name in str(err.value)
    (tmp_path / "other.nc").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"no records lm_{prefix}\*\.nc") as err:
        study.check_gpu_records(tmp_path)
    assert "other.nc" in str(err.value) and f"{prefix}flash" in str(err.value)
    with pytest.raises(FileNotFoundError):
        study.gpu_training_dataset(tmp_path)


def test_each_study_takes_only_its_own_records(records):
    assert s04.check_gpu_records(records) == records
    ds = s04.gpu_training_dataset(records)
    assert sorted(ds["run"].values) == ["lm_s04_flash_lr1e-3_s0_d0", "lm_s04_fp32_lr1e-3_s0_d0"]
    assert "s04_gproj_lr1e-3" in json.loads(ds.attrs["missing_runs"])
    assert "s04_flash_lr1e-3" not in json.loads(ds.attrs["missing_runs"])


# -- study 04 ------------------------------------------------------------------------------------------

def test_study04_gathers_the_per_layer_series_and_answers_from_them(records):
    ds = s04.gpu_training_dataset(records, mech=None)
    for var in ("key_mean_norm", "max_prob", "dq_rel_err", "grad_norm_layer"):
        assert ds[var].dims == ("run", "member", "step", "layer")
    assert list(ds["step"].values) == [0, 5, 10, 15, 20, 25, 30]
    assert "weight_sketch" not in ds and "tensor" not in ds.dims
    flash, fp32 = "lm_s04_flash_lr1e-3_s0_d0", "lm_s04_fp32_lr1e-3_s0_d0"
    # FP32 attention is its own recompute; bf16 flash is not
    assert float(ds["sum_max_dq_rel_err"].sel(run=fp32, member="a")) < 1e-5
    assert float(ds["sum_max_dq_rel_err"].sel(run=flash, member="a")) > 1e-4
    assert np.isfinite(float(ds["sum_dq_err_growth"].sel(run=flash, member="a")))  # six logged steps
    assert int(ds["sum_tokens_done"].sel(run=flash)) == 30 * 8 * 32
    assert float(ds["sum_blowup"].sel(run=flash, member="a")) == 0.0
    # GPU time: the records' own wall_s, summed
    walls = [float(record.open_record(p)["wall_s"]) for p in sorted(records.glob("lm_s04_*.nc"))]
    assert float(ds["campaign_gpu_s"]) == pytest.approx(sum(walls))
    every = [float(record.open_record(p)["wall_s"]) for p in sorted(records.glob("lm_*.nc"))]
    assert len(every) == len(RUNS) and float(ds["campaign_all_gpu_s"]) == pytest.approx(sum(every))
    assert sum(every) > sum(walls)
    assert ds.attrs["records_in_folder"] == len(RUNS)
    # the records' own provenance carried over
    assert set(ds["prov_version_torch"].values) == {__import__("torch").__version__}
    sha = record.open_record(records / f"{flash}.nc").attrs["corpus_sha256"]
    assert str(ds["prov_corpus_sha256"].sel(run=flash).values) == sha
    text = "\n".join(s04.gpu_training_sentences(ds))
    assert "dq_rel_err" in text and ("the layer mean grow more than" in text or "grew more than" in text)
    assert "Nothing blew up" in text and "No mechanism grid" in text
    table = s04.gpu_training_table(ds)
    assert list(table["attention"]) == ["sdpa:flash@bf16", "sdpa:math@fp32"]


def test_study04_blowup_and_the_grid_bound_are_computed(records):
    assert s04._loss_rise([math.nan, 3.0, 2.0, 1.0, 2.5]) == pytest.approx(2.5)
    assert s04._loss_rise([math.nan, 3.0, 2.0, 1.0]) < 1
    mech = s04.load_gpu_run("gpu")
    if mech is None:
        pytest.skip("no committed gpu run of study 04 in this checkout")
    ds = s04.gpu_training_dataset(records, mech=mech, level=0.1)
    mu = float(ds["grid_mu_at_level"])
    err = mech["mech_dq_err"].sel(variant="bf16_fused", seq_len=1024).isel(sharpness=0, head_dim=0).median("seed")
    below = err.sel(mu_norm=err["mu_norm"] < mu).values
    assert (below < 0.1).all() and float(err.sel(mu_norm=err["mu_norm"] > mu).max()) >= 0.1
    assert float(ds["grid_offset_spread_at_level"]) == pytest.approx(mu / math.sqrt(int(mech["head_dim"][0])))
    assert "The bound" in "\n".join(s04.gpu_training_sentences(ds))


def test_study04_offset_sentence_orders_the_runs_by_dq_error_and_key_offset(records):
    ds = s04.gpu_training_dataset(records, mech=None)
    flash, fp32 = "lm_s04_flash_lr1e-3_s0_d0", "lm_s04_fp32_lr1e-3_s0_d0"
    lines = s04.gpu_offset_sentences(ds)
    assert len(lines) == 1 and "Over the 6 logged steps all its runs reached (steps 5-30)" in lines[0]
    assert "FP32 0 < sdpa:flash" in lines[0]  # by dQ error: FP32 is its own recompute
    assert "One run per attention" in lines[0] and "s04_triton_lr1e-3" not in lines[0]

    def shifted(by):
        out = ds.copy(deep=True)
        out["key_mean_norm"].loc[dict(run=flash)] = out["key_mean_norm"].sel(run=fp32).values + by
        return out

    up = s04.gpu_offset_sentences(shifted(1.0))[0]
    assert "is above FP32's at 6 of the 6 steps (never below it)" in up and "in the same order by both" in up
    down = s04.gpu_offset_sentences(shifted(-1.0))[0]
    assert "is above FP32's at 0 of the 6 steps (last below it at step 30)" in down and "The two orders differ" in down
    # a GProj run without a Triton run of its setting: the forward kernel is named as the other difference
    gproj = shifted(1.0)
    names = gproj["member_attention"].values.astype(object)
    names[list(gproj["run"].values).index(flash)] = "triton:fa2:gproj_dq@bf16"
    gproj = gproj.assign_coords(member_attention=(("run", "member"), names.astype(str)))
    assert "has no record here" in s04.gpu_offset_sentences(gproj)[0]
    assert lines[0] in s04.gpu_training_sentences(ds)
    # a second flash run of the setting: the run-to-run spread is stated, and the runs named apart
    import xarray as xr

    again = ds.sel(run=[flash]).assign_coords(run=["lm_s04_flash_lr1e-3_b_s0_d0"])
    again["key_mean_norm"] = again["key_mean_norm"] * 1.5
    both = xr.concat([ds, again], "run", data_vars="all")
    text = s04.gpu_offset_sentences(both)[0]
    first = float(ds["key_mean_norm"].sel(run=flash, member="a", step=slice(5, 30)).mean("layer").mean())
    assert "One run per attention" not in text and "the 2 sdpa:flash runs' mean key_mean_norm" in text
    assert f"{first:.3g}, {1.5 * first:.3g} (1.5x apart)" in text
    assert f"sdpa:flash ({flash})" in text and "sdpa:flash (lm_s04_flash_lr1e-3_b_s0_d0)" in text
    second = float(again["dq_rel_err"].sel(member="a", step=slice(5, 30)).mean("layer").mean())
    assert f"mean dq_rel_err {float(ds['dq_rel_err'].sel(run=flash, member='a', step=slice(5, 30)).mean('layer').mean()):.3g}, {second:.3g}" in text
    # GProj beside our Triton kernel without it: the two are compared, and set beside the repeat's spread
    third = ds.sel(run=[flash]).assign_coords(run=["lm_s04_triton_lr1e-3_s0_d0"])
    third["dq_rel_err"] = third["dq_rel_err"] * 4
    trio = xr.concat([both, third], "run", data_vars="all")
    names = trio["member_attention"].values.astype(object)
    names[list(trio["run"].values).index(flash)] = "triton:fa2:gproj_dq@bf16"
    names[list(trio["run"].values).index("lm_s04_triton_lr1e-3_s0_d0")] = "triton:fa2@bf16"
    trio = trio.assign_coords(member_attention=(("run", "member"), names.astype(str)))
    text = s04.gpu_offset_sentences(trio)[0]
    assert "has no record here" not in text
    assert "GProj against the same Triton kernel without it (lm_s04_triton_lr1e-3_s0_d0)" in text
    assert "(4x lower with GProj)" in text and "(1x)." in text
    # the spread now is the flash_b run alone (one sdpa:flash run left): no repeat, so no spread comparison
    assert "repeat's spread" not in text
    # with a second sdpa:flash run: its spread (1.1x in key offset, 1x in dQ error) is the yardstick
    fourth = again.assign_coords(run=["lm_s04_flash_lr1e-3_c_s0_d0"])
    fourth["key_mean_norm"] = fourth["key_mean_norm"] * 1.1
    text = s04.gpu_offset_sentences(xr.concat([trio, fourth], "run", data_vars="all"))[0]
    assert "repeat's spread (1x in dq_rel_err, 1.1x in key_mean_norm)" in text
    assert "GProj's dQ difference is outside it and its key offset difference within it" in text


# -- study 03 ------------------------------------------------------------------------------------------

def test_study03_classifies_pairs_and_measures_their_drift(records):
    ds = s03.gpu_training_dataset(records)
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
    ds = s03.gpu_training_dataset(records)
    ratio = ds["gpu_ratio"].sel(gpu_lowprec="bf16_training", gpu_metric="wasserstein")
    flash = ds["gpu_drift"].sel(gpu_comparison="flash_vs_fp32", gpu_metric="wasserstein")
    low = ds["gpu_model_wasserstein"].sel(run="lm_s03_lowprec_s0_s0_d0")
    # step 10: both pairs have a snapshot; step 15: the flash drift interpolated between 10 and 20
    assert float(ratio.sel(snapshot=10)) == pytest.approx(float(low.sel(snapshot=10) / flash.sel(snapshot=10)))
    mid = 0.5 * (float(flash.sel(snapshot=10)) + float(flash.sel(snapshot=20)))
    assert float(ratio.sel(snapshot=15)) == pytest.approx(float(low.sel(snapshot=15)) / mid)
    assert np.isnan(float(ratio.sel(snapshot=5)))  # before the flash pair's first snapshot > 0
    text = "\n".join(s03.gpu_sentences(ds))
    assert "Golden et al.'s 2-5x" in text and "one seed, so no interval" in text
    assert f"{float(ratio.sel(snapshot=15)):.3g}" in text
    assert "Flash against the noise floor" in text and "GPU repeat" in text


def test_study03_golden_ratio_is_stated_where_two_low_precision_seeds_give_an_interval(records, tmp_path):
    import shutil

    for path in records.glob("lm_*.nc"):
        shutil.copy(path, tmp_path / path.name)
    # a second low-precision seed that stops earlier (step 10) than the first (step 15)
    train(_tiny(tag="s03_lowprec_s1", pair=True, kernel="sdpa:math", amp="off", pair_kernel="sdpa:flash",
                pair_amp="bf16", seed=1, data_seed=1, steps=10, snapshot_every=5), tmp_path, progress=lambda s: None)
    ds = s03.gpu_training_dataset(tmp_path)
    ratio = ds.sel(gpu_lowprec="bf16_training", gpu_metric="wasserstein")
    assert np.isfinite(float(ratio["gpu_ratio_low"].sel(snapshot=10)))
    assert np.isnan(float(ratio["gpu_ratio_low"].sel(snapshot=15)))  # one seed there
    line = [t for t in s03.gpu_sentences(ds) if t.startswith("**Golden et al.'s 2-5x**")][0]
    assert f"at step 10 is {float(ratio['gpu_ratio'].sel(snapshot=10)):.3g}: 95% interval over the 2" in line
    assert f"{float(ratio['gpu_ratio_low'].sel(snapshot=10)):.3g} to " in line and "one seed" not in line
    assert (f"At the later snapshots, which fewer seeds reached, it is {float(ratio['gpu_ratio'].sel(snapshot=15)):.3g} "
            "(step 15, 1 seed).") in line
    # paired by seed: each low-precision record over the flash record of its own seeds (s0 and s1 both have one)
    model = ds["gpu_model_wasserstein"]
    per_seed = [float(model.sel(run=f"lm_s03_lowprec_s{k}_s{k}_d{k}", snapshot=10)
                      / model.sel(run=f"lm_s03_flash_vs_fp32_s{k}_s{k}_d{k}", snapshot=10)) for k in (0, 1)]
    assert float(ratio["gpu_ratio_paired"].sel(snapshot=10)) == pytest.approx(math.sqrt(per_seed[0] * per_seed[1]))
    assert int(ratio["gpu_ratio_paired_n_seeds"].sel(snapshot=10)) == 2
    assert np.isfinite(float(ratio["gpu_ratio_paired_low"].sel(snapshot=10)))
    assert (f"Paired by seed (each `bf16_training` record over the `flash_vs_fp32` record of its own init and data "
            f"seeds, so the interval carries the flash pairs' spread as well): "
            f"{float(ratio['gpu_ratio_paired'].sel(snapshot=10)):.3g} at step 10, 95% interval over the 2 seed pairs") in line
    # a third seed that runs as far as the first: step 15 now has two seeds (an interval) and step 10 three;
    # the sentence stays at the snapshot with the most seeds, and names how many it has
    train(_tiny(tag="s03_lowprec_s2", pair=True, kernel="sdpa:math", amp="off", pair_kernel="sdpa:flash",
                pair_amp="bf16", seed=2, data_seed=2, steps=15, snapshot_every=5), tmp_path, progress=lambda s: None)
    ds = s03.gpu_training_dataset(tmp_path)
    ratio = ds.sel(gpu_lowprec="bf16_training", gpu_metric="wasserstein")
    assert int(ratio["gpu_ratio_n_seeds"].sel(snapshot=10)) == 3 and int(ratio["gpu_ratio_n_seeds"].sel(snapshot=15)) == 2
    assert np.isfinite(float(ratio["gpu_ratio_low"].sel(snapshot=15)))
    line = [t for t in s03.gpu_sentences(ds) if t.startswith("**Golden et al.'s 2-5x**")][0]
    assert f"at step 10 is {float(ratio['gpu_ratio'].sel(snapshot=10)):.3g}: 95% interval over the 3" in line
    assert f"{float(ratio['gpu_ratio'].sel(snapshot=15)):.3g} (step 15, 2 seeds)" in line
    # the third seed has no flash record of its seeds: it is not in the paired ratio
    assert int(ratio["gpu_ratio_paired_n_seeds"].sel(snapshot=10)) == 2


def test_study03_looks_before_the_shared_snapshots_with_the_records_that_have_early_ones(records, tmp_path):
    import shutil

    ds = s03.gpu_training_dataset(records)
    assert s03.gpu_early_sentence(ds) is None  # no repeat or flash record has a snapshot before step 10
    spread = s03.gpu_spread_sentence(ds)
    assert spread is None or "the next sentence looks there" not in spread
    for path in records.glob("lm_s03_*.nc"):
        shutil.copy(path, tmp_path / path.name)
    for tag, kw in (("s03_repeat_s2", {}), ("s03_flash_vs_fp32_s2", dict(pair_kernel="sdpa:math"))):
        train(_tiny(tag=tag, pair=True, seed=2, data_seed=2, snapshot_early=5, **kw), tmp_path,
              progress=lambda s: None)
    ds = s03.gpu_training_dataset(tmp_path)
    text = s03.gpu_early_sentence(ds)
    # step 5: the two new records (early snapshots) and the low-precision pair (snapshot_every 5) have it
    assert "before step 10, every comparison has a drift at step 5 in at least one record" in text
    for comp in ("gpu_repeat", "flash_vs_fp32", "bf16_training"):
        value = float(ds["gpu_drift"].sel(gpu_comparison=comp, gpu_metric="wasserstein", snapshot=5))
        assert f"{value:.3g} for `{comp}` (1 record)" in text
    assert ("more than 2x apart" in text) != ("within 2x of each other" in text)
    assert text in s03.gpu_sentences(ds)
    spread = s03.gpu_spread_sentence(ds)
    assert spread is None or "no snapshot before it is in a record" not in spread
    # two repeat records, both exactly 0 on this deterministic CPU: said so, with no ratio of seeds
    assert any(t.startswith("`gpu_repeat` over its 2 seeds") and "2 exactly 0: bitwise identical members" in t
               for t in s03.gpu_seed_sentences(ds))


def test_study03_common_step_is_the_last_snapshot_every_pair_record_has(records):
    ds = s03.gpu_training_dataset(records)
    # the low-precision pair stops at step 15 (snapshots 0, 5, 10, 15), the others at 30 (0, 10, 20, 30)
    assert list(s03.gpu_common_steps(ds)) == [10] and s03.gpu_common_step(ds) == 10
    assert list(s03.gpu_common_steps(ds, ["flash_vs_fp32", "noise_floor"])) == [10, 20, 30]
    assert s03.gpu_common_step(ds, ["bf16_training"]) == 15
    # by definition: every record of every pair has a drift there, and at no later snapshot
    finite = np.isfinite(ds["gpu_model_wasserstein"].transpose("run", "snapshot").values).all(0)
    later = ds["snapshot"].values > s03.gpu_common_step(ds)
    assert finite[list(ds["snapshot"].values).index(10)] and not finite[later].any()
    table = s03.gpu_kind_table(ds, 10)
    flash = ["lm_s03_flash_vs_fp32_s0_s0_d0", "lm_s03_flash_vs_fp32_s1_s1_d1"]
    want = ds["gpu_kind_wasserstein_rel"].sel(run=flash, snapshot=10).median("run").to_pandas()
    assert np.allclose(table.loc["flash_vs_fp32"].values, want.values)
    assert set(table.index) == set(ds["gpu_comparison"].values)
    text = s03.gpu_kind_sentence(ds)
    assert "at step 10, the last snapshot every pair record shares" in text
    assert f"{table.loc['flash_vs_fp32', 'attention']:.3g}" in text and "(repeat exactly 0)" in text


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
    ds = s03.gpu_training_dataset(records)
    # on the CPU the repeat pair is bitwise identical: none of the flash drift is non-determinism
    text = "\n".join(s03.gpu_repeat_sentences(ds))
    assert "bitwise identical" in text and "steps 10-30" in text
    early = _repeat_stops_early(ds)
    ratio = s03.gpu_ratio_series(early, "gpu_repeat", "flash_vs_fp32")
    assert list(ratio.index) == [10, 20] and np.allclose(ratio.values, [0.5, 2.0])  # step 30: the repeat has none
    text = "\n".join(s03.gpu_repeat_sentences(early))
    assert "0.5x to 2x" in text and "2x at step 20" in text and "at 1 of them (step 20)" in text
    assert "cannot be told apart from run-to-run noise" in text
    text = "\n".join(s03.gpu_repeat_sentences(_repeat_stops_early(ds, (2.0, 0.25))))
    assert "0.25x to 2x" in text and "reaches 25% of the flash-vs-FP32 pair's drift" in text and "4x as far" in text
    assert "0.25x to 2x" in "\n".join(s03.gpu_conclusion_lines(_repeat_stops_early(ds, (2.0, 0.25))))


def test_study03_spread_of_the_repeat_flash_and_low_precision_drifts(records):
    ds = s03.gpu_training_dataset(records)
    # step 10 is the last snapshot the repeat, flash and bf16-training pairs share; the CPU repeat is exactly 0
    drift = {c: float(ds["gpu_drift"].sel(gpu_comparison=c, gpu_metric="wasserstein", snapshot=10))
             for c in ("gpu_repeat", "flash_vs_fp32", "bf16_training")}
    assert drift["gpu_repeat"] == 0 and drift["flash_vs_fp32"] > 0 and drift["bf16_training"] > 0
    text = s03.gpu_spread_sentence(ds)
    factor = max(drift["flash_vs_fp32"], drift["bf16_training"]) / min(drift["flash_vs_fp32"], drift["bf16_training"])
    assert "at step 10, the last snapshot these pairs share" in text and f"{factor:.3g}x the smallest" in text
    assert "exactly 0 and left out of that factor" in text
    # the reading follows the factor: alike within 2x, or ranked by size
    for scale, alike in ((1.5, True), (3.0, False)):
        changed = _repeat_stops_early(ds, (1.0, 1.0)).copy(deep=True)
        flash = drift["flash_vs_fp32"]
        changed["gpu_drift"].loc[dict(gpu_comparison="bf16_training", gpu_metric="wasserstein", snapshot=10)] = flash * scale
        text = s03.gpu_spread_sentence(changed)
        assert "1.5x the smallest" in text if alike else "3x the smallest" in text
        assert ("cannot rank the changes" in text) == alike and ("rank the changes by size" in text) == (not alike)
        assert "left out" not in text  # the repeat now drifts
    assert "no snapshot before it is in a record of every one" in s03.gpu_spread_sentence(ds)  # one shared snapshot
    # a second shared snapshot (20): apart at the first, alike at the last, so the drifts merge in between
    low, flash = "lm_s03_lowprec_s0_s0_d0", drift["flash_vs_fp32"]
    two = ds.copy(deep=True)
    two["gpu_model_wasserstein"].loc[dict(run=low, snapshot=20)] = 1.0
    two["gpu_kind_wasserstein_rel"].loc[dict(run=low, snapshot=20)] = 1.0
    two["gpu_drift"].loc[dict(gpu_comparison="bf16_training", gpu_metric="wasserstein", snapshot=10)] = 3 * flash
    flash20 = float(two["gpu_drift"].sel(gpu_comparison="flash_vs_fp32", gpu_metric="wasserstein", snapshot=20))
    two["gpu_drift"].loc[dict(gpu_comparison="bf16_training", gpu_metric="wasserstein", snapshot=20)] = 1.2 * flash20
    assert list(s03.gpu_common_steps(two, ["gpu_repeat", "flash_vs_fp32", "bf16_training"])) == [10, 20]
    text = s03.gpu_spread_sentence(two)
    assert "at step 20, the last snapshot" in text and "1.2x the smallest" in text
    assert "At step 10, the first they share" in text and "3x apart" in text
    assert "merge between steps 10 and 20" in text
    # without a low-precision or repeat pair there is nothing to set side by side
    only = ds.sel(gpu_comparison=["flash_vs_fp32", "noise_floor"])
    assert s03.gpu_spread_sentence(only) is None


def test_study03_seed_sentence_gives_each_seed_and_the_interval(records):
    ds = s03.gpu_training_dataset(records)
    lines = s03.gpu_seed_sentences(ds)
    assert len(lines) == 1 and lines[0].startswith("`flash_vs_fp32` over its 2 seeds at step 30")
    a, b = ds["gpu_model_wasserstein"].sel(run=["lm_s03_flash_vs_fp32_s0_s0_d0", "lm_s03_flash_vs_fp32_s1_s1_d1"],
                                           snapshot=30).values
    assert f"{a:.3g}, {b:.3g}" in lines[0] and f"geometric mean {math.sqrt(a * b):.3g}" in lines[0]
    assert f"differ by {max(a, b) / min(a, b):.3g}x" in lines[0]
    assert lines[0] in s03.gpu_sentences(ds)


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

    from attnum.figures import wasserstein_weight_drift as figures

    for folder, common in ((records, 10), (records_without_lowprec, 30)):
        ds = s03.gpu_training_dataset(folder)
        fig = figures.plot_gpu_drift(ds)
        left, middle, right = fig.axes[:3]
        assert f"step {common}, the last snapshot every pair shares" in middle.get_title()
        table = s03.gpu_kind_table(ds, common)
        heights = [bar.get_height() for bar in middle.patches]
        kinds = len(ds["kind"])
        for i, comp in enumerate(ds["gpu_comparison"].values):  # bars in comparison order, NaN where 0
            want = table.loc[str(comp)].values
            assert np.allclose(heights[i * kinds:(i + 1) * kinds], np.where(want > 0, want, np.nan), equal_nan=True)
        texts = " ".join(t.get_text() for t in right.texts)
        legend = right.get_legend()
        if "bf16_training" in ds["gpu_comparison"].values:
            assert s03.gpu_lowprec_absence(ds) is None and not texts
            assert "their claim" in " ".join(t.get_text() for t in legend.get_texts())
            assert right.lines  # the ratio itself
        else:
            assert "No low-precision pair record" in texts and legend is None and not right.patches
            assert "No low-precision pair record" in s03.gpu_lowprec_absence(ds)
            lines = s03.gpu_conclusion_lines(ds)
            assert any("not tested by these records" in line for line in lines)
        plt.close(fig)


def test_results_write_with_provenance(records, tmp_path):
    ds = s03.gpu_training_dataset(records)
    path = ncio.write_results(ds, tmp_path / "r.nc", study="wasserstein_weight_drift", params={},
                              variables=s03.VARIABLES)
    back = ncio.open_results(path)
    assert back.sizes["run"] == 5 and "prov_version_gpu" in back.coords
    assert np.allclose(back["gpu_model_wasserstein"].values, ds["gpu_model_wasserstein"].values, equal_nan=True)


# -- the notebooks, through the runner ------------------------------------------------------------------

@pytest.mark.parametrize("study, figure, needle", [
    ("late_training_gradient_blowup", "gpu_training.png", "Does the dQ error grow late?"),
    ("wasserstein_weight_drift", "gpu_drift.png", "Golden et al.'s 2-5x"),
])
def test_notebook_gpu_training_tier_gathers_the_records(records, tmp_path, study, figure, needle):
    import nbformat

    from attnum import runner

    folder = runner.run(study, "gpu_training", {"gpu_records": str(records)}, outputs=tmp_path, progress=False)
    folder = __import__("pathlib").Path(folder)
    ds = ncio.open_results(folder / "results.nc")
    prefix = "s04_" if study.startswith("late") else "s03_"
    assert all(str(r).startswith(f"lm_{prefix}") for r in ds["run"].values)
    assert float(ds["campaign_gpu_s"]) > 0 and "mech_dq_err" not in ds and "drift_ratio" not in ds
    assert (folder / figure).exists()
    nb = nbformat.read(folder / "notebook.ipynb", 4)
    text = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert needle in text and '"ename"' not in text and "nothing is trained here" in text


def test_notebook_gpu_training_tier_stops_at_once_without_records(tmp_path):
    from attnum import runner

    empty = tmp_path / "records"
    empty.mkdir()
    with pytest.raises(Exception) as err:
        runner.run("late_training_gradient_blowup", "gpu_training", {"gpu_records": str(empty)},
                   outputs=tmp_path / "out", progress=False)
    text = str(err.value)
    assert "no records lm_s04_*.nc" in text and "s04_flash_lr1e-3" in text
    assert not list((tmp_path / "out").rglob("results.nc"))


def test_pair_records_are_classified_by_their_members():
    import xarray as xr

    def pair(att, amp=("bf16", "bf16"), seed=(0, 0)):
        return xr.Dataset(coords={"member": ["a", "b"], "member_attention": ("member", list(att)),
                                  "member_amp": ("member", list(amp)), "member_seed": ("member", list(seed))})

    assert s03.gpu_comparison(pair(["sdpa:flash@bf16", "sdpa:math@fp32"])) == "flash_vs_fp32"
    assert s03.gpu_comparison(pair(["sdpa:math@fp32", "sdpa:flash@bf16"])) == "flash_vs_fp32"
    assert s03.gpu_comparison(pair(["triton:fa2@bf16", "sdpa:math@fp32"])) == \
        "attention_triton:fa2@bf16_vs_sdpa:math@fp32"
    assert s03.gpu_comparison(pair(["sdpa:flash@bf16"] * 2, seed=(0, 1))) == "noise_floor"
    assert s03.gpu_comparison(pair(["sdpa:flash@bf16"] * 2)) == "gpu_repeat"
    assert s03.gpu_comparison(pair(["sdpa:math@fp32", "sdpa:flash@fp16"], amp=("off", "fp16"))) == "fp16_training"
    with pytest.raises(ValueError, match="one member"):
        s03.gpu_comparison(pair(["sdpa:flash@bf16"] * 2).isel(member=[0]))


def test_study04_names_the_layers_whose_dq_error_passed_the_level(records):
    ds = s04.gpu_training_dataset(records, mech=None)
    flash = "lm_s04_flash_lr1e-3_s0_d0"
    # the tiny CPU records' dQ errors are whatever a 2-layer toy gives: set the flash run's to 1% first
    dq = ds[s04.GPU_DQ_METRIC].copy()
    is_flash = dq["run"] == flash
    dq = xr.where(is_flash & dq.notnull(), 0.01, dq).transpose(*ds[s04.GPU_DQ_METRIC].dims)
    calm = ds.assign({s04.GPU_DQ_METRIC: dq})
    text = s04.gpu_dq_pass_sentence(calm)
    assert "in no layer of any run" in text and f"{flash} (0.01)" in text
    # raise one layer's dQ error above the level from the second logged step after 0 on
    steps = dq.sel(run=flash, member="a", layer=1).dropna("step")
    steps = steps["step"].values[steps["step"].values > 0]
    first, top = int(steps[1]), int(steps[-1])
    raised = dq.copy()
    for k, st in enumerate(steps[1:]):
        raised.loc[dict(run=flash, member="a", layer=1, step=st)] = 0.2 + 0.1 * k
    text = s04.gpu_dq_pass_sentence(calm.assign({s04.GPU_DQ_METRIC: raised}))
    assert f"{flash} (sdpa:flash@bf16): layer 1 passed 0.1 at step {first} " in text
    assert f"reached {0.2 + 0.1 * (len(steps) - 2):.3g} at step {top} " in text
    assert "layer 0 passed" not in text and "its other layers stayed at or below 0.01." in text
    assert "In the other runs" not in text  # the FP32 run's dQ error is 0: it has none to pass


def test_study04_sets_a_layer_that_passed_beside_the_same_layer_of_its_setting(records):
    ds = s04.gpu_training_dataset(records, mech=None)
    flash, fp32 = "lm_s04_flash_lr1e-3_s0_d0", "lm_s04_fp32_lr1e-3_s0_d0"
    dq = ds[s04.GPU_DQ_METRIC]
    calm = ds.assign({s04.GPU_DQ_METRIC: xr.where((dq["run"] == flash) & dq.notnull(), 0.01, dq).transpose(*dq.dims)})
    assert s04.gpu_pass_setting_sentences(calm) == []
    steps = calm[s04.GPU_DQ_METRIC].sel(run=flash, member="a", layer=1).dropna("step")["step"].values
    steps = steps[steps > 0]
    first = int(steps[2])
    raised = calm[s04.GPU_DQ_METRIC].copy()
    for st in steps[2:]:
        raised.loc[dict(run=flash, member="a", layer=1, step=st)] = 0.5
    # the two tiny runs share one setting: one of its two runs passed, and the FP32 run's layer 1 is read at that step
    (text,) = s04.gpu_pass_setting_sentences(calm.assign({s04.GPU_DQ_METRIC: raised}))
    km = float(ds["key_mean_norm"].sel(run=fp32, member="a", layer=1, step=first))
    assert "1 of the 2 trained runs of this setting had a layer whose dq_rel_err passed 0.1" in text
    assert f"{flash}'s layer 1 passed at step {first} " in text
    assert f"{fp32} (sdpa:math@fp32) at step {first}: dq_rel_err 0, key_mean_norm {km:.3g};" in text
    # a run of the setting that stopped before the step is read at its last logged step, and says so
    cut = calm.assign({s04.GPU_DQ_METRIC: raised})
    for var in ("key_mean_norm", s04.GPU_DQ_METRIC):
        cut[var] = cut[var].where(~((cut["run"] == fp32) & (cut["step"] >= first)))
    (text,) = s04.gpu_pass_setting_sentences(cut)
    assert "(it stopped before step" in text and f"{fp32} (sdpa:math@fp32) at step {first}" not in text


def test_study04_per_layer_figure_wraps_runs_into_blocks_on_one_y_axis_per_variable(records):
    from attnum.figures import late_training_gradient_blowup as figs

    ds = s04.gpu_training_dataset(records, mech=None)
    three = xr.concat([ds, ds.isel(run=[0]).assign_coords(run=["lm_s04_copy_s0_d0"])], "run", data_vars="all")
    fig = figs.plot_gpu_dq_by_layer(three, per_row=2)
    try:
        axes = np.array(fig.axes).reshape(4, 2)  # two blocks of (dQ row, key offset row), two runs a row
        assert [ax.get_title() for ax in axes[[0, 0, 2], [0, 1, 0]]] == [str(r) for r in three["run"].values]
        assert not axes[2, 1].get_visible() and not axes[3, 1].get_visible() and axes[2, 0].get_visible()
        dq_panels = [a for a in axes[[0, 0, 2], [0, 1, 0]] if a.lines]
        assert len({a.get_ylim() for a in dq_panels}) == 1 and len(dq_panels) >= 2
        assert axes[3, 0].get_xlabel() == "optimiser step" and axes[2, 0].get_ylabel() == s04.GPU_DQ_METRIC
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
