"""Readings of study 03's CPU tiers: numbers, booleans and tables from the results dataset (no English
sentences; the notebook's markdown states them through glued values)."""
from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
import xarray as xr

from ...glue import MISSING
from . import DRIFT_METRICS, GOLDEN_FLASH_OVER_BASELINE, GOLDEN_RATIO_RANGE, LOW_PRECISION_PAIRS, MATCHED

def _or_empty(fn):
    """A table function that returns an empty table for a run without the CPU tiers' drift (``ds`` None),
    so that the notebook's cells run alike on every tier."""
    @functools.wraps(fn)
    def wrapped(ds, *args, **kwargs):
        if ds is None:
            return pd.DataFrame()
        return fn(ds, *args, **kwargs)
    return wrapped


@_or_empty
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


def call_summary(ds: xr.Dataset) -> pd.DataFrame:
    """Per flash pair (rows): the flash-trained run it reads (``call_run``) and the first pair with that run
    (``same_run_as``); the attention calls' max |O_flash - O_ref| and relative L2 at the first and last
    checkpoint (mean over layers, median over seeds); whether the max deviation is non-decreasing over the
    checkpoints; the layer with the largest deviation at the last checkpoint; the smallest and largest over
    checkpoints of the flash kernel's max error against fp64 over the reference kernel's (median over seeds
    and layers; Golden et al.'s ~10x at bf16 in an isolated forward pass); and the pair's weights' max |dw|
    at the first and last checkpoint (median over seeds; NaN where the pair's drift was not measured)."""
    cols = ["run", "same_run_as", "max_abs_first", "max_abs_last", "rel_l2_first", "rel_l2_last", "non_decreasing",
            "largest_layer", "err_ratio_min", "err_ratio_max", "weight_max_abs_first", "weight_max_abs_last"]
    if ds is None or "call_max_abs" not in ds:
        return pd.DataFrame(columns=cols).rename_axis("call_pair")
    rows, seen = {}, {}
    for pair in map(str, ds["call_pair"].values):
        run = str(ds["call_run"].sel(call_pair=pair).values)
        seen.setdefault(run, pair)
        sub = ds.sel(call_pair=pair)
        dev = sub["call_max_abs"].mean("layer").median("seed")
        rel = sub["call_rel_l2"].mean("layer").median("seed")
        r = (sub["call_flash_err"] / sub["call_reference_err"].where(sub["call_reference_err"] > 0)).median(["seed", "layer"])
        by_layer = sub["call_max_abs"].isel(step=-1).median("seed")
        w = ds["model_max_abs"].sel(pair=pair).median("seed") if pair in ds["pair"].values else None
        rows[pair] = [run, seen[run], float(dev.isel(step=0)), float(dev.isel(step=-1)), float(rel.isel(step=0)),
                      float(rel.isel(step=-1)), bool((dev.diff("step") >= 0).all()), int(np.argmax(by_layer.values)),
                      float(r.min()), float(r.max()), float(w.isel(step=0)) if w is not None else math.nan,
                      float(w.isel(step=-1)) if w is not None else math.nan]
    return pd.DataFrame.from_dict(rows, orient="index", columns=cols).rename_axis("call_pair")


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


def checks(ds: xr.Dataset | None) -> dict:
    """Statements the text relies on, computed from the results (True/False, or a number); empty for a
    run without the CPU tiers' drift."""
    if ds is None:
        return {}
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
            out[f"{comp} ({metric}): smallest geometric mean over checkpoints"] = float(np.nanmin(vals))
            out[f"{comp} ({metric}): largest geometric mean over checkpoints"] = float(np.nanmax(vals))
    return out


def verdict(low: float, high: float, claim=GOLDEN_RATIO_RANGE) -> str:
    """Where an interval [low, high] lies against a claimed range: "below", "above", "inside", "overlaps",
    or ``glue.MISSING`` when there is no interval (too few seeds)."""
    lo, hi = claim
    if not (np.isfinite(low) and np.isfinite(high)):
        return MISSING
    if high < lo:
        return "below"
    if low > hi:
        return "above"
    if lo <= low and high <= hi:
        return "inside"
    return "overlaps"


def place(value: float, claim=GOLDEN_RATIO_RANGE) -> str:
    """Where one value lies against a claimed range: "below", "inside", "above" (``glue.MISSING``: NaN)."""
    if not np.isfinite(value):
        return MISSING
    return "below" if value < claim[0] else "above" if value > claim[1] else "inside"


# -- drift against the trainer's attention statistics ---------------------------------------------

@_or_empty
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


@_or_empty
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


@_or_empty
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


