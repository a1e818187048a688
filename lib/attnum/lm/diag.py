"""What the trainer measures besides the loss: per-layer attention statistics, the FP32-recompute
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
    dq_rel_err ...  the FP32-recompute diagnostic (``attnum.diagnostics.backward_errors``): the layer's
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

from ..diagnostics import backward_errors
from ..model import attention_statistics
from ..timing import Timer

LAYER_STATS = ("key_mean_norm", "key_norm", "key_mean_ratio", "offset_logit", "max_logit", "entropy", "max_prob")
DIAG_ERRORS = ("dq_rel_err", "dq_row_rel_err", "dk_rel_err", "dk_row_rel_err", "dv_rel_err", "dv_row_rel_err",
               "grad_norm_ratio")


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
                               causal=True, reference=fp32_reference())
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
    from .gpt import DTYPES

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
