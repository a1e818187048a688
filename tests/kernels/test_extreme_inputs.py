"""Study 02's library: input families, mask sentinels, injected faults, NaN-aware metrics, the scaled rule."""
import math

import numpy as np
import pytest
import torch

from attnum import acceptance, kernels
from attnum.kernels.faults import FAULTS, make_fault, round_significand
from attnum.kernels.flash import KernelHooks, flash_attention
from attnum.inputs import (FLASHINFER_TARGET_LOGITS, INPUT_FAMILIES, make_inputs, mask_to_bias)
from attnum.metrics import finite_error_summary, finiteness_counts, scaled_max_error, zero_rows
from attnum.precision import get_policy, round_to
from attnum.kernels import golden_attention, reference_attention, textbook_attention
from attnum.studies.extreme_inputs import detection, experiments, readings, real_kernels

# the sizes the experiments take (no defaults there: the notebook's parameters cell states them)
SIZES = dict(batch=1, heads=1, head_dim=64, block_q=128, block_k=128, device="cpu", golden_chunk=1024)


def sizes(**kw):
    return {**SIZES, **kw}


def rel(a, b):
    return (torch.linalg.vector_norm(a.double() - b) / torch.linalg.vector_norm(b)).item()


# -- input families --------------------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(INPUT_FAMILIES))
def test_every_family_is_seeded_float64_and_shaped(family):
    a = make_inputs(family, 2, 3, 40, 16, seed=5)
    b = make_inputs(family, 2, 3, 40, 16, seed=5)
    for x, y in zip((a.q, a.k, a.v), (b.q, b.k, b.v)):
        assert x.shape == (2, 3, 40, 16) and x.dtype == torch.float64 and x.device.type == "cpu"
        assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))  # same seed, same tensors
    if a.mask is not None:
        assert a.mask.dtype == torch.bool and a.mask.shape[-2:] == (40, 40)


def test_seeds_differ_where_the_family_is_random():
    for family in ("normal", "outliers", "sparse", "seed000_mix", "logit_targeted", "sawtooth"):
        a, b = make_inputs(family, 1, 1, 64, 16, seed=0), make_inputs(family, 1, 1, 64, 16, seed=1)
        assert not torch.equal(a.q.nan_to_num(0.0), b.q.nan_to_num(0.0)), family


def test_scales_outliers_and_constant_families():
    big = dict(batch=1, heads=2, seq_len=512, head_dim=64, seed=3)
    for family, sigma in (("normal", 1.0), ("normal_sigma10", 10.0), ("normal_sigma100", 100.0)):
        assert make_inputs(family, **big).k.std().item() == pytest.approx(sigma, rel=0.02)
    out = make_inputs("outliers", **big)
    for x in (out.q, out.k, out.v):
        assert int((x.abs() == 1000.0).sum()) == 8  # a few entries at 1000x the rest
        assert x[x.abs() != 1000.0].abs().max().item() < 10.0
    pm = make_inputs("pm_1e6", **big)
    assert torch.all(pm.q.abs() == 1e6) and (pm.q > 0).any() and (pm.q < 0).any()
    assert torch.all(make_inputs("zeros", **big).v == 0)
    fp16 = make_inputs("fp16_max", **big)
    assert torch.all(fp16.q == 65504.0) and torch.equal(round_to(fp16.q, "fp16"), fp16.q)
    assert torch.isinf(round_to(fp16.q[..., :1, :] @ fp16.k[..., :1, :].transpose(-1, -2), "fp16")).all()


