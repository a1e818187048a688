"""The numbers, verdict words and tables that study 01's notebook states, read from a results dataset
(this run's, or a committed GPU run's). No English sentences: each ``*_values`` function returns a flat
``{name: value}`` dict with the same keys whatever the run measured (``None`` where it did not), which the
notebook glues into its prose (``attnum.glue``); each ``*_table`` returns a DataFrame (``None`` when the run
lacks the variable)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import xarray as xr

from ...metrics import STRATA
from .experiments import FP32_STAGE_VARIANTS, MAC_MODES, REDUCTION_SPLIT
from .real_kernels import LONG_SEQUENCE_MIN, boolean_coordinates

if TYPE_CHECKING:
    import pandas as pd

# -- the sources' own numbers (cited as theirs, never as ours) ----------------------------------------

SEED000_MEAN_REL = {512: 0.0005, 1024: 0.0012, 2048: 0.0035, 4096: 0.012}
"""Seed 000's mean relative output errors of its MI210 port by N (the ROCm migration report, an unpublished
source document described in ``docs/sources.md``)."""
SEED000_TAIL_SHARE = 0.62
"""Seed 000: at n = 4096 the last 10% of the denominator's terms contribute 62% of the total error."""
SEED000_TAIL_N = 4096
SEED000_STRATA_EXCESS = {"last_10pct": 0.8, "middle_80pct": 0.3}
"""Seed 000: its port's error above NVIDIA's in the last 10% of positions and in the middle 80%."""

GROWTH_CASES = (("emulator", "all_bf16"), ("emulator", "all_fp16"), ("emulator", "fa2_bf16"), ("emulator", "fa2_fp16"),
                ("emulator", "fa2_fp32"), ("reference", "all_bf16"), ("reference", "all_fp16"), ("reference", "all_fp32"),
                ("reference", "fa2_fp16"))
"""The (kernel, policy) curves whose growth the prose states (keys ``<kernel>_<policy>_*``)."""
POLICIES = tuple(f"{p}_{f}" for p in ("all", "fa2") for f in ("bf16", "fp16", "fp32"))
DOMINANT = 2.0
"""A stage 'dominates' the attribution when its error alone is at least this multiple of the other's."""
REMOVED_GROWTH = 0.75
"""A variant 'removes' the fp32 reference's growth when it removes at least this share of it."""
FP32_STAGE_PLACES = {"score": "score product", "max": "row max", "exp": "exponential", "sum": "row sum",
                     "normalize": "normalisation", "pv": "P·V product"}
"""Short names of the fp32 reference's stages (the words a verdict glues)."""


def keyed(prefix: str, values: dict) -> dict:
    """``values`` with every key prefixed (the notebook's glue keys: ``s01_``, ``s01_gpu_``, ...)."""
    return {prefix + k: v for k, v in values.items()}


def lacking(ds: xr.Dataset | None, *names: str) -> list[str]:
    """The variables of ``names`` that ``ds`` lacks (all of them when there is no dataset)."""
    return list(names) if ds is None else [n for n in names if n not in ds]


def _nan_to_none(x):
    x = float(x)
    return None if not np.isfinite(x) else x


def run_values(ds: xr.Dataset | None) -> dict:
    """Where a dataset came from: its commit (short), device, and its shortest and longest N."""
    if ds is None:
        return {"commit": None, "device": None, "n_min": None, "n_max": None}
    return {"commit": str(ds.attrs.get("git_commit", ""))[:7] or None, "device": ds.attrs.get("device"),
            "n_min": int(ds["seq_len"].min()) if "seq_len" in ds else None,
            "n_max": int(ds["seq_len"].max()) if "seq_len" in ds else None}


