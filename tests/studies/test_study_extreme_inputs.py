"""Study 02 end to end: the smoke tier through the runner into a private outputs folder."""
import json

import numpy as np
import pytest

import attnum.runs.params  # noqa: F401  (runs.params below)

from attnum import acceptance, ncio, runs
from attnum.kernels.faults import FAULTS
from attnum.inputs import INPUT_FAMILIES
from attnum.studies.extreme_inputs import detection, experiments, readings, readings_gpu, real_kernels

# the sizes the experiments take (no defaults there: the notebook's parameters cell states them)
SIZES = dict(batch=1, heads=1, head_dim=64, block_q=128, block_k=128, device="cpu", golden_chunk=1024)


def sizes(**kw):
    return {**SIZES, **kw}


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    path = runs.run("extreme_inputs", "smoke", outputs=outputs, progress=False)
    return path, ncio.open_results(path / "results.nc")


def test_smoke_run_writes_results_figures_and_record(smoke):
    path, ds = smoke
    assert json.loads((path / "RUN.json").read_text())["status"] == "ok"
    figures = {p.name for p in path.glob("*.png")}
    assert {"sentinels.png", "sentinel_onset.png", "detection.png",
            "miss_rates.png", "real_kernels.png"} <= figures
    assert ds.attrs["headline_figure"] in figures and ds.attrs["study"] == "extreme_inputs"
    assert isinstance(json.loads(ds.attrs["kernel_exceptions"]), list)
    assert int(ds["kernel_exception"].sum()) == 0 and int(ds["det_fault_exception"].sum()) == 0


def test_finiteness_tables_have_the_expected_dims_and_obey_what_must_hold(smoke):
    _, ds = smoke
    dims = ("family", "kernel", "policy", "dtype", "seq_len", "seed")
    for var in ("nan_where_golden_finite", "inf_where_golden_finite", "finite_where_golden_nonfinite",
                "finite_rel_l2_err", "zero_rows", "nonzero_rows", "kernel_exception"):
        assert ds[var].dims == dims, var
    assert list(ds["family"].values) == list(INPUT_FAMILIES) and list(ds["seq_len"].values) == [64, 129]
    fa2 = ds.sel(policy="fa2")
    # finite inputs in range give finite outputs under the production policy, and agree with golden
    for family in ("normal", "normal_sigma10", "outliers", "sawtooth", "pulse", "sparse", "logit_targeted",
                   "fp16_max", "fully_masked_rows"):
        sub = fa2.sel(family=family)
        assert int((sub["nan_where_golden_finite"] + sub["inf_where_golden_finite"]).sum()) == 0, family
        assert float(ds["golden_nonfinite"].sel(family=family).max()) == 0, family
    for family in ("special_values", "seed000_mix"):  # a NaN in K makes every exact output row NaN
        assert float(ds["golden_nonfinite"].sel(family=family).min()) > 0
    assert float(ds["finite_max_abs_err"].sel(family="zeros").max()) == 0.0
    assert int(ds["zero_rows"].sel(family="fully_masked_rows").sum()) == 0
    assert int(ds["nonzero_rows"].sel(family="fully_masked_rows").sum()) == 0  # masked rows give 0, not NaN
    assert float(fa2["masked_key_influence"].sel(family="masked_huge_scores").max()) == 0.0
    amp = ds["amplification"].sel(family="normal")
    assert np.allclose(amp.values[np.isfinite(amp.values)], 1.0)
    assert float(ds["input_overflow"].sel(family="pm_1e6", dtype="fp16").min()) > 0  # 1e6 is beyond fp16
    assert float(ds["input_overflow"].sel(family="pm_1e6", dtype="bf16").max()) == 0


