"""Readings of a study-04 run (CPU tiers and the committed ``gpu`` run): the sources' own numbers (constants
marked ``[src]``, cited as theirs; ``docs/sources.md`` names each source) and their gradient checks
(seeds 000 and 003), the level crossings and ratios of the mechanism grid, the real-kernel summary and
details, the training summary and the diagnostic at spikes.
"""
from __future__ import annotations

import math

import numpy as np
import xarray as xr


# -- the sources' own numbers (theirs; docs/sources.md), each marked [src] -------------------------

SEED003_THRESHOLDS = {"dq": 1e-3, "dk": 1e-3, "dv": 5e-3}
"""[src] Seed 003's gradient thresholds on the largest absolute difference (in its setting, ``SEED003_SETTING``)."""
SEED003_SETTING = {"format": "fp16", "seq_len": 1024, "head_dim": 64}
"""[src] Seed 003's setting of those thresholds (against PyTorch's attention)."""
SEED003_CAUSAL_FACTOR = 10.0
"""[src] Seed 003: the causal backward "an order of magnitude" more stable than the generic one."""
SEED000_MIN_COS, SEED000_MAX_ANGLE = 0.99, 5.0
"""[src] Seed 000's gradient check: cosine similarity above 0.99 and angle below 5 degrees."""
SEED004_DQ_ERR = 2.19
"""[src] Seed 004: the median (over rows) relative dQ error its late-training run reached."""
SEED004_GRAD_NORM_GROWTH = 1000.0
"""[src] Seed 004: the gradient norm grew about this many times after the first ``SEED004_TOKENS_NORMAL``."""
SEED004_LOSS_GAP = 0.2
"""[src] Seed 004: final loss of BF16 FlashAttention-3 above FP32 attention's, nat."""
SEED004_PARAMETERS = 450e6
"""[src] Seed 004: parameters of its Transformer."""
SEED004_TOKENS = 50e9
"""[src] Seed 004: tokens of its whole run."""
SEED004_TOKENS_NORMAL = 25e9
"""[src] Seed 004: tokens it trained normally before the gradient norm grew."""
QIU_YAO_RESUME_STEP = 70_000
"""[src] Qiu & Yao's public training script: its "reproduce the instability" mode resumes at this iteration."""
QIU_YAO_TOKENS_PER_STEP = 20 * 1024 * 16
"""[src] Qiu & Yao's public training script: micro-batch 20 x 1024 tokens, 16 accumulation steps."""
QIU_YAO_LR, QIU_YAO_WEIGHT_DECAY = 1e-3, 0.0
"""[src] Qiu & Yao's public training script: the peak learning rate and weight decay of the unstable setting."""

# -- the study's own criteria ----------------------------------------------------------------------

SAME_PROBLEM_TOLERANCE = 0.1
"""The exact problem "has not moved" at a |mu| while its fp64 dQ is within this (median row relative difference) of
the one at |mu| = 0 (``same_problem_limit``)."""
REAL_GROWTH_AT_LEAST = 10.0
"""A real kernel "shows the growth" when its dQ error grows at least this many times from the smallest to the
largest |mu| at every sharpness (``real_kernel_summary``)."""


def source_values() -> dict:
    """The sources' own numbers the prose cites (theirs, never ours; sizes in millions ``_m`` and billions
    ``_b``), and the study's criteria, flat for ``attnum.glue``: keys without the notebook's prefix."""
    return {"seed004_dq_err": SEED004_DQ_ERR, "seed004_grad_norm_growth": SEED004_GRAD_NORM_GROWTH,
            "seed004_loss_gap": SEED004_LOSS_GAP, "seed004_parameters_m": SEED004_PARAMETERS / 1e6,
            "seed004_tokens_b": SEED004_TOKENS / 1e9, "seed004_tokens_normal_b": SEED004_TOKENS_NORMAL / 1e9,
            "seed000_min_cos": SEED000_MIN_COS, "seed000_max_angle": SEED000_MAX_ANGLE,
            "seed003_dq_max": SEED003_THRESHOLDS["dq"], "seed003_dk_max": SEED003_THRESHOLDS["dk"],
            "seed003_dv_max": SEED003_THRESHOLDS["dv"], "seed003_format": SEED003_SETTING["format"],
            "seed003_seq_len": SEED003_SETTING["seq_len"], "seed003_head_dim": SEED003_SETTING["head_dim"],
            "seed003_causal_factor": SEED003_CAUSAL_FACTOR,
            "qiu_yao_resume_step": QIU_YAO_RESUME_STEP, "qiu_yao_tokens_per_step": QIU_YAO_TOKENS_PER_STEP,
            "qiu_yao_tokens": QIU_YAO_RESUME_STEP * QIU_YAO_TOKENS_PER_STEP, "qiu_yao_lr": QIU_YAO_LR,
            "qiu_yao_weight_decay": QIU_YAO_WEIGHT_DECAY, "real_growth_at_least": REAL_GROWTH_AT_LEAST}