def long_sequence_table(ds: xr.Dataset, min_len: int = 8192):
    """Median relative L2 error and flash/reference max-abs ratio for N >= ``min_len``."""
    import pandas as pd

    sel = ds.sel(seq_len=[n for n in ds["seq_len"].values if n >= min_len])
    err = sel["rel_l2_err"].median("seed").to_dataframe()["rel_l2_err"].unstack("seq_len")
    ratio = sel["flash_to_reference_ratio"].median("seed").to_dataframe()["flash_to_reference_ratio"]
    ratio = ratio.unstack("seq_len")
    ratio.index = pd.MultiIndex.from_tuples([("emulator/reference", p, d) for p, d in ratio.index],
                                            names=err.index.names)
    return pd.concat({"rel_l2_err": err, "max_abs_ratio": ratio})


def long_sequence_values(ds: xr.Dataset | None, threshold: float = 10.0) -> dict:
    """Flash ``all_bf16`` at the longest N: its median rel. L2 error, its flash/reference max-error ratio, and
    the first N where that ratio reaches ``threshold`` (Golden et al.'s ~10x; None if never)."""
    out = {"n_max": None, "all_bf16_err": None, "all_bf16_ratio": None, "all_bf16_ratio_first_n": None}
    if ds is None or not {"bf16"} <= set(ds["dtype"].values):
        return out
    ratio = ds["flash_to_reference_ratio"].median("seed").sel(policy="all", dtype="bf16")
    err = ds["rel_l2_err"].median("seed").sel(kernel="emulator", policy="all", dtype="bf16")
    n_max = int(ds["seq_len"].max())
    past = [int(n) for n in ds["seq_len"].values if float(ratio.sel(seq_len=n)) >= threshold]
    return {"n_max": n_max, "all_bf16_err": float(err.sel(seq_len=n_max)),
            "all_bf16_ratio": float(ratio.sel(seq_len=n_max)), "all_bf16_ratio_first_n": past[0] if past else None}


# -- sections 1-2: growth with N -----------------------------------------------------------------------

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


MODEL_WORDS = {"a power law": "power", "√N": "sqrt", "log2 N": "log2"}


def registry_names(ds: xr.Dataset | None) -> xr.Dataset | None:
    """A run written before the ``kernel`` coordinate took the registry's family names (it called the tiled
    emulator "flash"), with the registry's names ("emulator"), so that one reader serves old and new runs."""
    if ds is None or "kernel" not in ds.coords or "flash" not in ds["kernel"].values:
        return ds
    return ds.assign_coords(kernel=["emulator" if str(k) == "flash" else str(k) for k in ds["kernel"].values])


def current_form(ds: xr.Dataset | None) -> xr.Dataset | None:
    """A committed run (``ncio.committed_run``) as this code writes runs today: the registry's kernel names
    (``registry_names``) and booleans for the yes/no coordinates (``real_kernels.boolean_coordinates``: runs
    made before wrote ``real_causal`` as 0/1 integers). None stays None."""
    return boolean_coordinates(registry_names(ds))


def growth_values(ds: xr.Dataset | None) -> dict:
    """For each curve of ``GROWTH_CASES``: ``<kernel>_<policy>_growth`` (median error at the longest N over
    the shortest), ``_exponent`` (power-law fit), ``_r2_power``, ``_r2_sqrt``, ``_r2_log2``, ``_best_model``
    (the model of highest R², as a word of ``MODEL_WORDS``) and ``_rise`` (the word ``"rises at every step"``
    or ``"does not rise at every step"``); None where not measured."""
    t = growth_table(ds) if ds is not None else None
    out = {}
    for kernel, policy in GROWTH_CASES:
        key = f"{kernel}_{policy}"
        row = t.loc[(kernel, policy)] if t is not None and (kernel, policy) in t.index else None
        get = lambda col: None if row is None or col not in row else float(row[col])  # noqa: E731
        out[f"{key}_growth"] = get("last/first")
        out[f"{key}_exponent"] = get("power-law exponent")
        out[f"{key}_r2_power"] = get("R2 power_law")
        out[f"{key}_r2_sqrt"] = get("R2 sqrt_n")
        out[f"{key}_r2_log2"] = get("R2 log2_n")
        out[f"{key}_rise"] = (None if row is None else
                              "rises at every step" if row["monotone rise"] else "does not rise at every step")
        r2 = {name: out[f"{key}_r2_{short}"] for name, short in MODEL_WORDS.items()}
        out[f"{key}_best_model"] = None if None in r2.values() else max(r2, key=r2.get)
    fa2 = [out[f"emulator_fa2_{f}_growth"] for f in ("bf16", "fp16") if out[f"emulator_fa2_{f}_growth"] is not None]
    out["emulator_fa2_low_growth_max"] = max(fa2) if fa2 else None
    return out


