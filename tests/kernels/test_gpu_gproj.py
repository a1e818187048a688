"""GPU checks of study 05's fixes: skipped without CUDA (run through the device tool)."""
import pytest
import torch

from attnum.attention import FIXES, AttentionImpl, attention_grads, with_fix
from attnum.backward import golden_attention_backward
from attnum.studies import gradient_blowup as blowup

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fix", list(FIXES))
def test_cuda_fix_matches_cpu(fix):
    q, k, v, do, _ = blowup.mechanism_operands(300, 64, 1.0, 100.0, seed=0)
    impl = with_fix(AttentionImpl("flash", "fa2_bf16", block_q=64, block_k=64, fused_scale_max=True), fix)
    cpu = attention_grads(q, k, v, do, impl, causal=True)
    gpu = attention_grads(q.cuda(), k.cuda(), v.cuda(), do.cuda(), impl, causal=True)
    gold = golden_attention_backward(q, k, v, do, causal=True)
    for a, b, g in zip(cpu, gpu, gold):
        assert b.device.type == "cuda"
        err_cpu, err_gpu = (a.double() - g).norm() / g.norm(), (b.cpu().double() - g).norm() / g.norm()
        assert err_gpu < 3 * err_cpu.item() + 1e-3
