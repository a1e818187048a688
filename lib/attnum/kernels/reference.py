"""Unblocked attention ``softmax(Q K^T * scale) V``: the reference, the fp64 golden value and its
gradients, and the unguarded textbook formula.

``reference_attention`` is plain (unblocked) attention: it materialises the
full N x N score matrix, rounding at the stages named by a precision policy.
It plays the part of "baseline attention" in Golden et al. (arXiv 2405.02803)
and of ``out_pt`` in the FlashAttention test suite.

``golden_attention`` is the fp64 ground truth every study measures against, and
``golden_attention_backward`` its exact gradients. Both walk over query chunks,
so their memory is O(N * chunk), never O(N^2).

``textbook_attention`` is what a first implementation writes: no guard for fully
masked rows, and optionally no max subtraction (study 02's overflow questions).
"""
from __future__ import annotations

import math

import torch

from ..precision import PrecisionPolicy, get_policy
from .common import causal_mask, check_qkv, check_scale

# Query rows per chunk when the caller names none. On the CPU the fp64 golden value is fastest with
# chunks whose score rows stay near the caches (128 rows: 1-8 MiB of fp64 scores at N = 1024-8192), and
# gives the same bits for every chunking (tests/io/test_chunks.py); elsewhere the old default is kept
# (a GPU's matmuls may round differently for different shapes).
GOLDEN_CHUNK = 1024
GOLDEN_CHUNK_CPU = 128
# Query rows per chunk a caller may pass to ``reference_attention`` on the CPU: same bits as all rows
# at once (tests/io/test_chunks.py) and the fastest measured; its default stays all rows at once.
REFERENCE_CHUNK_CPU = 256


def default_golden_chunk(device) -> int:
    """``GOLDEN_CHUNK_CPU`` on the CPU, ``GOLDEN_CHUNK`` on any other device."""
    return GOLDEN_CHUNK_CPU if torch.device(device).type == "cpu" else GOLDEN_CHUNK


def _chunk_or_default(chunk, device) -> int:
    if chunk is None:
        return default_golden_chunk(device)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return chunk


def reference_attention(q, k, v, policy: str | PrecisionPolicy = "fp32", *, scale: float | None = None,
                        causal: bool = False, attn_bias: torch.Tensor | None = None,
                        return_lse: bool = False, query_chunk: int | None = None, _rows=None):
    """Unblocked attention under a precision policy.

    ``attn_bias`` is an additive mask broadcastable to (batch, heads, n_q, n_k);
    ``-inf`` entries mask keys out. Rows with every key masked give output 0 and
    log-sum-exp ``-inf`` (PyTorch SDPA's convention since ``_safe_softmax``).

    ``query_chunk`` processes that many query rows at a time. Every row still
    sees all keys at once (no online rescaling), so the arithmetic per row is the
    unblocked algorithm's; only peak memory drops from O(N^2) to O(N * chunk).
    On the CPU the outputs are bit for bit those of all rows at once for chunks of
    many rows (``REFERENCE_CHUNK_CPU``; tests/io/test_chunks.py), non-finite inputs
    and masks included: each chunk masks its causal entries as the whole matrix does.
    """
    check_qkv(q, k, v)
    scale = check_scale(scale, q.shape[-1])
    if query_chunk:
        n_q = q.shape[-2]
        outs, lses = [], []
        for start in range(0, n_q, query_chunk):
            rows = slice(start, min(start + query_chunk, n_q))
            bias = attn_bias
            if bias is not None and bias.shape[-2] != 1:
                bias = bias[..., rows, :]
            # rows (start, stop) of n_q: the causal mask of these rows, applied as on the whole matrix
            o, lse = reference_attention(q[..., rows, :], k, v, policy, scale=scale, attn_bias=bias,
                                         return_lse=True, _rows=(rows.start, rows.stop, n_q) if causal else None)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        return (out, lse) if return_lse else out
    pol = get_policy(policy)
    carrier = pol.carrier
    q, k, v = (pol.round(t.to(carrier), "inputs") for t in (q, k, v))

    # -- scores: S = Q K^T, rounded to the score format, then scaled --
    s = pol.round(q @ k.transpose(-1, -2), "score")
    s = pol.round(s * scale, "score")
    if attn_bias is not None:
        s = pol.round(s + attn_bias.to(carrier), "score")
    if _rows is not None:  # a chunk of a causal call: its rows of the whole causal mask
        s = s.masked_fill(~causal_mask(_rows[2], k.shape[-2], q.device, rows=_rows[:2]), -math.inf)
    elif causal:
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
                     attn_bias: torch.Tensor | None = None, chunk: int | None = None,
                     return_lse: bool = False):
    """fp64 attention computed ``chunk`` query rows at a time (memory O(N * chunk)).

    Inputs are used exactly as given (upcast to fp64): pass the inputs the
    kernel under test actually read, so input rounding is not counted as
    kernel error. ``chunk=None``: ``default_golden_chunk(q.device)``.
    """
    check_qkv(q, k, v)
    chunk = _chunk_or_default(chunk, q.device)
    scale = check_scale(scale, q.shape[-1])
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float64, device=q.device)
    for start, stop, e, row_max, row_sum in _golden_chunks(q, k, scale, causal, attn_bias, chunk):
        out[..., start:stop, :] = (e @ v) / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
        lse[..., start:stop] = (row_max + torch.log(row_sum)).squeeze(-1)
    return (out, lse) if return_lse else out


