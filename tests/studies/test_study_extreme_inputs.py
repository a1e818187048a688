"""Study 02 end to end: the smoke tier through the runner into a private outputs folder."""
import json

import numpy as np
import pytest

from attnum import acceptance, ncio, runner
from attnum.kernels.faults import FAULTS
from attnum.inputs import INPUT_FAMILIES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    path = runner.run("extreme_inputs", "smoke", outputs=outputs, progress=False)
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
