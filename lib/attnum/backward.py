"""FlashAttention-style backward emulator under a precision policy, and its fp64 golden.

The algorithm follows FlashAttention-2 (Dao 2023, Alg. 2), which FlashAttention-3
keeps: the forward stores only the output O and the log-sum-exp L; the backward
loops over key blocks (outer; one thread block each on a GPU) and, for each,
over the query rows that reach it:

    S   = Q K_j^T                         raw scores (score format)
    P   = exp(S * scale - L)              recomputed from the stored L (no row max)
    dV_j = P~^T dO                        P rounded to ``p_bwd``
    dP  = dO V_j^T                        (dp)
    dS  = P * (dP - D),  D_i = sum_j dO_ij O_ij from the stored O    (dp, delta)
    dS~ = round(dS, ds)                   seed 004, cause 2: rows of dS~ no longer sum to 0
    dQ += dS~ K_j                         (grad_acc, carried across key blocks)
    dK_j = dS~^T Q * scale

and finally dQ *= scale. Every rounding point is a stage of the precision
policy (``attnum.precision``), so the FP32 backward is this code with every
backward stage in fp32. ``fused_scale_max`` recomputes P the way FA3 does,
``exp2(fma(S, scale * log2 e, -L * log2 e))``, matching the forward option of
the same name (seed 004, cause 1).

Vectorisation as in ``attnum.flash``: the only Python loop is over key blocks;
all query rows that reach a key block are processed at once, so dK_j and dV_j
are one fp32-accumulated matmul over those rows, rounded to ``grad_acc`` once.

``golden_attention_backward`` computes the exact gradients in fp64, in query
chunks, with the exact output (not a stored one) in D: the value every study
measures against.

Where fixes go (study 05): a correction of the rounded dS (GProj) acts between
``ds = round(ds_exact, ds)`` and the two matmuls, with the row sums r_i that
``stats["ds_row_sum"]`` already accumulates in the carrier format; its dK part
needs a pass over key blocks that computes r first. Options of the kernel travel
in ``attnum.attention.AttentionImpl`` next to ``fused_scale_max``.
"""
from __future__ import annotations

import math

import torch

from .precision import LOG2E, PrecisionPolicy, get_policy
from .reference import _check_qkv, default_scale


def _recompute_p(s, lse, scale: float, fused: bool, pol: PrecisionPolicy):
    """P = exp(S * scale - L) from raw scores ``s`` and the stored log-sum-exp ``lse`` (..., rows, 1).

    Rows with L = -inf (every key masked) give P = 0.
    """
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    if not fused:
        return torch.exp(pol.round(pol.round(s * scale, "stats") - lse, "stats"))
    # FA3: P = exp2(s * c - L * log2 e), one FMA on the raw score, like the forward.
    c = pol.round(torch.tensor(scale * LOG2E, dtype=s.dtype, device=s.device), "stats")
    lse2 = pol.round(lse * LOG2E, "stats")
    if s.dtype == torch.float64:
        x = s * c - lse2
    else:
        x = (s.double() * c.double() - lse2.double()).to(s.dtype)  # one rounding, as an fp32 FMA
    return torch.exp2(pol.round(x, "stats"))


