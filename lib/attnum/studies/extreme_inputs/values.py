"""Study 02's values for the notebook's prose: numbers, booleans and lists of names read from a run's
Dataset (no sentences; the notebook words them and glues these with ``attnum.glue.glue_values``).

Each ``*_values(ds)`` returns ``{key: value}`` with keys without a prefix; ``keyed`` adds one. A value the
run cannot give (a missing experiment, no point that qualifies) is None, which glues as n/a.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import torch
import xarray as xr

from ...precision import FORMATS
from .detection import FIXED_TOLERANCE

ROUNDING = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 2.0 ** -24}  # unit roundoff u = 2^-t


def keyed(prefix: str, values: dict) -> dict:
    return {f"{prefix}{k}": v for k, v in values.items()}


def _f(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _names(items) -> str:
    return ", ".join(str(x) for x in items) or "none"


def _range(da: xr.DataArray) -> tuple[float | None, float | None]:
    v = np.asarray(da.values, dtype=float).ravel()
    v = v[np.isfinite(v)]
    return (float(v.min()), float(v.max())) if v.size else (None, None)


# -- section 1: finite-ness -------------------------------------------------------------------------------

def finiteness_values(ds: xr.Dataset) -> dict:
    """Section 1: the families whose output departs from the golden value's finite-ness under each
    policy family (max over N, seeds, kernels and dtypes), the largest masked-key influence under ``fa2``,
    the families that ``all_fp16`` turns all-NaN, the outliers' NaN share under ``all_fp16``, the families
    whose golden output is non-finite everywhere (some dtype), and whether the kernels stay non-finite
    exactly where the golden value is there."""
    size = ds["output_size"]
    wrong = (ds["nan_where_golden_finite"] + ds["inf_where_golden_finite"]) / size
    fams = [str(f) for f in ds["family"].values]
    dtypes = [str(d) for d in ds["dtype"].values]

    def departing(policy, dtype_list):
        w = wrong.sel(policy=policy, dtype=dtype_list).max(["seq_len", "seed", "kernel", "dtype"])
        return [f for f in fams if float(w.sel(family=f)) > 0]

    fa2_low = [d for d in dtypes if d != "fp32"]
    values = {"fa2_departing": _names(departing("fa2", fa2_low)),
              "fp32_departing": _names(departing("fa2", ["fp32"]) if "fp32" in dtypes else []),
              "fa2_masked_influence_max": _f(ds["masked_key_influence"].sel(policy="fa2").max())}
    if "fp16" in dtypes:
        w16 = wrong.sel(policy="all", dtype="fp16")
        all_nan = [f for f in fams if float(w16.sel(family=f).min(["seq_len", "seed", "kernel"])) == 1.0]
        values["all_fp16_all_nan"] = _names(all_nan)
        lo, hi = _range(w16.sel(family="outliers")) if "outliers" in fams else (None, None)
        values.update(all_fp16_outliers_lo=lo, all_fp16_outliers_hi=hi)
    gold = (ds["golden_nonfinite"] / size).min(["seq_len", "seed"])
    everywhere = [f for f in fams if bool((gold.sel(family=f) == 1).any())]
    values["golden_nonfinite_families"] = _names(everywhere)
    if everywhere:
        finite_there = ds["finite_where_golden_nonfinite"].sel(family=everywhere).max()
        values["propagate_nan"] = bool(float(finite_there) == 0)
    else:
        values["propagate_nan"] = None
    if "fully_masked_rows" in fams:
        fm = ds.sel(family="fully_masked_rows")
        values["fully_masked_zero"] = bool(float(fm["nonzero_rows"].max()) == 0 and float(fm["zero_rows"].max()) == 0)
    return values


# -- section 2: amplification ----------------------------------------------------------------------------

PROSE_AMPLIFICATION = (("fa2", "fp16", "logit_targeted"), ("fa2", "bf16", "normal_sigma100"), ("fa2", "bf16", "outliers"),
                       ("all", "bf16", "normal_sigma10"), ("all", "bf16", "normal_sigma100"), ("all", "bf16", "sawtooth"),
                       ("all", "bf16", "logit_targeted"), ("fa2", "fp32", "normal_sigma10"), ("fa2", "fp32", "pm_1e6"),
                       ("fa2", "fp32", "normal_sigma100"))
"""The (policy family, dtype, family) groups whose amplification section 2's prose states."""