def _golden_chunks(q, k, scale: float, causal: bool, attn_bias, chunk: int):
    """fp64 q, k: per chunk of query rows ``(start, stop, e, row_max, row_sum)`` with
    e = exp(S - row max) of the scaled, masked scores (row max 0 where a row is fully masked)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    bias = None if attn_bias is None else attn_bias.to(torch.float64)
    for start in range(0, n_q, chunk):
        stop = min(start + chunk, n_q)
        s = (q[..., start:stop, :] @ k.transpose(-1, -2)) * scale
        if bias is not None:
            s = s + (bias[..., start:stop, :] if bias.shape[-2] != 1 else bias)
        if causal:
            s = s.masked_fill(~causal_mask(n_q, n_k, q.device, rows=(start, stop)), -math.inf)
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        e = torch.exp(s - row_max)
        yield start, stop, e, row_max, e.sum(dim=-1, keepdim=True)


@torch.no_grad()
def golden_attention_backward(q, k, v, grad_out, *, scale: float | None = None, causal: bool = False,
                              attn_bias: torch.Tensor | None = None, chunk: int = GOLDEN_CHUNK):
    """Exact attention gradients ``(dq, dk, dv)`` in fp64, ``chunk`` query rows at a time.

    Inputs and ``grad_out`` are used exactly as given (upcast to fp64): pass what the
    kernel under test read. D uses the exact output, so dS rows sum to 0 up to fp64 rounding.
    dK and dV are sums over the query chunks, so their last bits depend on ``chunk`` (dQ's do
    not); the default stays ``GOLDEN_CHUNK`` on every device.
    """
    check_qkv(q, k, v)
    chunk = _chunk_or_default(chunk, q.device)
    scale = check_scale(scale, q.shape[-1])
    q, k, v, do = (t.to(torch.float64) for t in (q, k, v, grad_out))
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for start, stop, e, _, row_sum in _golden_chunks(q, k, scale, causal, attn_bias, chunk):
        qc, doc = q[..., start:stop, :], do[..., start:stop, :]
        p = e / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
        out = p @ v
        dv += p.transpose(-1, -2) @ doc
        dp = doc @ v.transpose(-1, -2)
        ds = p * (dp - (doc * out).sum(dim=-1, keepdim=True))
        dq[..., start:stop, :] = (ds @ k) * scale
        dk += (ds.transpose(-1, -2) @ qc) * scale
    return dq, dk, dv


def textbook_attention(q, k, v, policy="fp32", *, subtract_max: bool = True, attn_bias=None,
                       scale: float | None = None):
    """softmax(Q K^T * scale + bias) V with no guards: what a first implementation writes.

    A fully masked row computes (-inf) - (-inf) = NaN, as ``torch.softmax`` does;
    ``subtract_max=False`` exponentiates the scores directly (overflow at large
    scores). Rounding follows the policy's stages as in ``reference_attention``.
    """
    check_qkv(q, k, v)
    pol = get_policy(policy)
    scale = check_scale(scale, q.shape[-1])
    q, k, v = (pol.round(t.to(pol.carrier), "inputs") for t in (q, k, v))
    s = pol.round(pol.round(q @ k.transpose(-1, -2), "score") * scale, "score")
    if attn_bias is not None:
        s = pol.round(s + attn_bias.to(pol.carrier), "score")
    if subtract_max:
        s = pol.round(s - s.amax(dim=-1, keepdim=True), "stats")
    e = pol.round(torch.exp(s), "stats")
    p = pol.round(e / pol.round(e.sum(dim=-1, keepdim=True), "stats"), "p")
    return pol.round(pol.round(p @ v, "out_acc"), "output")
