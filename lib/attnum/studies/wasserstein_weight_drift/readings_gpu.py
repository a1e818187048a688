"""Readings of study 03's ``gpu_training`` tier: tables and values from the gathered GPU pair records
(``experiments.gpu_training_dataset``). Pairs bounded by a time budget stop at different steps: they are
compared at the snapshots every record of them shares (``gpu_common_steps``), per kind at the last of
those (``gpu_kind_table``), and the repeat pair over the flash pair at every one (``gpu_ratio_series``)."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import xarray as xr

from . import GOLDEN_RATIO_RANGE, GPU_LOW_PRECISION, GPU_METRICS
from ...glue import MISSING
from .readings import place, verdict

def gpu_drift_table(ds: xr.Dataset | None, metric: str = "wasserstein"):
    """Per comparison at its last snapshot: the drift (geometric mean over seeds), its interval and seeds
    (``metric``: one of ``GPU_METRICS``, which the records hold with intervals); empty without records."""
    rows = []
    if not _has_gpu(ds):
        return pd.DataFrame(columns=["comparison"]).set_index("comparison")
    for comp in ds["gpu_comparison"].values:
        sub = ds.sel(gpu_comparison=comp, gpu_metric=metric)
        ok = np.nonzero(np.isfinite(sub["gpu_drift"].values) & (ds["snapshot"].values > 0))[0]
        if not len(ok):
            continue
        k = ok[-1]
        rows.append({"comparison": str(comp), "last snapshot (step)": int(ds["snapshot"][k]),
                     f"model {metric}": float(sub["gpu_drift"][k]), "ci low": float(sub["gpu_drift_low"][k]),
                     "ci high": float(sub["gpu_drift_high"][k]), "seeds": int(sub["gpu_n_seeds"][k])})
    return pd.DataFrame(rows).set_index("comparison")


def _runs_of(ds: xr.Dataset, comp: str) -> np.ndarray:
    return ds["run"].values[ds["gpu_comparison_of_run"].values == comp]


def gpu_common_steps(ds: xr.Dataset, comps=None) -> np.ndarray:
    """Snapshot steps > 0 at which every record of each comparison in ``comps`` (default: every one
    present) has its drift, model-level and per kind: the steps at which those pairs compare like for
    like (pairs bounded by a time budget stop at different steps)."""
    comps = [str(c) for c in ds["gpu_comparison"].values] if comps is None else list(comps)
    ok = ds["snapshot"].values > 0
    for comp in comps:
        runs = _runs_of(ds, comp)
        if not len(runs):
            return np.array([], dtype=int)
        ok &= np.isfinite(ds["gpu_model_wasserstein"].sel(run=runs).transpose("run", "snapshot").values).all(0)
        if "gpu_kind_wasserstein_rel" in ds:
            kind = ds["gpu_kind_wasserstein_rel"].sel(run=runs).transpose("run", "kind", "snapshot").values
            ok &= np.isfinite(kind).all(axis=(0, 1))
    return ds["snapshot"].values[ok].astype(int)


def gpu_common_step(ds: xr.Dataset, comps=None) -> int | None:
    """The last snapshot step > 0 that every record of the comparisons shares (None: there is none)."""
    steps = gpu_common_steps(ds, comps)
    return int(steps[-1]) if len(steps) else None


def gpu_kind_table(ds: xr.Dataset | None, step: int | None = None, metric: str = "wasserstein_rel"):
    """Per comparison (rows) and kind of tensor (columns): the drift at ``step`` (default: the last snapshot
    every pair record shares, ``gpu_common_step``), median over the comparison's records (seeds); NaN where
    a record has no snapshot at that step; empty without records or a shared snapshot."""
    step = gpu_common_step(ds) if step is None and _has_gpu(ds) and f"gpu_kind_{metric}" in ds else step
    if step is None:
        return pd.DataFrame()
    rows = {}
    for comp in ds["gpu_comparison"].values:
        sub = ds[f"gpu_kind_{metric}"].sel(run=_runs_of(ds, str(comp)), snapshot=step)
        rows[str(comp)] = sub.median("run", skipna=False).to_pandas()
    table = pd.DataFrame(rows).T
    table.columns.name, table.index.name = "kind", "comparison"
    return table


def gpu_ratio_series(ds: xr.Dataset, a: str, b: str, metric: str = "wasserstein"):
    """a's model-level drift / b's (geometric means over seeds) at every snapshot step > 0 that every
    record of both comparisons has (``gpu_common_steps``); empty when one is absent or b's drift is 0."""
    present = set(map(str, ds["gpu_comparison"].values))
    if a not in present or b not in present:
        return pd.Series(dtype=float, name=f"{a} / {b}")
    steps = gpu_common_steps(ds, [a, b])
    x, y = (ds["gpu_drift"].sel(gpu_comparison=c, gpu_metric=metric, snapshot=steps).values for c in (a, b))
    keep = y > 0
    return pd.Series(x[keep] / y[keep], index=pd.Index(steps[keep], name="step"), name=f"{a} / {b}")