def definition_values() -> dict:
    """Definitions the prose states: the largest spacing of bf16 numbers relative to their magnitude (two
    unit roundoffs, 2^-(t-1) for t significand bits: what a bf16 key component keeps of itself)."""
    from ...precision import SIGNIFICAND_BITS

    return {"bf16_spacing": 2.0 ** -(SIGNIFICAND_BITS["bf16"] - 1)}


def run_parameters(ds: xr.Dataset | None) -> dict:
    """The parameters a run was made with (its ``parameters`` attribute), empty without a run."""
    import json

    if ds is None:
        return {}
    raw = ds.attrs.get("parameters", {})
    return json.loads(raw) if isinstance(raw, str) else dict(raw)


def gpu_grid_values(ds: xr.Dataset | None) -> dict:
    """What the prose states of a run's grids (the committed ``gpu`` run): the real-kernel grid's smallest
    and largest N and d and its d's as a list, and the tied-maxima comparison's N and d. None without a run."""
    if ds is None or "real_seq_len" not in ds:
        return {k: None for k in ("real_n_min", "real_n_max", "real_d_min", "real_d_max", "real_head_dims",
                                  "tie_seq_len", "tie_head_dim")}
    p = run_parameters(ds)
    n, d = ds["real_seq_len"].values, ds["real_head_dim"].values
    return {"real_n_min": int(n.min()), "real_n_max": int(n.max()), "real_d_min": int(d.min()),
            "real_d_max": int(d.max()), "real_head_dims": ", ".join(str(int(x)) for x in d),
            "tie_seq_len": p.get("tie_seq_len"), "tie_head_dim": p.get("tie_head_dim")}


def ds_row_sum_values(ds: xr.Dataset, at: dict) -> dict:
    """The relative row sum of the dS the dQ matmul multiplies (``mech_ds_row_sum``, median over seeds) at
    the first sharpness and |mu| = 0 and the grid point ``at``, for FP32 attention (``fp32``) and for FP32
    attention with dS rounded to bf16 (``fp32_ds_bf16``); None for a variant the run lacks."""
    rows = ds["mech_ds_row_sum"].sel(**at).isel(sharpness=0, mu_norm=0).median("seed")
    return {f"ds_row_sum_{v}": float(rows.sel(variant=v)) if v in ds["variant"].values else None
            for v in ("fp32", "fp32_ds_bf16")}


def keyed(prefix: str, values: dict) -> dict:
    """``values`` with every key prefixed (the notebook's glue keys: ``s04_``)."""
    return {prefix + k: v for k, v in values.items()}


def orders_of_magnitude(theirs: float, ours: float) -> float | None:
    """log10(``theirs`` / ``ours``): how many orders of magnitude a source's size is above ours (None
    where either is not a positive finite number)."""
    try:
        ratio = float(theirs) / float(ours)
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return math.log10(ratio) if math.isfinite(ratio) and ratio > 0 else None


def seed000_limits() -> dict:
    """What seed 000's two conditions allow, in the other's terms: the angle (degrees) its cosine limit
    permits, arccos(``SEED000_MIN_COS``), and the relative L2 error between two vectors of equal norm at
    its angle limit, 2 sin(``SEED000_MAX_ANGLE`` / 2)."""
    return {"cos_angle": math.degrees(math.acos(SEED000_MIN_COS)),
            "angle_error": 2 * math.sin(math.radians(SEED000_MAX_ANGLE) / 2)}


def seed003_verdicts(ds: xr.Dataset, prefix: str = "src") -> xr.DataArray:
    """1 where dQ, dK and dV all pass seed 003's thresholds on the largest absolute error, else 0."""
    ok = xr.ones_like(ds[f"{prefix}_dq_max_abs_err"], dtype=bool)
    for g, limit in SEED003_THRESHOLDS.items():
        ok = ok & (ds[f"{prefix}_{g}_max_abs_err"] < limit)
    return ok.astype(np.int8)


