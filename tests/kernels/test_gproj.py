"""GProj in the backward emulator, the other fixes of study 05 and the analytic kernel cost."""
import math

import pytest
import torch

from attnum.cost import compute_seconds, cost_table, kernel_cost, visited_tiles
from attnum.inputs import normal_qkv
from attnum.kernels import (FIXES, Attention, AttentionImpl, as_kernel, flash_attention, flash_attention_backward,
                            golden_attention_backward, with_fix)
from attnum.kernels.autograd import flash_backward, flash_forward
from attnum.kernels.common import recompute_p as _recompute_p
from attnum.kernels.fixes import center_keys
from attnum.kernels.flash import stable_offset
from attnum.metrics import row_rel_l2
from attnum.operands import mechanism_operands, regime_operands
from attnum.precision import get_policy, round_to


def stable_flash_attention(q, k, v, policy="fa2_bf16", *, beta=2.0, **kw):
    """The STABLE forward: the one forward emulator with ``stable_beta``."""
    return flash_attention(q, k, v, policy, stable_beta=beta, **kw)


def _grad_out(q, seed=11):
    return torch.randn(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(q.dtype)


def _bf16_operands(n=128, d=32, seed=0):
    q, k, v = (round_to(t.float(), "bf16") for t in normal_qkv(1, 2, n, d, seed=seed))
    return q, k, v, round_to(_grad_out(q, seed + 5), "bf16")


# -- GProj ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["dq", "dq_dk"])
def test_gproj_rounded_ds_rows_sum_to_zero_in_fp32(mode):
    q, k, v, do = _bf16_operands()
    policy = get_policy("fp32").replace(ds="bf16")  # P exact in fp32: the projection alone is tested
    out, lse = flash_attention(q, k, v, policy, block_k=32)
    rel = {}
    for gproj in ("off", mode):
        stats = {}
        flash_attention_backward(q, k, v, out, lse, do, policy, block_k=32, gproj=gproj, stats=stats)
        rel[gproj] = (stats["ds_row_sum"].abs() / stats["ds_row_abs_sum"])
        # the rounded dS itself (before the projection) is the same with and without GProj
        assert (stats["ds_rounded_row_sum"].abs() / stats["ds_row_abs_sum"]).median() > 1e-4
    assert rel["off"].median() > 1e-4
    assert rel[mode].max() < 1e-6  # fp32 level, like an exact dS (test_backward: < 1e-5)
    # with P itself rounded to bf16 for the matmuls (fa2_bf16) the rows still sum to ~0
    stats = {}
    out, lse = flash_attention(q, k, v, "fa2_bf16", block_k=32)
    flash_attention_backward(q, k, v, out, lse, do, "fa2_bf16", block_k=32, gproj=mode, stats=stats)
    assert (stats["ds_row_sum"].abs() / stats["ds_row_abs_sum"]).max() < 1e-5


def test_gproj_dq_error_stays_at_the_no_offset_level_while_bf16_grows():
    errors = {"off": [], "dq": [], "dq_dk": []}
    mus = (0.0, 10.0, 100.0, 1000.0)
    for mu in mus:
        q, k, v, do, _ = mechanism_operands(256, 64, 1.0, mu, seed=0)
        gold = golden_attention_backward(q, k, v, do)[0]
        for mode in errors:
            impl = AttentionImpl("emulator", "fa2_bf16", block_q=64, block_k=64, fused_scale_max=True, gproj=mode)
            errors[mode].append(row_rel_l2(as_kernel(impl).backward(q, k, v, do)[0], gold).median().item())
    off = errors["off"]
    assert all(a < b for a, b in zip(off, off[1:])) and off[-1] > 20 * off[0], off
    for mode in ("dq", "dq_dk"):
        assert max(errors[mode]) < 1.5 * errors[mode][0], errors[mode]
        assert errors[mode][-1] < off[-1] / 50


def _one_shot_gproj(q, k, v, out, lse, do, policy, scale, causal):
    """The formula of seed 004 on whole matrices: r_i = sum_j dS~_ij, dS' = dS~ - r_i P~_ij,
    dQ = dS' K * scale, dK = dS'^T Q * scale (P~: P as rounded for the matmuls)."""
    pol = get_policy(policy)
    q, k, v = (pol.round(t.to(pol.carrier), "inputs") for t in (q, k, v))
    do = pol.round(do.to(pol.carrier), "grad_out")
    s = pol.round(q @ k.transpose(-1, -2), "score")
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(n_k - n_q + 1), -math.inf)
    p = _recompute_p(s, lse.to(pol.carrier).unsqueeze(-1), scale, False, pol)
    delta = pol.round((do * out.to(pol.carrier)).sum(-1, keepdim=True), "delta")
    ds = pol.round(pol.round(p * pol.round(pol.round(do @ v.transpose(-1, -2), "dp") - delta, "dp"), "dp"), "ds")
    p_mm = pol.round(p, "p_bwd")
    r = ds.sum(-1, keepdim=True)
    dq = (ds @ k - r * (p_mm @ k)) * scale
    dk = (ds - pol.round(r * p_mm, "p_bwd")).transpose(-1, -2) @ q * scale  # the correction, rounded like P~
    return dq, dk