MERGED_FACTOR = 2.0  # drifts within this factor of each other are called alike (``gpu_spread_table``)


def _side_by_side(ds: xr.Dataset) -> list[str] | None:
    """The comparisons set side by side (repeat, flash, low precision) present in ``ds``; None without the
    flash pair or a second one."""
    present = set(map(str, ds["gpu_comparison"].values))
    comps = [c for c in ("gpu_repeat", "flash_vs_fp32", *GPU_LOW_PRECISION) if c in present]
    return comps if "flash_vs_fp32" in comps and len(comps) >= 2 else None


def _drifts_at(ds: xr.Dataset, comps, step) -> tuple[dict, float]:
    """Each comparison's model-level W1 drift at ``step`` and the largest over the smallest of those > 0
    (NaN with fewer than two)."""
    drift = {c: float(ds["gpu_drift"].sel(gpu_comparison=c, gpu_metric="wasserstein", snapshot=step)) for c in comps}
    positive = [v for v in drift.values() if v > 0]
    return drift, (max(positive) / min(positive) if len(positive) >= 2 else math.nan)


def _has_gpu(ds) -> bool:
    return ds is not None and "gpu_drift" in ds


def gpu_provenance_table(ds: xr.Dataset | None) -> pd.DataFrame:
    """The records' own provenance (``prov_*`` coordinates; rows: field, columns: record)."""
    if not _has_gpu(ds):
        return pd.DataFrame()
    return pd.DataFrame({c.removeprefix("prov_"): ds[c].values for c in ds.coords if c.startswith("prov_")},
                        index=ds["run"].values).T


def gpu_record_table(ds: xr.Dataset | None) -> pd.DataFrame:
    """Per pair record (rows): its comparison, its last snapshot with a drift, and the model-level drift
    there by all three metrics the records hold (W1, relative L2, max |dw|); empty without records."""
    cols = ["comparison", "last snapshot (step)", "wasserstein", "rel_l2", "max_abs"]
    if not _has_gpu(ds):
        return pd.DataFrame(columns=cols)
    rows = {}
    for run in map(str, ds["run"].values):
        w = ds["gpu_model_wasserstein"].sel(run=run).values
        ok = np.nonzero(np.isfinite(w) & (ds["snapshot"].values > 0))[0]
        if not len(ok):
            continue
        k = ok[-1]
        rows[run] = [str(ds["gpu_comparison_of_run"].sel(run=run).values), int(ds["snapshot"][k])] + [
            float(ds[f"gpu_model_{m}"].sel(run=run)[k]) for m in GPU_PROSE_METRICS]
    return pd.DataFrame.from_dict(rows, orient="index", columns=cols).rename_axis("record")


def gpu_pair_ratio_table(ds: xr.Dataset | None) -> pd.DataFrame:
    """The repeat pair over the flash pair and the flash pair over the noise floor (model-level W1,
    geometric means over seeds) at every snapshot both comparisons' records share (``gpu_ratio_series``);
    a column per ratio, NaN where one is not defined; empty without records."""
    if not _has_gpu(ds):
        return pd.DataFrame(columns=["gpu_repeat / flash_vs_fp32", "flash_vs_fp32 / noise_floor"])
    series = [gpu_ratio_series(ds, "gpu_repeat", "flash_vs_fp32"), gpu_ratio_series(ds, "flash_vs_fp32", "noise_floor")]
    return pd.concat(series, axis=1)