def test_special_values_sawtooth_pulse_sparse_and_mix():
    spec = make_inputs("special_values", 1, 1, 100, 16, seed=0)
    for x in (spec.q, spec.k, spec.v):
        assert int(torch.isposinf(x).sum()) == 2 and int(torch.isneginf(x).sum()) == 2
        assert int(torch.isnan(x).sum()) == 2
        zeros = x == 0
        assert int((zeros & torch.signbit(x)).sum()) == 2 and int((zeros & ~torch.signbit(x)).sum()) >= 2
    saw = make_inputs("sawtooth", 1, 2, 200, 8, seed=1)
    steps = torch.diff(saw.k, dim=-2)
    assert torch.allclose(steps[steps > 0], torch.full_like(steps[steps > 0], 20.0 / 64))  # one ramp slope
    assert torch.allclose(steps[steps < 0], torch.full_like(steps[steps < 0], 20.0 / 64 - 20.0))  # and resets
    assert saw.k.abs().max().item() <= 10.0
    pulse = make_inputs("pulse", 1, 1, 300, 32, seed=2)
    for x in (pulse.q, pulse.k, pulse.v):
        assert int((x == 1e4).sum()) == 1 and x[x != 1e4].abs().max().item() < 10.0
    sparse = make_inputs("sparse", 1, 4, 1024, 64, seed=3)
    assert (sparse.q == 0).double().mean().item() == pytest.approx(0.95, abs=0.005)
    mix = make_inputs("seed000_mix", 1, 4, 1024, 64, seed=4).k
    extreme = (mix.abs() == 1e6).double().mean().item()
    special = (~torch.isfinite(mix) | (mix == 0)).double().mean().item()
    regular = ((mix.abs() <= 10) & (mix != 0)).double().mean().item()
    assert regular == pytest.approx(0.80, abs=0.01) and extreme == pytest.approx(0.15, abs=0.01)
    assert special == pytest.approx(0.05, abs=0.005)


@pytest.mark.parametrize("target", FLASHINFER_TARGET_LOGITS)
def test_targeted_logits_land_on_their_targets(target):
    d = 64
    inp = make_inputs("logit_targeted", 1, 2, 128, d, seed=7, target=target)
    scores = inp.q @ inp.k.transpose(-1, -2)
    spread = inp.q[..., 1:] @ inp.k[..., 1:].transpose(-1, -2)
    assert torch.all(inp.q[..., 0] * inp.k[..., 0] == target)  # the target term is exact in fp64
    assert (scores - spread - target).abs().max().item() <= 1e-10 * abs(target)
    assert spread.std().item() == pytest.approx(math.sqrt(d), rel=0.1)
    assert spread.abs().max().item() < 7 * math.sqrt(d)
    for fmt, bits in (("bf16", 8), ("fp16", 11)):
        r = inp.rounded(fmt)
        assert torch.isfinite(r.q).all() and torch.isfinite(r.k).all()
        s = r.q.double() @ r.k.double().transpose(-1, -2)
        # within the rounding of the target's factors plus the spread
        assert (s - target).abs().max().item() <= 2 * abs(target) * 2.0 ** -bits + 8 * math.sqrt(d)


def test_targeted_rows_can_be_chosen():
    inp = make_inputs("logit_targeted", 1, 1, 64, 32, seed=1, target=-1e5, rows=slice(0, 8))
    scores = inp.q @ inp.k.transpose(-1, -2)
    assert scores[..., :8, :].max().item() < -1e5 + 100
    assert scores[..., 8:, :].abs().max().item() < 100


def test_masked_huge_scores_and_fully_masked_rows():
    inp = make_inputs("masked_huge_scores", 1, 1, 200, 32, seed=2)
    masked = ~inp.mask[0, 0, 0]
    assert int(masked.sum()) == 50 and torch.equal(inp.mask[0, 0], inp.mask[0, 0, :1].expand(200, 200))
    scores = inp.q @ inp.k.transpose(-1, -2)
    assert scores[..., masked].min().item() > 1e5 - 100
    assert scores[..., ~masked].abs().max().item() < 100
    full = make_inputs("fully_masked_rows", 1, 1, 200, 16, seed=3)
    rows_without_keys = ~full.mask[0, 0].any(dim=-1)
    assert int(rows_without_keys.sum()) == 20
    assert full.mask[0, 0][~rows_without_keys].all()
    with pytest.raises(ValueError, match="unknown input family"):
        make_inputs("gaussian", 1, 1, 8, 8, seed=0)


# -- mask sentinels, fully masked rows, overflow -----------------------------------------------

@pytest.mark.parametrize("target", [-5.5e4, -6e4, -2.45e5])
def test_finite_sentinel_gives_zero_rows_where_golden_is_not_and_neg_inf_matches_golden(target):
    inp = make_inputs("logit_targeted", 1, 2, 256, 64, seed=0, target=target).rounded("bf16")
    gold = golden_attention(inp.q, inp.k, inp.v)
    sentinel, _ = flash_attention(inp.q, inp.k, inp.v, "fa2_bf16", mask_fill=-5e4, block_k=64)
    exact, _ = flash_attention(inp.q, inp.k, inp.v, "fa2_bf16", mask_fill="-inf", block_k=64)
    assert (gold != 0).any(dim=-1).all()
    assert zero_rows(sentinel, gold) == 2 * 256  # every row zero
    assert zero_rows(exact, gold) == 0 and rel(exact, gold) < 1e-2  # bf16-level agreement