def test_overflow_and_sentinel_tables_obey_what_must_hold(smoke):
    _, ds = smoke
    assert float(ds["overflow_golden_value"]) == 65504.0
    nan = ds["overflow_nan_fraction"]
    assert float(nan.sel(overflow_kernel="textbook", score_format="fp32", max_subtraction="yes")) == 0.0
    assert float(nan.sel(overflow_kernel="textbook", score_format="fp16", max_subtraction="yes")) == 1.0
    zero = ds["sentinel_zero_row_fraction"].sel(sentinel_policy=["fa2_bf16", "fa2_fp16"])
    assert ds["sentinel_zero_row_fraction"].dims == ("mask_handling", "case", "sentinel_policy", "seed")
    below = [c for c in ds["case"].values if c.startswith("logit_") and float(c[6:]) <= -5.5e4]
    assert float(zero.sel(mask_handling="fill_-5e4", case=below).min()) == 1.0  # FlashInfer's zero rows
    assert float(zero.sel(mask_handling="fill_-inf").sel(case=[c for c in ds["case"].values
                                                               if c.startswith("logit_")]).max()) == 0.0
    assert float(zero.sel(mask_handling="fill_-5e4", case="logit_-10000").max()) == 0.0
    nonzero = ds["sentinel_nonzero_row_fraction"].sel(case="fully_masked")
    assert float(nonzero.sel(mask_handling="fill_-inf").max()) == 0.0
    assert float(ds["sentinel_nan_fraction"].sel(case="fully_masked", mask_handling="softmax_unguarded").min()) > 0
    leak = ds["sentinel_masked_key_influence"].sel(case="masked_huge", sentinel_policy="fa2_bf16")
    assert float(leak.sel(mask_handling="additive_-1e4").min()) > 0 and float(leak.sel(mask_handling="fill_-inf").max()) == 0
    assert ds["onset_row_zero"].dims == ("onset_logit", "sentinel_policy", "row")


def test_detection_tables_have_the_expected_dims_and_obey_what_must_hold(smoke):
    _, ds = smoke
    assert ds["det_detected"].dims == ("rule", "fault", "severity_level", "det_family", "det_seq_len", "det_dtype",
                                       "det_seed")
    assert ds["det_false_alarm"].dims == ("rule", "det_family", "det_seq_len", "det_dtype", "det_seed")
    assert list(ds["rule"].values) == list(acceptance.DETECTION_RULES)
    assert list(ds["fault"].values) == list(FAULTS)
    for var in ("det_detected", "det_false_alarm", "det_fault_changed"):
        assert set(np.unique(ds[var].values)) <= {0, 1}, var
    # a fault that changed nothing gets the correct kernel's verdict, for every rule
    unchanged = (ds["det_fault_changed"] == 0)
    same = (ds["det_detected"] == ds["det_false_alarm"]).where(unchanged)
    assert float(same.min()) == 1.0
    # the LSE fault leaves O bit for bit: rules that read only O give the correct kernel's verdict
    lse = ds.sel(fault="low_precision_lse")
    for rule in ("fixed_0.1pct", "dynamic_threshold", "reference_relative", "scaled_elementwise"):
        assert (lse["det_detected"].sel(rule=rule) == lse["det_false_alarm"].sel(rule=rule)).all(), rule
    for var in ("det_detection_rate", "det_false_alarm_rate", "det_miss_rate"):
        vals = ds[var].values[np.isfinite(ds[var].values)]
        assert ((vals >= 0) & (vals <= 1)).all(), var
    for fault in ds["fault"].values:
        assert ds["severity"].sel(fault=fault, severity_level=int(ds["default_level"].sel(fault=fault))).item() == \
            FAULTS[str(fault)].default_severity
    params = json.loads(ds.attrs["parameters"])
    assert params["det_seq_lens"] == [64, 256] and list(ds["det_seq_len"].values) == [64, 256]


