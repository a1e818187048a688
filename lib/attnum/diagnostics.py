"""The FP32 backward-recompute diagnostic of seed 004.

Seed 004's test for a faulty attention backward: keep the forward of a
checkpoint exactly as it ran, recompute the backward of selected attention
layers in FP32, and compare. If the gradient norm drops sharply, the attention
kernel, not the data, optimiser or architecture, made the excess gradient.

Two entry points:

* ``backward_errors(q, k, v, grad_out, kernel)`` on raw tensors (saved from any
  model): the gradients the implementation computes (from a stored ``out`` and
  ``lse`` when given, i.e. the forward exactly as it ran) against the FP32
  recompute on the same operands;
* ``recompute_backward_fp32(model, batch, layers)`` on an ``attnum.model.GPT``
  (any checkpoint): two backward passes of the same forward, the second with the
  selected layers' attention backward recomputed in FP32; per layer the ratio of
  gradient norms and the dQ, dK, dV errors on that layer's own (q, k, v, dO).

The FP32 recompute reads the operands the kernel read (q, k, v rounded by its
``inputs`` stage, dO by its ``grad_out`` stage; ``Kernel.read_operands``), in both
entry points: the error tables and the second backward pass whose gradient norms
give the ratios. What is measured is the error of the kernel's arithmetic, not of
rounding its inputs. (Until this was fixed the second backward pass of
``recompute_backward_fp32`` ran the FP32 reference on the unrounded q, k, v, dO, so
its gradient-norm ratios also counted the rounding of the operands.)

Two dQ error metrics, never to be compared with each other: ``<g>_rel_err`` is the
global relative L2 error (all rows together, what the flag uses); ``<g>_row_rel_err``
the median over rows of each row's relative L2 error (the metric of seed 004's 219%).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import xarray as xr

from .kernels import FP32_BACKWARD, Kernel, as_kernel
from .metrics import GRADS, gradient_errors
from .model import GPT, grad_norms

DEFAULT_THRESHOLD = 0.1

ATTRS = {
    "grad_norm_low": ("1", "gradient norm of the block with the attention backward as trained"),
    "grad_norm_fp32": ("1", "gradient norm of the block with the selected layers' attention backward in FP32"),
    "grad_norm_ratio": ("1", "block gradient norm, as trained / FP32 attention backward"),
    "grad_norm_qk_ratio": ("1", "query/key projection gradient norm, as trained / FP32 attention backward"),
    "total_grad_norm_ratio": ("1", "model gradient norm, as trained / FP32 attention backward"),
    "forward_identical": ("1", "1 if both backward passes saw bitwise the same loss"),
    "flagged": ("1", "1 if the largest dQ/dK/dV global relative L2 error (all rows together) exceeds the threshold"),
    "threshold": ("1", "global relative L2 error threshold of the flag"),
}
for _g in GRADS:
    ATTRS[f"{_g}_rel_err"] = ("1", f"global relative L2 error (all rows together) of {_g} against the FP32 recompute")
    ATTRS[f"{_g}_row_rel_err"] = ("1", f"median over rows of the row relative L2 error of {_g}")
    ATTRS[f"{_g}_norm_ratio"] = ("1", f"||{_g}|| / ||{_g} of the FP32 recompute||")


def _ratio(a: float, b: float) -> float:
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def backward_errors(q, k, v, grad_out, kernel, *, causal: bool = False, scale: float | None = None,
                    out=None, lse=None, reference=FP32_BACKWARD,
                    threshold: float = DEFAULT_THRESHOLD) -> dict[str, float]:
    """Errors of ``kernel``'s attention gradients against the FP32 recompute, on raw tensors.

    ``out``/``lse``: what the forward stored (the emulator); without them the forward is
    recomputed, which is the same thing for a deterministic kernel.
    Returns per gradient ``<g>_rel_err`` (relative L2), ``<g>_row_rel_err`` (median row
    relative error), ``<g>_norm_ratio``, plus ``grad_norm_ratio`` over all three and ``flagged``.
    """
    kernel, reference = as_kernel(kernel), as_kernel(reference)
    low = kernel.backward(q, k, v, grad_out, causal=causal, scale=scale, out=out, lse=lse)
    operands = kernel.read_operands(q, k, v, grad_out)
    ref = reference.backward(*(t.float() for t in operands), causal=causal, scale=scale)
    errors = gradient_errors(low, ref, global_l2=True)
    result = {}
    for name in GRADS:
        result[f"{name}_rel_err"] = errors[f"{name}_rel_err"]
        result[f"{name}_row_rel_err"] = errors[f"{name}_err"]  # the median row error, named for this table
        result[f"{name}_norm_ratio"] = errors[f"{name}_norm_ratio"]
    norm = lambda ts: math.sqrt(sum(torch.linalg.vector_norm(t.double()).item() ** 2 for t in ts))
    result["grad_norm_ratio"] = _ratio(norm(low), norm(ref))
    result["flagged"] = int(max(result[f"{g}_rel_err"] for g in GRADS) > threshold)
    return result


class OperandsOf(Kernel):
    """``reference``'s backward on the operands ``kernel`` reads (``kernel.read_operands``: q, k, v
    and dO rounded as the kernel rounds them): the FP32 recompute of the diagnostic's second backward
    pass, so that both passes differentiate the same operands. Its gradients are those of the
    rounded operands, passed straight through to the unrounded ones, as the kernel's are."""

    def __init__(self, kernel, reference=FP32_BACKWARD):
        self.kernel, self.reference = as_kernel(kernel), as_kernel(reference)
        self.name = f"{self.reference.name}@operands_of({self.kernel.name})"
        self.gives_lse = self.reference.gives_lse

    def unavailable_reason(self, device="cpu"):
        return self.reference.unavailable_reason(device)

    def read_operands(self, q, k, v, grad_out):
        return self.kernel.read_operands(q, k, v, grad_out)

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        q, k, v, _ = self.read_operands(q, k, v, q)
        return self.reference.forward(q.float(), k.float(), v.float(), causal=causal, attn_bias=attn_bias,
                                      scale=scale)

    def backward(self, q, k, v, grad_out, *, causal=False, attn_bias=None, scale=None, out=None, lse=None,
                 stats=None):
        operands = (t.float() for t in self.read_operands(q, k, v, grad_out))
        return self.reference.backward(*operands, causal=causal, attn_bias=attn_bias, scale=scale)