# -- section 3: flash against the two references ----------------------------------------------------

def reference_comparison(ds: xr.Dataset, family: str = "fa2") -> "pd.DataFrame | None":
    """Flash against both references, median relative L2 error over seeds: our reference (P rounded to
    the dtype, policy ``<family>_<dtype>``) and fp32 inside (the math backend). None without fp32 inside."""
    import pandas as pd

    if lacking(ds, "fp32_inside_rel_l2_err"):
        return None
    med = ds["rel_l2_err"].median("seed").sel(policy=family)
    inside = ds["fp32_inside_rel_l2_err"].median("seed")
    rows = []
    for fmt in ds["dtype"].values:
        for n in ds["seq_len"].values:
            fl, ref, ins = (float(x.sel(dtype=fmt, seq_len=n)) for x in (med.sel(kernel="emulator"),
                                                                        med.sel(kernel="reference"), inside))
            rows.append({"dtype": fmt, "N": int(n), "emulator": fl, f"reference ({family}, P rounded)": ref,
                         "reference (fp32 inside)": ins, "emulator / reference": fl / ref, "emulator / fp32 inside": fl / ins})
    return pd.DataFrame(rows).set_index(["dtype", "N"])


def reference_comparison_values(ds: xr.Dataset | None) -> dict:
    """Ranges over N of flash/reference and flash/fp32-inside (fa2 policy) for bf16 and fp16."""
    t = reference_comparison(ds) if ds is not None else None
    out = {}
    for fmt in ("bf16", "fp16"):
        sub = t.xs(fmt) if t is not None and fmt in t.index.get_level_values("dtype") else None
        for col, key in (("emulator / reference", "over_reference"), ("emulator / fp32 inside", "over_inside")):
            out[f"{fmt}_{key}_min"] = None if sub is None else float(sub[col].min())
            out[f"{fmt}_{key}_max"] = None if sub is None else float(sub[col].max())
    over_ref = [out[f"{f}_over_reference_max"] for f in ("bf16", "fp16") if out[f"{f}_over_reference_max"] is not None]
    over_inside = [out[f"{f}_over_inside_min"] for f in ("bf16", "fp16") if out[f"{f}_over_inside_min"] is not None]
    out["versus_reference"] = None if not over_ref else "smaller" if max(over_ref) < 1 else "not smaller at every N"
    out["versus_inside"] = None if not over_inside else "larger" if min(over_inside) > 1 else "not larger at every N"
    return out


# -- section 4: Golden et al.'s tile -----------------------------------------------------------------

def golden_tile_values(ds: xr.Dataset) -> dict:
    """Golden et al.'s tile of the block experiment (``tile_q``, ``tile_k``) and its median error over the
    128x128 tile's under the first loop order, for ``all_bf16`` and ``fa2_bf16`` (None where not measured)."""
    import json

    out = {"head_dim": json.loads(ds.attrs.get("parameters", "{}")).get("head_dim"), "tile_q": None, "tile_k": None,
           "all_bf16_over_128": None, "fa2_bf16_over_128": None, "loop_order": str(ds["loop_order"].values[0])}
    configs = set(ds["block_config"].values)
    if "golden" not in configs:
        return out
    g = ds.sel(block_config="golden")
    out.update(tile_q=int(g["tile_q"]), tile_k=int(g["tile_k"]))
    if "128x128" in configs and "bf16" in ds["block_dtype"].values:
        ratio = ds["block_rel_l2_err"].sel(block_config="golden") / ds["block_rel_l2_err"].sel(block_config="128x128")
        ratio = ratio.median("block_seed").sel(loop_order=out["loop_order"], block_dtype="bf16")
        for pol in ("all", "fa2"):
            out[f"{pol}_bf16_over_128"] = float(ratio.sel(policy=pol))
    return out