@_or_empty
def correlation_table(ds: xr.Dataset, metric: str = "rel_l2"):
    """Within-step and pooled Spearman correlations of per-layer drift with each statistic."""
    return pd.concat({"across layers, within (seed, step)": ds["corr_layer_rank"].sel(corr_metric=metric).to_pandas(),
                      "pooled over seeds, steps, layers": ds["corr_pooled"].sel(corr_metric=metric).to_pandas()},
                     axis=1)


# -- figures --------------------------------------------------------------------------------------


@_or_empty
def group_table(ds: xr.Dataset, by: str = "kind", metric: str = "wasserstein_rel", step: int | None = None,
                position: int | None = None):
    """Drift per kind of tensor (or per layer) and pair at one checkpoint (``step``, or the checkpoint at
    ``position`` in the run's steps; default the last), median over seeds; the step is the columns' name."""
    step = int(ds["step"][-1 if position is None else position]) if step is None else step
    table = ds[f"{by}_{metric}"].sel(step=step).median("seed").to_pandas()
    table.columns.name = f"{by} (step {step})"
    return table


@_or_empty
def rate_table(ds: xr.Dataset, metric: str = "wasserstein"):
    """Rate of change of model-level drift per step since the previous checkpoint, median over seeds."""
    return ds[f"model_{metric}_rate"].median("seed").to_pandas()


@_or_empty
def final_loss_table(ds: xr.Dataset, records: int = 5):
    """Training loss over the last ``records`` records, per run (rows) and seed (columns)."""
    return ds["train_loss"].isel(train_step=slice(-records, None)).mean("train_step").to_pandas()


@_or_empty
def lowp_ratio_table(ds: xr.Dataset):
    """Every low-precision training pair over the ``flash`` pair (rows: comparison and metric) at every
    checkpoint (columns), geometric mean over seeds."""
    keep = [c for c in ds["comparison"].values if str(ds["comparison_denominator"].sel(comparison=c).values) == "flash"
            and str(ds["comparison_numerator"].sel(comparison=c).values) in LOW_PRECISION_PAIRS]
    return ds["drift_ratio"].sel(comparison=keep).to_dataframe()["drift_ratio"].unstack("step")


def run_size(ds: xr.Dataset | None, params: dict) -> dict:
    """The trained run's size from its parameters (NaN / ``n/a`` for a run that trained nothing): layers,
    width, steps, tokens per run (steps x batch x context), the perturbation of the chaos baseline and the
    flash pair's kernel policy."""
    trained = ds is not None and "model_wasserstein" in ds
    values = {"n_layer": params["n_layer"], "d_model": params["d_model"], "steps": params["steps"],
              "tokens_per_run": params["steps"] * params["batch_size"] * params["context"],
              "perturbation": params["perturbation"], "kernel_policy": params["kernel_policy"]}
    return {k: (v if trained else (MISSING if isinstance(v, str) else math.nan)) for k, v in values.items()}


@_or_empty
def matched_table(ds: xr.Dataset, step: int | None = None):
    """Low-precision training over the flash pair: against the study's ``flash`` pair (kernels under
    ``kernel_policy``) and against the precision-matched flash pair (``MATCHED``), per metric at one
    checkpoint (default the last): geometric mean over seeds, interval, verdict against 2-5x."""
    table = ratio_table(ds, step)
    keep = [c for c in ds["comparison"].values
            if str(ds["comparison_numerator"].sel(comparison=c).values) in LOW_PRECISION_PAIRS
            and str(ds["comparison_denominator"].sel(comparison=c).values) in ("flash", "flash_bf16", "flash_fp16")]
    return table.loc[pd.IndexSlice[keep, :], :] if keep else table.iloc[:0]


