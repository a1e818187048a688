"""GPU checks: skipped without CUDA (CI); run through the device tool, results in the notes."""
import pytest
import torch

from attnum.kernels import flash_attention
from attnum.inputs import normal_qkv
from attnum.precision import round_to
from attnum.kernels import golden_attention, reference_attention

pytestmark = pytest.mark.gpu


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


def test_cuda_golden_and_reference_run_on_device():
    q, k, v = (t.cuda() for t in normal_qkv(1, 1, 4096, 64, seed=1))
    gold = golden_attention(q, k, v, chunk=512)
    ref = reference_attention(q, k, v, "fa2_bf16")
    assert gold.device.type == "cuda" and (ref - gold).abs().max().item() < 1e-2
