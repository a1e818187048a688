"""What each fix of study 05 costs a real attention kernel, counted analytically.

The base is a FlashAttention-2/3 kernel pair on one head (Dao 2023, Alg. 1 and 2; Shah et al.
2024), n_q = n_k = N, head dimension d, tiles of block_q x block_k:

    forward   one pass over the tiles: S = Q K_j^T and O += P V_j (2 GEMMs per tile); Q read once,
              K_j and V_j per tile; O and the log-sum-exp written once
    backward  D = rowsum(dO * O) (a small kernel), then one pass, key blocks outer: S, dP = dO V_j^T,
              dV_j += P^T dO, dQ_i += dS K_j, dK_j += dS^T Q (5 GEMMs per tile); per tile Q_i, dO_i,
              L_i, D_i are read and dQ_i is added to an fp32 buffer with atomics; then dQ is converted

Counts are per head and per training step of attention (forward + backward), split by pass.
A "score GEMM" is 2 * (visited tile elements) * d FLOPs; causal masking visits only the tiles
on or below the diagonal, whole. Low-precision operands take ``low_bytes`` bytes, fp32 ones 4.
What each fix adds is what ``attnum.backward`` / ``attnum.fixes`` emulate:

    forward_fix     scale and max subtracted in two operations instead of one FMA, in the forward
                    and in the backward's recompute of P
    mean_key        a centering kernel (read K, write K - mean) before the forward and before the
                    backward, and the centering's backward on dK (read, write)
    stable_max      per score, a comparison with the running max and a count (forward only)
    fp32_backward   dS and P stay fp32, so the dV, dQ and dK GEMMs run in fp32 (on CUDA cores: a
                    TF32 GEMM would round dS again); S and dP keep low-precision operands
                    (dO arrives in the low format); gradients stored in fp32
    gproj_dq        one more GEMM per tile (P~ K_j), a row sum of dS~, and fp32 buffers for
                    (P~ K)_i and r_i filled with atomics beside dQ, read once at the end
    gproj_dq_dk     a first pass over the tiles (query blocks outer) recomputing S, P, dP, dS~ and
                    r; in the main pass, two more GEMMs per tile: r_i (P~ K_j)_i for dQ and
                    (r P~)^T Q_i for dK
    fp32_attention  every GEMM of both passes in fp32, every tensor read and written in fp32

``compute_seconds`` turns counts into an arithmetic time at a GPU's datasheet peaks (tensor-core,
special-function and ALU work not overlapped, memory time ignored): arithmetic on published
peaks, not a measurement. Memory traffic counts every global-memory access, including the dQ
atomics that a GPU's L2 cache mostly absorbs, so it overstates DRAM traffic.

``triton_fa2_cost`` / ``triton_fa2_seconds`` count our own Triton kernel (``attnum.kernels.triton_fa2``)
from its code instead: a two-kernel backward without atomics (7 GEMMs per tile where the design above
has 5), GProj inside the dQ kernel and, for dq_dk, one more GEMM in the dK/dV kernel; study 05 sets
these beside the kernel's measured times.
"""
from __future__ import annotations

import math

import numpy as np
import xarray as xr

from .kernels.fixes import FIXES

PASSES = ("forward", "backward")
QUANTITIES = {
    "gemm_flops_low": ("FLOP", "GEMM FLOPs with low-precision operands (tensor cores, fp32 accumulation)"),
    "gemm_flops_fp32": ("FLOP", "GEMM FLOPs with fp32 operands"),
    "exp_ops": ("1", "exponentials"),
    "pointwise_ops": ("1", "other elementwise operations on score-sized tiles and vectors"),
    "hbm_bytes": ("byte", "bytes read from and written to global memory (DRAM or L2)"),
    "tile_passes": ("1", "passes over the (query block, key block) tiles"),
    "extra_kernels": ("1", "kernel launches besides the tile passes"),
    "workspace_bytes": ("byte", "extra GPU memory the fix needs during the pass"),
}