def gpu_spread_table(ds: xr.Dataset | None, merged: float = MERGED_FACTOR) -> pd.DataFrame:
    """The repeat pair, the flash pair and the low-precision pairs (changes from nothing to every matmul's
    precision) side by side at every snapshot all their records share: each comparison's model-level W1
    (geometric mean over seeds), the largest over the smallest of those > 0 (``factor``) and whether that is
    below ``merged`` (``alike``); empty without records or a shared snapshot."""
    comps = _side_by_side(ds) if _has_gpu(ds) else None
    if comps is None:
        return pd.DataFrame(columns=["factor", "alike"])
    rows = {}
    for step in gpu_common_steps(ds, comps):
        drift, factor = _drifts_at(ds, comps, int(step))
        rows[int(step)] = {**drift, "factor": factor, "alike": bool(math.isfinite(factor) and factor < merged)}
    return pd.DataFrame.from_dict(rows, orient="index", columns=comps + ["factor", "alike"]).rename_axis("step")


def gpu_early_table(ds: xr.Dataset | None, merged: float = MERGED_FACTOR) -> pd.DataFrame:
    """The side-by-side comparison before the first snapshot all records share, at the snapshots where every
    comparison (repeat, flash, low precision) has at least one record with a drift (records made with
    ``snapshot_early``): each comparison's drift (geometric mean over the records that have it), their number
    of records (``n <comparison>``), the factor and ``alike`` as in ``gpu_spread_table``."""
    comps = _side_by_side(ds) if _has_gpu(ds) else None
    if comps is None:
        return pd.DataFrame(columns=["factor", "alike"])
    common = gpu_common_steps(ds, comps)
    drift = ds["gpu_drift"].sel(gpu_comparison=comps, gpu_metric="wasserstein")
    count = ds["gpu_n_seeds"].sel(gpu_comparison=comps, gpu_metric="wasserstein")
    rows = {}
    for i, s in enumerate(ds["snapshot"].values):
        if s > 0 and (not len(common) or s < common[0]) and np.isfinite(drift.values[:, i]).all():
            vals, factor = _drifts_at(ds, comps, int(s))
            rows[int(s)] = {**vals, **{f"n {c}": int(count.sel(gpu_comparison=c, snapshot=s)) for c in comps},
                            "factor": factor, "alike": bool(math.isfinite(factor) and factor < merged)}
    cols = comps + [f"n {c}" for c in comps] + ["factor", "alike"]
    return pd.DataFrame.from_dict(rows, orient="index", columns=cols).rename_axis("step")


def gpu_seed_table(ds: xr.Dataset | None) -> pd.DataFrame:
    """For each comparison with two seeds or more: the last snapshot every record of it has, the records'
    smallest and largest model-level W1 there, their geometric mean and interval (NaN when a record is
    exactly 0: bitwise identical members), how many are exactly 0, and the largest over the smallest."""
    cols = ["step", "seeds", "min", "max", "geometric mean", "ci low", "ci high", "exactly 0", "max / min"]
    if not _has_gpu(ds):
        return pd.DataFrame(columns=cols)
    rows = {}
    for comp in map(str, ds["gpu_comparison"].values):
        runs = _runs_of(ds, comp)
        step = gpu_common_step(ds, [comp]) if len(runs) >= 2 else None
        if step is None:
            continue
        each = ds["gpu_model_wasserstein"].sel(run=runs, snapshot=step).values
        sub = ds.sel(gpu_comparison=comp, gpu_metric="wasserstein", snapshot=step)
        zero = int((each == 0).sum())
        stats = [float(sub[v]) if not zero else math.nan for v in ("gpu_drift", "gpu_drift_low", "gpu_drift_high")]
        rows[comp] = [step, len(runs), float(each.min()), float(each.max()), *stats, zero,
                      float(each.max() / each.min()) if each.min() > 0 else math.nan]
    return pd.DataFrame.from_dict(rows, orient="index", columns=cols).rename_axis("comparison")


