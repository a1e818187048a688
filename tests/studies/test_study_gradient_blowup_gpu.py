"""Study 04's gpu_training tier on tiny CPU records made with attnum.train.train_corpus: the gathered dataset,
the computed readings, the early error for a folder without records, and one runner (papermill) run of
the notebook on those records (a record of another study's campaign in the folder is left out)."""
import json
import math

import numpy as np
import pytest
import xarray as xr

from attnum import ncio
from attnum.train import record
from attnum.train import train as _train
from attnum.studies.late_training_gradient_blowup import figures, gpu_training, readings, readings_gpu


def train(cfg, out_dir, progress=None):  # a corpus run: its record's path
    return _train(cfg, out_dir=out_dir, progress=False).path

RUNS = {
    "s04_flash_lr1e-3": dict(kernel="sdpa:flash"),
    "s04_fp32_lr1e-3": dict(kernel="sdpa:math"),
    "s03_repeat_s0": dict(pair=True),  # another study's record: this study leaves it out
}


# -- the early error ---------------------------------------------------------------------------------

def test_a_folder_without_records_fails_at_once_naming_what_is_missing(tmp_path):
    study, prefix = gpu_training, "s04_"
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        study.check_gpu_records(tmp_path / "nope")
    for name in record.campaign_runs(prefix):
        assert name in str(err.value)
    (tmp_path / "other.nc").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"no records lm_{prefix}\*\.nc") as err:
        study.check_gpu_records(tmp_path)
    assert "other.nc" in str(err.value) and f"{prefix}flash" in str(err.value)
    with pytest.raises(FileNotFoundError):
        study.gpu_training_dataset(tmp_path, None, 0.1)


def test_each_study_takes_only_its_own_records(records):
    assert gpu_training.check_gpu_records(records) == records
    ds = gpu_training.gpu_training_dataset(records, None, 0.1)
    assert sorted(ds["run"].values) == ["lm_s04_flash_lr1e-3_s0_d0", "lm_s04_fp32_lr1e-3_s0_d0"]
    assert "s04_gproj_lr1e-3" in json.loads(ds.attrs["missing_runs"])
    assert "s04_flash_lr1e-3" not in json.loads(ds.attrs["missing_runs"])


# -- study 04 ------------------------------------------------------------------------------------------

def test_study04_gathers_the_per_layer_series_and_answers_from_them(records):
    ds = gpu_training.gpu_training_dataset(records, mech=None, level=0.1)
    for var in ("key_mean_norm", "max_prob", "dq_rel_err", "grad_norm"):
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
    table = readings_gpu.gpu_training_table(ds)
    assert list(table["attention"]) == ["sdpa:flash@bf16", "sdpa:math@fp32"]
    late = readings_gpu.late_growth(ds)
    assert late["with growth"] == int(np.isfinite(table["dq_rel_err growth"]).sum()) >= 1
    assert late["grew"] == int((table["dq_rel_err growth"] > gpu_training.GPU_GROWTH).sum())
    assert readings_gpu.blowup_by_family(ds)["blew up"].sum() == 0  # nothing blew up
    camp = readings_gpu.campaign(ds)
    assert camp["runs"] == 2 and camp["records_in_folder"] == len(RUNS)
    assert camp["gpu_s"] == pytest.approx(sum(walls)) and camp["missing"] == len(json.loads(ds.attrs["missing_runs"]))
    bound = readings_gpu.grid_bound(ds)  # no mechanism grid: its side is NaN, the runs' side is read
    assert np.isnan(bound["grid_mu"]) and np.isnan(bound["spread_ratio"])
    assert bound["tokens"] == 30 * 8 * 32 and bound["dq_err"] == pytest.approx(float(table["max dq_rel_err"].max()))