# -- sections 5-6: strata, acceptance rules, seed 000's metric -----------------------------------------

def strata_table(ds: xr.Dataset, prefix: str = "") -> "pd.DataFrame | None":
    """Median over seeds of the per-stratum mean row error; ``prefix="nomask_"``: without a mask.
    Adds last/first, the ratio seed 000 describes (largest error in the last 10%). None if not measured."""
    var = f"{prefix}strata_rel_l2_err"
    if lacking(ds, var):
        return None
    t = ds[var].median("seed").to_dataframe()[var].unstack("stratum")[list(STRATA)]
    t["last / first"] = t["last_10pct"] / t["first_10pct"]
    t["last / middle"] = t["last_10pct"] / t["middle_80pct"]
    return t


def strata_values(ds: xr.Dataset) -> dict:
    """Range of last/first over kernels, policies and dtypes, with the causal mask and without; and under
    ``fa2`` at bf16 and fp16 (where the prose says the strata nearly agree)."""
    out = {}
    for prefix, name in (("", "causal"), ("nomask_", "nomask")):
        t = strata_table(ds, prefix)
        ratio = None if t is None else t["last / first"]
        out[f"{name}_last_over_first_min"] = None if ratio is None else float(ratio.min())
        out[f"{name}_last_over_first_max"] = None if ratio is None else float(ratio.max())
        if ratio is not None:
            fa2 = ratio[[p == "fa2" and d in ("bf16", "fp16") for _, p, d in ratio.index]] \
                if ratio.index.nlevels == 3 else ratio.iloc[:0]
        out[f"{name}_fa2_last_over_first_min"] = None if ratio is None or not len(fa2) else float(fa2.min())
        out[f"{name}_fa2_last_over_first_max"] = None if ratio is None or not len(fa2) else float(fa2.max())
    return out


def false_alarm_rate(ds: xr.Dataset, rule: str = "reference_relative", kernel: str = "emulator", policy: str = "all",
                     dtype: str = "bf16", min_len: int = LONG_SEQUENCE_MIN) -> tuple[float, int]:
    """The share of (N >= ``min_len``, seed) outputs the rule rejects, and how many outputs there are."""
    p = ds["passes"].sel(rule=rule, kernel=kernel, policy=policy, dtype=dtype)
    p = p.sel(seq_len=[n for n in ds["seq_len"].values if n >= min_len])
    return float(1 - p.astype(float).mean()), int(p.size)


def long_false_alarm_values(ds: xr.Dataset | None, rule: str = "reference_relative",
                            min_len: int = LONG_SEQUENCE_MIN) -> dict:
    """The rule's false-alarm rate on flash at N >= ``min_len`` (``<policy>_rate``, ``<policy>_outputs``) for
    all/fa2 x bf16/fp16; None where the run has no such output."""
    out = {}
    for policy in ("all_bf16", "all_fp16", "fa2_bf16", "fa2_fp16"):
        pol, fmt = policy.split("_")
        ok = ds is not None and fmt in ds["dtype"].values and int(ds["seq_len"].max()) >= min_len
        rate, count = false_alarm_rate(ds, rule, "emulator", pol, fmt, min_len) if ok else (None, None)
        out[f"{policy}_rate"], out[f"{policy}_outputs"] = rate, count
    return out


