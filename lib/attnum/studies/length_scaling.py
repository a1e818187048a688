"""Study 01: how attention-kernel error grows with sequence length.

Every measurement compares a kernel's output with the fp64 golden value
computed on the *same* rounded inputs, so input rounding is not counted as
kernel error. Kernels: ``reference`` (unblocked attention, rounded per the
policy) and ``flash`` (the tiled online-softmax emulator). Policies: the
``all_<dtype>`` family rounds every intermediate (Golden et al.'s
microbenchmark), the ``fa2_<dtype>`` family is what production kernels do.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr
from ..progress import tqdm

if TYPE_CHECKING:  # the tables' type in annotations only; pandas is imported where they are built
    import pandas as pd

from .. import acceptance
from ..inputs import normal_qkv
from .. import kernels
from ..metrics import GROWTH_MODELS, STRATA, error_summary, fit_growth, mean_rel_error, row_rel_l2, strata_bounds
from ..precision import FORMATS, min_normal, policy_for, round_to

KERNELS = ("reference", "flash")
FAMILIES = ("all", "fa2")
ERROR_METRICS = ("max_abs", "mean_abs", "rel_l2", "max_rel", "max_ulp")
SELF_CHECK_MAX_LEN = 2048  # the golden self-check (two chunkings) costs a second golden run

VARIABLES = {
    "real_rel_l2_err": ("1", "relative L2 error of a real kernel's output against the fp64 golden value"),
    "real_max_abs_err": ("1", "max |real kernel output - fp64 golden value|"),
    "real_emulator_rel_l2_err": ("1", "relative L2 error of the emulator configuration on the same inputs"),
    "real_bitwise_equal": ("1", "fraction of output elements bitwise equal between the real kernel and the emulator configuration"),
    "real_error_corr": ("1", "correlation of the real kernel's and the emulator configuration's deviations from the golden value rounded to the dtype"),
    "real_passes": ("1", "1 if the acceptance rule accepts the real kernel's output"),
    "real_status": ("1", "ok, or why the real kernel gave no output here (unavailable, refused, out of memory)"),
    "real_causal": ("1", "1: causal mask (bottom-right aligned), 0: none"),
    "tile_q": ("1", "query block (Br) of the tile configuration"),
    "tile_k": ("1", "key block (Bc) of the tile configuration"),
    "max_abs_err": ("1", "max |O - O_golden| over all elements"),
    "mean_abs_err": ("1", "mean |O - O_golden|"),
    "rel_l2_err": ("1", "relative L2 error ||O - O_golden|| / ||O_golden||"),
    "max_rel_err": ("1", "max elementwise relative error |O - O_golden| / |O_golden|"),
    "max_ulp_err": ("ulp", "max error in units in the last place of the output format"),
    "input_abs_max": ("1", "max |q|, |k|, |v| of the rounded inputs"),
    "dtype_floor": ("1", "FA test-suite floor 2 max|(g + 0.3 - 0.3) - g| in the output format"),
    "dynamic_threshold": ("1", "seed 000 dynamic threshold on the relative error"),
    "passes": ("1", "1 if the rule accepts the kernel output, else 0"),
    "pass_rate": ("1", "fraction of seeds whose output the rule accepts"),
    "flash_fp64_max_abs_err": ("1", "max |O_flash(fp64 policy) - O_golden| on the fp32 inputs"),
    "golden_self_max_abs_err": ("1", "max |golden(chunk a) - golden(chunk b)| on the fp32 inputs (N <= 2048)"),
    "flash_to_reference_ratio": ("1", "flash error / reference error (max abs), same policy"),
    "fit_intercept": ("1", "intercept of the growth fit of median error"),
    "fit_slope": ("1", "slope of the growth fit of median error"),
    "fit_r2": ("1", "coefficient of determination of the growth fit"),
    "block_max_abs_err": ("1", "max |O - O_golden| of the flash emulator at a block configuration"),
    "block_rel_l2_err": ("1", "relative L2 error of the flash emulator at a block configuration"),
    "strata_rel_l2_err": ("1", "mean per-row relative L2 error within a position stratum (causal)"),
    "strata_max_abs_err": ("1", "max |O - O_golden| within a position stratum (causal)"),
    "row_profile_rel_l2_err": ("1", "mean per-row relative L2 error in bins of query position (causal)"),
    "block_seq_len": ("1", "sequence length of the block-size experiment"),
    "attribution_rel_l2_err": ("1", "relative L2 error under a rounding variant (all stages low, one promoted, one alone)"),
    "p_below_min_normal_frac": ("1", "fraction of softmax probabilities below the format's smallest normal"),
    "attribution_query_rows": ("1", "query rows evaluated per input set in the attribution experiment"),
    "causal_seq_len": ("1", "sequence length of the causal position-stratified experiment"),
    "mean_rel_err": ("1", "seed 000's metric: mean elementwise |O - O_golden| / |O_golden| (zeros of the golden value skipped)"),
    "fp32_inside_rel_l2_err": ("1", "relative L2 error of unblocked attention with fp32 inside (inputs and output in the dtype; PyTorch's math backend)"),
    "fp32_inside_max_abs_err": ("1", "max |O - O_golden| of unblocked attention with fp32 inside"),
    "nomask_strata_rel_l2_err": ("1", "mean per-row relative L2 error within a position stratum, no mask"),
    "nomask_strata_max_abs_err": ("1", "max |O - O_golden| within a position stratum, no mask"),
    "nomask_row_profile_rel_l2_err": ("1", "mean per-row relative L2 error in bins of query position, no mask"),
    "nomask_seq_len": ("1", "sequence length of the unmasked position-stratified experiment"),
    "mac_rel_l2_err": ("1", "relative L2 error of the flash emulator with the score product accumulated term by term (fma or two roundings)"),
    "mac_query_rows": ("1", "query rows evaluated per input set in the multiply-add experiment"),
    "denominator_rel_l2_err": ("1", "relative L2 error of the flash emulator (fp32 inside) with the running row sum rounded to the dtype in a window of key blocks"),
    "denominator_tail_share": ("1", "error with the row sum rounded only in the last 10% of key blocks / error with it rounded in every block"),
    "denominator_query_rows": ("1", "query rows evaluated per input set in the denominator experiment"),
    "fp32_stage_rel_l2_err": ("1", "relative L2 error of the fp32 unblocked reference with one stage computed in fp64 (or the reductions split)"),
    "fp32_stage_query_rows": ("1", "query rows evaluated per input set in the fp32-reference stage experiment"),
    "fp32_stage_matmul_precision": ("1", "torch's float32 matmul settings when the fp32-reference stage experiment ran"),
}


def _inputs(fmt, seq_len, seed, batch, heads, head_dim, device):
    """Inputs rounded to ``fmt`` (what the kernel reads) and their fp64 golden output."""
    q, k, v = (round_to(t, fmt) for t in normal_qkv(batch, heads, seq_len, head_dim, seed=seed, device=device))
    return q, k, v


def length_sweep(seq_lens, dtypes, seeds, *, batch=1, heads=2, head_dim=64, block_q=128, block_k=128,
                 families=FAMILIES, device="cpu", golden_chunk=1024, reference_chunk=0,
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
    out["flash_to_reference_ratio"] = ds["max_abs_err"].sel(kernel="flash") / ds["max_abs_err"].sel(kernel="reference")
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
(bf16/fp16) elements. Golden et al. ran on A100s (papers.md section 3); the source gives M as "SRAM
size" without a value, so this choice is ours."""


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