def seed000_accepts(cos: xr.DataArray) -> xr.DataArray:
    """1 where seed 000's gradient check (cosine > 0.99 and angle < 5 degrees) accepts, else 0."""
    angle = np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))
    return ((cos > SEED000_MIN_COS) & (angle < SEED000_MAX_ANGLE)).astype(np.int8)


def seed000_table(ds: xr.Dataset, bad: float = 0.5):
    """Per variant, over the mechanism grid: the points whose median row dQ error is at least ``bad``
    (a badly wrong dQ by seed 004's metric), how many of them seed 000's check accepts, and the largest
    median row dQ error it accepts (with that point's cosine, angle and global relative L2 error)."""
    import pandas as pd

    rows = []
    accepted = seed000_accepts(ds["mech_dq_cos"])
    for variant in ds["variant"].values:
        err = ds["mech_dq_err"].sel(variant=variant).values.ravel()
        acc = accepted.sel(variant=variant).values.ravel().astype(bool)
        cos = ds["mech_dq_cos"].sel(variant=variant).values.ravel()
        glob = ds["mech_dq_rel_err"].sel(variant=variant).values.ravel()
        wrong = np.isfinite(err) & (err >= bad)
        worst = np.where(acc & np.isfinite(err), err, -np.inf)
        i = int(np.argmax(worst))
        has = np.isfinite(worst[i])
        rows.append({"variant": str(variant), f"points with median-row dQ err >= {bad:g}": int(wrong.sum()),
                     "of them accepted by seed 000's check": int((wrong & acc).sum()),
                     "largest accepted median-row dQ err": err[i] if has else math.nan,
                     "its cosine": cos[i] if has else math.nan,
                     "its angle (deg)": float(np.degrees(np.arccos(min(1.0, cos[i])))) if has else math.nan,
                     "its global rel. L2 dQ err": glob[i] if has else math.nan})
    return pd.DataFrame(rows).set_index("variant")


def same_problem_limit(ds: xr.Dataset, tolerance: float = SAME_PROBLEM_TOLERANCE) -> xr.DataArray:
    """Per (sharpness, N, d): the largest |mu| of the grid up to which the exact problem has not moved
    (median over seeds of ``mech_exact_dq_shift`` at most ``tolerance`` at that |mu| and every smaller one)."""
    shift = ds["mech_exact_dq_shift"].median("seed")
    within = (shift <= tolerance).cumprod("mu_norm").astype(bool)  # every |mu| up to here within
    mus = xr.broadcast(ds["mu_norm"], within)[0]
    out = mus.where(within).max("mu_norm")
    out.attrs.update(units="1", long_name=f"largest |mu| at which the exact dQ has moved by at most {tolerance:g} "
                                          "(median row) from |mu| = 0")
    return out


def dq_growth(ds: xr.Dataset, *, seq_len: int | None = None, head_dim: int | None = None):
    """Per sharpness: each real kernel's and each emulator variant's dQ error at the largest |mu|
    divided by its error at the smallest (|mu| = 0 on every tier; median over seeds), at
    ``seq_len`` / ``head_dim`` (default: the largest N and the first d of the real-kernel grid),
    with both errors beside the ratio (NaN for a kernel that gave no gradients)."""
    import pandas as pd

    at = dict(real_seq_len=int(ds["real_seq_len"][-1]) if seq_len is None else seq_len,
              real_head_dim=int(ds["real_head_dim"][0]) if head_dim is None else head_dim)
    low, top = float(ds["mu_norm"].min()), float(ds["mu_norm"].max())
    rows = []
    for var, dim, kind in (("real_mech_emulator_dq_err", "real_variant", "emulator"),
                           ("real_mech_dq_err", "real_kernel", "real")):
        da = ds[var].sel(**at).median("seed")
        for name in ds[dim].values:
            for s in ds["sharpness"].values:
                zero = float(da.sel({dim: name, "sharpness": s, "mu_norm": low}))
                big = float(da.sel({dim: name, "sharpness": s, "mu_norm": top}))
                rows.append({"kernel": f"{kind}: {name}", "sharpness": float(s), f"dQ err at |mu|={low:g}": zero,
                             f"dQ err at |mu|={top:g}": big, "growth": big / zero if zero > 0 else math.nan})
    return pd.DataFrame(rows).set_index(["kernel", "sharpness"])