def test_finite_sentinel_is_harmless_above_its_value():
    inp = make_inputs("logit_targeted", 1, 1, 256, 64, seed=0, target=-1e4).rounded("bf16")
    gold = golden_attention(inp.q, inp.k, inp.v)
    sentinel, _ = flash_attention(inp.q, inp.k, inp.v, "fa2_bf16", mask_fill=-5e4, block_k=64)
    assert zero_rows(sentinel, gold) == 0 and rel(sentinel, gold) < 1e-2


def test_onset_prediction_brackets_the_measured_onset():
    ds = experiments.sentinel_onset(128, [-50900.0, -50800.0, -50700.0, -50600.0, -50200.0, -50100.0],
                              ["fa2_bf16", "fa2_fp16"], seed=0, **sizes(block_k=64), progress=False)
    table = readings.onset_table(ds)
    for policy in ("fa2_bf16", "fa2_fp16"):
        row = table.loc[policy]
        assert row["highest row-max logit zeroed"] < row["predicted onset"] + 40
        assert row["lowest row-max logit not zeroed"] > row["predicted onset"] - 40


@pytest.mark.parametrize("policy", ["fa2_bf16", "fa2_fp16", "all_fp16"])
def test_fully_masked_rows_give_zero_without_nan(policy):
    inp = make_inputs("fully_masked_rows", 1, 2, 96, 16, seed=4)
    empty = ~inp.mask[0, 0].any(dim=-1)
    gold = golden_attention(inp.q, inp.k, inp.v, attn_bias=inp.attn_bias)
    flash, lse = flash_attention(inp.q, inp.k, inp.v, policy, attn_bias=inp.attn_bias, block_k=32)
    ref = reference_attention(inp.q, inp.k, inp.v, policy, attn_bias=inp.attn_bias)
    for out in (gold, flash, ref):
        assert not torch.isnan(out).any()
        assert torch.all(out[..., empty, :] == 0) and (out[..., ~empty, :] != 0).any(dim=-1).all()
    assert torch.isneginf(lse[..., empty]).all()
    unguarded = textbook_attention(inp.q, inp.k, inp.v, policy, attn_bias=inp.attn_bias)
    assert torch.isnan(unguarded[..., empty, :]).all() and not torch.isnan(unguarded[..., ~empty, :]).any()


def test_a_masked_key_gets_no_weight_unless_the_mask_is_too_small():
    inp = make_inputs("masked_huge_scores", 1, 1, 128, 32, seed=5)
    cols = experiments.masked_key_columns(inp.mask)
    shifted = experiments.shift_masked_values(inp.v, cols)
    for handling in ("fill_-inf", "fill_-5e4", "fill_finfo_min", "additive_finfo_min"):
        a, _ = experiments.masked_attention(handling, inp, "fa2_bf16", block_k=32)
        b, _ = experiments.masked_attention(handling, inp, "fa2_bf16", v=shifted, block_k=32)
        assert torch.equal(a, b), handling
    a, _ = experiments.masked_attention("additive_-1e4", inp, "fa2_bf16")
    b, _ = experiments.masked_attention("additive_-1e4", inp, "fa2_bf16", v=shifted)
    assert (a - b).abs().max().item() > 50  # a masked key with score 1e5 survives a -1e4 additive mask


def test_fp16_overflow_at_65504_needs_fp32_scores_and_max_subtraction():
    ds = experiments.overflow_experiment(32, 128, **{k: v for k, v in SIZES.items() if k != "head_dim"})
    assert float(ds["overflow_golden_value"]) == 65504.0
    nan = ds["overflow_nan_fraction"]
    assert float(nan.sel(overflow_kernel="textbook", score_format="fp32", max_subtraction="yes")) == 0.0
    assert float(ds["overflow_max_abs_err"].sel(overflow_kernel="textbook", score_format="fp32",
                                                 max_subtraction="yes")) == 0.0
    assert float(nan.sel(overflow_kernel="emulator", score_format="fp32", max_subtraction="yes")) == 0.0
    for kernel, score, sub in (("textbook", "fp16", "yes"), ("textbook", "fp16", "no"),
                               ("textbook", "fp32", "no"), ("emulator", "fp16", "yes")):
        assert float(nan.sel(overflow_kernel=kernel, score_format=score, max_subtraction=sub)) == 1.0