def _backward(model: GPT, inputs, targets):
    model.zero_grad(set_to_none=True)
    _, loss = model(inputs, targets)
    loss.backward()
    n_layer = len(model.blocks)
    norms = [grad_norms(model, layer) for layer in range(n_layer)]
    total = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
    return loss.item(), norms, total


def recompute_backward_fp32(model: GPT, batch, layers=None, *, threshold: float = DEFAULT_THRESHOLD,
                            reference=FP32_BACKWARD) -> xr.Dataset:
    """Per selected layer: gradient-norm ratios (as trained / FP32 attention backward) and
    dQ, dK, dV errors on the layer's own (q, k, v, dO); ``flagged`` past ``threshold``.

    The second backward pass recomputes each selected layer's attention backward under
    ``reference`` on the operands that layer's kernel read (``OperandsOf``), as the error
    tables do.

    The model is left as it was (no gradients kept, no layer changed).
    """
    inputs, targets = batch
    reference = as_kernel(reference)
    attns = model.attention_modules()
    layers = list(range(len(attns))) if layers is None else sorted(layers)
    try:
        for layer in layers:
            attns[layer].attention.capture = {}
        loss_low, norms_low, total_low = _backward(model, inputs, targets)
        captured = [attns[layer].attention.capture for layer in layers]
        for layer in layers:
            attns[layer].attention.capture = None
            attns[layer].attention.backward_kernel = OperandsOf(attns[layer].attention.kernel, reference)
        loss_ref, norms_ref, total_ref = _backward(model, inputs, targets)
    finally:
        for attn in attns:
            attn.attention.capture = None
            attn.attention.backward_kernel = None
        model.zero_grad(set_to_none=True)

    data = {name: np.full(len(layers), np.nan) for name in ATTRS if name not in
            ("total_grad_norm_ratio", "forward_identical", "threshold")}
    for i, (layer, cap) in enumerate(zip(layers, captured)):
        data["grad_norm_low"][i] = norms_low[layer]["grad_norm"]
        data["grad_norm_fp32"][i] = norms_ref[layer]["grad_norm"]
        data["grad_norm_ratio"][i] = _ratio(norms_low[layer]["grad_norm"], norms_ref[layer]["grad_norm"])
        data["grad_norm_qk_ratio"][i] = _ratio(norms_low[layer]["grad_norm_qk"], norms_ref[layer]["grad_norm_qk"])
        errors = backward_errors(cap["q"], cap["k"], cap["v"], cap["grad_out"], attns[layer].attention.kernel,
                                 causal=cap["causal"], scale=cap["scale"], reference=reference,
                                 threshold=threshold)
        for name in data:
            if name in errors:
                data[name][i] = errors[name]
    ds = xr.Dataset({name: ("layer", values) for name, values in data.items()}, coords={"layer": layers})
    ds["flagged"] = ds["flagged"].astype(np.int8)
    ds["total_grad_norm_ratio"] = _ratio(total_low, total_ref)
    ds["forward_identical"] = np.int8(loss_low == loss_ref)
    ds["threshold"] = float(threshold)
    for name in ds.data_vars:
        units, long_name = ATTRS[name]
        ds[name].attrs.update(units=units, long_name=long_name)
    return ds