def test_real_kernel_tables_record_every_kernel_input_and_mask_and_obey_what_must_hold(smoke):
    _, ds = smoke
    params = json.loads(ds.attrs["parameters"])
    dims = ("real_kernel", "real_dtype", "real_input", "real_mask")
    for var in ("real_status", "real_nan_fraction", "real_zero_rows", "real_rows_attend_masked", "real_rel_l2_err"):
        assert ds[var].dims == dims, var
    assert list(ds["real_kernel"].values) == params["real_kernels"] == ["sdpa:flash", "sdpa:math"]
    assert list(ds["real_input"].values) == params["real_inputs"]
    assert list(ds["real_mask"].values) == ["none"] + params["real_masks"]
    assert int(ds["real_seq_len"]) == params["real_seq_len"]
    status = ds["real_status"]
    # on a CPU both backends run every applicable point; the rest is marked, never left empty
    assert bool((status.str.startswith("not applicable") | (status == "ok")).all())
    masked_inputs = {"masked_huge_scores", "fully_masked_rows", "nan_in_masked_key", "nan_in_masked_value"}
    for inp in ds["real_input"].values:
        ran = status.sel(real_input=inp) == "ok"
        want = ["bool", "-inf", "-5e4", "finfo_min"] if inp in masked_inputs else ["none"]
        assert sorted(ds["real_mask"].values[ran.all(["real_kernel", "real_dtype"]).values]) == sorted(want), inp
    # fully masked rows: 0 with a boolean or -inf mask; with finite sentinels not 0 (attending masked keys)
    fm = ds.sel(real_input="fully_masked_rows")
    n_masked = fm["real_masked_rows"]
    exact = fm.sel(real_mask=["bool", "-inf"])
    assert (exact["real_masked_rows_zero"] == n_masked).all() and (exact["real_masked_rows_nan"] == 0).all()
    finite = fm.sel(real_mask=["-5e4", "finfo_min"])
    assert (finite["real_rows_attend_masked"] == n_masked).all()
    # masked keys scoring 1e5 get no weight under any delivery; finite inputs give no NaN where golden is finite
    assert float(ds["real_rows_attend_masked"].sel(real_input="masked_huge_scores").max()) == 0
    for inp in ("normal", "outliers", "sawtooth", "logit_targeted", "masked_huge_scores"):
        assert float(ds["real_nonfinite_where_golden_finite"].sel(real_input=inp).max()) == 0, inp
    # the pairs: a kernel against itself differs nowhere
    for name in ds["real_kernel"].values:
        self_pair = ds.sel(real_kernel=name, real_other_kernel=name)
        assert float(self_pair["real_pair_max_abs_diff"].max()) == 0.0
        assert float(self_pair["real_pair_nonfinite_mismatch"].max()) == 0.0
        assert float(self_pair["real_pair_zero_row_mismatch"].max()) == 0.0


# -- one faulty row and a fixed tolerance --------------------------------------------------------------

def test_row_fault_totals_match_the_metrics_on_the_explicit_faulty_output():
    import torch

    from attnum.metrics import mean_rel_error, rel_l2_error, row_rel_l2
    from attnum.studies.extreme_inputs.detection import _RowFault

    g = torch.Generator().manual_seed(3)
    gold = torch.randn(1, 2, 50, 8, dtype=torch.float64, generator=g)
    out = gold * (1 + 1e-4 * torch.randn(gold.shape, dtype=torch.float64, generator=g))
    rf = _RowFault(out, gold, rows=3)
    for e in (0.0, 0.05, 0.12, 2.0):
        faulty = out.clone()
        faulty[0, 0, -3:, :] *= 1 + e
        errs = rf.errors(e)
        assert errs["rel_l2"] == pytest.approx(rel_l2_error(faulty, gold), rel=1e-9)
        assert errs["mean_rel"] == pytest.approx(mean_rel_error(faulty, gold), rel=1e-9)
        assert errs["worst_row"] == pytest.approx(row_rel_l2(faulty, gold)[0, 0, -3:].max().item(), rel=1e-9)
    for metric in ("rel_l2", "mean_rel"):
        big = rf.largest_accepted(metric)
        assert rf.errors(big)[metric] <= 1e-3 < rf.errors(big * 1.001)[metric]
    assert np.isnan(_RowFault(out * 1.01, gold, rows=3).largest_accepted("rel_l2"))  # correct output rejected