@pytest.mark.parametrize("causal", [False, True])
def test_two_pass_dk_equals_the_one_shot_formula(causal):
    q, k, v, do = (t.double() for t in _bf16_operands(n=100, d=16, seed=3))
    scale = 0.25
    policy = get_policy("fp64").replace(ds="bf16")  # exact arithmetic except the rounding GProj repairs
    out, lse = flash_attention(q, k, v, policy, scale=scale, causal=causal, block_q=16, block_k=24)
    dq_ref, dk_ref = _one_shot_gproj(q, k, v, out, lse, do, policy, scale, causal)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    dq, dk, _ = flash_attention_backward(q, k, v, out, lse, do, policy, scale=scale, causal=causal, block_q=16,
                                         block_k=24, gproj="dq_dk")
    assert rel(dk, dk_ref) < 1e-12 and rel(dq, dq_ref) < 1e-12
    dq1, dk1, _ = flash_attention_backward(q, k, v, out, lse, do, policy, scale=scale, causal=causal, block_q=16,
                                           block_k=24, gproj="dq")
    assert rel(dq1, dq_ref) < 1e-12  # one pass suffices for dQ ...
    assert rel(dk1, dk_ref) > 1e-6  # ... but without r known up front dK is left uncorrected
    # the same with the BF16 kernel's roundings (gradients kept in fp32 to compare): fp32 reassociation only
    policy = get_policy("fa2_bf16").replace(grad="fp32")
    out, lse = flash_attention(q, k, v, policy, scale=scale, causal=causal, block_q=16, block_k=24)
    dq_ref, dk_ref = _one_shot_gproj(q, k, v, out, lse, do, policy, scale, causal)
    kw = dict(scale=scale, causal=causal, block_q=16, block_k=24)
    dq, dk, _ = flash_attention_backward(q, k, v, out, lse, do, policy, gproj="dq_dk", **kw)
    dk1 = flash_attention_backward(q, k, v, out, lse, do, policy, gproj="dq", **kw)[1]
    assert rel(dk, dk_ref) < 1e-5 and rel(dq, dq_ref) < 1e-5
    assert rel(dk1, dk_ref) > 100 * rel(dk, dk_ref)


def test_gproj_leaves_dv_alone_and_off_is_the_plain_backward():
    q, k, v, do = _bf16_operands()
    out, lse = flash_attention(q, k, v, "fa2_bf16", block_k=32)
    plain = flash_attention_backward(q, k, v, out, lse, do, "fa2_bf16", block_k=32)
    off = flash_attention_backward(q, k, v, out, lse, do, "fa2_bf16", block_k=32, gproj="off")
    full = flash_attention_backward(q, k, v, out, lse, do, "fa2_bf16", block_k=32, gproj="dq_dk")
    assert all(torch.equal(a, b) for a, b in zip(plain, off))
    assert torch.equal(full[2], plain[2]) and not torch.equal(full[0], plain[0])
    with pytest.raises(ValueError, match="gproj"):
        flash_attention_backward(q, k, v, out, lse, do, "fa2_bf16", gproj="twice")