def block_sweep(seq_len, block_configs, loop_orders, dtypes, seeds, *, batch=1, heads=2, head_dim=64,
                families=FAMILIES, device="cpu", golden_chunk=1024, progress=True) -> xr.Dataset:
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


def causal_strata(seq_len, dtypes, seeds, *, batch=1, heads=2, head_dim=64, block_q=128, block_k=128,
                  families=FAMILIES, profile_bins=32, device="cpu", golden_chunk=1024, reference_chunk=0,
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
                    "flash": kernels.emulator(pol, block_q=block_q, block_k=block_k).forward(q, k, v, causal=causal)[0]}
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


def stage_attribution(seq_lens, dtypes, seeds, *, query_rows=64, batch=1, heads=1, head_dim=64, block_q=128,
                      block_k=128, device="cpu", golden_chunk=1024, progress=True) -> xr.Dataset:
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
                        "flash": kernels.emulator(pol, block_q=block_q, block_k=block_k).forward(q, k, v)[0]}
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


def mac_sweep(seq_lens, dtypes, seeds, *, query_rows=64, batch=1, heads=1, head_dim=64, block_q=128,
              block_k=128, families=FAMILIES, device="cpu", golden_chunk=1024, progress=True) -> xr.Dataset:
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
    from ..kernels.flash import KernelHooks

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


def denominator_tail(seq_lens, dtypes, seeds, *, query_rows=64, batch=1, heads=1, head_dim=64, block_q=128,
                     block_k=128, device="cpu", golden_chunk=1024, progress=True) -> xr.Dataset:
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


def fp32_reference_stages(seq_lens, seeds, *, query_rows=64, batch=1, heads=1, head_dim=64, device="cpu",
                          golden_chunk=1024, progress=True) -> xr.Dataset:
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


LONG_SEQUENCE_MIN = 16384


def load_reference_run(name: str = "gpu") -> xr.Dataset | None:
    """The committed run ``outputs/length_scaling/<name>/results.nc`` of this checkout, if present."""
    from ..ncio import open_results
    from ..paths import project_root

    path = project_root() / "outputs" / "length_scaling" / name / "results.nc"
    return open_results(path) if path.exists() else None


def committed_real_kernel_runs() -> list[xr.Dataset]:
    """The committed CUDA runs of this checkout (``outputs/length_scaling/gpu*``) that measured real
    kernels, shortest lengths first: what a CPU run shows of the kernels it cannot run."""
    from ..ncio import open_results
    from ..paths import project_root

    runs = []
    for path in sorted((project_root() / "outputs" / "length_scaling").glob("gpu*/results.nc")):
        ds = open_results(path)
        if "real_rel_l2_err" in ds and "cuda" in ds.attrs.get("device", ""):
            ds.attrs["run"] = path.parent.name
            runs.append(ds)
    return sorted(runs, key=lambda ds: int(ds["real_seq_len"].min()))


def long_sequence_table(ds: xr.Dataset, min_len: int = 8192):
    """Median relative L2 error and flash/reference max-abs ratio for N >= ``min_len``."""
    import pandas as pd

    sel = ds.sel(seq_len=[n for n in ds["seq_len"].values if n >= min_len])
    err = sel["rel_l2_err"].median("seed").to_dataframe()["rel_l2_err"].unstack("seq_len")
    ratio = sel["flash_to_reference_ratio"].median("seed").to_dataframe()["flash_to_reference_ratio"]
    ratio = ratio.unstack("seq_len")
    ratio.index = pd.MultiIndex.from_tuples([("flash/reference", p, d) for p, d in ratio.index],
                                            names=err.index.names)
    return pd.concat({"rel_l2_err": err, "max_abs_ratio": ratio})


# -- figures --------------------------------------------------------------------------------


# -- real kernels beside the emulator (issue: "and my kernel?") ------------------------------------

REAL_ERRORS = ("rel_l2", "max_abs")


def fidelity_configs(block_ks) -> list[tuple[int, bool]]:
    """The emulator configurations a real kernel is compared with: FA2 loop, each key block,
    subtract-then-scale or FA3's fused scale-max (the policy is ``fa2_<dtype>``)."""
    return [(int(bk), fused) for bk in block_ks for fused in (False, True)]


def fidelity_label(block_k: int, fused: bool) -> str:
    return f"bk{block_k}" + (":fused" if fused else "")