def test_dilution_experiment_dilutes_one_row_by_rows_in_the_mean_and_by_sqrt_rows_in_l2():
    ds = detection.dilution_experiment([64, 1024], ["fp32"], [0], [0.12], [1, 16],
                                   **sizes(block_q=32, block_k=32, golden_chunk=256), progress=False)
    assert ds["dil_fault_err"].dims == ("dil_metric", "dil_faulty_rows", "dil_row_error", "dil_seq_len",
                                        "dil_dtype", "dil_seed")
    big = ds["dil_largest_accepted"].sel(dil_dtype="fp32", dil_seed=0)
    # mean relative error: the largest accepted row error grows in proportion to the rows (16x here)
    growth = big.sel(dil_metric="mean_rel") .sel(dil_seq_len=1024) / big.sel(dil_metric="mean_rel").sel(dil_seq_len=64)
    assert np.allclose(growth.values, 16, rtol=0.05)
    # relative L2: by about sqrt(rows) for a block of rows (4x), far less than the mean's 16x
    l2 = big.sel(dil_metric="rel_l2", dil_faulty_rows=16)
    assert 2.5 < float(l2.sel(dil_seq_len=1024) / l2.sel(dil_seq_len=64)) < 6
    # at fp32 the correct output passes both; a 12% error in one row of 1024 passes the mean rule, not the L2 rule
    acc = ds["dil_fault_accepted"].sel(dil_dtype="fp32", dil_seed=0, dil_row_error=0.12, dil_faulty_rows=1,
                                       dil_seq_len=1024)
    assert int(acc.sel(dil_metric="mean_rel")) == 1 and int(acc.sel(dil_metric="rel_l2")) == 0
    assert (ds["dil_correct_accepted"] == 1).all()
    summary = readings.dilution_summary(ds)
    assert summary.loc[("fp32", 1, "mean_rel"), "misses at N"] == "1024"


def test_smoke_run_has_the_dilution_experiment_and_both_metrics_in_the_detection_sweep(smoke):
    path, ds = smoke
    assert (path / "dilution.png").exists()
    params = json.loads(ds.attrs["parameters"])
    assert list(ds["dil_seq_len"].values) == params["dilution_seq_lens"]
    assert list(ds["dil_metric"].values) == ["rel_l2", "mean_rel"]
    err, acc = ds["dil_fault_err"], ds["dil_fault_accepted"]
    assert ((acc == 1) == (err <= 1e-3)).where(err.notnull()).fillna(True).all()
    # a larger error in the same rows is never easier to accept
    assert (err.diff("dil_row_error") >= 0).where(err.diff("dil_row_error").notnull()).fillna(True).all()
    rows = ds["dil_rows"].values
    assert list(rows) == [int(params["batch"]) * int(params["heads"]) * n for n in params["dilution_seq_lens"]]
    for var in ("det_fault_mean_rel_err", "det_correct_mean_rel_err"):
        vals = ds[var].values
        assert (vals[np.isfinite(vals)] >= 0).all() and np.isfinite(vals).any(), var
    table = readings.fixed_tolerance_by_metric(ds)
    assert set(table.index.get_level_values("metric")) == {"rel_l2", "mean_rel"}