def test_study04_blowup_and_the_grid_bound_are_computed(records):
    assert gpu_training._loss_rise([math.nan, 3.0, 2.0, 1.0, 2.5]) == pytest.approx(2.5)
    assert gpu_training._loss_rise([math.nan, 3.0, 2.0, 1.0]) < 1
    mech = readings.cuda_run(ncio.committed_run("late_training_gradient_blowup", "gpu"))
    if mech is None:
        pytest.skip("no committed gpu run of study 04 in this checkout")
    ds = gpu_training.gpu_training_dataset(records, mech=mech, level=0.1)
    mu = float(ds["grid_mu_at_level"])
    err = mech["mech_dq_err"].sel(variant="bf16_fused", seq_len=1024).isel(sharpness=0, head_dim=0).median("seed")
    below = err.sel(mu_norm=err["mu_norm"] < mu).values
    assert (below < 0.1).all() and float(err.sel(mu_norm=err["mu_norm"] > mu).max()) >= 0.1
    assert float(ds["grid_offset_spread_at_level"]) == pytest.approx(mu / math.sqrt(int(mech["head_dim"][0])))
    bound = readings_gpu.grid_bound(ds)
    assert bound["grid_mu"] == mu and bound["spread_ratio"] == pytest.approx(
        float(ds["grid_offset_spread_at_level"]) / bound["offset_spread"])


def test_study04_offset_table_orders_the_runs_by_dq_error_and_key_offset(records):
    ds = gpu_training.gpu_training_dataset(records, mech=None, level=0.1)
    flash, fp32 = "lm_s04_flash_lr1e-3_s0_d0", "lm_s04_fp32_lr1e-3_s0_d0"
    table = readings_gpu.offset_order(ds).droplevel("setting")
    assert list(table.index) == [(flash, "a"), (fp32, "a")]
    assert (table["steps"] == 6).all() and (table["first step"] == 5).all() and (table["last step"] == 30).all()
    steps = slice(5, 30)
    for run in (flash, fp32):
        one = ds.sel(run=run, member="a", step=steps)
        assert table.loc[(run, "a"), "mean key_mean_norm"] == pytest.approx(float(one["key_mean_norm"].mean("layer").mean()))
        assert table.loc[(run, "a"), "mean dq_rel_err"] == pytest.approx(float(one["dq_rel_err"].mean("layer").mean()))
    # by dQ error FP32 comes first: it is its own recompute
    assert table.loc[(fp32, "a"), "rank by dq_rel_err"] == 1 and table.loc[(flash, "a"), "rank by dq_rel_err"] == 2
    assert np.isnan(table.loc[(fp32, "a"), "steps above FP32"])

    def shifted(by):
        out = ds.copy(deep=True)
        out["key_mean_norm"].loc[dict(run=flash)] = out["key_mean_norm"].sel(run=fp32).values + by
        return readings_gpu.offset_order(out).droplevel("setting")

    up, down = shifted(1.0), shifted(-1.0)
    assert up.loc[(flash, "a"), "steps above FP32"] == 6 and np.isnan(up.loc[(flash, "a"), "last below FP32"])
    assert up["same order"].all()
    assert down.loc[(flash, "a"), "steps above FP32"] == 0 and down.loc[(flash, "a"), "last below FP32"] == 30
    assert not down["same order"].any()
    # a setting without an FP32-attention run has no row
    assert readings_gpu.offset_order(ds.sel(run=[flash])).empty and readings_gpu.offset_order(None).empty


# -- the notebooks, through the runner ------------------------------------------------------------------

def test_notebook_gpu_training_tier_gathers_the_records(records, tmp_path):
    study, figure = "late_training_gradient_blowup", "gpu_training.png"
    import shutil
    from pathlib import Path

    import nbformat

    from attnum import runs

    # sections 1-9 of this tier read the committed gpu run: the outputs root of this run holds a copy of it
    committed = Path(__file__).resolve().parents[2] / "outputs" / study / "gpu"
    shutil.copytree(committed, tmp_path / study / "gpu")
    needle = f"sections 1-9 read: {study}/gpu (cuda"
    folder = runs.run(study, "gpu_training", {"gpu_records": str(records)}, outputs=tmp_path, progress=False)
    folder = __import__("pathlib").Path(folder)
    ds = ncio.open_results(folder / "results.nc")
    prefix = "s04_"
    assert all(str(r).startswith(f"lm_{prefix}") for r in ds["run"].values)
    assert float(ds["campaign_gpu_s"]) > 0 and "mech_dq_err" not in ds and "drift_ratio" not in ds
    assert (folder / figure).exists()
    nb = nbformat.read(folder / "notebook.ipynb", 4)
    text = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert needle in text and '"ename"' not in text and "section 10 reads: this run" in text
    from attnum import glue

    executed = json.loads((folder / "notebook.ipynb").read_text())
    assert glue.missing_keys(executed) == set()
    values = glue.read_glued(executed)
    # the prose's repeat numbers are the run's own
    grow = readings_gpu.strongest_repeat_growth(ds, gpu_training.GPU_DQ_PASS)
    assert values["s04_dq_pass_level"] == gpu_training.GPU_DQ_PASS
    assert values["s04_repeat_runs"] == (grow["runs"] if grow["attention"] else "n/a")
    assert values["s04_repeat_grown"] == (grow["grown"] if grow["attention"] else "n/a")
    camp = readings_gpu.campaign(ds)
    assert values["s04_campaign_runs"] == camp["runs"] == 2 and values["s04_campaign_gpu_s"] == pytest.approx(camp["gpu_s"])
    assert values["s04_blown_up"] == int(readings_gpu.blowup_by_family(ds)["blew up"].sum())
    assert values["s04_memorising"] == int(readings_gpu.memorisation(ds)["memorises"].sum())


