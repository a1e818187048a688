"""Study 04 end to end: the smoke tier through the runner; and the study's helpers on small inputs."""
import json

import numpy as np
import pytest
import torch
import xarray as xr

from attnum import kernels, ncio, paths, runs
from attnum.operands import regime_operands
from attnum.studies import late_training_gradient_blowup as study
from attnum.studies.late_training_gradient_blowup import (experiments, gpu_training, readings,
                                                         readings_gpu, real_kernels)

STUDY = "late_training_gradient_blowup"
NOTEBOOK = "notebooks/04_late_training_gradient_blowup.ipynb"


@pytest.mark.slow
def test_smoke_run_writes_results_with_the_expected_dims(smoke_run):
    from attnum import glue

    path = smoke_run
    assert json.loads((path / "RUN.json").read_text())["status"] == "ok"
    executed = json.loads((path / "notebook.ipynb").read_text())
    assert glue.missing_keys(executed) == set()
    # every key the committed notebook's markdown refers to is glued by its code cells on this tier
    committed = json.loads((paths.project_root() / NOTEBOOK).read_text())
    assert glue.referenced_keys(committed) <= glue.glued_keys(executed)
    values = glue.read_glued(executed)
    # the sources' numbers are the constants the checks use, glued as they are (theirs, not measured)
    sources = readings.keyed("s04_", {**readings.source_values(), **readings.definition_values()})
    assert {k: values[k] for k in sources} == sources
    assert values["s04_seed004_dq_err"] == readings.SEED004_DQ_ERR == 2.19
    assert (values["s04_seed003_dq_max"], values["s04_seed003_dk_max"], values["s04_seed003_dv_max"]) == tuple(
        readings.SEED003_THRESHOLDS.values())
    params = runs.load_param_set(STUDY, "smoke")
    tokens = params["steps"] * params["batch_size"] * params["context"]
    assert values["s04_n_params"] == experiments.parameter_count(params) > 0
    assert values["s04_token_orders"] == pytest.approx(np.log10(readings.SEED004_TOKENS / tokens))
    ran = ncio.open_results(path / "results.nc", squeeze_sweep_dims=True)
    at = dict(seq_len=int(ran["seq_len"][-1]), head_dim=int(ran["head_dim"][0]))
    rows = ran["mech_ds_row_sum"].sel(**at).isel(sharpness=0, mu_norm=0).median("seed")
    assert values["s04_ds_row_sum_fp32"] == pytest.approx(float(rows.sel(variant="fp32")))
    assert values["s04_ds_row_sum_fp32_ds_bf16"] == pytest.approx(float(rows.sel(variant="fp32_ds_bf16")))
    assert values["s04_ds_row_sum_fp32"] < 1e-6 < values["s04_ds_row_sum_fp32_ds_bf16"]  # fp32 rounding vs bf16 dS
    late = readings.late_diagnostic(ncio.open_results(path / "results.nc", squeeze_sweep_dims=True))
    assert values["s04_late_global_max"] == pytest.approx(late["global_max"])
    assert values["s04_late_row_verdict"] == ("passes" if late["row_passes_100"] else "stays below")
    assert values["s04_late_global_pass_fraction"] == pytest.approx(late["global_pass_fraction"])
    assert values["s04_late_row_pass_fraction"] == pytest.approx(late["row_pass_fraction"])
    assert values["s04_late_level"] == late["level"] == 1.0
    assert {"error_vs_offset.png", "row_sums.png", "error_vs_size.png", "training.png", "checkpoint_offsets.png",
            "tied_maxima.png", "real_vs_emulator.png", "real_correlation.png",
            "real_diagnostics.png", "exact_problem.png"} <= {p.name for p in path.glob("*.png")}
    ds = ncio.open_results(path / "results.nc")
    params = runs.load_param_set(STUDY, "smoke")
    assert ds["mech_dq_err"].dims == ("variant", "sharpness", "mu_norm", "seq_len", "head_dim", "seed")
    assert ds["variant"].values.tolist() == params["variants"]
    # one name per kernel: each variant's own kernel name at the tier's tiles, a registry name where one exists
    names = [experiments.variant_kernel(v, params["block_q"], params["block_k"]).name for v in params["variants"]]
    assert ds["variant_kernel"].values.tolist() == names
    assert kernels.get(str(ds["variant_kernel"].sel(variant="bf16_fused").item())).name == names[5]
    assert ds["real_variant_kernel"].values.tolist() == [n for v, n in zip(params["variants"], names)
                                                         if v in params["real_variants"]]
    assert ds["mu_norm"].values.tolist() == params["mu_norms"]
    assert ds["train_loss"].dims == ("run", "step") and ds["run"].values.tolist() == list(readings.TRAINING_RUNS)
    for run, param in readings.TRAINING_RUNS.items():  # each run's attention: the registry kernel its parameter names
        name = str(ds["run_attention"].sel(run=run).item())
        assert name == kernels.model_kernel(params[param], block=params["model_block"]).name
        assert kernels.get(name).name == name
    assert ds["train_key_mean_norm"].dims == ("run", "step", "layer")
    assert ds["diag_dq_rel_err"].dims == ("checkpoint", "offset_norm", "layer")
    assert ds["checkpoint"].values.tolist() == params["checkpoint_steps"]
    assert ds["qy_dq_err"].dims == ("regime", "variant", "tiling", "seed")
    # the exact problem: unchanged on the axis-offset operands, moved on the rounded ones at the largest |mu|
    assert ds["xo_dq_err"].dims == ds["mech_dq_err"].dims
    assert float(ds["xo_exact_dq_shift"].max()) < 1e-9 < 0.1 < float(ds["mech_exact_dq_shift"].isel(mu_norm=-1).min())
    assert ds["src_dq_max_abs_err"].dims == ("src_format", "src_mask", "sharpness", "mu_norm", "seed")
    assert ds["src_format"].values.tolist() == params["src_formats"]
    for name in ("mech_dq_rel_err", "diag_dq_rel_err", "real_diag_dq_rel_err"):
        assert "global relative L2" in ds[name].attrs["long_name"], name
    for name in ("mech_dq_err", "diag_dq_row_rel_err", "real_mech_dq_err", "xo_dq_err"):
        assert "median" in ds[name].attrs["long_name"], name
    assert ds["live_dq_rel_err"].dims == ("diag_step", "layer")
    assert set(range(0, params["steps"], params["diagnose_every"])) <= set(ds["diag_step"].values.tolist())
    assert ds.attrs["headline_figure"] == "error_vs_offset.png" and ds.attrs["study"] == STUDY
    for name, var in ds.data_vars.items():
        # CF: every variable has a long_name; numbers have units, strings none
        assert var.attrs.get("long_name") and (var.attrs.get("units") or var.dtype.kind in "OUS"), name
    # what must hold even on the smoke tier
    assert (ds["diag_forward_identical"] == 1).all()
    bf16 = ds["mech_dq_err"].sel(variant="bf16").isel(sharpness=0, seq_len=0, head_dim=0, seed=0).values
    assert np.all(np.diff(bf16) > 0) and bf16[-1] > 20 * bf16[0]
    reference = ds["mech_dq_err"].sel(variant="reference_bf16")
    assert float(reference.max()) < 0.01
    # the real kernels: the CUDA-only one recorded, the CPU ones measured, the diagnostic on the last checkpoint
    assert ds["real_kernel"].values.tolist() == params["real_kernels"]
    assert ds["real_mech_dq_err"].dims == ("real_kernel", "sharpness", "mu_norm", "real_seq_len", "real_head_dim",
                                           "seed")
    assert ds["real_mech_dq_err_corr"].dims[:2] == ("real_kernel", "real_variant")
    status = ds["real_mech_status"]
    assert str(status.sel(real_kernel="sdpa:cudnn").values.ravel()[0]).startswith("unavailable: ")
    assert (status.sel(real_kernel=["sdpa:flash", "sdpa:math"]) == "ok").all()
    assert ds["real_diag_dq_rel_err"].dims == ("real_kernel", "offset_norm", "layer")
    assert int(ds["real_diag_checkpoint"]) == max(params["checkpoint_steps"])
    assert (ds["real_diag_forward_identical"].sel(real_kernel=["sdpa:flash", "sdpa:math"]) == 1).all()
    flash = ds["real_mech_dq_err"].sel(real_kernel="sdpa:flash").isel(sharpness=0, real_seq_len=0, real_head_dim=0,
                                                                        seed=0).values
    assert np.all(np.diff(flash) > 0) and flash[-1] > 20 * flash[0]
    assert float(ds["real_mech_dq_err"].sel(real_kernel="sdpa:math").max()) < 0.01


