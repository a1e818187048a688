"""Study 01's emulated measurements: each builds an ``xr.Dataset`` of errors against the fp64 golden value
computed on the same rounded inputs (the length sweep, block shapes and loop orders, causal and unmasked
position strata, rounding attribution, seed 000's multiply-add and denominator, the fp32 reference's stages).

Experiment functions take the sizes the notebook's parameters cell sets as keyword arguments without
defaults: the parameters cell states them once.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import xarray as xr

from ... import acceptance, kernels
from ...inputs import normal_qkv
from ...metrics import GROWTH_MODELS, STRATA, error_summary, fit_growth, mean_rel_error, row_rel_l2, strata_bounds
from ...precision import min_normal, policy_for, round_to
from ...progress import tqdm

KERNELS = ("reference", "emulator")  # registry families (attnum.kernels): unblocked and tiled attention
FAMILIES = ("all", "fa2")
ERROR_METRICS = ("max_abs", "mean_abs", "rel_l2", "max_rel", "max_ulp")
SELF_CHECK_MAX_LEN = 2048  # the golden self-check (two chunkings) costs a second golden run




def _inputs(fmt, seq_len, seed, batch, heads, head_dim, device):
    """Inputs rounded to ``fmt`` (what the kernel reads) and their fp64 golden output."""
    q, k, v = (round_to(t, fmt) for t in normal_qkv(batch, heads, seq_len, head_dim, seed=seed, device=device))
    return q, k, v


def length_sweep(seq_lens, dtypes, seeds, *, batch, heads, head_dim, block_q, block_k,
                 families=FAMILIES, device, golden_chunk, reference_chunk,
                 progress=True) -> xr.Dataset:
    """Errors of both kernels, both policy families, every dtype, length and seed."""
    shape = (len(KERNELS), len(families), len(dtypes), len(seq_lens), len(seeds))
    err = {m: np.full(shape, np.nan) for m in ERROR_METRICS}
    passes = np.zeros((len(acceptance.RULES),) + shape, dtype=np.int8)
    floors = np.full((len(dtypes), len(seq_lens), len(seeds)), np.nan)
    xmax = np.full((len(dtypes), len(seq_lens), len(seeds)), np.nan)
    fp64_err = np.full((len(seq_lens), len(seeds)), np.nan)
    mean_rel = np.full(shape, np.nan)
    inside = {m: np.full((len(dtypes), len(seq_lens), len(seeds)), np.nan) for m in ("rel_l2", "max_abs")}
    self_err = np.full((len(seq_lens), len(seeds)), np.nan)
    work = [(i, n, j, s) for i, n in enumerate(seq_lens) for j, s in enumerate(seeds)]
    for i, n, j, seed in tqdm(work, desc="lengths x seeds", disable=not progress):
        q64, k64, v64 = normal_qkv(batch, heads, n, head_dim, seed=seed, device=device)
        for d, fmt in enumerate(dtypes):
            q, k, v = (round_to(t, fmt) for t in (q64, k64, v64))
            gold = kernels.get("golden", chunk=golden_chunk).forward(q, k, v)[0]
            if fmt == "fp32" and n <= SELF_CHECK_MAX_LEN:
                # the golden value must not depend on how queries are chunked
                other = kernels.get("golden", chunk=max(1, golden_chunk // 3)).forward(q, k, v)[0]
                self_err[i, j] = (gold - other).abs().max().item()
            if fmt == "fp32":
                out64, _ = kernels.emulator("fp64", block_q=block_q, block_k=block_k).forward(q, k, v)
                fp64_err[i, j] = (out64 - gold).abs().max().item()
            xmax[d, i, j] = max(t.abs().max().item() for t in (q, k, v))
            floors[d, i, j] = acceptance.dtype_floor(gold, fmt)
            # Identical policies (all_fp32 == fa2_fp32) share one evaluation.
            cache = {}

            def run_kernel(kernel, pol):
                key = (kernel, pol.formats())
                if key not in cache:
                    kern = (kernels.reference(pol, query_chunk=reference_chunk or None) if kernel == "reference"
                            else kernels.emulator(pol, block_q=block_q, block_k=block_k))
                    cache[key] = kern.forward(q, k, v)[0]
                return cache[key]

            # same-precision reference of the FA/PyTorch test suites: plain attention, all in fmt
            pt_err = error_summary(run_kernel("reference", policy_for("all", fmt)), gold, fmt)["max_abs"]
            # the reference most users have in mind: fp32 inside, inputs and output in the dtype
            summary = error_summary(run_kernel("reference", fp32_inside_policy(fmt)), gold, fmt)
            for m in inside:
                inside[m][d, i, j] = summary[m]
            for f, family in enumerate(families):
                pol = policy_for(family, fmt)
                for kk, kernel in enumerate(KERNELS):
                    out = run_kernel(kernel, pol)
                    mean_rel[kk, f, d, i, j] = mean_rel_error(out, gold)
                    summary = error_summary(out, gold, fmt)
                    for m in ERROR_METRICS:
                        err[m][kk, f, d, i, j] = summary[m]
                    verdict = acceptance.judge(rel_l2=summary["rel_l2"], max_abs=summary["max_abs"], n=n,
                                               x_max=xmax[d, i, j], fmt=fmt, reference_max_abs=pt_err,
                                               floor=floors[d, i, j])
                    passes[:, kk, f, d, i, j] = [verdict[rule] for rule in acceptance.RULES]
            cache.clear()  # free the outputs before the next format
    dims = ("kernel", "policy", "dtype", "seq_len", "seed")
    coords = {"kernel": list(KERNELS), "policy": list(families), "dtype": list(dtypes),
              "seq_len": list(seq_lens), "seed": list(seeds), "rule": list(acceptance.RULES)}
    ds = xr.Dataset({f"{m}_err": (dims, err[m]) for m in ERROR_METRICS}, coords=coords)
    ds["passes"] = (("rule",) + dims, passes)
    ds["mean_rel_err"] = (dims, mean_rel)
    for m in inside:
        ds[f"fp32_inside_{m}_err"] = (("dtype", "seq_len", "seed"), inside[m])
    ds["dtype_floor"] = (("dtype", "seq_len", "seed"), floors)
    ds["input_abs_max"] = (("dtype", "seq_len", "seed"), xmax)
    ds["dynamic_threshold"] = (("dtype", "seq_len"), np.array(
        [[acceptance.dynamic_threshold(n, float(np.nanmax(xmax[d, i])), fmt) for i, n in enumerate(seq_lens)]
         for d, fmt in enumerate(dtypes)]))
    ds["flash_fp64_max_abs_err"] = (("seq_len", "seed"), fp64_err)
    ds["golden_self_max_abs_err"] = (("seq_len", "seed"), self_err)
    return ds


def summarize_lengths(ds: xr.Dataset) -> xr.Dataset:
    """Add pass rates, flash/reference ratios and growth fits of the median error."""
    out = ds.copy()
    out["pass_rate"] = ds["passes"].astype(float).mean("seed")
    out["flash_to_reference_ratio"] = ds["max_abs_err"].sel(kernel="emulator") / ds["max_abs_err"].sel(kernel="reference")
    metrics = ["max_abs", "rel_l2"]
    fits = np.full((len(metrics), ds.sizes["kernel"], ds.sizes["policy"], ds.sizes["dtype"], len(GROWTH_MODELS), 3), np.nan)
    n = ds["seq_len"].values
    for a, m in enumerate(metrics):
        med = ds[f"{m}_err"].median("seed")
        for b, kernel in enumerate(ds["kernel"].values):
            for c, pol in enumerate(ds["policy"].values):
                for d, fmt in enumerate(ds["dtype"].values):
                    res = fit_growth(n, med.sel(kernel=kernel, policy=pol, dtype=fmt).values)
                    for e, model in enumerate(GROWTH_MODELS):
                        fits[a, b, c, d, e] = [res[model]["intercept"], res[model]["slope"], res[model]["r2"]]
    dims = ("error_metric", "kernel", "policy", "dtype", "growth_model")
    out = out.assign_coords(error_metric=metrics, growth_model=list(GROWTH_MODELS))
    for idx, name in enumerate(("fit_intercept", "fit_slope", "fit_r2")):
        out[name] = (dims, fits[..., idx])
    return out


GOLDEN_TILE_MEMORY = 192 * 1024 // 2
"""M of Golden et al.'s tile formula, in elements: one A100 SM's 192 KiB of on-chip SRAM (L1 and shared
memory together, the M of FlashAttention's Algorithm 1, which the formula comes from) holding 2-byte
(bf16/fp16) elements. Golden et al. ran on A100s (A. Golden et al., "Is Flash Attention Stable?", 2024,
arXiv 2405.02803, https://arxiv.org/abs/2405.02803); the paper gives M as "SRAM size" without a value, so this
choice is ours."""


def golden_tile(head_dim: int, memory: int = GOLDEN_TILE_MEMORY) -> tuple[int, int]:
    """Golden et al.'s (FlashAttention-1's) tiles: Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d);
    returns (block_q, block_k) = (Br, Bc)."""
    if head_dim < 1 or memory < 1:
        raise ValueError(f"head_dim and memory must be positive, got {head_dim}, {memory}")
    bc = math.ceil(memory / (4 * head_dim))
    return min(bc, head_dim), bc


def parse_block_config(cfg: str, head_dim: int) -> tuple[int, int]:
    """``"64x128"`` -> (64, 128); ``"golden"`` -> ``golden_tile(head_dim)``."""
    if cfg == "golden":
        return golden_tile(head_dim)
    try:
        bq, bk = (int(x) for x in cfg.split("x"))
    except ValueError:
        raise ValueError(f"block configuration {cfg!r} is neither <block_q>x<block_k> nor 'golden'") from None
    return bq, bk


def block_sweep(seq_len, block_configs, loop_orders, dtypes, seeds, *, batch, heads, head_dim,
                families=FAMILIES, device, golden_chunk, progress=True) -> xr.Dataset:
    """Flash-emulator error over block shapes and loop orders at one length (Golden et al. Fig 6).

    A configuration is ``<block_q>x<block_k>`` or ``golden``: Golden et al.'s tiles for this head
    dimension (``golden_tile``)."""
    parsed = [parse_block_config(cfg, head_dim) for cfg in block_configs]
    shape = (len(block_configs), len(loop_orders), len(families), len(dtypes), len(seeds))
    max_abs, rel_l2 = np.full(shape, np.nan), np.full(shape, np.nan)
    work = [(d, fmt, s, seed) for d, fmt in enumerate(dtypes) for s, seed in enumerate(seeds)]
    for d, fmt, s, seed in tqdm(work, desc="block configs", disable=not progress):
        q, k, v = _inputs(fmt, seq_len, seed, batch, heads, head_dim, device)
        gold = kernels.get("golden", chunk=golden_chunk).forward(q, k, v)[0]
        for b, (bq, bk) in enumerate(parsed):
            for o, order in enumerate(loop_orders):
                for f, family in enumerate(families):
                    out, _ = kernels.emulator(policy_for(family, fmt), block_q=bq, block_k=bk,
                                              loop_order=order).forward(q, k, v)
                    summary = error_summary(out, gold, fmt)
                    max_abs[b, o, f, d, s], rel_l2[b, o, f, d, s] = summary["max_abs"], summary["rel_l2"]
    # own dtype and seed dimensions: the experiments may use different subsets, and merging shared
    # dimensions would pad every other experiment's variables with NaN
    dims = ("block_config", "loop_order", "policy", "block_dtype", "block_seed")
    coords = {"block_config": list(block_configs), "loop_order": list(loop_orders), "policy": list(families),
              "block_dtype": list(dtypes), "block_seed": list(seeds),
              # the tile of each configuration (not block_q/block_k: those name the length sweep's tile
              # parameters, which a sweep may add as dimensions)
              "tile_q": ("block_config", [p[0] for p in parsed]),
              "tile_k": ("block_config", [p[1] for p in parsed]),
              "block_area": ("block_config", [p[0] * p[1] for p in parsed])}
    ds = xr.Dataset({"block_max_abs_err": (dims, max_abs), "block_rel_l2_err": (dims, rel_l2)}, coords=coords)
    ds["block_seq_len"] = seq_len
    return ds


def causal_strata(seq_len, dtypes, seeds, *, batch, heads, head_dim, block_q, block_k,
                  families=FAMILIES, profile_bins=32, device, golden_chunk, reference_chunk,
                  causal=True, progress=True) -> xr.Dataset:
    """Causal attention: error by query position (first 10% / middle 80% / last 10%, seed 000).

    ``causal=False``: the same strata without a mask (every row sees all N keys), in variables
    prefixed ``nomask_`` (seed 000 reports its strata without saying which mask it used)."""
    shape = (len(KERNELS), len(families), len(dtypes), len(seeds))
    strata_rel = np.full(shape[:3] + (len(STRATA),) + shape[3:], np.nan)
    strata_max = np.full_like(strata_rel, np.nan)
    profile = np.full(shape[:3] + (profile_bins,) + shape[3:], np.nan)
    bounds = strata_bounds(seq_len)
    edges = np.linspace(0, seq_len, profile_bins + 1).astype(int)
    work = [(d, fmt, s, seed) for d, fmt in enumerate(dtypes) for s, seed in enumerate(seeds)]
    for d, fmt, s, seed in tqdm(work, desc="causal" if causal else "no mask", disable=not progress):
        q, k, v = _inputs(fmt, seq_len, seed, batch, heads, head_dim, device)
        gold = kernels.get("golden", chunk=golden_chunk).forward(q, k, v, causal=causal)[0]
        for f, family in enumerate(families):
            pol = policy_for(family, fmt)
            outs = {"reference": kernels.reference(pol, query_chunk=reference_chunk or None).forward(q, k, v, causal=causal)[0],
                    "emulator": kernels.emulator(pol, block_q=block_q, block_k=block_k).forward(q, k, v, causal=causal)[0]}
            for kk, kernel in enumerate(KERNELS):
                rows = row_rel_l2(outs[kernel], gold).flatten(0, -2).mean(0)  # mean over batch, heads
                absdiff = (outs[kernel].double() - gold).abs().amax(dim=-1).flatten(0, -2).amax(0)
                for t, name in enumerate(STRATA):
                    strata_rel[kk, f, d, t, s] = rows[bounds[name]].mean().item()
                    strata_max[kk, f, d, t, s] = absdiff[bounds[name]].max().item()
                for b in range(profile_bins):
                    profile[kk, f, d, b, s] = rows[edges[b]:edges[b + 1]].mean().item()
    coords = {"kernel": list(KERNELS), "policy": list(families), "dtype": list(dtypes), "seed": list(seeds),
              "stratum": list(STRATA), "position_bin": np.arange(profile_bins),
              "position_bin_center": ("position_bin", (edges[:-1] + edges[1:]) / 2.0)}
    ds = xr.Dataset({
        "strata_rel_l2_err": (("kernel", "policy", "dtype", "stratum", "seed"), strata_rel),
        "strata_max_abs_err": (("kernel", "policy", "dtype", "stratum", "seed"), strata_max),
        "row_profile_rel_l2_err": (("kernel", "policy", "dtype", "position_bin", "seed"), profile),
    }, coords=coords)
    ds["causal_seq_len"] = seq_len
    if not causal:
        ds = ds.rename({name: f"nomask_{name}" for name in ("strata_rel_l2_err", "strata_max_abs_err",
                                                             "row_profile_rel_l2_err")}
                       | {"causal_seq_len": "nomask_seq_len"})
    return ds


STAGES_LOW = ("score", "stats", "p", "out_acc", "output")
ATTRIBUTION_VARIANTS = ("all_low",) + tuple(f"promote_{st}" for st in STAGES_LOW) + tuple(f"only_{st}" for st in STAGES_LOW)


def attribution_policy(variant: str, fmt: str):
    """``all_low``: every stage in ``fmt``; ``promote_X``: all but X; ``only_X``: X alone (inputs always ``fmt``)."""
    low = policy_for("all", fmt)
    if variant == "all_low":
        return low
    kind, _, stage = variant.partition("_")
    if kind == "promote":
        return low.replace(**{stage: "fp32"})
    if kind == "only":
        return policy_for("all", "fp32").replace(name=f"only_{stage}_{fmt}", inputs=fmt, **{stage: fmt})
    raise ValueError(f"unknown attribution variant {variant!r}; variants: {ATTRIBUTION_VARIANTS}")


def stage_attribution(seq_lens, dtypes, seeds, *, query_rows, batch, heads, head_dim, block_q,
                      block_k, device, golden_chunk, progress=True) -> xr.Dataset:
    """Which rounding point makes the error grow? Promote one stage to fp32, or keep only one low.

    Only ``query_rows`` query rows are evaluated against all N keys: without a
    causal mask every row's computation is independent of the others, so the
    rows computed are exactly those of the full N x N problem, at O(rows * N) cost.
    """
    shape = (len(KERNELS), len(dtypes), len(ATTRIBUTION_VARIANTS), len(seq_lens), len(seeds))
    err = np.full(shape, np.nan)
    below = np.full((len(dtypes), len(seq_lens), len(seeds)), np.nan)
    work = [(i, n, j, s) for i, n in enumerate(seq_lens) for j, s in enumerate(seeds)]
    for i, n, j, seed in tqdm(work, desc="stage attribution", disable=not progress):
        q64, _, _ = normal_qkv(batch, heads, query_rows, head_dim, seed=seed, device=device)
        _, k64, v64 = normal_qkv(batch, heads, n, head_dim, seed=seed + 1_000_003, device=device)
        for d, fmt in enumerate(dtypes):
            q, k, v = (round_to(t, fmt) for t in (q64, k64, v64))
            gold = kernels.get("golden", chunk=golden_chunk).forward(q, k, v)[0]
            probs = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * head_dim ** -0.5, dim=-1)
            below[d, i, j] = (probs < min_normal(fmt)).double().mean().item()
            for st, variant in enumerate(ATTRIBUTION_VARIANTS):
                pol = attribution_policy(variant, fmt)
                outs = {"reference": kernels.reference(pol).forward(q, k, v)[0],
                        "emulator": kernels.emulator(pol, block_q=block_q, block_k=block_k).forward(q, k, v)[0]}
                for kk, kernel in enumerate(KERNELS):
                    err[kk, d, st, i, j] = error_summary(outs[kernel], gold, fmt)["rel_l2"]
    coords = {"kernel": list(KERNELS), "attribution_dtype": list(dtypes), "variant": list(ATTRIBUTION_VARIANTS),
              "attribution_seq_len": list(seq_lens), "attribution_seed": list(seeds)}
    ds = xr.Dataset({"attribution_rel_l2_err": (tuple(coords), err)}, coords=coords)
    ds["p_below_min_normal_frac"] = (("attribution_dtype", "attribution_seq_len", "attribution_seed"), below)
    ds["attribution_query_rows"] = query_rows
    return ds


def fp32_inside_policy(fmt: str):
    """Unblocked attention as PyTorch's math backend computes it from ``fmt`` inputs: every stage in
    fp32 (scores, softmax, normalised P, P V), inputs and the output in ``fmt``, rounded once."""
    return policy_for("all", "fp32").replace(name=f"fp32_inside_{fmt}", inputs=fmt, output=fmt)


# -- seed 000: two-rounding multiply-add (its MI210 port), the denominator's last 10% ----------------

MAC_MODES = ("matmul", "fma", "two_rounding")


def mac_sweep(seq_lens, dtypes, seeds, *, query_rows, batch, heads, head_dim, block_q,
              block_k, families=FAMILIES, device, golden_chunk, progress=True) -> xr.Dataset:
    """The flash emulator with its score product Q K^T accumulated three ways (``MAC_MODES``): the
    matmul of every other experiment (fp32 accumulator, rounded once to the score format), a
    term-by-term fused multiply-add in the score format, and seed 000's MI210 multiply-add with two
    roundings (product, then sum). ``query_rows`` rows against all N keys, as in ``stage_attribution``."""
    shape = (len(MAC_MODES), len(families), len(dtypes), len(seq_lens), len(seeds))
    err = np.full(shape, np.nan)
    cases = _rounded_row_cases(query_rows, seq_lens, seeds, dtypes, batch, heads, head_dim, device, golden_chunk,
                               "multiply-add", progress)
    for i, j, d, fmt, (q, k, v), gold in cases:
        for f, family in enumerate(families):
            for a, mode in enumerate(MAC_MODES):
                pol = policy_for(family, fmt).with_score_mac(None if mode == "matmul" else mode)
                out = kernels.emulator(pol, block_q=block_q, block_k=block_k).forward(q, k, v)[0]
                err[a, f, d, i, j] = error_summary(out, gold, fmt)["rel_l2"]
    coords = {"mac": list(MAC_MODES), "policy": list(families), "mac_dtype": list(dtypes),
              "mac_seq_len": list(seq_lens), "mac_seed": list(seeds)}
    ds = xr.Dataset({"mac_rel_l2_err": (tuple(coords), err)}, coords=coords)
    ds["mac_query_rows"] = query_rows
    return ds


def _row_subset_inputs(query_rows, n, seed, batch, heads, head_dim, device):
    """``query_rows`` queries and N keys and values (rows are independent without a mask)."""
    q64, _, _ = normal_qkv(batch, heads, query_rows, head_dim, seed=seed, device=device)
    _, k64, v64 = normal_qkv(batch, heads, n, head_dim, seed=seed + 1_000_003, device=device)
    return q64, k64, v64


def _rounded_row_cases(query_rows, seq_lens, seeds, dtypes, batch, heads, head_dim, device, golden_chunk, desc,
                       progress):
    """For every (N, seed) the row-subset inputs, then per format: (i, j, d, fmt, (q, k, v) rounded to fmt,
    the fp64 golden output of those rounded operands); i, j, d index seq_lens, seeds, dtypes."""
    work = [(i, n, j, s) for i, n in enumerate(seq_lens) for j, s in enumerate(seeds)]
    for i, n, j, seed in tqdm(work, desc=desc, disable=not progress):
        q64, k64, v64 = _row_subset_inputs(query_rows, n, seed, batch, heads, head_dim, device)
        for d, fmt in enumerate(dtypes):
            q, k, v = (round_to(t, fmt) for t in (q64, k64, v64))
            yield i, j, d, fmt, (q, k, v), kernels.get("golden", chunk=golden_chunk).forward(q, k, v)[0]


DENOMINATOR_WINDOWS = ("every_block", "first_90pct", "last_10pct")
TAIL_FRACTION = 0.1


def _row_sum_rounder(fmt: str, n: int, block_k: int, window: str):
    """A flash-emulator hook that rounds the running row sum to ``fmt`` after the key blocks of
    ``window`` only (the policy keeps it in fp32 otherwise). Blocks are numbered in the order the
    FA2 loop calls the hook (no mask: once per key block, in key order)."""
    from ...kernels.flash import KernelHooks

    n_blocks = math.ceil(n / block_k)
    tail_start = n - max(1, round(TAIL_FRACTION * n))  # first key of the last 10%

    class RowSumWindow(KernelHooks):
        def __init__(self):
            self.block = 0

        def store_row_sum(self, l):
            b, self.block = self.block, self.block + 1
            last = (b + 1) * block_k > tail_start  # the block holds keys of the last 10%
            if window == "every_block" or (window == "last_10pct") == last:
                return round_to(l, fmt)
            return l

    hooks = RowSumWindow()
    hooks.n_blocks = n_blocks
    return hooks


def denominator_tail(seq_lens, dtypes, seeds, *, query_rows, batch, heads, head_dim, block_q,
                     block_k, device, golden_chunk, progress=True) -> xr.Dataset:
    """Seed 000: "at n = 4096 the last 10% of the denominator's terms contribute 62% of the error".

    The flash emulator with every stage in fp32 (inputs in the dtype) except the running row sum
    (the softmax denominator), which is rounded to the dtype after the key blocks of a window
    (``DENOMINATOR_WINDOWS``): after every block, only after blocks holding the first 90% of the keys,
    or only after those holding the last 10%. ``denominator_tail_share`` = error(last 10%) /
    error(every block): the share of the denominator's error that its last 10% of terms make.
    """
    shape = (len(DENOMINATOR_WINDOWS), len(dtypes), len(seq_lens), len(seeds))
    err = np.full(shape, np.nan)
    cases = _rounded_row_cases(query_rows, seq_lens, seeds, dtypes, batch, heads, head_dim, device, golden_chunk,
                               "denominator", progress)
    for i, j, d, fmt, (q, k, v), gold in cases:
        n = seq_lens[i]
        pol = policy_for("all", "fp32").replace(name=f"fp32_inside_{fmt}", inputs=fmt)
        for w, window in enumerate(DENOMINATOR_WINDOWS):
            hooks = _row_sum_rounder(fmt, n, block_k, window)
            out = kernels.emulator(pol, block_q=block_q, block_k=block_k, fault=hooks).forward(q, k, v)[0]
            if hooks.block != hooks.n_blocks:
                raise RuntimeError(f"row-sum hook called {hooks.block} times for {hooks.n_blocks} key blocks")
            err[w, d, i, j] = error_summary(out, gold, fmt)["rel_l2"]
    coords = {"denominator_window": list(DENOMINATOR_WINDOWS), "denominator_dtype": list(dtypes),
              "denominator_seq_len": list(seq_lens), "denominator_seed": list(seeds)}
    ds = xr.Dataset({"denominator_rel_l2_err": (tuple(coords), err)}, coords=coords)
    ds["denominator_tail_share"] = ds["denominator_rel_l2_err"].sel(denominator_window="last_10pct", drop=True) \
        / ds["denominator_rel_l2_err"].sel(denominator_window="every_block", drop=True)
    ds["denominator_query_rows"] = query_rows
    return ds


# -- why the fp32 reference grows with N on the GPU: one stage at a time in fp64 --------------------

FP32_STAGES = ("score", "max", "exp", "sum", "normalize", "pv")
FP32_STAGE_VARIANTS = ("reference", "all_fp32") + tuple(f"fp64_{st}" for st in FP32_STAGES) + (
    "sum_split", "pv_split")
REDUCTION_SPLIT = 1024


def staged_fp32_attention(q, k, v, *, fp64_stage: str | None = None, split: str | None = None,
                          chunk: int = REDUCTION_SPLIT) -> torch.Tensor:
    """Unblocked fp32 attention (``reference_attention`` under the ``fp32`` policy, step by step) with
    one stage's arithmetic done in fp64 and its result rounded back to fp32 (``fp64_stage``, one of
    ``FP32_STAGES``), or one long reduction over the N keys split into ``chunk``-key partial results
    added in fp32 (``split``: ``"sum"`` or ``"pv"``). Without either it is the fp32 reference."""
    if fp64_stage not in (None,) + FP32_STAGES:
        raise ValueError(f"fp64_stage must be one of {FP32_STAGES}, got {fp64_stage!r}")
    if split not in (None, "sum", "pv"):
        raise ValueError(f"split must be 'sum' or 'pv', got {split!r}")
    f32, f64 = torch.float32, torch.float64

    def stage(name, fn, *args):
        if name == fp64_stage:
            return fn(*(a.to(f64) for a in args)).to(f32)
        return fn(*args)

    def split_sum(x, dim):  # fp32 partial sums of chunk keys each, then their fp32 sum
        parts = [x.narrow(dim, a, min(chunk, x.shape[dim] - a)).sum(dim=dim, keepdim=True)
                 for a in range(0, x.shape[dim], chunk)]
        return torch.cat(parts, dim=dim).sum(dim=dim, keepdim=True)

    q, k, v = (t.to(f32) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5
    s = stage("score", lambda a, b: (a @ b.transpose(-1, -2)) * scale, q, k)
    row_max = stage("max", lambda x: x.amax(dim=-1, keepdim=True), s)
    e = stage("exp", lambda x, m: torch.exp(x - m), s, row_max)
    if split == "sum":
        row_sum = split_sum(e, -1)
    else:
        row_sum = stage("sum", lambda x: x.sum(dim=-1, keepdim=True), e)
    p = stage("normalize", lambda x, l: x / l, e, row_sum)
    if split == "pv":
        parts = [p[..., a:a + chunk] @ v[..., a:a + chunk, :] for a in range(0, p.shape[-1], chunk)]
        return torch.stack(parts).sum(dim=0)
    return stage("pv", lambda a, b: a @ b, p, v)


def fp32_matmul_settings() -> str:
    """torch's float32 matmul settings now (TF32 would explain an fp32 error that grows on a GPU)."""
    cuda_tf32 = torch.backends.cuda.matmul.allow_tf32
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    return (f"float32_matmul_precision={torch.get_float32_matmul_precision()}; "
            f"cuda.matmul.allow_tf32={cuda_tf32}; cudnn.allow_tf32={cudnn_tf32}")


