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
    FlashInfer did up to 0.6.18.post1 (FlashInfer issue 4267; docs/sources.md).
  * ``fault``: a ``KernelHooks`` object, the places where a buggy kernel may
    depart from the algorithm (``attnum.kernels.faults`` defines realistic bugs).
    ``None`` (the default) is the algorithm itself, bit for bit.
  * the policy's ``score_mac``: Q K^T as a term-by-term multiply-add in the score format, fused or
    with two roundings (seed 000's MI210; ``sequential_mac``). ``None`` (every preset) is the matmul.
  * ``stable_beta``: Qiu & Yao's STABLE exponent offset on rows with a repeated
    maximum (arXiv 2510.04212; study 05's ``stable_max`` fix), FA2 loop order only.
"""
from __future__ import annotations

import math

import torch

from ..precision import PrecisionPolicy, get_policy
from .common import causal_mask, check_qkv, check_scale, exponent, key_blocks, parse_mask_fill, rescale

LOOP_ORDERS = ("q_outer", "k_outer")

STABLE_TIE_TOL = 1e-3
"""Scores within this much (after scaling) of the row maximum count as a repeated maximum (STABLE)."""


class KernelHooks:
    """The points where a kernel variant may depart from the algorithm; this base changes nothing.

    ``attnum.kernels.faults`` subclasses it to inject bugs. ``block`` is the index of
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


def stable_offset(row_max: torch.Tensor, ties: torch.Tensor, beta: float) -> torch.Tensor:
    """The exponent offset of Qiu & Yao's STABLE rule (arXiv 2510.04212), in raw-score units.

    ``ties``: how many scores of the row lie within the tie tolerance of ``row_max``. A repeated
    maximum gives beta * max if positive, 0 if negative (or zero); a unique one gives max.
    """
    repeated = ties > 1
    shifted = torch.where(row_max > 0, beta * row_max, torch.zeros_like(row_max))
    return torch.where(repeated, shifted, row_max)


def sequential_mac(q: torch.Tensor, k: torch.Tensor, fmt: str, *, two_rounding: bool) -> torch.Tensor:
    """Q K^T accumulated term by term over the head dimension in ``fmt`` (``PrecisionPolicy.score_mac``).

    The products are formed exactly (in fp64: the product of two fp32, fp16 or bf16 values fits its
    53 bits); a fused multiply-add rounds ``acc + q_i k_i`` once to ``fmt``; ``two_rounding`` first
    rounds the product to ``fmt``, then the sum (seed 000's MI210). Returned in ``q``'s dtype.
    (The fp64 sum before the rounding to ``fmt`` can double-round in rare ties; that is below
    what this option measures.)
    """
    from ..precision import round_to

    q64, k64 = q.double(), k.double().transpose(-1, -2)
    acc = torch.zeros(q.shape[:-1] + (k.shape[-2],), dtype=torch.float64, device=q.device)
    for i in range(q.shape[-1]):
        prod = q64[..., i:i + 1] * k64[..., i:i + 1, :]
        if two_rounding:
            prod = round_to(prod, fmt)
        acc = round_to(acc + prod, fmt)
    return acc.to(q.dtype)


def flash_attention(q, k, v, policy: str | PrecisionPolicy = "fa2_bf16", *, scale: float | None = None,
                    causal: bool = False, attn_bias: torch.Tensor | None = None, block_q: int = 128,
                    block_k: int = 128, loop_order: str = "q_outer", fused_scale_max: bool = False,
                    mask_fill="-inf", fault: KernelHooks | None = None, stable_beta: float = 0.0,
                    tie_tol: float = STABLE_TIE_TOL):
    """Emulated FlashAttention forward. Returns ``(out, lse)``.

    ``out`` has shape (batch, heads, n_q, head_dim) in the carrier dtype holding
    values of the policy's output format; ``lse`` (batch, heads, n_q) is the
    natural-log log-sum-exp of the scaled scores, in the policy's lse format.
    Rows whose every key is masked give out = 0 and lse = -inf.
    ``fault`` injects a bug (see ``KernelHooks``); ``None`` runs the algorithm.

    ``stable_beta`` > 0 (>= 1): Qiu & Yao's STABLE max shift (FA2 loop order only). On a row
    whose maximum score is repeated (``tie_tol``, in scaled-score units), exponentiate relative
    to m = beta * max when the max is positive and m = 0 when it is negative, so that no
    probability is exactly 1 before normalisation; rows with a unique maximum keep m = max. In
    a tiled kernel the tie is only known block by block: the running maximum carries a running
    count of scores near it, and the offset in use is rescaled like the running max whenever it
    moves. The stored log-sum-exp is offset * scale + log l, so the backward is unchanged. When
    (beta - 1) * max * scale passes ~87, every probability of the row underflows: out 0, lse -inf.
    """
    check_qkv(q, k, v)
    if loop_order not in LOOP_ORDERS:
        raise ValueError(f"loop_order must be one of {LOOP_ORDERS}, got {loop_order!r}")
    stable = stable_beta != 0
    if stable and stable_beta < 1:
        raise ValueError(f"STABLE needs beta >= 1 (the offset must not fall below the max), got {stable_beta}")
    if stable and loop_order != "q_outer":
        raise ValueError("the STABLE max shift is emulated in the FlashAttention-2 loop order only")
    pol = get_policy(policy)
    fault = NO_FAULT if fault is None else fault
    fill = fault.mask_fill(parse_mask_fill(mask_fill))
    carrier = pol.carrier
    scale = check_scale(scale, q.shape[-1])
    q, k, v = (pol.round(t.to(carrier), "inputs") for t in (q, k, v))
    n_q, n_k = q.shape[-2], k.shape[-2]
    offset = fault.causal_offset(n_k - n_q)  # causal alignment: query i sees keys <= i + offset
    n_read = fault.keys_read(n_k)
    bias = None if attn_bias is None else attn_bias.to(carrier).expand(q.shape[:2] + (n_q, n_k))

    stat_shape = q.shape[:-1] + (1,)
    m = torch.full(stat_shape, fill, dtype=carrier, device=q.device)  # running row max (raw scores)
    l = torch.zeros(stat_shape, dtype=carrier, device=q.device)
    acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=carrier, device=q.device)
    if stable:
        ties = torch.zeros(stat_shape, dtype=carrier, device=q.device)  # scores within tie_tol of m
        e = torch.full(stat_shape, -math.inf, dtype=carrier, device=q.device)  # offset l and acc refer to

    # -- which query rows reach each key block (causal: skip whole tiles) --
    for block, k_start, k_stop, row0 in key_blocks(n_q, n_read, block_q, block_k, causal, offset):
        rows = slice(row0, n_q)
        q_blk, k_blk, v_blk = q[..., rows, :], k[..., k_start:k_stop, :], v[..., k_start:k_stop, :]

        # -- compute qk: raw scores, accumulated and stored in the score format --
        if pol.score_mac is None:
            s = pol.round(q_blk @ k_blk.transpose(-1, -2), "score")
        else:
            s = sequential_mac(q_blk, k_blk, pol.score, two_rounding=pol.score_mac == "two_rounding")
        if bias is not None:
            s = pol.round(s + bias[..., rows, k_start:k_stop] / scale, "score")
        if causal:
            visible = causal_mask(n_q, n_k, q.device, rows=(row0, n_q), cols=(k_start, k_stop),
                                  extra=offset - (n_k - n_q))
            s = s.masked_fill(~visible, fill)
        if bias is not None and math.isfinite(fill):
            s = torch.where(torch.isneginf(s), torch.full_like(s, fill), s)

        m_old, l_old, acc_old = m[..., rows, :], l[..., rows, :], acc[..., rows, :]
        if loop_order == "q_outer":
            # -- FA2: running max, rescale, unnormalised accumulator in registers --
            m_new = pol.round(torch.maximum(m_old, s.amax(dim=-1, keepdim=True)), "stats")
            e_old, e_new = m_old, m_new  # the exponent's offset: the running max ...
            if stable:
                # ... or STABLE's: count the scores tied with the running max, shift when repeated
                finite = torch.isfinite(m_new)
                m_safe = torch.where(finite, m_new, torch.zeros_like(m_new))
                near = ((s - m_safe) * scale >= -tie_tol) & finite
                old_near = ((m_old - m_safe) * scale >= -tie_tol) & torch.isfinite(m_old)
                t_old = ties[..., rows, :]
                t_new = near.sum(dim=-1, keepdim=True).to(carrier) + torch.where(old_near, t_old,
                                                                                torch.zeros_like(t_old))
                e_old = e[..., rows, :]
                e_new = torch.where(finite, pol.round(stable_offset(m_new, t_new, beta=stable_beta), "stats"), m_new)
            p = exponent(s, fault.exponent_max(block, e_old, e_new), scale, fused_scale_max, pol)
            alpha = rescale(e_old, e_new, scale, pol)
            if stable:  # nothing carried yet (or all of it underflowed): no 0 * exp(overflow) = NaN
                alpha = torch.where(l_old > 0, alpha, torch.zeros_like(alpha))
            l_new = fault.store_row_sum(pol.round(alpha * l_old + p.sum(dim=-1, keepdim=True), "stats"))
            pv = pol.round(fault.store_p(pol.round(p, "p")) @ v_blk, "out_acc")
            acc_new = pol.round(fault.acc_rescale(block, alpha) * acc_old + pv, "out_acc")
            if stable:
                ties[..., rows, :], e[..., rows, :] = t_new, e_new
        else:
            # -- FA1: block-local max, normalised O written back after every block --
            m_blk = pol.round(s.amax(dim=-1, keepdim=True), "stats")
            p = exponent(s, fault.exponent_max(block, m_old, m_blk), scale, fused_scale_max, pol)
            l_blk = pol.round(p.sum(dim=-1, keepdim=True), "stats")
            m_new = pol.round(torch.maximum(m_old, m_blk), "stats")
            alpha_old = rescale(m_old, m_new, scale, pol)
            alpha_blk = rescale(m_blk, m_new, scale, pol)
            l_new = fault.store_row_sum(pol.round(alpha_old * l_old + alpha_blk * l_blk, "stats"))
            pv = pol.round(fault.store_p(pol.round(p, "p")) @ v_blk, "out_acc")
            numer = pol.round(l_old * fault.acc_rescale(block, alpha_old) * acc_old + alpha_blk * pv, "out_acc")
            acc_new = pol.round(numer / torch.where(l_new > 0, l_new, torch.ones_like(l_new)), "output")
        if row0 == 0:
            m, l, acc = m_new, l_new, acc_new
        else:
            m[..., rows, :], l[..., rows, :], acc[..., rows, :] = m_new, l_new, acc_new

    # -- epilogue: normalise, store O and the log-sum-exp (relative to the offset in use) --
    empty = l == 0  # no key carried weight; a NaN row sum stays NaN (as in the golden value), never 0
    if loop_order == "q_outer":
        out = acc / torch.where(empty, torch.ones_like(l), l)
    else:
        out = acc
    out = pol.round(torch.where(empty, torch.zeros_like(out), out), "output")
    final_offset = e if stable else m
    offset_safe = torch.where(torch.isfinite(final_offset), final_offset, torch.zeros_like(final_offset))
    lse = torch.where(empty, torch.full_like(l, -math.inf), offset_safe * scale + torch.log(l))
    return out, fault.store_lse(pol.round(lse.squeeze(-1), "lse"))
