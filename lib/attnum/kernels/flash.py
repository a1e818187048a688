"""Tiled FlashAttention forward emulator with online softmax.

The algorithm, stage by stage, follows FlashAttention-2 (Dao 2023, Alg. 1)
for ``loop_order="q_outer"`` and FlashAttention-1 (Dao et al. 2022, Alg. 1)
for ``loop_order="k_outer"``; every stored or rounded value goes through the
precision policy (see ``attnum.precision``).

Vectorisation: the only Python loop is over key blocks. For each key block,
all query rows that the block can reach are processed at once (the query
blocks run "in parallel", as thread blocks do on a GPU), so peak memory is
O(N * block_k) per head plus O(N * d) of state. A query row's numerics depend
only on the key-block partition, so ``block_q`` matters only where whole
(query block, key block) tiles are skipped: causal masking, where a key block
is processed by every query block that reaches it, the diagonal tile included.

Options later studies use:
  * ``fused_scale_max``: FlashAttention-3's exponent ``exp2(s*c - m*c)`` with
    c = scale*log2(e), evaluated as one FMA on the raw score s and the rounded
    product m*c; at s = m the exponent is the rounding error of m*c, not 0
    (seed 004, cause 1). Otherwise subtract the max first, then scale.
  * ``mask_fill``: ``"-inf"`` (NaN-safe) or a finite sentinel such as -5e4
    that replaces masked raw scores *and* starts the running max, as
    FlashInfer did (seed 002; papers.md section 6).
  * ``fault``: a ``KernelHooks`` object, the places where a buggy kernel may
    depart from the algorithm (``attnum.faults`` defines realistic bugs).
    ``None`` (the default) is the algorithm itself, bit for bit.
"""
from __future__ import annotations

import math

import torch

from .precision import LOG2E, PrecisionPolicy, get_policy
from .reference import _check_qkv, default_scale

LOOP_ORDERS = ("q_outer", "k_outer")


class KernelHooks:
    """The points where a kernel variant may depart from the algorithm; this base changes nothing.

    ``attnum.faults`` subclasses it to inject bugs. ``block`` is the index of
    the key block being processed (0 for the first).
    """

    def keys_read(self, n_k: int) -> int:
        """How many keys the key loop reads (all of them)."""
        return n_k

    def causal_offset(self, offset: int) -> int:
        """Causal alignment: query i sees keys <= i + offset."""
        return offset

    def mask_fill(self, fill: float) -> float:
        """The value masked raw scores get and the running max starts from."""
        return fill

    def exponent_max(self, block: int, m_old, m_new):
        """The row max subtracted in the exponent of this block (the updated running max)."""
        return m_new

    def acc_rescale(self, block: int, alpha):
        """The factor the output accumulator is rescaled by when the running max moves."""
        return alpha

    def store_row_sum(self, l):
        """The running row sum as stored after each block (already in the stats format)."""
        return l

    def store_p(self, p):
        """P as fed to the PV matmul (already in the p format)."""
        return p

    def store_lse(self, lse):
        """The log-sum-exp as written out (already in the lse format)."""
        return lse


NO_FAULT = KernelHooks()


def key_blocks(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool, offset: int):
    """The kernel's loop over key blocks: ``(block, k_start, k_stop, row0)`` for each.

    ``row0`` is the first row of the first query block that reaches the key
    block; under a causal mask, (query block, key block) tiles that lie wholly
    above the diagonal are skipped, as the kernels do, and the loop ends once no
    query row reaches the keys. Query i sees keys <= i + ``offset``.
    """
    for block, k_start in enumerate(range(0, n_k, block_k)):
        row0 = 0
        if causal:
            first_row = k_start - offset
            if first_row >= n_q:
                return
            row0 = max(0, first_row) // block_q * block_q
        yield block, k_start, min(k_start + block_k, n_k), row0


def _parse_mask_fill(mask_fill) -> float:
    if isinstance(mask_fill, str):
        if mask_fill not in ("-inf", "finfo_min"):
            raise ValueError(f"mask_fill must be '-inf', 'finfo_min' or a finite float, got {mask_fill!r}")
        return -math.inf if mask_fill == "-inf" else float(torch.finfo(torch.float32).min)
    value = float(mask_fill)
    if math.isnan(value) or value > 0:
        raise ValueError(f"mask_fill must be -inf or a negative number, got {mask_fill!r}")
    return value


def _exponent_base_e(s, m, scale: float, fused: bool, pol: PrecisionPolicy):
    """exp of the scaled, max-subtracted scores, in the carrier dtype (before P rounding).

    ``s`` and ``m`` are raw (unscaled) scores. ``m`` = -inf rows give exp(-inf) = 0.
    """
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    if not fused:
        # subtract-then-scale: at s = m the exponent is exactly 0, so P = 1 exactly.
        x = pol.round(s - m, "stats")
        return pol.round(x.mul_(scale), "stats").exp_()
    # fused: FA3 computes max_scaled = m * c once, then fma(s, c, -max_scaled) per element.
    c = pol.round(torch.tensor(scale * LOG2E, dtype=s.dtype, device=s.device), "stats")
    m_scaled = pol.round(m * c, "stats")
    if s.dtype == torch.float64:
        x = s * c - m_scaled
    else:
        # an fp32 FMA rounds once: the fp64 product of two fp32 values is exact.
        x = (s.double() * c.double() - m_scaled.double()).to(s.dtype)
    return torch.exp2(pol.round(x, "stats"))


def _rescale(m_old, m_new, scale: float, pol: PrecisionPolicy):
    """exp((m_old - m_new) * scale); 1 where no finite score has been seen yet."""
    both_empty = ~torch.isfinite(m_new)
    diff = torch.where(both_empty, torch.zeros_like(m_new), m_old - m_new)
    return torch.exp(pol.round(pol.round(diff, "stats") * scale, "stats"))