def test_mechanism_grid_isolates_kernel_error():
    ds = experiments.mechanism_grid([1.0], [0.0, 300.0], [64], [16], [0], variants=["fp32", "fp32_ds_bf16", "bf16"],
                                   block_q=16, block_k=16, golden_chunk=1024, device="cpu", progress=False)
    err = ds["mech_dq_err"].squeeze()
    assert float(err.sel(variant="fp32", mu_norm=300.0)) < 1e-4
    for variant in ("fp32_ds_bf16", "bf16"):
        assert float(err.sel(variant=variant, mu_norm=300.0)) > 10 * float(err.sel(variant=variant, mu_norm=0.0))
    cos = ds["mech_dq_err_cos_mu"].squeeze().sel(variant="bf16", mu_norm=300.0)
    assert float(cos) > 0.9
    rows = ds["mech_ds_row_sum"].squeeze().sel(mu_norm=0.0)
    assert float(rows.sel(variant="fp32")) < 1e-6 < 1e-5 < float(rows.sel(variant="fp32_ds_bf16"))
    assert np.isnan(ds["mech_dq_err_cos_mu"].sel(mu_norm=0.0)).all()


def test_level_crossing_interpolates_in_log_log():
    da = xr.DataArray([0.01, 0.1, 1.0, 10.0], coords={"x": [0.0, 10.0, 100.0, 1000.0]}, dims="x", name="e")
    assert float(readings.level_crossing(da, "x", 1.0)) == pytest.approx(100.0)
    assert float(readings.level_crossing(da, "x", 3.1622776601683795)) == pytest.approx(316.227766, rel=1e-6)
    assert np.isnan(float(readings.level_crossing(da, "x", 100.0)))


def test_regimes_have_tied_maxima_and_offsets():
    q, k, v, do, mu = regime_operands("tied_max_negative_v", 64, 16, seed=0, n_ties=4)
    scores = q @ k.transpose(-1, -2)
    top = scores.max(dim=-1, keepdim=True).values
    assert ((scores == top).sum(-1) >= 4).all()  # every row's maximum is repeated
    assert float(v.mean()) < -0.5 and float(mu.abs().sum()) == 0
    _, _, _, _, mu = regime_operands("key_offset", 64, 16, seed=0, mu_norm=50.0)
    assert float(mu.norm()) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="regime"):
        regime_operands("ties", 64, 16, seed=0)


# -- real kernels (section 8): the mechanism grid and the diagnostic through the registry's kernels ----------

REAL_MUS = [0.0, 100.0, 1000.0, 10000.0]


@pytest.fixture(scope="module")
def real_grid():
    # the emulator variant "bf16" at these tiles is also passed as a "real" kernel, by its registry name
    return real_kernels.real_mechanism_grid(["sdpa:cudnn", "emulator:fa2_bf16:bk16:bq16", "sdpa:math", "sdpa:flash"],
                                     [1.0, 16.0], REAL_MUS, [64], [16], [0, 1], variants=["bf16", "bf16_fused"],
                                     block_q=16, block_k=16, golden_chunk=1024, device="cpu",
                                            progress=False)


def test_real_grid_records_a_cuda_only_kernel_as_unavailable(real_grid):
    status = real_grid["real_mech_status"]
    cudnn = str(status.sel(real_kernel="sdpa:cudnn").item())
    assert cudnn.startswith("unavailable: ") and "CUDA" in cudnn
    assert np.isnan(real_grid["real_mech_dq_err"].sel(real_kernel="sdpa:cudnn")).all()
    assert np.isnan(real_grid["real_mech_dq_err_corr"].sel(real_kernel="sdpa:cudnn")).all()
    assert (status.sel(real_kernel=["sdpa:math", "sdpa:flash"]) == "ok").all()
    assert np.isfinite(real_grid["real_mech_dq_err"].sel(real_kernel=["sdpa:math", "sdpa:flash"])).all()


