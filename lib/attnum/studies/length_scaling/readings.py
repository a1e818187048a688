"""What the notebook states, computed from a results dataset (this run's, or a committed GPU run's)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import xarray as xr

from ...metrics import STRATA
from .experiments import MAC_MODES, REDUCTION_SPLIT
from .real_kernels import LONG_SEQUENCE_MIN, best_fidelity, fidelity_by_length, real_false_alarms

if TYPE_CHECKING:
    import pandas as pd


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


# -- what the notebook states, computed from a results dataset ---------------------------------------

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
