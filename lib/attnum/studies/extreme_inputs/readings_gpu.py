"""Study 02's readings of the real-kernel experiment (section 7): what each kernel did, by input."""
from __future__ import annotations

import json
import math

import numpy as np
import xarray as xr

from .real_kernels import _cells, _real_label, emulator_beside_real


def real_findings_by_input(ds: xr.Dataset) -> list[str]:
    """One sentence per (dtype, input, mask delivery) where some real kernel departs from the golden
    value's finite-ness, zero rows or masking, or gives no output: what each kernel did (``_real_label``),
    kernels that agree with the golden value grouped as "as golden", and the emulator's outcome on the
    same family when the family sweep has it (``emulator_beside_real``)."""
    beside = emulator_beside_real(ds) if "family" in ds else None
    cell = _cells(ds)
    out = []
    for fmt in ds["real_dtype"].values:
        for inp in ds["real_input"].values:
            for mask in ds["real_mask"].values:
                labels = {}
                for kernel in ds["real_kernel"].values:
                    code, text = _real_label(cell(kernel, fmt, inp, mask))
                    if not (isinstance(code, float) and math.isnan(code)):
                        labels[str(kernel)] = (code, text)
                if not labels or all(code == 0 for code, _ in labels.values()):
                    continue
                bad = [f"{k}: {t}" for k, (c, t) in labels.items() if c != 0]
                good = [f"{k} ({t})" for k, (c, t) in labels.items() if c == 0]
                text = f"{inp}{'' if mask == 'none' else ' | ' + str(mask)}, {fmt}: " + "; ".join(bad)
                if good:
                    text += f"; as golden: {', '.join(good)}"
                if beside is not None and mask in ("none", "-inf") and (str(fmt), str(inp)) in beside.index:
                    text += f"; emulator (family sweep): {beside.loc[(str(fmt), str(inp))].iloc[0]}"
                out.append(text + ".")
    return out


def _real_point(inp, mask) -> str:
    return f"{inp}{'' if mask == 'none' else ' | ' + str(mask)}"


def _short_reason(status: str) -> str:
    """A refusal's reason in a few words (the full text is in ``real_status_table``)."""
    if "No available kernel" in status:
        return "refused: no available kernel for an explicit mask"
    if "out of resource" in status or "No valid triton configs" in status:
        return "refused: the compile failed (no Triton configuration fits in shared memory)"
    return status if len(status) <= 90 else status[:87] + "..."


def _by_dtype(groups: dict) -> str:
    """``{(what, kernel): [dtypes]}`` -> "what: k (bf16, fp16), ...", kernels in order of first appearance."""
    out: dict[str, list[str]] = {}
    for (what, kernel), fmts in groups.items():
        out.setdefault(what, []).append(f"{kernel} ({', '.join(fmts)})")
    return "; ".join(f"{what}: {', '.join(ks)}" for what, ks in out.items())