def real_kernel_summary(ds: xr.Dataset, *, emulator: str = "bf16", growth_at_least: float = REAL_GROWTH_AT_LEAST):
    """One row per real kernel, from the real-kernel grid and the real-kernel diagnostic of a run:
    its status; its median row dQ error at the smallest and the largest |mu| (largest N, first d, the
    range over sharpness), its growth factor beside the emulator variant's on the same operands, whether
    it grows by at least ``growth_at_least`` at every sharpness; the median and the range over
    (sharpness, |mu| > 0, seed) of the correlation of its dQ error with the emulator's; and the FP32
    recompute diagnostic with it as the model's attention: its global relative L2 dQ error (largest over
    layers) without an offset and at the largest offset, the layers flagged without an offset, and the
    query/key projection gradient-norm ratio (largest over layers) without an offset."""
    import pandas as pd

    growth = dq_growth(ds)
    low, top = float(ds["mu_norm"].min()), float(ds["mu_norm"].max())
    at = dict(real_seq_len=int(ds["real_seq_len"][-1]), real_head_dim=int(ds["real_head_dim"][0]))
    rows = []
    for kernel in ds["real_kernel"].values:
        kernel = str(kernel)
        status = ds["real_mech_status"].sel(real_kernel=kernel).values.ravel()
        bad = [str(x) for x in status if str(x) != "ok"]
        g = growth.xs(f"real: {kernel}", level="kernel")
        e = growth.xs(f"emulator: {emulator}", level="kernel") if f"emulator: {emulator}" in growth.index.get_level_values(0) else None
        corr = ds["real_mech_dq_err_corr"].sel(real_kernel=kernel, real_variant=emulator, **at)
        corr = corr.where(corr["mu_norm"] > 0).values.ravel()
        corr = corr[np.isfinite(corr)]
        row = {"kernel": kernel, "status": "ok" if not bad else bad[0][:200],
               f"dQ err at |mu|={low:g}, min": g[f"dQ err at |mu|={low:g}"].min(),
               f"dQ err at |mu|={top:g}, max": g[f"dQ err at |mu|={top:g}"].max(),
               "growth min": g["growth"].min(), "growth max": g["growth"].max(),
               f"emulator {emulator} growth min": e["growth"].min() if e is not None else math.nan,
               f"emulator {emulator} growth max": e["growth"].max() if e is not None else math.nan,
               "grows": bool((g["growth"] >= growth_at_least).all()) if np.isfinite(g["growth"]).all() else None,
               f"corr with {emulator}, median": float(np.median(corr)) if corr.size else math.nan,
               f"corr with {emulator}, min": float(corr.min()) if corr.size else math.nan,
               f"corr with {emulator}, max": float(corr.max()) if corr.size else math.nan}
        if "real_diag_dq_rel_err" in ds:
            diag = ds["real_diag_dq_rel_err"].sel(real_kernel=kernel)
            offsets = ds["offset_norm"].values
            row.update({
                "diag status": str(ds["real_diag_status"].sel(real_kernel=kernel).values)[:200],
                "diag global rel. L2 dQ err, no offset (max layer)": float(diag.sel(offset_norm=0.0).max()),
                f"diag global rel. L2 dQ err, offset {offsets.max():g} (max layer)":
                    float(diag.sel(offset_norm=offsets.max()).max()),
                "diag layers flagged, no offset": int(ds["real_diag_flagged"].sel(real_kernel=kernel,
                                                                                  offset_norm=0.0).sum()),
                "diag q/k grad-norm ratio, no offset (max layer)":
                    float(ds["real_diag_grad_norm_qk_ratio"].sel(real_kernel=kernel, offset_norm=0.0).max()),
            })
        rows.append(row)
    return pd.DataFrame(rows).set_index("kernel")


