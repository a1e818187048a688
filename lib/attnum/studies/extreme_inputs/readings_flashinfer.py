"""FlashInfer before and after its sentinel fix, read from the committed H200 probe files (no kernel runs, no
English): ``<outputs>/kernels/h200/seed_kernels_fi18.json`` (FlashInfer 0.6.18.post1, masked-score sentinel 5e4)
and ``seed_kernels_fi70.json`` (0.7.0, IEEE infinity), both written by ``attnum.kernels.seed_kernels_probe``.

The probe (its ``sentinel`` list) builds rows whose valid scaled logits all equal -L (softmax scale 1, N = 256,
d = 64, two heads, bf16), for L across the former sentinel: without a mask and causal (the right answer is the
mean of V over the row's keys: a row output as zeros has relative L2 error 1), and, for the prefill kernel,
with half the keys masked by a boolean custom mask (masked keys carry raw logit 0 and V = 1, valid keys V = 0:
the output is the weight given to masked keys, right answer 0; a row output as zeros also reads 0 there).

Per version, kernel and case: the *onset*, the lowest level L (as rounded to bf16, ``logit_level_bf16``) with
wrong rows (error above ``ONSET_TOLERANCE``, a NaN row, or masked keys given weight above it), the highest
level below it that was right, and beside it the onset the emulator's finite-fill scheme
(``experiments.masked_attention``'s ``fill_<v>``: masked scores and the running max start at the fill) predicts
for the same sentinel, scale and P format (``predicted_onset``; for the masked case the level where the fill
outweighs the valid keys by ``ONSET_TOLERANCE``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

FLASHINFER_PROBES = (("0.6.18.post1", "seed_kernels_fi18.json"), ("0.7.0", "seed_kernels_fi70.json"))
"""(FlashInfer version, the committed probe file of that version): the last release with the finite sentinel,
the first with IEEE infinity (docs/sources.md)."""
PROBE_DIR = ("kernels", "h200")
"""Where the probe files lie under the outputs root (``paths.outputs_root()``, ``$ATTNUM_OUTPUTS`` when set)."""
FLASHINFER_KERNELS = ("flashinfer:prefill", "flashinfer:decode", "flashinfer:decode_paged")
"""The kernels a probe file may hold; one a file lacks reads as not measured (``*_measured`` False)."""
CASES = ("nomask", "causal", "masked")
ONSET_TOLERANCE = 0.1
"""A level has wrong rows when the output's relative L2 error (or, masked case, the largest weight given to
masked keys) is above this: far above bf16's rounding of a correct output, far below a zeroed output's 1."""
EMULATED_POLICY = "fa2_bf16"
"""The emulator's policy for the probe's bf16 inputs (fp32 scores and statistics, P rounded to bf16): its P
format sets where P underflows."""
PROBE_SCALE = 1.0  # the probe's softmax scale (seed_kernels_probe.sentinel: q = e1, k_j = -L e1)
PROBE_HEAD_DIM = 64  # the probe's head dimension
PROBE_MASKED_FRACTION = 0.5  # the share of keys the probe's masked case masks


def probe_path(filename: str, root: str | Path | None = None) -> Path:
    """``<root>/kernels/h200/<filename>``, ``root`` by default the outputs root (``$ATTNUM_OUTPUTS`` when set)."""
    from ...paths import outputs_root

    return Path(root if root is not None else outputs_root()).joinpath(*PROBE_DIR, filename)


def load_flashinfer_probes(root: str | Path | None = None) -> dict:
    """``{version: probe record or None}`` for ``FLASHINFER_PROBES`` (None: the file is not in this checkout).
    A file whose recorded FlashInfer version is not the one it stands for is an error."""
    probes = {}
    for version, filename in FLASHINFER_PROBES:
        path = probe_path(filename, root)
        if not path.exists():
            probes[version] = None
            continue
        record = json.loads(path.read_text())
        if str(record.get("flashinfer_version")) != version:
            raise ValueError(f"{path}: records FlashInfer {record.get('flashinfer_version')!r}, expected {version!r}")
        probes[version] = record
    return probes


def missing_probes(probes: dict) -> list[str]:
    """The probe files (paths relative to the outputs root) that are absent."""
    names = dict(FLASHINFER_PROBES)
    return ["/".join((*PROBE_DIR, names[v])) for v, r in probes.items() if r is None]


def sentinel_value(record: dict) -> float:
    """The masked-score magnitude the probe read from FlashInfer's header: a number, or inf for IEEE infinity."""
    text = str(record.get("flashinfer_mask_sentinel"))
    return math.inf if text == "infinity" else float(text)