def acceptance_values(ds: xr.Dataset) -> dict:
    """Per rule and dtype, the false-alarm rate over every N, kernel, policy and seed (keys
    ``<rule>_<dtype>``, rules ``fixed``, ``dynamic``, ``refrel``), the dynamic threshold's range, and the unit
    roundoff of bf16 (what the fixed tolerance is below)."""
    import torch

    short = {"fixed_0.1pct": "fixed", "dynamic_threshold": "dynamic", "reference_relative": "refrel"}
    alarms = 1 - ds["pass_rate"].mean(["seq_len", "kernel", "policy"])
    out = {}
    for rule, name in short.items():
        for fmt in ("bf16", "fp16", "fp32"):
            ok = rule in ds["rule"].values and fmt in ds["dtype"].values
            out[f"{name}_{fmt}"] = float(alarms.sel(rule=rule, dtype=fmt)) if ok else None
    threshold = ds["dynamic_threshold"]
    out["dynamic_threshold_min"], out["dynamic_threshold_max"] = float(threshold.min()), float(threshold.max())
    out["bf16_unit_roundoff"] = float(torch.finfo(torch.bfloat16).eps) / 2
    return out


def seed000_metric_table(ds: xr.Dataset, kernel: str = "emulator") -> "pd.DataFrame | None":
    """Seed 000's metric (mean elementwise relative error) beside ours (relative L2), median over seeds,
    for each policy; seed 000's own numbers where it gives them. None without ``mean_rel_err``."""
    import pandas as pd

    if lacking(ds, "mean_rel_err"):
        return None
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


def seed000_growth_table(ds: xr.Dataset, kernel: str = "emulator", lo: int = 512, hi: int = 4096) -> "pd.DataFrame | None":
    """Seed 000's metric at N = ``lo`` and ``hi`` per policy and its factor, and seed 000's own row; None when
    the run lacks the metric or either length."""
    import pandas as pd

    if lacking(ds, "mean_rel_err") or not {lo, hi} <= {int(n) for n in ds["seq_len"].values}:
        return None
    med = ds["mean_rel_err"].median("seed").sel(kernel=kernel)
    rows = [{"policy": f"{pol}_{fmt}", f"N={lo}": float(med.sel(policy=pol, dtype=fmt, seq_len=lo)),
             f"N={hi}": float(med.sel(policy=pol, dtype=fmt, seq_len=hi))}
            for pol in ds["policy"].values for fmt in ds["dtype"].values]
    rows.append({"policy": "seed 000 (MI210 port)", f"N={lo}": SEED000_MEAN_REL[lo], f"N={hi}": SEED000_MEAN_REL[hi]})
    t = pd.DataFrame(rows).set_index("policy")
    t["factor"] = t[f"N={hi}"] / t[f"N={lo}"]
    return t


def seed000_values(ds: xr.Dataset | None, lo: int = 512, hi: int = 4096) -> dict:
    """Seed 000's own numbers (``seed000_err_lo``, ``_hi``, ``_factor``, the tail share and strata excess) and, from
    ``ds``, the largest factor of its metric from ``lo`` to ``hi`` under ``fa2_*`` and ``all_*`` (None if absent)."""
    out = {"seed000_err_lo": SEED000_MEAN_REL[lo], "seed000_err_hi": SEED000_MEAN_REL[hi],
           "seed000_factor": SEED000_MEAN_REL[hi] / SEED000_MEAN_REL[lo], "seed000_tail_share": SEED000_TAIL_SHARE,
           "seed000_tail_n": SEED000_TAIL_N, "seed000_tail_excess": SEED000_STRATA_EXCESS["last_10pct"],
           "seed000_middle_excess": SEED000_STRATA_EXCESS["middle_80pct"]}
    t = seed000_growth_table(ds) if ds is not None else None
    for family in ("fa2", "all"):
        sub = None if t is None else t["factor"][[i.startswith(family + "_") for i in t.index]]
        out[f"{family}_factor_max"] = None if sub is None or not len(sub) else float(sub.max())
    return out


# -- section 7: which rounding point --------------------------------------------------------------------