def real_kernel_details(ds: xr.Dataset, *, emulator: str = "bf16", tolerance: float = SAME_PROBLEM_TOLERANCE):
    """Per real kernel, what ``real_kernel_summary`` leaves out, over the whole real-kernel grid (every
    sharpness, |mu|, N, d and seed): the ratio of its median row dQ error to the emulator variant's at the
    same point (min, max); its median row dQ error growth from |mu| = 0 to the largest |mu| within the
    mechanism grid's same-problem limit (``same_problem_limit`` at ``tolerance``, the smallest over its
    N and d, per sharpness; largest real N, first real d; min and max over sharpness) beside the
    emulator's; the median correlation of its dQ error with the emulator's at each head dimension
    (|mu| > 0); its largest median row dK and dV errors and their largest growth over |mu| = 0 at the same
    point; and, with it as the model's attention, the diagnostic's *median row* dQ error without an
    offset (largest over layers), the smallest offset at which a layer is flagged (by the global relative
    L2 dQ error; NaN: never) and the range of the query/key gradient-norm ratio over offsets and layers."""
    import pandas as pd

    low = float(ds["mu_norm"].min())
    emu = ds["real_mech_emulator_dq_err"].sel(real_variant=emulator)
    at = dict(real_seq_len=int(ds["real_seq_len"][-1]), real_head_dim=int(ds["real_head_dim"][0]))
    limit = (same_problem_limit(ds, tolerance).min([d for d in ("seq_len", "head_dim") if d in ds.dims])
             if "mech_exact_dq_shift" in ds else None)

    def growth_within(da):
        if limit is None:
            return math.nan, math.nan
        g = []
        for s in ds["sharpness"].values:
            top = float(limit.sel(sharpness=s))
            if not np.isfinite(top) or top <= low:
                continue
            e = da.sel(sharpness=s, **at).median("seed")
            g.append(float(e.sel(mu_norm=top) / e.sel(mu_norm=low)))
        g = [x for x in g if np.isfinite(x)]
        return (min(g), max(g)) if g else (math.nan, math.nan)

    def finite(x):
        x = np.asarray(x, dtype=float).ravel()
        return x[np.isfinite(x)]

    e_lo, e_hi = growth_within(emu)
    rows = []
    for kernel in ds["real_kernel"].values:
        kernel = str(kernel)
        real = ds.sel(real_kernel=kernel)
        ratio = finite(real["real_mech_dq_err"] / emu)
        g_lo, g_hi = growth_within(real["real_mech_dq_err"])
        row = {"kernel": kernel,
               f"dQ err / emulator {emulator}'s, min": ratio.min() if ratio.size else math.nan,
               f"dQ err / emulator {emulator}'s, max": ratio.max() if ratio.size else math.nan,
               "same-problem growth, min": g_lo, "same-problem growth, max": g_hi,
               f"emulator {emulator} same-problem growth, min": e_lo,
               f"emulator {emulator} same-problem growth, max": e_hi}
        cos = finite(real["real_mech_dq_err_cos_mu"].sel(mu_norm=float(ds["mu_norm"].max())))
        row["dQ err |cos| with mu at the largest |mu|, min"] = cos.min() if cos.size else math.nan
        corr = real["real_mech_dq_err_corr"].sel(real_variant=emulator)
        for d in ds["real_head_dim"].values:
            c = finite(corr.sel(real_head_dim=d).where(corr["mu_norm"] > 0))
            row[f"corr with {emulator}, median at d={int(d)}"] = float(np.median(c)) if c.size else math.nan
        for g in ("dk", "dv"):
            err = real[f"real_mech_{g}_err"]
            e = finite(err)
            gr = finite(err / err.sel(mu_norm=low))
            name = {"dk": "dK", "dv": "dV"}[g]
            row[f"{name} err, max"] = e.max() if e.size else math.nan
            row[f"{name} err growth over |mu|={low:g}, max"] = gr.max() if gr.size else math.nan
        if "real_diag_dq_row_rel_err" in ds:
            ok = str(ds["real_diag_status"].sel(real_kernel=kernel).values) == "ok"
            flagged = ds["real_diag_flagged"].sel(real_kernel=kernel).max("layer")
            offs = ds["offset_norm"].values[np.asarray(flagged.values) > 0]
            qk = finite(ds["real_diag_grad_norm_qk_ratio"].sel(real_kernel=kernel))
            row.update({
                "diag median row dQ err, no offset (max layer)":
                    float(ds["real_diag_dq_row_rel_err"].sel(real_kernel=kernel, offset_norm=0.0).max()) if ok
                    else math.nan,
                "diag smallest offset flagged": float(offs.min()) if ok and offs.size else math.nan,
                "diag q/k grad-norm ratio, min": qk.min() if ok and qk.size else math.nan,
                "diag q/k grad-norm ratio, max": qk.max() if ok and qk.size else math.nan,
                "diag model grad-norm ratio, largest |ratio - 1|":
                    float(abs(ds["real_diag_total_grad_norm_ratio"].sel(real_kernel=kernel) - 1).max()) if ok
                    else math.nan,
                "diag forward identical at every offset":
                    float(ds["real_diag_forward_identical"].sel(real_kernel=kernel).min()) if ok else math.nan})
        rows.append(row)
    return pd.DataFrame(rows).set_index("kernel")