def real_highlights(ds: xr.Dataset, far: float = 10.0, floor: float = 1e-2) -> list[str]:
    """Section 7b's findings, regrouped from the data (one sentence each, nothing hand-written about
    the numbers): refusals per kernel, what each mask delivery gave on fully masked rows, a NaN in
    padding, scores near the format's limits, outputs that are finite where the golden value is but
    far from it (relative L2 error above ``floor`` and ``far`` times the median of the kernels that
    agree with the golden value's finite-ness there), one NaN/inf in K or V, and the emulator's
    family-sweep outcome beside them."""
    kernels_ = [str(k) for k in ds["real_kernel"].values]
    dtypes_ = [str(f) for f in ds["real_dtype"].values]
    masks = [str(m) for m in ds["real_mask"].values if m != "none"]
    inputs = [str(i) for i in ds["real_input"].values]
    cell = _cells(ds)
    status = lambda k, f, i, m: str(cell(k, f, i, m)["real_status"])  # noqa: E731
    val = lambda c, name: float(c[name])  # noqa: E731
    out = []

    # refusals
    parts, ran_all = [], []
    for k in kernels_:
        reasons: dict[str, set] = {}
        points = 0
        for f in dtypes_:
            for i in inputs:
                for m in ["none"] + masks:
                    s = status(k, f, i, m)
                    if s == "ok" or s.startswith("not applicable: the input"):
                        continue
                    if s.startswith("unavailable"):
                        reasons.setdefault(s.split(":")[0], set()).add("every point")
                        continue
                    points += 1
                    reasons.setdefault(_short_reason(s) if not s.startswith("not applicable") else
                                       "not applicable (no boolean mask input)", set()).add(m)
        if not reasons:
            ran_all.append(k)
            continue
        order = ["none"] + masks
        parts.append(f"{k}: " + "; ".join(
            f"{why} ({', '.join(sorted(w, key=lambda x: order.index(x) if x in order else -1))})"
            for why, w in reasons.items()))
    if parts:
        text = "No output (mask deliveries in brackets): " + " · ".join(parts) + "."
        if any("compile failed" in p for p in parts):
            text += (" A failed compile is not an answer about these inputs: that kernel's handling of masks is "
                     "not measured in this run.")
        if ran_all:
            text += f" Every point ran in {', '.join(ran_all)}."
        out.append(text)

    # fully masked rows
    if "fully_masked_rows" in inputs:
        total = int(ds["real_masked_rows"].sel(real_input="fully_masked_rows").max())
        golden_everywhere = []
        for m in masks:
            groups: dict = {}
            for k in kernels_:
                for f in dtypes_:
                    if status(k, f, "fully_masked_rows", m) != "ok":
                        continue
                    c = cell(k, f, "fully_masked_rows", m)
                    if val(c, "real_masked_rows_nan") > 0:
                        what = "NaN"
                    elif val(c, "real_rows_attend_masked") > 0 or val(c, "real_nonzero_rows") > 0:
                        what = "not 0, weight on the masked keys"
                    elif val(c, "real_masked_rows_zero") >= total:
                        what = "0 (the golden value)"
                    else:
                        what = "partly 0"
                    groups.setdefault((what, k), []).append(f)
            if not groups:
                continue
            if all(what == "0 (the golden value)" for what, _ in groups):
                golden_everywhere.append(m)
            out.append(f"Fully masked rows ({total} per input), mask as {m}: " + _by_dtype(groups) + ".")
        if golden_everywhere:
            out.append(f"The mask deliveries that gave 0 on fully masked rows in every kernel that ran them: "
                       f"{', '.join(golden_everywhere)}.")

    # a NaN in padding (masked for every query)
    d = int(ds["real_head_dim"])
    for inp, what in (("nan_in_masked_key", "key"), ("nan_in_masked_value", "value")):
        if inp not in inputs:
            continue
        fr, ran, clean = [], set(), set()
        for k in kernels_:
            for f in dtypes_:
                for m in masks:
                    if status(k, f, inp, m) != "ok":
                        continue
                    ran.add(k)
                    x = val(cell(k, f, inp, m), "real_nonfinite_where_golden_finite")
                    fr.append(x)
                    if x == 0:
                        clean.add(k)
        if not fr:
            continue
        lo, hi = min(fr), max(fr)
        size = f"{lo:.1%}" if lo == hi else f"{lo:.1%} to {hi:.1%}"
        cols = f" ({lo * d:.3g} of d = {d} columns)" if lo == hi and 0 < lo < 1 else ""
        text = (f"A NaN in a padding {what} (masked for every query; golden value finite): non-finite in {size} of "
                f"the output entries{cols} in {', '.join(k for k in kernels_ if k in ran and k not in clean)}")
        if clean:
            text += f"; kept out in some deliveries by {', '.join(sorted(clean))}"
        out.append(text + f", over the deliveries {', '.join(masks)} and formats {', '.join(dtypes_)}.")

    # scores near the format's limits
    limit_words = {"scores_near_max": "+0.5 x", "scores_beyond_max": "+2 x", "scores_near_min": "-0.5 x"}
    for inp, words in limit_words.items():
        if inp not in inputs:
            continue
        for f in dtypes_:
            groups: dict[str, list[str]] = {}
            errs = []
            for k in kernels_:
                if status(k, f, inp, "none") != "ok":
                    continue
                code, label = _real_label(cell(k, f, inp, "none"))
                if code == 0:
                    errs.append(val(cell(k, f, inp, "none"), "real_rel_l2_err"))
                    groups.setdefault("finite as golden", []).append(k)
                else:
                    groups.setdefault(label, []).append(k)
            if not groups:
                continue
            parts = []
            for label, ks in groups.items():
                if label == "finite as golden" and errs:
                    label += (f" (rel. L2 {min(errs):.1e})" if min(errs) == max(errs) else
                              f" (rel. L2 {min(errs):.1e} to {max(errs):.1e})")
                parts.append(f"{label}: {', '.join(ks)}")
            out.append(f"Scores at {words} the largest {f} number ({inp}): " + "; ".join(parts) + ".")

    # finite where the golden value is finite, but far from it
    far_off, checked = [], 0
    for f in dtypes_:
        for i in inputs:
            for m in ["none"] + masks:
                errs = {}
                for k in kernels_:
                    if status(k, f, i, m) != "ok":
                        continue
                    c = cell(k, f, i, m)
                    code, _ = _real_label(c)
                    e = val(c, "real_rel_l2_err")
                    if code == 0 and math.isfinite(e) and float(ds["real_golden_nonfinite"].sel(
                            real_dtype=f, real_input=i)) == 0:
                        errs[k] = e
                if len(errs) < 3:
                    continue
                checked += 1
                med = float(np.median(list(errs.values())))
                bad = {k: e for k, e in errs.items() if e > floor and e > far * med}
                if bad:
                    far_off.append(f"{_real_point(i, m)}, {f}: " + ", ".join(f"{k} {e:.2g}" for k, e in bad.items())
                                   + f" (median of the {len(errs)} kernels {med:.1e})")
    if far_off:
        out.append(f"Finite where the golden value is, no zero rows, but far from it (relative L2 error above "
                   f"{floor:g} and {far:g}x the median kernel's): " + "; ".join(far_off) + ".")
    elif checked:
        out.append(f"No kernel's finite output is far from the golden value (relative L2 error above {floor:g} and "
                   f"{far:g}x the median kernel's) where the others agree with it ({checked} points with three or "
                   "more kernels).")

    single = real_single_entry_statement(ds)
    if single:
        out.append(single)

    # the emulator beside them
    if "family" in ds:
        beside = emulator_beside_real(ds)
        emu_col = beside.columns[0]
        emu_bad = [f"{i}, {f} ({t})" for (f, i), t in beside[emu_col].items()
                   if not (t[:1].isdigit() or t == "NaN as golden")]
        real_bad = []
        for k in beside.columns[1:]:
            bad = [f"{i}, {f} ({t})" for (f, i), t in beside[k].items()
                   if not (t[:1].isdigit() or t in ("NaN as golden", "-", "refused", "unavailable", "n/a"))]
            if bad:
                real_bad.append(f"{k}: {'; '.join(bad)}")
        text = (f"The emulator ({emu_col.removeprefix('emulator ')}; the family sweep's families only, none of the "
                "padding-NaN or scores-near-limit inputs): ")
        text += ("finite, without zero rows and without weight on masked keys on every family whose golden value "
                 "is finite" if not emu_bad else "departs on " + "; ".join(emu_bad))
        if real_bad:
            text += "; on the same families the real kernels depart in " + " · ".join(real_bad)
        out.append(text + ".")
    return out