def real_kernel_sweep(kernel_names, seq_lens, dtypes, head_dims, causal_modes, seeds, *, block_ks=(64, 128),
                      batch=1, heads=2, device="cpu", golden_chunk=1024, reference_chunk=4096,
                      progress=True) -> xr.Dataset:
    """Real kernels of the registry on the inputs the emulator gets, against the fp64 golden value.

    Per kernel, dtype, head dim, mask, N and seed: the relative L2 and max error of the output; the
    verdict of every acceptance rule (``acceptance.judge``, the same-precision reference being
    unblocked attention with every stage in the dtype); and the **fidelity** of each emulator
    configuration (``fidelity_configs``, policy ``fa2_<dtype>``): the fraction of output elements
    bitwise equal to the kernel's, and the correlation of the two kernels' deviations from the
    golden value rounded to the dtype (subtracting the output rounding both share). A kernel that
    cannot run here, refuses the inputs or runs out of memory is recorded with the reason (``status``),
    never replaced by another.
    """
    configs = fidelity_configs(block_ks)
    kernels_ = [kernels.get(name) for name in kernel_names]
    base = (len(dtypes), len(head_dims), len(causal_modes), len(seq_lens), len(seeds))
    err = {m: np.full((len(kernels_),) + base, np.nan) for m in REAL_ERRORS}
    emu_err = np.full((len(configs),) + base, np.nan)
    bitwise = np.full((len(kernels_), len(configs)) + base, np.nan)
    corr = np.full((len(kernels_), len(configs)) + base, np.nan)
    passes = np.full((len(acceptance.RULES), len(kernels_)) + base, np.nan)
    status = np.full((len(kernels_),) + base[:-1], "ok", dtype=object)
    work = [(a, fmt, b, d, c, causal, i, n, j, seed) for a, fmt in enumerate(dtypes) for b, d in enumerate(head_dims)
            for c, causal in enumerate(causal_modes) for i, n in enumerate(seq_lens) for j, seed in enumerate(seeds)]
    for a, fmt, b, d, c, causal, i, n, j, seed in tqdm(work, desc="real kernels", disable=not progress):
        q, k, v = _inputs(fmt, n, seed, batch, heads, d, device)
        gold = kernels.get("golden", chunk=golden_chunk).forward(q, k, v, causal=causal)[0]
        gold_rounded = round_to(gold.float(), fmt).double()
        ref = kernels.reference(policy_for("all", fmt), query_chunk=reference_chunk or None)
        reference_max_abs = error_summary(ref.forward(q, k, v, causal=causal)[0], gold, fmt)["max_abs"]
        floor = acceptance.dtype_floor(gold, fmt)
        x_max = max(t.abs().max().item() for t in (q, k, v))
        emulated = []
        for e, (bk, fused) in enumerate(configs):
            out_e = kernels.emulator(policy_for("fa2", fmt), block_q=128, block_k=bk, fused_scale_max=fused).forward(
                q, k, v, causal=causal)[0]
            emu_err[e, a, b, c, i, j] = error_summary(out_e, gold, fmt)["rel_l2"]
            emulated.append(out_e)
        low = FORMATS[fmt]
        for kk, kernel in enumerate(kernels_):
            reason = kernel.unavailable_reason(device)
            if reason:
                status[kk, a, b, c, i] = f"unavailable: {reason}"
                continue
            try:
                out = kernel.forward(q.to(low), k.to(low), v.to(low), causal=causal)[0]
            except torch.OutOfMemoryError as exc:
                torch.cuda.empty_cache()
                status[kk, a, b, c, i] = f"out of memory: {str(exc).splitlines()[0][:200]}"
                continue
            except (RuntimeError, ValueError) as exc:  # a backend that refuses these inputs, recorded
                status[kk, a, b, c, i] = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                continue
            out = out.float()
            summary = error_summary(out, gold, fmt)
            for m in REAL_ERRORS:
                err[m][kk, a, b, c, i, j] = summary[m]
            verdict = acceptance.judge(rel_l2=summary["rel_l2"], max_abs=summary["max_abs"], n=n, x_max=x_max,
                                       fmt=fmt, reference_max_abs=reference_max_abs, floor=floor)
            passes[:, kk, a, b, c, i, j] = [verdict[rule] for rule in acceptance.RULES]
            dev_k = (out.double() - gold_rounded).flatten()
            for e, out_e in enumerate(emulated):
                bitwise[kk, e, a, b, c, i, j] = (out == out_e).double().mean().item()
                dev_e = (out_e.double() - gold_rounded).flatten()
                corr[kk, e, a, b, c, i, j] = _correlation(dev_k, dev_e)
            del out
    dims = ("real_dtype", "real_head_dim", "real_causal", "real_seq_len", "real_seed")
    coords = {"real_kernel": [k.name for k in kernels_], "fidelity_config": [fidelity_label(*c) for c in configs],
              "real_dtype": list(dtypes), "real_head_dim": list(head_dims),
              "real_causal": [int(bool(x)) for x in causal_modes], "real_seq_len": list(seq_lens),
              "real_seed": list(seeds), "rule": list(acceptance.RULES)}
    ds = xr.Dataset({f"real_{m}_err": (("real_kernel",) + dims, err[m]) for m in REAL_ERRORS}, coords=coords)
    ds["real_emulator_rel_l2_err"] = (("fidelity_config",) + dims, emu_err)
    ds["real_bitwise_equal"] = (("real_kernel", "fidelity_config") + dims, bitwise)
    ds["real_error_corr"] = (("real_kernel", "fidelity_config") + dims, corr)
    ds["real_passes"] = (("rule", "real_kernel") + dims, passes)
    ds["real_status"] = (("real_kernel",) + dims[:-1], status.astype(str))
    return ds


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two deviations (NaN when either is constant or not finite)."""
    ok = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[ok] - a[ok].mean(), b[ok] - b[ok].mean()
    den = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    return (a @ b / den).item() if den > 0 else float("nan")


def best_fidelity(ds: xr.Dataset) -> "pd.DataFrame":
    """Per real kernel (dtype, head dim, mask): the emulator configuration with the highest mean
    bitwise-equal fraction over N and seeds, with that fraction and the mean error correlation."""
    import pandas as pd

    rows = []
    mean_bits = ds["real_bitwise_equal"].mean(["real_seq_len", "real_seed"])
    mean_corr = ds["real_error_corr"].mean(["real_seq_len", "real_seed"])
    for kernel in ds["real_kernel"].values:
        for fmt in ds["real_dtype"].values:
            for d in ds["real_head_dim"].values:
                for causal in ds["real_causal"].values:
                    sel = dict(real_kernel=kernel, real_dtype=fmt, real_head_dim=d, real_causal=causal)
                    bits = mean_bits.sel(sel)
                    if not np.isfinite(bits.values).any():
                        continue
                    best = str(bits.idxmax("fidelity_config").values)
                    rows.append({"kernel": kernel, "dtype": fmt, "head_dim": int(d), "causal": bool(causal),
                                 "best emulator config": best,
                                 "bitwise equal": float(bits.sel(fidelity_config=best)),
                                 "error corr": float(mean_corr.sel(sel).sel(fidelity_config=best))})
    return pd.DataFrame(rows)


# -- what the notebook states, computed from a results dataset ---------------------------------------
# Each function returns a table and/or sentences built from the numbers of the dataset it is given
# (this run's, or a committed GPU run's); a variable the dataset lacks gives a sentence saying so.

SEED000_MEAN_REL = {512: 0.0005, 1024: 0.0012, 2048: 0.0035, 4096: 0.012}
"""Seed 000's mean relative output errors of its MI210 port by N (papers.md section 1)."""
SEED000_TAIL_SHARE = 0.62
"""Seed 000: at n = 4096 the last 10% of the denominator's terms contribute 62% of the total error."""


