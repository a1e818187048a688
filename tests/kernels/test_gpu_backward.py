"""GPU checks of the backward emulator and the trainer: skipped without CUDA (run through the device tool)."""
import pytest
import torch

from attnum.kernels import AttentionImpl, as_kernel
from attnum.kernels import golden_attention_backward
from attnum.inputs import normal_qkv
from attnum.model import GPTConfig
from attnum.tasks import Task
from attnum.training import TrainConfig, train

def attention_forward(q, k, v, impl, *, causal=False, scale=None):
    """The differentiable output of a kernel (an ``AttentionImpl`` or registry name)."""
    return as_kernel(impl)(q, k, v, is_causal=causal, scale=scale)


def attention_grads(q, k, v, grad_out, impl, **kw):
    """``(dq, dk, dv)`` of a kernel through its registry interface."""
    return as_kernel(impl).backward(q, k, v, grad_out, **kw)


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("policy", ["fp64", "fp32", "fa2_bf16"])
def test_cuda_backward_matches_cpu(policy):
    q, k, v = normal_qkv(1, 2, 300, 64, seed=0)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    impl = AttentionImpl("emulator", policy, block_q=64, block_k=64)
    cpu = attention_grads(q, k, v, do, impl, causal=True)
    gpu = attention_grads(q.cuda(), k.cuda(), v.cuda(), do.cuda(), impl, causal=True)
    gold = golden_attention_backward(q, k, v, do, causal=True)
    for a, b, g in zip(cpu, gpu, gold):
        assert b.device.type == "cuda"
        err_cpu, err_gpu = (a.double() - g).norm() / g.norm(), (b.cpu().double() - g).norm() / g.norm()
        assert err_gpu < {"fp64": 1e-12, "fp32": 1e-5}.get(policy, 3 * err_cpu.item() + 1e-3)


def test_cuda_training_runs():
    task = Task("induction", context=16, n_symbols=8, lm_loss=True)
    cfg = GPTConfig(vocab_size=task.vocab_size, context=16, n_layer=2, n_head=2, d_model=16,
                    attention=(AttentionImpl("emulator", "fa2_bf16", block_q=8, block_k=8),))
    tc = TrainConfig(steps=5, batch_size=4, warmup_steps=1, checkpoint_steps=(0, 5))
    a = train(cfg, task, tc, device="cuda", progress=False)
    assert a.checkpoints[5]["head.weight"].device.type == "cuda"
    assert torch.isfinite(torch.tensor(a.records["loss"].values)).all()
    assert not torch.equal(a.checkpoints[5]["head.weight"], a.checkpoints[0]["head.weight"])