def sentinel_levels(record: dict, kernel: str) -> pd.DataFrame:
    """One row per logit level of ``kernel``'s sentinel scan, by its bf16 level L: per case the error
    (``<case>_err``: relative L2; masked: the largest masked-key weight, NaN rows as inf) and NaN rows
    (``<case>_nan_rows``). Columns of a case the file lacks are absent."""
    rows = []
    for r in record["kernels"][kernel].get("sentinel", []):
        if "logit_level" not in r:
            continue
        row = {"level": float(r["logit_level_bf16"]), "requested level": float(r["logit_level"])}
        for case in ("nomask", "causal"):
            if f"{case}_rel_l2_err" in r:
                row[f"{case}_err"] = float(r[f"{case}_rel_l2_err"])
                row[f"{case}_nan_rows"] = int(r[f"{case}_nan_rows"])
        if "masked_weight_max" in r:
            row["masked_err"] = float(r["masked_weight_max"])
            row["masked_nan_rows"] = int(r["masked_nan_rows"])
        rows.append(row)
    return pd.DataFrame(rows).sort_values("level").reset_index(drop=True)


def _wrong(levels: pd.DataFrame, case: str, tol: float) -> np.ndarray:
    err = levels[f"{case}_err"].to_numpy(dtype=float)
    return ~(err <= tol) | (levels[f"{case}_nan_rows"].to_numpy() > 0)


def onset(levels: pd.DataFrame, case: str, tol: float = ONSET_TOLERANCE) -> tuple[float, float]:
    """(highest level right below the onset, onset): the onset is the lowest level with wrong rows (NaN when
    there is none up to the scan's last level; then the first value is the last level)."""
    wrong = _wrong(levels, case, tol)
    lv = levels["level"].to_numpy(dtype=float)
    if not wrong.any():
        return float(lv.max()), math.nan
    first = float(lv[wrong].min())
    below = lv[lv < first]
    return (float(below.max()) if below.size else math.nan), first


def emulated_onset(sentinel: float, case: str, *, tol: float = ONSET_TOLERANCE, policy: str = EMULATED_POLICY,
                   scale: float = PROBE_SCALE, head_dim: int = PROBE_HEAD_DIM,
                   masked_fraction: float = PROBE_MASKED_FRACTION) -> float:
    """The level L at which the emulator's finite-fill scheme with masked score -``sentinel`` starts giving
    wrong rows on the probe's construction (inf for an infinite sentinel: never).

    No mask / causal: the row comes out zero once the largest P underflows P's format
    (``experiments.predicted_onset``). Masked: masked keys get the fill's score, valid keys -L; their weight
    f e^{-S} / (f e^{-S} + (1 - f) e^{-L}) exceeds ``tol`` from L = S + ln(tol (1 - f) / ((1 - tol) f)) / scale."""
    from ...precision import get_policy
    from .experiments import predicted_onset

    if math.isinf(sentinel):
        return math.inf
    if case == "masked":
        return sentinel + math.log(tol * (1 - masked_fraction) / ((1 - tol) * masked_fraction)) / scale
    return -predicted_onset(-sentinel, get_policy(policy).p, head_dim, scale=scale)


TABLE_COLUMNS = ("sentinel", "levels", "last right", "onset", "emulator onset", "emulator agrees",
                 "error at the older version's onset", "largest error", "NaN rows")


def _agrees(last_right: float, first: float, predicted: float, top: float) -> bool:
    """The emulator's predicted onset lies where the measured one does: in (last right, onset], or both beyond
    the scan (no onset measured, prediction above its last level)."""
    if math.isnan(first):
        return bool(predicted > top)
    return bool((math.isnan(last_right) or last_right < predicted) and predicted <= first)