H100_SXM = {
    # NVIDIA H100 SXM5 datasheet, dense: BF16 tensor core 989.4 TFLOP/s, FP32 (CUDA cores) 66.9 TFLOP/s,
    # HBM3 3.35 TB/s; special-function (exp) throughput 3.9 TFLOP/s as quoted by FlashAttention-3
    # (Shah et al. 2024, Sec. 1).
    "low_gemm_flops_per_s": 989.4e12,
    "fp32_flops_per_s": 66.9e12,
    "exp_per_s": 3.9e12,
    "hbm_bytes_per_s": 3.35e12,
}


def visited_tiles(seq_len: int, block_q: int, block_k: int, causal: bool) -> int:
    """Tiles a kernel computes: all of them, or (causal) those with a key at or before a row's position."""
    n_q_blocks, n_k_blocks = math.ceil(seq_len / block_q), math.ceil(seq_len / block_k)
    if not causal:
        return n_q_blocks * n_k_blocks
    count = 0
    for i in range(n_q_blocks):
        last_row = min((i + 1) * block_q, seq_len) - 1
        count += last_row // block_k + 1
    return count


def kernel_cost(fix: str, seq_len: int, head_dim: int, *, block_q: int = 128, block_k: int = 128,
                causal: bool = False, low_bytes: int = 2) -> dict[str, dict[str, float]]:
    """``{pass: {quantity: count}}`` for one head's forward and backward under ``fix`` (see the module
    docstring for the kernels counted)."""
    if fix not in FIXES:
        raise ValueError(f"unknown fix {fix!r}; allowed: {list(FIXES)}")
    n, d, b, f = seq_len, head_dim, low_bytes, 4
    tiles = visited_tiles(n, block_q, block_k, causal)
    elems = tiles * block_q * block_k  # score elements computed (whole tiles)
    gemm = 2.0 * elems * d  # one score-sized GEMM
    q_rows_per_tile = tiles * block_q  # query rows loaded, summed over tiles
    k_rows_per_tile = tiles * block_k
    x = f if fix == "fp32_attention" else b  # format of inputs, outputs and dO in memory

    fwd = dict.fromkeys(QUANTITIES, 0.0)
    fwd.update(gemm_flops_low=2 * gemm, exp_ops=elems,
               pointwise_ops=3 * elems,  # fused scale-max FMA, row max, row sum
               hbm_bytes=n * d * x + 2 * k_rows_per_tile * d * x + n * d * x + n * f, tile_passes=1)
    bwd = dict.fromkeys(QUANTITIES, 0.0)
    bwd.update(gemm_flops_low=5 * gemm, exp_ops=elems,
               pointwise_ops=3 * elems + 2 * n * d,  # P recompute FMA, dP - D, * P; D = rowsum(dO * O)
               hbm_bytes=(2 * n * d * x + n * f  # D: read O and dO, write D
                          + q_rows_per_tile * (2 * d * x + 2 * f + 2 * d * f)  # Q_i, dO_i, L_i, D_i; dQ atomics
                          + 2 * n * d * x + 2 * n * d * x  # K_j, V_j read; dK_j, dV_j written
                          + n * d * f + n * d * x),  # dQ converted
               tile_passes=1, extra_kernels=2)

    if fix == "forward_fix":
        fwd["pointwise_ops"] += elems
        bwd["pointwise_ops"] += elems
    elif fix == "mean_key":
        fwd["hbm_bytes"] += 2 * n * d * b
        fwd["pointwise_ops"] += 2 * n * d
        fwd["extra_kernels"] += 1
        fwd["workspace_bytes"] += n * d * b
        bwd["hbm_bytes"] += 2 * n * d * b + 2 * n * d * b  # centre K again; dK - mean(dK)
        bwd["pointwise_ops"] += 2 * n * d + 2 * n * d
        bwd["extra_kernels"] += 2
        bwd["workspace_bytes"] += n * d * b
    elif fix == "stable_max":
        fwd["pointwise_ops"] += 2 * elems
    elif fix == "fp32_backward":
        bwd["gemm_flops_low"] = 2 * gemm  # S and dP
        bwd["gemm_flops_fp32"] = 3 * gemm  # dV, dQ, dK
        bwd["hbm_bytes"] += 3 * n * d * (f - b)  # dQ, dK, dV stored in fp32
    elif fix == "gproj_dq":
        bwd["gemm_flops_low"] += gemm  # P~ K_j
        bwd["pointwise_ops"] += elems + 2 * n * d  # row sum of dS~; dQ -= r (P~ K) at the end
        bwd["hbm_bytes"] += q_rows_per_tile * (2 * d * f + 2 * f) + n * d * f + n * f
        bwd["workspace_bytes"] += n * d * f + n * f
    elif fix == "gproj_dq_dk":
        # pass 1, query blocks outer: S, P, dP, dS~ and its row sum; r written once
        bwd["gemm_flops_low"] += 2 * gemm
        bwd["exp_ops"] += elems
        bwd["pointwise_ops"] += 4 * elems
        bwd["hbm_bytes"] += n * (2 * d * b + 2 * f) + 2 * k_rows_per_tile * d * b + n * f
        bwd["tile_passes"] += 1
        bwd["workspace_bytes"] += n * f
        # main pass: r_i (P~ K_j) for dQ and (r P~)^T Q for dK, r read per tile
        bwd["gemm_flops_low"] += 2 * gemm
        bwd["pointwise_ops"] += 2 * elems + q_rows_per_tile * d
        bwd["hbm_bytes"] += q_rows_per_tile * f
    elif fix == "fp32_attention":
        fwd["gemm_flops_fp32"], fwd["gemm_flops_low"] = fwd["gemm_flops_low"], 0.0
        bwd["gemm_flops_fp32"], bwd["gemm_flops_low"] = bwd["gemm_flops_low"], 0.0
    return {"forward": fwd, "backward": bwd}


