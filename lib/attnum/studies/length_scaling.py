"""Study 01: how attention-kernel error grows with sequence length.

Every measurement compares a kernel's output with the fp64 golden value
computed on the *same* rounded inputs, so input rounding is not counted as
kernel error. Kernels: ``reference`` (unblocked attention, rounded per the
policy) and ``flash`` (the tiled online-softmax emulator). Policies: the
``all_<dtype>`` family rounds every intermediate (Golden et al.'s
microbenchmark), the ``fa2_<dtype>`` family is what production kernels do.
"""
from __future__ import annotations

import numpy as np
import torch
import xarray as xr
from ..progress import tqdm

from .. import acceptance
from ..inputs import normal_qkv
from .. import kernels
from ..metrics import GROWTH_MODELS, STRATA, error_summary, fit_growth, row_rel_l2, strata_bounds
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
            cache: dict = {}

            def run_kernel(kernel, pol):
                key = (kernel, pol.formats())
                if key not in cache:
                    kern = (kernels.reference(pol, query_chunk=reference_chunk or None) if kernel == "reference"
                            else kernels.emulator(pol, block_q=block_q, block_k=block_k))
                    cache[key] = kern.forward(q, k, v)[0]
                return cache[key]

            # same-precision reference of the FA/PyTorch test suites: plain attention, all in fmt
            pt_err = error_summary(run_kernel("reference", policy_for("all", fmt)), gold, fmt)["max_abs"]
            for f, family in enumerate(families):
                pol = policy_for(family, fmt)
                for kk, kernel in enumerate(KERNELS):
                    summary = error_summary(run_kernel(kernel, pol), gold, fmt)
                    for m in ERROR_METRICS:
                        err[m][kk, f, d, i, j] = summary[m]
                    verdict = acceptance.judge(rel_l2=summary["rel_l2"], max_abs=summary["max_abs"], n=n,
                                               x_max=xmax[d, i, j], fmt=fmt, reference_max_abs=pt_err,
                                               floor=floors[d, i, j])
                    passes[:, kk, f, d, i, j] = [verdict[rule] for rule in acceptance.RULES]
            del cache
    dims = ("kernel", "policy", "dtype", "seq_len", "seed")
    coords = {"kernel": list(KERNELS), "policy": list(families), "dtype": list(dtypes),
              "seq_len": list(seq_lens), "seed": list(seeds), "rule": list(acceptance.RULES)}
    ds = xr.Dataset({f"{m}_err": (dims, err[m]) for m in ERROR_METRICS}, coords=coords)
    ds["passes"] = (("rule",) + dims, passes)
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


def block_sweep(seq_len, block_configs, loop_orders, dtypes, seeds, *, batch=1, heads=2, head_dim=64,
                families=FAMILIES, device="cpu", golden_chunk=1024, progress=True) -> xr.Dataset:
    """Flash-emulator error over block shapes and loop orders at one length (Golden et al. Fig 6)."""
    parsed = [tuple(int(x) for x in cfg.split("x")) for cfg in block_configs]
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
                  progress=True) -> xr.Dataset:
    """Causal attention: error by query position (first 10% / middle 80% / last 10%, seed 000)."""
    shape = (len(KERNELS), len(families), len(dtypes), len(seeds))
    strata_rel = np.full(shape[:3] + (len(STRATA),) + shape[3:], np.nan)
    strata_max = np.full_like(strata_rel, np.nan)
    profile = np.full(shape[:3] + (profile_bins,) + shape[3:], np.nan)
    bounds = strata_bounds(seq_len)
    edges = np.linspace(0, seq_len, profile_bins + 1).astype(int)
    work = [(d, fmt, s, seed) for d, fmt in enumerate(dtypes) for s, seed in enumerate(seeds)]
    for d, fmt, s, seed in tqdm(work, desc="causal", disable=not progress):
        q, k, v = _inputs(fmt, seq_len, seed, batch, heads, head_dim, device)
        gold = kernels.get("golden", chunk=golden_chunk).forward(q, k, v, causal=True)[0]
        for f, family in enumerate(families):
            pol = policy_for(family, fmt)
            outs = {"reference": kernels.reference(pol, query_chunk=reference_chunk or None).forward(q, k, v, causal=True)[0],
                    "flash": kernels.emulator(pol, block_q=block_q, block_k=block_k).forward(q, k, v, causal=True)[0]}
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
