"""Study 02's readings of the real-kernel experiment (section 7): tables of what each kernel did, by input,
mask delivery and format, and the values the notebook's prose states (no sentences: the notebook words them)."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import xarray as xr

from .real_kernels import _cells, _real_label, emulator_beside_real

SINGLE_ENTRY_INPUTS = ("nan_in_one_key", "inf_in_one_key", "nan_in_one_value", "inf_in_one_value")
PADDING_INPUTS = ("nan_in_masked_key", "nan_in_masked_value")


def _names(ds: xr.Dataset, dim: str) -> list[str]:
    return [str(x) for x in ds[dim].values]


def real_findings_table(ds: xr.Dataset) -> pd.DataFrame:
    """One row per (dtype, input, mask delivery) where some real kernel departs from the golden value's
    finite-ness, zero rows or masking, or gives no output; one column per kernel with its outcome
    (``_real_label``: how it departs, its relative L2 error where it agrees, why it gave no output), and the
    emulator's outcome on the same family (family sweep, ``-inf`` masks) where the sweep has it."""
    beside = emulator_beside_real(ds) if "family" in ds else None
    cell = _cells(ds)
    kernels_ = _names(ds, "real_kernel")
    rows = []
    for fmt in _names(ds, "real_dtype"):
        for inp in _names(ds, "real_input"):
            for mask in _names(ds, "real_mask"):
                labels = {k: _real_label(cell(k, fmt, inp, mask)) for k in kernels_}
                ran = {k: v for k, v in labels.items() if not (isinstance(v[0], float) and math.isnan(v[0]))}
                if not ran or all(code == 0 for code, _ in ran.values()):
                    continue
                row = {"dtype": fmt, "input": inp, "mask": mask, **{k: t for k, (_, t) in labels.items()}}
                if beside is not None:
                    emulated = (fmt, inp) in beside.index and mask in ("none", "-inf")
                    row["emulator (family sweep)"] = beside.loc[(fmt, inp)].iloc[0] if emulated else "-"
                rows.append(row)
    columns = ["dtype", "input", "mask", *kernels_] + (["emulator (family sweep)"] if beside is not None else [])
    return pd.DataFrame(rows, columns=columns).set_index(["dtype", "input", "mask"])


FULLY_MASKED_OUTCOMES = ("zero", "nan", "masked_weight")


def fully_masked_outcome(cell: dict, total: int) -> dict:
    """What one kernel gave on the ``total`` fully masked rows of one cell, as fractions of those rows:
    ``zero`` (the golden value), ``nan`` (a NaN in the row) and ``masked_weight`` (rows that gave weight to
    a masked key, ``real_rows_attend_masked``, over ``total``); every value NaN where the kernel gave no
    output."""
    if str(np.asarray(cell["real_status"])) != "ok" or total <= 0:
        return dict.fromkeys(FULLY_MASKED_OUTCOMES, math.nan)
    return {"zero": float(cell["real_masked_rows_zero"]) / total, "nan": float(cell["real_masked_rows_nan"]) / total,
            "masked_weight": min(float(cell["real_rows_attend_masked"]), total) / total}


def real_fully_masked_table(ds: xr.Dataset) -> pd.DataFrame:
    """(mask delivery, outcome) down, (kernel, dtype) across: the fractions of the ``fully_masked_rows``
    input's rows that see no key which each kernel gave as 0 (the golden value), with a NaN, or with
    weight on masked keys (``fully_masked_outcome``; NaN: no output)."""
    if "fully_masked_rows" not in ds["real_input"].values:
        return pd.DataFrame()
    total = int(ds["real_masked_rows"].sel(real_input="fully_masked_rows").max())
    cell = _cells(ds)
    masks = [m for m in _names(ds, "real_mask") if m != "none"]
    table = {(k, f): [fully_masked_outcome(cell(k, f, "fully_masked_rows", m), total)[o]
                      for m in masks for o in FULLY_MASKED_OUTCOMES]
             for k in _names(ds, "real_kernel") for f in _names(ds, "real_dtype")}
    index = pd.MultiIndex.from_product([masks, FULLY_MASKED_OUTCOMES], names=["mask", "outcome"])
    return pd.DataFrame(table, index=index)


def masks_zero_everywhere(ds: xr.Dataset) -> list[str]:
    """The mask deliveries that gave 0 on every fully masked row (no NaN, no weight on masked keys) in every
    kernel and format that ran them."""
    table = real_fully_masked_table(ds)
    out = []
    if not len(table):
        return out
    for mask in table.index.get_level_values("mask").unique():
        sub = table.loc[mask]
        ran = sub.loc["zero"].notna()
        if ran.any() and bool((sub.loc["zero"][ran] == 1).all() and (sub.loc["nan"][ran] == 0).all()
                              and (sub.loc["masked_weight"][ran] == 0).all()):
            out.append(str(mask))
    return out


def real_padding_nan(ds: xr.Dataset) -> pd.DataFrame:
    """Per padding input (a NaN in a key or value masked for every query; golden value finite) and kernel:
    the smallest and largest fraction of output entries non-finite over the mask deliveries and formats
    that ran, and in how many of them the NaN was kept out."""
    cell = _cells(ds)
    masks = [m for m in _names(ds, "real_mask") if m != "none"]
    rows = []
    for inp in [i for i in PADDING_INPUTS if i in ds["real_input"].values]:
        for k in _names(ds, "real_kernel"):
            fr = [float(c["real_nonfinite_where_golden_finite"]) for f in _names(ds, "real_dtype") for m in masks
                  for c in [cell(k, f, inp, m)] if str(np.asarray(c["real_status"])) == "ok"]
            if fr:
                rows.append({"input": inp, "kernel": k, "non-finite, least": min(fr), "non-finite, most": max(fr),
                             "deliveries run": len(fr), "kept out in": sum(x == 0 for x in fr)})
    return pd.DataFrame(rows, columns=["input", "kernel", "non-finite, least", "non-finite, most",
                                       "deliveries run", "kept out in"]).set_index(["input", "kernel"])


