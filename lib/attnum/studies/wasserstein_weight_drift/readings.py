"""Readings of study 03's CPU tiers: numbers, booleans and tables from the results dataset (no English
sentences; the notebook's markdown states them through glued values)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import xarray as xr

from . import DRIFT_METRICS, GOLDEN_RATIO_RANGE, LOW_PRECISION_PAIRS, MATCHED

def call_table(ds: xr.Dataset, metric: str = "call_max_abs"):
    """Per flash pair and checkpoint: the attention calls' deviation (mean over layers, median over
    seeds) beside the pair's model-level weight drift (max |dw|, median over seeds), and the flash
    kernel's deviation from fp64 over the reference kernel's (median over seeds and layers)."""
    frames = {}
    for pair in ds["call_pair"].values:
        sub = ds.sel(call_pair=pair)
        cols = {f"{metric} (mean over layers)": sub[metric].mean("layer").median("seed").to_series()}
        if pair in ds["pair"].values:
            cols["weight max |dw|"] = ds["model_max_abs"].sel(pair=pair).median("seed").to_series()
            cols["weight rel. L2"] = ds["model_rel_l2"].sel(pair=pair).median("seed").to_series()
        ratio = (sub["call_flash_err"] / sub["call_reference_err"].where(sub["call_reference_err"] > 0))
        cols["flash / reference error vs fp64"] = ratio.median(["seed", "layer"]).to_series()
        frames[str(pair)] = pd.DataFrame(cols)
    return pd.concat(frames, names=["pair", "step"])


def call_statements(ds: xr.Dataset) -> list[str]:
    """Sentences computed from the per-call data: for each flash pair, the attention calls' max
    deviation between the kernels at the first and last checkpoint, whether it grows over training
    (median over seeds, mean over layers), the layer with the larger deviation at the end, and the
    flash kernel's error against fp64 relative to the reference kernel's (Golden et al.'s ~10x at bf16
    in an isolated forward pass)."""
    out, seen = [], {}
    for pair in ds["call_pair"].values:
        run = str(ds["call_run"].sel(call_pair=pair).values)
        if run in seen:
            out.append(f"`{pair}`: the same flash-trained run ({run}) as `{seen[run]}`, same numbers.")
            continue
        seen[run] = str(pair)
        sub = ds.sel(call_pair=pair)
        dev = sub["call_max_abs"].mean("layer").median("seed")
        rel = sub["call_rel_l2"].mean("layer").median("seed")
        first, last = float(dev.isel(step=0)), float(dev.isel(step=-1))
        grows = bool((dev.diff("step") >= 0).all())
        ratio = (sub["call_flash_err"] / sub["call_reference_err"].where(sub["call_reference_err"] > 0))
        r = ratio.median(["seed", "layer"])
        by_layer = sub["call_max_abs"].isel(step=-1).median("seed")
        text = (f"`{pair}` ({ds['call_run'].sel(call_pair=pair).item()}): per-call max |O_flash - O_ref| "
                f"{first:.2e} at step {int(dev['step'][0])} and {last:.2e} at step {int(dev['step'][-1])} (relative L2 "
                f"{float(rel.isel(step=0)):.2e} and {float(rel.isel(step=-1)):.2e}); "
                f"{'non-decreasing at every checkpoint' if grows else 'not monotone over the checkpoints'}; "
                f"largest at the last checkpoint in layer {int(np.argmax(by_layer.values))} "
                f"(layers: {', '.join(f'{v:.2e}' for v in by_layer.values)}); flash kernel's max error against "
                f"fp64 over the reference kernel's: {float(r.min()):.2g} to {float(r.max()):.2g} over checkpoints "
                f"(median over seeds and layers)")
        if pair in ds["pair"].values:
            w = ds["model_max_abs"].sel(pair=pair).median("seed")
            text += (f"; over the same checkpoints the weights' max |dw| went from {float(w.isel(step=0)):.2e} to "
                     f"{float(w.isel(step=-1)):.2e}")
        out.append(text + ".")
    return out


def first_step_above(ds: xr.Dataset, comparison: str, metric: str = "wasserstein", rule: str = "ci") -> float:
    """The first checkpoint step from which the numerator pair's drift stays above the denominator's
    at every later step. ``rule="ci"``: the interval's lower end is above 1; ``"all_seeds"``: every
    seed's ratio is above 1. NaN when it never does (at the last step at least)."""
    sub = ds.sel(comparison=comparison, metric=metric)
    if rule == "ci":
        above = (sub["drift_ratio_low"] > 1).values
    elif rule == "all_seeds":
        above = (sub["drift_ratio_per_seed"] > 1).all("seed").values
    else:
        raise ValueError(f"rule must be 'ci' or 'all_seeds', not {rule!r}")
    steps = sub["step"].values
    if not above[-1]:
        return math.nan
    below = np.nonzero(~above)[0]
    return float(steps[below[-1] + 1] if below.size else steps[0])


