"""Reference attention ``softmax(Q K^T * scale) V`` and the fp64 golden value.

``reference_attention`` is plain (unblocked) attention: it materialises the
full N x N score matrix, rounding at the stages named by a precision policy.
It plays the part of "baseline attention" in Golden et al. (arXiv 2405.02803)
and of ``out_pt`` in the FlashAttention test suite.

``golden_attention`` is the fp64 ground truth every study measures against.
It walks over query chunks, so its memory is O(N * chunk), never O(N^2).
"""
from __future__ import annotations

import math

import torch

from .precision import PrecisionPolicy, get_policy


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def causal_mask(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """Boolean (n_q, n_k) mask, True where query i may attend key j.

    Queries are aligned to the end of the keys (query i sits at key position
    i + n_k - n_q), the convention of FlashAttention-2 and PyTorch SDPA's
    bottom-right causal mask when n_q != n_k.
    """
    offset = n_k - n_q
    rows = torch.arange(n_q, device=device)[:, None] + offset
    cols = torch.arange(n_k, device=device)[None, :]
    return cols <= rows


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, heads, seq, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape[:-1] + (k.shape[-1],) or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def reference_attention(q, k, v, policy: str | PrecisionPolicy = "fp32", *, scale: float | None = None,
                        causal: bool = False, attn_bias: torch.Tensor | None = None,
                        return_lse: bool = False, query_chunk: int | None = None):
    """Unblocked attention under a precision policy.

    ``attn_bias`` is an additive mask broadcastable to (batch, heads, n_q, n_k);
    ``-inf`` entries mask keys out. Rows with every key masked give output 0 and
    log-sum-exp ``-inf`` (PyTorch SDPA's convention since ``_safe_softmax``).

    ``query_chunk`` processes that many query rows at a time. Every row still
    sees all keys at once (no online rescaling), so the arithmetic per row is the
    unblocked algorithm's; only peak memory drops from O(N^2) to O(N * chunk).
    """
    _check_qkv(q, k, v)
    if query_chunk:
        n_q, n_k = q.shape[-2], k.shape[-2]
        outs, lses = [], []
        for start in range(0, n_q, query_chunk):
            rows = slice(start, min(start + query_chunk, n_q))
            bias = attn_bias
            if causal:  # express the causal mask of these rows as an additive bias
                qi = torch.arange(rows.start, rows.stop, device=q.device)[:, None] + (n_k - n_q)
                causal_bias = torch.zeros(rows.stop - rows.start, n_k, dtype=torch.float64, device=q.device)
                causal_bias.masked_fill_(torch.arange(n_k, device=q.device)[None, :] > qi, -math.inf)
                bias = causal_bias if bias is None else bias[..., rows, :] + causal_bias
            elif bias is not None and bias.shape[-2] != 1:
                bias = bias[..., rows, :]
            o, lse = reference_attention(q[..., rows, :], k, v, policy, scale=scale, attn_bias=bias,
                                         return_lse=True)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        return (out, lse) if return_lse else out
    pol = get_policy(policy)
    carrier = pol.carrier
    scale = default_scale(q.shape[-1]) if scale is None else scale
    q, k, v = (pol.round(t.to(carrier), "inputs") for t in (q, k, v))

    # -- scores: S = Q K^T, rounded to the score format, then scaled --
    s = pol.round(q @ k.transpose(-1, -2), "score")
    s = pol.round(s * scale, "score")
    if attn_bias is not None:
        s = pol.round(s + attn_bias.to(carrier), "score")
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), -math.inf)

    # -- softmax with the row max subtracted (statistics in the stats format) --
    row_max = pol.round(s.amax(dim=-1, keepdim=True), "stats")
    row_max_safe = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = pol.round(torch.exp(s - row_max_safe), "stats")
    row_sum = pol.round(e.sum(dim=-1, keepdim=True), "stats")
    p = pol.round(e / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum)), "p")

    # -- output: P V accumulated in the out_acc format, stored in the output format --
    out = pol.round(pol.round(p @ v, "out_acc"), "output")
    if not return_lse:
        return out
    lse = pol.round((row_max_safe + torch.log(row_sum)).squeeze(-1), "lse")
    return out, lse


@torch.no_grad()
def golden_attention(q, k, v, *, scale: float | None = None, causal: bool = False,
                     attn_bias: torch.Tensor | None = None, chunk: int = 1024,
                     return_lse: bool = False):
    """fp64 attention computed ``chunk`` query rows at a time (memory O(N * chunk)).

    Inputs are used exactly as given (upcast to fp64): pass the inputs the
    kernel under test actually read, so input rounding is not counted as
    kernel error.
    """
    _check_qkv(q, k, v)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    scale = default_scale(q.shape[-1]) if scale is None else scale
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float64, device=q.device)
    for start in range(0, n_q, chunk):
        stop = min(start + chunk, n_q)
        s = (q[..., start:stop, :] @ k.transpose(-1, -2)) * scale
        if attn_bias is not None:
            bias = attn_bias.to(torch.float64)
            if bias.shape[-2] != 1:
                bias = bias[..., start:stop, :]
            s = s + bias
        if causal:
            rows = torch.arange(start, stop, device=q.device)[:, None] + (n_k - n_q)
            s = s.masked_fill(torch.arange(n_k, device=q.device)[None, :] > rows, -math.inf)
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        e = torch.exp(s - row_max)
        row_sum = e.sum(dim=-1, keepdim=True)
        out[..., start:stop, :] = (e @ v) / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
        lse[..., start:stop] = (row_max + torch.log(row_sum)).squeeze(-1)
    return (out, lse) if return_lse else out