def real_single_entry_statement(ds: xr.Dataset) -> str | None:
    """One sentence: on one NaN or +inf in one key or value of N(0, 1) inputs, whether every kernel
    that ran is non-finite exactly where the golden value is (without zero rows), or how each departs."""
    kernels_ = [str(k) for k in ds["real_kernel"].values]
    dtypes_ = [str(f) for f in ds["real_dtype"].values]
    singles = [i for i in ("nan_in_one_key", "inf_in_one_key", "nan_in_one_value", "inf_in_one_value")
               if i in ds["real_input"].values]
    if not singles:
        return None
    departs, ran = [], []
    for k in kernels_:
        for i in singles:
            for f in dtypes_:
                c = ds.sel(real_kernel=k, real_dtype=f, real_input=i, real_mask="none")
                if str(c["real_status"].values) != "ok":
                    continue
                if k not in ran:
                    ran.append(k)
                code, label = _real_label(c)
                if code != 0:
                    departs.append(f"{k} on {i}, {f} ({label})")
    if not ran:
        return None
    return (f"One NaN or +inf in one key or value ({', '.join(singles)}; N = {int(ds['real_seq_len'])}): "
            + (f"every kernel that ran ({', '.join(ran)}) is non-finite exactly where the golden value is, without "
               "zero rows" if not departs else "departures from the golden value's NaN/inf pattern: "
               + "; ".join(departs)) + ".")


def real_exceptions_by_experiment(ds: xr.Dataset) -> list[str]:
    """The exceptions a run recorded (``kernel_exceptions``), counted per experiment and what raised
    (the first two words of where), with the first message of each."""
    entries = json.loads(ds.attrs.get("kernel_exceptions", "[]"))
    groups: dict[str, list] = {}
    for e in entries:
        words = str(e["where"]).split()
        key = " ".join(words[:2])
        groups.setdefault(key, [0, str(e["message"])])
        groups[key][0] += int(e["count"])
    return [f"{n} x {key}: {msg[:160]}" for key, (n, msg) in groups.items()]