# -- the other fixes --------------------------------------------------------------------------------

def test_mean_key_subtraction_leaves_the_forward_unchanged():
    q, k, v = normal_qkv(1, 2, 96, 16, seed=4)
    k = k + 3.0  # a common key component for the centering to remove
    for policy, tol in (("fp64", 1e-12), ("fp32", 1e-5)):
        for causal in (False, True):
            plain = AttentionImpl("emulator", policy, block_q=32, block_k=32)
            centred = plain.replace(center_keys=True)
            a = as_kernel(plain)(q, k, v, is_causal=causal)
            b = as_kernel(centred)(q, k, v, is_causal=causal)
            assert ((a - b).norm() / a.norm()).item() < tol
    assert center_keys(k).mean(dim=-2).abs().max().item() < 1e-12


def _tied_operands():
    q, k, v, do, _ = regime_operands("tied_max_negative_v", 96, 16, seed=0, n_ties=4)
    return q.double(), k.double(), v.double(), do.double()


@pytest.mark.parametrize("fix", list(FIXES))
@pytest.mark.parametrize("operands", ["normal", "tied"])
def test_each_fix_leaves_fp64_policy_gradients_unchanged(fix, operands):
    if operands == "normal":
        q, k, v = normal_qkv(1, 2, 70, 16, seed=6)
        do = _grad_out(q)
    else:
        q, k, v, do = _tied_operands()
    base = AttentionImpl("emulator", "fp64", block_q=16, block_k=24, fused_scale_max=True)
    impl = with_fix(base, fix)
    for causal in (False, True):
        gold = golden_attention_backward(q, k, v, do, causal=causal)
        fixed = as_kernel(impl).backward(q, k, v, do, causal=causal)
        plain = as_kernel(base).backward(q, k, v, do, causal=causal)
        for a, b, g in zip(fixed, plain, gold):
            assert ((a - g).norm() / g.norm()).item() < 1e-11
            assert ((a - b).norm() / g.norm()).item() < 1e-11


@pytest.mark.parametrize("fix", ["mean_key", "stable_max", "gproj_dq", "gproj_dq_dk"])
def test_gradcheck_in_fp64_with_each_fix(fix):
    q, k, v = (t.requires_grad_(True) for t in normal_qkv(1, 1, 11, 4, seed=0))
    impl = with_fix(AttentionImpl("emulator", "fp64", block_q=4, block_k=5, fused_scale_max=True), fix)
    assert torch.autograd.gradcheck(lambda a, b, c: as_kernel(impl)(a, b, c, is_causal=True), (q, k, v))


def test_stable_offset_rule():
    row_max = torch.tensor([[3.0], [-2.0], [3.0], [0.0]])
    ties = torch.tensor([[2.0], [5.0], [1.0], [3.0]])
    assert stable_offset(row_max, ties, beta=7.0).flatten().tolist() == [21.0, 0.0, 3.0, 0.0]


def test_stable_max_changes_only_rows_with_a_repeated_maximum():
    q, k, v = (round_to(t.float(), "bf16") for t in normal_qkv(1, 1, 32, 16, seed=2))
    s = (q @ k.transpose(-1, -2)).double() * 0.25
    top2 = s.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3  # no ties on these operands
    plain = flash_attention(q, k, v, "fa2_bf16", block_k=8)
    stable = stable_flash_attention(q, k, v, "fa2_bf16", block_k=8, beta=2.0)
    assert torch.equal(plain[0], stable[0]) and torch.equal(plain[1], stable[1])
    q, k, v, _ = _tied_operands()
    plain = flash_attention(q.float(), k.float(), v.float(), "fa2_bf16", block_k=16)
    stable = stable_flash_attention(q.float(), k.float(), v.float(), "fa2_bf16", block_k=16, beta=2.0)
    assert not torch.equal(plain[0], stable[0])
    # the log-sum-exp is the same quantity whatever the offset
    assert ((plain[1] - stable[1]).abs().max() / plain[1].abs().max()).item() < 1e-5


