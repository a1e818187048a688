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

from . import GOLDEN_RATIO_RANGE, GPU_LOW_PRECISION
from .readings import verdict

def gpu_drift_table(ds: xr.Dataset, metric: str = "wasserstein"):
    """Per comparison at its last snapshot: the drift (geometric mean over seeds), its interval and seeds."""
    rows = []
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


def gpu_kind_table(ds: xr.Dataset, step: int, metric: str = "wasserstein_rel"):
    """Per comparison (rows) and kind of tensor (columns): the drift at ``step``, median over the
    comparison's records (seeds); NaN where a record has no snapshot at that step."""
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


def _steps(steps) -> str:
    steps = [int(s) for s in steps]
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def gpu_repeat_sentences(ds: xr.Dataset) -> list[str]:
    """The repeat pair over the flash-vs-FP32 pair at every snapshot both share, and what it means: how
    much of the flash pair's drift GPU non-determinism alone (two identical runs) reaches."""
    rep = gpu_ratio_series(ds, "gpu_repeat", "flash_vs_fp32")
    if not len(rep):
        return []
    steps, last, r = rep.index.values, int(rep.index[-1]), float(rep.iloc[-1])
    if (rep.values == 0).all():
        return [f"**GPU repeat:** the two identical runs are bitwise identical at every snapshot they share with the "
                f"flash-vs-FP32 pair ({_steps(steps)}): none of the flash pair's drift is run-to-run non-determinism."]
    above = steps[rep.values >= 1]
    out = [f"**GPU repeat:** two identical GPU runs drift {rep.min():.3g}x to {rep.max():.3g}x as far as the "
           f"flash-vs-FP32 pair (model-level W1, repeat / flash) over the {len(rep)} snapshots both pairs have "
           f"({_steps(steps)}), and {r:.3g}x at step {last}, the last of them; the repeat pair drifts at least as far "
           f"as the flash pair at {len(above)} of them" + (f" (step {', '.join(map(str, above))})" if len(above) else "")
           + "."]
    if r >= 1:
        out.append(f"So at step {last} GPU non-determinism alone (two identical runs) moves the weights as far as "
                   "changing the attention kernel from flash (bf16) to FP32, or farther: by weight drift the kernel's "
                   "effect cannot be told apart from run-to-run noise.")
    else:
        out.append(f"So at step {last} GPU non-determinism alone (two identical runs, no change of kernel) reaches "
                   f"{r:.0%} of the flash-vs-FP32 pair's drift: changing the attention kernel from flash (bf16) to "
                   f"FP32 moves the weights only {1 / r:.3g}x as far as changing nothing (and the flash pair's own "
                   "drift carries the same non-determinism).")
    return out


def gpu_kind_sentence(ds: xr.Dataset) -> str | None:
    """The per-kind drift of the flash pair beside the repeat pair's and the noise floor's, at the last
    snapshot every pair record shares (the middle panel of ``plot_gpu_drift``)."""
    if "gpu_kind_wasserstein_rel" not in ds or "flash_vs_fp32" not in ds["gpu_comparison"].values:
        return None
    step = gpu_common_step(ds)
    where = "the last snapshot every pair record shares"
    if step is None:
        step, where = gpu_common_step(ds, ["flash_vs_fp32"]), "the flash pair's own last snapshot: no snapshot is shared by every pair record"
        if step is None:
            return None
    table = gpu_kind_table(ds, step)
    flash = table.loc["flash_vs_fp32"]
    others = [c for c in ("gpu_repeat", "noise_floor") if c in table.index and table.loc[c].notna().all()]
    names = {"gpu_repeat": "repeat", "noise_floor": "noise floor"}
    parts = []
    for kind, value in flash.items():
        text = f"{kind} " + " / ".join(f"{v:.3g}" for v in [value] + [table.loc[c, kind] for c in others])
        if "gpu_repeat" in others:
            rep = table.loc["gpu_repeat", kind]
            text += f" ({value / rep:.3g}x)" if rep > 0 else " (repeat exactly 0)"
        parts.append(text)
    header = " / ".join(["flash"] + [names[c] for c in others]) + (" (flash over repeat)" if "gpu_repeat" in others else "")
    out = (f"**Where the drift sits:** at step {step}, {where} (relative W1 per kind of tensor, median over "
           f"seeds), the flash-vs-FP32 drift is largest for `{flash.idxmax()}`; per kind, {header}: "
           + "; ".join(parts) + ".")
    if "gpu_repeat" in others:
        rep = table.loc["gpu_repeat"]
        more = [str(k) for k in flash.index if flash[k] > rep[k]]
        less = [str(k) for k in flash.index if flash[k] <= rep[k]]
        out += (f" The flash pair drifts more than the repeat pair in {len(more)} of {len(flash)} kinds"
                + (f" ({', '.join(more)})" if more else "") + (f", as far or less in {', '.join(less)}" if less else "")
                + ".")
    return out