def matched_ranges(ds: xr.Dataset) -> pd.DataFrame:
    """For each low-precision training pair over its precision-matched flash pair (``MATCHED``) and over the
    ``flash`` pair, per metric: the ratio at the last checkpoint with its interval (geometric mean over
    seeds), its smallest and largest value over the checkpoints after step 0, and whether the matched pair
    is the ``flash`` pair itself (the same runs: the ratios equal bit for bit)."""
    cols = ["ratio_last", "ci_low_last", "ci_high_last", "min", "max", "matched_is_flash"]
    rows = {}
    if ds is None or "drift_ratio" not in ds:
        return pd.DataFrame(columns=cols, index=pd.MultiIndex.from_tuples([], names=["comparison", "metric"]))
    comps = [str(c) for c in ds["comparison"].values]
    later = ds["step"].values > 0
    for low, matched in MATCHED.items():
        new, old = f"{low}/{matched}", f"{low}/flash"
        if new not in comps:
            continue
        same = old in comps and np.array_equal(ds["drift_ratio"].sel(comparison=new).values,
                                               ds["drift_ratio"].sel(comparison=old).values, equal_nan=True)
        for comp in dict.fromkeys(c for c in (new, old) if c in comps):
            for metric in DRIFT_METRICS:
                r = ds.sel(comparison=comp, metric=metric)
                last = r.isel(step=-1)
                vals = r["drift_ratio"].values[later]
                ok = np.isfinite(vals).any()
                rows[(comp, metric)] = [float(last["drift_ratio"]), float(last["drift_ratio_low"]),
                                        float(last["drift_ratio_high"]), float(np.nanmin(vals)) if ok else math.nan,
                                        float(np.nanmax(vals)) if ok else math.nan, bool(same)]
    index = pd.MultiIndex.from_tuples(list(rows), names=["comparison", "metric"])
    return pd.DataFrame(list(rows.values()), index=index, columns=cols)


def precision_contrast(ds: xr.Dataset, base: str = "flash") -> pd.DataFrame:
    """How the weight drift follows the per-call deviation across the flash pairs: for every other flash
    pair with a different flash-trained run (rows), ``base``'s per-call relative L2 deviation over the pair's
    (median over seeds, layers and checkpoints) and ``base``'s model-level weight drift over the pair's at
    the last checkpoint (median over seeds), per drift metric (columns ``drift_<metric>``)."""
    cols = ["per_call"] + [f"drift_{m}" for m in DRIFT_METRICS]
    if ds is None or "call_rel_l2" not in ds or base not in ds["call_pair"].values:
        return pd.DataFrame(columns=cols).rename_axis(f"{base} over")
    base_run = str(ds["call_run"].sel(call_pair=base).values)
    dev = ds["call_rel_l2"].median(["seed", "layer", "step"])
    rows = {}
    for pair in map(str, ds["call_pair"].values):
        if str(ds["call_run"].sel(call_pair=pair).values) == base_run or pair not in ds["pair"].values:
            continue
        last = {m: ds[f"model_{m}"].isel(step=-1).median("seed") for m in DRIFT_METRICS}
        rows[pair] = [float(dev.sel(call_pair=base) / dev.sel(call_pair=pair))] + [
            float(last[m].sel(pair=base) / last[m].sel(pair=pair)) for m in DRIFT_METRICS]
    return pd.DataFrame.from_dict(rows, orient="index", columns=cols).rename_axis(f"{base} over")


# -- values for the notebook's prose (glued; no sentences) -----------------------------------------

def noise_floor_exceedances(ds: xr.Dataset, metric: str) -> pd.DataFrame:
    """Every (pair, seed, step > 0) at which a pair other than ``repeat`` and ``init_seed`` drifts at least as
    far as the noise floor (``init_seed``) of the same seed, by model-level ``metric``."""
    cols = ["pair", "seed", "step", "drift", "noise floor"]
    if ds is None or "init_seed" not in ds["pair"].values:
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


def source_values() -> dict:
    """Golden et al.'s own numbers the prose cites (theirs, never ours: ``GOLDEN_RATIO_RANGE`` also as the range
    the prose states, and ``GOLDEN_FLASH_OVER_BASELINE``), and the significand bits fp16 has beyond bf16 (a
    definition), flat for ``attnum.glue``: keys without the notebook's prefix."""
    from ...precision import SIGNIFICAND_BITS

    low, high = GOLDEN_RATIO_RANGE
    return {"golden_ratio_low": low, "golden_ratio_high": high, "golden_range": f"{low:g}–{high:g}x",
            "golden_flash_over_baseline": GOLDEN_FLASH_OVER_BASELINE,
            "fp16_extra_bits": SIGNIFICAND_BITS["fp16"] - SIGNIFICAND_BITS["bf16"]}


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
        none = "none" if cpu else MISSING
        out[f"floor_exceeded_pairs_{metric}"] = ", ".join(sorted(set(ex["pair"]))) if len(ex) else none
        out[f"floor_exceeded_seeds_{metric}"] = ", ".join(map(str, sorted(set(ex["seed"])))) if len(ex) else none
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
        out[f"{key}_max_metric"] = DRIFT_METRICS[int(np.nanargmax(maxima))] if np.isfinite(maxima).any() else MISSING
        out[f"{key}_max_place"] = place(out[f"{key}_max"])
    out.update(shape_values(ds if cpu else None))
    out.update(conclusion_values(ds if cpu else None))
    return out