def flash_attention_backward(q, k, v, out, lse, grad_out, policy: str | PrecisionPolicy = "fa2_bf16", *,
                             scale: float | None = None, causal: bool = False,
                             attn_bias: torch.Tensor | None = None, block_q: int = 128, block_k: int = 128,
                             fused_scale_max: bool = False, stats: dict | None = None):
    """Emulated FlashAttention backward. Returns ``(dq, dk, dv)`` in the policy's carrier dtype.

    ``q, k, v`` are the forward's inputs (rounded to the ``inputs`` format here, as the
    forward did), ``out`` and ``lse`` what the forward stored, ``grad_out`` = dL/dO.
    ``attn_bias`` (additive, no gradient) and ``causal`` must be the forward's.

    ``stats``: a dict to fill with per-row diagnostics of shape (batch, heads, n_q):
    ``ds_row_sum`` (sum_j of dS as fed to the matmuls), ``ds_exact_row_sum`` (the same
    before the ``ds`` rounding) and ``ds_row_abs_sum`` (sum_j |dS~_ij|).
    """
    _check_qkv(q, k, v)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    pol = get_policy(policy)
    carrier = pol.carrier
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (pol.round(t.to(carrier), "inputs") for t in (q, k, v))
    out = out.to(carrier)
    grad_out = pol.round(grad_out.to(carrier), "grad_out")
    lse = lse.to(carrier).unsqueeze(-1)
    n_q, n_k = q.shape[-2], k.shape[-2]
    offset = n_k - n_q
    bias = None if attn_bias is None else attn_bias.to(carrier).expand(q.shape[:2] + (n_q, n_k))

    # -- preprocessing: D_i = rowsum(dO * O) from the stored (rounded) output --
    delta = pol.round((grad_out * out).sum(dim=-1, keepdim=True), "delta")

    dq_acc = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros(v.shape, dtype=carrier, device=v.device)
    if stats is not None:
        for key in ("ds_row_sum", "ds_exact_row_sum", "ds_row_abs_sum"):
            stats[key] = torch.zeros(q.shape[:-1], dtype=carrier, device=q.device)

    for k_start in range(0, n_k, block_k):
        k_stop = min(k_start + block_k, n_k)
        row0 = 0
        if causal:
            first_row = k_start - offset
            if first_row >= n_q:
                break
            row0 = max(0, first_row) // block_q * block_q
        rows = slice(row0, n_q)
        q_blk, k_blk, v_blk = q[..., rows, :], k[..., k_start:k_stop, :], v[..., k_start:k_stop, :]
        do_blk = grad_out[..., rows, :]

        # -- recompute S and P from the stored log-sum-exp --
        s = pol.round(q_blk @ k_blk.transpose(-1, -2), "score")
        if bias is not None:
            s = pol.round(s + bias[..., rows, k_start:k_stop] / scale, "score")
        if causal:
            qi = torch.arange(row0, n_q, device=q.device)[:, None] + offset
            kj = torch.arange(k_start, k_stop, device=q.device)[None, :]
            s = s.masked_fill(kj > qi, -math.inf)
        p = _recompute_p(s, lse[..., rows, :], scale, fused_scale_max, pol)

        # -- dV_j = P^T dO, with P rounded for the matmul --
        dv[..., k_start:k_stop, :] = pol.round(pol.round(
            pol.round(p, "p_bwd").transpose(-1, -2) @ do_blk, "grad_acc"), "grad")

        # -- dS = P * (dP - D) in the accumulator format, then rounded for the matmuls --
        dp = pol.round(do_blk @ v_blk.transpose(-1, -2), "dp")
        ds_exact = pol.round(p * pol.round(dp - delta[..., rows, :], "dp"), "dp")
        ds = pol.round(ds_exact, "ds")
        if stats is not None:
            stats["ds_row_sum"][..., rows] += ds.sum(dim=-1)
            stats["ds_exact_row_sum"][..., rows] += ds_exact.sum(dim=-1)
            stats["ds_row_abs_sum"][..., rows] += ds.abs().sum(dim=-1)

        # -- dQ accumulates across key blocks; dK_j is complete after this block --
        dq_acc[..., rows, :] = pol.round(dq_acc[..., rows, :] + pol.round(ds @ k_blk, "grad_acc"), "grad_acc")
        dk[..., k_start:k_stop, :] = pol.round(
            pol.round(ds.transpose(-1, -2) @ q_blk, "grad_acc") * scale, "grad")

    dq = pol.round(dq_acc * scale, "grad")
    return dq, dk, dv


@torch.no_grad()
def golden_attention_backward(q, k, v, grad_out, *, scale: float | None = None, causal: bool = False,
                              attn_bias: torch.Tensor | None = None, chunk: int = 1024):
    """Exact attention gradients ``(dq, dk, dv)`` in fp64, ``chunk`` query rows at a time.

    Inputs and ``grad_out`` are used exactly as given (upcast to fp64): pass what the
    kernel under test read. D uses the exact output, so dS rows sum to 0 up to fp64 rounding.
    """
    _check_qkv(q, k, v)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    q, k, v, do = (t.to(torch.float64) for t in (q, k, v, grad_out))
    n_q, n_k = q.shape[-2], k.shape[-2]
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for start in range(0, n_q, chunk):
        stop = min(start + chunk, n_q)
        qc, doc = q[..., start:stop, :], do[..., start:stop, :]
        s = (qc @ k.transpose(-1, -2)) * scale
        if attn_bias is not None:
            bias = attn_bias.to(torch.float64)
            s = s + (bias[..., start:stop, :] if bias.shape[-2] != 1 else bias)
        if causal:
            rows = torch.arange(start, stop, device=q.device)[:, None] + (n_k - n_q)
            s = s.masked_fill(torch.arange(n_k, device=q.device)[None, :] > rows, -math.inf)
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        e = torch.exp(s - row_max)
        row_sum = e.sum(dim=-1, keepdim=True)
        p = e / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
        out = p @ v
        dv += p.transpose(-1, -2) @ doc
        dp = doc @ v.transpose(-1, -2)
        ds = p * (dp - (doc * out).sum(dim=-1, keepdim=True))
        dq[..., start:stop, :] = (ds @ k) * scale
        dk += (ds.transpose(-1, -2) @ qc) * scale
    return dq, dk, dv