def amplification_values(ds: xr.Dataset, groups=PROSE_AMPLIFICATION) -> dict:
    """Section 2: the range (over N and both kernels) of the amplification of each (policy, dtype, family)
    group, keyed ``amp_<policy>_<dtype>_<family>_lo/hi`` (None where the run lacks the group); under ``fa2``
    at bf16 and fp16 the largest amplification over the families other than ``logit_targeted``
    (``amp_fa2_low_max``); and the largest of all (``amp_max``)."""
    amp = ds["amplification"]
    values = {}
    for pol, fmt, fam in groups:
        lo = hi = None
        if fmt in ds["dtype"].values and fam in ds["family"].values:
            lo, hi = _range(amp.sel(policy=pol, dtype=fmt, family=fam))
        values[f"amp_{pol}_{fmt}_{fam}_lo"], values[f"amp_{pol}_{fmt}_{fam}_hi"] = lo, hi
    low = [d for d in ("bf16", "fp16") if d in ds["dtype"].values]
    others = [f for f in ds["family"].values if f not in ("normal", "logit_targeted")]
    values["amp_fa2_low_max"] = _range(amp.sel(policy="fa2", dtype=low, family=others))[1] if low else None
    values["amp_max"] = _range(amp)[1]
    return values


def format_facts() -> dict:
    """Facts of the formats the prose uses (computed, not measured): u_fp32 times a score of 6e4, the
    spacing of bf16 numbers at 6e4, fp16's largest number and one score of q = k = v = 65504 at d = 128."""
    big = 6e4
    bf16_spacing = 2.0 ** (math.floor(math.log2(big)) - 7)
    fp16_max = float(torch.finfo(FORMATS["fp16"]).max)
    return {"u32_times_6e4": ROUNDING["fp32"] * big, "bf16_spacing_6e4": bf16_spacing, "fp16_max": fp16_max,
            "score_65504_d128": fp16_max ** 2 * SEED003_HEAD_DIM}


# -- section 3: overflow ---------------------------------------------------------------------------------

def overflow_values(ds: xr.Dataset) -> dict:
    """Section 3: which (kernel, score format, max subtraction) gave every entry NaN, and the error of the
    one(s) that gave a finite answer."""
    nan = ds["overflow_nan_fraction"]
    err = ds["overflow_max_abs_err"]
    cases = [(str(k), str(s), str(m)) for k in nan["overflow_kernel"].values for s in nan["score_format"].values
             for m in nan["max_subtraction"].values]
    finite = [c for c in cases if float(nan.sel(overflow_kernel=c[0], score_format=c[1], max_subtraction=c[2])) == 0]
    all_nan = [c for c in cases if float(nan.sel(overflow_kernel=c[0], score_format=c[1], max_subtraction=c[2])) == 1]
    applicable = [c for c in cases if math.isfinite(float(nan.sel(overflow_kernel=c[0], score_format=c[1],
                                                                     max_subtraction=c[2])))]
    return {"head_dim": int(ds["overflow_head_dim"]), "seq_len": int(ds["overflow_seq_len"]),
            "golden": float(ds["overflow_golden_value"]),
            "finite_cases": _names(f"{k} (scores {s}, max subtracted: {m})" for k, s, m in finite),
            "only_fp32_and_max": bool(finite) and all(s == "fp32" and m == "yes" for _, s, m in finite),
            "all_nan_others": len(all_nan) == len(applicable) - len(finite),
            "finite_err_max": _f(max(float(err.sel(overflow_kernel=k, score_format=s, max_subtraction=m))
                                     for k, s, m in finite)) if finite else None}


# -- section 4: sentinels --------------------------------------------------------------------------------

def _logit(case: str) -> float | None:
    return float(case.split("_", 1)[1]) if case.startswith("logit_") else None