def _yes_no(flag) -> str:
    return "yes" if bool(flag) else "no"


def _orders(values: np.ndarray) -> float:
    """log10 of the largest over the smallest of the positive ``values`` (NaN with fewer than two)."""
    v = values[np.isfinite(values) & (values > 0)]
    return float(np.log10(v.max() / v.min())) if v.size >= 2 else math.nan


def shape_values(ds: xr.Dataset | None) -> dict:
    """The run's size and the qualitative statements of the CPU sections, as values (NaN or ``n/a`` where a
    variable or pair is absent): model parameters, tokens per run, seeds and runs; whether the repeat pair is
    exactly 0 and every pair's drift grows at every checkpoint (median over seeds) per metric; whether
    ``flash_fp32`` stays below the chaos baseline; the noise floor's relative L2 at step 0; the spread of the
    pairs' W1 (orders of magnitude, median over seeds) at the first checkpoint after step 0 and at the last;
    the peak relative growth rate of W1 (median over seeds; smallest and largest over the pairs, the pairs
    with the two largest and the smallest); the attention projections' relative L2 over each other kind's at
    the first checkpoint after step 0 (low-precision training pairs and flash pairs); norms the least-drifting
    kind; the largest over the smallest block's relative L2 at the last checkpoint; signs of the pooled
    correlations with the largest logit and the entropy, and the range of the across-layer ones."""
    keys = ["n_params", "n_seeds", "n_runs", "repeat_zero", "rates_all_positive",
            "flash_fp32_below_perturbation", "init_seed_rel_l2_step0_min", "init_seed_rel_l2_step0_max",
            "spread_orders_first", "spread_orders_last", "spread_first_step", "growth_peak_min", "growth_peak_max",
            "growth_fastest", "growth_slowest", "attn_conc_lowp_min", "attn_conc_lowp_max", "attn_conc_flash_min",
            "attn_conc_flash_max", "attn_conc_perturbation_min", "attn_conc_perturbation_max", "norm_least",
            "flash_fp32_smallest", "dof", "layer_spread_max", "pooled_max_logit_all_positive",
            "pooled_entropy_all_negative", "layer_corr_max_logit_min", "layer_corr_max_logit_max",
            "layer_corr_entropy_min", "layer_corr_entropy_max"] + [f"grows_{m}" for m in DRIFT_METRICS]
    out = {k: math.nan for k in keys}
    if ds is None or "model_wasserstein" not in ds or "tensor_numel" not in ds:
        return out
    pairs = [str(p) for p in ds["pair"].values]
    moving = [p for p in pairs if p != "repeat"]
    later = ds["step"].values > 0
    out["n_params"] = int(ds["tensor_numel"].sum())
    if "train_loss" in ds:
        out["n_runs"] = int(ds.sizes["run"])
    out["n_seeds"] = int(ds.sizes["seed"])
    out["dof"] = int(ds.sizes["seed"]) - 1
    if "flash_fp32" in pairs and len(moving) > 1:
        rest = [p for p in moving if p != "flash_fp32"]
        out["flash_fp32_smallest"] = _yes_no(all(
            (ds[f"model_{m}"].isel(step=later).median("seed").sel(pair="flash_fp32")
             < ds[f"model_{m}"].isel(step=later).median("seed").sel(pair=rest).min("pair")).all() for m in DRIFT_METRICS))
    if "repeat" in pairs:
        out["repeat_zero"] = _yes_no(all((ds[m].sel(pair="repeat") == 0).all() for m in DRIFT_METRICS))
    for m in DRIFT_METRICS:
        med = ds[f"model_{m}"].isel(step=later).sel(pair=moving).median("seed")
        out[f"grows_{m}"] = _yes_no((med.diff("step") >= 0).all())
    rate = ds["model_wasserstein_rate"].sel(pair=moving) if "model_wasserstein_rate" in ds else None
    if rate is not None:
        out["rates_all_positive"] = _yes_no((rate.isel(step=slice(1, None)) > 0).all())
    if {"flash_fp32", "init_perturbation"} <= set(pairs):
        out["flash_fp32_below_perturbation"] = _yes_no(all(
            (ds[f"model_{m}"].isel(step=later).median("seed").sel(pair="flash_fp32")
             < ds[f"model_{m}"].isel(step=later).median("seed").sel(pair="init_perturbation")).all()
            for m in DRIFT_METRICS))
    if "init_seed" in pairs:
        start = ds["model_rel_l2"].sel(pair="init_seed").isel(step=0)
        out["init_seed_rel_l2_step0_min"], out["init_seed_rel_l2_step0_max"] = float(start.min()), float(start.max())
    if later.any():
        w = ds["model_wasserstein"].sel(pair=moving).median("seed")
        out["spread_first_step"] = int(ds["step"].values[later][0])
        out["spread_orders_first"] = _orders(w.isel(step=int(np.nonzero(later)[0][0])).values)
        out["spread_orders_last"] = _orders(w.isel(step=-1).values)
        logw = np.log(w.where(w > 0))
        growth = (logw.diff("step") / logw["step"].diff("step")).max("step")
        ok = growth.dropna("pair")
        if ok.sizes["pair"]:
            order = ok.sortby(ok)
            out["growth_peak_min"], out["growth_peak_max"] = float(order.min()), float(order.max())
            out["growth_fastest"] = ", ".join(map(str, order["pair"].values[::-1][:2]))
            out["growth_slowest"] = str(order["pair"].values[0])
        kinds = ds["kind_rel_l2"].isel(step=int(np.nonzero(later)[0][0])).median("seed")
        others = [k for k in map(str, kinds["kind"].values) if k != "attention"]
        conc = kinds.sel(kind="attention") / kinds.sel(kind=others)
        for key, group in (("lowp", LOW_PRECISION_PAIRS), ("flash", ("flash", "flash_fp32")),
                           ("perturbation", ("init_perturbation",))):
            sel = [p for p in group if p in pairs]
            if sel:
                out[f"attn_conc_{key}_min"] = float(conc.sel(pair=sel).min())
                out[f"attn_conc_{key}_max"] = float(conc.sel(pair=sel).max())
    last = ds["kind_rel_l2"].isel(step=-1).median("seed").sel(pair=moving)
    out["norm_least"] = _yes_no((last.argmin("kind") == list(last["kind"].values).index("norm")).all())
    layers = ds["layer_rel_l2"].isel(step=-1).median("seed").sel(pair=moving)
    out["layer_spread_max"] = float((layers.max("layer") / layers.min("layer")).max())
    if "corr_pooled" in ds:
        pooled = ds["corr_pooled"].sel(corr_metric="rel_l2", pair=moving)
        rank = ds["corr_layer_rank"].sel(corr_metric="rel_l2", pair=moving)
        stat = [d for d in pooled.dims if d != "pair"][0]
        out["pooled_max_logit_all_positive"] = _yes_no((pooled.sel({stat: "max_logit"}) > 0).all())
        out["pooled_entropy_all_negative"] = _yes_no((pooled.sel({stat: "entropy"}) < 0).all())
        for s in ("max_logit", "entropy"):
            out[f"layer_corr_{s}_min"] = float(rank.sel({stat: s}).min())
            out[f"layer_corr_{s}_max"] = float(rank.sel({stat: s}).max())
    return out


