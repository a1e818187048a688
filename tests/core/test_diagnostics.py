"""The FP32 backward-recompute diagnostic reads exactly the operands the kernel read, in both passes."""
import numpy as np
import torch

from attnum.train import diag as diagnostics
from attnum.kernels import FP32_BACKWARD, AttentionImpl, as_kernel
from attnum.model import GPT, GPTConfig, add_key_offset
from attnum.precision import get_policy, round_to
from attnum.train import Task

# a kernel whose only rounding is of its operands: its backward is the exact FP32 backward of the
# rounded q, k, v, dO, so a recompute on the operands it read must find no difference at all
INPUTS_ONLY = AttentionImpl("emulator", get_policy("fp32").replace(name="fp32+in=bf16", inputs="bf16",
                                                                     grad_out="bf16"), block_q=8, block_k=8)


def _model(impl, offset=0.0):
    task = Task("induction", context=16, n_symbols=8, lm_loss=True)
    cfg = GPTConfig(vocab_size=task.vocab_size, context=16, n_layer=2, n_head=2, d_model=16, attention=(impl,))
    model = GPT(cfg, seed=2)
    add_key_offset(model, 1, torch.full((16,), offset))
    return model, task.batch(0, 8)


def test_gradient_norm_ratios_compare_against_the_recompute_on_the_rounded_operands():
    # with a key offset of 300 per component the bf16 rounding of the keys changes the problem:
    # an FP32 backward on the unrounded keys (the old second pass) gave a query/key gradient-norm
    # ratio of 0.61 in layer 1 for this kernel; on the operands the kernel read it is 1
    model, batch = _model(INPUTS_ONLY, offset=300.0)
    ds = diagnostics.recompute_backward_fp32(model, batch, reference=INPUTS_ONLY.replace(block_q=8, block_k=8))
    np.testing.assert_allclose(ds["grad_norm_qk_ratio"].values, 1.0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ds["grad_norm_ratio"].values, 1.0, rtol=0, atol=1e-5)
    assert abs(float(ds["total_grad_norm_ratio"]) - 1.0) < 1e-6
    assert int(ds["forward_identical"]) == 1
    # the default FP32 reference on the same operands: still the kernel's own problem (ratio near 1)
    fp32 = diagnostics.recompute_backward_fp32(model, batch)
    assert np.all(np.abs(fp32["grad_norm_qk_ratio"].values - 1.0) < 1e-3)


def test_the_old_second_pass_would_have_counted_the_operand_rounding():
    # the same model, the reference handed the unrounded operands (what the diagnostic did before)
    model, batch = _model(INPUTS_ONLY, offset=300.0)
    attns = model.attention_modules()
    norms = []
    for backward_kernel in (None, FP32_BACKWARD, diagnostics.OperandsOf(attns[1].attention.kernel)):
        attns[1].attention.backward_kernel = None if backward_kernel is None else as_kernel(backward_kernel)
        model.zero_grad(set_to_none=True)
        _, loss = model(*batch)
        loss.backward()
        norms.append(float(torch.linalg.vector_norm(attns[1].qkv.weight.grad[:32])))
    attns[1].attention.backward_kernel = None
    trained, unrounded, rounded = norms
    assert abs(trained / unrounded - 1) > 0.1  # the old comparison: a ratio far from 1 for an exact kernel
    assert abs(trained / rounded - 1) < 1e-5


def test_operands_of_reads_what_the_kernel_reads():
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 24, 8, generator=gen) for _ in range(4))
    k = k + 200.0
    kernel = as_kernel(AttentionImpl("emulator", "fa2_bf16", block_q=8, block_k=8))
    recompute = diagnostics.OperandsOf(kernel)
    got = recompute.backward(q, k, v, do, causal=True)
    on_rounded = as_kernel(FP32_BACKWARD).backward(*(round_to(t, "bf16") for t in (q, k, v, do)), causal=True)
    on_given = as_kernel(FP32_BACKWARD).backward(q, k, v, do, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(got, on_rounded))
    assert not torch.allclose(got[0], on_given[0], rtol=1e-2, atol=0)
    assert recompute.name.startswith(as_kernel(FP32_BACKWARD).name) and kernel.name in recompute.name
    # a kernel that rounds nothing: the recompute is the reference on the given operands
    plain = diagnostics.OperandsOf(FP32_BACKWARD)
    assert all(torch.equal(a, b) for a, b in zip(plain.backward(q, k, v, do), as_kernel(FP32_BACKWARD).backward(q, k, v, do)))
