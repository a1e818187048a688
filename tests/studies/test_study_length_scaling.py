"""Study 01 end to end: the smoke tier through the runner, then the publisher."""
import json

import numpy as np
import pytest

from attnum import ncio, runner
from attnum.publish import publish
from attnum.studies import length_scaling as study

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    path = runner.run("length_scaling", "smoke", outputs=outputs, progress=False)
    return outputs, path


def test_smoke_run_writes_results_figures_and_record(smoke_run):
    _, path = smoke_run
    assert (path / "notebook.ipynb").exists() and (path / "results.nc").exists()
    assert json.loads((path / "RUN.json").read_text())["status"] == "ok"
    assert {"error_vs_length.png", "block_effects.png", "causal_profile.png", "pass_rates.png",
            "stage_attribution.png"} <= {p.name for p in path.glob("*.png")}


def test_smoke_results_obey_what_must_hold(smoke_run):
    _, path = smoke_run
    ds = ncio.open_results(path / "results.nc")
    for dim in ("kernel", "policy", "dtype", "seq_len", "seed"):
        assert dim in ds["rel_l2_err"].dims
    assert ds["seq_len"].values.tolist() == [64, 128, 256]
    # fp32 error below bf16 error at every N, for every kernel, policy and seed
    for metric in ("rel_l2_err", "max_abs_err"):
        assert (ds[metric].sel(dtype="fp32") < ds[metric].sel(dtype="bf16")).all()
    assert float(ds["golden_self_max_abs_err"].max()) <= 1e-14  # golden vs itself
    assert float(ds["flash_fp64_max_abs_err"].max()) <= 1e-12
    assert np.isfinite(ds["rel_l2_err"]).all()
    rate = ds["pass_rate"]
    assert ((rate >= 0) & (rate <= 1)).all() and set(rate["rule"].values) == {
        "fixed_0.1pct", "dynamic_threshold", "reference_relative"}
    assert set(ds["stratum"].values) == {"first_10pct", "middle_80pct", "last_10pct"}
    # rounding attribution: keeping only the output in the low format is the smallest error at every N
    attr = ds["attribution_rel_l2_err"].sel(attribution_dtype="bf16", kernel="flash")
    assert (attr.sel(variant="only_output") <= attr.sel(variant="all_low")).all()
    frac = ds["p_below_min_normal_frac"]
    assert (frac.sel(attribution_dtype="bf16") == 0).all() and (frac.sel(attribution_dtype="fp16") > 0).all()
    assert ds["passes"].dtype == np.int8  # nothing was padded by the merge of the experiments
    params = json.loads(ds.attrs["parameters"])
    assert params["seq_lens"] == [64, 128, 256] and ds.attrs["study"] == "length_scaling"


def test_published_index_lists_the_run(smoke_run):
    outputs, path = smoke_run
    index = publish(outputs)
    html = index.read_text()
    assert "length_scaling/smoke" in html and "results.nc" in html
    site_run = index.parent / "length_scaling" / "smoke"
    assert (site_run / "notebook.html").stat().st_size > 10_000
    assert (site_run / "results.nc").exists()
    assert "Length scaling" in html


def test_sweep_writes_one_folder_per_point_and_runs_merge_by_coordinates(tmp_path):
    tiny = {"dtypes": ["fp32"], "block_configs": ["32x32"], "loop_orders": ["q_outer"], "block_seeds": [0],
            "attribution_seq_lens": [256], "attribution_dtypes": ["bf16"], "attribution_query_rows": 8}
    paths = runner.sweep("length_scaling", {"head_dim": [16, 32]}, "smoke", tiny, outputs=tmp_path,
                         progress=False)
    assert [p.name.rsplit("@", 1)[-1] for p in paths] == ["head_dim=16", "head_dim=32"]  # "@" marks sweep points
    merged = ncio.open_study("length_scaling", root=tmp_path)
    assert merged["head_dim"].values.tolist() == [16, 32]
    assert merged["rel_l2_err"].dims[0] == "head_dim"
    assert np.isfinite(merged["rel_l2_err"]).all()
    # runs differ in their parameters: the merge must not pretend they share the first run's
    assert "parameters" not in merged.attrs


def test_real_kernel_sweep_records_refusals_and_finds_the_emulator_in_itself():
    # an emulator configuration, taken as a "real" kernel, must be reproduced bit for bit by that configuration
    ds = study.real_kernel_sweep(["emulator:fa2_bf16:bk32:bq128", "sdpa:math", "sdpa:cudnn"], [64, 96], ["bf16"],
                                 [16], [False, True], [0], block_ks=(32, 64), progress=False)
    bits = ds["real_bitwise_equal"].sel(real_kernel="emulator:fa2_bf16:bk32:bq128")
    assert (bits.sel(fidelity_config="bk32") == 1).all()
    assert (ds["real_error_corr"].sel(real_kernel="emulator:fa2_bf16:bk32:bq128", fidelity_config="bk32") > 0.999).all()
    assert float(bits.sel(fidelity_config="bk64").min()) < 1  # another key block rounds differently
    best = study.best_fidelity(ds)
    assert set(best[best["kernel"] == "emulator:fa2_bf16:bk32:bq128"]["best emulator config"]) == {"bk32"}
    status = ds["real_status"].sel(real_kernel="sdpa:cudnn").values.ravel()
    assert all(s.startswith("unavailable:") and "CUDA" in s for s in status)
    assert ds["real_rel_l2_err"].sel(real_kernel="sdpa:cudnn").isnull().all()
    math_err = ds["real_rel_l2_err"].sel(real_kernel="sdpa:math")
    assert ((math_err > 0) & (math_err < 1e-2)).all()  # bf16 inputs and output: about the unit roundoff
    assert set(ds["rule"].values) == {"fixed_0.1pct", "dynamic_threshold", "reference_relative"}