def compute_seconds(counts: dict[str, float], peaks: dict[str, float] = H100_SXM) -> float:
    """Arithmetic time of one kernel pass's counts at datasheet peaks: GEMMs at their operand
    format's rate, exponentials at the special-function rate, other elementwise operations at the
    fp32 rate (2 FLOPs each, like a multiply-add), none of them overlapped; memory time ignored
    (FlashAttention kernels are compute-bound at training sizes). A crude model, not a measurement."""
    return (counts["gemm_flops_low"] / peaks["low_gemm_flops_per_s"]
            + counts["gemm_flops_fp32"] / peaks["fp32_flops_per_s"]
            + counts["exp_ops"] / peaks["exp_per_s"]
            + 2 * counts["pointwise_ops"] / peaks["fp32_flops_per_s"])


def cost_table(fixes, seq_len: int, head_dim: int, *, block_q: int = 128, block_k: int = 128,
               causal: bool = True, low_bytes: int = 2) -> xr.Dataset:
    """Every quantity of ``kernel_cost`` for each fix and pass, the compute time at H100 peaks, and
    each fix's extra over ``none``: compute time relative to the base backward and to the base
    forward + backward, memory traffic relative to the base forward + backward."""
    data = {name: np.zeros((len(fixes), len(PASSES))) for name in QUANTITIES}
    seconds = np.zeros((len(fixes), len(PASSES)))
    for i, fix in enumerate(fixes):
        cost = kernel_cost(fix, seq_len, head_dim, block_q=block_q, block_k=block_k, causal=causal,
                           low_bytes=low_bytes)
        for j, pass_name in enumerate(PASSES):
            for name in QUANTITIES:
                data[name][i, j] = cost[pass_name][name]
            seconds[i, j] = compute_seconds(cost[pass_name])
    ds = xr.Dataset({f"cost_{name}": (("fix", "kernel_pass"), values) for name, values in data.items()},
                    coords={"fix": list(fixes), "kernel_pass": list(PASSES)})
    ds["cost_compute_seconds"] = (("fix", "kernel_pass"), seconds)
    for name, (units, long_name) in QUANTITIES.items():
        ds[f"cost_{name}"].attrs.update(units=units, long_name=f"{long_name}, per head (analytic)")
    ds["cost_compute_seconds"].attrs.update(
        units="s", long_name="arithmetic time at H100 SXM datasheet peaks, per head (analytic, not measured)")
    base = kernel_cost("none", seq_len, head_dim, block_q=block_q, block_k=block_k, causal=causal,
                       low_bytes=low_bytes)
    base_bwd = compute_seconds(base["backward"])
    base_all = base_bwd + compute_seconds(base["forward"])
    base_bytes = base["forward"]["hbm_bytes"] + base["backward"]["hbm_bytes"]
    extra = {
        "cost_extra_compute_vs_backward": ((seconds.sum(1) - base_all) / base_bwd,
                                           "extra arithmetic time of forward + backward over the base, / base backward"),
        "cost_extra_compute_vs_attention": ((seconds.sum(1) - base_all) / base_all,
                                            "extra arithmetic time of forward + backward over the base, "
                                            "/ base forward + backward"),
        "cost_extra_traffic_vs_attention": ((data["hbm_bytes"].sum(1) - base_bytes) / base_bytes,
                                            "extra memory traffic of forward + backward over the base, "
                                            "/ base forward + backward"),
    }
    for name, (values, long_name) in extra.items():
        ds[name] = ("fix", values)
        ds[name].attrs.update(units="1", long_name=long_name + " (analytic)")
    ds.attrs.update(cost_seq_len=seq_len, cost_head_dim=head_dim, cost_block_q=block_q, cost_block_k=block_k,
                    cost_causal=int(causal))
    return ds