def test_stable_max_collapses_rows_whose_shifted_scores_underflow():
    # four tied keys at scaled score 200: the offset 2 * 200 puts every probability below exp(-200) = 0 in fp32
    d = 16
    q = torch.zeros(1, 1, 8, d)
    q[..., 0] = 200.0 * math.sqrt(d) / 4.0
    k = torch.randn(1, 1, 32, d, generator=torch.Generator().manual_seed(0)) * 0.01
    k[..., :4, :] = 0.0
    k[..., :4, 0] = 4.0
    v = torch.randn(1, 1, 32, d, generator=torch.Generator().manual_seed(1))
    out, lse = stable_flash_attention(q, k, v, "fp32", block_k=8, beta=2.0)
    assert torch.isneginf(lse).all() and (out == 0).all()
    out, lse = flash_attention(q, k, v, "fp32", block_k=8)
    assert torch.isfinite(lse).all() and (out != 0).any()


def test_fix_options_parse_label_and_validate():
    impl = AttentionImpl.parse("emulator:fa2_bf16:fused:gproj_dq_dk:center_keys", block_k=32)
    assert impl.gproj == "dq_dk" and impl.center_keys and impl.fused_scale_max and impl.block_k == 32
    assert AttentionImpl.parse(impl.name, block_k=32) == impl
    stable = AttentionImpl.parse("emulator:fa2_bf16:stable=7")
    assert stable.stable_beta == 7.0 and AttentionImpl.parse(stable.name) == stable
    assert AttentionImpl.parse("emulator:fa2_bf16:gproj_dq").gproj == "dq"
    assert AttentionImpl.parse("emulator:fa2_bf16:bk64:fused").name == "emulator:fa2_bf16:bk64:fused"  # unchanged
    with pytest.raises(ValueError, match="gproj"):
        AttentionImpl("emulator", gproj="yes")
    with pytest.raises(ValueError, match="stable_beta"):
        AttentionImpl("emulator", stable_beta=0.5)
    with pytest.raises(ValueError, match="options of the emulator"):
        AttentionImpl("reference", "fp32", center_keys=True)
    with pytest.raises(ValueError, match="unknown fix"):
        with_fix(impl, "magic")


def test_with_fix_changes_one_thing():
    base = AttentionImpl("emulator", "fa2_bf16", block_q=32, block_k=32, fused_scale_max=True)
    assert with_fix(base, "none") == base
    assert with_fix(base, "forward_fix") == base.replace(fused_scale_max=False)
    assert with_fix(base, "stable_max", stable_beta=7.0).stable_beta == 7.0
    fp32_bwd = with_fix(base, "fp32_backward").policy
    assert fp32_bwd.forward_formats() == base.policy.forward_formats() and set(fp32_bwd.backward_formats()) == {"fp32"}
    assert with_fix(base, "fp32_attention").policy.name == "fp32"
    fp64 = base.replace(policy="fp64")
    assert with_fix(fp64, "fp32_backward").policy == fp64.policy  # nothing narrower than fp32 to widen
    assert list(FIXES) == list(FIXES)


def test_fixes_run_through_autograd_and_the_module():
    q, k, v = (t.float().requires_grad_(True) for t in normal_qkv(1, 2, 48, 16, seed=8))
    do = _grad_out(q.detach())
    for fix in FIXES:
        impl = with_fix(AttentionImpl("emulator", "fa2_bf16", block_q=16, block_k=16, fused_scale_max=True), fix)
        module = Attention(impl)
        out = module(q, k, v, is_causal=True)
        auto = torch.autograd.grad(out, (q, k, v), do)
        direct = as_kernel(impl).backward(q.detach(), k.detach(), v.detach(), do, causal=True)
        assert all(torch.equal(a, b.float()) for a, b in zip(auto, direct)), fix
        fwd = flash_forward(q.detach(), k.detach(), v.detach(), impl, causal=True)
        assert torch.equal(out.detach(), fwd[0].float())
        assert all(torch.equal(a, b) for a, b in zip(direct, flash_backward(
            q.detach(), k.detach(), v.detach(), *fwd, do, impl, causal=True)))


# -- the analytic cost ------------------------------------------------------------------------------