def fp32_reference_stages(seq_lens, seeds, *, query_rows, batch, heads, head_dim, device,
                          golden_chunk, progress=True) -> xr.Dataset:
    """Which reduction makes the fp32 unblocked reference's error grow with N (``FP32_STAGE_VARIANTS``)?

    fp32 inputs; ``query_rows`` query rows against all N keys, computed at once (give it the length
    sweep's ``reference_chunk`` to reproduce the shapes of that sweep's matmuls). Variants: the
    length sweep's reference kernel itself, its step-by-step copy (``staged_fp32_attention``), that
    copy with each stage in fp64 in turn, and with the row sum or the P V product split into
    fp32 partial results of ``REDUCTION_SPLIT`` keys. A stage whose fp64 version removes the growth
    is the one that causes it.
    """
    shape = (len(FP32_STAGE_VARIANTS), len(seq_lens), len(seeds))
    err = np.full(shape, np.nan)
    work = [(i, n, j, s) for i, n in enumerate(seq_lens) for j, s in enumerate(seeds)]
    for i, n, j, seed in tqdm(work, desc="fp32 reference stages", disable=not progress):
        q, k, v = (t.float() for t in _row_subset_inputs(query_rows, n, seed, batch, heads, head_dim, device))
        gold = kernels.get("golden", chunk=golden_chunk).forward(q, k, v)[0]
        for a, variant in enumerate(FP32_STAGE_VARIANTS):
            if variant == "reference":
                out = kernels.reference("fp32").forward(q, k, v)[0]
            elif variant == "all_fp32":
                out = staged_fp32_attention(q, k, v)
            elif variant.endswith("_split"):
                out = staged_fp32_attention(q, k, v, split=variant.removesuffix("_split"))
            else:
                out = staged_fp32_attention(q, k, v, fp64_stage=variant.removeprefix("fp64_"))
            err[a, i, j] = error_summary(out, gold, "fp32")["rel_l2"]
            del out
    coords = {"fp32_stage_variant": list(FP32_STAGE_VARIANTS), "fp32_stage_seq_len": list(seq_lens),
              "fp32_stage_seed": list(seeds)}
    ds = xr.Dataset({"fp32_stage_rel_l2_err": (tuple(coords), err)}, coords=coords)
    ds["fp32_stage_query_rows"] = query_rows
    ds["fp32_stage_matmul_precision"] = fp32_matmul_settings()
    return ds