def sentinel_values(ds: xr.Dataset) -> dict:
    """Section 4: the logit cases the -5e4 fill zeroes in every policy (and the -1e4 fill), those it gets
    right under ``fa2_*`` (relative L2 within 10 u of the policy's P format), the masked-key influence
    range with finite fills on visible logits of -6e4 (``fa2_*``), the additive -1e4 mask on masked
    scores of 1e5, which handlings give 0 on fully masked rows under ``fa2_*``."""
    zero = ds["sentinel_zero_row_fraction"].max("seed")
    infl = ds["sentinel_masked_key_influence"].max("seed")
    nonzero = ds["sentinel_nonzero_row_fraction"].max("seed")
    nan = ds["sentinel_nan_fraction"].max("seed")
    pols = [str(p) for p in ds["sentinel_policy"].values]
    fa2 = [p for p in pols if p.startswith("fa2_")]
    logits = [str(c) for c in ds["case"].values if _logit(str(c)) is not None]
    values = {}
    for fill in ("fill_-5e4", "fill_-1e4"):
        if fill in ds["mask_handling"].values:
            z = zero.sel(mask_handling=fill)
            key = fill.replace("fill_", "fill").replace("-", "m")
            values[f"{key}_zeroed"] = _names(f"{_logit(c):.4g}" for c in logits
                                            if float(z.sel(case=c, sentinel_policy=pols).min()) == 1)
            values[f"{key}_kept"] = _names(f"{_logit(c):.4g}" for c in logits
                                          if float(z.sel(case=c, sentinel_policy=fa2).max()) == 0)
    if "fill_-inf" in ds["mask_handling"].values:
        fix = ds["sentinel_rel_l2_err"].max("seed").sel(mask_handling="fill_-inf", sentinel_policy=fa2)
        values["fill_inf_rel_max"] = _f(fix.max())
    if "masked_huge_valid_-6e4" in ds["case"].values:
        fin = [m for m in ("fill_-5e4", "fill_-1e4") if m in ds["mask_handling"].values]
        lo, hi = _range(infl.sel(case="masked_huge_valid_-6e4", mask_handling=fin, sentinel_policy=fa2))
        values.update(finite_fill_influence_lo=lo, finite_fill_influence_hi=hi)
    if "additive_-1e4" in ds["mask_handling"].values and "masked_huge" in ds["case"].values:
        values["additive_m1e4_influence_min"] = _range(infl.sel(case="masked_huge", mask_handling="additive_-1e4",
                                                                 sentinel_policy=fa2))[0]
    if "fully_masked" in ds["case"].values:
        ok = [str(m) for m in ds["mask_handling"].values
              if float(nonzero.sel(case="fully_masked", mask_handling=m, sentinel_policy=fa2).max()) == 0
              and float(nan.sel(case="fully_masked", mask_handling=m, sentinel_policy=fa2).max()) == 0]
        values["fully_masked_zero_handlings"] = _names(ok)
        if "softmax_unguarded" in ds["mask_handling"].values:
            values["unguarded_fully_masked_nan"] = bool(float(nan.sel(
                case="fully_masked", mask_handling="softmax_unguarded", sentinel_policy=fa2).min()) > 0)
    return values


def onset_values(ds: xr.Dataset) -> dict:
    """Section 4, the onset scan: per policy the predicted onset (raw logits), its distance below the
    sentinel, whether the measured interval (highest zeroed row, lowest row not zeroed) contains it and how
    far the interval's edge is from it; and under ``fa2_*`` the largest relative error (above 0.1) of an
    output that is not zero (the ragged edge), with its policy and target logit."""
    from .readings import onset_table

    table = onset_table(ds)
    fill = float(ds["onset_fill"])
    values = {"fill": fill}
    below = []
    for pol, row in table.iterrows():
        key = str(pol)
        pred, hi_zero, lo_ok = row["predicted onset"], row["highest row-max logit zeroed"], row["lowest row-max logit not zeroed"]
        values[f"onset_{key}_predicted"] = _f(pred)
        values[f"onset_{key}_below_fill"] = _f(fill - pred)
        values[f"onset_{key}_contains"] = bool(hi_zero <= pred <= lo_ok) if math.isfinite(hi_zero) and math.isfinite(lo_ok) else None
        values[f"onset_{key}_edge_offset"] = _f(lo_ok - pred) if math.isfinite(lo_ok) else None
        if key.startswith("fa2_"):
            below.append(fill - pred)
    values["onset_fa2_below_lo"] = min(below) if below else None
    values["onset_fa2_below_hi"] = max(below) if below else None
    values["onset_fa2_all_contain"] = all(values[f"onset_{p}_contains"] is True for p in table.index if str(p).startswith("fa2_")) \
        if below else None
    # the ragged edge: rows not all zero whose error is far above rounding
    fa2 = [p for p in ds["sentinel_policy"].values if str(p).startswith("fa2_")]
    err = ds["onset_rel_l2_err"].sel(sentinel_policy=fa2)
    wrong = err.where((err > 0.1) & (err != 1.0))  # 1.0: a zero output; above 0.1: far beyond rounding
    if bool(wrong.notnull().any()):
        idx = np.unravel_index(int(np.nanargmax(wrong.values)), wrong.shape)
        values.update(onset_ragged_err=float(wrong.values[idx]), onset_ragged_logit=float(wrong["onset_logit"].values[idx[0]]),
                      onset_ragged_policy=str(wrong["sentinel_policy"].values[idx[1]]))
    else:
        values.update(onset_ragged_err=None, onset_ragged_logit=None, onset_ragged_policy=None)
    return values