TRAINING_RUNS = {"bf16": "train_attention", "fp32": "baseline_attention"}
"""The training runs (the ``run`` coordinate): the run with the kernel under test and the FP32-attention run,
each with the parameter that names its attention (a registry name; the run's ``run_attention`` holds the
kernel's own name)."""
TRAINING_PARAMS = ("task", "lm_loss", "context", "n_symbols", "n_layer", "n_head", "d_model", "train_attention",
                   "model_block", "steps", "batch_size", "lr", "warmup_steps", "weight_decay", "grad_clip",
                   "train_seed", "data_seed")


def level_crossing(da: xr.DataArray, dim: str, level: float) -> xr.DataArray:
    """The value of coordinate ``dim`` at which ``da`` first reaches ``level``, by log-log
    interpolation between neighbouring points with dim > 0 (NaN when it never does, or
    already does at the first positive point)."""
    x_all = da[dim].values.astype(float)

    def crossing(vals):
        ok = (x_all > 0) & np.isfinite(vals) & (vals > 0)
        x, y = np.log(x_all[ok]), np.log(vals[ok])
        above = np.nonzero(y >= math.log(level))[0]
        if not len(above) or above[0] == 0:
            return math.nan
        i = above[0]
        t = (math.log(level) - y[i - 1]) / (y[i] - y[i - 1])
        return float(np.exp(x[i - 1] + t * (x[i] - x[i - 1])))

    out = xr.apply_ufunc(crossing, da, input_core_dims=[[dim]], vectorize=True)
    out.attrs.update(units="1", long_name=f"{dim} at which {da.name} reaches {level:g}")
    return out


def spike_table(ds: xr.Dataset):
    """The diagnostic at every gradient-norm spike of the trained run: one row per spike step."""
    import pandas as pd

    spikes = ds["diag_step"].values[ds["live_spike"].values == 1]
    sub = ds.sel(diag_step=spikes)
    table = pd.DataFrame({"gradient norm": sub["live_grad_norm_total"].values,
                          "model ratio (as run / FP32 bwd)": sub["live_total_grad_norm_ratio"].values},
                         index=pd.Index(spikes, name="step"))
    for layer in ds["layer"].values:
        table[f"layer {layer} ratio"] = sub["live_grad_norm_ratio"].sel(layer=layer).values
        table[f"layer {layer} dQ global rel. L2 err"] = sub["live_dq_rel_err"].sel(layer=layer).values
    return table


BF16_FLASH_VARIANTS = ("fp32_ds_bf16", "bf16_bwd_fp32", "bf16", "bf16_fused")


def gap_below_bf16(ds: xr.Dataset, variant: str, var: str = "mech_dq_err") -> float:
    """The smallest factor, over every grid point, by which each BF16 flash variant's error exceeds
    ``variant``'s (below 1: somewhere a BF16 flash variant is more accurate)."""
    present = [v for v in BF16_FLASH_VARIANTS if v in ds["variant"].values]
    if variant not in ds["variant"].values or not present:
        return math.nan
    return float((ds[var].sel(variant=present).min("variant") / ds[var].sel(variant=variant)).min())


def spread_over_sizes(ds: xr.Dataset, variant: str, var: str = "mech_dq_err") -> float:
    """The largest ratio, at one (sharpness, |mu| > 0, seed), between the errors of two (N, d) points."""
    da = ds[var].sel(variant=variant).where(ds["mu_norm"] > 0)
    spread = da.max(["seq_len", "head_dim"]) / da.min(["seq_len", "head_dim"])
    return float(spread.max())


def training_summary(ds: xr.Dataset, trained: str = "bf16", baseline: str = "fp32", late_fraction: float = 0.5):
    """One row per run pair: final losses, the loss gap, and the late-training ratio of global
    gradient norms (trained / baseline; median and max over the last ``late_fraction`` of steps)."""
    import pandas as pd

    steps = ds["step"].values
    late = steps >= steps[0] + (1 - late_fraction) * (steps[-1] - steps[0])
    ratio = (ds["train_grad_norm_total"].sel(run=trained) / ds["train_grad_norm_total"].sel(run=baseline)).values[late]
    final = lambda run: float(ds["train_loss"].sel(run=run).isel(step=slice(-10, None)).mean())
    ratio_all = (ds["train_grad_norm_total"].sel(run=trained) / ds["train_grad_norm_total"].sel(run=baseline)).values
    return pd.DataFrame([{
        f"final loss {trained}": final(trained), f"final loss {baseline}": final(baseline),
        "loss gap (nat)": final(trained) - final(baseline),
        "late grad-norm ratio, median": float(np.nanmedian(ratio)),
        "late grad-norm ratio, max": float(np.nanmax(ratio)),
        "grad-norm ratio, max over all steps": float(np.nanmax(ratio_all)),
    }])


