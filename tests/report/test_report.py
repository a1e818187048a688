"""The report on the CPU: the emulator, a correct user function and two broken ones, each verdict by value."""
import json

import numpy as np
import pytest

from attnum import cli, report
from attnum.report import experiments, rates, readings

TINY = dict(forward_seq_lens=[64, 128], forward_dtypes=["bf16"], forward_head_dims=[32], forward_causal=[0],
            forward_seeds=[0], forward_heads=1,
            extreme_inputs=["normal", "fully_masked_rows", "special_values"], extreme_dtypes=["bf16"],
            extreme_seq_len=64, extreme_head_dim=32,
            backward_sharpness=[1.0], backward_mu_norms=[0.0, 1000.0], backward_seq_len=64, backward_head_dim=32,
            backward_seeds=[0], speed_seq_len=64, speed_head_dim=32, speed_heads=1, speed_repeats=1,
            helper_seq_lens=[64], helper_seeds=[0])
UNDER_TEST = ["emulator:fa2_bf16:bk64", "user_kernels:correct", "user_kernels:sentinel_5e4", "user_kernels:softmax_bf16"]


@pytest.fixture(scope="module")
def ds():
    return experiments.measure(UNDER_TEST, ["sdpa:math"], TINY, progress=False)


def test_each_kernels_verdicts(ds):
    s = readings.summary_table(ds)
    got = {k: (s.loc[k, "verdict"], s.loc[k, "forward"], s.loc[k, "extremes"], s.loc[k, "backward dQ"]) for k in s.index}
    assert got == {
        "emulator:fa2_bf16:bk64": ("normal", "within band", "as the emulator", "grows"),
        "user_kernels:correct": ("normal", "within band", "as the emulator", "flat"),
        "user_kernels:sentinel_5e4": ("abnormal", "within band", "departs", "flat"),
        "user_kernels:softmax_bf16": ("abnormal", "above band", "departs", "grows"),
        "sdpa:math": ("normal", "within band", "as the emulator", "flat"),
    }
    assert list(s["under test"]) == [True] * 4 + [False]
    assert s.loc["user_kernels:softmax_bf16", "worst error ratio"] > readings.FACTOR
    assert s.loc["user_kernels:correct", "worst error ratio"] < 1  # fp32 inside: below the emulator's error


def test_the_numbers_behind_the_verdicts(ds):
    f = readings.forward_verdict(ds, "emulator:fa2_bf16:bk64")
    assert f["measured"] == 1.0 and f["ratio_max"] == float(ds["fwd_ratio"].sel(kernel="emulator:fa2_bf16:bk64").max())
    e = readings.extreme_verdict(ds, "user_kernels:sentinel_5e4")
    assert e["inputs"] == "fully_masked_rows (bf16)" and e["masked_rows_given_weight"] > 0
    assert readings.extreme_verdict(ds, "user_kernels:correct")["masked_rows_given_weight"] == 0
    b = readings.backward_verdict(ds, "user_kernels:softmax_bf16")
    dq = ds["bwd_mech_dq_err"].sel(kernel="user_kernels:softmax_bf16").squeeze()
    assert b["growth"] == pytest.approx(float(dq.sel(bwd_mu_norm=1000.0) / dq.sel(bwd_mu_norm=0.0)))
    assert b["growth"] > readings.FACTOR > readings.backward_verdict(ds, "user_kernels:correct")["growth"]


def test_the_reference_relative_rule_misses_both_broken_kernels(ds):
    t = readings.acceptance_table(ds, readings.overall_verdicts(ds))
    assert t.loc[("user_kernels:softmax_bf16", "reference_relative"), "outcome"] == "missed"
    assert t.loc[("user_kernels:sentinel_5e4", "reference_relative"), "outcome"] == "missed"
    assert t.loc[("user_kernels:correct", "reference_relative"), "outcome"] == "agrees"
    assert t.loc[("user_kernels:correct", "fixed_0.1pct"), "outcome"] == "false alarm"  # bf16's u is above 0.1%


def test_speed_and_values(ds):
    t = readings.speed_table(ds)
    assert (t["status"] == "ok").all() and (t["forward ms"] > 0).all()
    v = readings.values(ds, None, {"ratio_max": 1.4}, {"alarms_fixed_bf16": 1.0})
    assert (v["rp_kernels"], v["rp_against"], v["rp_normal"], v["rp_abnormal"]) == (4, 1, 2, 2)
    assert (v["rp_n_min"], v["rp_n_max"], v["rp_band_ratio_max"], v["rp_s01_alarms_fixed_bf16"]) == (64, 128, 1.4, 1.0)
    assert v["rp_rules_missing"] == 2