def test_nan_inputs_give_nan_rows_not_zero_rows():
    q, k, v = (t.clone() for t in (make_inputs("normal", 1, 1, 64, 16, seed=0).q,) * 3)
    k[0, 0, 5, 3] = math.nan  # every score row meets the NaN key
    gold = golden_attention(q, k, v)
    out, lse = flash_attention(q, k, v, "fa2_bf16", block_k=16)
    assert torch.isnan(gold).all() and torch.isnan(out).all() and torch.isnan(lse).all()


# -- injected faults -----------------------------------------------------------------------------

def test_round_significand_equals_real_formats():
    x = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 30
    assert torch.equal(round_significand(x, 8), round_to(x, "bf16"))
    assert torch.equal(round_significand(x, 11), round_to(x, "fp16"))
    special = torch.tensor([math.inf, -math.inf, math.nan, 0.0])
    assert torch.equal(round_significand(special, 4).nan_to_num(1.0), special.nan_to_num(1.0))
    assert round_significand(torch.tensor([0.6875]), 2).item() == 0.75  # 0.1011b -> 0.11b


def test_no_fault_is_the_algorithm_bit_for_bit():
    q, k, v = (round_to(t, "bf16") for t in (make_inputs("normal", 1, 2, 300, 32, seed=1).q,
                                              make_inputs("normal", 1, 2, 300, 32, seed=2).k,
                                              make_inputs("normal", 1, 2, 300, 32, seed=3).v))
    for causal in (False, True):
        for order in ("q_outer", "k_outer"):
            base = flash_attention(q, k, v, "fa2_bf16", causal=causal, block_k=64, loop_order=order)
            for fault in (None, KernelHooks()):
                other = flash_attention(q, k, v, "fa2_bf16", causal=causal, block_k=64, loop_order=order,
                                        fault=fault)
                assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_fault_changes_the_output_measurably_at_its_default_severity(name):
    family = "logit_targeted" if name == "finite_sentinel" else "normal"
    inp = make_inputs(family, 1, 2, 512, 64, seed=11)
    gold, gold_lse = golden_attention(inp.q, inp.k, inp.v, causal=True, return_lse=True)
    correct, correct_lse = flash_attention(inp.q, inp.k, inp.v, "fa2_fp32", causal=True, block_k=64)
    faulty, faulty_lse = flash_attention(inp.q, inp.k, inp.v, "fa2_fp32", causal=True, block_k=64,
                                         fault=make_fault(name))
    correct_err = max((correct - gold).abs().max().item(), (correct_lse - gold_lse).abs().max().item())
    assert correct_err < (1e-5 if family == "normal" else 1e-2)  # fp32 level (fp32 scores of -6e4: ~1e-3)
    changed = max((faulty - correct).abs().max().item(), (faulty_lse - correct_lse).abs().max().item())
    assert changed > 100 * correct_err, f"{name}: changed by {changed:.2e}, correct error {correct_err:.2e}"
    if name == "low_precision_lse":
        assert torch.equal(faulty, correct)  # only the LSE moves


def test_fault_registry_levels_and_errors():
    for name, cls in FAULTS.items():
        assert cls.default_severity in cls.severities and len(cls.severities) >= 3
        assert make_fault(name).severity == cls.default_severity
        assert make_fault(name, level=0).severity == cls.severities[0]
    with pytest.raises(ValueError, match="unknown fault"):
        make_fault("bitflip")
    with pytest.raises(ValueError, match="severity levels"):
        make_fault("stale_max", level=9)


# -- NaN-aware metrics and the scaled rule ------------------------------------------------------