def test_real_grid_emulator_against_itself(real_grid):
    # the variant "bf16" at these tiles is the registry's emulator:fa2_bf16:bk16:bq16 (one name per kernel)
    assert kernels.get(str(real_grid["real_variant_kernel"].sel(real_variant="bf16").item())).name == \
        kernels.get("emulator:fa2_bf16:bk16:bq16").name
    same = real_grid.sel(real_kernel="emulator:fa2_bf16:bk16:bq16")
    np.testing.assert_allclose(same["real_mech_dq_err_corr"].sel(real_variant="bf16"), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(same["real_mech_dq_err"], real_grid["real_mech_emulator_dq_err"].sel(real_variant="bf16"))
    # the fused variant is another kernel: its correlation drops below 1 where the error is large
    assert float(same["real_mech_dq_err_corr"].sel(real_variant="bf16_fused").min()) < 0.99


def test_sdpa_math_dq_error_stays_small_as_mu_grows(real_grid):
    math_ = real_grid["real_mech_dq_err"].sel(real_kernel="sdpa:math")
    emu = real_grid["real_mech_emulator_dq_err"].sel(real_variant="bf16")
    # measured: 1.5e-3 to 2.0e-3 up to |mu| = 1000, at most 1.6e-2 at |mu| = 1e4 and sharpness 16
    assert float(math_.sel(mu_norm=[0.0, 100.0, 1000.0]).max()) < 5e-3
    assert float(math_.max()) < 0.05
    growth = math_.sel(mu_norm=10000.0, sharpness=1.0) / math_.sel(mu_norm=0.0, sharpness=1.0)
    assert float(growth.max()) < 2.0
    assert bool((math_.sel(mu_norm=[100.0, 1000.0, 10000.0]) * 10 < emu.sel(mu_norm=[100.0, 1000.0, 10000.0])).all())
    # uncorrelated with the emulator's dQ error once mu is there (measured |corr| <= 0.21)
    corr = real_grid["real_mech_dq_err_corr"].sel(real_kernel="sdpa:math", mu_norm=[100.0, 1000.0, 10000.0])
    assert float(abs(corr).max()) < 0.3


def test_sdpa_flash_on_cpu_shows_the_emulators_dq_growth(real_grid):
    flash = real_grid["real_mech_dq_err"].sel(real_kernel="sdpa:flash", sharpness=1.0)
    # measured: 136x and 190x from |mu| = 0 to 1000 (the emulator: 161x, 165x)
    assert bool((flash.sel(mu_norm=1000.0) > 50 * flash.sel(mu_norm=0.0)).all())
    assert bool((np.diff(flash.values, axis=0) > 0).all())  # grows at every step of |mu|, every seed
    corr = real_grid["real_mech_dq_err_corr"].sel(real_kernel="sdpa:flash", real_variant="bf16")
    assert float(corr.median()) > 0.6 and float(corr.min()) > 0.3  # measured: median 0.80, min 0.47
    cos = real_grid["real_mech_dq_err_cos_mu"].sel(real_kernel="sdpa:flash", mu_norm=1000.0)
    assert float(cos.min()) > 0.9
    dk = real_grid["real_mech_dk_err"].sel(real_kernel="sdpa:flash")
    assert float(dk.max()) < 0.02  # dK does not grow


def test_dq_growth_table(real_grid):
    table = readings.dq_growth(real_grid)
    row = table.loc[("real: sdpa:flash", 1.0)]
    assert row["growth"] == pytest.approx(row["dQ err at |mu|=10000"] / row["dQ err at |mu|=0"])
    assert table.loc[("emulator: bf16", 1.0), "growth"] > 100 > 2 > table.loc[("real: sdpa:math", 1.0), "growth"]
    assert np.isnan(table.loc[("real: sdpa:cudnn", 1.0), "growth"])


@pytest.fixture(scope="module")
def small_checkpoint():
    from types import SimpleNamespace

    from attnum import kernels
    from attnum.model import GPT, GPTConfig
    from attnum.train import Task

    task = Task("induction", context=16, n_symbols=8, data_seed=0, lm_loss=True)
    cfg = GPTConfig(vocab_size=task.vocab_size, context=16, n_layer=2, n_head=2, d_model=16,
                    attention=(kernels.model_kernel("emulator:fa2_bf16:fused", block=8),))
    state = {k: v.clone() for k, v in GPT(cfg, seed=0).state_dict().items()}
    return SimpleNamespace(checkpoints={0: state}), cfg, task.batch(10 ** 7, 16, "cpu")


def test_diagnostic_with_a_real_kernel_as_the_models_attention(small_checkpoint):
    result, cfg, batch = small_checkpoint
    ds = real_kernels.real_kernel_diagnostics(result, cfg, batch, ["sdpa:flash", "sdpa:math", "sdpa:cudnn"],
                                       [0.0, 100.0, 1000.0], threshold=0.1, seed=0,
                                              device="cpu", progress=False)
    assert ds["real_diag_dq_rel_err"].dims == ("real_kernel", "offset_norm", "layer")
    assert str(ds["real_diag_status"].sel(real_kernel="sdpa:cudnn").item()).startswith("unavailable: ")
    assert np.isnan(ds["real_diag_dq_rel_err"].sel(real_kernel="sdpa:cudnn")).all()
    ran = ds.sel(real_kernel=["sdpa:flash", "sdpa:math"])
    assert (ran["real_diag_status"] == "ok").all() and (ran["real_diag_forward_identical"] == 1).all()
    flash = ds["real_diag_dq_rel_err"].sel(real_kernel="sdpa:flash")
    # fed bf16: BF16 rounding level without an offset (measured 1.9e-3, 2.2e-3), then the growth (to 1.6, 4.8)
    assert float(flash.sel(offset_norm=0.0).max()) < 1e-2
    assert bool((flash.sel(offset_norm=1000.0) > 100 * flash.sel(offset_norm=0.0)).all())
    math_ = ds["real_diag_dq_rel_err"].sel(real_kernel="sdpa:math")
    assert float(math_.max()) < 1e-2  # measured at most 4.3e-3
    # the emulated kernel on the same checkpoint, through checkpoint_diagnostics: the same picture as sdpa:flash
    emulated = experiments.checkpoint_diagnostics(result, cfg, batch, [0.0, 1000.0], threshold=0.1, seed=0,
                                                       device="cpu", progress=False)
    ratio = flash.sel(offset_norm=1000.0) / emulated["diag_dq_rel_err"].sel(offset_norm=1000.0, checkpoint=0)
    assert float(ratio.min()) > 0.5 and float(ratio.max()) < 2.0


def test_fa4_and_a_forward_only_kernel_are_recorded_never_replaced(small_checkpoint):
    # FlashAttention-4 is CUDA-only: refused here with its own reason; FlashInfer's prefill has no backward:
    # not applicable on any device (this study measures gradients)
    names = ["fa4", "flashinfer:prefill", "sdpa:math"]
    grid = real_kernels.real_mechanism_grid(names, [1.0], [0.0, 100.0], [32], [16], [0], variants=["bf16"],
                                            block_q=16, block_k=16, golden_chunk=1024, device="cpu", progress=False)
    status = {k: str(grid["real_mech_status"].sel(real_kernel=k).item()) for k in names}
    assert status["fa4"] == "unavailable: " + kernels.get("fa4").unavailable_reason("cpu")
    assert "CUDA" in status["fa4"]
    assert status["flashinfer:prefill"].startswith(real_kernels.NOT_APPLICABLE + ": flashinfer")
    assert "no backward" in status["flashinfer:prefill"] and status["sdpa:math"] == "ok"
    for k in ("fa4", "flashinfer:prefill"):
        assert np.isnan(grid["real_mech_dq_err"].sel(real_kernel=k)).all()
    assert np.isfinite(grid["real_mech_dq_err"].sel(real_kernel="sdpa:math")).all()
    assert real_kernels.kernel_status(kernels.get("flashinfer:prefill"), "cuda").startswith(real_kernels.NOT_APPLICABLE)
    result, cfg, batch = small_checkpoint
    diag = real_kernels.real_kernel_diagnostics(result, cfg, batch, names, [0.0], threshold=0.1, seed=0,
                                                device="cpu", progress=False)
    assert [str(x) for x in diag["real_diag_status"].values] == [status[k] for k in names]
    assert np.isnan(diag["real_diag_dq_rel_err"].sel(real_kernel=["fa4", "flashinfer:prefill"])).all()
    # the gpu tier measures FA4's backward beside sdpa:flash and our Triton FA2
    gpu = runs.load_param_set(STUDY, "gpu")["real_kernels"]
    assert {"fa4", "sdpa:flash", "triton:fa2"} <= set(gpu) and all(kernels.get(k).has_backward for k in gpu)


def test_in_format_feeds_the_kernel_bf16_and_the_recompute_what_it_read():
    import torch

    from attnum import kernels
    from attnum.train.diag import backward_errors

    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(4))
    inner = kernels.get("sdpa:flash")
    wrapped = real_kernels.InFormat(inner)
    out = wrapped(q, k, v, is_causal=True)
    assert out.dtype == torch.float32
    assert torch.equal(out, inner(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True).float())
    assert all(torch.equal(a, b.bfloat16().float()) for a, b in zip(wrapped.read_operands(q, k, v, do), (q, k, v, do)))
    # in bf16 its gradients carry BF16 rounding; the same SDPA kernel on the fp32 tensors is an fp32 kernel
    low = backward_errors(q, k, v, do, wrapped, causal=True)
    fp32 = backward_errors(q, k, v, do, inner, causal=True)
    assert 1e-4 < low["dq_rel_err"] < 2e-2 and fp32["dq_rel_err"] < 1e-5


