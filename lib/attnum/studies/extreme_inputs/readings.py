"""Study 02's readings of its results: tables and values computed from the Dataset (no kernel runs)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import xarray as xr

from ...kernels import FAULTS
from .detection import FIXED_TOLERANCE, SEED000_MISSED_ERROR


def _kernel_column(table: pd.DataFrame) -> pd.Series:
    """The registry name of each row's (kernel, policy, dtype): the ``kernel_name`` coordinate, or for a run
    written without it the family and the policy (``emulator/fa2_bf16``)."""
    if "kernel_name" in table:
        return table["kernel_name"].astype(str)
    return table["kernel"] + "/" + table["policy"] + "_" + table["dtype"]


def amplification_table(ds: xr.Dataset, seq_len: int) -> pd.DataFrame:
    """Amplification at one N: families down, kernels (registry names) across."""
    amp = ds["amplification"].sel(seq_len=seq_len).to_dataframe().reset_index()
    amp["column"] = _kernel_column(amp)
    return amp.pivot(index="family", columns="column", values="amplification").loc[list(ds["family"].values)]


def finiteness_table(ds: xr.Dataset) -> pd.DataFrame:
    """Per family: golden non-finite fraction, and per kernel/policy/dtype the fraction of entries
    whose finite-ness disagrees with the golden output (max over N and seeds); kernels by registry name."""
    size = ds["output_size"]
    wrong = (ds["nan_where_golden_finite"] + ds["inf_where_golden_finite"] + ds["finite_where_golden_nonfinite"])
    frac = (wrong / size).max(["seq_len", "seed"])
    table = frac.to_dataframe(name="disagree").reset_index()
    table["column"] = _kernel_column(table)
    wide = table.pivot(index="family", columns="column", values="disagree")
    gold = (ds["golden_nonfinite"] / size).max(["seq_len", "seed"]).to_dataframe(name="g")["g"].unstack("dtype")
    wide.insert(0, "golden non-finite", gold.max(axis=1))
    return wide.loc[list(ds["family"].values)]


def onset_table(ds: xr.Dataset) -> pd.DataFrame:
    """Per policy: the measured onset interval (in row-max logits) against the prediction."""
    rows = []
    for i, policy in enumerate(ds["sentinel_policy"].values):
        logit = ds["onset_row_max_logit"].sel(sentinel_policy=policy).values.ravel()
        zero = ds["onset_row_zero"].sel(sentinel_policy=policy).values.ravel().astype(bool)
        rows.append({
            "policy": str(policy),
            "highest row-max logit zeroed": float(logit[zero].max()) if zero.any() else math.nan,
            "lowest row-max logit not zeroed": float(logit[~zero].min()) if (~zero).any() else math.nan,
            "predicted onset": float(ds["onset_predicted_logit"].sel(sentinel_policy=policy)),
            "rows zeroed": f"{int(zero.sum())}/{zero.size}",
        })
    return pd.DataFrame(rows).set_index("policy")


def caught(ds: xr.Dataset) -> xr.DataArray:
    """1 where a rule discriminates a fault at (severity, family, N, dtype): the fault changed the
    output in every seed, the rule rejects the faulty kernel in every seed and accepts the correct
    kernel in every seed."""
    detected_all = ds["det_detected"].min("det_seed")
    applicable = ds["det_fault_changed"].min("det_seed")
    clean = 1 - ds["det_false_alarm"].max("det_seed")
    return (detected_all * applicable * clean).astype(np.int8)


def _n_ranges(values) -> str:
    return ",".join(str(int(v)) for v in values) if len(values) else "-"


def detection_headline(ds: xr.Dataset, dtype: str) -> pd.DataFrame:
    """For each fault and rule at one dtype: the mildest severity caught (at any N and family), and
    the N at which the default severity is caught; "missed" lists N where the default-severity
    fault changed the output but the rule did not catch it (for any family)."""
    sub = ds.sel(det_dtype=dtype)
    hit = caught(sub).max("det_family")  # rule, fault, severity_level, det_seq_len
    present = sub["det_fault_changed"].min("det_seed").max("det_family")  # fault, severity_level, det_seq_len
    lens = ds["det_seq_len"].values
    table = {}
    for rule in ds["rule"].values:
        col = []
        for fault in ds["fault"].values:
            h = hit.sel(rule=rule, fault=fault)
            levels = [lev for lev in ds["severity_level"].values if bool(h.sel(severity_level=lev).max())]
            sev = f"{ds['severity'].sel(fault=fault, severity_level=levels[0]).item():g}" if levels else "-"
            lev = int(ds["default_level"].sel(fault=fault))
            at_default = h.sel(severity_level=lev).values.astype(bool)
            there = present.sel(fault=fault, severity_level=lev).values.astype(bool)
            text = f"sev {sev}; N {_n_ranges(lens[at_default])}"
            if (there & ~at_default).any():
                text += f" (missed N {_n_ranges(lens[there & ~at_default])})"
            col.append(text)
        table[rule] = col
    df = pd.DataFrame(table, index=list(ds["fault"].values))
    df.index.name = f"fault, fa2_{dtype}"
    return df


def fixed_tolerance_by_metric(ds: xr.Dataset, big: float = 0.1) -> pd.DataFrame:
    """The detection sweep's fixed 0.1% tolerance on both of seed 000's candidate metrics, side by side:
    per dtype, N and metric (relative L2, mean relative error), the fraction of (family, seed) points
    where it rejects the correct kernel, the fraction of faulty outputs (that changed) with a worst row
    off by >= ``big`` that it accepts, and the largest worst-row error of a faulty output it accepts."""
    rows = []
    changed = ds["det_fault_changed"] == 1
    worst = ds["det_fault_worst_row_err"]
    for fmt in ds["det_dtype"].values:
        for n in ds["det_seq_len"].values:
            sel = dict(det_dtype=fmt, det_seq_len=n)
            for metric, fault_var, correct_var in (("rel_l2", "det_fault_rel_l2_err", "det_correct_rel_l2_err"),
                                                    ("mean_rel", "det_fault_mean_rel_err", "det_correct_mean_rel_err")):
                if fault_var not in ds:
                    continue
                accepted = (ds[fault_var] <= FIXED_TOLERANCE).sel(**sel)
                ch, w = changed.sel(**sel), worst.sel(**sel)
                large = ch & (w >= big)
                n_large = int(large.sum())
                missed = w.where(ch & accepted)
                rows.append({"dtype": str(fmt), "N": int(n), "metric": metric,
                             "rejects correct": float((ds[correct_var].sel(**sel) > FIXED_TOLERANCE).mean()),
                             f"faulty, worst row >= {big:.0%}": n_large,
                             "of those accepted": float((accepted & large).sum()) / n_large if n_large else math.nan,
                             "largest accepted worst-row error": float(missed.max()) if bool(missed.notnull().any())
                             else 0.0})
    return pd.DataFrame(rows).set_index(["dtype", "N", "metric"])


def dilution_table(ds: xr.Dataset, row_error: float = SEED000_MISSED_ERROR) -> pd.DataFrame:
    """Per dtype, faulty rows and N: each metric of the correct output and of the output with
    ``row_error`` in the faulty rows (median over seeds), whether the fixed 0.1% tolerance accepts
    the correct and the faulty output (in every seed), and the largest row error it accepts
    (smallest over seeds)."""
    rows = []
    e_sel = float(ds["dil_row_error"].sel(dil_row_error=row_error, method="nearest"))
    for fmt in ds["dil_dtype"].values:
        for r in ds["dil_faulty_rows"].values:
            for n in ds["dil_seq_len"].values:
                sel = dict(dil_dtype=fmt, dil_seq_len=n)
                row = {"dtype": str(fmt), "faulty rows": int(r), "N": int(n),
                       "rows seen": int(ds["dil_rows"].sel(dil_seq_len=n))}
                for m in ds["dil_metric"].values:
                    c = ds["dil_correct_err"].sel(dil_metric=m, **sel)
                    f = ds["dil_fault_err"].sel(dil_metric=m, dil_faulty_rows=r, dil_row_error=e_sel, **sel)
                    big = ds["dil_largest_accepted"].sel(dil_metric=m, dil_faulty_rows=r, **sel)
                    row[f"{m}: correct"] = float(c.median())
                    row[f"{m}: with {e_sel:.0%}"] = float(f.median())
                    row[f"{m}: accepts correct"] = bool((c <= FIXED_TOLERANCE).all())
                    row[f"{m}: accepts {e_sel:.0%}"] = bool((f <= FIXED_TOLERANCE).all())
                    row[f"{m}: largest accepted"] = float(big.min()) if bool(big.notnull().all()) else math.nan
                rows.append(row)
    return pd.DataFrame(rows).set_index(["dtype", "faulty rows", "N"])


def dilution_summary(ds: xr.Dataset, row_error: float = SEED000_MISSED_ERROR) -> pd.DataFrame:
    """Per dtype, number of faulty rows and metric: the N (ranges of the run's lengths) at which the fixed
    0.1% tolerance accepts the correct output and misses ``row_error`` in the faulty rows (every seed),
    at which it catches it, and at which it rejects the correct output too; and the largest accepted row
    error at the first and last such N with its log-log slope over the rows seen (NaN: fewer than two N)."""
    table = dilution_table(ds, row_error)
    e_lab = f"{float(ds['dil_row_error'].sel(dil_row_error=row_error, method='nearest')):.0%}"
    rows = []
    for (fmt, r), sub in table.groupby(level=["dtype", "faulty rows"]):
        sub = sub.droplevel(["dtype", "faulty rows"])
        for m in ds["dil_metric"].values:
            ok = sub[f"{m}: accepts correct"]
            big = sub[f"{m}: largest accepted"]
            fit = big[np.isfinite(big) & (big > 0)]
            slope = math.nan
            if len(fit) >= 2:
                rows_seen = ds["dil_rows"].sel(dil_seq_len=list(fit.index)).values.astype(float)
                slope = float(np.polyfit(np.log(rows_seen), np.log(fit.values), 1)[0])
            rows.append({"dtype": str(fmt), "faulty rows": int(r), "metric": str(m),
                         "misses at N": _n_ranges(list(sub.index[ok & sub[f"{m}: accepts {e_lab}"]])),
                         "catches at N": _n_ranges(list(sub.index[ok & ~sub[f"{m}: accepts {e_lab}"]])),
                         "rejects correct at N": _n_ranges(list(sub.index[~ok])),
                         "largest accepted, first N": float(fit.iloc[0]) if len(fit) else math.nan,
                         "largest accepted, last N": float(fit.iloc[-1]) if len(fit) else math.nan,
                         "log-log slope": slope})
    return pd.DataFrame(rows).set_index(["dtype", "faulty rows", "metric"])


def fault_table(names=None) -> pd.DataFrame:
    """The injected faults: what each does, what its severity means, its levels and default."""
    names = list(FAULTS) if names is None else list(names)
    return pd.DataFrame([{"fault": n, "bug": FAULTS[n].description, "severity": FAULTS[n].severity_meaning,
                          "levels (mildest first)": ", ".join(f"{x:g}" for x in FAULTS[n].severities),
                          "default": f"{FAULTS[n].default_severity:g}"} for n in names]).set_index("fault")


def family_false_alarm_table(ds: xr.Dataset) -> pd.DataFrame:
    """False-alarm rate of each rule on the correct flash kernel, per family and dtype (over N, seeds)."""
    rate = ds["family_false_alarm"].mean(["seq_len", "seed"])
    table = rate.to_dataframe()["family_false_alarm"].unstack("rule")
    return table[list(ds["rule"].values)]


def largest_missed(ds: xr.Dataset) -> pd.DataFrame:
    """Per rule, dtype and N: the largest worst-row error of a faulty output the rule accepted.

    Only outputs the fault changed count; "by" names the fault (severity) and family behind it.
    """
    worst = ds["det_fault_worst_row_err"].where((ds["det_fault_changed"] == 1) & (ds["det_detected"] == 0))
    rows = []
    for rule in ds["rule"].values:
        for fmt in ds["det_dtype"].values:
            for n in ds["det_seq_len"].values:
                sub = worst.sel(rule=rule, det_dtype=fmt, det_seq_len=n).transpose(
                    "fault", "severity_level", "det_family", "det_seed")
                values = sub.values
                row = {"rule": str(rule), "dtype": str(fmt), "N": int(n)}
                if np.isnan(values).all():
                    rows.append(dict(row, **{"largest missed worst-row error": 0.0, "by": "-"}))
                    continue
                f, lev, fam, seed = np.unravel_index(int(np.argmax(np.nan_to_num(values, nan=-1.0, posinf=1e308))),
                                                     values.shape)
                fault = str(sub["fault"].values[f])
                sev = ds["severity"].sel(fault=fault, severity_level=int(sub["severity_level"].values[lev])).item()
                rows.append(dict(row, **{"largest missed worst-row error": float(values[f, lev, fam, seed]),
                                         "by": f"{fault} ({sev:g}), {sub['det_family'].values[fam]}"}))
    return pd.DataFrame(rows).set_index(["rule", "dtype", "N"])


def dilution_boundary(ds: xr.Dataset, row_error: float = SEED000_MISSED_ERROR, faulty_rows: int = 1,
                      metric: str = "rel_l2") -> pd.DataFrame:
    """Per dtype and seed: from which N the fixed 0.1% tolerance on ``metric`` misses ``row_error`` in
    ``faulty_rows`` rows (the largest accepted row error ``dil_largest_accepted`` reaches ``row_error``).

    Columns: ``last N caught`` and ``first N missed`` (measured lengths; NaN where none), ``boundary N``
    (the N where the largest accepted error equals ``row_error``, interpolated in log-log between the two
    measured lengths that bracket it; NaN where the run's lengths do not bracket it), and
    ``rejects correct`` (the tolerance rejects the correct output at some N of the run: then it misses
    nothing there). For a row of typical size (its norm 1/sqrt(rows) of the output's) the relative-L2
    boundary is where ``row_error`` / sqrt(rows) = 0.1%: ``typical_dilution_boundary``."""
    big = ds["dil_largest_accepted"].sel(dil_metric=metric, dil_faulty_rows=faulty_rows)
    lens = np.asarray(ds["dil_seq_len"].values, dtype=float)
    rows = []
    for fmt in ds["dil_dtype"].values:
        for seed in ds["dil_seed"].values:
            e = big.sel(dil_dtype=fmt, dil_seed=seed).values.astype(float)
            ok = np.isfinite(e)
            missed = ok & (e >= row_error)
            caught_at = ok & (e < row_error)
            boundary = math.nan
            for i in range(len(lens) - 1):
                a, b = e[i], e[i + 1]
                if ok[i] and ok[i + 1] and a < row_error <= b and a > 0:
                    t = (math.log(row_error) - math.log(a)) / (math.log(b) - math.log(a))
                    boundary = math.exp(math.log(lens[i]) + t * (math.log(lens[i + 1]) - math.log(lens[i])))
                    break
            rows.append({"dtype": str(fmt), "seed": int(seed),
                         "last N caught": float(lens[caught_at].max()) if caught_at.any() else math.nan,
                         "first N missed": float(lens[missed].min()) if missed.any() else math.nan,
                         "boundary N": boundary, "rejects correct": bool((~ok).any())})
    return pd.DataFrame(rows).set_index(["dtype", "seed"])


def typical_dilution_boundary(ds: xr.Dataset, row_error: float = SEED000_MISSED_ERROR) -> float:
    """N at which one row of typical size (norm 1/sqrt(rows) of the output's) with ``row_error`` in it has
    a relative L2 error of exactly the fixed tolerance, the correct output's own error neglected:
    rows = (row_error / tol)^2, N = rows / (batch * heads)."""
    per_n = float(ds["dil_rows"].values[0]) / float(ds["dil_seq_len"].values[0])
    return (row_error / FIXED_TOLERANCE) ** 2 / per_n


def dilution_boundary_values(ds: xr.Dataset | None, prefix: str, row_error: float = SEED000_MISSED_ERROR) -> dict:
    """Glue values of ``dilution_boundary`` (one faulty row, relative L2) over the dtypes where the
    tolerance accepts the correct output: the interpolated boundary's smallest and largest value over
    dtypes and seeds and their ratio (the spread over the draws), how many (dtype, seed) cases it was bracketed in, the first missed N, and the
    longest N of the run. Values are None (glued as n/a) when ``ds`` is None or has no bracket."""
    keys = ("boundary_lo", "boundary_hi", "boundary_spread", "bracketed", "cases", "first_missed_lo",
            "first_missed_hi", "n_max", "usable_dtypes", "rejecting_dtypes")
    if ds is None or "dil_largest_accepted" not in ds:
        return {f"{prefix}_{k}": None for k in keys}
    table = dilution_boundary(ds, row_error)
    usable = table[~table["rejects correct"]]
    b, f = usable["boundary N"].dropna(), usable["first N missed"].dropna()
    rejecting = sorted(set(table.index.get_level_values("dtype")[table["rejects correct"].values]))
    values = {"boundary_lo": int(round(b.min())) if len(b) else None,
              "boundary_hi": int(round(b.max())) if len(b) else None,
              "boundary_spread": float(b.max() / b.min()) if len(b) else None,
              "bracketed": int(len(b)), "cases": int(len(usable)),
              "first_missed_lo": int(f.min()) if len(f) else None, "first_missed_hi": int(f.max()) if len(f) else None,
              "n_max": int(ds["dil_seq_len"].max()),
              "usable_dtypes": ", ".join(f"fa2_{d}" for d in sorted(set(usable.index.get_level_values("dtype"))))
              or "none",
              "rejecting_dtypes": ", ".join(f"fa2_{d}" for d in rejecting) or "none"}
    return {f"{prefix}_{k}": v for k, v in values.items()}