def on_cuda(ds: xr.Dataset | None) -> bool:
    """Whether ``ds`` is a run made on a CUDA device (the committed ``gpu`` run is read only if so)."""
    return ds is not None and "cuda" in str(ds.attrs.get("device", ""))


def cuda_run(ds: xr.Dataset | None) -> xr.Dataset | None:
    """``ds`` (e.g. ``ncio.committed_run(STUDY, "gpu")``) when it ran on a CUDA device, else None."""
    return ds if on_cuda(ds) else None


def cpu_training_run(ds: xr.Dataset | None) -> xr.Dataset | None:
    """``ds`` (e.g. ``ncio.committed_run(STUDY, "default")``) when it is a CPU run that trained the model
    (the CPU training the gpu_training tier is set beside), else None."""
    return ds if ds is not None and not on_cuda(ds) and "train_grad_norm_total" in ds else None


def tied_cos_pk(ds: xr.Dataset) -> xr.DataArray:
    """Per regime: the smallest median-over-seeds |cos(dQ error, P K)| of the BF16 flash variants
    ``bf16`` and ``bf16_fused`` over both tilings (near 1: the error is a row-sum residual times the
    key component every attended key shares)."""
    flash = [v for v in ("bf16", "bf16_fused") if v in ds["variant"].values]
    return ds["qy_dq_err_cos_pk"].sel(variant=flash).median("seed").min(["variant", "tiling"])


def late_diagnostic(ds: xr.Dataset | None, level: float = 1.0) -> dict:
    """The FP32 recompute diagnostic without an offset over the last third of training (the checkpoints
    at or past two thirds of the last), in the layer with the largest global dQ
    error there: its global relative L2 dQ error (``diag_dq_rel_err``, what the flag reads) and its median
    row error (``diag_dq_row_rel_err``), each min and max over those checkpoints, per measure whether it
    reaches ``level`` at some checkpoint (``*_passes_100``) and the fraction of those checkpoints at which
    it does (``*_pass_fraction``), how many of those checkpoints flag the layer, and its query/key
    gradient-norm ratio. NaN values (None verdicts) for a run without the diagnostic."""
    keys = ("layer", "first_checkpoint", "last_checkpoint", "n_checkpoints", "flagged", "global_min", "global_max",
            "row_min", "row_max", "qk_ratio_min", "qk_ratio_max", "global_pass_fraction", "row_pass_fraction")
    if ds is None or "diag_dq_rel_err" not in ds:
        return {**{k: math.nan for k in keys}, "level": level, "global_passes_100": None, "row_passes_100": None}
    checkpoints = ds["checkpoint"].values
    late = checkpoints[checkpoints >= checkpoints.max() * 2 / 3]
    at = dict(offset_norm=0.0, checkpoint=late)
    glob, row = ds["diag_dq_rel_err"].sel(**at), ds["diag_dq_row_rel_err"].sel(**at)
    layer = int(glob["layer"].values[int(np.argmax(glob.max("checkpoint").values))])
    qk = ds["diag_grad_norm_qk_ratio"].sel(**at, layer=layer)
    g, r = glob.sel(layer=layer).values, row.sel(layer=layer).values
    out = {"layer": layer, "first_checkpoint": int(late[0]), "last_checkpoint": int(late[-1]),
           "n_checkpoints": len(late), "flagged": int(ds["diag_flagged"].sel(**at, layer=layer).sum()),
           "global_min": float(g.min()), "global_max": float(g.max()),
           "row_min": float(r.min()), "row_max": float(r.max()),
           "qk_ratio_min": float(qk.min()), "qk_ratio_max": float(qk.max()),
           "global_pass_fraction": float(np.mean(g >= level)), "row_pass_fraction": float(np.mean(r >= level)),
           "level": level}
    out["global_passes_100"] = out["global_max"] >= level
    out["row_passes_100"] = out["row_max"] >= level
    return out