GPU_CHANGE = {"gpu_repeat": "no change", "flash_vs_fp32": "the attention kernel", "noise_floor": "the initial weights",
              "bf16_training": "every matmul's precision, bf16", "fp16_training": "every matmul's precision, fp16"}
MERGED_FACTOR = 2.0  # drifts within this factor of each other are called alike by gpu_spread_sentence


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


def gpu_spread_sentence(ds: xr.Dataset, merged: float = MERGED_FACTOR) -> str | None:
    """The repeat pair, the flash pair and the low-precision pairs (changes from nothing to every
    matmul's precision) side by side at the last snapshot they all share, and at the first when
    they share more than one: how far apart their drifts are, and what it means when they are alike
    (None: no shared snapshot, or fewer than two of them with a drift > 0 there)."""
    comps = _side_by_side(ds)
    if comps is None:
        return None
    steps = gpu_common_steps(ds, comps)
    if not len(steps):
        return None

    def at(step):
        drift, factor = _drifts_at(ds, comps, step)
        return drift, factor, any(v <= 0 for v in drift.values())

    first, last = int(steps[0]), int(steps[-1])
    drift, factor, zero = at(last)
    if not math.isfinite(factor):
        return None
    listed = lambda d: ", ".join(f"{v:.3g} for `{c}` ({GPU_CHANGE[c]})" for c, v in d.items())
    out = (f"**Changes of different size side by side:** at step {last}, the last snapshot these pairs share, the "
           f"model-level W1 drift is {listed(drift)}: the largest is {factor:.3g}x the smallest"
           + (" (the repeat pair is exactly 0 and left out of that factor)" if zero else "") + ".")
    factor0 = factor
    if first != last:
        drift0, factor0, _ = at(first)
        out += (f" At step {first}, the first they share: {listed(drift0)}"
                + (f", {factor0:.3g}x apart." if math.isfinite(factor0) else "."))
    if factor >= merged:
        return out + f" The drifts differ by more than {merged:g}x, so at step {last} they rank the changes by size."
    out += (f" Changes this different in size drifting within {merged:g}x of each other means that by step {last} "
            "the weight drift measures how training amplifies any small difference, not the size of the change "
            "that started it: a ratio of such drifts cannot rank the changes, and a ratio near 1 is what it gives.")
    if first != last and math.isfinite(factor0) and factor0 >= merged:
        return out + (f" At step {first} they were still {factor0:.3g}x apart: the drifts merge between steps "
                      f"{first} and {last}, and only before that can a ratio of drifts rank the changes.")
    earlier = ("the next sentence looks there, with the records that have early snapshots"
               if gpu_early_sentence(ds, merged) else
               "no snapshot before it is in a record of every one of these comparisons")
    return out + (f" They are alike at every snapshot all their records share (from step {first}); whether they "
                  f"differ earlier needs earlier snapshots (the campaign's `snapshot_early`): {earlier}.")


def gpu_early_sentence(ds: xr.Dataset, merged: float = MERGED_FACTOR) -> str | None:
    """The side-by-side comparison before the first snapshot all records share, at the snapshots where
    every comparison (repeat, flash, low precision) has at least one record with a drift (records made
    with ``snapshot_early``): each comparison's drift there (geometric mean over the records that have
    it, their number given) and how far apart they are. None when there is no such snapshot."""
    comps = _side_by_side(ds)
    if comps is None:
        return None
    common = gpu_common_steps(ds, comps)
    drift = ds["gpu_drift"].sel(gpu_comparison=comps, gpu_metric="wasserstein")
    count = ds["gpu_n_seeds"].sel(gpu_comparison=comps, gpu_metric="wasserstein")
    snaps = ds["snapshot"].values
    early = [int(s) for i, s in enumerate(snaps) if s > 0 and (not len(common) or s < common[0])
             and np.isfinite(drift.values[:, i]).all()]
    if not early:
        return None

    def listed(step):
        vals, factor = _drifts_at(ds, comps, step)
        n = {c: int(count.sel(gpu_comparison=c, snapshot=step)) for c in comps}
        return (", ".join(f"{v:.3g} for `{c}` ({n[c]} record{'s' if n[c] != 1 else ''})" for c, v in vals.items())
                + (f", {factor:.3g}x apart" if math.isfinite(factor) else ""))

    first, last = early[0], early[-1]
    out = (f"**Earlier, with the records that have early snapshots:** before step "
           f"{int(common[0]) if len(common) else '(none shared)'}, every comparison has a drift at "
           f"{_steps(early)} in at least one record (not all: a comparison's drift there is the geometric mean of "
           f"the records it has). At step {first}: {listed(first)}"
           + (f"; at step {last}: {listed(last)}." if last != first else "."))
    factors = [_drifts_at(ds, comps, s)[1] for s in early]
    apart = [s for s, f in zip(early, factors) if math.isfinite(f) and f >= merged]
    if apart:
        out += (f" They are more than {merged:g}x apart at {len(apart)} of these {len(early)} snapshots (up to step "
                f"{apart[-1]}): there, a ratio of drifts still reflects the size of the change.")
    else:
        out += (f" They are within {merged:g}x of each other already at step {first}: the drifts are alike from the "
                "first snapshot measured, so at no measured step does a ratio of drifts rank the changes by size.")
    return out


