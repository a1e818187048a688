"""Seed 004's claims that study 05 can put to a measurement, read from a run's ``results.nc``: one table (the
source's number beside ours, and whether ours reproduces it, as a boolean) and the flat values the notebook
glues. Seed 004's numbers are the constants of ``readings`` marked ``[src]``; no English here.
"""
from __future__ import annotations

import math

import numpy as np
import xarray as xr

from .readings import (NOTES_P_MAX_NOT_ONE, SEED004_DQ_ERR_AFTER, SEED004_DQ_ERR_BEFORE, SEED004_FP32_STEP_COST,
                       SEED004_GPROJ_STEP_COST, SEED004_LOSS_GAP, baseline_run, has_real, regime_offset, trusted_offset,
                       within_factor)
from .readings_costs import call_extras, has_step_timings, has_timings, step_extras

REACHED_FACTOR = 2.0
"""Our unfixed error 'reaches' seed 004's 219% when it is within this factor of it either way."""
FIXED_FACTOR = 3.0
"""Our error after GProj is 'the order of' seed 004's 0.34% when it is at most this multiple of it."""
COST_FACTOR = 2.0
"""A measured cost reproduces seed 004's when it is within this factor of it either way."""
CLAIM_COLUMNS = ("kernel", "over", "sharpness", "|mu|", "trusted", "theirs", "theirs after", "ours", "ours after",
                 "reproduced")


def _nearest(err_none: xr.DataArray, err_fix: xr.DataArray, mu_max: float = math.inf):
    """The (sharpness, |mu|) with |mu| <= ``mu_max`` where ``err_none`` is nearest seed 004's 219% in log,
    and both errors there."""
    err_none = err_none.where(err_none["mu_norm"] <= mu_max)
    dist = np.abs(np.log(err_none / SEED004_DQ_ERR_BEFORE))
    idx = np.unravel_index(int(np.nanargmin(dist.values)), dist.shape)
    point = {dim: float(err_none[dim].values[i]) for dim, i in zip(err_none.dims, idx)}
    return point, float(err_none.sel(point)), float(err_fix.sel(point))


def before_after_reproduced(before: float, after: float) -> bool:
    """Seed 004's 219% -> 0.34% reproduced: ours before within ``REACHED_FACTOR`` of 219% and after at most
    ``FIXED_FACTOR`` x 0.34%."""
    return bool(within_factor(before, SEED004_DQ_ERR_BEFORE, REACHED_FACTOR)) and after <= FIXED_FACTOR * SEED004_DQ_ERR_AFTER


def _before_after_rows(label: str, kernel: str, over: str, err_none, err_fix, trusted: float) -> dict:
    """``label`` at the trusted offsets (the exact problem of |mu| = 0), and ``label_changed`` at the nearest
    point over every offset when that lies beyond them (a changed exact problem)."""
    rows = {}
    for key, mu_max in ((label, trusted), (f"{label}_changed", math.inf)):
        point, before, after = _nearest(err_none, err_fix, mu_max)
        if key != label and point["mu_norm"] <= trusted:
            continue
        rows[key] = {"kernel": kernel, "over": over, "sharpness": point["sharpness"], "|mu|": point["mu_norm"],
                     "trusted": bool(point["mu_norm"] <= trusted), "theirs": SEED004_DQ_ERR_BEFORE,
                     "theirs after": SEED004_DQ_ERR_AFTER, "ours": before, "ours after": after,
                     "reproduced": before_after_reproduced(before, after)}
    return rows


def _cost_row(kernel: str, over: str, ours: float, theirs: float, reproduced) -> dict:
    return {"kernel": kernel, "over": over, "sharpness": math.nan, "|mu|": math.nan, "trusted": None,
            "theirs": theirs, "theirs after": math.nan, "ours": ours, "ours after": math.nan,
            "reproduced": reproduced}