def test_notebook_gpu_training_tier_stops_at_once_without_records(tmp_path):
    from attnum import runs

    empty = tmp_path / "records"
    empty.mkdir()
    with pytest.raises(Exception) as err:
        runs.run("late_training_gradient_blowup", "gpu_training", {"gpu_records": str(empty)},
                   outputs=tmp_path / "out", progress=False)
    text = str(err.value)
    assert "no records lm_s04_*.nc" in text and "s04_flash_lr1e-3" in text
    assert not list((tmp_path / "out").rglob("results.nc"))


def test_study04_names_the_layers_whose_dq_error_passed_the_level(records):
    ds = gpu_training.gpu_training_dataset(records, mech=None, level=0.1)
    flash = "lm_s04_flash_lr1e-3_s0_d0"
    # the tiny CPU records' dQ errors are whatever a 2-layer toy gives: set the flash run's to 1% first
    dq = ds[gpu_training.GPU_DQ_METRIC].copy()
    is_flash = dq["run"] == flash
    dq = xr.where(is_flash & dq.notnull(), 0.01, dq).transpose(*ds[gpu_training.GPU_DQ_METRIC].dims)
    calm = ds.assign({gpu_training.GPU_DQ_METRIC: dq})
    assert readings_gpu.layer_passes(calm).empty
    # raise one layer's dQ error above the level from the second logged step after 0 on
    steps = dq.sel(run=flash, member="a", layer=1).dropna("step")
    steps = steps["step"].values[steps["step"].values > 0]
    first, top = int(steps[1]), int(steps[-1])
    raised = dq.copy()
    for k, st in enumerate(steps[1:]):
        raised.loc[dict(run=flash, member="a", layer=1, step=st)] = 0.2 + 0.1 * k
    passes = readings_gpu.layer_passes(calm.assign({gpu_training.GPU_DQ_METRIC: raised}))
    assert len(passes) == 1  # layer 1 of the flash run only: the FP32 run's dQ error is 0
    row = passes.iloc[0]
    assert (row["run"], row["attention"], row["layer"], row["pass_step"]) == (flash, "sdpa:flash@bf16", 1, first)
    assert (row["top_dq_rel_err"], row["top_step"]) == (pytest.approx(0.2 + 0.1 * (len(steps) - 2)), top)
    assert row["other_layers_max_dq"] == pytest.approx(0.01)


def test_study04_sets_a_layer_that_passed_beside_the_same_layer_of_its_setting(records):
    ds = gpu_training.gpu_training_dataset(records, mech=None, level=0.1)
    flash, fp32 = "lm_s04_flash_lr1e-3_s0_d0", "lm_s04_fp32_lr1e-3_s0_d0"
    dq = ds[gpu_training.GPU_DQ_METRIC]
    calm = ds.assign({gpu_training.GPU_DQ_METRIC: xr.where((dq["run"] == flash) & dq.notnull(), 0.01, dq).transpose(*dq.dims)})
    assert readings_gpu.layer_passes(calm).empty
    steps = calm[gpu_training.GPU_DQ_METRIC].sel(run=flash, member="a", layer=1).dropna("step")["step"].values
    steps = steps[steps > 0]
    first = int(steps[2])
    raised = calm[gpu_training.GPU_DQ_METRIC].copy()
    for st in steps[2:]:
        raised.loc[dict(run=flash, member="a", layer=1, step=st)] = 0.5
    # the two tiny runs share one setting: one of its two runs passed, and the FP32 run's layer 1 is read at that step
    passed = calm.assign({gpu_training.GPU_DQ_METRIC: raised})
    assert list(readings_gpu.layer_passes(passed)[["run", "layer", "pass_step"]].itertuples(index=False, name=None)) \
        == [(flash, 1, first)]
    km = float(ds["key_mean_norm"].sel(run=fp32, member="a", layer=1, step=first))
    (beside,) = readings_gpu.same_layer_elsewhere(passed, flash, 1, first).to_dict("records")
    assert (beside["run"], beside["attention"], beside["read_at"]) == (fp32, "sdpa:math@fp32", first)
    assert beside["dq_rel_err"] == 0.0 and beside["key_mean_norm"] == pytest.approx(km) and not beside["stopped_before"]
    # a run of the setting that stopped before the step is read at its last logged step, and says so
    cut = calm.assign({gpu_training.GPU_DQ_METRIC: raised})
    for var in ("key_mean_norm", gpu_training.GPU_DQ_METRIC):
        cut[var] = cut[var].where(~((cut["run"] == fp32) & (cut["step"] >= first)))
    (beside,) = readings_gpu.same_layer_elsewhere(cut, flash, 1, first).to_dict("records")
    assert beside["stopped_before"] and beside["read_at"] < first