# -- section 5: detection --------------------------------------------------------------------------------

def detection_values(ds: xr.Dataset) -> dict:
    """Section 5: the correct kernel's median relative L2 error per detection dtype, the dynamic threshold's
    smallest value at fp16 (the largest is its cap), the faults ``scaled_elementwise_lse`` catches at their
    default severity at every N in every dtype, its false alarms (detection sweep and the finite families of
    the family sweep at bf16/fp16), and the longest N at which each output-only rule caught
    ``dropped_tail`` at fp16."""
    from .readings import caught
    from ...acceptance import dynamic_threshold

    values = {f"correct_rel_{d}": _f(ds["det_correct_rel_l2_err"].sel(det_dtype=d).median())
              for d in [str(x) for x in ds["det_dtype"].values]}
    values["det_n_max"] = int(ds["det_seq_len"].max())
    values["det_n_min"] = int(ds["det_seq_len"].min())
    hit = caught(ds).max("det_family")
    rule = "scaled_elementwise_lse"
    if rule in ds["rule"].values:
        every = []
        for fault in ds["fault"].values:
            lev = int(ds["default_level"].sel(fault=fault))
            h = hit.sel(rule=rule, fault=fault, severity_level=lev)
            if bool((h == 1).all()):
                every.append(str(fault))
        values["lse_caught_every_n"] = len(every)
        values["faults"] = int(ds["fault"].size)
        values["lse_false_alarm_det"] = _f(ds["det_false_alarm_rate"].sel(rule=rule).max())
        low = [d for d in ("bf16", "fp16") if d in ds["dtype"].values]
        fam = ds["family_false_alarm"].sel(rule=rule, dtype=low)
        values["lse_false_alarm_families"] = _f(fam.max())  # NaN where the golden output is not finite
    if "dropped_tail" in ds["fault"].values and "fp16" in ds["det_dtype"].values:
        lev = int(ds["default_level"].sel(fault="dropped_tail"))
        h = hit.sel(fault="dropped_tail", severity_level=lev, det_dtype="fp16")
        lens = ds["det_seq_len"].values
        for r in ds["rule"].values:
            at = lens[h.sel(rule=r).values.astype(bool)]
            key = str(r).replace(".", "_")
            values[f"dropped_tail_fp16_{key}_n_max"] = int(at.max()) if at.size else None
            values[f"dropped_tail_fp16_{key}_every_n"] = bool(at.size == lens.size)
    for r in ds["rule"].values:
        key = str(r).replace(".", "_")
        for d in [str(x) for x in ds["det_dtype"].values]:
            values[f"{key}_false_alarm_{d}"] = _f(ds["det_false_alarm_rate"].sel(rule=r, det_dtype=d).mean())
        values[f"{key}_false_alarm_max"] = _f(ds["det_false_alarm_rate"].sel(rule=r).max())
        every = [str(f) for f in ds["fault"].values if bool((hit.sel(
            rule=r, fault=f, severity_level=int(ds["default_level"].sel(fault=f))) == 1).all())]
        values[f"{key}_caught_every_n"] = len(every)
    for fam in ("normal", "outliers"):
        if fam in ds["det_family"].values and "fp16" in ds["det_dtype"].values:
            x = ds["det_input_abs_max"].sel(det_family=fam, det_dtype="fp16")
            t = [dynamic_threshold(int(n), float(x.sel(det_seq_len=n).max()), "fp16") for n in ds["det_seq_len"].values]
            values[f"dynamic_fp16_{fam}_lo"], values[f"dynamic_fp16_{fam}_hi"] = min(t), max(t)
    if "dynamic_fp16_normal_hi" in values and "correct_rel_fp16" in values:
        values["dynamic_fp16_below_correct"] = bool(values["dynamic_fp16_normal_hi"] < values["correct_rel_fp16"])
    return values