# -- our Triton kernel's own structure (``attnum.kernels.triton_fa2``) --------------------------------

H200_SXM = {
    # NVIDIA H200 SXM datasheet: the same dense BF16 tensor-core (989 TFLOP/s) and FP32 (67 TFLOP/s) peaks
    # as the H100 SXM, HBM3e at 4.8 TB/s; the exponential rate as for the H100 (same SM).
    **H100_SXM,
    "hbm_bytes_per_s": 4.8e12,
}

TRITON_VARIANTS = {
    # variant: (GProj mode, FP32 backward, fp32 inputs) of ``triton_fa2``; named by the fix it implements
    "none": ("off", False, False),
    "gproj_dq": ("dq", False, False),
    "gproj_dq_dk": ("dq_dk", False, False),
    "fp32_backward": ("off", True, False),
    "fp32_attention": ("off", False, True),
}


def triton_fa2_cost(variant: str, seq_len: int, head_dim: int, *, causal: bool = False,
                    tiles: dict | None = None) -> dict[str, dict[str, float]]:
    """``{pass: {quantity: count}}`` (GEMM FLOPs by operand format, exponentials, other elementwise
    operations) for one head of our Triton kernel, counted from its code rather than from the generic
    design of ``kernel_cost``: forward 2 GEMMs per tile; backward as two kernels, dQ (query blocks
    outer: S, dP, dS~ K; 3 GEMMs per tile, +1 for GProj's P~ K) and dK/dV (key blocks outer: S^T,
    dP^T, P~^T dO, dS~^T Q; 4 per tile, +1 for GProj dq_dk's (r P~)^T Q), so 7 backward GEMMs where
    the atomic design has 5. ``fp32_backward``: the dV, dQ and dK GEMMs take fp32 operands (3 of 7);
    ``fp32_attention`` (the kernel fed fp32 tensors): every GEMM. ``tiles``: the kernel's tile sizes
    (``fwd_m``, ``fwd_n``, ``dq_m``, ``dq_n``, ``kv_m``, ``kv_n``); by default the tiles the kernel
    itself launches with at this head dim and causality (``triton_fa2.default_config``: its tuned
    table, or the untuned fallback; the backward tiles halved under ``fp32_backward`` and, here, for
    fp32 inputs). Tiles only matter where they cut the causal diagonal (``visited_tiles``)."""
    if variant not in TRITON_VARIANTS:
        raise ValueError(f"unknown Triton variant {variant!r}; allowed: {list(TRITON_VARIANTS)}")
    # imported here: triton_fa2's kernels are defined at import, in the interpreter only if TRITON_INTERPRET is
    # already set then (the CPU tests set it before they import the module)
    from .kernels.triton_fa2 import default_config

    gproj, fp32_bwd, fp32_in = TRITON_VARIANTS[variant]
    t = default_config(head_dim, fp32_backward=fp32_bwd or fp32_in, causal=causal, gproj=gproj).tiles()
    t.update(tiles or {})
    n, d = seq_len, head_dim

    def score_elems(block_q, block_k):
        return visited_tiles(n, block_q, block_k, causal) * block_q * block_k

    e_fwd, e_dq, e_kv = score_elems(t["fwd_m"], t["fwd_n"]), score_elems(t["dq_m"], t["dq_n"]), \
        score_elems(t["kv_m"], t["kv_n"])
    low = "gemm_flops_fp32" if fp32_in else "gemm_flops_low"  # the format of the S and dP GEMMs' operands
    fwd = dict.fromkeys(("gemm_flops_low", "gemm_flops_fp32", "exp_ops", "pointwise_ops"), 0.0)
    bwd = dict(fwd)
    fwd[low] += 2 * 2.0 * e_fwd * d
    fwd["exp_ops"] += e_fwd
    fwd["pointwise_ops"] += 3 * e_fwd
    # dQ kernel: S and dP (low unless fp32 inputs), dS~ K (fp32 under the FP32 backward), GProj's P~ K
    bwd[low] += 2 * 2.0 * e_dq * d
    bwd["gemm_flops_fp32" if fp32_bwd else low] += 2.0 * e_dq * d
    bwd["exp_ops"] += e_dq
    bwd["pointwise_ops"] += 4 * e_dq + 2 * n * d
    if gproj != "off":
        bwd[low] += 2.0 * e_dq * d
        bwd["pointwise_ops"] += e_dq
    # dK/dV kernel: S^T, dP^T (low), P~^T dO and dS~^T Q (fp32 under the FP32 backward), GProj dq_dk's (r P~)^T Q
    bwd[low] += 2 * 2.0 * e_kv * d
    bwd["gemm_flops_fp32" if fp32_bwd else low] += 2 * 2.0 * e_kv * d
    bwd["exp_ops"] += e_kv
    bwd["pointwise_ops"] += 4 * e_kv
    if gproj == "dq_dk":
        bwd[low] += 2.0 * e_kv * d
        bwd["pointwise_ops"] += e_kv
    return {"forward": fwd, "backward": bwd}


def triton_fa2_seconds(variant: str, seq_len: int, head_dim: int, *, causal: bool = False,
                       heads: int = 1, peaks: dict = H200_SXM) -> dict[str, float]:
    """Arithmetic time (``compute_seconds``, datasheet peaks, memory ignored) of ``heads`` heads of
    our Triton kernel: ``{"forward", "backward", "fwd_bwd"}`` in seconds (analytic, not measured)."""
    cost = triton_fa2_cost(variant, seq_len, head_dim, causal=causal)
    fwd, bwd = (heads * compute_seconds(cost[p], peaks) for p in PASSES)
    return {"forward": fwd, "backward": bwd, "fwd_bwd": fwd + bwd}