def test_study04_per_layer_figure_wraps_runs_into_blocks_on_one_y_axis_per_variable(records):
    ds = gpu_training.gpu_training_dataset(records, mech=None, level=0.1)
    three = xr.concat([ds, ds.isel(run=[0]).assign_coords(run=["lm_s04_copy_s0_d0"])], "run", data_vars="all")
    fig = figures.plot_gpu_dq_by_layer(three, per_row=2)
    try:
        axes = np.array(fig.axes).reshape(4, 2)  # two blocks of (dQ row, key offset row), two runs a row
        assert [ax.get_title() for ax in axes[[0, 0, 2], [0, 1, 0]]] == [str(r) for r in three["run"].values]
        assert not axes[2, 1].get_visible() and not axes[3, 1].get_visible() and axes[2, 0].get_visible()
        dq_panels = [a for a in axes[[0, 0, 2], [0, 1, 0]] if a.lines]
        assert len({a.get_ylim() for a in dq_panels}) == 1 and len(dq_panels) >= 2
        assert axes[3, 0].get_xlabel() == "optimiser step" and axes[2, 0].get_ylabel() == gpu_training.GPU_DQ_METRIC
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_results_write_with_provenance(records, tmp_path):
    from attnum.studies.late_training_gradient_blowup import experiments

    ds = gpu_training.gpu_training_dataset(records, None, 0.1)
    path = ncio.write_results(ds, tmp_path / "r.nc", study="late_training_gradient_blowup", params={},
                              variables=experiments.VARIABLES)
    back = ncio.open_results(path)
    assert back.sizes["run"] == 2 and "prov_version_torch" in back.coords
    assert np.allclose(back["dq_rel_err"].values, ds["dq_rel_err"].values, equal_nan=True)


def test_clopper_pearson_interval_for_one_growth_in_two_runs():
    low, high = readings_gpu.clopper_pearson(1, 2)
    assert low == pytest.approx(0.01258, abs=1e-5) and high == pytest.approx(0.98742, abs=1e-5)
    assert readings_gpu.clopper_pearson(0, 2)[0] == 0.0 and readings_gpu.clopper_pearson(2, 2)[1] == 1.0
    low, high = readings_gpu.clopper_pearson(0, 10)
    assert low == 0.0 and high == pytest.approx(1 - 0.025 ** 0.1)  # k = 0: 1 - (alpha/2)^(1/n)
    assert all(math.isnan(x) for x in readings_gpu.clopper_pearson(0, 0))