def test_gpu_readback_helpers_on_the_cpu_run(smoke, tmp_path, monkeypatch):
    import shutil

    path, ds = smoke
    summary = real_kernels.real_kernel_summary(ds)
    assert list(summary.index) == [(k, d) for k in ds["real_kernel"].values for d in ds["real_dtype"].values]
    # a NaN in a padding key poisons every row in both CPU backends (section 7), whatever the mask
    for key in summary.index:
        assert "nan_in_masked_key" in summary.loc[key, "NaN/inf where golden finite"]
        assert summary.loc[key, "no output"] == "none"
    beside = real_kernels.emulator_beside_real(ds)
    assert set(beside.index.get_level_values("input")) == set(ds["family"].values) & set(ds["real_input"].values)
    assert beside.loc[("bf16", "normal")].iloc[0][0].isdigit()  # the emulator's error on N(0, 1) inputs, a number
    findings = readings_gpu.real_findings_table(ds)
    padding = findings.loc[("bf16", "nan_in_masked_key", "bool")]
    assert padding["sdpa:flash"] == "NaN 100%" and padding["sdpa:math"] == "NaN 100%"
    assert "normal" not in findings.index.get_level_values("input")  # N(0, 1) inputs: every kernel as golden
    # the committed-run loader: nothing there -> None; a CPU run there -> None (not a GPU run); a results
    # file without its record is a damaged run, named, never read
    monkeypatch.setenv("ATTNUM_ROOT", str(tmp_path))
    monkeypatch.delenv("ATTNUM_OUTPUTS", raising=False)
    assert real_kernels.load_gpu_run() is None
    shutil.copytree(path, tmp_path / "outputs" / "extreme_inputs" / "gpu")
    assert real_kernels.load_gpu_run() is None
    (tmp_path / "outputs" / "extreme_inputs" / "gpu" / "RUN.json").unlink()
    with pytest.raises(ncio.DamagedRunError, match="extreme_inputs/gpu: RUN.json is missing"):
        real_kernels.load_gpu_run()


def test_real_kernel_readings_on_the_cpu_run(smoke):
    _, ds = smoke
    # both CPU backends return 0 on fully masked rows under a boolean mask and a -inf bias (section 7)
    fully = readings_gpu.real_fully_masked_table(ds)
    for mask in ("bool", "-inf"):
        assert (fully.loc[(mask, "zero")] == 1.0).all() and (fully.loc[(mask, "nan")] == 0.0).all()
    # a finite sentinel: every fully masked row is an average over the masked keys, not 0 (section 7)
    assert (fully.loc[("-5e4", "zero")] == 0.0).all() and (fully.loc[("-5e4", "masked_weight")] == 1.0).all()
    assert {"bool", "-inf"} <= set(readings_gpu.masks_zero_everywhere(ds))
    pad = readings_gpu.real_padding_nan(ds)
    assert (pad.loc["nan_in_masked_key"]["non-finite, least"] == 1.0).all()
    # two kernels only: the far-from-golden check needs three, so it checks no point
    far = readings_gpu.real_far_from_golden(ds)
    assert len(far) == 0 and far.attrs["points_checked"] == 0
    values = readings_gpu.real_values(ds, "x")
    assert values["x_padding_nan_least"] == 1.0 and values["x_seq_len"] == int(ds["real_seq_len"])
    assert values["x_departures"] == len(readings_gpu.real_findings_table(ds))
    assert readings_gpu.real_values(None, "x")["x_commit"] is None


def test_dilution_boundary_says_where_the_rule_misses():
    ds = detection.dilution_experiment([64, 1024], ["fp32"], [0], [0.01, 0.12], [1],
                                       **sizes(block_q=32, block_k=32, golden_chunk=256), progress=False)
    # 1% in one row: diluted by sqrt(1024) = 32 below 0.1% at N = 1024, not by sqrt(64) = 8 at N = 64
    row = readings.dilution_boundary(ds, row_error=0.01).loc[("fp32", 0)]
    assert row["first N missed"] == 1024 and row["last N caught"] == 64 and 64 < row["boundary N"] < 1024
    assert not row["rejects correct"]
    row = readings.dilution_boundary(ds, row_error=0.12).loc[("fp32", 0)]
    assert np.isnan(row["first N missed"]) and row["last N caught"] == 1024 and np.isnan(row["boundary N"])
    values = readings.dilution_boundary_values(ds, "d", row_error=0.01)
    assert values["d_first_missed_lo"] == 1024 and values["d_bracketed"] == 1 and values["d_n_max"] == 1024
    assert readings.typical_dilution_boundary(ds) == pytest.approx(14400.0)
    assert readings.dilution_boundary_values(None, "d")["d_boundary_lo"] is None


def test_smoke_notebook_glues_every_key_its_markdown_refers_to(smoke):
    from attnum import glue

    path, _ = smoke
    executed = json.loads((path / "notebook.ipynb").read_text())
    assert glue.referenced_keys(executed) and glue.missing_keys(executed) == set()