def attribution_table(ds: xr.Dataset, dtype: str = "bf16", kernel: str = "emulator") -> "pd.DataFrame":
    """Per N, the all-low error, the error of the statistics alone and of the output accumulator alone, and
    the share of the all-low error (and of its growth since the shortest N) each promotion removes."""
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


def attribution_values(ds: xr.Dataset | None, dtype: str = "bf16") -> dict:
    """The attribution's numbers at the shortest and the longest N (stats/accumulator ratio, share of the
    error and of its growth removed by promoting the statistics), and the first N from which the statistics
    dominate (``stats_dominant_from``; None if never in this run)."""
    keys = ("n_first", "n_last", "ratio_first", "ratio_last", "removed_first", "removed_last", "growth_removed_last",
            "acc_removed_last", "stats_dominant_from")
    if ds is None or dtype not in ds["attribution_dtype"].values:
        return dict.fromkeys(keys)
    df = attribution_table(ds, dtype)
    first, last = df.iloc[0], df.iloc[-1]
    dominant = [int(n) for n, r in df.iterrows() if r["only_stats / only_out_acc"] >= DOMINANT]
    return {"n_first": int(df.index[0]), "n_last": int(df.index[-1]),
            "ratio_first": float(first["only_stats / only_out_acc"]), "ratio_last": float(last["only_stats / only_out_acc"]),
            "removed_first": float(first["removed by promote_stats"]), "removed_last": float(last["removed by promote_stats"]),
            "growth_removed_last": _nan_to_none(last["growth removed by promote_stats"]),
            "acc_removed_last": float(last["removed by promote_out_acc"]),
            "stats_dominant_from": dominant[0] if dominant else None}


def subnormal_values(ds: xr.Dataset) -> dict:
    """fp16's smallest normal number and the largest share of softmax probabilities below it (reference)."""
    from ...precision import min_normal

    frac = ds["p_below_min_normal_frac"]
    fp16 = frac.sel(attribution_dtype="fp16") if "fp16" in frac["attribution_dtype"].values else None
    return {"fp16_min_normal": float(min_normal("fp16")),
            "fp16_below_max": None if fp16 is None else float(fp16.max())}


def denominator_table(ds: xr.Dataset) -> "pd.DataFrame | None":
    """Error with the row sum rounded only in the last 10% of key blocks / with it rounded in every block,
    median over seeds, by dtype (rows) and N (columns). None if not measured."""
    if lacking(ds, "denominator_tail_share"):
        return None
    share = ds["denominator_tail_share"].median("denominator_seed")
    return share.to_pandas()


def denominator_values(ds: xr.Dataset | None, n: int = SEED000_TAIL_N) -> dict:
    """The tail share at N = ``n`` per dtype (None where N = ``n`` was not measured), and its range."""
    t = denominator_table(ds) if ds is not None else None
    out = {}
    for fmt in ("bf16", "fp16"):
        ok = t is not None and fmt in t.index and n in t.columns
        out[f"{fmt}_at_n"] = float(t.loc[fmt, n]) if ok else None
    out["min"] = None if t is None else float(t.values.min())
    out["max"] = None if t is None else float(t.values.max())
    return out


def mac_table(ds: xr.Dataset) -> "pd.DataFrame | None":
    """Seed 000's two-rounding multiply-add: relative L2 error per mode and N, and two_rounding / fma."""
    if lacking(ds, "mac_rel_l2_err"):
        return None
    med = ds["mac_rel_l2_err"].median("mac_seed")
    t = med.to_dataframe()["mac_rel_l2_err"].unstack("mac")[list(MAC_MODES)]
    t["two_rounding / fma"] = t["two_rounding"] / t["fma"]
    return t