def test_repeat_growth_counts_the_runs_of_one_setting_and_kernel_that_grew(records):
    ds = gpu_training.gpu_training_dataset(records, None, 0.1)
    flash = "lm_s04_flash_lr1e-3_s0_d0"
    dq = ds[gpu_training.GPU_DQ_METRIC]
    calm = ds.assign({gpu_training.GPU_DQ_METRIC: xr.where((dq["run"] == flash) & dq.notnull(), 0.01, dq).transpose(*dq.dims)})
    assert len(readings_gpu.repeat_growth(calm)) == 0
    assert math.isnan(readings_gpu.strongest_repeat_growth(calm)["runs"])
    assert math.isnan(readings_gpu.strongest_repeat_growth(None)["grown"])
    # a copy of the flash run under another name: two runs of one setting and kernel, one of which grows
    twin = calm.isel(run=[0]).assign_coords(run=["lm_s04_flash_lr1e-3_b_s0_d0"])
    pair = xr.concat([calm, twin], "run", data_vars="all")
    raised = pair[gpu_training.GPU_DQ_METRIC].copy()
    steps = raised.sel(run=flash, member="a", layer=1).dropna("step")["step"].values
    raised.loc[dict(run=flash, member="a", layer=1, step=steps[-1])] = 1.5
    grow = readings_gpu.strongest_repeat_growth(pair.assign({gpu_training.GPU_DQ_METRIC: raised}))
    assert (grow["runs"], grow["grown"], grow["grown_runs"]) == (2, 1, flash)
    assert grow["largest dq_rel_err"] == 1.5 and grow["attention"] == "sdpa:flash@bf16"
    assert (grow["p low (95%)"], grow["p high (95%)"]) == pytest.approx(readings_gpu.clopper_pearson(1, 2))


def test_growth_reading_takes_the_largest_pass_and_reads_the_same_layer_of_its_setting(records):
    ds = gpu_training.gpu_training_dataset(records, None, 0.1)
    flash, fp32 = "lm_s04_flash_lr1e-3_s0_d0", "lm_s04_fp32_lr1e-3_s0_d0"
    dq = ds[gpu_training.GPU_DQ_METRIC]
    calm = ds.assign({gpu_training.GPU_DQ_METRIC: xr.where((dq["run"] == flash) & dq.notnull(), 0.01, dq).transpose(*dq.dims)})
    assert math.isnan(readings_gpu.growth_reading(calm)["growth_top_dq_rel_err"])
    assert math.isnan(readings_gpu.growth_reading(None)["repeat_dq_rel_err"])
    raised = calm[gpu_training.GPU_DQ_METRIC].copy()
    steps = raised.sel(run=flash, member="a", layer=1).dropna("step")["step"].values
    steps = steps[steps > 0]
    raised.loc[dict(run=flash, member="a", layer=1, step=steps[1])] = 0.3
    raised.loc[dict(run=flash, member="a", layer=1, step=steps[-1])] = 1.2
    out = readings_gpu.growth_reading(calm.assign({gpu_training.GPU_DQ_METRIC: raised}))
    assert (out["growth_run"], out["growth_layer"], out["growth_pass_step"]) == (flash, 1, int(steps[1]))
    assert (out["growth_top_dq_rel_err"], out["growth_top_step"]) == (1.2, int(steps[-1]))
    assert out["growth_top_key_mean_norm"] == float(ds["key_mean_norm"].sel(run=flash, member="a", layer=1, step=steps[-1]))
    assert out["growth_other_layers_max_dq"] == 0.01
    # the FP32 run is the setting's other run but not a repeat (another kernel), and there is no GProj run
    assert math.isnan(out["repeat_dq_rel_err"]) and math.isnan(out["gproj_dq_rel_err"]) and math.isnan(out["second_layer"])
    table = readings_gpu.same_layer_elsewhere(calm.assign({gpu_training.GPU_DQ_METRIC: raised}), flash, 1, int(steps[1]))
    assert list(table["run"]) == [fp32] and table["dq_rel_err"].iloc[0] == 0.0


def test_section_10_reads_a_run_gathered_before_the_one_record_schema_as_todays():
    """A gpu_training run gathered in the corpus trainer's old layout (per-block norm ``grad_norm_layer``,
    whole-model ``grad_norm``) is read by section 10 exactly as the same run in today's schema."""
    committed = ncio.committed_run("late_training_gradient_blowup", "gpu_training")
    assert committed is not None and "grad_norm_layer" not in committed and "layer" in committed["grad_norm"].dims
    old = committed.rename({"grad_norm": "_layer", "grad_norm_total": "_total"}).rename(
        {"_layer": "grad_norm_layer", "_total": "grad_norm"})
    ds = readings_gpu.records_run(None, old)
    assert "layer" in ds["grad_norm"].dims and "layer" not in ds["grad_norm_total"].dims
    np.testing.assert_array_equal(ds["grad_norm"].values, committed["grad_norm"].values)
    np.testing.assert_array_equal(ds["grad_norm_total"].values, committed["grad_norm_total"].values)
    assert readings_gpu.records_run(None, committed) is committed  # today's schema: read as it is