def flash_attention(q, k, v, policy: str | PrecisionPolicy = "fa2_bf16", *, scale: float | None = None,
                    causal: bool = False, attn_bias: torch.Tensor | None = None, block_q: int = 128,
                    block_k: int = 128, loop_order: str = "q_outer", fused_scale_max: bool = False,
                    mask_fill="-inf", fault: KernelHooks | None = None):
    """Emulated FlashAttention forward. Returns ``(out, lse)``.

    ``out`` has shape (batch, heads, n_q, head_dim) in the carrier dtype holding
    values of the policy's output format; ``lse`` (batch, heads, n_q) is the
    natural-log log-sum-exp of the scaled scores, in the policy's lse format.
    Rows whose every key is masked give out = 0 and lse = -inf.
    ``fault`` injects a bug (see ``KernelHooks``); ``None`` runs the algorithm.
    """
    _check_qkv(q, k, v)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    if loop_order not in LOOP_ORDERS:
        raise ValueError(f"loop_order must be one of {LOOP_ORDERS}, got {loop_order!r}")
    pol = get_policy(policy)
    fault = NO_FAULT if fault is None else fault
    fill = fault.mask_fill(_parse_mask_fill(mask_fill))
    carrier = pol.carrier
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (pol.round(t.to(carrier), "inputs") for t in (q, k, v))
    n_q, n_k = q.shape[-2], k.shape[-2]
    offset = fault.causal_offset(n_k - n_q)  # causal alignment: query i sees keys <= i + offset
    n_read = fault.keys_read(n_k)
    bias = None if attn_bias is None else attn_bias.to(carrier).expand(q.shape[:2] + (n_q, n_k))

    stat_shape = q.shape[:-1] + (1,)
    m = torch.full(stat_shape, fill, dtype=carrier, device=q.device)
    l = torch.zeros(stat_shape, dtype=carrier, device=q.device)
    acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=carrier, device=q.device)

    # -- which query rows reach each key block (causal: skip whole tiles) --
    for block, k_start, k_stop, row0 in key_blocks(n_q, n_read, block_q, block_k, causal, offset):
        rows = slice(row0, n_q)
        q_blk, k_blk, v_blk = q[..., rows, :], k[..., k_start:k_stop, :], v[..., k_start:k_stop, :]

        # -- compute qk: raw scores, accumulated and stored in the score format --
        s = pol.round(q_blk @ k_blk.transpose(-1, -2), "score")
        if bias is not None:
            s = pol.round(s + bias[..., rows, k_start:k_stop] / scale, "score")
        if causal:
            qi = torch.arange(row0, n_q, device=q.device)[:, None] + offset
            kj = torch.arange(k_start, k_stop, device=q.device)[None, :]
            s = s.masked_fill(kj > qi, fill)
        if bias is not None and math.isfinite(fill):
            s = torch.where(torch.isneginf(s), torch.full_like(s, fill), s)

        m_old, l_old, acc_old = m[..., rows, :], l[..., rows, :], acc[..., rows, :]
        if loop_order == "q_outer":
            # -- FA2: running max, rescale, unnormalised accumulator in registers --
            m_new = pol.round(torch.maximum(m_old, s.amax(dim=-1, keepdim=True)), "stats")
            p = _exponent_base_e(s, fault.exponent_max(block, m_old, m_new), scale, fused_scale_max, pol)
            alpha = _rescale(m_old, m_new, scale, pol)
            l_new = fault.store_row_sum(pol.round(alpha * l_old + p.sum(dim=-1, keepdim=True), "stats"))
            pv = pol.round(fault.store_p(pol.round(p, "p")) @ v_blk, "out_acc")
            acc_new = pol.round(fault.acc_rescale(block, alpha) * acc_old + pv, "out_acc")
        else:
            # -- FA1: block-local max, normalised O written back after every block --
            m_blk = pol.round(s.amax(dim=-1, keepdim=True), "stats")
            p = _exponent_base_e(s, fault.exponent_max(block, m_old, m_blk), scale, fused_scale_max, pol)
            l_blk = pol.round(p.sum(dim=-1, keepdim=True), "stats")
            m_new = pol.round(torch.maximum(m_old, m_blk), "stats")
            alpha_old = _rescale(m_old, m_new, scale, pol)
            alpha_blk = _rescale(m_blk, m_new, scale, pol)
            l_new = fault.store_row_sum(pol.round(alpha_old * l_old + alpha_blk * l_blk, "stats"))
            pv = pol.round(fault.store_p(pol.round(p, "p")) @ v_blk, "out_acc")
            numer = pol.round(l_old * fault.acc_rescale(block, alpha_old) * acc_old + alpha_blk * pv, "out_acc")
            acc_new = pol.round(numer / torch.where(l_new > 0, l_new, torch.ones_like(l_new)), "output")
        if row0 == 0:
            m, l, acc = m_new, l_new, acc_new
        else:
            m[..., rows, :], l[..., rows, :], acc[..., rows, :] = m_new, l_new, acc_new

    # -- epilogue: normalise, store O and the log-sum-exp --
    empty = l == 0  # no key carried weight; a NaN row sum stays NaN (as in the golden value), never 0
    if loop_order == "q_outer":
        out = acc / torch.where(empty, torch.ones_like(l), l)
    else:
        out = acc
    out = pol.round(torch.where(empty, torch.zeros_like(out), out), "output")
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = torch.where(empty, torch.full_like(l, -math.inf), m_safe * scale + torch.log(l))
    return out, fault.store_lse(pol.round(lse.squeeze(-1), "lse"))