def missing(ds: xr.Dataset | None, *names: str) -> str | None:
    """None when ``ds`` has every variable of ``names``; otherwise a sentence naming what is missing."""
    if ds is None:
        return "no dataset (the run is not present in this checkout)"
    lacking = [n for n in names if n not in ds]
    if lacking:
        run = ds.attrs.get("run") or ds.attrs.get("git_commit", "")[:12] or "this run"
        return f"the run {run} has no {', '.join(lacking)} (it predates the measurement); nothing to report here"
    return None


def growth_table(ds: xr.Dataset, metric: str = "rel_l2") -> "pd.DataFrame":
    """Per kernel, policy and dtype: median error at the shortest and longest N, their ratio, whether
    the medians rise monotonically, and the power-law exponent and R^2 of each growth model."""
    import pandas as pd

    med = ds[f"{metric}_err"].median("seed")
    n = ds["seq_len"].values
    rows = []
    for kernel in ds["kernel"].values:
        for pol in ds["policy"].values:
            for fmt in ds["dtype"].values:
                y = med.sel(kernel=kernel, policy=pol, dtype=fmt).values
                row = {"kernel": kernel, "policy": f"{pol}_{fmt}", f"err N={n[0]}": y[0], f"err N={n[-1]}": y[-1],
                       "last/first": y[-1] / y[0], "monotone rise": bool(np.all(np.diff(y) > 0))}
                if "fit_slope" in ds:
                    fit = ds.sel(error_metric=metric, kernel=kernel, policy=pol, dtype=fmt)
                    row["power-law exponent"] = float(fit["fit_slope"].sel(growth_model="power_law"))
                    for model in ds["growth_model"].values:
                        row[f"R2 {model}"] = float(fit["fit_r2"].sel(growth_model=model))
                rows.append(row)
    return pd.DataFrame(rows).set_index(["kernel", "policy"])


def growth_sentences(ds: xr.Dataset) -> list[str]:
    """The fit discussion's claims, each with its numbers (issue 10 items 2 and 3)."""
    t = growth_table(ds)
    n0, n1 = int(ds["seq_len"].values[0]), int(ds["seq_len"].values[-1])
    out = []
    for key in (("flash", "all_bf16"), ("flash", "all_fp16")):
        if key in t.index:
            r = t.loc[key]
            out.append(f"{key[0]} `{key[1]}`: error x{r['last/first']:.3g} from N = {n0} to {n1}, power-law "
                       f"exponent {r['power-law exponent']:.2f} (R² {r['R2 power_law']:.2f}; √N fit R² "
                       f"{r['R2 sqrt_n']:.2f}, log2 N fit R² {r['R2 log2_n']:.2f})")
    for fmt in ds["dtype"].values:
        key = ("flash", f"fa2_{fmt}")
        if key in t.index:
            r = t.loc[key]
            out.append(f"flash `fa2_{fmt}`: error x{r['last/first']:.3g} from N = {n0} to {n1} "
                       f"({'rising at every step' if r['monotone rise'] else 'not monotone'}; log2 N fit R² "
                       f"{r['R2 log2_n']:.2f})")
    key = ("reference", "all_fp32")
    if key in t.index:
        r = t.loc[key]
        out.append(f"reference fp32: error x{r['last/first']:.3g} from N = {n0} to {n1}, power-law exponent "
                   f"{r['power-law exponent']:.2f} (R² {r['R2 power_law']:.2f})")
    return out