def mac_growth_table(ds: xr.Dataset) -> "pd.DataFrame | None":
    """Per policy and dtype: the range of two_rounding / fma over N and each mode's growth (longest / shortest N)."""
    import pandas as pd

    t = mac_table(ds)
    if t is None:
        return None
    rows = []
    for (pol, fmt), sub in t.groupby(level=["policy", "mac_dtype"]):
        row = {"policy": f"{pol}_{fmt}", "two_rounding / fma min": sub["two_rounding / fma"].min(),
               "two_rounding / fma max": sub["two_rounding / fma"].max()}
        row.update({f"{m} growth": sub[m].iloc[-1] / sub[m].iloc[0] for m in MAC_MODES})
        rows.append(row)
    return pd.DataFrame(rows).set_index("policy")


def mac_values(ds: xr.Dataset | None) -> dict:
    """The range of two_rounding / fma over every policy, dtype and N, and its largest growth difference
    (``two_rounding growth / fma growth``, farthest from 1)."""
    t = mac_growth_table(ds) if ds is not None else None
    if t is None:
        return {"ratio_min": None, "ratio_max": None, "growth_ratio_min": None, "growth_ratio_max": None}
    g = t["two_rounding growth"] / t["fma growth"]
    return {"ratio_min": float(t["two_rounding / fma min"].min()), "ratio_max": float(t["two_rounding / fma max"].max()),
            "growth_ratio_min": float(g.min()), "growth_ratio_max": float(g.max())}


# -- section 8b: why the fp32 reference grows ------------------------------------------------------------

def fp32_stage_table(ds: xr.Dataset) -> "pd.DataFrame | None":
    """Median error of each fp32-reference variant by N, and its growth (longest / shortest N)."""
    if lacking(ds, "fp32_stage_rel_l2_err"):
        return None
    t = ds["fp32_stage_rel_l2_err"].median("fp32_stage_seed").to_pandas()
    t["longest / shortest N"] = t.iloc[:, -1] / t.iloc[:, 0]
    return t


def fp32_stage_values(ds: xr.Dataset | None) -> dict:
    """The fp32 reference's growth from the shortest to the longest N (``reference_growth``), whether there is
    growth to attribute (``has_growth``: more than 20%), the variants that remove at least ``REMOVED_GROWTH``
    of it (``causes``, e.g. ``"fp64_pv, pv_split"``; ``"none"``), the stages they change (``cause_stages``),
    the other variants' growth range, the √N growth one running sum would have, and the matmul settings."""
    keys = ("device", "matmul", "n_first", "n_last", "reference_growth", "has_growth", "growth_verdict", "causes", "cause_stages",
            "causes_growth_max", "others_growth_min", "others_growth_max", "sqrt_growth", "split")
    t = fp32_stage_table(ds) if ds is not None else None
    if t is None:
        return dict.fromkeys(keys)
    g = t["longest / shortest N"]
    n0, n1 = int(ds["fp32_stage_seq_len"].values[0]), int(ds["fp32_stage_seq_len"].values[-1])
    growth = g["reference"] - 1
    removed = {v: 1 - (g[v] - 1) / growth for v in g.index if v not in ("reference", "all_fp32")}
    has_growth = bool(growth > 0.2)
    causes = [v for v, r in removed.items() if r >= REMOVED_GROWTH] if has_growth else []
    others = [g[v] for v in removed if v not in causes]
    stages = sorted({v.removeprefix("fp64_").removesuffix("_split") for v in causes})
    return {"device": ds.attrs.get("device"), "matmul": str(ds["fp32_stage_matmul_precision"].values),
            "n_first": n0, "n_last": n1, "reference_growth": float(g["reference"]), "has_growth": has_growth,
            "growth_verdict": "a growth to attribute" if has_growth else "no growth to attribute",
            "causes": ", ".join(causes) or "none", "cause_stages": " and ".join(FP32_STAGE_PLACES[s] for s in stages) or "none",
            "causes_growth_max": float(max(g[v] for v in causes)) if causes else None,
            "others_growth_min": float(min(others)) if others else None,
            "others_growth_max": float(max(others)) if others else None,
            "sqrt_growth": math.sqrt(n1 / n0), "split": REDUCTION_SPLIT}


assert set(FP32_STAGE_VARIANTS) >= {"reference", "all_fp32"}