def fp32_tie_values(ds: xr.Dataset) -> dict:
    """The share of (N, seed) points of the fp32 ``pm_1e6`` family at which each rule rejects the correct
    kernel (the scaled rules' share is the one the prose names)."""
    if "pm_1e6" not in ds["family"].values or "fp32" not in ds["dtype"].values:
        return {"pm1e6_fp32_scaled_false_alarm": None}
    fa = ds["family_false_alarm"].sel(family="pm_1e6", dtype="fp32").mean(["seq_len", "seed"])
    return {"pm1e6_fp32_scaled_false_alarm": _f(fa.sel(rule=["scaled_elementwise", "scaled_elementwise_lse"]).max()),
            "pm1e6_fp32_fixed_false_alarm": _f(fa.sel(rule="fixed_0.1pct"))}


# -- section 6: the fixed tolerance ----------------------------------------------------------------------

def fixed_tolerance_usable(by_metric: pd.DataFrame) -> pd.DataFrame:
    """Per dtype and metric of ``readings.fixed_tolerance_by_metric``: the N at which the fixed tolerance
    accepts the correct kernel everywhere, there the least and most of the faulty outputs (worst row off by
    >= 10%) it accepts, and the largest worst-row error it accepts."""
    rows = []
    for (fmt, metric), sub in by_metric.groupby(level=["dtype", "metric"]):
        sub = sub.droplevel(["dtype", "metric"])
        usable = sub[sub["rejects correct"] == 0]
        rows.append({"dtype": fmt, "metric": metric,
                     "usable at N": ", ".join(str(int(n)) for n in usable.index) or "none",
                     "accepts of faulty >= 10%, least": usable["of those accepted"].min() if len(usable) else math.nan,
                     "accepts of faulty >= 10%, most": usable["of those accepted"].max() if len(usable) else math.nan,
                     "largest accepted worst-row error": usable["largest accepted worst-row error"].max()
                     if len(usable) else math.nan})
    return pd.DataFrame(rows).set_index(["dtype", "metric"])


def dilution_reach(ds: xr.Dataset) -> dict:
    """Section 6: the largest single-row error a relative-L2 tolerance of 0.1% can miss at the detection
    sweep's longest N for a row of typical size: 0.1% * sqrt(batch * heads * N)."""
    rows = float(ds["dil_rows"].values[0]) / float(ds["dil_seq_len"].values[0]) * float(ds["det_seq_len"].max())
    return {"det_typical_row_reach": FIXED_TOLERANCE * math.sqrt(rows)}


# -- section 7: real kernels (CPU) -----------------------------------------------------------------------

