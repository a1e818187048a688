"""GPU checks of study 05's fixes: skipped without CUDA (run through the device tool)."""
import pytest
import torch

from attnum.kernels import AttentionImpl, FIXES, as_kernel, with_fix
from attnum.kernels import golden_attention_backward
from attnum.studies import late_training_gradient_blowup as blowup

def attention_forward(q, k, v, impl, *, causal=False, scale=None):
    """The differentiable output of a kernel (an ``AttentionImpl`` or registry name)."""
    return as_kernel(impl)(q, k, v, is_causal=causal, scale=scale)


def attention_grads(q, k, v, grad_out, impl, **kw):
    """``(dq, dk, dv)`` of a kernel through its registry interface."""
    return as_kernel(impl).backward(q, k, v, grad_out, **kw)


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fix", list(FIXES))
def test_cuda_fix_matches_cpu(fix):
    q, k, v, do, _ = blowup.mechanism_operands(300, 64, 1.0, 100.0, seed=0)
    impl = with_fix(AttentionImpl("emulator", "fa2_bf16", block_q=64, block_k=64, fused_scale_max=True), fix)
    cpu = attention_grads(q, k, v, do, impl, causal=True)
    gpu = attention_grads(q.cuda(), k.cuda(), v.cuda(), do.cuda(), impl, causal=True)
    gold = golden_attention_backward(q, k, v, do, causal=True)
    for a, b, g in zip(cpu, gpu, gold):
        assert b.device.type == "cuda"
        err_cpu, err_gpu = (a.double() - g).norm() / g.norm(), (b.cpu().double() - g).norm() / g.norm()
        assert err_gpu < 3 * err_cpu.item() + 1e-3