# -- the exact problem against |mu|; the sources' gradient checks -------------------------------------

def test_rounded_offset_changes_the_exact_problem_and_the_axis_offset_does_not():
    from attnum.operands import axis_offset_operands, key_resolution, mechanism_operands, mechanism_operands_in
    from attnum.precision import round_to

    same = mechanism_operands_in("bf16", 64, 16, 4.0, 1000.0, 3)
    assert all(torch.equal(a, b) for a, b in zip(same, mechanism_operands(64, 16, 4.0, 1000.0, 3)))
    k0 = mechanism_operands(256, 16, 1.0, 0.0, 0)[1]
    k4 = mechanism_operands(256, 16, 1.0, 1e4, 0)[1]
    assert key_resolution(k0)["distinct_values"] > 100 > 8 > key_resolution(k4)["distinct_values"]
    assert key_resolution(torch.zeros(1, 1, 5, 3))["distinct_keys"] == 1.0
    q, k, v, do, mu = axis_offset_operands(64, 16, 4.0, 1e4, 3)
    q0, k0, v0, do0, _ = axis_offset_operands(64, 16, 4.0, 0.0, 3)
    assert torch.equal(k, round_to(k, "bf16")) and torch.equal(k - mu.float(), k0)
    assert all(torch.equal(a, b) for a, b in zip((q, v, do), (q0, v0, do0)))
    assert float(mu[0]) == pytest.approx(1e4, rel=2 ** -8) and float(mu[1:].abs().sum()) == 0
    ds = experiments.mechanism_grid([1.0], [0.0, 1e4], [64], [16], [0], variants=["bf16"], block_q=16, block_k=16,
                                   golden_chunk=1024, device="cpu", progress=False)
    xo = experiments.mechanism_grid([1.0], [0.0, 1e4], [64], [16], [0], variants=["bf16"], block_q=16, block_k=16,
                                   golden_chunk=1024, device="cpu", progress=False, operands="axis_offset")
    assert float(ds["mech_exact_dq_shift"].sel(mu_norm=0.0).max()) == 0.0
    assert float(ds["mech_exact_dq_shift"].sel(mu_norm=1e4).min()) > 0.5  # measured ~1.5-4 on such grids
    assert float(xo["xo_exact_dq_shift"].max()) < 1e-9
    assert float(xo["xo_dq_err"].sel(mu_norm=1e4).min()) > 100 * float(xo["xo_dq_err"].sel(mu_norm=0.0).max())
    assert set(xo.data_vars) == {f"xo_{m}" for m in experiments.AXIS_OFFSET_VARS} | {"variant_description", "variant_kernel"}


def test_same_problem_limit():
    shift = xr.DataArray([[[0.0, 0.01, 0.2, 0.05]], [[0.0, 0.5, 0.01, 0.01]]],
                         coords={"sharpness": [1.0, 16.0], "seed": [0], "mu_norm": [0.0, 10.0, 100.0, 1000.0]},
                         dims=("sharpness", "seed", "mu_norm"))
    limit = readings.same_problem_limit(xr.Dataset({"mech_exact_dq_shift": shift}), 0.1)
    assert limit.sel(sharpness=1.0).item() == 10.0  # 1000 is within again, but 100 is not: the limit stops
    assert limit.sel(sharpness=16.0).item() == 0.0


def test_seed000_check_is_the_binding_angle():
    cos = xr.DataArray([0.98, 0.995, 0.997, 1.0])
    # cos 0.995 is 5.7 degrees: above 0.99 but rejected by the angle; 0.997 is 4.4 degrees
    assert readings.seed000_accepts(cos).values.tolist() == [0, 0, 1, 1]


def test_seed003_verdicts():
    ds = xr.Dataset({"src_dq_max_abs_err": ("x", [5e-4, 5e-4, 2e-3, 5e-4]),
                     "src_dk_max_abs_err": ("x", [5e-4, 5e-4, 5e-4, 5e-4]),
                     "src_dv_max_abs_err": ("x", [4e-3, 6e-3, 1e-3, 4e-3])})
    assert readings.seed003_verdicts(ds).values.tolist() == [1, 0, 0, 1]


def test_source_checks_measure_both_masks_against_their_own_exact_gradients():
    ds = experiments.source_checks([1.0], [0.0, 1000.0], 64, 16, [0], formats=["bf16", "fp16"], block_q=16, block_k=16,
                                  golden_chunk=1024, device="cpu", progress=False)
    assert ds["src_dq_err"].dims == ("src_format", "src_mask", "sharpness", "mu_norm", "seed")
    assert ds["src_kernel"].values.tolist() == ["emulator:fa2_bf16:bk16", "emulator:fa2_fp16:bk16"]
    plain = ds.sel(mu_norm=0.0)
    # fp16 has 3 more significand bits: its errors are several times smaller on the same operands
    assert bool((plain["src_dq_err"].sel(src_format="fp16") * 3 < plain["src_dq_err"].sel(src_format="bf16")).all())
    assert float(plain["src_dq_err"].max()) < 0.01 and float(plain["src_dq_cos"].min()) > 0.9999
    # the offset grows dQ in both formats and both masks (against each mask's own fp64 gradients)
    assert bool((ds["src_dq_err"].sel(mu_norm=1000.0) > 10 * plain["src_dq_err"]).all())
    # (the causal errors are below 1% only because each is against the causal fp64 gradients)


def test_real_kernel_summary(real_grid):
    summary = readings.real_kernel_summary(real_grid)
    assert bool(summary.loc["sdpa:flash", "grows"]) and not summary.loc["sdpa:math", "grows"]
    assert summary.loc["sdpa:cudnn", "grows"] is None
    assert summary.loc["sdpa:cudnn", "status"].startswith("unavailable")
    assert summary.loc["sdpa:flash", "corr with bf16, median"] > 0.5 > abs(summary.loc["sdpa:math", "corr with bf16, median"])
    growth = readings.dq_growth(real_grid)
    assert summary.loc["sdpa:flash", "growth max"] == pytest.approx(growth.xs("real: sdpa:flash", level="kernel")["growth"].max())
    assert np.isnan(summary.loc["sdpa:cudnn", "growth min"]) and np.isnan(summary.loc["sdpa:cudnn", "growth max"])
    assert summary.loc["sdpa:flash", "growth min"] >= 10 > summary.loc["sdpa:math", "growth min"]


