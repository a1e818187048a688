"""Pieces every attention kernel of the package shares, each written once.

* ``check_qkv``, ``check_scale``, ``check_lse``: the entry checks (shapes, empty sizes, scale);
* ``default_scale``: 1 / sqrt(head_dim);
* ``causal_mask``: the one causal mask (bottom-right aligned, as FlashAttention-2 and PyTorch
  SDPA's bottom-right mask), for any block of rows and columns;
* ``key_blocks``: the tiled kernels' loop over key blocks, with the causal tile skipping;
* ``exponent``, ``rescale``, ``recompute_p``: the exponentials of online softmax, in both the
  subtract-then-scale form and FlashAttention-3's fused scale-max FMA (seed 004, cause 1);
* ``parse_mask_fill``: the value masked scores get (``-inf`` or a finite sentinel).
"""
from __future__ import annotations

import math

import torch

from ..precision import LOG2E, PrecisionPolicy


def default_scale(head_dim: int) -> float:
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return 1.0 / math.sqrt(head_dim)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q (batch, heads, n_q, d), k (batch, heads, n_k, d), v (batch, heads, n_k, d_v); no empty size."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (batch, heads, seq, head_dim); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape[:-1] + (k.shape[-1],) or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    empty = [name for name, t in (("q", q), ("k", k), ("v", v)) if 0 in t.shape]
    if empty:
        raise ValueError(f"empty size in {', '.join(empty)}: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (batch, heads, sequence length and head_dim must be >= 1)")


def check_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: 1/sqrt(d) when None, else a finite positive number."""
    if scale is None:
        return default_scale(head_dim)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return scale


def check_lse(lse: torch.Tensor, q: torch.Tensor) -> None:
    """The stored log-sum-exp of a forward over ``q``: shape (batch, heads, n_q)."""
    if tuple(lse.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"lse has shape {tuple(lse.shape)}; the forward over q {tuple(q.shape)} stores "
                         f"{tuple(q.shape[:-1])} (batch, heads, n_q)")


def causal_mask(n_q: int, n_k: int, device=None, *, rows: tuple[int, int] | None = None,
                cols: tuple[int, int] | None = None, extra: int = 0) -> torch.Tensor:
    """Boolean mask, True where query i may attend key j, for rows [r0, r1) and columns [c0, c1).

    Queries are aligned to the end of the keys: query i sits at key position i + n_k - n_q (the
    convention of FlashAttention-2 and PyTorch SDPA's bottom-right mask when n_q != n_k).
    ``extra`` lets every query see that many further keys (a fault: an off-by-one mask).
    """
    r0, r1 = rows or (0, n_q)
    c0, c1 = cols or (0, n_k)
    qi = torch.arange(r0, r1, device=device)[:, None] + (n_k - n_q) + extra
    kj = torch.arange(c0, c1, device=device)[None, :]
    return kj <= qi


def key_blocks(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool, offset: int):
    """The kernel's loop over key blocks: ``(block, k_start, k_stop, row0)`` for each.

    ``row0`` is the first row of the first query block that reaches the key block; under a
    causal mask, (query block, key block) tiles that lie wholly above the diagonal are skipped,
    as the kernels do, and the loop ends once no query row reaches the keys. Query i sees keys
    <= i + ``offset``.
    """
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    for block, k_start in enumerate(range(0, n_k, block_k)):
        row0 = 0
        if causal:
            first_row = k_start - offset
            if first_row >= n_q:
                return
            row0 = max(0, first_row) // block_q * block_q
        yield block, k_start, min(k_start + block_k, n_k), row0


def parse_mask_fill(mask_fill) -> float:
    """``"-inf"``, ``"finfo_min"`` (fp32's) or a negative float: what masked raw scores become."""
    if isinstance(mask_fill, str):
        if mask_fill not in ("-inf", "finfo_min"):
            raise ValueError(f"mask_fill must be '-inf', 'finfo_min' or a finite float, got {mask_fill!r}")
        return -math.inf if mask_fill == "-inf" else float(torch.finfo(torch.float32).min)
    value = float(mask_fill)
    if math.isnan(value) or value > 0:
        raise ValueError(f"mask_fill must be -inf or a negative number, got {mask_fill!r}")
    return value


def _fma(s: torch.Tensor, c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """s * c - b rounded once, as an FMA in s's dtype (the fp64 product of two fp32 values is exact)."""
    if s.dtype == torch.float64:
        return s * c - b
    return (s.double() * c.double() - b.double()).to(s.dtype)


def exponent(s, m, scale: float, fused: bool, pol: PrecisionPolicy):
    """exp of the scaled, max-subtracted scores, in the carrier dtype (before P is rounded).

    ``s`` and ``m`` are raw (unscaled) scores; rows with m = -inf (nothing seen) give exp(-inf) = 0.
    Subtract-then-scale makes the exponent exactly 0 at s = m (P = 1 there). ``fused`` is
    FlashAttention-3's ``exp2(fma(s, c, -m * c))`` with c = scale * log2 e: at s = m the exponent
    is the rounding error of m * c, not 0 (seed 004, cause 1).
    """
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    if not fused:
        x = pol.round(s - m, "stats")
        return pol.round(x.mul_(scale), "stats").exp_()
    c = pol.round(torch.tensor(scale * LOG2E, dtype=s.dtype, device=s.device), "stats")
    m_scaled = pol.round(m * c, "stats")
    return torch.exp2(pol.round(_fma(s, c, m_scaled), "stats"))


def rescale(m_old, m_new, scale: float, pol: PrecisionPolicy):
    """exp((m_old - m_new) * scale), the online-softmax correction; 1 where nothing was seen yet."""
    both_empty = ~torch.isfinite(m_new)
    diff = torch.where(both_empty, torch.zeros_like(m_new), m_old - m_new)
    return torch.exp(pol.round(pol.round(diff, "stats") * scale, "stats"))


def recompute_p(s, lse, scale: float, fused: bool, pol: PrecisionPolicy):
    """The backward's P = exp(S * scale - L) from raw scores and the stored log-sum-exp (..., rows, 1).

    Rows with L = -inf (every key masked) give P = 0. ``fused``: FA3's one FMA on the raw score.
    """
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    if not fused:
        return torch.exp(pol.round(pol.round(s * scale, "stats") - lse, "stats"))
    c = pol.round(torch.tensor(scale * LOG2E, dtype=s.dtype, device=s.device), "stats")
    lse2 = pol.round(lse * LOG2E, "stats")
    return torch.exp2(pol.round(_fma(s, c, lse2), "stats"))