def checks(ds: xr.Dataset) -> dict:
    """Statements the text relies on, computed from the results (True/False, or a number)."""
    later = ds["step"].values > 0
    out = {}
    pairs = [str(p) for p in ds["pair"].values]
    if "repeat" in pairs:
        out["repeat pair exactly 0 at every step, seed and tensor"] = bool(
            all((ds[m].sel(pair="repeat") == 0).all() for m in DRIFT_METRICS))
    moving = [p for p in pairs if p != "repeat"]
    for metric in DRIFT_METRICS:
        d = ds[f"model_{metric}"].isel(step=later)
        if "init_seed" in pairs and len(moving) > 1:
            rest = d.sel(pair=[p for p in moving if p != "init_seed"])
            out[f"{metric}: init_seed largest at every checkpoint and seed"] = bool(
                (d.sel(pair="init_seed") > rest.max("pair")).all())
        if "flash_fp32" in pairs and len(moving) > 1:
            rest = d.sel(pair=[p for p in moving if p != "flash_fp32"]).median("seed")
            out[f"{metric}: flash_fp32 smallest at every checkpoint (median over seeds)"] = bool(
                (d.sel(pair="flash_fp32").median("seed") < rest.min("pair")).all())
        if "flash" in pairs and "init_seed" in pairs:
            out[f"{metric}: flash below init_seed at every checkpoint and seed"] = bool(
                (d.sel(pair="flash") < d.sel(pair="init_seed")).all())
        out[f"{metric}: every pair's drift grows at every checkpoint (median over seeds)"] = bool(
            (d.sel(pair=moving).median("seed").diff("step") >= 0).all())
    last = ds.isel(step=-1)
    for metric in ("rel_l2", "wasserstein_rel"):
        kinds = last[f"kind_{metric}"].median("seed").sel(pair=moving)
        out[f"{metric}: norms the least-drifting kind of every pair at the last checkpoint"] = bool(
            (kinds.argmin("kind") == list(kinds["kind"].values).index("norm")).all())
    for comp in ds["comparison"].values:
        if str(ds["comparison_denominator"].sel(comparison=comp).values) != "flash":
            continue
        r = ds["drift_ratio"].sel(comparison=comp)
        for metric in DRIFT_METRICS:
            vals = r.sel(metric=metric).values[later]
            out[f"{comp} ({metric}): smallest and largest geometric mean over checkpoints"] = (
                f"{np.nanmin(vals):.2f} .. {np.nanmax(vals):.2f}")
    return out


def verdict(low: float, high: float, claim=GOLDEN_RATIO_RANGE) -> str:
    """Where an interval [low, high] lies against a claimed range."""
    lo, hi = claim
    if not (np.isfinite(low) and np.isfinite(high)):
        return "undetermined (too few seeds for an interval)"
    if high < lo:
        return f"below the claimed {lo:g}-{hi:g}x"
    if low > hi:
        return f"above the claimed {lo:g}-{hi:g}x"
    if lo <= low and high <= hi:
        return f"inside the claimed {lo:g}-{hi:g}x"
    return f"overlaps the claimed {lo:g}-{hi:g}x"


# -- drift against the trainer's attention statistics ---------------------------------------------

def final_drift_table(ds: xr.Dataset, step: int | None = None):
    """Model-level drift of every pair at one checkpoint (default the last): median over seeds,
    and the smallest and largest seed."""
    step = int(ds["step"][-1]) if step is None else step
    cols = {}
    for metric in ("wasserstein", "wasserstein_rel", "max_abs", "rel_l2"):
        da = ds[f"model_{metric}"].sel(step=step)
        cols[(metric, "median")] = da.median("seed").values
        cols[(metric, "min")] = da.min("seed").values
        cols[(metric, "max")] = da.max("seed").values
    return pd.DataFrame(cols, index=pd.Index(ds["pair"].values, name=f"pair (step {step})"))


