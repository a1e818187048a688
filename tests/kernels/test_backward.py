"""The backward emulator, its autograd Function and the backward stages of the precision policy."""
import math

import pytest
import torch

from attnum.inputs import normal_qkv
from attnum.kernels import (Attention, AttentionImpl, as_kernel, flash_attention, flash_attention_backward,
                            golden_attention_backward, reference_attention)
from attnum.metrics import row_rel_l2
from attnum.model import GPTConfig
from attnum.precision import BACKWARD_STAGES, PRESETS, PrecisionPolicy, get_policy
from attnum.train import Task
from attnum.train import TrainConfig, train


def _grad_out(q, seed=11):
    return torch.randn(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(q.dtype)


# -- the policy ---------------------------------------------------------------------------------

def test_backward_stages_default_to_no_rounding_and_presets_keep_their_names():
    for name, pol in PRESETS.items():
        assert pol.name == name
    fa2 = get_policy("fa2_bf16")
    assert (fa2.grad_out, fa2.delta, fa2.dp, fa2.ds, fa2.p_bwd, fa2.grad_acc, fa2.grad) == \
        ("bf16", "fp32", "fp32", "bf16", "bf16", "fp32", "bf16")
    assert set(get_policy("fp64").backward_formats()) == {"fp64"}
    assert set(get_policy("fp32").backward_formats()) == {"fp32"}
    forward_only = PrecisionPolicy("custom", "bf16", "fp32", "fp32", "bf16", "fp32", "bf16", "fp32")
    assert set(forward_only.backward_formats()) == {"fp32"} and forward_only.carrier == torch.float32
    fp32_bwd = fa2.with_backward("fp32")
    assert fp32_bwd.forward_formats() == fa2.forward_formats() and set(fp32_bwd.backward_formats()) == {"fp32"}
    assert fp32_bwd.name == "fa2_bf16+bwd=fp32"
    assert get_policy("fp32").replace(ds="bf16").ds == "bf16"
    with pytest.raises(ValueError, match="fp8"):
        fa2.replace(ds="fp8")
    assert "ds" in BACKWARD_STAGES


# -- correctness in exact arithmetic ------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_gradcheck_in_fp64(causal, fused):
    q, k, v = (t.requires_grad_(True) for t in normal_qkv(1, 2, 13, 4, seed=0))
    impl = AttentionImpl("emulator", "fp64", block_q=4, block_k=5, fused_scale_max=fused)
    assert torch.autograd.gradcheck(lambda a, b, c: as_kernel(impl)(a, b, c, is_causal=causal), (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,n_k", [(70, 70), (40, 90)])
def test_fp32_backward_matches_autograd_through_reference_attention(causal, n_q, n_k):
    q, _, _ = (t.float() for t in normal_qkv(2, 2, n_q, 16, seed=1))
    _, k, v = (t.float() for t in normal_qkv(2, 2, n_k, 16, seed=2))
    do = _grad_out(q)
    flash = as_kernel(AttentionImpl("emulator", "fp32", block_q=16, block_k=24)).backward(q, k, v, do, causal=causal)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    auto = torch.autograd.grad(reference_attention(*leaves, "fp32", causal=causal), leaves, do)
    gold = golden_attention_backward(q, k, v, do, causal=causal, chunk=17)
    for a, b, g in zip(flash, auto, gold):
        assert (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item() < 2e-6
        assert (torch.linalg.vector_norm(a.double() - g) / torch.linalg.vector_norm(g)).item() < 2e-6


def test_golden_backward_equals_fp64_autograd():
    q, k, v = normal_qkv(1, 2, 50, 8, seed=3)
    do = _grad_out(q)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    auto = torch.autograd.grad(reference_attention(*leaves, "fp64", causal=True), leaves, do)
    for a, b in zip(golden_attention_backward(q, k, v, do, causal=True, chunk=7), auto):
        assert (a - b).abs().max().item() < 1e-12


def test_fused_scale_max_feeds_the_backward():
    q, k, v = (t.float() for t in normal_qkv(1, 1, 128, 32, seed=4, std=2.0))
    do = _grad_out(q)
    plain = as_kernel(AttentionImpl("emulator", "fp32", block_k=32)).backward(q, k, v, do)
    fused = as_kernel(AttentionImpl("emulator", "fp32", block_k=32, fused_scale_max=True)).backward(q, k, v, do)
    assert not all(torch.equal(a, b) for a, b in zip(plain, fused))
    # the backward's own P recompute follows the option, not only the stored O and LSE
    out, lse = flash_attention(q, k, v, "fp32", block_k=32, fused_scale_max=True)
    unfused_recompute = flash_attention_backward(q, k, v, out, lse, do, "fp32", block_k=32)
    assert not all(torch.equal(a, b) for a, b in zip(fused, unfused_recompute))
    # and in fp64 the fused recompute is still exact
    q64, k64, v64 = normal_qkv(1, 1, 64, 16, seed=5)
    g64 = golden_attention_backward(q64, k64, v64, _grad_out(q64))
    f64 = as_kernel(AttentionImpl("emulator", "fp64", fused_scale_max=True)).backward(q64, k64, v64, _grad_out(q64))
    assert max((a - b).abs().max().item() for a, b in zip(f64, g64)) < 1e-12


# -- seed 004's mechanism -----------------------------------------------------------------------

def test_exact_ds_rows_sum_to_zero_and_rounded_rows_do_not():
    q, k, v = (t.float() for t in normal_qkv(1, 2, 96, 32, seed=6))
    do = _grad_out(q)
    policy = get_policy("fp32").replace(ds="bf16")
    out, lse = flash_attention(q, k, v, policy, block_k=32)
    stats = {}
    flash_attention_backward(q, k, v, out, lse, do, policy, block_k=32, stats=stats)
    exact = (stats["ds_exact_row_sum"].abs() / stats["ds_row_abs_sum"]).max().item()
    rounded = (stats["ds_row_sum"].abs() / stats["ds_row_abs_sum"]).median().item()
    assert exact < 1e-5
    assert rounded > 1e-4
    stats64 = {}
    q64, k64, v64 = normal_qkv(1, 2, 96, 32, seed=6)
    out64, lse64 = flash_attention(q64, k64, v64, "fp64", block_k=32)
    flash_attention_backward(q64, k64, v64, out64, lse64, _grad_out(q64), "fp64", block_k=32, stats=stats64)
    assert (stats64["ds_row_sum"].abs() / stats64["ds_row_abs_sum"]).max().item() < 1e-13


def _dyadic(t):
    """Values on a 2^-6 grid, small: adding an integer mu below 2^10 is exact in fp32 and fp64."""
    return torch.round(t * 64) / 64


def test_key_offset_leaves_forward_and_fp32_dq_unchanged_but_grows_the_bf16_dq_error():
    q, k, v = (_dyadic(t) for t in normal_qkv(1, 1, 128, 32, seed=7))
    do = _dyadic(_grad_out(q))
    direction = torch.zeros(32, dtype=torch.float64)
    direction[:4] = 1.0  # integer steps along it keep k + mu on the grid
    base64 = flash_attention(q, k, v, "fp64", block_k=32)[0]
    base32 = flash_attention(q.float(), k.float(), v.float(), "fp32", block_k=32)[0]
    dq32 = as_kernel(AttentionImpl("emulator", "fp32", block_k=32)).backward(q.float(), k.float(), v.float(), do.float())[0]
    bf16_errors = []
    for mu_norm in (0, 4, 64, 512):
        k_mu = k + mu_norm / 2 * direction  # |mu| = mu_norm, exactly representable
        assert (flash_attention(q, k_mu, v, "fp64", block_k=32)[0] - base64).abs().max().item() < 1e-12
        out32 = flash_attention(q.float(), k_mu.float(), v.float(), "fp32", block_k=32)[0]
        assert ((out32 - base32).norm() / base32.norm()).item() < 1e-4
        ops = [t.float() for t in (q, k_mu, v, do)]
        dq32_mu = as_kernel(AttentionImpl("emulator", "fp32", block_k=32)).backward(*ops)[0]
        assert ((dq32_mu - dq32).norm() / dq32.norm()).item() < 3e-3
        gold = golden_attention_backward(*ops)[0]
        dq_bf16 = as_kernel(AttentionImpl("emulator", "fa2_bf16", block_k=32)).backward(*ops)[0]
        bf16_errors.append(row_rel_l2(dq_bf16, gold).median().item())
    assert all(a < b for a, b in zip(bf16_errors, bf16_errors[1:])), bf16_errors
    assert bf16_errors[-1] > 20 * bf16_errors[0]


# -- the drop-in module -------------------------------------------------------------------------

def test_attention_module_recomputes_only_the_backward():
    q, k, v = (t.float().requires_grad_(True) for t in normal_qkv(1, 2, 48, 16, seed=8))
    module = Attention("emulator:fa2_bf16:bq64:bk16")
    out = module(q, k, v, is_causal=True)
    do = _grad_out(out)
    low = torch.autograd.grad(out, (q, k, v), do)
    module.backward_kernel = as_kernel(AttentionImpl("emulator", "fp32", block_k=16))
    out_fp32_bwd = module(q, k, v, is_causal=True)
    recomputed = torch.autograd.grad(out_fp32_bwd, (q, k, v), do)
    assert torch.equal(out, out_fp32_bwd)  # the forward exactly as it ran
    expected = as_kernel(module.backward_kernel).backward(q.detach(), k.detach(), v.detach(), do, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(recomputed, expected))
    assert not all(torch.equal(a, b) for a, b in zip(low, recomputed))


def test_attention_impl_parse_and_errors():
    impl = AttentionImpl.parse("emulator:fa2_bf16:fused", block_k=32)
    assert impl.family == "emulator" and impl.policy.name == "fa2_bf16" and impl.fused_scale_max and impl.block_k == 32
    assert impl.name == "emulator:fa2_bf16:bk32:bq64:fused"
    assert AttentionImpl.parse("reference:fp32").name == "reference:fp32"
    with pytest.raises(ValueError, match="unknown emulated implementation"):
        AttentionImpl.parse("triton:fp32")
    with pytest.raises(ValueError, match="unknown option 'fa9'"):
        AttentionImpl.parse("emulator:fa2_bf16:fa9")
    with pytest.raises(ValueError, match="unknown precision policy"):
        AttentionImpl.parse("emulator:fa9")


def test_fully_masked_rows_give_zero_gradients_and_no_nan():
    q, k, v = normal_qkv(1, 1, 32, 8, seed=9)
    bias = torch.zeros(1, 1, 32, 32, dtype=torch.float64)
    bias[..., :3, :] = -math.inf
    out, lse = flash_attention(q, k, v, "fa2_bf16", attn_bias=bias, block_k=8)
    dq, dk, dv = flash_attention_backward(q, k, v, out, lse, _grad_out(q), "fa2_bf16", attn_bias=bias, block_k=8)
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))
    assert torch.all(dq[..., :3, :] == 0)


# -- on a CUDA device (marked gpu: skipped without one; .ci/gpu runs them) --------------------


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["fp64", "fp32", "fa2_bf16"])
def test_cuda_backward_matches_cpu(policy):
    q, k, v = normal_qkv(1, 2, 300, 64, seed=0)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    impl = AttentionImpl("emulator", policy, block_q=64, block_k=64)
    cpu = as_kernel(impl).backward(q, k, v, do, causal=True)
    gpu = as_kernel(impl).backward(q.cuda(), k.cuda(), v.cuda(), do.cuda(), causal=True)
    gold = golden_attention_backward(q, k, v, do, causal=True)
    for a, b, g in zip(cpu, gpu, gold):
        assert b.device.type == "cuda"
        err_cpu, err_gpu = (a.double() - g).norm() / g.norm(), (b.cpu().double() - g).norm() / g.norm()
        assert err_gpu < {"fp64": 1e-12, "fp32": 1e-5}.get(policy, 3 * err_cpu.item() + 1e-3)


@pytest.mark.gpu
def test_cuda_training_runs():
    task = Task("induction", context=16, n_symbols=8, lm_loss=True)
    cfg = GPTConfig(vocab_size=task.vocab_size, context=16, n_layer=2, n_head=2, d_model=16,
                    attention=(AttentionImpl("emulator", "fa2_bf16", block_q=8, block_k=8),))
    tc = TrainConfig(steps=5, batch_size=4, warmup_steps=1, checkpoint_steps=(0, 5))
    a = train(tc, task, cfg, device="cuda", progress=False)
    assert a.checkpoints[5]["head.weight"].device.type == "cuda"
    assert torch.isfinite(torch.tensor(a.records["loss"].values)).all()
    assert not torch.equal(a.checkpoints[5]["head.weight"], a.checkpoints[0]["head.weight"])
