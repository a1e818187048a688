import math

import pytest
import torch

from attnum.kernels import flash_attention
from attnum.kernels.common import exponent as _exponent_base_e
from attnum.inputs import normal_qkv
from attnum.precision import get_policy, round_to
from attnum.kernels import golden_attention, reference_attention


@pytest.mark.parametrize("n_q,n_k,block_q,block_k", [(200, 200, 32, 48), (64, 130, 16, 32), (1025, 1025, 128, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("loop_order", ["q_outer", "k_outer"])
def test_flash_fp64_equals_golden(n_q, n_k, block_q, block_k, causal, loop_order):
    q, _, _ = normal_qkv(2, 2, n_q, 32, seed=1)
    _, k, v = normal_qkv(2, 2, n_k, 32, seed=2)
    gold, gold_lse = golden_attention(q, k, v, causal=causal, chunk=37, return_lse=True)
    out, lse = flash_attention(q, k, v, "fp64", causal=causal, block_q=block_q, block_k=block_k,
                               loop_order=loop_order)
    assert (out - gold).abs().max().item() < 1e-12
    assert (lse - gold_lse).abs().max().item() < 1e-12


def test_reference_fp64_equals_golden_with_additive_mask():
    q, k, v = normal_qkv(1, 2, 96, 16, seed=3)
    bias = torch.randn(1, 1, 96, 96, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bias[..., ::3] = -math.inf
    gold = golden_attention(q, k, v, attn_bias=bias, chunk=10)
    assert (reference_attention(q, k, v, "fp64", attn_bias=bias) - gold).abs().max().item() < 1e-12
    out, _ = flash_attention(q, k, v, "fp64", attn_bias=bias, block_q=32, block_k=20)
    assert (out - gold).abs().max().item() < 1e-12


def test_one_block_covering_all_keys_is_the_unblocked_computation():
    """block_k >= N: one online-softmax step, i.e. softmax with deferred normalisation, bit for bit."""
    pol = get_policy("fa2_bf16")
    q, k, v = (round_to(t.float(), "bf16") for t in normal_qkv(1, 2, 100, 32, seed=4))
    out, lse = flash_attention(q, k, v, pol, block_q=128, block_k=128)
    scale = 32 ** -0.5
    s = q @ k.transpose(-1, -2)
    m = s.amax(-1, keepdim=True)
    p = torch.exp((s - m) * scale)
    expected = round_to((round_to(p, "bf16") @ v) / p.sum(-1, keepdim=True), "bf16")
    assert torch.equal(out, expected)
    assert torch.allclose(lse, (m * scale + torch.log(p.sum(-1, keepdim=True))).squeeze(-1))
    # and tiling really changes the rounding: a smaller key block gives a different output
    tiled, _ = flash_attention(q, k, v, pol, block_q=128, block_k=16)
    assert not torch.equal(tiled, out)


def test_block_q_has_no_effect_without_masks_but_block_k_has():
    q, k, v = normal_qkv(1, 1, 256, 32, seed=5)
    a, _ = flash_attention(q, k, v, "all_bf16", block_q=16, block_k=32)
    b, _ = flash_attention(q, k, v, "all_bf16", block_q=128, block_k=32)
    c, _ = flash_attention(q, k, v, "all_bf16", block_q=16, block_k=64)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_fused_scale_max_leaves_nonzero_exponent_at_the_max():
    pol = get_policy("fa2_bf16")
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(512, 64, generator=g) * 20).float()
    m = s.amax(-1, keepdim=True)
    at_max = s == m
    p_plain = _exponent_base_e(s, m, 0.125, False, pol)
    p_fused = _exponent_base_e(s, m, 0.125, True, pol)
    assert torch.all(p_plain[at_max] == 1.0)  # subtract-then-scale: exp(0) exactly
    assert (p_fused[at_max] != 1.0).float().mean().item() > 0.2  # seed 004: often not exactly 1
    assert (p_fused[at_max] - 1.0).abs().max().item() < 1e-5


def test_fused_flash_differs_from_plain_but_both_are_accurate():
    q, k, v = (round_to(t, "bf16") for t in normal_qkv(1, 1, 256, 64, seed=6, std=3.0))
    gold = golden_attention(q, k, v)
    plain, _ = flash_attention(q, k, v, "fa2_bf16", fused_scale_max=False)
    fused, _ = flash_attention(q, k, v, "fa2_bf16", fused_scale_max=True)
    assert not torch.equal(plain, fused)
    for out in (plain, fused):
        assert torch.linalg.vector_norm(out - gold) / torch.linalg.vector_norm(gold) < 1e-2


def test_fully_masked_rows_give_zero_and_no_nan():
    q, k, v = normal_qkv(1, 1, 64, 16, seed=7)
    bias = torch.zeros(1, 1, 64, 64, dtype=torch.float64)
    bias[..., :5, :] = -math.inf
    for out, lse in (flash_attention(q, k, v, "fa2_bf16", attn_bias=bias, block_k=16),
                     reference_attention(q, k, v, "fa2_bf16", attn_bias=bias, return_lse=True)):
        assert not torch.isnan(out).any()
        assert torch.all(out[..., :5, :] == 0)
        assert torch.all(torch.isneginf(lse[..., :5]))
        assert torch.all(out[..., 5:, :].abs().sum(-1) > 0)


def test_finite_sentinel_underflows_rows_below_it():
    """FlashInfer's -5e4: valid raw logits all below it never raise the running max -> zero output."""
    d = 64
    q = torch.zeros(1, 1, 1, d, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 8, d, dtype=torch.float64)
    k[..., 0] = -6e4 + torch.arange(8, dtype=torch.float64)  # raw scores -6e4 .. -6e4 + 7
    v = torch.randn(1, 1, 8, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gold = golden_attention(q, k, v)
    sentinel, _ = flash_attention(q, k, v, "fa2_bf16", mask_fill=-5e4, block_k=4)
    exact, _ = flash_attention(q, k, v, "fp32", mask_fill="-inf", block_k=4)
    assert gold.abs().sum() > 0
    assert torch.all(sentinel == 0)
    assert (exact - gold).abs().max().item() < 1e-5


def test_bad_arguments_are_named():
    q, k, v = normal_qkv(1, 1, 8, 4, seed=0)
    with pytest.raises(ValueError, match="loop_order"):
        flash_attention(q, k, v, loop_order="diagonal")
    with pytest.raises(ValueError, match="block sizes"):
        flash_attention(q, k, v, block_k=0)
    with pytest.raises(ValueError, match="mask_fill"):
        flash_attention(q, k, v, mask_fill="+inf")
    with pytest.raises(ValueError, match="4-D"):
        flash_attention(q[0], k[0], v[0])


def test_golden_chunking_does_not_change_the_answer():
    q, k, v = normal_qkv(1, 2, 300, 16, seed=8)
    a = golden_attention(q, k, v, chunk=300)
    b = golden_attention(q, k, v, chunk=7)
    assert (a - b).abs().max().item() < 1e-14


@pytest.mark.parametrize("policy", ["fp64", "fa2_bf16", "all_fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_query_chunked_reference_is_the_same_computation(policy, causal):
    q, _, _ = normal_qkv(1, 2, 300, 32, seed=9)
    _, k, v = normal_qkv(1, 2, 340, 32, seed=10)
    whole, lse = reference_attention(q, k, v, policy, causal=causal, return_lse=True)
    chunked, lse_c = reference_attention(q, k, v, policy, causal=causal, return_lse=True, query_chunk=64)
    assert torch.equal(whole, chunked) and torch.equal(lse, lse_c)


# -- on a CUDA device (marked gpu: skipped without one; .ci/gpu runs them) --------------------


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["fp64", "fp32", "fa2_bf16", "all_fp16"])
def test_cuda_emulator_matches_cpu(policy):
    q, k, v = (round_to(t, "bf16") for t in normal_qkv(1, 2, 700, 64, seed=0))
    cpu, _ = flash_attention(q, k, v, policy, causal=True, block_q=64, block_k=64)
    gpu, _ = flash_attention(q.cuda(), k.cuda(), v.cuda(), policy, causal=True, block_q=64, block_k=64)
    gold = golden_attention(q, k, v, causal=True)
    assert gpu.device.type == "cuda"
    err_cpu, err_gpu = (cpu - gold).abs().max().item(), (gpu.cpu() - gold).abs().max().item()
    tol = {"fp64": 1e-12, "fp32": 1e-5}.get(policy)
    if tol:
        assert err_gpu < tol
    else:  # different matmul blocking: same error level, not the same bits
        assert err_gpu < 3 * err_cpu + 1e-3


@pytest.mark.gpu
def test_cuda_golden_and_reference_run_on_device():
    q, k, v = (t.cuda() for t in normal_qkv(1, 1, 4096, 64, seed=1))
    gold = golden_attention(q, k, v, chunk=512)
    ref = reference_attention(q, k, v, "fa2_bf16")
    assert gold.device.type == "cuda" and (ref - gold).abs().max().item() < 1e-2