def gpu_lowprec_missing(ds: xr.Dataset | None) -> str | None:
    """What keeps the low-precision/flash ratio from being computed: the comparison(s) absent, or
    "overlap" (no low-precision snapshot within the flash pair's); None when there is a ratio."""
    if not _has_gpu(ds):
        return "records"
    present = set(map(str, ds["gpu_comparison"].values))
    if not present & set(GPU_LOW_PRECISION):
        return " or ".join(GPU_LOW_PRECISION)
    if "flash_vs_fp32" not in present:
        return "flash_vs_fp32"
    if "gpu_ratio" not in ds or not np.isfinite(ds["gpu_ratio"].sel(gpu_metric="wasserstein").values).any():
        return "overlap"
    return None


def gpu_golden_table(ds: xr.Dataset | None, claim=GOLDEN_RATIO_RANGE) -> pd.DataFrame:
    """Golden et al.'s 2-5x per low-precision pair and metric held with intervals (W1, relative L2): the
    low-precision pair's model-level drift over the flash pair's (interpolated in step) at the last snapshot
    with the most seeds among those with two or more (``_most_seeds_snapshot``), its interval over the
    low-precision seeds and where it lies against the claim (``readings.verdict``; one seed: the point value's
    ``readings.place``); the same paired by seed (each record over the flash record of its own seeds); and the
    last snapshot with a ratio (reached by fewer seeds, perhaps) with its ratio."""
    cols = ["step", "ratio", "ci low", "ci high", "seeds", "against Golden et al.", "paired step", "paired ratio",
            "paired ci low", "paired ci high", "paired seeds", "paired against Golden et al.", "last step",
            "ratio at last step"]
    index = pd.MultiIndex.from_tuples([], names=["comparison", "metric"])
    if gpu_lowprec_missing(ds) is not None:
        return pd.DataFrame(columns=cols, index=index)
    rows = {}
    for comp in map(str, ds["gpu_lowprec"].values):
        for metric in map(str, ds["gpu_metric"].values):
            sub = ds.sel(gpu_lowprec=comp, gpu_metric=metric)
            ok = np.nonzero(np.isfinite(sub["gpu_ratio"].values))[0]
            if not len(ok):
                continue
            n = sub["gpu_ratio_n_seeds"].values
            k = _most_seeds_snapshot(n, ok)
            r, lo, hi = (float(sub[v][k]) for v in ("gpu_ratio", "gpu_ratio_low", "gpu_ratio_high"))
            where = verdict(lo, hi, claim) if np.isfinite(lo) else place(r, claim)
            paired = [math.nan] * 5 + [MISSING]
            if "gpu_ratio_paired" in sub:
                pv = sub["gpu_ratio_paired"].values
                pok = np.nonzero(np.isfinite(pv))[0]
                if len(pok):
                    pn = sub["gpu_ratio_paired_n_seeds"].values
                    pk = _most_seeds_snapshot(pn, pok)
                    plo, phi = float(sub["gpu_ratio_paired_low"][pk]), float(sub["gpu_ratio_paired_high"][pk])
                    paired = [int(ds["snapshot"][pk]), float(pv[pk]), plo, phi, int(pn[pk]),
                              verdict(plo, phi, claim) if np.isfinite(plo) else place(float(pv[pk]), claim)]
            rows[(comp, metric)] = [int(ds["snapshot"][k]), r, lo, hi, int(n[k]), where, *paired,
                                    int(ds["snapshot"][ok[-1]]), float(sub["gpu_ratio"][ok[-1]])]
    return pd.DataFrame(list(rows.values()), index=pd.MultiIndex.from_tuples(list(rows), names=index.names),
                        columns=cols)


def _most_seeds_snapshot(n: np.ndarray, ok) -> int:
    """Of the snapshot indices ``ok``, the last with the most seeds ``n`` among those with two or more (an
    interval needs two), else the last one: a later snapshot that fewer seeds reached gives a wider
    interval over a smaller sample."""
    with_ci = [k for k in ok if n[k] >= 2]
    return [j for j in with_ci if n[j] == max(n[with_ci])][-1] if with_ci else ok[-1]


# -- values for the notebook's prose (glued; no sentences) -----------------------------------------