def test_exceptions_are_counted_per_experiment_and_fault():
    import xarray as xr

    entries = [{"count": 1, "where": f"detection narrow_p(severity=4) normal N={n} bf16 seed=0", "message": "E"}
               for n in (256, 1024)] + [{"count": 2, "where": "dilution N=64 fp16 seed=0 golden", "message": "F"}]
    table = readings_gpu.real_exceptions_by_experiment(xr.Dataset(attrs={"kernel_exceptions": json.dumps(entries)}))
    assert table.values.tolist() == [["detection narrow_p(severity=4)", 2, "E"], ["dilution N=64", 2, "F"]]


@pytest.mark.gpu
def test_bit_width_faults_run_on_cuda():
    """The committed gpu run at f934abd recorded a device-mismatch error for every point of the three
    bit-width faults (attnum.kernels.faults.round_significand); the detection sweep must run them on CUDA."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    log = experiments.ExceptionLog()
    detection.detection_sweep(["low_precision_sum", "narrow_p", "low_precision_lse"], ["normal"], [256], ["bf16"], [0],
                          causal=True, **sizes(device="cuda"), log=log, progress=False)
    assert log.counts == {}, log.to_json()


def test_the_study_package_is_light():
    import subprocess
    import sys

    code = "import sys, attnum.studies.extreme_inputs as s; print('torch' in sys.modules, sorted(s.VARIABLES)[:1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False")


def test_prose_values_are_the_data_they_summarise(smoke):
    from attnum.studies.extreme_inputs import values

    _, ds = smoke
    fin = values.finiteness_values(ds)
    wrong = (ds["nan_where_golden_finite"] + ds["inf_where_golden_finite"]).sel(policy="fa2")
    assert (fin["fa2_departing"] == "none") == (float(wrong.max()) == 0)
    nan16 = ((ds["nan_where_golden_finite"] + ds["inf_where_golden_finite"]) / ds["output_size"]).sel(
        policy="all", dtype="fp16")
    assert fin["all_fp16_all_nan"].split(", ") == [str(f) for f in ds["family"].values
                                                   if float(nan16.sel(family=f).min()) == 1.0]
    over = values.overflow_values(ds)
    assert over["only_fp32_and_max"] is True and over["finite_err_max"] == 0.0 and over["head_dim"] == 128
    sent = values.sentinel_values(ds)
    zeroed = ds["sentinel_zero_row_fraction"].sel(mask_handling="fill_-5e4").min(["seed", "sentinel_policy"])
    assert len(sent["fillm5e4_zeroed"].split(", ")) == int(sum(
        float(zeroed.sel(case=c)) == 1 for c in ds["case"].values if str(c).startswith("logit_")))
    onset = values.onset_values(ds)
    table = readings.onset_table(ds)
    for pol in table.index:
        assert onset[f"onset_{pol}_predicted"] == pytest.approx(float(table.loc[pol, "predicted onset"]))
        assert onset[f"onset_{pol}_below_fill"] == pytest.approx(float(ds["onset_fill"]) - onset[f"onset_{pol}_predicted"])
    amp = values.amplification_values(ds)
    sub = ds["amplification"].sel(policy="all", dtype="bf16", family="logit_targeted")
    assert amp["amp_all_bf16_logit_targeted_hi"] == float(sub.max())
    det = values.detection_values(ds)
    assert det["correct_rel_bf16"] == float(ds["det_correct_rel_l2_err"].sel(det_dtype="bf16").median())
    assert det["det_n_max"] == int(ds["det_seq_len"].max())
    real = values.real_error_values(ds)
    cell = ds["real_rel_l2_err"].sel(real_kernel="sdpa:math", real_dtype="fp16", real_input="normal", real_mask="none")
    assert real["real_sdpa_math_fp16_normal"] == float(cell)
    assert real["real_no_output"] == 0  # both CPU backends take every delivery (section 7)