def attribution_table(ds: xr.Dataset, dtype: str = "bf16", kernel: str = "flash") -> "pd.DataFrame":
    """Issue 10 item 1: per N, the all-low error, the error of the statistics alone and of the output
    accumulator alone, and the share of the all-low error that promoting the statistics removes."""
    import pandas as pd

    a = ds["attribution_rel_l2_err"].median("attribution_seed").sel(kernel=kernel, attribution_dtype=dtype)
    df = pd.DataFrame({v: a.sel(variant=v).values for v in ("all_low", "only_stats", "only_out_acc", "promote_stats",
                                                            "promote_out_acc")},
                      index=pd.Index(a["attribution_seq_len"].values, name="N"))
    df["only_stats / only_out_acc"] = df["only_stats"] / df["only_out_acc"]
    df["removed by promote_stats"] = 1 - df["promote_stats"] / df["all_low"]
    df["removed by promote_out_acc"] = 1 - df["promote_out_acc"] / df["all_low"]
    # the growth since the shortest N (NaN there): the share of it that each promotion removes
    for stage in ("stats", "out_acc"):
        growth = df["all_low"] - df["all_low"].iloc[0]
        kept = df[f"promote_{stage}"] - df[f"promote_{stage}"].iloc[0]
        df[f"growth removed by promote_{stage}"] = (1 - kept / growth).where(growth.index != growth.index[0])
    return df


def attribution_sentence(ds: xr.Dataset, dtype: str = "bf16") -> str:
    df = attribution_table(ds, dtype)
    n0 = df.index[0]
    parts = [f"N = {n}: statistics alone {r['only_stats']:.2e}, output accumulator alone {r['only_out_acc']:.2e} "
             f"(ratio {r['only_stats / only_out_acc']:.2g}); promoting the statistics removes "
             f"{r['removed by promote_stats']:.0%} of the all-{dtype} error"
             + ("" if n == n0 else f" and {r['growth removed by promote_stats']:.0%} of its growth since N = {n0}")
             + f", promoting the accumulator {r['removed by promote_out_acc']:.0%}"
             + ("" if n == n0 else f" and {r['growth removed by promote_out_acc']:.0%}")
             for n, r in df.iterrows()]
    dominant = [n for n, r in df.iterrows() if r["only_stats / only_out_acc"] >= 2]
    tail = (f"The statistics dominate (at least twice the accumulator's error) from N = {dominant[0]} on "
            f"in this run." if dominant else "The statistics never reach twice the accumulator's error in this run.")
    return "; ".join(parts) + ". " + tail


def reference_comparison(ds: xr.Dataset, family: str = "fa2") -> "pd.DataFrame | str":
    """Issue 10 item 4: flash against both references, median relative L2 error over seeds: our
    reference (P rounded to the dtype, policy ``<family>_<dtype>``) and fp32 inside (the math backend)."""
    import pandas as pd

    note = missing(ds, "fp32_inside_rel_l2_err")
    if note:
        return note
    med = ds["rel_l2_err"].median("seed").sel(policy=family)
    inside = ds["fp32_inside_rel_l2_err"].median("seed")
    rows = []
    for fmt in ds["dtype"].values:
        for n in ds["seq_len"].values:
            fl, ref, ins = (float(x.sel(dtype=fmt, seq_len=n)) for x in (med.sel(kernel="flash"),
                                                                        med.sel(kernel="reference"), inside))
            rows.append({"dtype": fmt, "N": int(n), "flash": fl, f"reference ({family}, P rounded)": ref,
                         "reference (fp32 inside)": ins, "flash / reference": fl / ref, "flash / fp32 inside": fl / ins})
    return pd.DataFrame(rows).set_index(["dtype", "N"])


def false_alarm_rate(ds: xr.Dataset, rule: str = "reference_relative", kernel: str = "flash", policy: str = "all",
                     dtype: str = "bf16", min_len: int = LONG_SEQUENCE_MIN) -> tuple[float, int]:
    """Issue 10 item 6: the share of (N >= ``min_len``, seed) outputs the rule rejects, and how many."""
    p = ds["passes"].sel(rule=rule, kernel=kernel, policy=policy, dtype=dtype)
    p = p.sel(seq_len=[n for n in ds["seq_len"].values if n >= min_len])
    return float(1 - p.astype(float).mean()), int(p.size)


def seed000_metric_table(ds: xr.Dataset, kernel: str = "flash") -> "pd.DataFrame | str":
    """Item 10 (study 01 part): seed 000's metric (mean elementwise relative error) beside ours
    (relative L2), median over seeds, for each policy; seed 000's own numbers where it gives them."""
    import pandas as pd

    note = missing(ds, "mean_rel_err")
    if note:
        return note
    rows = []
    for pol in ds["policy"].values:
        for fmt in ds["dtype"].values:
            sel = dict(kernel=kernel, policy=pol, dtype=fmt)
            for n in ds["seq_len"].values:
                rows.append({"policy": f"{pol}_{fmt}", "N": int(n),
                             "mean rel. error (seed 000's metric)": float(ds["mean_rel_err"].sel(**sel, seq_len=n).median()),
                             "relative L2 (ours)": float(ds["rel_l2_err"].sel(**sel, seq_len=n).median()),
                             "seed 000, MI210 port": SEED000_MEAN_REL.get(int(n), np.nan)})
    return pd.DataFrame(rows).set_index(["policy", "N"])


def strata_table(ds: xr.Dataset, prefix: str = "") -> "pd.DataFrame | str":
    """Median over seeds of the per-stratum mean row error; ``prefix="nomask_"``: without a mask.
    Adds last/first, the ratio seed 000 describes (largest error in the last 10%)."""
    var = f"{prefix}strata_rel_l2_err"
    note = missing(ds, var)
    if note:
        return note
    t = ds[var].median("seed").to_dataframe()[var].unstack("stratum")[list(STRATA)]
    t["last / first"] = t["last_10pct"] / t["first_10pct"]
    t["last / middle"] = t["last_10pct"] / t["middle_80pct"]
    return t


def denominator_sentence(ds: xr.Dataset, n: int = 4096) -> str:
    note = missing(ds, "denominator_tail_share")
    if note:
        return note
    share = ds["denominator_tail_share"].median("denominator_seed")
    parts = []
    for fmt in share["denominator_dtype"].values:
        vals = ", ".join(f"N = {int(m)}: {float(share.sel(denominator_dtype=fmt, denominator_seq_len=m)):.0%}"
                         for m in share["denominator_seq_len"].values)
        parts.append(f"{fmt}: {vals}")
    at = (f" (N = {n} is {'' if n in share['denominator_seq_len'].values else 'not '}among the lengths measured)")
    return ("error with the row sum rounded only over the last 10% of the keys, as a share of the error with it "
            "rounded after every key block — " + "; ".join(parts) + at
            + ". Seed 000: 62% at n = 4096 (its MI210 port, its own error decomposition).")