def gpu_seed_sentences(ds: xr.Dataset) -> list[str]:
    """For each comparison with two seeds or more: its records' drifts at the last snapshot every one
    of them has, their geometric mean and interval."""
    conf = float(ds.attrs.get("confidence", 0.95))
    out = []
    for comp in map(str, ds["gpu_comparison"].values):
        runs = _runs_of(ds, comp)
        if len(runs) < 2:
            continue
        step = gpu_common_step(ds, [comp])
        if step is None:
            continue
        each = ds["gpu_model_wasserstein"].sel(run=runs, snapshot=step).values
        sub = ds.sel(gpu_comparison=comp, gpu_metric="wasserstein", snapshot=step)
        if (each == 0).any():  # a deterministic device: identical members give a drift of exactly 0
            out.append(f"`{comp}` over its {len(runs)} seeds at step {step}, the last snapshot all have: "
                       + ", ".join(f"{v:.3g}" for v in each) + f" ({int((each == 0).sum())} exactly 0: bitwise "
                       "identical members, so no geometric mean or interval).")
            continue
        out.append(f"`{comp}` over its {len(runs)} seeds at step {step}, the last snapshot all have: "
                   + ", ".join(f"{v:.3g}" for v in each) + f" (geometric mean {float(sub['gpu_drift']):.3g}, "
                   f"{conf:.0%} interval {float(sub['gpu_drift_low']):.3g} to {float(sub['gpu_drift_high']):.3g}); "
                   f"the seeds differ by {each.max() / each.min():.3g}x.")
    return out


def gpu_lowprec_absence(ds: xr.Dataset) -> str | None:
    """Why there is no low-precision/flash ratio to show (None: there is one at some snapshot)."""
    present = set(map(str, ds["gpu_comparison"].values))
    if not present & set(GPU_LOW_PRECISION):
        return f"No low-precision pair record ({' or '.join(GPU_LOW_PRECISION)}) among the gathered records"
    if "flash_vs_fp32" not in present:
        return "No flash_vs_fp32 pair record among the gathered records"
    if "gpu_ratio" not in ds or not np.isfinite(ds["gpu_ratio"].sel(gpu_metric="wasserstein").values).any():
        return "No low-precision snapshot lies within the flash pair's snapshots"
    return None