def real_error_values(ds: xr.Dataset, kernel_names=("sdpa:flash", "sdpa:math")) -> dict:
    """Section 7: per kernel of ``kernel_names`` (the CPU's two backends, whose outcomes the prose states) and
    dtype, the relative L2 error on each input named below where the kernel's output agrees with the golden
    value's finite-ness (no zero rows; else None; on the ``scores_*`` inputs also its zero rows and NaN share), keyed
    ``real_<kernel>_<dtype>_<input>`` (characters of a kernel name other than [a-z0-9_] as ``_``), the count of points that
    gave no output for a reason other than "not applicable", and the fp32 score spacing at 2 * fp16's
    largest number times sqrt(d)."""
    from .real_kernels import _cells, _real_label

    cell = _cells(ds)
    values = {}
    status = ds["real_status"].values.astype(str).ravel()
    values["real_no_output"] = int(sum(1 for s in status if s != "ok" and not s.startswith("not applicable")))
    present = ({str(x) for x in ds["real_kernel"].values}, {str(x) for x in ds["real_dtype"].values},
               {str(x) for x in ds["real_input"].values})
    for k in kernel_names:
        for f in ("bf16", "fp16"):
            for i in ("normal", "pm_1e6", "scores_near_max", "scores_near_min", "scores_beyond_max"):
                key = re.sub(r"[^a-z0-9_]", "_", f"real_{k}_{f}_{i}".lower())  # a glue key
                extra = i.startswith("scores_")  # the prose says how these depart
                if not (k in present[0] and f in present[1] and i in present[2]):
                    values.update({key: None, **({f"{key}_zero_rows": None, f"{key}_nan": None} if extra else {})})
                    continue
                c = cell(k, f, i, "none")
                code, _ = _real_label(c)
                e = float(c["real_rel_l2_err"])
                values[key] = e if code == 0 and math.isfinite(e) else None
                if extra:
                    values[f"{key}_zero_rows"] = _f(c["real_zero_rows"])
                    values[f"{key}_nan"] = _f(c["real_nan_fraction"])
    d = int(ds["real_head_dim"])
    score = 2 * float(torch.finfo(FORMATS["fp16"]).max)
    values["fp32_spacing_2x_fp16_max"] = 2.0 ** (math.floor(math.log2(score)) - 23)
    values["bf16_half_max_raw"] = 0.5 * float(torch.finfo(FORMATS["bf16"]).max) * math.sqrt(d)
    values["fp32_max"] = float(torch.finfo(torch.float32).max)
    return values


def real_kernel_error_spread(ds: xr.Dataset | None) -> pd.DataFrame:
    """Like with like for seed 000's "3-5x" (one platform's kernel over another's on the same extreme
    inputs): per dtype and input without a mask, where at least two real kernels agree with the golden
    value's finite-ness, the largest and smallest relative L2 error among them, their ratio, and which
    kernels they are."""
    if ds is None or "real_status" not in ds:
        return pd.DataFrame(columns=["dtype", "input", "kernels", "least", "by", "most", "by ", "most / least"])
    from .real_kernels import _cells, _real_label

    cell = _cells(ds)
    rows = []
    for f in [str(x) for x in ds["real_dtype"].values]:
        for i in [str(x) for x in ds["real_input"].values]:
            if float(ds["real_golden_nonfinite"].sel(real_dtype=f, real_input=i)) != 0:
                continue
            errs = {}
            for k in [str(x) for x in ds["real_kernel"].values]:
                c = cell(k, f, i, "none")
                if str(np.asarray(c["real_status"])) != "ok":
                    continue
                e = float(c["real_rel_l2_err"])
                if _real_label(c)[0] == 0 and math.isfinite(e) and e > 0:
                    errs[k] = e
            if len(errs) < 2:
                continue
            lo, hi = min(errs, key=errs.get), max(errs, key=errs.get)
            rows.append({"dtype": f, "input": i, "kernels": len(errs), "least": errs[lo], "by": lo,
                         "most": errs[hi], "by ": hi, "most / least": errs[hi] / errs[lo]})
    return pd.DataFrame(rows, columns=["dtype", "input", "kernels", "least", "by", "most", "by ", "most / least"])


def spread_values(table: pd.DataFrame) -> dict:
    """The kernel-over-kernel ratio of ``real_kernel_error_spread`` on N(0, 1) inputs and over the extreme
    inputs (every other input): median, least and most, and on how many (dtype, input) points."""
    if not len(table):
        return dict.fromkeys(("extreme_hi_input", "normal_lo", "normal_hi", "extreme_median", "extreme_lo", "extreme_hi",
                              "extreme_points", "extreme_in_3_5"))
    normal = table[table["input"] == "normal"]["most / least"]
    extreme = table[table["input"] != "normal"]["most / least"]
    top = table.loc[extreme.idxmax()] if len(extreme) else None
    return {"extreme_hi_input": None if top is None else f"{top['input']} ({top['dtype']})",
            "normal_lo": _f(normal.min()) if len(normal) else None,
            "normal_hi": _f(normal.max()) if len(normal) else None,
            "extreme_median": _f(extreme.median()) if len(extreme) else None,
            "extreme_lo": _f(extreme.min()) if len(extreme) else None,
            "extreme_hi": _f(extreme.max()) if len(extreme) else None,
            "extreme_points": int(len(extreme)),
            "extreme_in_3_5": int(((extreme >= SEED000_KERNEL_RATIO[0]) & (extreme <= SEED000_KERNEL_RATIO[1])).sum())}