def real_far_from_golden(ds: xr.Dataset, far: float = 10.0, floor: float = 1e-2) -> pd.DataFrame:
    """Silent errors: (dtype, input, mask, kernel) where a kernel's output is finite where the golden value is,
    without zero rows or weight on masked keys, but its relative L2 error is above ``floor`` and ``far``
    times the median of the kernels that agree with the golden value's finite-ness there (points with at
    least three such kernels; ``attrs["points_checked"]`` says how many)."""
    cell = _cells(ds)
    kernels_ = _names(ds, "real_kernel")
    rows, checked = [], 0
    for f in _names(ds, "real_dtype"):
        for i in _names(ds, "real_input"):
            if float(ds["real_golden_nonfinite"].sel(real_dtype=f, real_input=i)) != 0:
                continue
            for m in _names(ds, "real_mask"):
                errs = {}
                for k in kernels_:
                    c = cell(k, f, i, m)
                    if str(np.asarray(c["real_status"])) != "ok":
                        continue
                    code, _ = _real_label(c)
                    e = float(c["real_rel_l2_err"])
                    if code == 0 and math.isfinite(e):
                        errs[k] = e
                if len(errs) < 3:
                    continue
                checked += 1
                med = float(np.median(list(errs.values())))
                rows += [{"dtype": f, "input": i, "mask": m, "kernel": k, "rel. L2 error": e, "median kernel": med,
                          "kernels": len(errs)} for k, e in errs.items() if e > floor and e > far * med]
    table = pd.DataFrame(rows, columns=["dtype", "input", "mask", "kernel", "rel. L2 error", "median kernel",
                                        "kernels"])
    table.attrs["points_checked"] = checked
    return table


def real_single_entry_departures(ds: xr.Dataset) -> pd.DataFrame:
    """On one NaN or +inf in one key or value of N(0, 1) inputs (no mask): the (kernel, input, dtype) whose
    output departs from the golden value's NaN/inf pattern or zeroes rows (empty: every kernel that ran is
    non-finite exactly where the golden value is)."""
    cell = _cells(ds)
    rows = []
    for k in _names(ds, "real_kernel"):
        for i in [x for x in SINGLE_ENTRY_INPUTS if x in ds["real_input"].values]:
            for f in _names(ds, "real_dtype"):
                c = cell(k, f, i, "none")
                if str(np.asarray(c["real_status"])) != "ok":
                    continue
                code, label = _real_label(c)
                if code != 0:
                    rows.append({"kernel": k, "input": i, "dtype": f, "outcome": label})
    return pd.DataFrame(rows, columns=["kernel", "input", "dtype", "outcome"])


def real_exceptions_by_experiment(ds: xr.Dataset) -> pd.DataFrame:
    """The exceptions a run recorded (``kernel_exceptions``), counted per experiment and what raised (the
    first two words of where), with the first message of each."""
    groups: dict[str, list] = {}
    for e in json.loads(ds.attrs.get("kernel_exceptions", "[]")):
        key = " ".join(str(e["where"]).split()[:2])
        groups.setdefault(key, [0, str(e["message"])[:160]])
        groups[key][0] += int(e["count"])
    return pd.DataFrame([{"raised in": k, "count": n, "first message": m} for k, (n, m) in groups.items()],
                        columns=["raised in", "count", "first message"])


def real_values(ds: xr.Dataset | None, prefix: str) -> dict:
    """Glue values of a run's real-kernel experiment (None, glued as n/a, where ``ds`` is None): its commit,
    device, N and d, the kernels, what FlashInfer and FA4 ran as (version, and FlashInfer's masked-score
    sentinel; None where the run has no such kernel), the mask deliveries that gave 0 on fully masked rows everywhere, how many
    (dtype, input, mask) points some kernel departs at, silent errors and single-entry departures."""
    keys = ("commit", "device", "seq_len", "head_dim", "kernels", "zero_masks", "departures", "silent",
            "silent_checked", "single_departures", "padding_nan_least", "padding_nan_most", "flashinfer_runs_as",
            "fa4_runs_as")
    if ds is None or "real_status" not in ds:
        return {f"{prefix}_{k}": None for k in keys}
    pad = real_padding_nan(ds)
    key_pad = pad.loc["nan_in_masked_key"] if "nan_in_masked_key" in pad.index.get_level_values("input") else None
    far = real_far_from_golden(ds)
    backends = json.loads(ds.attrs.get("real_kernel_backends", "{}"))
    values = {"commit": str(ds.attrs.get("git_commit", ""))[:7], "device": str(ds.attrs.get("device", "")),
              "seq_len": int(ds["real_seq_len"]), "head_dim": int(ds["real_head_dim"]),
              "kernels": ", ".join(_names(ds, "real_kernel")),
              "zero_masks": ", ".join(masks_zero_everywhere(ds)) or "none",
              "departures": len(real_findings_table(ds)), "silent": len(far),
              "silent_checked": int(far.attrs["points_checked"]),
              "single_departures": len(real_single_entry_departures(ds)),
              "padding_nan_least": float(key_pad["non-finite, least"].min()) if key_pad is not None else None,
              "padding_nan_most": float(key_pad["non-finite, most"].max()) if key_pad is not None else None,
              **{f"{k}_runs_as": backends.get(name) for k, name in (("flashinfer", "flashinfer:prefill"), ("fa4", "fa4"))}}
    return {f"{prefix}_{k}": v for k, v in values.items()}
