"""Aggregates of study 03's drift that every tier's dataset is built from: per kind, layer and model and
their rates (``summarize``), ratios of two pairs' drift with a t interval over seeds (``drift_ratios``),
Spearman correlations of per-layer drift with attention statistics (``attention_correlations``), and the
GPU records' comparisons and intervals (``gpu_comparison``, ``_interval``, ``_paired_ratio``). Plain
NumPy/xarray on measured drift: nothing here trains."""
from __future__ import annotations

import math

import numpy as np
import xarray as xr
from scipy import stats as sps

from ... import drift
from . import CORR_METRICS, DRIFT_METRICS, GPU_METRICS, LOW_PRECISION_PAIRS, MATCHED, STATISTICS

# -- aggregates, rates, ratios --------------------------------------------------------------------

def summarize(ds: xr.Dataset) -> xr.Dataset:
    """Add per-kind, per-layer and model-level aggregates and model-level drift rates."""
    out = ds.copy()
    for by in ("kind", "layer", "model"):
        agg = drift.aggregate(ds, by)
        for name in agg.data_vars:
            out[f"{by}_{name}"] = agg[name].transpose("pair", "seed", "step", ...)
    for metric in DRIFT_METRICS:
        out[f"model_{metric}_rate"] = drift_rate(out[f"model_{metric}"])
    return out


def drift_rate(da: xr.DataArray) -> xr.DataArray:
    """Change per optimizer step since the previous checkpoint (NaN at the first)."""
    steps = da["step"].astype(float)
    rate = da.diff("step", label="upper") / steps.diff("step", label="upper")
    return rate.reindex(step=da["step"])


def ratio_interval(ratios: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """Geometric mean of positive ratios (last axis) and a t interval on their logs.

    Non-finite or non-positive entries are dropped; fewer than two left: the interval is NaN.
    """
    r = np.asarray(ratios, dtype=float)
    r = r[np.isfinite(r) & (r > 0)]
    if r.size == 0:
        return math.nan, math.nan, math.nan
    logs = np.log(r)
    centre = float(np.exp(logs.mean()))
    if r.size < 2:
        return centre, math.nan, math.nan
    half = sps.t.ppf(0.5 + confidence / 2, r.size - 1) * logs.std(ddof=1) / math.sqrt(r.size)
    return centre, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))


def comparisons(pairs) -> list[tuple[str, str]]:
    """(numerator, denominator) pairs of drift ratios that the present pairs allow."""
    out = []
    for flash in ("flash", "flash_fp32"):
        if flash not in pairs:
            continue
        out += [(low, flash) for low in LOW_PRECISION_PAIRS if low in pairs]
        out += [(flash, base) for base in ("init_seed", "init_perturbation") if base in pairs]
    out += [(low, flash) for low, flash in MATCHED.items() if low in pairs and flash in pairs]
    return out


def drift_ratios(ds: xr.Dataset, *, confidence: float) -> xr.Dataset:
    """Model-level drift ratios numerator / denominator per seed, their geometric mean over seeds
    and its confidence interval, for every comparison the pairs allow (dims comparison, metric, step)."""
    comps = comparisons(list(ds["pair"].values))
    names = [f"{a}/{b}" for a, b in comps]
    shape = (len(comps), len(DRIFT_METRICS), ds.sizes["seed"], ds.sizes["step"])
    per_seed = np.full(shape, np.nan)
    for c, (num, den) in enumerate(comps):
        for m, metric in enumerate(DRIFT_METRICS):
            a = ds[f"model_{metric}"].sel(pair=num).transpose("seed", "step").values
            b = ds[f"model_{metric}"].sel(pair=den).transpose("seed", "step").values
            with np.errstate(divide="ignore", invalid="ignore"):
                per_seed[c, m] = np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)
    summary = np.apply_along_axis(lambda r: ratio_interval(r, confidence), 2, per_seed)  # (c, m, 3, step)
    coords = {"comparison": names, "metric": list(DRIFT_METRICS), "seed": ds["seed"].values, "step": ds["step"].values,
              "comparison_numerator": ("comparison", [a for a, _ in comps]),
              "comparison_denominator": ("comparison", [b for _, b in comps])}
    dims = ("comparison", "metric", "step")
    out = xr.Dataset({"drift_ratio": (dims, summary[:, :, 0]), "drift_ratio_low": (dims, summary[:, :, 1]),
                      "drift_ratio_high": (dims, summary[:, :, 2]),
                      "drift_ratio_per_seed": (("comparison", "metric", "seed", "step"), per_seed)}, coords=coords)
    out.attrs["confidence"] = confidence
    for name in ("drift_ratio_low", "drift_ratio_high"):
        out[name].attrs["confidence"] = confidence
    return out



def _spearman(x, y) -> float:
    """Spearman rank correlation of the finite pairs (two points: the sign agreement, +-1); NaN
    with fewer than two points or a constant side."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 2 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return math.nan
    return float(np.corrcoef(sps.rankdata(x[ok]), sps.rankdata(y[ok]))[0, 1])


def layer_statistic(ds: xr.Dataset, run: str, statistic: str) -> xr.DataArray:
    """A run's per-layer training record at the checkpoint steps (the nearest record at or before)."""
    rec = ds[f"train_{statistic}"].sel(run=run)
    return rec.sel(train_step=ds["step"].values, method="pad").rename(train_step="step").assign_coords(
        step=ds["step"].values)