def mac_table(ds: xr.Dataset) -> "pd.DataFrame | str":
    """Seed 000's two-rounding multiply-add: relative L2 error per mode and N, and two_rounding / fma."""
    note = missing(ds, "mac_rel_l2_err")
    if note:
        return note
    med = ds["mac_rel_l2_err"].median("mac_seed")
    t = med.to_dataframe()["mac_rel_l2_err"].unstack("mac")[list(MAC_MODES)]
    t["two_rounding / fma"] = t["two_rounding"] / t["fma"]
    return t


def fp32_stage_table(ds: xr.Dataset) -> "pd.DataFrame | str":
    """Item 7: median error of each fp32-reference variant by N, and its growth (longest / shortest N)."""
    note = missing(ds, "fp32_stage_rel_l2_err")
    if note:
        return note
    t = ds["fp32_stage_rel_l2_err"].median("fp32_stage_seed").to_pandas()
    t["longest / shortest N"] = t.iloc[:, -1] / t.iloc[:, 0]
    return t


def fp32_stage_sentence(ds: xr.Dataset) -> str:
    t = fp32_stage_table(ds)
    if isinstance(t, str):
        return t
    g = t["longest / shortest N"]
    n0, n1 = int(ds["fp32_stage_seq_len"].values[0]), int(ds["fp32_stage_seq_len"].values[-1])
    flattest = g.drop(["reference", "all_fp32"]).idxmin()
    return (f"on {ds.attrs.get('device', 'this device')} ({str(ds['fp32_stage_matmul_precision'].values)}), "
            f"from N = {n0} to {n1} the fp32 reference's error grows x{g['reference']:.2f} "
            f"(its step-by-step copy x{g['all_fp32']:.2f}); with one stage in fp64: "
            + ", ".join(f"{v.removeprefix('fp64_')} x{g[v]:.2f}" for v in g.index if v.startswith("fp64_"))
            + f"; with the reductions split in {REDUCTION_SPLIT}-key parts: row sum x{g['sum_split']:.2f}, "
            f"P V x{g['pv_split']:.2f}. The variant that grows least: {flattest}.")


def real_kernel_sentences(run: xr.Dataset) -> list[str]:
    """Per real kernel of a run: its best emulator configuration's bitwise-equal share and error
    correlation (ranges over dtype, head dim, mask), its error range by dtype, and what it could not run."""
    out = []
    best = best_fidelity(run)
    err = run["real_rel_l2_err"]
    for kernel in run["real_kernel"].values:
        b = best[best["kernel"] == kernel]
        status = run["real_status"].sel(real_kernel=kernel)
        bad = status.where(status != "ok", drop=True) if (status != "ok").any() else None
        if b.empty:
            out.append(f"`{kernel}`: no output on this device ({np.unique(status.values)[0][:120]})")
            continue
        words = [f"`{kernel}`: best emulator configuration {', '.join(sorted(set(b['best emulator config'])))}; "
                 f"bitwise equal {b['bitwise equal'].min():.1%}-{b['bitwise equal'].max():.1%}, deviation "
                 f"correlation {b['error corr'].min():.2f}-{b['error corr'].max():.2f}"]
        for fmt in run["real_dtype"].values:
            e = err.sel(real_kernel=kernel, real_dtype=fmt)
            if np.isfinite(e.values).any():
                words.append(f"{fmt} error {float(e.min()):.2g}-{float(e.max()):.2g}")
        if bad is not None:
            kinds = sorted({str(x).split(":")[0] for x in status.values.flatten() if x != "ok"})
            lens = sorted({int(n) for n in status["real_seq_len"].values
                           if (status.sel(real_seq_len=n) != "ok").any()})
            words.append(f"no output ({', '.join(kinds)}) at N = {', '.join(map(str, lens))}")
        out.append("; ".join(words))
    return out


def real_false_alarms(run: xr.Dataset, min_len: int = LONG_SEQUENCE_MIN) -> "pd.DataFrame":
    """False-alarm rate of each rule on each real kernel over the outputs at N >= ``min_len``, with
    the number of outputs it is taken over (kernels that gave none there are left out)."""
    import pandas as pd

    p = run["real_passes"].sel(real_seq_len=[n for n in run["real_seq_len"].values if n >= min_len])
    rows = []
    for kernel in run["real_kernel"].values:
        for rule in run["rule"].values:
            v = p.sel(real_kernel=kernel, rule=rule).values
            v = v[np.isfinite(v)]
            if v.size:
                rows.append({"kernel": kernel, "rule": rule, "false alarms": 1 - v.mean(), "outputs": v.size})
    if not rows:
        return pd.DataFrame(columns=["false alarms", "outputs"])
    return pd.DataFrame(rows).set_index(["kernel", "rule"])


def golden_tile_sentence(ds: xr.Dataset) -> str:
    """The block experiment's Golden et al. tile against the 128x128 tile, where both were measured."""
    if "golden" not in ds["block_config"].values:
        return "the block experiment of this run has no 'golden' configuration"
    import json

    g = ds.sel(block_config="golden")
    head_dim = json.loads(ds.attrs.get("parameters", "{}")).get("head_dim", "?")
    words = [f"Golden et al.'s tile for d = {head_dim}: "
             f"{int(g['tile_q'])}x{int(g['tile_k'])} (block_q x block_k)"]
    if "128x128" in ds["block_config"].values:
        ratio = (ds["block_rel_l2_err"].sel(block_config="golden") / ds["block_rel_l2_err"].sel(block_config="128x128"))
        ratio = ratio.median("block_seed").sel(loop_order=ds["loop_order"].values[0])
        words.append("its error / the 128x128 tile's (" + str(ds["loop_order"].values[0]) + "): " + ", ".join(
            f"{p}_{f} {float(ratio.sel(policy=p, block_dtype=f)):.2f}"
            for p in ratio["policy"].values for f in ratio["block_dtype"].values))
    return "; ".join(words)


