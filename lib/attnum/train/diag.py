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

-- What the corpus trainer measures on its diagnostic batch --

What the trainer measures besides the loss: per-layer attention statistics, the FP32-recompute
diagnostic's dQ error, per-layer gradient norms, the time attention takes, and weight sketches.

Per layer, on a fixed diagnostic batch (the first ``diag_batch`` validation windows, the same at
every log step; one forward and backward of the model, no optimiser step), from the q, k, v the
layer's kernel read and the dO it was given (``CausalSelfAttention.capture``):

    key_mean_norm   ||mean_j k_j||, the common key offset (seed 004's mu), mean over sequences and heads
    key_norm        mean_j ||k_j||; key_mean_ratio = key_mean_norm / key_norm (1: all keys alike)
    offset_logit    mean_i |q_i . mean_j k_j| * scale: the score shift the offset adds to each row
                    (softmax ignores it exactly; the rounded backward does not, seed 004 cause 2)
    max_logit       the largest scaled causal score
    entropy         mean over rows of -sum_j P_ij log P_ij (nats); max_prob the mean row maximum of P
    dq_rel_err ...  the FP32-recompute diagnostic (``attnum.train.diag.backward_errors``): the layer's
                    kernel backward on the operands it read against the same backward computed by
                    ``sdpa:math`` in fp32 on those operands upcast exactly (TF32 off); global relative
                    L2 error (``*_rel_err``) and median row error (``*_row_rel_err``) of dQ, dK, dV

All of it is computed in fp32 from the full (sequences, heads, N, N) score matrix of the
diagnostic batch; memory ~ 4 * diag_batch * heads * N^2 bytes per tensor, one layer at a time.

Weight sketches (``weight_sketches``): per tensor, the sorted values cut into ``K`` equal runs
and each run's mean (``K`` = min(sketch_size, numel); NaN padding). For two tensors of the same
size, mean_k |a_k - b_k| over the run means is a lower bound of the exact Wasserstein-1 distance
mean_i |sort(a)_i - sort(b)_i| (triangle inequality within each run), equal to it when within each
run the order statistics of the two differ by the same sign. ``exact_drift`` gives the exact W1,
max |a - b| and ||a - b|| / ||a|| of two models held in one process (the pair mode).
"""
from __future__ import annotations

import math
import statistics

import numpy as np
import torch
import xarray as xr

from ..kernels import FP32_BACKWARD, Kernel, as_kernel
from ..metrics import GRADS, gradient_errors
from ..model import GPT, attention_statistics, grad_norms
from ..timing import Timer

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
                    threshold: float = DEFAULT_THRESHOLD, signature: bool = False) -> dict[str, float]:
    """Errors of ``kernel``'s attention gradients against the FP32 recompute, on raw tensors.

    ``out``/``lse``: what the forward stored (the emulator); without them the forward is
    recomputed, which is the same thing for a deterministic kernel.
    Returns per gradient ``<g>_rel_err`` (relative L2), ``<g>_row_rel_err`` (median row
    relative error), ``<g>_norm_ratio``, plus ``grad_norm_ratio`` over all three and ``flagged``;
    ``signature``: also ``dq_err_pk_cos`` (``dq_error_signature``).
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
    if signature:
        result["dq_err_pk_cos"] = dq_error_signature(low[0], ref[0], operands[0], operands[1], causal=causal,
                                                     scale=scale)
    return result


@torch.no_grad()
def dq_error_signature(dq, dq_ref, q, k, *, causal: bool = True, scale: float | None = None) -> float:
    """Median over rows of |cos(dQ_i - dQ_ref_i, (P K)_i)|, in fp32 (rows without error left out; NaN if none).

    The mechanism of seed 004's cause 2: with dS rounded, sum_j dS_ij is no longer 0, and dQ_i = sum_j dS_ij k_j
    gains (sum_j dS_ij) times a vector common to the keys; with a common key offset mu every (P K)_i is near mu,
    so an error made by that mechanism lines up with (P K)_i (|cos| -> 1), while rounding noise spread over
    the keys gives |cos| ~ d^-1/2.
    """
    q, k = q.float(), k.float()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(m - n + 1), -math.inf)
    pk = torch.softmax(s, dim=-1) @ k
    err = dq.float() - dq_ref.float()
    en, pn = err.norm(dim=-1), pk.norm(dim=-1)
    ok = (en > 0) & (pn > 0)
    if not bool(ok.any()):
        return math.nan
    cos = ((err * pk).sum(-1)[ok] / (en[ok] * pn[ok])).abs()
    return float(cos.median())


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


# -- the corpus trainer's per-layer statistics, errors, timing and weight sketches --
LAYER_STATS = ("key_mean_norm", "key_norm", "key_mean_ratio", "offset_logit", "max_logit", "entropy", "max_prob")
DIAG_ERRORS = ("dq_rel_err", "dq_row_rel_err", "dk_rel_err", "dk_row_rel_err", "dv_rel_err", "dv_row_rel_err",
               "grad_norm_ratio", "dq_err_pk_cos")


def attention_stats(q, k, scale: float | None = None) -> dict[str, float]:
    """``LAYER_STATS`` of causal attention with scores q k^T * scale, in fp32 (see the module docstring)."""
    return attention_statistics(q, k, scale, extended=True)


_FP32_REFERENCE = None


def fp32_reference():
    global _FP32_REFERENCE
    if _FP32_REFERENCE is None:
        from ..kernels import get

        _FP32_REFERENCE = get("sdpa:math")
    return _FP32_REFERENCE