# -- the sources' own numbers (theirs, never ours; docs/sources.md names each source), each marked [src] ---------

SEED000_KERNEL_RATIO = (3.0, 5.0)
"""[src] Seed 000 (the ROCm migration report): on extreme inputs its AMD port's error was this many times the
NVIDIA original's (low, high)."""
SEED000_MIX = {"regular": 0.80, "extreme": 0.15, "special": 0.05}
"""[src] Seed 000's test-data mix, per entry: values uniform in [-10, 10], +-1e6, special values
(``attnum.inputs.seed000_mix_family`` draws it; a test checks the drawn shares against these)."""
SEED003_SCORE = 4.29e9
"""[src] Seed 003 (the MI50 port's engineering checks): QK^T at q = k = v = 65504, d = 128, as it quotes it."""
SEED003_HEAD_DIM = 128
"""[src] Seed 003's head dimension of that overflow test."""
SEED002_PRODUCTION_LOGIT = -2.45e5
"""[src] Seed 002 (summary of mask sentinels): the raw logits a production model reached under FlashInfer's
finite sentinel (also the lowest of FlashInfer's regression targets, ``attnum.inputs.FLASHINFER_TARGET_LOGITS``)."""
REFERENCE_RELATIVE_SHIFT = 0.3
"""[src] The FlashAttention tests' floor 2 max|(g + 0.3 - 0.3) - g| (``tests/test_flash_attn.py``), as
``attnum.acceptance.dtype_floor`` computes it (a test checks the two agree)."""


def source_values() -> dict:
    """The sources' numbers the prose cites (keys without the notebook's prefix): seed 000's fixed tolerance
    and the error it says that tolerance missed (the study's ``FIXED_TOLERANCE`` and ``SEED000_MISSED_ERROR``,
    which the experiments use), its kernel-over-kernel ratio and test-data mix; seed 003's quoted score and
    head dimension; seed 002's production logit."""
    from .detection import SEED000_MISSED_ERROR

    return {"seed000_tolerance": FIXED_TOLERANCE, "seed000_missed_error": SEED000_MISSED_ERROR,
            "seed000_ratio_lo": SEED000_KERNEL_RATIO[0], "seed000_ratio_hi": SEED000_KERNEL_RATIO[1],
            "seed000_mix_regular": SEED000_MIX["regular"], "seed000_mix_extreme": SEED000_MIX["extreme"],
            "seed000_mix_special": SEED000_MIX["special"], "seed003_score": SEED003_SCORE,
            "seed003_head_dim": SEED003_HEAD_DIM, "seed002_production_logit": SEED002_PRODUCTION_LOGIT,
            "reference_shift": REFERENCE_RELATIVE_SHIFT}


def _default(fn, name: str):
    import inspect

    return inspect.signature(fn).parameters[name].default


def definition_values() -> dict:
    """The definitions the prose states, read from the code that uses them (so the two cannot disagree):
    input families' defaults (``attnum.inputs``), the acceptance rules' factors (``attnum.acceptance``), the
    real-kernel score targets and padding share (``real_kernels``)."""
    from ... import acceptance, inputs
    from .real_kernels import _PADDING_FRACTION, REAL_SCORE_TARGETS

    return {"sparse_zero_fraction": _default(inputs.sparse_family, "zero_fraction"),
            "fully_masked_row_fraction": _default(inputs.fully_masked_rows_family, "masked_row_fraction"),
            "masked_key_fraction": _default(inputs.masked_huge_scores_family, "masked_fraction"),
            "reference_factor": _default(acceptance.reference_relative_rule, "c"),
            "scaled_factor": _default(acceptance.scaled_elementwise_rule, "c"),
            "scaled_floor": _default(acceptance.scaled_elementwise_rule, "floor"),
            "score_near_max": REAL_SCORE_TARGETS["scores_near_max"],
            "score_beyond_max": REAL_SCORE_TARGETS["scores_beyond_max"],
            "score_near_min": REAL_SCORE_TARGETS["scores_near_min"],
            "padding_fraction": _PADDING_FRACTION}