def seed000_growth_sentences(ds: xr.Dataset, kernel: str = "flash", lo: int = 512, hi: int = 4096) -> list[str]:
    """Seed 000's metric from N = ``lo`` to ``hi`` per policy (its own numbers grow x24 there)."""
    note = missing(ds, "mean_rel_err")
    if note:
        return [note]
    if not {lo, hi} <= set(int(n) for n in ds["seq_len"].values):
        return [f"this run does not have both N = {lo} and N = {hi}"]
    med = ds["mean_rel_err"].median("seed").sel(kernel=kernel)
    out = []
    for pol in ds["policy"].values:
        for fmt in ds["dtype"].values:
            a, b = (float(med.sel(policy=pol, dtype=fmt, seq_len=n)) for n in (lo, hi))
            out.append(f"{kernel} `{pol}_{fmt}`: mean relative error {100 * a:.3g}% at N = {lo}, {100 * b:.3g}% at N = {hi} (x{b / a:.2f})")
    s0 = SEED000_MEAN_REL
    out.append(f"seed 000 (its MI210 port against the CUDA kernel): {s0[lo]:.2%} at N = {lo}, {s0[hi]:.2%} at N = {hi} "
               f"(x{s0[hi] / s0[lo]:.0f})")
    return out


def mac_growth_sentences(ds: xr.Dataset) -> list[str]:
    """Per policy and dtype: two-rounding / fused error ratio range, and each mode's growth over N."""
    t = mac_table(ds)
    if isinstance(t, str):
        return [t]
    out = []
    for (pol, fmt), sub in t.groupby(level=["policy", "mac_dtype"]):
        growth = {m: sub[m].iloc[-1] / sub[m].iloc[0] for m in MAC_MODES}
        out.append(f"`{pol}_{fmt}`: two roundings / fused {sub['two_rounding / fma'].min():.3g}-"
                   f"{sub['two_rounding / fma'].max():.3g}; growth from the shortest to the longest N: "
                   + ", ".join(f"{m} x{g:.2f}" for m, g in growth.items()))
    return out


# -- item 7 and the real kernels, stated from a run's data (review of the committed H200 run) --------

FP32_STAGE_PLACES = {"score": "the score product Q Kᵀ", "max": "the row max", "exp": "the exponential",
                     "sum": "the row sum over the N keys", "normalize": "the normalisation",
                     "pv": "the P·V product (a reduction over the N keys)"}
REMOVED_GROWTH = 0.75
"""A variant 'removes' the fp32 reference's growth when it removes at least this share of it."""


def fp32_stage_cause_sentence(ds: xr.Dataset) -> str:
    """Item 7 in words: which variants remove at least ``REMOVED_GROWTH`` of the fp32 reference's growth
    from the shortest to the longest N, and what that says; beside the growth a single running fp32 sum
    over the N keys would have (√ of the length ratio) and a sum of fixed-size fp32 parts (about none)."""
    t = fp32_stage_table(ds)
    if isinstance(t, str):
        return t
    g = t["longest / shortest N"]
    n0, n1 = int(ds["fp32_stage_seq_len"].values[0]), int(ds["fp32_stage_seq_len"].values[-1])
    device = ds.attrs.get("device", "this device")
    growth = g["reference"] - 1
    if not growth > 0.2:
        return (f"on {device} the fp32 reference's error grows only x{g['reference']:.2f} from N = {n0} to {n1}: "
                "there is no growth to attribute on this device")
    removed = {v: 1 - (g[v] - 1) / growth for v in g.index if v not in ("reference", "all_fp32")}
    causes = [v for v, r in removed.items() if r >= REMOVED_GROWTH]
    if not causes:
        return (f"on {device} no single stage in fp64 and no split reduction removes {REMOVED_GROWTH:.0%} of the fp32 "
                f"reference's growth (x{g['reference']:.2f} from N = {n0} to {n1}): the growth is not in one stage")
    stages = sorted({v.removeprefix("fp64_").removesuffix("_split") for v in causes})
    words = ", ".join(f"`{v}` (x{g[v]:.2f}, {removed[v]:.0%} of the growth removed)" for v in causes)
    others = [g[v] for v in removed if v not in causes]
    rest = f"; every other variant grows x{min(others):.2f}-{max(others):.2f}" if others else ""
    return (f"on {device} the fp32 reference's error grows x{g['reference']:.2f} from N = {n0} to {n1}; the variants "
            f"that remove at least {REMOVED_GROWTH:.0%} of that growth: {words}{rest}. The growth is in "
            f"{' and '.join(FP32_STAGE_PLACES[s] for s in stages)}. For "
            f"comparison, one running fp32 sum over all N keys has a relative error that grows like √N "
            f"(x{math.sqrt(n1 / n0):.1f} over this range); a sum of fp32 parts of fixed length "
            f"({REDUCTION_SPLIT} keys here) one that does not grow.")


def fidelity_by_length(run: xr.Dataset) -> "pd.DataFrame":
    """Per real kernel, dtype and N: the bitwise-equal share and deviation correlation of each case's best
    emulator configuration (``best_fidelity``, per dtype, head dim and mask), averaged over head dims,
    masks and seeds. Does the emulator reproduce the kernel equally well at every length?"""
    import pandas as pd

    best = best_fidelity(run)
    rows = []
    for _, b in best.iterrows():
        sel = dict(real_kernel=b["kernel"], real_dtype=b["dtype"], real_head_dim=b["head_dim"],
                   real_causal=int(b["causal"]), fidelity_config=b["best emulator config"])
        bits = run["real_bitwise_equal"].sel(sel).mean("real_seed")
        corr = run["real_error_corr"].sel(sel).mean("real_seed")
        for n in run["real_seq_len"].values:
            rows.append({"kernel": b["kernel"], "dtype": b["dtype"], "N": int(n),
                         "bitwise equal": float(bits.sel(real_seq_len=n)), "error corr": float(corr.sel(real_seq_len=n))})
    if not rows:
        return pd.DataFrame(columns=["bitwise equal", "error corr"])
    return pd.DataFrame(rows).groupby(["kernel", "dtype", "N"], sort=False).mean()