def gpu_conclusion_lines(ds: xr.Dataset) -> list[str]:
    """What the GPU pair records say on the questions of the CPU conclusions 1-4 (every number computed)."""
    out = []
    rep = gpu_ratio_series(ds, "gpu_repeat", "flash_vs_fp32")
    if "gpu_repeat" not in ds["gpu_comparison"].values:
        out.append("Determinism (conclusion 1): no `gpu_repeat` record, so the GPU drifts have no run-to-run "
                   "yardstick here.")
    else:
        steps = gpu_common_steps(ds, ["gpu_repeat"])
        drift = ds["gpu_drift"].sel(gpu_comparison="gpu_repeat", gpu_metric="wasserstein", snapshot=steps).values
        if len(steps) and (drift == 0).all():
            out.append(f"Determinism (conclusion 1): GPU training was bitwise deterministic here (`gpu_repeat` is 0 at "
                       f"every snapshot, {_steps(steps)}).")
        elif len(steps):
            zero = np.nonzero(drift == 0)[0]
            since = (f"from step {int(steps[zero[-1] + 1])} on" if len(zero) and zero[-1] + 1 < len(steps)
                     else f"at {int((drift > 0).sum())} of {len(steps)} snapshots" if len(zero) else
                     f"from step {int(steps[0])} on")
            out.append(f"Determinism (conclusion 1): GPU training is not bitwise deterministic: two identical runs "
                       f"(`gpu_repeat`) drift apart {since} (model-level W1 {drift[-1]:.3g} at step "
                       f"{int(steps[-1])}), so every GPU drift is read against that pair, not against 0"
                       + (f"; its drift is {rep.min():.3g}x to {rep.max():.3g}x the flash-vs-FP32 pair's "
                          f"({_steps(rep.index)})" if len(rep) else "") + ".")
    absent = gpu_lowprec_absence(ds)
    if absent:
        out.append(f"Golden et al.'s headline (conclusion 2): not tested by these records. {absent}.")
    else:
        for comp in ds["gpu_lowprec"].values:
            ratio = ds["gpu_ratio"].sel(gpu_lowprec=comp, gpu_metric="wasserstein")
            ok = np.nonzero(np.isfinite(ratio.values))[0]
            if len(ok):
                out.append(f"Golden et al.'s headline (conclusion 2): `{comp}` / `flash_vs_fp32` model-level W1 is "
                           f"{np.nanmin(ratio.values):.3g}x to {np.nanmax(ratio.values):.3g}x "
                           f"({_steps(ds['snapshot'].values[ok])}) against their claimed "
                           f"{GOLDEN_RATIO_RANGE[0]:g}-{GOLDEN_RATIO_RANGE[1]:g}x.")
    floor = gpu_ratio_series(ds, "flash_vs_fp32", "noise_floor")
    if len(floor):
        below = int((floor.values < 1).sum())
        out.append(f"Noise floor (conclusion 3): the flash-vs-FP32 drift is below the drift of two init seeds at "
                   f"{below} of {len(floor)} common snapshots ({_steps(floor.index)}; {floor.min():.3g}x to "
                   f"{floor.max():.3g}x).")
    if len(rep) > 1 and (rep.values > 0).all():
        out.append(f"Ratios over time (conclusion 4): the repeat/flash ratio moves from {rep.iloc[0]:.3g}x at step "
                   f"{int(rep.index[0])} to {rep.iloc[-1]:.3g}x at step {int(rep.index[-1])}.")
    seeds = {str(c): int(len(_runs_of(ds, str(c)))) for c in ds["gpu_comparison"].values}
    out.append("Seeds: " + ", ".join(f"`{c}` {n}" for c, n in seeds.items())
               + (" (one seed each: no intervals)." if max(seeds.values()) == 1 else "."))
    return out