GPU_PROSE_METRICS = ("wasserstein", "rel_l2", "max_abs")


def gpu_metric_ratios(ds: xr.Dataset, comp: str, step: int) -> dict:
    """``comp``'s model-level drift over the flash_vs_fp32 pair's at ``step``, by every metric the records
    hold (W1, relative L2, max |dw|): geometric mean over each comparison's records with a drift there (NaN
    where either has none)."""
    out = {}
    for metric in GPU_PROSE_METRICS:
        vals = []
        for c in (comp, "flash_vs_fp32"):
            runs = _runs_of(ds, c)
            v = ds[f"gpu_model_{metric}"].sel(run=runs, snapshot=step).values if len(runs) else np.array([])
            v = v[np.isfinite(v) & (v > 0)]
            vals.append(float(np.exp(np.log(v).mean())) if v.size else math.nan)
        out[metric] = vals[0] / vals[1] if vals[1] > 0 else math.nan
    return out


def gpu_prose_values(ds: xr.Dataset | None) -> dict:
    """The numbers section 7's markdown states (unprefixed keys; NaN without the GPU records): for each
    low-precision pair, its last snapshot shared with the flash pair, and the ratio over the flash pair there
    by W1, relative L2 and max |dw|, with where each lies against Golden et al.'s 2-5x; the records'
    commit (the last record's)."""
    out = {}
    gpu = ds is not None and "gpu_drift" in ds
    for comp in GPU_LOW_PRECISION:
        present = gpu and comp in ds["gpu_comparison"].values and "flash_vs_fp32" in ds["gpu_comparison"].values
        steps = gpu_common_steps(ds, [comp, "flash_vs_fp32"]) if present else []
        step = int(steps[-1]) if len(steps) else None
        out[f"{comp}_step"] = step if step is not None else math.nan
        ratios = gpu_metric_ratios(ds, comp, step) if step is not None else {m: math.nan for m in GPU_PROSE_METRICS}
        for metric, r in ratios.items():
            out[f"{comp}_ratio_{metric}"] = r
            lo, hi = GOLDEN_RATIO_RANGE
            out[f"{comp}_ratio_{metric}_place"] = place(r)
    out.update(gpu_series_values(ds if gpu else None))
    return out


def _series_stats(prefix: str, series: pd.Series) -> dict:
    ok = len(series) > 0
    return {f"{prefix}_min": float(series.min()) if ok else math.nan,
            f"{prefix}_max": float(series.max()) if ok else math.nan,
            f"{prefix}_last": float(series.iloc[-1]) if ok else math.nan,
            f"{prefix}_first_step": int(series.index[0]) if ok else math.nan,
            f"{prefix}_last_step": int(series.index[-1]) if ok else math.nan,
            f"{prefix}_n": int(len(series)) if ok else math.nan}