def ratio_table(ds: xr.Dataset, step: int | None = None, claim=GOLDEN_RATIO_RANGE):
    """Every drift ratio at one checkpoint: geometric mean over seeds, its interval, and where the
    interval lies against Golden et al.'s 2-5x (low-precision over flash comparisons only)."""
    step = int(ds["step"][-1]) if step is None else step
    rows = []
    for comp in ds["comparison"].values:
        for metric in ds["metric"].values:
            sel = dict(comparison=comp, metric=metric, step=step)
            low, high = float(ds["drift_ratio_low"].sel(**sel)), float(ds["drift_ratio_high"].sel(**sel))
            lowp = str(ds["comparison_numerator"].sel(comparison=comp).values) in LOW_PRECISION_PAIRS
            rows.append({"comparison": comp, "metric": metric, "ratio": float(ds["drift_ratio"].sel(**sel)),
                         "ci low": low, "ci high": high,
                         "against Golden et al.": verdict(low, high, claim) if lowp else ""})
    return pd.DataFrame(rows).set_index(["comparison", "metric"])


def floor_table(ds: xr.Dataset):
    """For every comparison of a flash pair with a baseline pair: from which checkpoint step on its
    drift stays above the baseline's (interval above 1; every seed above 1), per metric."""
    rows = []
    for comp in ds["comparison"].values:
        if str(ds["comparison_numerator"].sel(comparison=comp).values) in LOW_PRECISION_PAIRS:
            continue
        for metric in ds["metric"].values:
            last = dict(comparison=comp, metric=metric, step=ds["step"][-1])
            rows.append({"comparison": comp, "metric": metric,
                         "ratio at last step": float(ds["drift_ratio"].sel(**last)),
                         "above from step (interval)": first_step_above(ds, comp, metric, "ci"),
                         "above from step (every seed)": first_step_above(ds, comp, metric, "all_seeds")})
    return pd.DataFrame(rows).set_index(["comparison", "metric"])


def correlation_table(ds: xr.Dataset, metric: str = "rel_l2"):
    """Within-step and pooled Spearman correlations of per-layer drift with each statistic."""
    return pd.concat({"across layers, within (seed, step)": ds["corr_layer_rank"].sel(corr_metric=metric).to_pandas(),
                      "pooled over seeds, steps, layers": ds["corr_pooled"].sel(corr_metric=metric).to_pandas()},
                     axis=1)


# -- figures --------------------------------------------------------------------------------------


def group_table(ds: xr.Dataset, by: str = "kind", metric: str = "wasserstein_rel", step: int | None = None):
    """Drift per kind of tensor (or per layer) and pair at one checkpoint, median over seeds."""
    step = int(ds["step"][-1]) if step is None else step
    return ds[f"{by}_{metric}"].sel(step=step).median("seed").to_pandas()


def matched_table(ds: xr.Dataset, step: int | None = None):
    """Low-precision training over the flash pair: against the study's ``flash`` pair (kernels under
    ``kernel_policy``) and against the precision-matched flash pair (``MATCHED``), per metric at one
    checkpoint (default the last): geometric mean over seeds, interval, verdict against 2-5x."""
    table = ratio_table(ds, step)
    keep = [c for c in ds["comparison"].values
            if str(ds["comparison_numerator"].sel(comparison=c).values) in LOW_PRECISION_PAIRS
            and str(ds["comparison_denominator"].sel(comparison=c).values) in ("flash", "flash_bf16", "flash_fp16")]
    return table.loc[pd.IndexSlice[keep, :], :] if keep else table.iloc[:0]


def matched_statements(ds: xr.Dataset) -> list[str]:
    """For each low-precision training pair with its precision-matched flash pair present: the drift
    ratio over the matched pair beside the ratio over the ``flash`` pair, per metric, at the last
    checkpoint (geometric mean over seeds, interval) and its range over the later checkpoints."""
    out = []
    comps = [str(c) for c in ds["comparison"].values]
    later = ds["step"].values > 0
    flash_attn = ""
    if "flash" in ds["pair"].values:
        flash_attn = str(ds["run_attention"].sel(run=str(ds["pair_run_b"].sel(pair="flash").values)).values)
    for low, matched in MATCHED.items():
        new, old = f"{low}/{matched}", f"{low}/flash"
        if new not in comps:
            continue
        if old in comps and np.array_equal(ds["drift_ratio"].sel(comparison=new).values,
                                           ds["drift_ratio"].sel(comparison=old).values, equal_nan=True):
            old = new  # the matched flash pair is the `flash` pair itself (kernel_policy of that format)
            if f"{low}/flash" != new:
                out.append(f"`{low}`: `{matched}` is the `flash` pair itself here (same runs), so the matched "
                           f"ratio is the ratio over `flash` of section 3.")
                continue
        parts = []
        for metric in DRIFT_METRICS:
            def text(comp):
                r = ds.sel(comparison=comp, metric=metric)
                last = r.isel(step=-1)
                vals = r["drift_ratio"].values[later]
                return (f"{float(last['drift_ratio']):.2f} [{float(last['drift_ratio_low']):.2f}, "
                        f"{float(last['drift_ratio_high']):.2f}] at the last step, {np.nanmin(vals):.2f} to "
                        f"{np.nanmax(vals):.2f} over the checkpoints")
            piece = f"{metric}: over `{matched}` {text(new)}"
            if old in comps and old != new:
                piece += f"; over `flash` ({flash_attn}) {text(old)}"
            parts.append(piece)
        out.append(f"`{low}`: " + "; ".join(parts) + ".")
    return out