def trained_model(ds: xr.Dataset):
    """The model a run trained, as the real-kernel diagnostic's model, one row per layer: at the last
    checkpoint, with the trained emulated kernel, without an offset its global relative L2 and median
    row dQ errors, its global relative L2 dQ error at the largest offset, whether it is flagged there
    without an offset, the smallest offset at which it is flagged (NaN: at none), the number of
    checkpoints at which it is flagged without an offset, and its largest attention logit at the last
    recorded step of the trained (``bf16``) run."""
    import pandas as pd

    last = int(ds["checkpoint"].values.max())
    offsets = ds["offset_norm"].values
    at_last = ds.sel(checkpoint=last)
    rows = []
    for layer in ds["layer"].values:
        flags = at_last["diag_flagged"].sel(layer=layer).values > 0
        rows.append({"layer": int(layer), "checkpoint": last,
                     "global dQ err, no offset": float(at_last["diag_dq_rel_err"].sel(layer=layer, offset_norm=0.0)),
                     "median row dQ err, no offset": float(at_last["diag_dq_row_rel_err"].sel(layer=layer,
                                                                                              offset_norm=0.0)),
                     f"global dQ err, offset {offsets.max():g}":
                         float(at_last["diag_dq_rel_err"].sel(layer=layer, offset_norm=offsets.max())),
                     "smallest offset flagged": float(offsets[flags].min()) if flags.any() else math.nan,
                     "checkpoints flagged, no offset": int((ds["diag_flagged"].sel(layer=layer, offset_norm=0.0)
                                                            > 0).sum()),
                     "max logit, last step": float(ds["train_max_logit"].sel(run="bf16", layer=layer).isel(step=-1))})
    return pd.DataFrame(rows).set_index("layer")


def same_training(ds: xr.Dataset, other: xr.Dataset | None) -> dict | None:
    """When ``ds`` and ``other`` (two runs of this study, e.g. a CPU tier and the committed GPU run) trained
    the same model the same way (``TRAINING_PARAMS`` equal): the number of first recorded steps compared,
    the largest relative difference of their BF16 runs' losses over them, and each run's final loss;
    None otherwise."""
    import json

    if other is None or other is ds or "train_loss" not in ds or "train_loss" not in other:
        return None
    p, q = (json.loads(x.attrs["parameters"]) if isinstance(x.attrs.get("parameters"), str)
            else dict(x.attrs.get("parameters", {})) for x in (ds, other))
    if not p or not q or any(p.get(k) != q.get(k) for k in TRAINING_PARAMS):
        return None
    a, b = (x["train_loss"].sel(run="bf16") for x in (ds, other))
    n = min(4, a.sizes["step"], b.sizes["step"])
    return {"first steps": n,
            "largest relative loss difference": float(abs(a.isel(step=slice(0, n)).values
                                                          / b.isel(step=slice(0, n)).values - 1).max()),
            "final loss here": float(a.isel(step=-1)), "final loss there": float(b.isel(step=-1))}


EXPERIMENT_VARS = ("mech_dq_err", "train_loss", "diag_dq_rel_err", "real_mech_status")
"""Variables that mark a run of the study's own experiments (sections 1-9), not a gathering of records."""


def experiments_run(ds: xr.Dataset, committed_gpu: xr.Dataset | None) -> xr.Dataset:
    """The run sections 1-9 read: ``ds`` when it made the experiments (every tier but ``gpu_training``),
    else the committed ``gpu`` run (``committed_gpu``, when it ran on CUDA). Raises, naming the file,
    when neither holds them."""
    if all(v in ds for v in EXPERIMENT_VARS):
        return ds
    if committed_gpu is not None and on_cuda(committed_gpu) and all(v in committed_gpu for v in EXPERIMENT_VARS):
        return committed_gpu
    raise FileNotFoundError("this run made none of the study's experiments and the committed gpu run "
                            "(outputs/late_training_gradient_blowup/gpu/results.nc, from a CUDA device) is absent: "
                            "sections 1-9 have nothing to read")


def kernel_status_in(ds: xr.Dataset | None, kernel: str) -> str | None:
    """The real-kernel grid's status of ``kernel`` in ``ds`` ("ok", or its first reason for giving no
    gradients), "not in this run" when the run's kernel list lacks it, None without a run."""
    if ds is None or "real_mech_status" not in ds:
        return None
    if kernel not in [str(k) for k in ds["real_kernel"].values]:
        return "not in this run"
    bad = [str(x) for x in ds["real_mech_status"].sel(real_kernel=kernel).values.ravel() if str(x) != "ok"]
    return bad[0] if bad else "ok"