def gpu_series_values(ds: xr.Dataset | None) -> dict:
    """The rest of section 7's numbers (NaN or ``n/a`` without records): the campaign (records, GPUs, GPU
    seconds of these records and of the folder, campaign runs without a record); the repeat pair over the
    flash pair and the flash pair over the noise floor over their common snapshots (range, last value and
    step, number of snapshots, how many with the repeat at or above the flash pair and the flash pair below
    the floor); whether two identical GPU runs were bitwise identical at every shared snapshot and the
    repeat pair's W1 at its last; the side-by-side factor at the first and last shared snapshot
    (``gpu_spread_table``) and how many early snapshots are more than ``MERGED_FACTOR`` apart
    (``gpu_early_table``); the per-kind step, the kind where the flash pair drifts most and in how many kinds
    it drifts more than the repeat pair; the seeds per comparison; and what keeps the 2-5x ratio from being
    computed (``gpu_lowprec_missing``)."""
    out = {}
    gpu = _has_gpu(ds)
    out["n_records"] = int(ds.sizes["run"]) if gpu else math.nan
    out["gpus"] = ", ".join(sorted(set(map(str, ds["prov_version_gpu"].values)))) if gpu and "prov_version_gpu" in ds.coords else MISSING
    out["gpu_s"] = float(ds["campaign_gpu_s"]) if gpu else math.nan
    out["all_gpu_s"] = float(ds["campaign_all_gpu_s"]) if gpu else math.nan
    out["records_in_folder"] = int(ds.attrs.get("records_in_folder", 0)) if gpu else math.nan
    missing = json.loads(ds.attrs.get("missing_runs", "[]")) if gpu else []
    out["missing_runs"] = ", ".join(missing) if missing else ("none" if gpu else MISSING)
    rep = gpu_ratio_series(ds, "gpu_repeat", "flash_vs_fp32") if gpu else pd.Series(dtype=float)
    floor = gpu_ratio_series(ds, "flash_vs_fp32", "noise_floor") if gpu else pd.Series(dtype=float)
    out.update(_series_stats("repeat_over_flash", rep))
    out["repeat_at_or_above_flash_n"] = int((rep.values >= 1).sum()) if len(rep) else math.nan
    out.update(_series_stats("flash_over_floor", floor))
    out["flash_below_floor_n"] = int((floor.values < 1).sum()) if len(floor) else math.nan
    out["repeat_bitwise_identical"] = MISSING
    out["repeat_last_w1"], out["repeat_last_step"] = math.nan, math.nan
    if gpu and "gpu_repeat" in ds["gpu_comparison"].values:
        steps = gpu_common_steps(ds, ["gpu_repeat"])
        drift = ds["gpu_drift"].sel(gpu_comparison="gpu_repeat", gpu_metric="wasserstein", snapshot=steps).values
        if len(steps):
            out["repeat_bitwise_identical"] = "yes" if (drift == 0).all() else "no"
            out["repeat_last_w1"], out["repeat_last_step"] = float(drift[-1]), int(steps[-1])
    spread = gpu_spread_table(ds)
    for key, row in (("first", 0), ("last", -1)):
        out[f"spread_{key}_step"] = int(spread.index[row]) if len(spread) else math.nan
        out[f"spread_{key}_factor"] = float(spread["factor"].iloc[row]) if len(spread) else math.nan
        out[f"spread_{key}_alike"] = ("yes" if spread["alike"].iloc[row] else "no") if len(spread) else MISSING
    out["merged_factor"] = MERGED_FACTOR
    early = gpu_early_table(ds)
    out["early_n"] = int(len(early)) if gpu else math.nan
    out["early_apart_n"] = int((~early["alike"].astype(bool)).sum()) if len(early) else (0 if gpu else math.nan)
    step = gpu_common_step(ds) if gpu and "gpu_kind_wasserstein_rel" in ds else None
    out["kind_step"] = step if step is not None else math.nan
    out["kind_flash_largest"], out["kind_flash_above_repeat_n"], out["kind_n"] = MISSING, math.nan, math.nan
    if step is not None and "flash_vs_fp32" in ds["gpu_comparison"].values:
        table = gpu_kind_table(ds, step)
        flash = table.loc["flash_vs_fp32"]
        out["kind_flash_largest"], out["kind_n"] = str(flash.idxmax()), int(len(flash))
        if "gpu_repeat" in table.index:
            out["kind_flash_above_repeat_n"] = int((flash > table.loc["gpu_repeat"]).sum())
    for comp in ("flash_vs_fp32", "noise_floor", "gpu_repeat", *GPU_LOW_PRECISION):
        out[f"seeds_{comp}"] = int(len(_runs_of(ds, comp))) if gpu else math.nan
    out["lowprec_missing"] = gpu_lowprec_missing(ds) or "none"
    golden = gpu_golden_table(ds)
    for comp in GPU_LOW_PRECISION:
        for metric in GPU_METRICS:
            key = (comp, metric)
            here = key in golden.index
            for col, name in (("step", "step"), ("ratio", "ratio"), ("ci low", "low"), ("ci high", "high"),
                              ("seeds", "seeds"), ("against Golden et al.", "verdict"), ("paired ratio", "paired"),
                              ("paired ci low", "paired_low"), ("paired ci high", "paired_high"),
                              ("paired against Golden et al.", "paired_verdict")):
                value = golden.loc[key, col] if here else (MISSING if "verdict" in name else math.nan)
                out[f"golden_{comp}_{metric}_{name}"] = value
    return out
