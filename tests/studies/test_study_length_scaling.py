"""Study 01 end to end: the smoke tier through the runner, then the publisher."""
import json

import numpy as np
import pandas as pd
import pytest

import attnum.runs.params  # noqa: F401  (runs.params below)
import xarray as xr

from attnum import ncio, runs
from attnum.site import publish
import attnum.studies.length_scaling as study
from attnum.studies.length_scaling import experiments, readings, real_kernels


def test_the_package_init_is_light():
    import subprocess
    import sys

    code = ("import sys, attnum.studies.length_scaling as s; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(len(s.VARIABLES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) > 0


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    path = runs.run("length_scaling", "smoke", outputs=outputs, progress=False)
    return outputs, path


@pytest.mark.slow
def test_smoke_run_writes_results_figures_and_record(smoke_run):
    _, path = smoke_run
    assert (path / "notebook.ipynb").exists() and (path / "results.nc").exists()
    assert json.loads((path / "RUN.json").read_text())["status"] == "ok"
    assert {"error_vs_length.png", "block_effects.png", "causal_profile.png", "pass_rates.png",
            "stage_attribution.png"} <= {p.name for p in path.glob("*.png")}


@pytest.mark.slow
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
    attr = ds["attribution_rel_l2_err"].sel(attribution_dtype="bf16", kernel="emulator")
    assert (attr.sel(variant="only_output") <= attr.sel(variant="all_low")).all()
    frac = ds["p_below_min_normal_frac"]
    assert (frac.sel(attribution_dtype="bf16") == 0).all() and (frac.sel(attribution_dtype="fp16") > 0).all()
    assert ds["passes"].dtype == np.int8  # nothing was padded by the merge of the experiments
    params = json.loads(ds.attrs["parameters"])
    assert params["seq_lens"] == [64, 128, 256] and ds.attrs["study"] == "length_scaling"


@pytest.mark.slow
def test_smoke_run_holds_the_new_measurements(smoke_run):
    _, path = smoke_run
    ds = ncio.open_results(path / "results.nc")
    for var in ("mean_rel_err", "fp32_inside_rel_l2_err", "nomask_strata_rel_l2_err", "mac_rel_l2_err",
                "denominator_tail_share", "fp32_stage_rel_l2_err"):
        assert np.isfinite(ds[var]).all() and (ds[var] > 0).all(), var
    assert "golden" in ds["block_config"].values
    assert int(ds["tile_k"].sel(block_config="golden")) == experiments.golden_tile(32)[1]
    # without a mask no position stratum sees more keys than another
    ratio = ds["nomask_strata_rel_l2_err"].sel(stratum="last_10pct") / ds["nomask_strata_rel_l2_err"].sel(stratum="first_10pct")
    assert float(abs(np.log(ratio)).max()) < np.log(2)
    assert str(ds["fp32_stage_matmul_precision"].values).startswith("float32_matmul_precision=")
    assert (path / "fp32_reference_stages.png").stat().st_size > 10_000


@pytest.mark.slow
def test_the_prose_glues_every_value_it_states(smoke_run):
    from attnum import glue

    _, path = smoke_run
    executed = json.loads((path / "notebook.ipynb").read_text())
    assert glue.referenced_keys(executed) and not glue.missing_keys(executed)
    values = glue.read_glued(executed)
    ds = ncio.open_results(path / "results.nc", squeeze_sweep_dims=True)
    assert values["s01_commit"] == ds.attrs["git_commit"][:7]
    assert values["s01_emulator_all_bf16_growth"] == pytest.approx(readings.growth_values(ds)["emulator_all_bf16_growth"])
    assert values["s01_seed000_tail_share"] == 0.62  # the source's own number, glued as the source's


@pytest.mark.slow
def test_published_index_lists_the_run(smoke_run):
    outputs, path = smoke_run
    index = publish(outputs)
    html = index.read_text()
    assert "length_scaling/smoke" in html and "results.nc" in html
    site_run = index.parent / "length_scaling" / "smoke"
    assert (site_run / "notebook.html").stat().st_size > 10_000
    assert (site_run / "results.nc").exists()
    assert "Length scaling" in html


@pytest.mark.slow
def test_sweep_writes_one_folder_per_point_and_runs_merge_by_coordinates(tmp_path):
    tiny = {"dtypes": ["fp32"], "block_configs": ["32x32"], "loop_orders": ["q_outer"], "block_seeds": [0],
            "attribution_seq_lens": [256], "attribution_dtypes": ["bf16"], "attribution_query_rows": 8}
    paths = runs.sweep("length_scaling", {"head_dim": [16, 32]}, "smoke", tiny, outputs=tmp_path,
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
    ds = real_kernels.real_kernel_sweep(["emulator:fa2_bf16:bk32:bq128", "sdpa:math", "sdpa:cudnn"], [64, 96], ["bf16"],
                                 [16], [False, True], [0], block_ks=(32, 64), progress=False, batch=1, heads=2, device="cpu", golden_chunk=1024, reference_chunk=4096)
    bits = ds["real_bitwise_equal"].sel(real_kernel="emulator:fa2_bf16:bk32:bq128")
    assert (bits.sel(fidelity_config="bk32") == 1).all()
    assert (ds["real_error_corr"].sel(real_kernel="emulator:fa2_bf16:bk32:bq128", fidelity_config="bk32") > 0.999).all()
    assert float(bits.sel(fidelity_config="bk64").min()) < 1  # another key block rounds differently
    best = real_kernels.best_fidelity(ds)
    assert set(best[best["kernel"] == "emulator:fa2_bf16:bk32:bq128"]["best emulator config"]) == {"bk32"}
    status = ds["real_status"].sel(real_kernel="sdpa:cudnn").values.ravel()
    assert all(s.startswith("unavailable:") and "CUDA" in s for s in status)
    assert ds["real_rel_l2_err"].sel(real_kernel="sdpa:cudnn").isnull().all()
    math_err = ds["real_rel_l2_err"].sel(real_kernel="sdpa:math")
    assert ((math_err > 0) & (math_err < 1e-2)).all()  # bf16 inputs and output: about the unit roundoff
    assert set(ds["rule"].values) == {"fixed_0.1pct", "dynamic_threshold", "reference_relative"}


def test_real_kernel_sweep_refuses_cuda_only_kernels_on_cpu_and_records_a_refusal(monkeypatch):
    from attnum import kernels as registry
    from attnum.kernels.registry import Kernel

    class Picky(Kernel):
        """A kernel that takes head dim 16 only and refuses others by assertion, as flash-attn-4 does."""
        name = "picky"

        def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
            assert q.shape[-1] == 16, f"head dim {q.shape[-1]} not supported"
            return registry.get("sdpa:math").forward(q, k, v, causal=causal)

    get = registry.get
    monkeypatch.setattr(registry, "get", lambda name, **kw: Picky() if name == "picky" else get(name, **kw))
    ds = real_kernels.real_kernel_sweep(["fa4", "flashinfer:prefill", "picky"], [64], ["bf16"], [16, 32], [False], [0],
                                        block_ks=(32,), progress=False, batch=1, heads=1, device="cpu",
                                        golden_chunk=1024, reference_chunk=4096)
    for name in ("fa4", "flashinfer:prefill"):
        status = ds["real_status"].sel(real_kernel=name).values.ravel()
        assert all(s.startswith("unavailable:") and "CUDA" in s for s in status), status
        assert ds["real_rel_l2_err"].sel(real_kernel=name).isnull().all()
    picky = ds["real_status"].sel(real_kernel="picky").isel(real_dtype=0, real_causal=0, real_seq_len=0)
    assert str(picky.sel(real_head_dim=16).values) == "ok"
    assert str(picky.sel(real_head_dim=32).values) == "refused: AssertionError: head dim 32 not supported"
    err = ds["real_rel_l2_err"].sel(real_kernel="picky").isel(real_dtype=0, real_causal=0, real_seq_len=0)
    assert float(err.sel(real_head_dim=16).max()) > 0 and err.sel(real_head_dim=32).isnull().all()  # no fallback


def test_gpu_tier_measures_fa4_and_flashinfer_prefill():
    names = runs.load_param_set("length_scaling", "gpu")["real_kernels"]
    assert {"fa4", "flashinfer:prefill"} <= set(names)
    from attnum import kernels as registry
    assert [registry.get(n).name for n in ("fa4", "flashinfer:prefill")] == ["fa4", "flashinfer:prefill"]


# -- fast unit tests of the real-kernel and acceptance measurements -----------------------------------

import torch  # noqa: E402

from attnum import kernels  # noqa: E402
from attnum.inputs import normal_qkv  # noqa: E402
from attnum.kernels.flash import flash_attention, sequential_mac  # noqa: E402
from attnum.precision import PRESETS, get_policy, round_to  # noqa: E402


def _qkv(n=96, d=16, fmt="bf16", rows=None, seed=0):
    q, k, v = normal_qkv(1, 1, n, d, seed=seed)
    if rows:
        q = q[..., :rows, :]
    return tuple(round_to(t.float(), fmt) for t in (q, k, v))


def test_score_mac_is_off_in_every_preset_and_off_is_bit_identical():
    assert all(p.score_mac is None for p in PRESETS.values())
    q, k, v = _qkv()
    for name in ("fa2_bf16", "all_bf16", "fp32"):
        base, _ = flash_attention(q, k, v, name, block_q=32, block_k=32)
        off, _ = flash_attention(q, k, v, get_policy(name).with_score_mac(None), block_q=32, block_k=32)
        assert torch.equal(base, off)
    with pytest.raises(ValueError, match="score_mac"):
        get_policy("fa2_bf16").with_score_mac("three_roundings")


def test_sequential_mac_fused_vs_two_roundings():
    q, k, _ = _qkv(64, 32, "fp32")
    exact = q.double() @ k.double().transpose(-1, -2)
    assert torch.allclose(sequential_mac(q.double(), k.double(), "fp64", two_rounding=False), exact, rtol=0, atol=1e-12)
    fused = sequential_mac(q, k, "fp32", two_rounding=False)
    two = sequential_mac(q, k, "fp32", two_rounding=True)
    assert not torch.equal(fused, two)  # fp32 products need rounding: the second rounding shows
    assert (two.double() - exact).abs().mean() > (fused.double() - exact).abs().mean()
    qb, kb, _ = _qkv(64, 32, "bf16")  # bf16 x bf16 is exact in fp32: two roundings = one
    assert torch.equal(sequential_mac(qb, kb, "fp32", two_rounding=False), sequential_mac(qb, kb, "fp32", two_rounding=True))
    assert not torch.equal(sequential_mac(qb, kb, "bf16", two_rounding=False), sequential_mac(qb, kb, "bf16", two_rounding=True))


def test_mac_sweep_separates_the_modes_where_they_can_differ():
    ds = experiments.mac_sweep([64, 128], ["bf16", "fp32"], [0], query_rows=8, head_dim=16, block_q=32, block_k=32,
                         progress=False, batch=1, heads=1, device="cpu", golden_chunk=1024)
    err = ds["mac_rel_l2_err"].sel(mac_seed=0)
    assert np.isfinite(err).all() and (err > 0).all()
    fa2 = err.sel(policy="fa2", mac_dtype="bf16")
    assert (fa2.sel(mac="fma") == fa2.sel(mac="two_rounding")).all()  # products exact in the fp32 score format
    assert (err.sel(policy="all", mac_dtype="fp32", mac="fma") != err.sel(policy="all", mac_dtype="fp32", mac="two_rounding")).any()


def test_golden_tile_formula():
    assert experiments.golden_tile(64) == (64, 384)  # M = 98304: Bc = ceil(M / 256), Br = min(Bc, d)
    assert experiments.golden_tile(128) == (128, 192)
    assert experiments.golden_tile(64, memory=1000) == (4, 4)
    assert experiments.parse_block_config("golden", 32) == (32, 768)
    assert experiments.parse_block_config("16x64", 32) == (16, 64)
    with pytest.raises(ValueError, match="golden"):
        experiments.parse_block_config("big", 32)
    ds = experiments.block_sweep(128, ["32x32", "golden"], ["q_outer"], ["bf16"], [0], head_dim=16, progress=False, batch=1, heads=2, device="cpu", golden_chunk=1024)
    assert int(ds["tile_k"].sel(block_config="golden")) == experiments.golden_tile(16)[1]


def test_fp32_inside_reference_is_the_fp32_reference_rounded_once():
    q, k, v = _qkv(80, 16, "bf16")
    inside = kernels.reference(experiments.fp32_inside_policy("bf16")).forward(q, k, v)[0]
    fp32 = kernels.reference("fp32").forward(q, k, v)[0]
    assert torch.equal(inside, round_to(fp32, "bf16"))
    ds = experiments.length_sweep([64, 128, 256], ["bf16"], [0], head_dim=16, block_q=32, block_k=32, progress=False, batch=1, heads=2, device="cpu", golden_chunk=1024, reference_chunk=0)
    assert (ds["fp32_inside_rel_l2_err"] > 0).all()
    # the production flash kernel rounds P; the fp32-inside reference does not, so it errs less
    assert (ds["rel_l2_err"].sel(kernel="emulator", policy="fa2") > ds["fp32_inside_rel_l2_err"]).all()
    assert ((ds["mean_rel_err"] > 0) & np.isfinite(ds["mean_rel_err"])).all()


def test_staged_fp32_reference_equals_the_reference_and_each_stage_can_be_promoted():
    q, k, v = _qkv(300, 16, "fp32", rows=24)
    ref = kernels.reference("fp32").forward(q, k, v)[0]
    assert torch.equal(experiments.staged_fp32_attention(q, k, v), ref)
    gold = kernels.get("golden").forward(q, k, v)[0]
    err = lambda o: float((o.double() - gold).norm() / gold.norm())  # noqa: E731
    for stage in experiments.FP32_STAGES:
        out = experiments.staged_fp32_attention(q, k, v, fp64_stage=stage)
        assert out.dtype == torch.float32 and err(out) < 1e-6
    assert err(experiments.staged_fp32_attention(q, k, v, fp64_stage="pv")) != err(ref)
    assert not torch.equal(experiments.staged_fp32_attention(q, k, v, split="pv", chunk=64), ref)
    with pytest.raises(ValueError):
        experiments.staged_fp32_attention(q, k, v, fp64_stage="softmax")
    ds = experiments.fp32_reference_stages([128, 256], [0], query_rows=8, head_dim=16, progress=False, batch=1, heads=1, device="cpu", golden_chunk=1024)
    e = ds["fp32_stage_rel_l2_err"]
    assert list(e["fp32_stage_variant"].values) == list(experiments.FP32_STAGE_VARIANTS)
    assert (e.sel(fp32_stage_variant="reference") == e.sel(fp32_stage_variant="all_fp32")).all()
    assert ((e > 0) & (e < 1e-5)).all()
    assert "float32_matmul_precision" in str(ds["fp32_stage_matmul_precision"].values)
    values = readings.fp32_stage_values(ds)
    t = readings.fp32_stage_table(ds)
    assert values["reference_growth"] == pytest.approx(float(t.loc["reference", "longest / shortest N"]))
    assert (values["n_first"], values["n_last"]) == (128, 256) and values["sqrt_growth"] == pytest.approx(2 ** 0.5)


def test_row_sum_window_rounds_only_inside_its_window():
    # N = 100, block 10: keys 90..99 are the last 10%, i.e. block 9 alone
    l = torch.full((1, 1), 1.0 + 2.0 ** -12)  # not a bf16 number
    for window, rounded in (("every_block", set(range(10))), ("last_10pct", {9}), ("first_90pct", set(range(9)))):
        hooks = experiments._row_sum_rounder("bf16", 100, 10, window)
        got = {b for b in range(10) if not torch.equal(hooks.store_row_sum(l.clone()), l)}
        assert got == rounded, window


def test_denominator_tail_measures_the_row_sum_only():
    ds = experiments.denominator_tail([128, 512], ["bf16", "fp32"], [0], query_rows=8, head_dim=16, block_q=32,
                                block_k=32, progress=False, batch=1, heads=1, device="cpu", golden_chunk=1024)
    err = ds["denominator_rel_l2_err"]
    fp32 = err.sel(denominator_dtype="fp32")  # rounding an fp32 row sum to fp32 changes nothing
    assert (fp32 == fp32.sel(denominator_window="every_block")).all()
    bf16 = err.sel(denominator_dtype="bf16")
    assert (bf16.sel(denominator_window="every_block") > 10 * fp32.sel(denominator_window="every_block")).all()
    share = ds["denominator_tail_share"].sel(denominator_dtype="bf16")
    assert ((share > 0) & (share < 2)).all()
    values = readings.denominator_values(ds, n=512)
    med = ds["denominator_tail_share"].median("denominator_seed")
    assert values["bf16_at_n"] == pytest.approx(float(med.sel(denominator_dtype="bf16", denominator_seq_len=512)))
    assert values["fp16_at_n"] is None  # not measured here
    assert readings.denominator_values(ds)["bf16_at_n"] is None  # N = 4096 (seed 000's) was not measured
    assert (values["min"], values["max"]) == (pytest.approx(float(med.min())), pytest.approx(float(med.max())))
    # seed 000's own number (the ROCm migration report, docs/sources.md), stated as the source's
    assert readings.seed000_values(None)["seed000_tail_share"] == 0.62


def test_unmasked_strata_and_the_statement_helpers():
    lengths = experiments.summarize_lengths(experiments.length_sweep([64, 128, 256], ["bf16", "fp32"], [0, 1], head_dim=16,
                                                         block_q=32, block_k=32, progress=False, batch=1, heads=2, device="cpu", golden_chunk=1024, reference_chunk=0))
    nomask = experiments.causal_strata(128, ["bf16"], [0], head_dim=16, block_q=32, block_k=32, causal=False,
                                 progress=False, batch=1, heads=2, device="cpu", golden_chunk=1024, reference_chunk=0)
    assert {"nomask_strata_rel_l2_err", "nomask_seq_len"} <= set(nomask) and "strata_rel_l2_err" not in nomask
    table = readings.strata_table(nomask, "nomask_")
    assert (table["last / first"] > 0).all()
    assert readings.strata_table(nomask) is None
    assert readings.lacking(nomask, "strata_rel_l2_err", "nomask_strata_rel_l2_err") == ["strata_rel_l2_err"]
    strata = readings.strata_values(nomask)
    assert strata["causal_last_over_first_max"] is None
    assert strata["nomask_last_over_first_max"] == pytest.approx(float(table["last / first"].max()))
    growth = readings.growth_table(lengths)
    row = growth.loc[("emulator", "all_bf16")]
    med = lengths["rel_l2_err"].median("seed").sel(kernel="emulator", policy="all", dtype="bf16")
    assert row["last/first"] == pytest.approx(float(med.sel(seq_len=256) / med.sel(seq_len=64)))
    values = readings.growth_values(lengths)
    assert values["emulator_all_bf16_growth"] == pytest.approx(row["last/first"])
    assert values["emulator_all_bf16_exponent"] == pytest.approx(row["power-law exponent"])
    assert values["emulator_all_bf16_rise"] == ("rises at every step" if row["monotone rise"] else "does not rise at every step")
    r2 = {w: row[f"R2 {m}"] for w, m in (("a power law", "power_law"), ("√N", "sqrt_n"), ("log2 N", "log2_n"))}
    assert values["emulator_all_bf16_best_model"] == max(r2, key=r2.get)
    assert values["emulator_all_fp16_growth"] is None and set(values) == set(readings.growth_values(None))
    rate, count = readings.false_alarm_rate(lengths, "fixed_0.1pct", "emulator", "fa2", "bf16", min_len=128)
    assert count == 4 and rate == 1.0  # bf16's unit roundoff is above 0.1%: every output rejected
    comparison = readings.reference_comparison(lengths)
    assert (comparison["emulator / fp32 inside"].xs("bf16") > 1).all()
    compared = readings.reference_comparison_values(lengths)
    assert compared["bf16_over_inside_min"] == pytest.approx(float(comparison["emulator / fp32 inside"].xs("bf16").min()))
    assert compared["versus_inside"] == "larger" and compared["fp16_over_inside_min"] is None
    seed000 = readings.seed000_metric_table(lengths)
    assert seed000.loc[("fa2_bf16", 128), "seed 000, MI210 port"] != seed000.loc[("fa2_bf16", 128), "seed 000, MI210 port"]
    assert seed000["mean rel. error (seed 000's metric)"].gt(0).all()


def test_real_kernel_statements_record_what_could_not_run():
    ds = real_kernels.real_kernel_sweep(["sdpa:math", "sdpa:cudnn"], [64, 128], ["bf16"], [16], [False], [0],
                                 block_ks=(32,), progress=False, batch=1, heads=2, device="cpu", golden_chunk=1024, reference_chunk=4096)
    summary = real_kernels.real_kernel_table(ds)
    assert summary.loc["sdpa:cudnn", "no output"] == "unavailable" and pd.isna(summary.loc["sdpa:cudnn", "best configs"])
    assert pd.isna(summary.loc["sdpa:math", "no output"]) and summary.loc["sdpa:math", "best configs"] == "bk32"
    values = real_kernels.real_kernel_values(ds)
    assert values["sdpa_cudnn_no_output"] == "unavailable" and values["sdpa_cudnn_bits_min"] is None
    assert values["sdpa_math_no_output"] == "none" and values["sdpa_flash_no_output"] is None  # not in this run
    assert values["sdpa_math_bits_min"] == pytest.approx(float(summary.loc["sdpa:math", "bitwise min"]))
    assert set(values) == set(real_kernels.real_kernel_values(None))
    alarms = real_kernels.real_false_alarms(ds, min_len=128)
    assert set(alarms.index.get_level_values("kernel")) == {"sdpa:math"}
    assert (alarms["outputs"] == 1).all()
    assert float(alarms.loc[("sdpa:math", "fixed_0.1pct"), "false alarms"]) == 1.0


@pytest.mark.gpu
def test_fp32_reference_stages_on_cuda():
    ds = experiments.fp32_reference_stages([256, 1024], [0], query_rows=64, head_dim=32, device="cuda", progress=False, batch=1, heads=1, golden_chunk=1024)
    e = ds["fp32_stage_rel_l2_err"]
    assert ((e > 0) & (e < 1e-5)).all()
    assert (e.sel(fp32_stage_variant="fp64_pv") <= 2 * e.sel(fp32_stage_variant="all_fp32")).all()


def test_attribution_table_shares():
    ds = experiments.stage_attribution([256, 1024], ["bf16"], [0], query_rows=8, head_dim=16, block_q=32, block_k=32,
                                 progress=False, batch=1, heads=1, device="cpu", golden_chunk=1024)
    t = readings.attribution_table(ds)
    a = ds["attribution_rel_l2_err"].sel(kernel="emulator", attribution_dtype="bf16", attribution_seed=0)
    n = 1024
    assert t.loc[n, "removed by promote_stats"] == pytest.approx(
        1 - float(a.sel(variant="promote_stats", attribution_seq_len=n) / a.sel(variant="all_low", attribution_seq_len=n)))
    growth = float(a.sel(variant="all_low", attribution_seq_len=n) - a.sel(variant="all_low", attribution_seq_len=256))
    kept = float(a.sel(variant="promote_stats", attribution_seq_len=n) - a.sel(variant="promote_stats", attribution_seq_len=256))
    assert t.loc[n, "growth removed by promote_stats"] == pytest.approx(1 - kept / growth)
    assert np.isnan(t.loc[256, "growth removed by promote_stats"])
    values = readings.attribution_values(ds)
    assert (values["n_first"], values["n_last"]) == (256, 1024)
    assert values["removed_last"] == pytest.approx(t.loc[n, "removed by promote_stats"])
    assert values["growth_removed_last"] == pytest.approx(1 - kept / growth)
    dominant = [int(m) for m in t.index if t.loc[m, "only_stats / only_out_acc"] >= 2]
    assert values["stats_dominant_from"] == (dominant[0] if dominant else None)


def _fp32_stage_dataset(flat: tuple[str, ...], growth=(1.0, 2.0, 4.0)):
    """A made-up fp32-stage dataset: every variant grows by ``growth`` except those in ``flat``."""
    variants = list(experiments.FP32_STAGE_VARIANTS)
    err = np.array([[[1e-7 * (1.0 if v in flat else g)] for g in growth] for v in variants])
    coords = {"fp32_stage_variant": variants, "fp32_stage_seq_len": [1024, 4096, 16384], "fp32_stage_seed": [0]}
    ds = xr.Dataset({"fp32_stage_rel_l2_err": (tuple(coords), err)}, coords=coords)
    ds["fp32_stage_matmul_precision"] = "made up"
    ds.attrs["device"] = "test device"
    return ds


def test_fp32_stage_values_name_the_variants_that_remove_the_growth():
    pv = readings.fp32_stage_values(_fp32_stage_dataset(("fp64_pv", "pv_split")))
    assert pv["causes"] == "fp64_pv, pv_split" and pv["cause_stages"] == "P·V product"
    assert pv["reference_growth"] == pytest.approx(4.0) and (pv["n_first"], pv["n_last"]) == (1024, 16384)
    assert pv["sqrt_growth"] == pytest.approx(4.0) and pv["causes_growth_max"] == pytest.approx(1.0)
    assert pv["has_growth"] and pv["growth_verdict"] == "a growth to attribute"
    assert pv["others_growth_min"] == pytest.approx(4.0) and pv["others_growth_max"] == pytest.approx(4.0)
    row_sum = readings.fp32_stage_values(_fp32_stage_dataset(("fp64_sum", "sum_split")))
    assert row_sum["causes"] == "fp64_sum, sum_split" and row_sum["cause_stages"] == "row sum"
    none = readings.fp32_stage_values(_fp32_stage_dataset(()))
    assert none["causes"] == "none" and none["has_growth"]  # growth, but not in one stage
    flat = readings.fp32_stage_values(_fp32_stage_dataset((), growth=(1.0, 1.05, 1.1)))
    assert not flat["has_growth"] and flat["growth_verdict"] == "no growth to attribute" and flat["causes"] == "none"
    lacking = _fp32_stage_dataset(()).drop_vars("fp32_stage_rel_l2_err")
    assert set(readings.fp32_stage_values(lacking).values()) == {None}


def test_real_kernel_fidelity_growth_and_alarm_readings():
    import json

    real = real_kernels.real_kernel_sweep(["sdpa:math", "sdpa:cudnn"], [64, 128], ["bf16"], [16], [False, True], [0],
                                   block_ks=(32,), progress=False, batch=1, heads=2, device="cpu", golden_chunk=1024, reference_chunk=4096)
    by_n = real_kernels.fidelity_by_length(real)
    assert set(by_n.index.get_level_values("kernel")) == {"sdpa:math"}  # cudnn cannot run on a CPU
    best = real_kernels.best_fidelity(real)
    cfg = best[(best["kernel"] == "sdpa:math") & ~best["causal"]]["best emulator config"].iloc[0]
    cfg_causal = best[(best["kernel"] == "sdpa:math") & best["causal"]]["best emulator config"].iloc[0]
    bits = real["real_bitwise_equal"].sel(real_kernel="sdpa:math", real_dtype="bf16", real_head_dim=16,
                                          real_seq_len=128, real_seed=0)
    assert real["real_causal"].values.tolist() == [False, True]  # booleans, not 0/1
    expected = (float(bits.sel(real_causal=False, fidelity_config=cfg))
                + float(bits.sel(real_causal=True, fidelity_config=cfg_causal))) / 2
    assert by_n.loc[("sdpa:math", "bf16", 128), "bitwise equal"] == pytest.approx(expected)
    lengths_table = real_kernels.fidelity_length_table(real)
    assert list(lengths_table.index) == [("sdpa:math", "bf16")]
    row = lengths_table.loc[("sdpa:math", "bf16")]
    assert (row["N short"], row["N long"]) == (64, 128)
    assert row["bitwise long"] == pytest.approx(expected)
    growth = real_kernels.real_growth_table(real)
    assert set(growth.index) == {("sdpa:math", "none", "bf16"), ("sdpa:math", "causal", "bf16")}
    e = real["real_rel_l2_err"].sel(real_kernel="sdpa:math", real_causal=False, real_dtype="bf16", real_head_dim=16,
                                    real_seed=0)
    factor = float(e.sel(real_seq_len=128) / e.sel(real_seq_len=64))
    assert growth.loc[("sdpa:math", "none", "bf16"), "growth max"] == pytest.approx(factor)
    values = real_kernels.real_kernel_values(real, min_len=128)
    assert values["sdpa_math_growth_bf16_nomask_max"] == pytest.approx(factor)
    assert values["sdpa_math_bits_bf16_long"] == pytest.approx(expected)
    assert values["alarms_fixed_bf16"] == 1.0  # bf16's unit roundoff is above the fixed tolerance
    by_dtype = real_kernels.real_false_alarms_by_dtype(real, min_len=128)
    assert by_dtype.loc["fixed_0.1pct", "bf16"] == 1.0  # sdpa:cudnn gave no output: only sdpa:math counts
    assert np.isnan(real_kernels.real_false_alarms_by_dtype(real, min_len=10**6).loc["fixed_0.1pct", "bf16"])
    # the math backend against the emulated fp32-inside reference on the same inputs
    lengths = experiments.summarize_lengths(experiments.length_sweep([64, 128], ["bf16"], [0], heads=2, head_dim=16, block_q=32,
                                                         block_k=32, progress=False, batch=1, device="cpu", golden_chunk=1024, reference_chunk=0))
    run = xr.merge([lengths, real], join="outer", compat="no_conflicts")
    run.attrs["parameters"] = json.dumps({"head_dim": 16})
    math_backend = real_kernels.math_backend_values(run)
    assert math_backend["cases"] == 2 and math_backend["head_dim"] == 16
    assert 0.5 < math_backend["ratio_min"] <= math_backend["ratio_max"] < 2
    inside = lengths["fp32_inside_rel_l2_err"].median("seed").sel(dtype="bf16", seq_len=64)
    assert math_backend["ratio_min"] <= float(e.sel(real_seq_len=64) / inside) <= math_backend["ratio_max"]
    assert real_kernels.math_backend_values(run, kernel="sdpa:flash")["cases"] == 0
    assert real_kernels.math_backend_values(real)["ratio_min"] is None  # no fp32_inside_rel_l2_err


def test_real_causal_is_boolean_after_the_results_file(tmp_path):
    real = real_kernels.real_kernel_sweep(["sdpa:math"], [64], ["bf16"], [16], [False, True], [0], block_ks=(32,),
                                          progress=False, batch=1, heads=1, device="cpu", golden_chunk=1024,
                                          reference_chunk=4096)
    path = ncio.write_results(real, tmp_path / "results.nc", study="length_scaling", params={},
                              variables=study.VARIABLES)
    back = ncio.open_results(path)
    assert back["real_causal"].dtype == bool and back["real_causal"].values.tolist() == [False, True]
    np.testing.assert_array_equal(back["real_rel_l2_err"].sel(real_causal=True).values,
                                  real["real_rel_l2_err"].sel(real_causal=True).values)
    assert real_kernels.boolean_coordinates(back).identical(back)  # already booleans: unchanged


def test_the_committed_gpu_runs_read_with_boolean_real_causal():
    """Runs written before ncio stored booleans have real_causal as 0/1 integers (some committed gpu* runs; the
    committed gpu run itself, in either form, is also cast back to 0/1 here): both read back as booleans,
    value for value, through readings.current_form and committed_real_kernel_runs."""
    committed = ncio.committed_run("length_scaling", "gpu")
    if committed is None:
        pytest.skip("no committed GPU run in this checkout")
    as_ints = committed.assign_coords(real_causal=committed["real_causal"].values.astype(np.int64))
    for raw in (committed, as_ints):
        ds = readings.current_form(raw)
        assert ds["real_causal"].dtype == bool
        assert ds["real_causal"].values.tolist() == [bool(x) for x in raw["real_causal"].values]
        causal_at = [bool(x) for x in raw["real_causal"].values].index(True)
        np.testing.assert_array_equal(ds["real_rel_l2_err"].sel(real_causal=True).values,
                                      raw["real_rel_l2_err"].isel(real_causal=causal_at).values)
    assert "emulator" in ds["kernel"].values
    runs_ = real_kernels.committed_real_kernel_runs()
    assert runs_ and all(r["real_causal"].dtype == bool for r in runs_)
    assert real_kernels.math_backend_values(ds)["cases"] > 0  # selects real_causal=False
    with pytest.raises(ValueError, match="real_causal"):
        real_kernels.boolean_coordinates(xr.Dataset(coords={"real_causal": [0, 2]}))


def test_real_kernel_values_when_every_kernel_gave_output(monkeypatch):
    """A run where no kernel was refused anywhere (an H200 run whose lengths all fit sdpa:math) has a "no
    output" column of None alone, which pandas keeps as None in an object column (mixed with strings it
    becomes NaN): each reading must come out a string or None either way, and one refusal must be named."""
    real = real_kernels.real_kernel_sweep(["sdpa:math"], [64, 128], ["bf16"], [16], [False], [0], block_ks=(32,),
                                          progress=False, batch=1, heads=1, device="cpu", golden_chunk=1024,
                                          reference_chunk=4096)
    other = real.assign_coords(real_kernel=["sdpa:efficient"]).copy(deep=True)
    other["real_status"] = other["real_status"].astype(object)  # "ok" alone gives a 2-character dtype
    other["real_status"].loc[dict(real_seq_len=128)] = "refused: too long for this test"
    for name in other.data_vars:
        if name != "real_status" and "real_seq_len" in other[name].dims and other[name].dtype.kind == "f":
            other[name].loc[dict(real_seq_len=128)] = np.nan
    both = xr.concat([real, other], dim="real_kernel", data_vars="all")
    table = real_kernels.real_kernel_table(both)
    alone = real_kernels.real_kernel_table(real)  # sdpa:math only, never refused
    assert alone.loc["sdpa:math", "no output"] is None
    assert real_kernels.real_kernel_values(real)["sdpa_math_no_output"] == "none"
    as_objects = table.astype(object).where(table.notna(), None)  # None, not NaN, in the text columns
    for summary in (table, as_objects):
        monkeypatch.setattr(real_kernels, "real_kernel_table", lambda run, summary=summary: summary)
        values = real_kernels.real_kernel_values(both)
        assert values["sdpa_math_no_output"] == "none"
        assert values["sdpa_efficient_no_output"] == table.loc["sdpa:efficient", "no output"]
        assert values["sdpa_efficient_no_output"].startswith("refused")
        assert values["sdpa_flash_no_output"] is None  # not measured at all


def _contrast_run(fused_minus_unfused):
    """A real-kernel dataset of one kernel whose fused-minus-unfused bitwise share is given per case (4 cases: two
    N x two key blocks), the unfused share 0.9."""
    diff = np.asarray(fused_minus_unfused, dtype=float).reshape(2, 2)  # (key block, N)
    configs = ["bk64", "bk64:fused", "bk128", "bk128:fused"]
    bits = np.empty((1, 4, 1, 1, 1, 2, 1))
    for b in range(2):
        bits[0, 2 * b, 0, 0, 0, :, 0] = 0.9
        bits[0, 2 * b + 1, 0, 0, 0, :, 0] = 0.9 + diff[b]
    dims = ("real_kernel", "fidelity_config", "real_dtype", "real_head_dim", "real_causal", "real_seq_len", "real_seed")
    coords = dict(real_kernel=["k"], fidelity_config=configs, real_dtype=["bf16"], real_head_dim=[64],
                  real_causal=[False], real_seq_len=[256, 1024], real_seed=[0])
    return xr.Dataset({"real_bitwise_equal": (dims, bits), "real_error_corr": (dims, bits)}, coords=coords)


def test_fused_contrast_counts_cases_and_tests_the_split():
    from scipy.stats import binomtest

    run = _contrast_run([-0.01, -0.002, -0.003, 0.001])
    row = real_kernels.fused_contrast(run).loc["k"]
    assert (row["cases"], row["fused better"], row["unfused better"]) == (4, 1, 3)
    assert row["mean"] == pytest.approx(-0.0035) and (row["min"], row["max"]) == pytest.approx((-0.01, 0.001))
    assert row["best bitwise"] == pytest.approx(0.9)  # every case's unfused share
    for wins, losses in ((1, 3), (7, 57), (0, 10), (5, 5)):
        assert real_kernels._sign_test_p(wins, losses) == pytest.approx(binomtest(wins, wins + losses).pvalue)
    assert np.isnan(real_kernels._sign_test_p(0, 0))
    assert real_kernels.fused_verdict(real_kernels.fused_contrast(run), "k") == "the map does not tell the two orders apart"
    assert real_kernels.fused_verdict(real_kernels.fused_contrast(run), "other") is None
    # a tie counts for neither order; enough one-sided cases decide
    tied = real_kernels.fused_contrast(_contrast_run([0.0, 0.0, 0.0, 0.002])).loc["k"]
    assert (tied["fused better"], tied["unfused better"]) == (1, 0)
    many = xr.concat([_contrast_run([0.001] * 4).assign_coords(real_head_dim=[d]) for d in (16, 32, 64, 128)],
                     dim="real_head_dim")
    contrast = real_kernels.fused_contrast(many)
    assert contrast.loc["k", "fused better"] == 16 and contrast.loc["k", "sign p"] < real_kernels.FUSED_DECIDED_P
    assert real_kernels.fused_verdict(contrast, "k") == "the map favours the fused order"
    phrase = real_kernels.fused_reading(contrast, "k")
    assert phrase.startswith("the fused configuration matches more outputs in 16 and the unfused one in 0 of 16 cases")
    assert phrase.endswith(real_kernels.fused_verdict(contrast, "k"))


def test_reproduction_thresholds():
    high, low = real_kernels.REPRODUCED_BITS
    assert real_kernels.reproduction(high).startswith("reproduced nearly bit for bit")
    assert real_kernels.reproduction(low).startswith("not reproduced")
    assert real_kernels.reproduction((high + low) / 2).startswith("reproduced in part")
    assert real_kernels.reproduction(None) is None and real_kernels.reproduction(float("nan")) is None


def test_overlap_of_two_runs_and_the_longest_run(monkeypatch, tmp_path):
    real = real_kernels.real_kernel_sweep(["sdpa:math"], [64, 128], ["bf16"], [16], [False], [0], block_ks=(32,),
                                          progress=False, batch=1, heads=1, device="cpu", golden_chunk=1024,
                                          reference_chunk=4096)
    real.attrs["parameters"] = json.dumps({"batch": 1, "heads": 1})
    other = real.sel(real_seq_len=[128]).copy(deep=True)
    same = real_kernels.overlap_values(real, other)
    assert (same["cases"], same["equal"], same["max_rel_diff"], same["n"]) == (1, 1, 0.0, "128")
    assert same["text"].startswith("at N = 128, of the 1 cases") and "1 gave the identical error" in same["text"]
    other["real_rel_l2_err"] = other["real_rel_l2_err"] * 1.5
    moved = real_kernels.overlap_values(real, other)
    assert moved["equal"] == 0 and moved["max_rel_diff"] == pytest.approx(0.5)
    other.attrs["parameters"] = json.dumps({"batch": 1, "heads": 2})  # other inputs: not compared
    assert real_kernels.overlap_values(real, other)["cases"] is None
    assert real_kernels.overlap_values(real, None)["text"].startswith("not compared")
    # the longest run: this run when it is a gpu_long run on CUDA, else the committed one (none here)
    monkeypatch.setenv("ATTNUM_OUTPUTS", str(tmp_path))
    run = real.copy()
    run.attrs.update(device="cuda:0 NVIDIA H200", parameters=json.dumps({"output_dir": "length_scaling/gpu_long"}))
    assert real_kernels.longest_real_run(run) is run and real_kernels.measured_on_cuda(run)
    assert not real_kernels.measured_on_cuda(real) and not real_kernels.measured_on_cuda(None)  # a CPU run
    empty = run.copy()
    empty["real_rel_l2_err"] = empty["real_rel_l2_err"] * np.nan
    assert not real_kernels.measured_on_cuda(empty)  # no kernel gave an output
    run.attrs["parameters"] = json.dumps({"output_dir": "length_scaling/gpu"})
    assert real_kernels.longest_real_run(run) is None
    run.attrs.update(device="cpu", parameters=json.dumps({"output_dir": "length_scaling/gpu_long"}))
    assert real_kernels.longest_real_run(run) is None
    longest = real_kernels.real_error_at_longest(real)
    e = real["real_rel_l2_err"].sel(real_kernel="sdpa:math", real_dtype="bf16", real_seq_len=128).median("real_seed")
    assert longest.loc[("sdpa:math", "bf16"), "N"] == 128
    assert longest.loc[("sdpa:math", "bf16"), "err max"] == pytest.approx(float(e.max()))
    values = real_kernels.real_kernel_values(real)
    assert values["sdpa_math_err_bf16_n_long"] == 128 and values["fa4_err_bf16_n_long"] is None
    assert values["sdpa_math_reproduction"] == real_kernels.reproduction(values["sdpa_math_bits_bf16_short"])