def conclusion_lines(ds: xr.Dataset) -> list[str]:
    """Short computed lines for the conclusions: the low-precision / flash ratio over the matched and
    the `flash` pair at the last step (geometric means over seeds) per metric, and for each distinct
    flash-trained run the per-call deviation at the first and last checkpoint beside the weights'
    max |dw| at the last."""
    out = []
    comps = [str(c) for c in ds["comparison"].values]
    for low, matched in MATCHED.items():
        new, old = f"{low}/{matched}", f"{low}/flash"
        if new not in comps:
            continue
        last = ds["drift_ratio"].sel(comparison=new).isel(step=-1)
        text = f"`{new}` at the last step: " + ", ".join(
            f"{m} {float(last.sel(metric=m)):.2f}" for m in DRIFT_METRICS)
        if old in comps and not np.array_equal(ds["drift_ratio"].sel(comparison=new).values,
                                               ds["drift_ratio"].sel(comparison=old).values, equal_nan=True):
            prev = ds["drift_ratio"].sel(comparison=old).isel(step=-1)
            text += " (over `flash`: " + ", ".join(f"{m} {float(prev.sel(metric=m)):.2f}" for m in DRIFT_METRICS) + ")"
        out.append(text + ".")
    if "call_max_abs" in ds:
        seen = set()
        for pair in ds["call_pair"].values:
            run = str(ds["call_run"].sel(call_pair=pair).values)
            if run in seen:
                continue
            seen.add(run)
            dev = ds["call_max_abs"].sel(call_pair=pair).mean("layer").median("seed")
            text = (f"`{pair}`: per-call max |O_flash - O_ref| {float(dev.isel(step=0)):.1e} (step "
                    f"{int(dev['step'][0])}) and {float(dev.isel(step=-1)):.1e} (step {int(dev['step'][-1])})")
            if pair in ds["pair"].values:
                w = ds["model_max_abs"].sel(pair=pair).median("seed").isel(step=-1)
                text += f"; weights' max |dw| at the last step {float(w):.1e}"
            out.append(text + ".")
    return out


def precision_contrast(ds: xr.Dataset, base: str = "flash") -> list[str]:
    """How the weight drift follows the per-call deviation across the flash pairs: for every other
    flash pair with a different run, the ratio of ``base``'s per-call relative L2 deviation to its
    (median over seeds, layers and checkpoints) beside the ratio of their model-level weight drift at
    the last checkpoint (median over seeds), per drift metric."""
    if "call_rel_l2" not in ds or base not in ds["call_pair"].values:
        return []
    out = []
    base_run = str(ds["call_run"].sel(call_pair=base).values)
    dev = ds["call_rel_l2"].median(["seed", "layer", "step"])
    for pair in ds["call_pair"].values:
        if str(ds["call_run"].sel(call_pair=pair).values) == base_run or pair not in ds["pair"].values:
            continue
        ratio = float(dev.sel(call_pair=base) / dev.sel(call_pair=pair))
        drifts = ", ".join(
            f"{m} {float(ds[f'model_{m}'].sel(pair=base).isel(step=-1).median('seed') / ds[f'model_{m}'].sel(pair=pair).isel(step=-1).median('seed')):.2g}x"
            for m in DRIFT_METRICS)
        out.append(f"`{base}` over `{pair}`: per-call deviation (relative L2) {ratio:.3g}x; weight drift at the "
                   f"last checkpoint {drifts}.")
    return out




# -- values for the notebook's prose (glued; no sentences) -----------------------------------------