def test_visited_tiles():
    assert visited_tiles(256, 64, 64, causal=False) == 16
    assert visited_tiles(256, 64, 64, causal=True) == 10
    assert visited_tiles(100, 64, 32, causal=True) == 2 + 4


def test_kernel_cost_counts_what_each_fix_adds():
    n, d = 1024, 64
    gemm = 2.0 * n * n * d
    cost = {fix: kernel_cost(fix, n, d, block_q=128, block_k=128) for fix in FIXES}
    base = cost["none"]
    assert base["forward"]["gemm_flops_low"] == 2 * gemm and base["backward"]["gemm_flops_low"] == 5 * gemm
    assert base["backward"]["tile_passes"] == base["forward"]["tile_passes"] == 1
    assert cost["gproj_dq"]["backward"]["gemm_flops_low"] == 6 * gemm
    assert cost["gproj_dq"]["backward"]["tile_passes"] == 1
    assert cost["gproj_dq_dk"]["backward"]["gemm_flops_low"] == 9 * gemm and cost["gproj_dq_dk"]["backward"]["tile_passes"] == 2
    assert cost["gproj_dq_dk"]["backward"]["exp_ops"] == 2 * base["backward"]["exp_ops"]
    assert cost["fp32_backward"]["backward"]["gemm_flops_fp32"] == 3 * gemm
    assert cost["fp32_attention"]["forward"]["gemm_flops_fp32"] == 2 * gemm
    assert cost["fp32_attention"]["backward"]["gemm_flops_low"] == 0
    for fix in ("forward_fix", "stable_max"):
        assert cost[fix]["forward"]["gemm_flops_low"] == base["forward"]["gemm_flops_low"]
        assert cost[fix]["forward"]["hbm_bytes"] == base["forward"]["hbm_bytes"]
        assert cost[fix]["forward"]["pointwise_ops"] > base["forward"]["pointwise_ops"]
    assert cost["mean_key"]["forward"]["extra_kernels"] == 1
    causal = kernel_cost("none", n, d, block_q=128, block_k=128, causal=True)
    assert causal["backward"]["gemm_flops_low"] == 5 * 2.0 * 36 * 128 * 128 * d  # 36 of 64 tiles
    total = {fix: compute_seconds(c["forward"]) + compute_seconds(c["backward"]) for fix, c in cost.items()}
    assert total["none"] < total["gproj_dq"] < total["gproj_dq_dk"] < total["fp32_backward"] < total["fp32_attention"]
    with pytest.raises(ValueError, match="unknown fix"):
        kernel_cost("magic", n, d)


def test_cost_table_relative_extras():
    ds = cost_table(FIXES, 2048, 128, causal=True)
    assert ds["cost_gemm_flops_low"].dims == ("fix", "kernel_pass")
    assert float(ds["cost_extra_compute_vs_attention"].sel(fix="none")) == 0.0
    assert float(ds["cost_extra_compute_vs_backward"].sel(fix="gproj_dq_dk")) > float(
        ds["cost_extra_compute_vs_attention"].sel(fix="gproj_dq_dk")) > 0
    for name in ds.data_vars:
        assert ds[name].attrs["units"] and ds[name].attrs["long_name"]


# -- on a CUDA device (marked gpu: skipped without one; .ci/gpu runs them) --------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fix", list(FIXES))
def test_cuda_fix_matches_cpu(fix):
    q, k, v, do, _ = mechanism_operands(300, 64, 1.0, 100.0, seed=0)
    impl = with_fix(AttentionImpl("emulator", "fa2_bf16", block_q=64, block_k=64, fused_scale_max=True), fix)
    cpu = as_kernel(impl).backward(q, k, v, do, causal=True)
    gpu = as_kernel(impl).backward(q.cuda(), k.cuda(), v.cuda(), do.cuda(), causal=True)
    gold = golden_attention_backward(q, k, v, do, causal=True)
    for a, b, g in zip(cpu, gpu, gold):
        assert b.device.type == "cuda"
        err_cpu, err_gpu = (a.double() - g).norm() / g.norm(), (b.cpu().double() - g).norm() / g.norm()
        assert err_gpu < 3 * err_cpu.item() + 1e-3
