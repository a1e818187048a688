"""FlashAttention-style backward emulator under a precision policy, with GProj.

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

Vectorisation as in ``attnum.kernels.flash``: the only Python loop is over key blocks;
all query rows that reach a key block are processed at once, so dK_j and dV_j
are one fp32-accumulated matmul over those rows, rounded to ``grad_acc`` once.

The exact gradients every study measures against are ``attnum.kernels.reference.
golden_attention_backward`` (fp64, in query chunks, D from the exact output).

GProj (seed 004's fix; study 05), option ``gproj``: after dS is rounded, restore the
zero row sums on the values the matmuls actually multiply,

    r_i  = sum_j dS~_ij                   (accumulated in the ``dp`` format, fp32)
    dS'  = dS~ - r_i P_ij                 (rows of P sum to 1, so rows of dS' sum to ~0)

computed the way a kernel has to, without ever forming dS' in the low format (that
would round the row sums away again):

    ``"dq"``    the dQ correction inside the existing pass: r_i and (P~ K)_i are
                accumulated beside dQ, and dQ_i -= r_i (P~ K)_i once every key block
                has been seen. dK is not corrected.
    ``"dq_dk"`` one extra pass over the key blocks first computes r_i for every query row
                (the backward is key-block-outer: r_i is a reduction over all key blocks,
                unknown while dK_j is accumulated); in the main pass each dQ tile gets
                r_i (P~ K_j)_i subtracted beside dS~ K_j (r scales the fp32 GEMM output), and
                the correction r_i P~_ij, rounded to ``p_bwd``, is a second operand of dK_j's
                fp32 accumulator beside dS~.

P~ is P as rounded for the dV matmul (``p_bwd``): a kernel reuses that register tile.
Because D_i enters dS as -D_i P_ij, GProj also removes the error of a D formed from
the stored output: dS' equals dS with D_i replaced by sum_j P_ij dP_ij.
Options of the kernel travel in ``attnum.kernels.autograd.AttentionImpl`` next to ``fused_scale_max``.
"""
from __future__ import annotations

import math

import torch

from ..precision import PrecisionPolicy, get_policy
from .common import causal_mask, check_lse, check_qkv, check_scale, key_blocks, recompute_p


GPROJ_MODES = ("off", "dq", "dq_dk")
"""GProj's modes, named for the gradients they correct."""