def attention_correlations(ds: xr.Dataset) -> xr.Dataset:
    """Per pair, statistic and drift metric: Spearman correlations between the pair's per-layer drift
    and the statistic recorded by its reference run; within each (seed, step) across layers
    (``corr_layer_rank``, free of the common trend over training) and pooled (``corr_pooled``)."""
    pairs = ds["pair"].values
    rank = np.full((len(pairs), len(STATISTICS), len(CORR_METRICS)), np.nan)
    pooled = np.full_like(rank, np.nan)
    for p, pair in enumerate(pairs):
        run = str(ds["pair_run_a"].sel(pair=pair).values)
        for s, stat in enumerate(STATISTICS):
            x_all = layer_statistic(ds, run, stat).transpose("seed", "step", "layer").values
            for m, metric in enumerate(CORR_METRICS):
                y_all = ds[f"layer_{metric}"].sel(pair=pair).transpose("seed", "step", "layer").values
                later = ds["step"].values > 0
                x, y = x_all[:, later], y_all[:, later]
                pooled[p, s, m] = _spearman(x.ravel(), y.ravel())
                within = [_spearman(x[i, j], y[i, j]) for i in range(x.shape[0]) for j in range(x.shape[1])]
                within = [w for w in within if np.isfinite(w)]
                rank[p, s, m] = float(np.mean(within)) if within else math.nan
    dims = ("pair", "statistic", "corr_metric")
    coords = {"pair": pairs, "statistic": list(STATISTICS), "corr_metric": list(CORR_METRICS)}
    return xr.Dataset({"corr_layer_rank": (dims, rank), "corr_pooled": (dims, pooled)}, coords=coords)


# -- tables ---------------------------------------------------------------------------------------
def gpu_comparison(run: xr.Dataset) -> str:
    """What a pair record's members differ in, from its members' attention, autocast and seed."""
    att, amp, seed = (list(map(str, run[c].values)) for c in ("member_attention", "member_amp", "member_seed"))
    if len(att) != 2:
        raise ValueError("not a pair record: it has one member")
    if seed[0] != seed[1]:
        return "noise_floor"
    if amp[0] != amp[1]:
        low = amp[1] if amp[0] == "off" else amp[0]
        return f"{low}_training"
    if att[0] != att[1]:
        if "sdpa:flash" in {a.split("@")[0] for a in att} and "sdpa:math@fp32" in att:
            return "flash_vs_fp32"
        return f"attention_{att[0]}_vs_{att[1]}"  # another attention pair: kept, named by its members
    return "gpu_repeat"


def _interval(values, confidence: float) -> tuple[float, float, float, int]:
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size and (v == 0).all():  # bitwise identical members (a repeat pair on a deterministic device)
        return 0.0, math.nan, math.nan, int(v.size)
    v = v[v > 0]
    centre, low, high = ratio_interval(v, confidence)
    return centre, low, high, int(v.size)


def _interpolated_within(snaps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` (one per snapshot step of ``snaps``) interpolated linearly in step to every snapshot > 0
    between the first and last steps where they are finite and > 0; NaN outside (and where there is none)."""
    ok = np.isfinite(values) & (snaps > 0) & (values > 0)
    out = np.full(len(snaps), np.nan)
    if ok.any():
        inside = (snaps > 0) & (snaps >= snaps[ok].min()) & (snaps <= snaps[ok].max())
        out[inside] = np.interp(snaps[inside], snaps[ok], values[ok])
    return out


def _paired_ratio(out: xr.Dataset, gathered: xr.Dataset, lows, flash_runs, pairs, comps, confidence: float):
    """Each low-precision record's drift over the drift of the flash_vs_fp32 record with its own init and
    data seeds (interpolated linearly in step to the low-precision snapshots, within the flash record's
    own snapshots), then the geometric mean and t interval over those per-seed ratios: the seeds are
    paired, so the interval carries both pairs' spread. Records without a flash partner are left out.
    Returns the centre, low, high and count arrays (low precision x metric x snapshot)."""
    snaps = out["snapshot"].values
    shape = (len(lows), len(GPU_METRICS), len(snaps))
    centre, low, high, count = (np.full(shape, np.nan) for _ in range(4))
    seeds_of = lambda run: (int(gathered["run_seed"].sel(run=run)), int(gathered["run_data_seed"].sel(run=run)))
    partner = {seeds_of(r): r for r in flash_runs}
    for j, metric in enumerate(GPU_METRICS):
        model = out[f"gpu_model_{metric}"]
        for i, comp in enumerate(lows):
            rows = []
            for run in (r for r, c in zip(pairs, comps) if c == comp):
                flash_run = partner.get(seeds_of(run))
                if flash_run is not None:
                    rows.append(model.sel(run=run).values
                                / _interpolated_within(snaps, model.sel(run=flash_run).values))
            if rows:
                rows = np.array(rows)
                for k in range(len(snaps)):
                    centre[i, j, k], low[i, j, k], high[i, j, k], count[i, j, k] = _interval(rows[:, k], confidence)
    return centre, low, high, count