def seed004_claims(ds: xr.Dataset, timing_head_dim: int | None = None, timing_causal: bool | None = None):
    """One row per claim of seed 004 this dataset can measure, indexed by a short claim label:

    * ``dq_emulator`` / ``dq_triton`` / ``dq_fa4`` (each with ``_changed`` when the nearest point lies beyond
      the trusted offset): median dQ error before -> after GProj at the grid point (largest N; first d for the
      emulator, largest d for the real kernels) where the unfixed kernel is nearest 219%: the emulator's
      ``none`` -> ``gproj_dq``; ``triton:fa2`` -> ``triton:fa2:gproj_dq``; ``fa4`` (FlashAttention-3's design
      on Hopper, as it is) -> ``triton:fa2:gproj_dq``;
    * ``call_gproj``, ``call_gproj_flash``: GProj dq's extra per attention call (forward + backward) over our
      kernel without it and over ``sdpa:flash``; reproduced (as an upper bound of a step's extra) when at most
      seed 004's +4.7%;
    * ``call_fp32_ratio``: the fastest FP32 attention's extra over GProj's, per call, against theirs
      (+33.4% / +4.7%), within ``COST_FACTOR`` (the ratio of two extras does not depend on attention's share);
    * ``step_gproj``, ``step_gproj_flash``, ``step_fp32``, ``step_fp32_flash``: a whole training step of our
      GPT with GProj dq through our kernel, and with the fastest FP32 attention, over the step with our kernel
      without GProj and with ``sdpa:flash``; within ``COST_FACTOR`` of theirs.

    Columns ``CLAIM_COLUMNS``; ``reproduced`` is True, False or None (not measured: NaN ours)."""
    import pandas as pd

    rows = {}
    trusted = trusted_offset(ds)
    sub = ds["grid_dq_err"].isel(seq_len=-1, head_dim=0).median("seed")
    if "gproj_dq" in ds["fix"].values:
        rows.update(_before_after_rows("dq_emulator", "gproj_dq", "none", sub.sel(fix="none"), sub.sel(fix="gproj_dq"),
                                       trusted))
    names = ds["real_kernel"].values.tolist() if has_real(ds) else []
    at = dict(seq_len=int(ds["seq_len"][-1]), head_dim=int(ds["head_dim"][-1]))
    ran = lambda k: k in names and str(ds["real_status"].sel(real_kernel=k, **at).item()) == "ok"  # noqa: E731
    if ran("triton:fa2:gproj_dq"):
        real = ds["real_dq_err"].sel(**at).median("seed")
        for label, unfixed in (("dq_triton", "triton:fa2"), ("dq_fa4", "fa4")):
            if ran(unfixed):
                rows.update(_before_after_rows(label, "triton:fa2:gproj_dq", unfixed, real.sel(real_kernel=unfixed),
                                               real.sel(real_kernel="triton:fa2:gproj_dq"), trusted))
    call = call_extras(ds, timing_head_dim, timing_causal) if has_timings(ds) else call_extras(xr.Dataset())
    bound = lambda x: None if not np.isfinite(x) else bool(x <= SEED004_GPROJ_STEP_COST)  # noqa: E731
    rows["call_gproj"] = _cost_row("triton:fa2:gproj_dq", "triton:fa2", call["call_gproj_over_ours"],
                                   SEED004_GPROJ_STEP_COST, bound(call["call_gproj_over_ours"]))
    rows["call_gproj_flash"] = _cost_row("triton:fa2:gproj_dq", "sdpa:flash", call["call_gproj_over_flash"],
                                         SEED004_GPROJ_STEP_COST, bound(call["call_gproj_over_flash"]))
    theirs_ratio = SEED004_FP32_STEP_COST / SEED004_GPROJ_STEP_COST
    rows["call_fp32_ratio"] = _cost_row(call["call_fp32_fastest"] or "", "triton:fa2", call["call_fp32_over_gproj"],
                                        theirs_ratio, within_factor(call["call_fp32_over_gproj"], theirs_ratio,
                                                                    COST_FACTOR))
    step = step_extras(ds) if has_step_timings(ds) else step_extras(xr.Dataset())
    for label, kernel, over, key, theirs in (
            ("step_gproj", "triton:fa2:gproj_dq", "triton:fa2", "gproj_over_ours", SEED004_GPROJ_STEP_COST),
            ("step_gproj_flash", "triton:fa2:gproj_dq", "sdpa:flash", "gproj_over_flash", SEED004_GPROJ_STEP_COST),
            ("step_fp32", step["fp32_fastest"], "triton:fa2", "fp32_fastest_over_ours", SEED004_FP32_STEP_COST),
            ("step_fp32_flash", step["fp32_fastest"], "sdpa:flash", "fp32_fastest_over_flash", SEED004_FP32_STEP_COST)):
        rows[label] = _cost_row(kernel, over, step[key], theirs, within_factor(step[key], theirs, COST_FACTOR))
    table = pd.DataFrame.from_dict(rows, orient="index")[list(CLAIM_COLUMNS)]
    table.index.name = "claim"
    return table


VERDICT_WORDS = {True: "reproduced", False: "not reproduced", None: "not measured"}
"""The verdict word the prose states for a claim's ``reproduced`` value."""
WITHIN_WORDS = {True: "within", False: "not within", None: "not measured:"}
"""The words the prose states for ``within_factor``'s answer ("... a factor of 2 of seed 004's number")."""