def test_committed_runs_are_read_only_from_the_right_device():
    cpu = xr.Dataset({"train_grad_norm_total": ("a", [1.0])}, attrs={"device": "cpu"})
    cuda = xr.Dataset({"x": ("a", [1.0])}, attrs={"device": "cuda NVIDIA H200"})
    assert readings.cuda_run(None) is None and readings.cuda_run(cpu) is None and readings.cuda_run(cuda) is cuda
    assert readings.cpu_training_run(None) is None and readings.cpu_training_run(cuda) is None
    assert readings.cpu_training_run(cpu) is cpu
    assert readings.cpu_training_run(cpu.drop_vars("train_grad_norm_total")) is None  # no training in it


def test_the_package_module_is_light_and_gives_its_variables():
    import subprocess
    import sys

    code = ("import sys, attnum.studies.late_training_gradient_blowup as s; "
            "assert 'torch' not in sys.modules, 'torch imported'; assert s.STUDY; "
            "v = s.VARIABLES; assert 'mech_dq_err' in v and 'train_loss' in v")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_real_kernel_details_point_by_point_and_within_the_same_problem_limit(real_grid):
    details = readings.real_kernel_details(real_grid)
    # the emulator passed as a "real" kernel is the bf16 variant itself: its ratio is 1 everywhere
    same = details.loc["emulator:fa2_bf16:bk16:bq16"]
    assert same["dQ err / emulator bf16's, min"] == 1.0 == same["dQ err / emulator bf16's, max"]
    assert np.isnan(details.loc["sdpa:cudnn", "dQ err / emulator bf16's, min"])  # unavailable: no ratio
    assert 0.3 < details.loc["sdpa:flash", "dQ err / emulator bf16's, min"]
    assert details.loc["sdpa:flash", "dQ err / emulator bf16's, max"] < 3.0
    assert details.loc["sdpa:math", "dQ err / emulator bf16's, min"] < 0.1  # far below once mu is there
    assert np.isnan(details.loc["sdpa:flash", "same-problem growth, min"])  # no exact-problem data in this grid
    assert details.loc["sdpa:flash", "corr with bf16, median at d=16"] > 0.5
    assert details.loc["sdpa:flash", "dK err growth over |mu|=0, max"] < 2.0
    assert details.loc["sdpa:flash", "dQ err |cos| with mu at the largest |mu|, min"] > 0.9
    # with a same-problem limit of |mu| = 100 at sharpness 1 and 0 at sharpness 16: the growth to 100 at sharpness 1
    shift = xr.DataArray(np.repeat(np.array([[0.0, 0.01, 0.5, 2.0], [0.0, 0.5, 1.0, 2.0]])[:, None, None, None, :],
                                   2, axis=3),
                         coords={"sharpness": [1.0, 16.0], "seq_len": [64], "head_dim": [16], "seed": [0, 1],
                                 "mu_norm": REAL_MUS},
                         dims=("sharpness", "seq_len", "head_dim", "seed", "mu_norm"))
    limited = readings.real_kernel_details(xr.merge([real_grid, xr.Dataset({"mech_exact_dq_shift": shift})],
                                                 join="exact"))
    err = real_grid["real_mech_dq_err"].sel(real_kernel="sdpa:flash", sharpness=1.0).isel(
        real_seq_len=-1, real_head_dim=0).median("seed")
    expected = float(err.sel(mu_norm=100.0) / err.sel(mu_norm=0.0))
    assert limited.loc["sdpa:flash", "same-problem growth, min"] == pytest.approx(expected)
    assert limited.loc["sdpa:flash", "same-problem growth, max"] == pytest.approx(expected)
    assert np.isnan(limited.loc["sdpa:cudnn", "same-problem growth, min"])  # unavailable: nothing to read


def _trained(flag_at_last, params):
    import json

    checkpoints, offsets, layers = [0, 10], [0.0, 3.0, 30.0], [0, 1]
    shape = (len(checkpoints), len(offsets), len(layers))
    flagged = np.zeros(shape)
    flagged[1, 2, 1] = 1
    if flag_at_last:
        flagged[1, :, 1] = 1
    err = np.full(shape, 0.01)
    err[1, 2] = [0.5, 2.0]
    coords = {"checkpoint": checkpoints, "offset_norm": offsets, "layer": layers}
    dims = ("checkpoint", "offset_norm", "layer")
    return xr.Dataset({"diag_dq_rel_err": (dims, err), "diag_dq_row_rel_err": (dims, err * 3),
                       "diag_flagged": (dims, flagged),
                       "train_max_logit": (("run", "step", "layer"), np.ones((2, 3, 2))),
                       "train_loss": (("run", "step"), np.array([[2.0, 1.5, 1.0], [2.0, 1.5, 1.1]]))},
                      coords={**coords, "run": ["bf16", "fp32"], "step": [0, 5, 10]},
                      attrs={"parameters": json.dumps(params)})


def test_trained_model_and_same_training():
    params = {k: 1 for k in readings.TRAINING_PARAMS}
    quiet, flagged = _trained(False, params), _trained(True, params)
    table = readings.trained_model(quiet)
    assert list(table.index) == [0, 1] and (table["checkpoint"] == 10).all()
    assert list(table["global dQ err, no offset"]) == [0.01, 0.01]
    assert list(table["median row dQ err, no offset"]) == pytest.approx([0.03, 0.03])
    assert list(table["global dQ err, offset 30"]) == [0.5, 2.0]
    assert np.isnan(table.loc[0, "smallest offset flagged"]) and table.loc[1, "smallest offset flagged"] == 30.0
    assert list(table["checkpoints flagged, no offset"]) == [0, 0]
    again = readings.trained_model(flagged)
    assert list(again["checkpoints flagged, no offset"]) == [0, 1] and again.loc[1, "smallest offset flagged"] == 0.0
    other = _trained(False, params)
    other["train_loss"][0, 0] = 2.002
    same = readings.same_training(quiet, other)
    assert same["first steps"] == 3
    assert same["largest relative loss difference"] == pytest.approx(1 - 2.0 / 2.002)
    assert (same["final loss here"], same["final loss there"]) == (1.0, 1.0)
    assert readings.same_training(quiet, _trained(False, {**params, "steps": 2})) is None
    assert readings.same_training(quiet, quiet) is None and readings.same_training(quiet, None) is None


# -- the gpu_training tier's computed text (section 10) ----------------------------------------------------

def _gathered_series(dq_rel_err):
    """A gathered dataset of two single-member runs with the series ``attnum.train.record.summary`` reads."""
    dq = np.asarray(dq_rel_err, dtype=float)  # (run, step)
    runs, steps, layers = ["r0", "r1"], np.arange(dq.shape[1]) * 10, [0, 1]
    per_layer = np.repeat(dq[:, None, :, None], len(layers), axis=3)
    loss = np.tile(np.linspace(3.0, 1.0, len(steps)), (2, 1))[:, None, :]
    loss[:, :, 0] = np.nan
    val = np.full_like(loss, np.nan)
    val[:, :, ::2] = [[[3.0, 2.0, 2.5, 2.8]], [[3.0, 2.0, 1.9, 1.8]]]
    dims3, dims4 = ("run", "member", "step"), ("run", "member", "step", "layer")
    data = {"loss": (dims3, loss), "val_loss": (dims3, val), "grad_norm_total": (dims3, np.ones_like(loss)),
            "dq_rel_err": (dims4, per_layer), "dq_row_rel_err": (dims4, per_layer),
            "key_mean_norm": (dims4, np.ones_like(per_layer)), "offset_logit": (dims4, np.ones_like(per_layer)),
            "max_prob": (dims4, np.ones_like(per_layer)), "tokens_done": ("run", [1000, 3000]),
            "nonfinite_step": (("run", "member"), [[-1], [-1]]), "tokens_per_s": (("run", "step"), np.ones((2, len(steps))))}
    return xr.Dataset(data, coords={"run": runs, "member": ["a"], "step": steps, "layer": layers,
                                    "run_corpus_train_bytes": ("run", [500.0, np.nan])})