def test_helper_rates_on_correct_kernels_and_faults():
    r = rates.helper_rates([64], [0], head_dim=32, heads=1, faults=("dropped_tail", "off_by_one_causal"),
                           causal_modes=(True,), progress=False)
    alarms = r["helper_false_alarm"].values
    assert np.isfinite(alarms).all() and alarms.sum() == 0
    missed = r["helper_missed"].sel(helper_fault="dropped_tail", helper_level=3).values
    assert missed.tolist() == [[[0.0]]]
    t = readings.helper_rates_table(r)
    assert t.loc[("correct kernel", "sdpa:math"), "rate"] == 0.0


def test_bad_kernels_are_refused_before_any_measurement(tmp_path):
    with pytest.raises(report.ReportError, match="no_such_family"):
        report.check_kernels(["no_such_family:x"], "cpu")
    with pytest.raises(report.ReportError, match="user_kernels:lost_row"):
        report.check_kernels(["user_kernels:lost_row"], "cpu")
    with pytest.raises(report.ReportError, match="unknown report parameter"):
        report.run_report(["sdpa:math"], overrides={"nope": 1}, outputs=tmp_path)
    assert cli.main(["report", "no_such_family:x", "--outputs", str(tmp_path)]) == 2
    assert report.report_name(["user_kernels:correct", "sdpa:math"]) == "user_kernels-correct+sdpa-math"
    assert report.load_tier("quick")["forward_dtypes"] == ["bf16", "fp16"]


@pytest.mark.slow
def test_the_report_notebook_end_to_end(tmp_path):
    """papermill, results.nc with its provenance, every glued key the markdown names, the HTML page."""
    import nbformat

    from attnum import glue
    from attnum.ncio import open_results

    folder = report.run_report(["user_kernels:softmax_bf16"], overrides=TINY, outputs=tmp_path, progress=False)
    ds = open_results(folder / "results.nc")
    assert ds.attrs["study"] == "report" and ds.attrs["git_commit"]
    assert json.loads(ds.attrs["parameters"])["kernel_names"] == ["user_kernels:softmax_bf16"]
    assert "torch" in json.loads(ds.attrs["package_versions"])
    executed = nbformat.read(str(folder / "notebook.ipynb"), as_version=4)
    assert glue.missing_keys(executed) == set()
    assert glue.read_glued(executed)["rp_abnormal"] == 1
    assert (folder / "report.html").stat().st_size > 10000


def test_study01_alarms_are_the_studys_own_numbers():
    """The report reads only study 01's false-alarm table of its GPU run; the values are those of the study's
    ``real_kernel_values`` (which builds further tables the report does not state)."""
    from attnum.ncio import committed_run
    from attnum.studies.length_scaling.readings import current_form
    from attnum.studies.length_scaling.real_kernels import LONG_SEQUENCE_MIN, real_kernel_values

    run = current_form(committed_run("length_scaling", "gpu"))
    mine, study = readings.study01_alarms(run, LONG_SEQUENCE_MIN), real_kernel_values(run, LONG_SEQUENCE_MIN)
    assert mine == {k: v for k, v in study.items() if k.startswith("alarms_") or k == "commit"}
    assert mine["alarms_fixed_bf16"] is not None
    assert set(readings.study01_alarms(None, LONG_SEQUENCE_MIN).values()) == {None}


def test_the_html_page_leaves_out_the_glue_records(tmp_path, recwarn):
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    record = new_output("display_data", data={"application/papermill.record/text/plain": "3"},
                        metadata={"scrapbook": {"name": "rp_x", "mime_prefix": "application/papermill.record/"}})
    nb = new_notebook(cells=[new_code_cell("glue", outputs=[record]), new_markdown_cell("x = {glue:text}`rp_x`")])
    nbformat.write(nb, str(tmp_path / "nb.ipynb"))
    page = report.write_html(tmp_path / "nb.ipynb", tmp_path / "page.html").read_text()
    assert "x = 3" in page
    assert not [w for w in recwarn if "not able to be represented" in str(w.message)]