def claims_values(claims) -> dict:
    """Flat values of ``seed004_claims``'s table for the prose: per claim label ``<label>_ours``,
    ``<label>_kernel`` and ``<label>_verdict`` (a word of ``VERDICT_WORDS``); for the before/after claims
    (``dq_*``) also ``<label>_ours_after``, ``<label>_sharpness`` and ``<label>_mu``. Every possible label's keys
    are present, None (and the word "not measured") for a claim without a row."""
    dq = [f"{k}{c}" for k in ("dq_emulator", "dq_triton", "dq_fa4") for c in ("", "_changed")]
    costs = ["call_gproj", "call_gproj_flash", "call_fp32_ratio", "step_gproj", "step_gproj_flash", "step_fp32",
             "step_fp32_flash"]
    out = {}
    for label in dq + costs:
        row = claims.loc[label] if label in claims.index else None
        num = lambda col: None if row is None or not np.isfinite(row[col]) else float(row[col])  # noqa: E731
        verdict = None if row is None or row["reproduced"] is None else bool(row["reproduced"])
        out.update({f"{label}_ours": num("ours"), f"{label}_kernel": None if row is None else (str(row["kernel"]) or None),
                    f"{label}_verdict": VERDICT_WORDS[verdict]})
        if label in dq:
            out.update({f"{label}_ours_after": num("ours after"), f"{label}_sharpness": num("sharpness"),
                        f"{label}_mu": num("|mu|")})
    return out


def source_values() -> dict:
    """Seed 004's own numbers (theirs, for the prose that cites them), the notes' numpy check, and the
    criteria of the verdicts."""
    return {"seed004_dq_before": SEED004_DQ_ERR_BEFORE, "seed004_dq_after": SEED004_DQ_ERR_AFTER,
            "seed004_gproj_step": SEED004_GPROJ_STEP_COST, "seed004_fp32_step": SEED004_FP32_STEP_COST,
            "seed004_fp32_over_gproj": SEED004_FP32_STEP_COST / SEED004_GPROJ_STEP_COST,
            "seed004_loss_gap": SEED004_LOSS_GAP, "notes_p_max_not_one": NOTES_P_MAX_NOT_ONE,
            "reached_factor": REACHED_FACTOR,
            "fixed_factor": FIXED_FACTOR, "cost_factor": COST_FACTOR}


def training_values(ds: xr.Dataset) -> dict:
    """Seed 004's training claims against this run's small model: the largest |final-loss gap| of a GProj run
    to FP32 attention's, the unfixed kernel's gap, whether that comparison discriminates (the unfixed kernel
    is not as close: gap above twice GProj's plus 1e-3 nat); the late gradient norm over FP32 attention's of
    the unfixed kernel and the forward fix (median over the second half), whether the unfixed kernel grows
    (ratio >= 2); the largest key-mean norm any run reached, the regime's |mu| (``regime_offset``) and
    whether any run reached it. None where a run is missing."""
    out = {"train_gproj_gap": None, "train_none_gap": None, "train_discriminating": None, "train_none_ratio": None,
           "train_forward_fix_ratio": None, "train_none_grows": None, "train_key_mean_max": None,
           "train_regime_mu": None, "train_regime_reached": None}
    if "train_loss" not in ds:
        return out
    final = ds["train_loss"].isel(step=slice(-10, None)).mean("step")
    baseline = baseline_run(ds)
    gap = lambda run: float(final.sel(run=run) - final.sel(run=baseline))  # noqa: E731
    runs = final["run"].values
    gps = [r for r in ("gproj_dq", "gproj_dq_dk") if r in runs]
    if gps and "none" in runs:
        worst = max(abs(gap(r)) for r in gps)
        out.update(train_gproj_gap=worst, train_none_gap=gap("none"),
                   train_discriminating=bool(abs(gap("none")) > 2 * worst + 1e-3))
    steps = ds["step"].values
    late = steps >= steps[0] + 0.5 * (steps[-1] - steps[0])
    ratio = (ds["train_grad_norm_total"] / ds["train_grad_norm_total"].sel(run=baseline)).isel(step=late).median("step")
    if "none" in runs:
        out.update(train_none_ratio=float(ratio.sel(run="none")), train_none_grows=bool(ratio.sel(run="none") >= 2))
    if "forward_fix" in runs:
        out["train_forward_fix_ratio"] = float(ratio.sel(run="forward_fix"))
    if "train_key_mean_norm" in ds:
        top = regime_offset(ds)
        key = float(ds["train_key_mean_norm"].max())
        out.update(train_key_mean_max=key, train_regime_mu=top if np.isfinite(top) else None,
                   train_regime_reached=bool(key >= top))
    return out


def p_max_values(ds: xr.Dataset) -> dict:
    """Seed 004's cause 1: the span over the grid of the fraction of rows whose fused scale-max P at the row
    maximum is not exactly 1 (fused emulator), and whether the effect occurs at all."""
    frac = ds["grid_p_max_not_one"]
    return {"p_max_not_one_min": float(frac.min()), "p_max_not_one_max": float(frac.max()),
            "p_max_not_one_occurs": bool(frac.max() > 0)}