def test_finiteness_counts_and_finite_errors():
    gold = torch.tensor([[1.0, 2.0, math.nan], [0.0, 0.0, 0.0]], dtype=torch.float64)
    out = torch.tensor([[math.nan, math.inf, 5.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert finiteness_counts(out, gold) == {"nan_where_golden_finite": 1, "inf_where_golden_finite": 1,
                                            "finite_where_golden_nonfinite": 1, "golden_nonfinite": 1}
    summary = finite_error_summary(out, gold, "fp32")
    assert summary["finite_fraction"] == pytest.approx(3 / 6) and summary["max_abs"] == 0.0
    assert math.isnan(finite_error_summary(out[:1, :2], gold[:1, :2], "fp32")["max_abs"])
    assert zero_rows(torch.zeros(2, 3), torch.tensor([[0.0, 1, 0], [0, 0, 0]])) == 1
    assert scaled_max_error(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]), 0.25) == 2.0
    assert scaled_max_error(torch.tensor([math.nan]), torch.tensor([1.0]), 1.0) == math.inf
    assert scaled_max_error(torch.tensor([-math.inf]), torch.tensor([-math.inf]), 1.0) == 0.0


def test_scaled_rule_accepts_correct_kernels_and_rejects_a_narrow_p():
    inp = make_inputs("normal", 1, 2, 512, 64, seed=3).rounded("bf16")
    policy = get_policy("fa2_bf16")
    ctx = experiments._detection_context(inp, policy, "bf16", True, 256)
    correct = flash_attention(inp.q, inp.k, inp.v, policy, causal=True, block_k=64)
    verdict = experiments._judge(correct, ctx, 512, "bf16")
    assert verdict["passes"]["scaled_elementwise"] and verdict["passes"]["scaled_elementwise_lse"]
    assert verdict["kappa_out"] <= 2 * ctx["kappa_ref"] + 2
    assert not verdict["passes"]["fixed_0.1pct"]  # bf16's own rounding is above 0.1%: a false alarm
    faulty = flash_attention(inp.q, inp.k, inp.v, policy, causal=True, block_k=64,
                             fault=make_fault("narrow_p"))
    assert not experiments._judge(faulty, ctx, 512, "bf16")["passes"]["scaled_elementwise"]
    assert acceptance.scaled_elementwise_rule(5.9, 2.0) and not acceptance.scaled_elementwise_rule(6.1, 2.0)
    assert acceptance.error_scale(torch.tensor([2.0]), "bf16").item() == 2 * 2.0 ** -8


def test_kernel_exceptions_are_recorded_not_raised():
    log = experiments.ExceptionLog()
    value, message = log.call("here", lambda: 1 / 0)
    assert value is None and message.startswith("ZeroDivisionError")
    assert log.call("there", lambda: 3) == (3, None)
    assert '"count": 1' in log.to_json() and '"where": "here"' in log.to_json()


def test_mask_to_bias():
    mask = torch.tensor([[True, False]])
    assert mask_to_bias(mask).tolist() == [[0.0, -math.inf]]
    assert mask_to_bias(mask, -1e4).tolist() == [[0.0, -1e4]]


def test_a_kernel_that_raises_is_recorded_and_the_sweeps_go_on(monkeypatch):
    from attnum.kernels import autograd

    real = autograd.flash_forward  # what every emulator kernel of the registry runs

    def flaky(*args, fault=None, **kwargs):
        if fault is not None and fault.name == "stale_max":
            raise FloatingPointError("emulated kernel crash")
        if kwargs.get("mask_fill") == -1e4:
            raise FloatingPointError("emulated kernel crash")
        return real(*args, fault=fault, **kwargs)

    monkeypatch.setattr(autograd, "flash_forward", flaky)
    log = experiments.ExceptionLog()
    ds = detection.detection_sweep(["stale_max", "narrow_p"], ["normal"], [128], ["fp16"], [0], causal=True,
                               **sizes(block_k=32, head_dim=16), log=log, progress=False)
    assert ds["det_fault_exception"].sel(fault="stale_max").all()
    assert not ds["det_fault_exception"].sel(fault="narrow_p").any()
    assert ds["det_detected"].sel(fault="stale_max").all()  # a crash is caught by every rule
    sent = experiments.sentinel_experiment(64, ["fa2_bf16"], [0], targets=(-6e4,), **sizes(head_dim=16, block_k=32), log=log,
                                     progress=False)
    assert sent["sentinel_exception"].sel(mask_handling="fill_-1e4").all()
    assert not sent["sentinel_exception"].sel(mask_handling="fill_-inf").any()
    assert "emulated kernel crash" in log.to_json()


# -- real kernels on the same inputs (section 7) ------------------------------------------------

REAL_SIZES = dict(batch=1, heads=1, head_dim=16, device="cpu", golden_chunk=1024)


def _real(kernel_names, inputs, masks=("bool", "-inf", "-5e4"), dtypes=("bf16",), n=48, **kw):
    return real_kernels.real_kernel_inputs(kernel_names, inputs, masks, dtypes, n, progress=False,
                                   **{"seed": 0, **REAL_SIZES, **kw})


def test_real_extra_inputs_put_the_nan_where_they_say_and_the_golden_input_is_clean():
    inp, gold = real_kernels.real_case_inputs("nan_in_masked_key", "bf16", 1, 2, 32, 16, seed=0)
    assert int(torch.isnan(inp.k).sum()) == 2 and not torch.isnan(inp.q).any() and not torch.isnan(inp.v).any()
    masked = experiments.masked_key_columns(inp.mask)
    assert masked is not None and int(torch.isnan(inp.k[..., masked, :]).sum()) == 2  # in a padding key
    assert not torch.isnan(gold.k).any() and torch.equal(gold.mask, inp.mask)
    inp, gold = real_kernels.real_case_inputs("inf_in_one_value", "fp16", 1, 1, 32, 16, seed=0)
    assert gold is inp and inp.mask is None and int(torch.isinf(inp.v).sum()) == 1
    inp, _ = real_kernels.real_case_inputs("scores_near_max", "fp16", 1, 1, 32, 16, seed=0)
    scaled = (inp.rounded("fp16").q @ inp.rounded("fp16").k.transpose(-1, -2)) / 4.0
    assert abs(scaled.mean().item() / (0.5 * 65504.0) - 1) < 1e-2
    with pytest.raises(ValueError, match="unknown real-kernel input"):
        real_kernels.real_case_inputs("no_such_input", "bf16", 1, 1, 32, 16, seed=0)


def test_a_cuda_only_kernel_is_recorded_as_unavailable_with_the_registrys_reason():
    ds = _real(["sdpa:math", "sdpa:cudnn"], ["normal", "fully_masked_rows"])
    cudnn = ds["real_status"].sel(real_kernel="sdpa:cudnn")
    applicable = ~cudnn.str.startswith("not applicable")
    assert bool(cudnn.where(applicable, "unavailable: x").str.startswith("unavailable: ").all())
    reason = kernels.get("sdpa:cudnn").unavailable_reason("cpu")
    assert str(cudnn.sel(real_dtype="bf16", real_input="normal", real_mask="none").values) == f"unavailable: {reason}"
    assert bool(ds["real_rel_l2_err"].sel(real_kernel="sdpa:cudnn").isnull().all())
    math_status = ds["real_status"].sel(real_kernel="sdpa:math")
    assert str(math_status.sel(real_dtype="bf16", real_input="normal", real_mask="none").values) == "ok"
    # an input without a mask runs only under "none", a masked input under every delivery, never "none"
    assert str(math_status.sel(real_dtype="bf16", real_input="normal", real_mask="bool").values).startswith(
        "not applicable")
    assert str(math_status.sel(real_dtype="bf16", real_input="fully_masked_rows", real_mask="none").values).startswith(
        "not applicable")
    assert real_kernels.real_status_table(ds)["kernel"].unique().tolist() == ["sdpa:cudnn"]


def test_a_refusal_is_recorded_as_data_and_the_experiment_goes_on(monkeypatch):
    from attnum.kernels.sdpa import BackendRefused, SdpaKernel

    real = SdpaKernel.differentiable

    def picky(self, q, k, v, *, bool_mask=None, **kwargs):
        if bool_mask is not None:
            raise BackendRefused(f"{self.name} refused a boolean mask (emulated)")
        return real(self, q, k, v, **kwargs)

    monkeypatch.setattr(SdpaKernel, "differentiable", picky)
    ds = _real(["sdpa:math", "textbook:fp32"], ["masked_huge_scores", "normal"])
    status = ds["real_status"].sel(real_dtype="bf16", real_input="masked_huge_scores")
    assert str(status.sel(real_kernel="sdpa:math", real_mask="bool").values) == \
        "refused: BackendRefused: sdpa:math refused a boolean mask (emulated)"
    assert str(status.sel(real_kernel="sdpa:math", real_mask="-inf").values) == "ok"
    # a kernel with no boolean-mask input is not applicable there, not refused
    assert str(status.sel(real_kernel="textbook:fp32", real_mask="bool").values).startswith("not applicable: textbook")
    refused = ds.sel(real_kernel="sdpa:math", real_dtype="bf16", real_input="masked_huge_scores", real_mask="bool")
    assert np.isnan(float(refused["real_nan_fraction"])) and np.isnan(float(refused["real_rel_l2_err"]))
    table = real_kernels.real_status_table(ds)
    assert table.loc[table["kernel"] == "sdpa:math", "points"].tolist() == [1]
    # running out of memory is recorded under its own name, not as a refusal
    class Hungry(kernels.Kernel):
        name = "hungry"

        def forward(self, q, k, v, **kwargs):
            raise torch.OutOfMemoryError("tried to allocate 1 PiB")

    q = torch.randn(1, 1, 16, 8, dtype=torch.bfloat16)
    out, why = real_kernels._real_forward(Hungry(), q, q, q, None, "none")
    assert out is None and why == "out of memory: tried to allocate 1 PiB"
    out, why = real_kernels._real_forward(kernels.get("sdpa:math"), q, q, q, None, "none")
    assert why == "ok" and out.dtype == torch.float64


def test_fully_masked_rows_give_a_recorded_zero_or_nan_outcome_per_kernel():
    ds = _real(["sdpa:math", "sdpa:flash", "textbook:fp32"], ["fully_masked_rows"], masks=("bool", "-inf", "-5e4"),
               dtypes=("bf16", "fp16"))
    n_masked = ds["real_masked_rows"].sel(real_input="fully_masked_rows")
    assert float(n_masked.min()) >= 1
    sub = ds.sel(real_input="fully_masked_rows")
    for name in ("sdpa:math", "sdpa:flash"):  # PyTorch's convention: 0, no NaN, with bool and -inf masks
        k = sub.sel(real_kernel=name, real_mask=["bool", "-inf"])
        assert (k["real_masked_rows_zero"] == n_masked).all() and (k["real_masked_rows_nan"] == 0).all(), name
        assert (k["real_rows_attend_masked"] == 0).all() and (k["real_nonzero_rows"] == 0).all(), name
        # a finite sentinel: every fully masked row is finite, not 0, an average over masked keys
        k = sub.sel(real_kernel=name, real_mask="-5e4")
        assert (k["real_rows_attend_masked"] == n_masked).all() and (k["real_masked_rows_zero"] == 0).all(), name
    # the unguarded textbook softmax gives NaN on exactly those rows
    t = sub.sel(real_kernel="textbook:fp32", real_mask="-inf")
    assert (t["real_masked_rows_nan"] == n_masked).all() and (t["real_masked_rows_zero"] == 0).all()
    assert (t["real_nonfinite_where_golden_finite"] > 0).all()


def test_pairwise_disagreement_is_zero_against_itself_and_finds_a_different_nan_pattern():
    ds = _real(["sdpa:math", "sdpa:flash", "textbook:fp32"], ["normal", "fully_masked_rows"], masks=("-inf",))
    names = list(ds["real_kernel"].values)
    for name in names:
        self_pair = ds.sel(real_kernel=name, real_other_kernel=name)
        ran = self_pair["real_pair_max_abs_diff"].notnull()
        assert bool(ran.any())
        assert float(self_pair["real_pair_max_abs_diff"].where(ran).max()) == 0.0
        assert float(self_pair["real_pair_nonfinite_mismatch"].max()) == 0.0
        assert float(self_pair["real_pair_zero_row_mismatch"].max()) == 0.0
    diff = ds["real_pair_max_abs_diff"]
    assert np.allclose(diff.values, diff.transpose("real_other_kernel", "real_kernel", ...).values, equal_nan=True)
    assert float(diff.sel(real_kernel="sdpa:math", real_other_kernel="sdpa:flash", real_input="normal",
                          real_mask="none").max()) > 0  # two backends round differently
    masked = dict(real_input="fully_masked_rows", real_mask="-inf", real_dtype="bf16")
    assert float(ds["real_pair_nonfinite_mismatch"].sel(real_kernel="sdpa:math", real_other_kernel="textbook:fp32",
                                                        **masked)) > 0  # 0 against NaN rows
    table = real_kernels.real_disagreements(ds)
    assert {("sdpa:math", "textbook:fp32"), ("sdpa:flash", "textbook:fp32")} <= set(
        zip(table["kernel a"], table["kernel b"]))
    assert not ((table["kernel a"] == "sdpa:math") & (table["kernel b"] == "sdpa:flash")).any()
    codes, labels = real_kernels.real_outcome_table(ds, "bf16")
    assert labels.loc["fully_masked_rows | -inf", "textbook:fp32"].startswith("NaN")
    assert codes.loc["fully_masked_rows | -inf", "sdpa:math"] == 0.0


def test_the_seed_kernels_are_recorded_as_unavailable_on_the_cpu_never_replaced():
    ds = _real(["sdpa:math", "fa4", "flashinfer:prefill"], ["normal", "fully_masked_rows"])
    for name in ("fa4", "flashinfer:prefill"):
        status = ds["real_status"].sel(real_kernel=name)
        ran = [str(s) for s in status.values.ravel() if not str(s).startswith("not applicable")]
        reason = kernels.get(name).unavailable_reason("cpu")
        assert reason and ran and all(s == f"unavailable: {reason}" for s in ran)
        assert bool(ds["real_rel_l2_err"].sel(real_kernel=name).isnull().all())
        # no other kernel's output stands in for it: every pair with it is empty
        assert bool(ds["real_pair_max_abs_diff"].sel(real_kernel=name).isnull().all())
    assert str(ds["real_status"].sel(real_kernel="sdpa:math", real_dtype="bf16", real_input="normal",
                                      real_mask="none").values) == "ok"


def test_boolean_mask_delivery_per_kernel():
    assert real_kernels.boolean_mask_input(kernels.get("sdpa:math")) == "bool_mask"
    assert real_kernels.boolean_mask_input(kernels.get("flashinfer:prefill")) == "custom_mask"
    assert real_kernels.boolean_mask_input(kernels.get("flashinfer:decode")) is None
    assert real_kernels.boolean_mask_input(kernels.get("fa4")) is None
    assert real_kernels.boolean_mask_input(kernels.get("textbook:fp32")) is None
    ds = _real(["textbook:fp32"], ["fully_masked_rows"], masks=("bool",))
    assert str(ds["real_status"].sel(real_kernel="textbook:fp32", real_mask="bool").values.ravel()[0]) == \
        "not applicable: textbook:fp32 takes no boolean mask input"


def test_family_sweep_names_its_kernels_as_the_registry_does():
    ds = experiments.family_sweep(["normal"], [32], ["bf16", "fp16"], [0], batch=1, heads=1, head_dim=16, block_q=16,
                                  block_k=16, device="cpu", golden_chunk=32, progress=False)
    assert list(ds["kernel"].values) == ["reference", "emulator"]
    name = str(ds["kernel_name"].sel(kernel="emulator", policy="fa2", dtype="bf16").values)
    assert name == "emulator:fa2_bf16:bk16" and kernels.get(name).name == name
    assert str(ds["kernel_name"].sel(kernel="reference", policy="all", dtype="fp16").values) == "reference:all_fp16"
    # a run written with the former names reads back in the registry's
    old = ds.assign_coords(kernel=["reference", "flash"])
    assert list(real_kernels.with_registry_names(old)["kernel"].values) == ["reference", "emulator"]


def test_kernel_error_spread_is_the_ratio_of_two_kernels_errors_on_the_same_input():
    from attnum.studies.extreme_inputs import values

    ds = _real(["sdpa:math", "sdpa:flash"], ["normal", "normal_sigma10", "special_values"], dtypes=("bf16", "fp16"))
    table = values.real_kernel_error_spread(ds)
    assert set(table["input"]) == {"normal", "normal_sigma10"}  # special_values: the golden value is NaN
    for _, row in table.iterrows():
        errs = ds["real_rel_l2_err"].sel(real_dtype=row["dtype"], real_input=row["input"], real_mask="none")
        assert row["most / least"] == pytest.approx(float(errs.max() / errs.min()))
        assert row["least"] == float(errs.min()) and row["by"] == str(errs.idxmin().values)
    spread = values.spread_values(table)
    extreme = table[table["input"] != "normal"]["most / least"]
    assert spread["extreme_points"] == len(extreme) == 2 and spread["extreme_hi"] == float(extreme.max())
    assert values.spread_values(values.real_kernel_error_spread(None))["extreme_median"] is None