def recompute_errors(capture: dict, kernel) -> dict[str, float]:
    """The FP32-recompute diagnostic on one layer's captured operands (see the module docstring)."""
    with torch.autocast(capture["q"].device.type, enabled=False):
        errs = backward_errors(capture["q"], capture["k"], capture["v"], capture["grad_out"], kernel,
                               causal=True, reference=fp32_reference(), signature=True)
    return {name: float(errs[name]) for name in DIAG_ERRORS}


def layer_grad_norms(model) -> tuple[list[float], list[float], float]:
    """Per block: the gradient norm of all its parameters and of the q/k rows of its qkv
    projection; and the whole model's gradient norm. One device sync."""
    per_block, per_qk = [], []
    for block in model.blocks:
        grads = [p.grad.float() for p in block.parameters() if p.grad is not None]
        per_block.append(torch.sqrt(sum((g * g).sum() for g in grads)) if grads else torch.zeros(()))
        d = block.attn.proj.weight.shape[0]
        qk = [p.grad[:2 * d].float() for p in (block.attn.qkv.weight, block.attn.qkv.bias) if p.grad is not None]
        per_qk.append(torch.sqrt(sum((g * g).sum() for g in qk)) if qk else torch.zeros(()))
    total = [p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None]
    values = torch.stack([torch.as_tensor(x, device=per_block[0].device) for x in per_block + per_qk]
                         + [torch.sqrt(sum(total))]).double().cpu().tolist()
    n = len(per_block)
    return values[:n], values[n:2 * n], values[-1]


def time_attention(choice, shape, device, repeats: int = 10, warmup: int = 3) -> dict[str, float]:
    """Median seconds of one attention forward and of forward + backward, alone, on random
    operands of ``shape`` (batch, heads, N, d) in the choice's dtype; status as data."""
    from ..model import DTYPES

    kernel = choice.kernel()
    reason = kernel.unavailable_reason(device)
    if reason:
        return {"status": f"unavailable: {reason}", "fwd_s": math.nan, "fwd_bwd_s": math.nan}
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=gen).to(device=device, dtype=DTYPES[choice.dtype])
                   for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    timer = Timer(device)
    fwd, both = [], []
    try:
        for i in range(warmup + repeats):
            t0 = timer.mark()
            with torch.no_grad():
                kernel(q, k, v, is_causal=True)
            t1 = timer.mark()
            out = kernel(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), do)
            t2 = timer.mark()
            if i >= warmup:
                fwd.append(timer.seconds(t0, t1))
                both.append(timer.seconds(t1, t2))
    except torch.OutOfMemoryError:
        return {"status": "out of memory", "fwd_s": math.nan, "fwd_bwd_s": math.nan}
    except Exception as exc:  # a refusal or a compile failure: data, not a crash of the run
        return {"status": f"failed: {type(exc).__name__}: {str(exc)[:300]}", "fwd_s": math.nan,
                "fwd_bwd_s": math.nan}
    return {"status": "ok", "fwd_s": statistics.median(fwd), "fwd_bwd_s": statistics.median(both)}


# -- weights ---------------------------------------------------------------------------------------

def tensor_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters()]


@torch.no_grad()
def weight_sketches(model, size: int) -> np.ndarray:
    """(tensor, size) float32: per tensor the means of ``K`` equal runs of its sorted values
    (``K`` = min(size, numel), the rest NaN; runs split as evenly as ``torch.tensor_split`` does)."""
    out = np.full((len(tensor_names(model)), size), np.nan, dtype=np.float32)
    for i, (_, p) in enumerate(model.named_parameters()):
        values = p.detach().float().flatten().sort().values
        k = min(size, values.numel())
        out[i, :k] = _run_means(values.double(), k).cpu().numpy()
    return out


@torch.no_grad()
def weight_l2(model) -> np.ndarray:
    """(tensor,) float64: the L2 norm of every parameter (the reference scale of drift.aggregate)."""
    return torch.stack([p.detach().double().norm() for p in model.parameters()]).cpu().numpy()


def _run_means(sorted_values: torch.Tensor, k: int) -> torch.Tensor:
    """Means of the ``k`` runs ``torch.tensor_split`` would make, by cumulative sums (one pass)."""
    n = sorted_values.numel()
    bounds = torch.tensor([(i * (n // k) + min(i, n % k)) for i in range(k + 1)], device=sorted_values.device)
    csum = torch.cat([sorted_values.new_zeros(1), sorted_values.cumsum(0)])
    return (csum[bounds[1:]] - csum[bounds[:-1]]) / (bounds[1:] - bounds[:-1]).double()


def sketch_wasserstein(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Lower bound of the per-tensor W1 from two sketches (..., K) of equal-size tensors:
    the mean over the runs of |a_k - b_k| (NaN padding ignored)."""
    return np.nanmean(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), axis=-1)


@torch.no_grad()
def exact_drift(model_a, model_b) -> dict[str, np.ndarray]:
    """Per tensor: exact W1 (mean |sort(a) - sort(b)| in float64), max |a - b| and ||a - b|| / ||a||."""
    w1, max_abs, rel = [], [], []
    for (name, a), (name_b, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        if name != name_b or a.shape != b.shape:
            raise ValueError(f"the two models differ at {name!r} / {name_b!r}")
        a64, b64 = a.detach().double().flatten(), b.detach().double().flatten()
        w1.append((a64.sort().values - b64.sort().values).abs().mean())
        max_abs.append((a64 - b64).abs().max())
        rel.append((a64 - b64).norm() / a64.norm().clamp_min(1e-300))
    stack = lambda xs: torch.stack(xs).cpu().numpy()
    return {"w1": stack(w1), "max_abs": stack(max_abs), "rel_l2": stack(rel)}