def _key_block_tiles(q, k, v, grad_out, lse, delta, bias, pol: PrecisionPolicy, scale: float, causal: bool,
                     block_q: int, block_k: int, fused: bool):
    """One pass over the key blocks: per block, ``(rows, keys, p, ds_exact, ds)`` for every query
    row that reaches it, with P recomputed from the stored log-sum-exp and dS before and after
    the ``ds`` rounding."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    offset = n_k - n_q
    for _, k_start, k_stop, row0 in key_blocks(n_q, n_k, block_q, block_k, causal, offset):
        rows, keys = slice(row0, n_q), slice(k_start, k_stop)
        q_blk, k_blk, v_blk = q[..., rows, :], k[..., keys, :], v[..., keys, :]
        do_blk = grad_out[..., rows, :]

        # -- recompute S and P from the stored log-sum-exp --
        s = pol.round(q_blk @ k_blk.transpose(-1, -2), "score")
        if bias is not None:
            s = pol.round(s + bias[..., rows, keys] / scale, "score")
        if causal:
            s = s.masked_fill(~causal_mask(n_q, n_k, q.device, rows=(row0, n_q), cols=(k_start, k_stop)), -math.inf)
        p = recompute_p(s, lse[..., rows, :], scale, fused, pol)

        # -- dS = P * (dP - D) in the accumulator format, then rounded for the matmuls --
        dp = pol.round(do_blk @ v_blk.transpose(-1, -2), "dp")
        ds_exact = pol.round(p * pol.round(dp - delta[..., rows, :], "dp"), "dp")
        # -- dS rounded to the ds format for the dQ and dK matmuls: seed 004, cause 2 --
        ds = pol.round(ds_exact, "ds")
        yield rows, keys, p, ds_exact, ds


def flash_attention_backward(q, k, v, out, lse, grad_out, policy: str | PrecisionPolicy = "fa2_bf16", *,
                             scale: float | None = None, causal: bool = False,
                             attn_bias: torch.Tensor | None = None, block_q: int = 128, block_k: int = 128,
                             fused_scale_max: bool = False, gproj: str = "off", stats: dict | None = None):
    """Emulated FlashAttention backward. Returns ``(dq, dk, dv)`` in the policy's carrier dtype.

    ``q, k, v`` are the forward's inputs (rounded to the ``inputs`` format here, as the
    forward did), ``out`` and ``lse`` what the forward stored, ``grad_out`` = dL/dO.
    ``attn_bias`` (additive, no gradient) and ``causal`` must be the forward's.
    ``gproj``: ``"off"``, ``"dq"`` or ``"dq_dk"`` (see the module docstring).

    ``stats``: a dict to fill with per-row diagnostics of shape (batch, heads, n_q):
    ``ds_row_sum`` (sum_j of dS as the dQ matmul effectively multiplies it: dS' under GProj),
    ``ds_rounded_row_sum`` (sum_j dS~, after the ``ds`` rounding and before any projection),
    ``ds_exact_row_sum`` (before the ``ds`` rounding) and ``ds_row_abs_sum`` (sum_j |dS~_ij|).
    """
    check_qkv(q, k, v)
    check_lse(lse, q)
    if tuple(out.shape) != tuple(q.shape[:-1]) + (v.shape[-1],) or grad_out.shape != out.shape:
        raise ValueError(f"out {tuple(out.shape)} and grad_out {tuple(grad_out.shape)} must have the output's "
                         f"shape {tuple(q.shape[:-1]) + (v.shape[-1],)}")
    if gproj not in GPROJ_MODES:
        raise ValueError(f"gproj must be one of {GPROJ_MODES}, got {gproj!r}")
    pol = get_policy(policy)
    carrier = pol.carrier
    scale = check_scale(scale, q.shape[-1])
    q, k, v = (pol.round(t.to(carrier), "inputs") for t in (q, k, v))
    out = out.to(carrier)
    grad_out = pol.round(grad_out.to(carrier), "grad_out")
    lse = lse.to(carrier).unsqueeze(-1)
    n_q, n_k = q.shape[-2], k.shape[-2]
    bias = None if attn_bias is None else attn_bias.to(carrier).expand(q.shape[:2] + (n_q, n_k))

    # -- preprocessing: D_i = rowsum(dO * O) from the stored (rounded) output --
    delta = pol.round((grad_out * out).sum(dim=-1, keepdim=True), "delta")

    def tiles():
        return _key_block_tiles(q, k, v, grad_out, lse, delta, bias, pol, scale, causal, block_q, block_k,
                                fused_scale_max)

    row_shape = q.shape[:-1] + (1,)
    r_full = None
    if gproj == "dq_dk":
        # -- GProj (dq_dk) pass 1: r_i = sum_j dS~_ij over every key block, before any dK_j is formed --
        r_full = torch.zeros(row_shape, dtype=carrier, device=q.device)
        for rows, _, _, _, ds in tiles():
            r_full[..., rows, :] = pol.round(r_full[..., rows, :] + ds.sum(dim=-1, keepdim=True), "dp")

    dq_acc = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros(v.shape, dtype=carrier, device=v.device)
    if gproj == "dq":
        r_acc = torch.zeros(row_shape, dtype=carrier, device=q.device)  # beside dQ: r_i and (P~ K)_i
        pk_acc = torch.zeros_like(q)
    if stats is not None:
        for key in ("ds_row_sum", "ds_rounded_row_sum", "ds_exact_row_sum", "ds_row_abs_sum", "p_row_sum"):
            stats[key] = torch.zeros(q.shape[:-1], dtype=carrier, device=q.device)

    for rows, keys, p, ds_exact, ds in tiles():
        q_blk, k_blk, do_blk = q[..., rows, :], k[..., keys, :], grad_out[..., rows, :]
        p_mm = pol.round(p, "p_bwd")

        # -- dV_j = P^T dO, with P rounded for the matmul --
        dv[..., keys, :] = pol.round(pol.round(p_mm.transpose(-1, -2) @ do_blk, "grad_acc"), "grad")

        # -- dQ tile: dS~ K_j, less r_i (P~ K_j)_i beside it when r is known (GProj "dq_dk") --
        dq_tile = ds @ k_blk
        ds_k = ds
        if gproj == "dq_dk":
            # -- GProj (dq_dk): r_i (P~ K_j)_i off the dQ tile, r_i P~_ij off dK's operand --
            r_blk = r_full[..., rows, :]
            dq_tile = dq_tile - r_blk * (p_mm @ k_blk)  # r applied to the fp32 GEMM output, not rounded
            # dK's correction: the operand r_i P~_ij (rounded like P~) into dK's fp32 accumulator
            ds_k = ds - pol.round(r_blk * p_mm, "p_bwd")
        elif gproj == "dq":
            # -- GProj (dq): r_i and (P~ K)_i accumulated beside dQ --
            r_acc[..., rows, :] = pol.round(r_acc[..., rows, :] + ds.sum(dim=-1, keepdim=True), "dp")
            pk_acc[..., rows, :] = pol.round(pk_acc[..., rows, :] + pol.round(p_mm @ k_blk, "grad_acc"),
                                             "grad_acc")
        if stats is not None:
            stats["ds_rounded_row_sum"][..., rows] += ds.sum(dim=-1)
            stats["ds_exact_row_sum"][..., rows] += ds_exact.sum(dim=-1)
            stats["ds_row_abs_sum"][..., rows] += ds.abs().sum(dim=-1)
            stats["p_row_sum"][..., rows] += p_mm.sum(dim=-1)

        # -- dQ accumulates across key blocks; dK_j is complete after this block --
        dq_acc[..., rows, :] = pol.round(dq_acc[..., rows, :] + pol.round(dq_tile, "grad_acc"), "grad_acc")
        dk[..., keys, :] = pol.round(pol.round(ds_k.transpose(-1, -2) @ q_blk, "grad_acc") * scale, "grad")

    if gproj == "dq":
        # -- GProj (dq): the dQ correction, once r_i is complete: dQ_i -= r_i (P~ K)_i --
        dq_acc = pol.round(dq_acc - r_acc * pk_acc, "grad_acc")
    if stats is not None:
        # the row sums of dS as the dQ matmul effectively multiplies it: sum_j (dS~_ij - r_i P~_ij) = r_i (1 - sum_j P~_ij)
        stats["ds_row_sum"] = stats["ds_rounded_row_sum"]
        if gproj != "off":
            r = r_acc if gproj == "dq" else r_full
            stats["ds_row_sum"] = (r * (1 - stats["p_row_sum"].unsqueeze(-1))).squeeze(-1)
    dq = pol.round(dq_acc * scale, "grad")
    return dq, dk, dv