def flashinfer_onset_table(probes: dict, tol: float = ONSET_TOLERANCE) -> pd.DataFrame:
    """Per (kernel, case, version) the probe measured: the sentinel, the levels scanned, the measured onset
    bracket, the emulator's onset for the same sentinel and whether it lies in the bracket, the error at the
    onset level of the first version (the same level for both versions), the largest error over the scan and
    the NaN rows. Empty without any probe file."""
    rows = []
    first_onsets = {}
    for version, record in probes.items():
        if record is None:
            continue
        sentinel = sentinel_value(record)
        for kernel in FLASHINFER_KERNELS:
            if kernel not in record["kernels"] or record["kernels"][kernel].get("unavailable"):
                continue
            levels = sentinel_levels(record, kernel)
            for case in CASES:
                if f"{case}_err" not in levels:
                    continue
                last_right, first = onset(levels, case, tol)
                first_onsets.setdefault((kernel, case), first)
                at = first_onsets[(kernel, case)]
                predicted = emulated_onset(sentinel, case, tol=tol)
                err = levels[f"{case}_err"]
                rows.append({"kernel": kernel, "case": case, "version": version, "sentinel": sentinel,
                             "levels": len(levels), "last right": last_right, "onset": first,
                             "emulator onset": predicted,
                             "emulator agrees": _agrees(last_right, first, predicted, float(levels["level"].max())),
                             "error at the older version's onset": float(err[levels["level"] == at].max()) if np.isfinite(at) else math.nan,
                             "largest error": float(err.max()), "NaN rows": int(levels[f"{case}_nan_rows"].sum())})
    if not rows:
        return pd.DataFrame(columns=["kernel", "case", "version", *TABLE_COLUMNS]).set_index(["kernel", "case", "version"])
    return pd.DataFrame(rows).set_index(["kernel", "case", "version"])[list(TABLE_COLUMNS)]


def fully_masked(record: dict | None, kernel: str = "flashinfer:prefill") -> dict:
    """The probe's fully masked rows (``case: fully_masked_rows``): rows, zero rows, NaN rows, the largest
    |value| (None where the file lacks the case)."""
    out = dict.fromkeys(("rows", "zero_rows", "nan_rows", "max_abs"))
    if record is None or kernel not in record["kernels"]:
        return out
    for r in record["kernels"][kernel].get("sentinel", []):
        if r.get("case") == "fully_masked_rows":
            out.update(rows=int(r["rows"]), zero_rows=int(r["zero_rows"]), nan_rows=int(r["nan_rows"]),
                       max_abs=float(r["max_abs_value"]))
    return out


def _v(x):
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    x = float(x)
    return x if math.isfinite(x) else None


