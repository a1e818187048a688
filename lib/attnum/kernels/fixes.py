"""Kernel-side pieces of the fixes study 05 compares, beside GProj (in ``attnum.backward``).

``center_keys``
    Mean-key subtraction ("key smoothing", SageAttention, Zhang et al. 2024, arXiv 2410.02367;
    seed 004 tried it): K - mean_j K_j over the key sequence of each (batch, head). Each row's
    scores shift by the constant q_i . mean, which softmax ignores, so the forward is unchanged
    in exact arithmetic, and so is the gradient: the centering's backward removes the mean of
    dK over keys, which is exactly 0 because the rows of dS sum to 0.

``stable_flash_attention``
    Qiu & Yao's "STABLE" max shift (arXiv 2510.04212; ``papers.md`` section 5): on a row whose
    maximum score is repeated, exponentiate relative to m = beta * max when the max is positive
    and m = 0 when it is negative, so that no probability is exactly 1 before normalisation
    (their failure needs P = 1 at several keys). Rows with a unique maximum keep m = max. The
    stored log-sum-exp is m * scale + log l whatever m is, so the backward is unchanged.
    In a tiled kernel the tie is only known block by block: the running maximum carries a
    running count of scores within ``tie_tol`` (scaled-score units) of it, and the offset in
    use is rescaled like the running max of FlashAttention-2 whenever it moves.

    A fixed offset above the maximum has a price: when beta * max * scale - max * scale passes
    ~87 (fp32/bf16 exp underflow), every probability of the row underflows to 0, and the row's
    output is 0 with a log-sum-exp of -inf. Study 05 reports where that happens.

Both are reached through ``attnum.attention.AttentionImpl`` (``center_keys``, ``stable_beta``).
"""
from __future__ import annotations

import math

import torch

from .flash import _exponent_base_e, _rescale, key_blocks
from .precision import PrecisionPolicy, get_policy
from .reference import _check_qkv, default_scale

STABLE_TIE_TOL = 1e-3
"""Scores within this much (after scaling) of the row maximum count as a repeated maximum."""


def center_keys(k: torch.Tensor) -> torch.Tensor:
    """K - mean_j K_j over the key sequence (dim -2), in k's dtype."""
    return k - k.mean(dim=-2, keepdim=True)


def uncenter_key_grad(dk: torch.Tensor) -> torch.Tensor:
    """The gradient with respect to the keys before centering: dK - mean_j dK_j."""
    return dk - dk.mean(dim=-2, keepdim=True)


def stable_offset(row_max: torch.Tensor, ties: torch.Tensor, beta: float) -> torch.Tensor:
    """The exponent offset of Qiu & Yao's STABLE rule, in raw-score units.

    ``ties``: how many scores of the row lie within the tie tolerance of ``row_max``. A repeated
    maximum gives beta * max if positive, 0 if negative (or zero); a unique one gives max.
    """
    repeated = ties > 1
    shifted = torch.where(row_max > 0, beta * row_max, torch.zeros_like(row_max))
    return torch.where(repeated, shifted, row_max)


def stable_flash_attention(q, k, v, policy: str | PrecisionPolicy = "fa2_bf16", *, scale: float | None = None,
                           causal: bool = False, block_q: int = 128, block_k: int = 128,
                           fused_scale_max: bool = False, beta: float = 2.0, tie_tol: float = STABLE_TIE_TOL):
    """FlashAttention-2 forward (``attnum.flash``, ``loop_order="q_outer"``) whose exponent offset
    follows the STABLE rule. Returns ``(out, lse)`` like ``attnum.flash.flash_attention``."""
    _check_qkv(q, k, v)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    if beta < 1:
        raise ValueError(f"STABLE needs beta >= 1 (the offset must not fall below the max), got {beta}")
    pol = get_policy(policy)
    carrier = pol.carrier
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    q, k, v = (pol.round(t.to(carrier), "inputs") for t in (q, k, v))
    n_q, n_k = q.shape[-2], k.shape[-2]
    offset = n_k - n_q

    stat_shape = q.shape[:-1] + (1,)
    m = torch.full(stat_shape, -math.inf, dtype=carrier, device=q.device)  # running row max
    ties = torch.zeros(stat_shape, dtype=carrier, device=q.device)  # scores within tie_tol of it
    e = torch.full(stat_shape, -math.inf, dtype=carrier, device=q.device)  # offset l and acc refer to
    l = torch.zeros(stat_shape, dtype=carrier, device=q.device)
    acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=carrier, device=q.device)

    for _, k_start, k_stop, row0 in key_blocks(n_q, n_k, block_q, block_k, causal, offset):
        rows = slice(row0, n_q)
        q_blk, k_blk, v_blk = q[..., rows, :], k[..., k_start:k_stop, :], v[..., k_start:k_stop, :]

        # -- compute qk --
        s = pol.round(q_blk @ k_blk.transpose(-1, -2), "score")
        if causal:
            qi = torch.arange(row0, n_q, device=q.device)[:, None] + offset
            kj = torch.arange(k_start, k_stop, device=q.device)[None, :]
            s = s.masked_fill(kj > qi, -math.inf)

        # -- running max and the count of scores tied with it --
        m_old, t_old, e_old = m[..., rows, :], ties[..., rows, :], e[..., rows, :]
        m_new = pol.round(torch.maximum(m_old, s.amax(dim=-1, keepdim=True)), "stats")
        finite = torch.isfinite(m_new)
        m_safe = torch.where(finite, m_new, torch.zeros_like(m_new))
        near = ((s - m_safe) * scale >= -tie_tol) & finite
        old_near = ((m_old - m_safe) * scale >= -tie_tol) & torch.isfinite(m_old)
        t_new = near.sum(dim=-1, keepdim=True).to(carrier) + torch.where(old_near, t_old, torch.zeros_like(t_old))

        # -- STABLE offset; l and the accumulator are rescaled when it moves, as for a running max --
        e_new = torch.where(finite, pol.round(stable_offset(m_new, t_new, beta), "stats"), m_new)
        p = _exponent_base_e(s, e_new, scale, fused_scale_max, pol)
        alpha = _rescale(e_old, e_new, scale, pol)
        # nothing carried yet (or all of it underflowed): no rescale, rather than 0 * exp(overflow) = NaN
        alpha = torch.where(l[..., rows, :] > 0, alpha, torch.zeros_like(alpha))
        l_new = pol.round(alpha * l[..., rows, :] + p.sum(dim=-1, keepdim=True), "stats")
        pv = pol.round(pol.round(p, "p") @ v_blk, "out_acc")
        acc_new = pol.round(alpha * acc[..., rows, :] + pv, "out_acc")
        m[..., rows, :], ties[..., rows, :], e[..., rows, :] = m_new, t_new, e_new
        l[..., rows, :], acc[..., rows, :] = l_new, acc_new

    # -- epilogue: normalise, store O and the log-sum-exp relative to the offset used --
    empty = l == 0  # no key carried weight, or every probability underflowed below the offset
    out = acc / torch.where(empty, torch.ones_like(l), l)
    out = pol.round(torch.where(empty, torch.zeros_like(out), out), "output")
    e_safe = torch.where(torch.isfinite(e), e, torch.zeros_like(e))
    lse = torch.where(empty, torch.full_like(l, -math.inf), e_safe * scale + torch.log(l))
    return out, pol.round(lse.squeeze(-1), "lse")
