"""Study 02's readings of its results: tables and values computed from the Dataset (no kernel runs)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import xarray as xr

from ...kernels import FAULTS
from .detection import FIXED_TOLERANCE, SEED000_MISSED_ERROR


def amplification_table(ds: xr.Dataset, seq_len: int) -> pd.DataFrame:
    """Amplification at one N: families down, kernel/policy_dtype across."""
    amp = ds["amplification"].sel(seq_len=seq_len).to_dataframe()["amplification"].reset_index()
    amp["column"] = amp["kernel"] + "/" + amp["policy"] + "_" + amp["dtype"]
    return amp.pivot(index="family", columns="column", values="amplification").loc[list(ds["family"].values)]


def finiteness_table(ds: xr.Dataset) -> pd.DataFrame:
    """Per family: golden non-finite fraction, and per kernel/policy/dtype the fraction of entries
    whose finite-ness disagrees with the golden output (max over N and seeds)."""
    size = ds["output_size"]
    wrong = (ds["nan_where_golden_finite"] + ds["inf_where_golden_finite"] + ds["finite_where_golden_nonfinite"])
    frac = (wrong / size).max(["seq_len", "seed"])
    table = frac.to_dataframe(name="disagree").reset_index()
    table["column"] = table["kernel"] + "/" + table["policy"] + "_" + table["dtype"]
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


def dilution_statements(ds: xr.Dataset, row_error: float = SEED000_MISSED_ERROR) -> list[str]:
    """Sentences, computed from the data: for each metric, dtype and number of faulty rows, at which
    N the fixed 0.1% tolerance accepts the correct output and misses ``row_error`` in the faulty
    rows (every seed), at which N it catches it, and at which it rejects the correct output too;
    and how the largest accepted row error grows with the number of rows (log-log slope)."""
    table = dilution_table(ds, row_error)
    out = []
    e_lab = f"{float(ds['dil_row_error'].sel(dil_row_error=row_error, method='nearest')):.0%}"
    for (fmt, r), sub in table.groupby(level=["dtype", "faulty rows"]):
        sub = sub.droplevel(["dtype", "faulty rows"])
        for m in ds["dil_metric"].values:
            ok = sub[f"{m}: accepts correct"]
            missed = list(sub.index[ok & sub[f"{m}: accepts {e_lab}"]])
            caught_n = list(sub.index[ok & ~sub[f"{m}: accepts {e_lab}"]])
            false = list(sub.index[~ok])
            name = {"rel_l2": "relative L2", "mean_rel": "mean relative error"}[str(m)]
            text = (f"fa2_{fmt}, {r} faulty row{'s' if r > 1 else ''}, 0.1% on the {name}: "
                    f"misses {e_lab} at N {_n_ranges(missed)}; catches it at N {_n_ranges(caught_n)}")
            if false:
                text += f"; rejects the correct output at N {_n_ranges(false)}"
            big = sub[f"{m}: largest accepted"]
            fit = big[np.isfinite(big) & (big > 0)]
            if len(fit) >= 2:
                rows_seen = ds["dil_rows"].sel(dil_seq_len=list(fit.index)).values.astype(float)
                slope = np.polyfit(np.log(rows_seen), np.log(fit.values), 1)[0]
                text += (f"; the largest accepted row error goes from {fit.iloc[0]:.3g} to {fit.iloc[-1]:.3g} "
                         f"(log-log slope over the rows seen {slope:.2f})")
            out.append(text + ".")
    return out


def dilution_one_row_l2(ds: xr.Dataset, row_error: float = SEED000_MISSED_ERROR) -> list[str]:
    """Per dtype, one faulty row, the fixed 0.1% on the relative L2 error: whether it misses
    ``row_error`` and from which N (rows seen), the faulty output's relative L2 there, and where it
    rejects the correct output already (median over seeds; "misses" needs every seed)."""
    table = dilution_table(ds, row_error)
    e_lab = f"{float(ds['dil_row_error'].sel(dil_row_error=row_error, method='nearest')):.0%}"
    out = []
    for fmt in ds["dil_dtype"].values:
        if (str(fmt), 1) not in table.index.droplevel("N"):
            continue
        sub = table.loc[(str(fmt), 1)]
        ok = sub["rel_l2: accepts correct"]
        missed = sub.index[ok & sub[f"rel_l2: accepts {e_lab}"]].tolist()
        caught_n = sub.index[ok & ~sub[f"rel_l2: accepts {e_lab}"]].tolist()
        false = sub.index[~ok].tolist()
        if missed:
            n0 = min(missed)
            text = (f"fa2_{fmt}: the 0.1% rule on the relative L2 misses {e_lab} in one row at N {_n_ranges(missed)} "
                    f"(from {int(ds['dil_rows'].sel(dil_seq_len=n0))} rows on: relative L2 of that output "
                    f"{sub.loc[n0, f'rel_l2: with {e_lab}']:.2e}, of the correct one "
                    f"{sub.loc[n0, 'rel_l2: correct']:.2e})")
            text += f" and catches it at N {_n_ranges(caught_n)}" if caught_n else ""
        elif caught_n:
            text = (f"fa2_{fmt}: the 0.1% rule on the relative L2 catches {e_lab} in one row at every N where it "
                    f"accepts the correct output ({_n_ranges(caught_n)}); it misses it nowhere in this run")
        else:
            text = f"fa2_{fmt}: the 0.1% rule on the relative L2 neither misses nor catches {e_lab} in one row"
        if false:
            lo, hi = sub.loc[false, "rel_l2: correct"].min(), sub.loc[false, "rel_l2: correct"].max()
            text += (f"; it rejects the correct output at N {_n_ranges(false)} (its relative L2 {lo:.2e} to "
                     f"{hi:.2e}), so it misses nothing there and accepts nothing")
        out.append(text + ".")
    return out


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