def flashinfer_values(probes: dict, tol: float = ONSET_TOLERANCE) -> dict:
    """Flat values of ``flashinfer_onset_table`` for the prose (keys without the notebook's prefix; None where
    not measured): ``old`` is the first version of ``FLASHINFER_PROBES``, ``new`` the second; kernels as
    ``prefill`` / ``decode`` / ``decode_paged``. Per (version, kernel, case): ``_onset``, ``_last_right``, ``_err_max``,
    ``_err_min`` and ``_err_at_old_onset``; per (kernel, case) the emulator's ``emu_*_onset`` and
    ``emu_*_agrees`` for the old sentinel, and whether the old bracket holds the sentinel read in base-2 units
    (S ln 2, ``*_ln2_in_bracket``); the fully masked rows; the versions, sentinels, tolerance, levels and
    which files are missing."""
    (old_v, _), (new_v, _) = FLASHINFER_PROBES
    table = flashinfer_onset_table(probes, tol)
    values = {"old_version": old_v, "new_version": new_v, "tolerance": tol, "present": not missing_probes(probes),
              "missing": ", ".join(missing_probes(probes)) or "none"}
    for tag, version in (("old", old_v), ("new", new_v)):
        record = probes.get(version)
        values[f"{tag}_sentinel"] = None if record is None else str(record.get("flashinfer_mask_sentinel"))
        values[f"{tag}_device"] = None if record is None else str(record.get("device"))
        fm = fully_masked(record)
        values.update({f"{tag}_fully_masked_{k}": v for k, v in fm.items()})
    old_record = probes.get(old_v)
    sentinel = None if old_record is None else sentinel_value(old_record)
    values["old_sentinel_value"] = _v(sentinel)
    values["old_sentinel_ln2"] = None if sentinel is None else sentinel * math.log(2.0)
    levels_seen = [sentinel_levels(r, k)["level"] for r in probes.values() if r is not None
                   for k in FLASHINFER_KERNELS if k in r["kernels"]]
    values["levels_lo"] = _v(min(float(lv.min()) for lv in levels_seen)) if levels_seen else None
    values["levels_hi"] = _v(max(float(lv.max()) for lv in levels_seen)) if levels_seen else None
    values["levels"] = int(max(len(lv) for lv in levels_seen)) if levels_seen else None
    new_rows = table.xs(new_v, level="version") if new_v in table.index.get_level_values("version") else None
    values["new_no_onset"] = None if new_rows is None else bool(new_rows["onset"].isna().all())
    for kernel in FLASHINFER_KERNELS:
        short = kernel.split(":")[1]
        for case in CASES:
            for tag, version in (("old", old_v), ("new", new_v)):
                key = f"{tag}_{short}_{case}"
                row = table.loc[(kernel, case, version)] if (kernel, case, version) in table.index else None
                values[f"{key}_measured"] = row is not None
                values[f"{key}_onset"] = None if row is None else _v(row["onset"])
                values[f"{key}_last_right"] = None if row is None else _v(row["last right"])
                values[f"{key}_err_max"] = None if row is None else _v(row["largest error"])
                values[f"{key}_err_at_old_onset"] = None if row is None else _v(row["error at the older version's onset"])
                values[f"{key}_nan_rows"] = None if row is None else int(row["NaN rows"])
                record = probes.get(version)
                values[f"{key}_err_min"] = (_v(sentinel_levels(record, kernel)[f"{case}_err"].iloc[0])
                                            if row is not None else None)
            key = f"{short}_{case}"
            old = table.loc[(kernel, case, old_v)] if (kernel, case, old_v) in table.index else None
            values[f"emu_{key}_onset"] = None if old is None else _v(old["emulator onset"])
            values[f"emu_{key}_agrees"] = None if old is None else bool(old["emulator agrees"])
            if old is None or sentinel is None or math.isnan(old["onset"]):
                values[f"{key}_ln2_in_bracket"] = None
            else:
                values[f"{key}_ln2_in_bracket"] = bool(old["last right"] < values["old_sentinel_ln2"] <= old["onset"])
    for tag, version in (("old", old_v), ("new", new_v)):
        record = probes.get(version)
        entry = None if record is None else record["kernels"].get("flashinfer:decode_paged")
        values[f"{tag}_decode_paged_runs_as"] = None if entry is None else str(entry.get("runs_as"))
        for kernel in FLASHINFER_KERNELS:
            short = kernel.split(":")[1]
            for case in CASES:
                values[f"{tag}_{short}_{case}_reading"] = onset_reading(values, f"{tag}_{short}_{case}")
    for case in ("nomask", "causal"):
        same = [None if not (values[f"{tag}_decode_{case}_measured"] and values[f"{tag}_decode_paged_{case}_measured"])
                else (values[f"{tag}_decode_{case}_onset"] == values[f"{tag}_decode_paged_{case}_onset"]
                      and values[f"{tag}_decode_{case}_last_right"] == values[f"{tag}_decode_paged_{case}_last_right"])
                for tag in ("old", "new")]
        values[f"decode_paged_{case}_same_bracket"] = None if None in same else all(same)
    return values


def onset_reading(values: dict, key: str) -> str:
    """One kernel and case of ``flashinfer_values`` as a phrase of its numbers: where its rows go wrong (the
    bracket (last right, onset]), or that none did up to the highest level scanned, or that it was not
    measured. Only the probe's numbers go in; the words are fixed by which of the three it is."""
    if not values.get(f"{key}_measured"):
        return "not measured"
    onset, last_right = values.get(f"{key}_onset"), values.get(f"{key}_last_right")
    if onset is None:
        err = values.get(f"{key}_err_max")
        tail = "" if err is None else f" (largest error {err:.2g})"
        return f"no wrong row up to L = {values['levels_hi']:.0f}{tail}"
    if last_right is None:
        return f"wrong from the lowest level, L = {onset:.0f}"
    return f"right at L = {last_right:.0f}, wrong from L = {onset:.0f}"