def test_record_summary_growth_of_an_all_zero_error_is_nan_without_a_warning():
    import warnings

    from attnum.train import record

    rising = np.linspace(0.01, 0.05, 8)
    ds = _gathered_series([rising, np.zeros(8)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = record.summary(ds)
    growth = table["dq_err_growth"].sel(member="a")
    # seven logged steps after step 0: a fifth is one step, last over first
    assert float(growth.sel(run="r0")) == pytest.approx(rising[-1] / rising[1])
    assert np.isnan(float(growth.sel(run="r1")))
    # the lowest validation loss and its step; passes only where the split's size is known
    assert float(table["min_val_loss_step"].sel(run="r0", member="a")) == 20
    assert float(table["min_val_loss_step"].sel(run="r1", member="a")) == 60
    assert float(table["train_passes"].sel(run="r0")) == 2.0 and np.isnan(float(table["train_passes"].sel(run="r1")))


@pytest.fixture(scope="module")
def s04_records(tmp_path_factory):
    """Two tiny CPU records of the s04 campaign, same setting, stopped at different steps: flash at 30
    (logged every 5) and FP32 attention at 23 (logged at 5, ..., 20 and 23); evaluated every 15 steps."""
    from attnum.train import TrainConfig, train

    folder = tmp_path_factory.mktemp("records")
    base = dict(n_layer=2, n_head=2, d_model=32, context=32, batch_size=8, log_every=5, eval_every=15,
                snapshot_every=10, corpus_max_bytes=1_000_000, val_windows=8, diag_batch=2, warmup_steps=2, lr=3e-3,
                sketch_size=16, device="cpu", budget_s=300.0, time_attention=False)
    train(TrainConfig.byte_lm(**base, steps=30, kernel="sdpa:flash", tag="s04_flash_lr1e-3"), out_dir=folder, progress=False)
    train(TrainConfig.byte_lm(**base, steps=23, kernel="sdpa:math", tag="s04_fp32_lr1e-3"), out_dir=folder, progress=False)
    return gpu_training.gpu_training_dataset(folder, mech=None, level=0.1)


FLASH, FP32 = "lm_s04_flash_lr1e-3_s0_d0", "lm_s04_fp32_lr1e-3_s0_d0"


def test_gpu_late_growth_counts_only_members_with_a_growth(s04_records):
    ds = s04_records.copy(deep=True)
    ds["dq_rel_err"].loc[{"run": FP32}] = 0.0  # as on the GPU: the diagnostic recomputes FP32 attention exactly
    ds["sum_max_dq_rel_err"].loc[{"run": FP32}] = 0.0
    ds["sum_dq_err_growth"].loc[{"run": FP32}] = np.nan
    table = readings_gpu.gpu_training_table(ds)
    assert table.loc[(FP32, "a"), "max dq_rel_err"] == 0.0 and np.isnan(table.loc[(FP32, "a"), "dq_rel_err growth"])
    assert np.isfinite(float(ds["sum_dq_err_growth"].sel(run=FLASH, member="a")))
    growth = float(ds["sum_dq_err_growth"].sel(run=FLASH, member="a"))
    late = readings_gpu.late_growth(ds)
    assert late["with growth"] == 1 and late["level"] == gpu_training.GPU_GROWTH
    assert late["grew"] == int(growth > gpu_training.GPU_GROWTH)
    ds["sum_dq_err_growth"].loc[{"run": FLASH}] = 10 * gpu_training.GPU_GROWTH
    assert readings_gpu.late_growth(ds)["grew"] == 1 and readings_gpu.late_growth(ds)["grew_runs"] == f"{FLASH}/a"
    assert np.isnan(readings_gpu.late_growth(None)["grew"])
    # nothing blew up: the losses fall
    blew = readings_gpu.blowup_by_family(ds)
    assert blew.loc["sdpa:flash", "members"] == 1 and blew.loc["FP32", "members"] == 1 and blew["blew up"].sum() == 0
    ds["sum_diverged"].loc[{"run": FLASH}] = 1
    assert readings_gpu.blowup_by_family(ds).loc["sdpa:flash", "blew up"] == 1


def test_gpu_equal_step_table_takes_the_largest_common_logged_step(s04_records):
    ds = s04_records
    assert int(ds["steps_done"].sel(run=FLASH)) == 30 and int(ds["steps_done"].sel(run=FP32)) == 23
    table = readings_gpu.gpu_equal_step_table(ds)
    assert list(table.index.get_level_values("run")) == [FLASH, FP32]
    assert (table["common step"] == 20).all()  # 23 is logged by the FP32 run only
    assert list(table["last step"]) == [30, 23]
    for run in (FLASH, FP32):
        one = ds.sel(run=run, member="a")
        row = table.loc[(run, "a")]
        assert row["train loss"] == float(one["loss"].sel(step=20))
        assert row["val step"] == 15 and row["val loss"] == float(one["val_loss"].sel(step=15))  # last eval <= 20
        assert row["key_mean_norm"] == pytest.approx(float(one["key_mean_norm"].sel(step=20).mean()))
        assert row["grad norm"] == float(one["grad_norm_total"].sel(step=20))
    # a setting with a single run gives no comparison
    alone = ds.sel(run=[FLASH])
    assert readings_gpu.gpu_equal_step_table(alone).empty
    assert readings_gpu.gpu_equal_step_table(None).empty


def test_gpu_memorisation_and_throughput_are_computed(s04_records):
    ds = s04_records
    split = float(ds["run_corpus_train_bytes"].sel(run=FLASH))
    passes = 30 * 8 * 32 / split
    assert float(ds["sum_train_passes"].sel(run=FLASH)) == pytest.approx(passes)
    table = readings_gpu.memorisation(ds)
    low = ds["val_loss"].sel(run=FLASH, member="a")
    step = int(low["step"][int(low.fillna(np.inf).argmin("step"))])
    row = table.loc[(FLASH, "a")]
    assert row["passes"] == pytest.approx(passes) and row["min val step"] == step
    assert row["min val loss"] == pytest.approx(float(low.min()))
    # a validation loss that ends 50% above a minimum at step 15 while the training loss keeps falling: memorising
    rose = ds.copy(deep=True)
    v15 = float(low.sel(step=15))
    rose["sum_min_val_loss"].loc[{"run": FLASH, "member": "a"}] = v15
    rose["sum_min_val_loss_step"].loc[{"run": FLASH, "member": "a"}] = 15
    rose["sum_final_val_loss"].loc[{"run": FLASH, "member": "a"}] = 1.5 * v15
    assert float(rose["sum_final_loss"].sel(run=FLASH, member="a")) < float(ds["loss"].sel(run=FLASH, member="a", step=15))
    memo = readings_gpu.memorisation(rose).loc[(FLASH, "a")]
    assert memo["min val step"] == 15 and memo["val rise"] == pytest.approx(0.5) and bool(memo["memorises"])
    # the memorising member's layer-mean dQ error at its minimum (step 15) and at its end
    dq = ds["dq_rel_err"].sel(run=FLASH, member="a").mean("layer").dropna("step")
    a, b = float(dq.sel(step=15)), float(dq[-1])
    assert (memo["dq at min"], memo["dq at end"]) == pytest.approx((a, b))
    assert memo["dq grew after min"] == bool(b > (1 + gpu_training.GPU_DQ_LATE_RISE) * a)
    grown = rose.copy(deep=True)
    grown["dq_rel_err"].loc[{"run": FLASH, "member": "a", "step": int(dq["step"][-1])}] = 2 * a
    assert readings_gpu.memorisation(grown).loc[(FLASH, "a"), "dq grew after min"] is True
    assert not bool(table.loc[(FLASH, "a"), "memorises"]) and np.isnan(table.loc[(FLASH, "a"), "dq at min"])
    assert readings_gpu.memorisation(None).empty
    rate = float(ds["sum_median_tokens_per_s"].sel(run=FP32))
    throughput = readings_gpu.throughput(ds)
    assert throughput.loc[FP32, "tokens/s"] == rate and throughput.loc[FP32, "steps"] == 23
    assert throughput.loc[FP32, "attention"] == "sdpa:math@fp32"
    assert np.isnan(throughput.loc[FP32, "attention share"])  # time_attention off: no share
    assert throughput["over the slowest"].min() == 1.0
    assert throughput.loc[FLASH, "over the slowest"] == pytest.approx(
        float(ds["sum_median_tokens_per_s"].sel(run=FLASH)) / throughput["tokens/s"].min())


def _layered_records(n_steps=40, n_layers=4, grow_layer=2):
    """A gathered-like dataset: run a (flash) with one layer whose key offset and dQ error both grow
    by the same factor over the second half, the other layers flat; run b (FP32) with a zero dQ error."""
    steps = np.arange(n_steps) * 10
    frac = np.clip((np.arange(n_steps) - n_steps / 2) / (n_steps / 2), 0, None)  # 0 in the first half, then to 1
    key = np.full((n_steps, n_layers), 5.0)
    key[:, grow_layer] = 5.0 * (1 + 3 * frac)  # x4 by the end
    err = 0.01 * key / 5.0  # dQ error in proportion to the key offset in every layer
    sharp = np.full((n_steps, n_layers), 0.3)
    a = np.stack([err, np.zeros_like(err)])[:, None]  # run, member, step, layer
    k = np.stack([key, key])[:, None]
    ds = xr.Dataset({"dq_rel_err": (("run", "member", "step", "layer"), a),
                     "key_mean_norm": (("run", "member", "step", "layer"), k),
                     "key_mean_ratio": (("run", "member", "step", "layer"), np.full_like(k, 0.5)),
                     "max_prob": (("run", "member", "step", "layer"), np.stack([sharp, sharp])[:, None])},
                    coords={"run": ["flash_run", "fp32_run"], "member": ["a"], "step": steps,
                            "layer": np.arange(n_layers),
                            "member_attention": (("run", "member"), [["sdpa:flash@bf16"], ["sdpa:math@fp32"]])})
    return ds


def test_layer_growth_finds_the_layer_whose_keys_drift_and_skips_a_zero_error_member():
    ds = _layered_records()
    table = readings_gpu.gpu_layer_growth(ds)
    assert set(table.index.get_level_values("run")) == {"flash_run"}  # FP32: dQ error 0, left out
    sub = table.loc[("flash_run", "a")]
    n = 39  # logged steps: step 0 left out
    k = n // 5
    mid, end = slice(n // 2 - k, n // 2), slice(n - k, n)
    key = ds["key_mean_norm"].sel(run="flash_run", member="a").values[1:, 2]
    expected = key[end].mean() / key[mid].mean()
    assert sub.loc[2, "key offset growth"] == pytest.approx(expected)
    assert sub.loc[2, "dq growth"] == pytest.approx(expected)  # error in proportion to the offset
    assert sub.loc[0, "dq growth"] == pytest.approx(1.0)
    assert sub.loc[2, "late_corr"] == pytest.approx(1.0)
    assert np.isnan(sub.loc[0, "late_corr"])  # a flat layer: no correlation to speak of
    across = readings_gpu.layers_across(ds)
    assert list(across.index) == [("flash_run", "a")]  # FP32: dQ error 0, left out
    row = across.loc[("flash_run", "a")]
    assert row["top layer"] == 2 and row["top dq growth"] == pytest.approx(expected)
    assert (row["layers grown"], row["layers"]) == (int(expected > gpu_training.GPU_GROWTH), 4)
    assert row["across-layer corr (logs)"] == pytest.approx(1.0)  # only layer 2 grows, in both


def test_layer_growth_with_no_trained_member_says_so():
    ds = _layered_records()
    ds["dq_rel_err"][:] = 0.0
    assert len(readings_gpu.gpu_layer_growth(ds)) == 0
    assert readings_gpu.layers_across(ds).empty and readings_gpu.layers_across(None).empty


def _diagnosed(glob, row, flagged):
    """A run's diagnostic at checkpoints 0, 10, 20, 30 (no offset and one offset), two layers."""
    coords = {"checkpoint": [0, 10, 20, 30], "offset_norm": [0.0, 100.0], "layer": [0, 1]}
    def var(layer1):
        values = np.zeros((4, 2, 2))
        values[:, 0, 1] = layer1
        values[:, 0, 0] = 0.01
        values[:, 1, :] = 5.0  # with the offset: never read by late_diagnostic
        return (("checkpoint", "offset_norm", "layer"), values)
    return xr.Dataset({"diag_dq_rel_err": var(glob), "diag_dq_row_rel_err": var(row),
                       "diag_flagged": var(flagged), "diag_grad_norm_qk_ratio": var([1.0, 1.1, 1.2, 1.5])}, coords=coords)


def test_late_diagnostic_states_each_measure_on_its_own():
    # the last third: checkpoints 20 and 30; layer 1 has the larger global error there
    late = readings.late_diagnostic(_diagnosed([0.01, 0.5, 1.3, 3.1], [0.01, 0.05, 0.077, 0.099], [0, 1, 1, 1]))
    assert (late["layer"], late["first_checkpoint"], late["last_checkpoint"], late["n_checkpoints"]) == (1, 20, 30, 2)
    assert (late["global_min"], late["global_max"]) == (1.3, 3.1) and (late["row_min"], late["row_max"]) == (0.077, 0.099)
    assert late["global_passes_100"] is True and late["row_passes_100"] is False  # only the global error passes
    assert (late["global_pass_fraction"], late["row_pass_fraction"]) == (1.0, 0.0) and late["level"] == 1.0
    half = readings.late_diagnostic(_diagnosed([0.01, 0.5, 0.9, 3.1], [0.01, 0.05, 0.077, 0.099], [0, 1, 1, 1]))
    assert half["global_pass_fraction"] == 0.5 and half["global_passes_100"] is True
    assert readings.late_diagnostic(_diagnosed([0.01, 0.5, 0.9, 3.1], [0.01, 0.05, 0.077, 0.099], [0, 1, 1, 1]),
                                    level=0.08)["row_pass_fraction"] == 0.5
    assert late["flagged"] == 2 and (late["qk_ratio_min"], late["qk_ratio_max"]) == (1.2, 1.5)
    both = readings.late_diagnostic(_diagnosed([0.01, 0.5, 1.3, 3.1], [0.01, 0.5, 1.7, 2.7], [0, 1, 1, 1]))
    assert both["row_passes_100"] is True
    nothing = readings.late_diagnostic(None)
    assert np.isnan(nothing["global_max"]) and nothing["row_passes_100"] is None
    assert np.isnan(nothing["global_pass_fraction"]) and np.isnan(nothing["row_pass_fraction"])


def test_without_records_the_gpu_figures_are_one_empty_panel_saying_so():
    """The gpu tier has no training records: its figure cells still run and say what is absent."""
    import matplotlib.pyplot as plt

    from attnum.studies.late_training_gradient_blowup import figures

    for fig in (figures.plot_gpu_training(None), figures.plot_gpu_training(xr.Dataset())):
        (ax,) = fig.axes
        assert not ax.axison
        assert [t.get_text() for t in ax.texts] == ["no GPU training records in this run"]
        plt.close(fig)


# -- names, sources and notices ---------------------------------------------------------------------

def test_every_variant_is_a_registry_kernel_or_one_with_its_documented_stages_switched():
    from attnum.precision import BACKWARD_STAGES, get_policy

    switched = {}
    for name, (family, policy, fused, _) in experiments.KERNEL_VARIANTS.items():
        base, stages = experiments.variant_base(name, 32, 64)
        kernel = kernels.get(base)  # the registry builds the base kernel from its name
        assert (kernel.impl.family, kernel.impl.fused_scale_max, kernel.impl.block_k) == (family, fused, 64)
        assert kernel.impl.policy.replace(**stages).as_dict() | {"name": policy.name} == policy.as_dict()
        if stages:
            switched[name] = stages
        else:  # the variant is that registry kernel, under the name the results store
            assert experiments.variant_kernel(name, 32, 64).name == base
    # the two variants that are no registry kernel, each as KERNEL_VARIANTS describes it
    assert switched == {"fp32_ds_bf16": {"ds": "bf16"},
                        "bf16_bwd_fp32": {s: "fp32" for s in BACKWARD_STAGES
                                          if get_policy("fa2_bf16").as_dict()[s] != "fp32"}}


def test_committed_runs_name_registry_kernels_and_documented_variants():
    for name in ("gpu", "default"):
        ds = ncio.committed_run(STUDY, name)
        if ds is None:
            continue
        assert set(ds["variant"].values.tolist()) <= set(experiments.KERNEL_VARIANTS)
        assert set(ds["real_variant"].values.tolist()) <= set(experiments.KERNEL_VARIANTS)
        assert ds["run"].values.tolist() == list(readings.TRAINING_RUNS)
        for attention in ds["run_attention"].values:
            assert kernels.get(str(attention)).name == str(attention)
        for kernel in ds["real_kernel"].values:
            assert kernels.get(str(kernel)).name == str(kernel)
    assert ncio.committed_run(STUDY, "gpu") is not None  # the run the notebook's GPU prose reads is there


def _markdown_calls(notebook: dict):
    """Every ``Markdown(...)`` call of the notebook's code cells."""
    import ast

    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Markdown":
                yield node


def test_the_notebooks_markdown_notices_escape_the_data_values_they_state():
    import ast

    from attnum.site import render_finding

    notebook = json.loads((paths.project_root() / NOTEBOOK).read_text())
    calls = list(_markdown_calls(notebook))
    assert len(calls) == 2
    planted = "x<img src=y onerror=alert(1)>**bold** [link](http://z) `tick"
    for call in calls:
        inner = call.args[0]  # Markdown(render_finding(template, {key: value}))
        assert isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "render_finding"
        template = ast.literal_eval(inner.args[0])
        keys = [ast.literal_eval(k) for k in inner.args[1].keys]
        assert keys and all(f"{{glue:text}}`{k}`" in template for k in keys)
        shown = render_finding(template, {k: planted for k in keys})
        escaped = "x\\<img src\\=y onerror\\=alert\\(1\\)\\>\\*\\*bold\\*\\* \\[link\\]\\(http\\:\\/\\/z\\) \\`tick"
        assert shown.count(escaped) == len(keys)  # every character of markup in the value backslash-escaped
        assert "onerror" not in shown.replace(escaped, "") and "<" not in shown.replace(escaped, "")


def test_source_values_are_the_constants_and_the_notebook_states_every_one():
    values = readings.keyed("s04_", {**readings.source_values(), **readings.definition_values()})
    assert values["s04_seed004_parameters_m"] == readings.SEED004_PARAMETERS / 1e6 == 450
    assert values["s04_seed004_tokens_normal_b"] * 2 == values["s04_seed004_tokens_b"] == 50
    assert values["s04_qiu_yao_tokens"] == 70_000 * 20 * 1024 * 16
    assert values["s04_bf16_spacing"] == 2.0 ** -7
    assert values["s04_seed003_format"] == readings.SEED003_SETTING["format"] == "fp16"
    notebook = json.loads((paths.project_root() / NOTEBOOK).read_text())
    from attnum import glue

    stated = glue.referenced_keys(notebook)
    assert set(values) <= stated  # each of them is stated in the prose
    derived = readings.keyed("s04_seed000_", readings.seed000_limits())  # what seed 000's limits allow
    assert {k for k in stated if k.startswith(("s04_seed00", "s04_qiu_yao_"))} <= set(values) | set(derived)
    assert readings.orders_of_magnitude(1e9, 1e5) == pytest.approx(4.0)
    assert readings.orders_of_magnitude(1e9, 0) is None and readings.orders_of_magnitude(1e9, None) is None


def test_grid_values_of_the_committed_gpu_run_and_the_records_model():
    gpu = ncio.committed_run(STUDY, "gpu")
    grid = readings.gpu_grid_values(gpu)
    assert (grid["real_n_min"], grid["real_n_max"]) == (int(gpu["real_seq_len"].min()), int(gpu["real_seq_len"].max()))
    assert grid["real_head_dims"] == ", ".join(str(int(d)) for d in gpu["real_head_dim"].values)
    assert grid["tie_seq_len"] == json.loads(gpu.attrs["parameters"])["tie_seq_len"]
    assert set(readings.gpu_grid_values(None).values()) == {None}
    records = ncio.committed_run(STUDY, "gpu_training")
    model = readings_gpu.records_model(records)
    params = [json.loads(str(p)) for p in records["run_parameters"].values]
    assert model["n_layer"] == params[0]["n_layer"] and model["context"] == params[0]["context"]
    assert model["corpus_mb"] == pytest.approx(float(records["prov_corpus_bytes"].max()) / 1e6)
    assert readings_gpu.records_model(None) == {k: None for k in (*readings_gpu.MODEL_FIELDS, "corpus_mb")}