def conclusion_values(ds: xr.Dataset | None) -> dict:
    """The numbers of conclusions 6 and 7: each low-precision pair over its precision-matched flash pair and
    over ``flash`` at the last checkpoint per metric (``matched_ranges``), and the ``flash`` pair's per-call
    max deviation at the first and last checkpoint with its weights' max |dw| at the last (``call_summary``)."""
    out = {}
    table = matched_ranges(ds)
    for low, matched in MATCHED.items():
        for den in (matched, "flash"):
            for m in DRIFT_METRICS:
                key = (f"{low}/{den}", m)
                out[f"{low}_over_{den}_{m}_last"] = float(table.loc[key, "ratio_last"]) if key in table.index else math.nan
        key = (f"{low}/{matched}", "wasserstein")
        out[f"{low}_matched_is_flash"] = (_yes_no(table.loc[key, "matched_is_flash"]) if key in table.index
                                          else MISSING)
    calls = call_summary(ds)
    for col in ("max_abs_first", "max_abs_last", "weight_max_abs_last", "err_ratio_min", "err_ratio_max"):
        for pair in ("flash", "flash_fp32", "flash_fp16"):
            out[f"call_{pair}_{col}"] = float(calls.loc[pair, col]) if pair in calls.index else math.nan
    out["call_flash_non_decreasing"] = _yes_no(calls.loc["flash", "non_decreasing"]) if "flash" in calls.index else MISSING
    contrast = precision_contrast(ds)
    for pair in ("flash_fp32", "flash_fp16"):
        out[f"contrast_{pair}_per_call"] = float(contrast.loc[pair, "per_call"]) if pair in contrast.index else math.nan
        out[f"contrast_{pair}_drift_wasserstein"] = (float(contrast.loc[pair, "drift_wasserstein"])
                                                     if pair in contrast.index else math.nan)
    return out