def noise_floor_exceedances(ds: xr.Dataset, metric: str) -> pd.DataFrame:
    """Every (pair, seed, step > 0) at which a pair other than ``repeat`` and ``init_seed`` drifts at least as
    far as the noise floor (``init_seed``) of the same seed, by model-level ``metric``."""
    cols = ["pair", "seed", "step", "drift", "noise floor"]
    if "init_seed" not in ds["pair"].values:
        return pd.DataFrame(columns=cols)
    d = ds[f"model_{metric}"].isel(step=ds["step"].values > 0)
    floor = d.sel(pair="init_seed")
    rows = []
    for pair in (p for p in map(str, ds["pair"].values) if p not in ("repeat", "init_seed")):
        above = (d.sel(pair=pair) >= floor).transpose("seed", "step")
        for i, j in zip(*np.nonzero(above.values)):
            seed, step = int(above["seed"][i]), int(above["step"][j])
            rows.append([pair, seed, step, float(d.sel(pair=pair, seed=seed, step=step)),
                         float(floor.sel(seed=seed, step=step))])
    return pd.DataFrame(rows, columns=cols)


def ratio_extremes(ds: xr.Dataset, comparison: str, metric: str) -> dict:
    """Smallest and largest geometric mean over seeds of a drift ratio over the checkpoints > 0, and the
    step of the largest (NaN when the comparison is absent)."""
    if comparison not in ds["comparison"].values:
        return {"min": math.nan, "max": math.nan, "max_step": math.nan}
    r = ds["drift_ratio"].sel(comparison=comparison, metric=metric).isel(step=ds["step"].values > 0)
    vals = r.values
    if not np.isfinite(vals).any():
        return {"min": math.nan, "max": math.nan, "max_step": math.nan}
    return {"min": float(np.nanmin(vals)), "max": float(np.nanmax(vals)),
            "max_step": int(r["step"].values[int(np.nanargmax(vals))])}


def prose_values(ds: xr.Dataset | None) -> dict:
    """The numbers and verdicts the CPU sections' markdown states (unprefixed keys; NaN on a run without
    the CPU tiers' drift): whether the noise floor is the largest drift at every checkpoint and seed per
    metric, how many (pair, seed, step) exceed it and where; the range of the low-precision/flash ratios
    over the checkpoints, per metric, over ``flash`` and over the precision-matched flash pair."""
    out = {}
    cpu = ds is not None and "drift_ratio" in ds
    for metric in DRIFT_METRICS:
        ex = noise_floor_exceedances(ds, metric) if cpu else pd.DataFrame(columns=["pair", "seed", "step"])
        out[f"floor_largest_{metric}"] = ("yes" if ex.empty else "no") if cpu else math.nan
        out[f"floor_exceeded_n_{metric}"] = len(ex) if cpu else math.nan
        out[f"floor_exceeded_pairs_{metric}"] = ", ".join(sorted(set(ex["pair"]))) if len(ex) else "none"
        out[f"floor_exceeded_seeds_{metric}"] = ", ".join(map(str, sorted(set(ex["seed"])))) if len(ex) else "none"
        out[f"floor_exceeded_first_{metric}"] = int(ex["step"].min()) if len(ex) else math.nan
        out[f"floor_exceeded_last_{metric}"] = int(ex["step"].max()) if len(ex) else math.nan
        for comp in ("fp16_training/flash", "bf16_training/flash", "fp16_training/flash_fp16",
                     "bf16_training/flash_fp32", "fp16_training/flash_fp32"):
            key = comp.replace("/", "_over_")
            ext = ratio_extremes(ds, comp, metric) if cpu else {"min": math.nan, "max": math.nan, "max_step": math.nan}
            out[f"{key}_{metric}_min"], out[f"{key}_{metric}_max"] = ext["min"], ext["max"]
            out[f"{key}_{metric}_max_step"] = ext["max_step"]
    for base in ("init_seed", "init_perturbation"):
        comp = f"flash/{base}"
        here = cpu and comp in ds["comparison"].values
        r = ds["drift_ratio"].sel(comparison=comp) if here else None
        first = [float(r.sel(metric=m).isel(step=1)) for m in DRIFT_METRICS] if here and ds.sizes["step"] > 1 else []
        last = [float(r.sel(metric=m).isel(step=-1)) for m in DRIFT_METRICS] if here else []
        out[f"flash_over_{base}_max"] = float(np.nanmax(r.isel(step=ds["step"].values > 0).values)) if here else math.nan
        out[f"flash_over_{base}_first_min"] = min(first) if first else math.nan
        out[f"flash_over_{base}_first_max"] = max(first) if first else math.nan
        out[f"flash_over_{base}_last_min"] = min(last) if last else math.nan
        out[f"flash_over_{base}_last_max"] = max(last) if last else math.nan
    for comp in ("fp16_training/flash", "fp16_training/flash_fp16"):
        key = comp.replace("/", "_over_")
        maxima = np.array([out[f"{key}_{m}_max"] for m in DRIFT_METRICS], dtype=float)
        out[f"{key}_max"] = float(np.nanmax(maxima)) if np.isfinite(maxima).any() else math.nan
    return out