def gpu_sentences(ds: xr.Dataset, claim=GOLDEN_RATIO_RANGE) -> list[str]:
    """Issue 13 section 4's questions answered from the gathered pair records (every number computed)."""
    out = []
    gpus = sorted(set(str(g) for g in ds["prov_version_gpu"].values))
    missing = json.loads(ds.attrs.get("missing_runs", "[]"))
    out.append(f"**Campaign.** {ds.sizes['run']} pair record(s) ({', '.join(map(str, ds['run'].values))}) on "
               f"{', '.join(gpus)}; GPU time {float(ds['campaign_gpu_s']):.0f} s for these records and "
               f"{float(ds['campaign_all_gpu_s']):.0f} s for all {int(ds.attrs.get('records_in_folder', 0))} records "
               "of the folder, the whole campaign (sums of the records' "
               "wall_s, each the whole training command from process start)"
               + (f"; campaign runs without a record here: {', '.join(missing)}." if missing else
                  "; every campaign run of this study has a record."))
    table = gpu_drift_table(ds)
    conf = float(ds.attrs.get("confidence", 0.95))
    for comp, row in table.iterrows():
        row = {**row, "seeds": int(row["seeds"]), "last snapshot (step)": int(row["last snapshot (step)"])}
        ci = (f" ({conf:.0%} interval over {row['seeds']} seeds {row['ci low']:.3g} to {row['ci high']:.3g})"
              if row["seeds"] >= 2 else " (one seed: no interval)")
        out.append(f"`{comp}`: model-level W1 drift {row['model wasserstein']:.3g} at step "
                   f"{row['last snapshot (step)']}{ci}.")
    floor = gpu_ratio_series(ds, "flash_vs_fp32", "noise_floor")
    if len(floor):
        last, r = int(floor.index[-1]), float(floor.iloc[-1])
        out.append(f"**Flash against the noise floor:** at step {last}, the last snapshot both pairs have, the "
                   f"flash-vs-FP32 drift is {r:.3g}x the drift between two init seeds ("
                   + ("below" if r < 1 else "above") + f" the floor); {floor.min():.3g}x to {floor.max():.3g}x over "
                   f"their {len(floor)} common snapshots ({_steps(floor.index)}).")
    out += gpu_repeat_sentences(ds)
    if "gpu_ratio" in ds:
        for comp in ds["gpu_lowprec"].values:
            sub = ds.sel(gpu_lowprec=comp, gpu_metric="wasserstein")
            ok = np.nonzero(np.isfinite(sub["gpu_ratio"].values))[0]
            if not len(ok):
                continue
            n = sub["gpu_ratio_n_seeds"].values
            k = _most_seeds_snapshot(n, ok)
            r, lo, hi = (float(sub[v][k]) for v in ("gpu_ratio", "gpu_ratio_low", "gpu_ratio_high"))
            seeds = int(n[k])
            where = (f"{conf:.0%} interval over the {seeds} `{comp}` seeds (each over the flash pair's geometric mean "
                     f"over its seeds) {lo:.3g} to {hi:.3g}: {verdict(lo, hi, claim)}") if np.isfinite(lo) else (
                "one seed, so no interval; the point value lies " +
                ("inside" if claim[0] <= r <= claim[1] else "below" if r < claim[0] else "above") +
                f" the claimed {claim[0]:g}-{claim[1]:g}x")
            text = (f"**Golden et al.'s 2-5x** (their claim: flash causes 2-5x less weight deviation than "
                    f"low-precision training): `{comp}` / `flash_vs_fp32` model-level W1 at step "
                    f"{int(ds['snapshot'][k])} is {r:.3g}: {where}.")
            if k != ok[-1]:
                later = [j for j in ok if j > k]
                text += (" At the later snapshots, which fewer seeds reached, it is "
                         + ", ".join(f"{float(sub['gpu_ratio'][j]):.3g} (step {int(ds['snapshot'][j])}, "
                                     f"{int(n[j])} seed{'s' if n[j] != 1 else ''})" for j in later) + ".")
            out.append(text + _paired_ratio_sentence(ds, sub, comp, conf, claim))
    absent = gpu_lowprec_absence(ds)
    if absent:
        out.append(f"{absent}: the 2-5x ratio cannot be computed.")
    spread = gpu_spread_sentence(ds)
    if spread:
        out.append(spread)
    early = gpu_early_sentence(ds)
    if early:
        out.append(early)
    out += gpu_seed_sentences(ds)
    kind = gpu_kind_sentence(ds)
    if kind:
        out.append(kind)
    return out


def _most_seeds_snapshot(n: np.ndarray, ok) -> int:
    """Of the snapshot indices ``ok``, the last with the most seeds ``n`` among those with two or more (an
    interval needs two), else the last one: a later snapshot that fewer seeds reached gives a wider
    interval over a smaller sample."""
    with_ci = [k for k in ok if n[k] >= 2]
    return [j for j in with_ci if n[j] == max(n[with_ci])][-1] if with_ci else ok[-1]


def _paired_ratio_sentence(ds: xr.Dataset, sub: xr.Dataset, comp: str, conf: float, claim) -> str:
    """The ratio paired by seed (``gpu_ratio_paired``) at the last snapshot with the most seed pairs, set
    beside the unpaired one: empty when no low-precision record has a flash partner of its seeds."""
    if "gpu_ratio_paired" not in sub:
        return ""
    paired = sub["gpu_ratio_paired"].values
    ok = np.nonzero(np.isfinite(paired))[0]
    if not len(ok):
        return ""
    n = sub["gpu_ratio_paired_n_seeds"].values
    k = _most_seeds_snapshot(n, ok)
    lo, hi = float(sub["gpu_ratio_paired_low"][k]), float(sub["gpu_ratio_paired_high"][k])
    seeds = int(n[k])
    spread = (f"{conf:.0%} interval over the {seeds} seed pairs {lo:.3g} to {hi:.3g}: {verdict(lo, hi, claim)}"
              if np.isfinite(lo) else "one seed pair, so no interval")
    return (f" Paired by seed (each `{comp}` record over the `flash_vs_fp32` record of its own init and data seeds, "
            f"so the interval carries the flash pairs' spread as well): {float(paired[k]):.3g} at step "
            f"{int(ds['snapshot'][k])}, {spread}.")



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
            out[f"{comp}_ratio_{metric}_place"] = ("n/a" if not np.isfinite(r) else "inside" if lo <= r <= hi
                                                   else "below" if r < lo else "above")
    return out