def fidelity_length_sentences(run: xr.Dataset) -> list[str]:
    """Per real kernel: the best configuration's bitwise share and correlation at the shortest and the longest
    N where the kernel gave an output, per dtype."""
    t = fidelity_by_length(run)
    out = []
    for kernel in dict.fromkeys(t.index.get_level_values("kernel")):
        parts = []
        for fmt in dict.fromkeys(t.loc[kernel].index.get_level_values("dtype")):
            sub = t.loc[(kernel, fmt)].dropna(subset=["bitwise equal"])
            if sub.empty:
                continue
            lo, hi = sub.iloc[0], sub.iloc[-1]
            parts.append(f"{fmt}: bitwise equal {lo['bitwise equal']:.1%} at N = {sub.index[0]}, "
                         f"{hi['bitwise equal']:.1%} at N = {sub.index[-1]} (correlation {lo['error corr']:.2f} → "
                         f"{hi['error corr']:.2f})")
        if parts:
            out.append(f"`{kernel}` with its best configuration — " + "; ".join(parts))
    return out


def real_growth_sentences(run: xr.Dataset, causal: int = 0) -> list[str]:
    """Per real kernel and dtype (``causal``: 0 no mask, 1 causal): its median error's factor from the
    shortest to the longest N where it gave an output (range over head dims), beside the emulator's factor
    under ``fa2_<dtype>`` (its configurations' range) over the same lengths."""
    err = run["real_rel_l2_err"].sel(real_causal=causal).median("real_seed")
    emu = run["real_emulator_rel_l2_err"].sel(real_causal=causal).median("real_seed")
    out = []
    for kernel in run["real_kernel"].values:
        parts = []
        for fmt in run["real_dtype"].values:
            e = err.sel(real_kernel=kernel, real_dtype=fmt)
            ok = [n for n in run["real_seq_len"].values if np.isfinite(e.sel(real_seq_len=n).values).all()]
            if len(ok) < 2:
                continue
            f = (e.sel(real_seq_len=ok[-1]) / e.sel(real_seq_len=ok[0])).values
            fe = (emu.sel(real_dtype=fmt, real_seq_len=ok[-1]) / emu.sel(real_dtype=fmt, real_seq_len=ok[0])).values
            parts.append(f"{fmt} x{np.min(f):.2f}-{np.max(f):.2f} from N = {ok[0]} to {ok[-1]} (emulator "
                         f"`fa2_{fmt}` x{np.min(fe):.2f}-{np.max(fe):.2f})")
        if parts:
            out.append(f"`{kernel}`, {'causal' if causal else 'no mask'}: " + "; ".join(parts))
    return out


def math_backend_sentence(run: xr.Dataset, kernel: str = "sdpa:math") -> str:
    """Is the math backend the fp32-inside reference? Its median error (no mask) over that of the emulated
    fp32-inside reference of the length sweep at the same N, dtype and head dim (other inputs: a ratio near
    1 says the same arithmetic, not the same bits)."""
    if kernel not in run["real_kernel"].values:
        return f"this run did not measure `{kernel}`"
    note = missing(run, "fp32_inside_rel_l2_err")
    if note:
        return note
    import json

    head_dim = json.loads(run.attrs.get("parameters", "{}")).get("head_dim")
    if head_dim not in run["real_head_dim"].values:
        return f"the length sweep's head dim ({head_dim}) is not among the real kernels' head dims"
    real = run["real_rel_l2_err"].sel(real_kernel=kernel, real_causal=0, real_head_dim=head_dim).median("real_seed")
    inside = run["fp32_inside_rel_l2_err"].median("seed")
    ratios = []
    for fmt in real["real_dtype"].values:
        if fmt not in inside["dtype"].values:
            continue
        for n in real["real_seq_len"].values:
            r = float(real.sel(real_dtype=fmt, real_seq_len=n))
            if np.isfinite(r) and n in inside["seq_len"].values:
                ratios.append(r / float(inside.sel(dtype=fmt, seq_len=n)))
    if not ratios:
        return f"no N and dtype where both `{kernel}` and the fp32-inside reference were measured"
    return (f"`{kernel}`'s error / the emulated fp32-inside reference's (same N, dtype and d = {head_dim}, no mask): "
            f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} cases")


def real_false_alarm_sentences(run: xr.Dataset, min_len: int = LONG_SEQUENCE_MIN) -> list[str]:
    """Per acceptance rule: its false-alarm rate on each real kernel at N >= ``min_len`` (and over how many
    outputs), and the rate per dtype where the dtypes differ."""
    t = real_false_alarms(run, min_len)
    if not len(t):
        return [f"no real-kernel output at N >= {min_len}"]
    out = []
    p = run["real_passes"].sel(real_seq_len=[n for n in run["real_seq_len"].values if n >= min_len])
    for rule in dict.fromkeys(t.index.get_level_values("rule")):
        sub = t.xs(rule, level="rule")
        words = ", ".join(f"`{k}` {r['false alarms']:.0%} of {int(r['outputs'])}" for k, r in sub.iterrows())
        by_fmt = []
        for fmt in run["real_dtype"].values:
            v = p.sel(rule=rule, real_dtype=fmt).values
            v = v[np.isfinite(v)]
            if v.size:
                by_fmt.append(f"{fmt} {1 - v.mean():.0%}")
        out.append(f"{rule}: {words} (all kernels by dtype: {', '.join(by_fmt)})")
    return out
