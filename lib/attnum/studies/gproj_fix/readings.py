"""Numbers and tables of study 05, read from its Dataset (a run's ``results.nc``) and from the committed
H200 benchmark of our Triton kernel: no English. Seed 004's own numbers are constants marked ``[src]`` (seed 004:
the report on late-training gradient blowup in BF16 FlashAttention-3 and GProj, an unpublished source document
described in ``docs/sources.md``).
"""
from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ... import ncio
from . import (BOOLEAN_COORDINATES, LEGACY_STEP_NO_ATTENTION, LEGACY_TRAIN_BASELINE,
               STEP_NO_ATTENTION)

SEED004_DQ_ERR_BEFORE = 2.19  # [src] seed 004: median relative dQ error before GProj
SEED004_DQ_ERR_AFTER = 0.0034  # [src] seed 004: after GProj
SEED004_GPROJ_STEP_COST = 0.047  # [src] seed 004: GProj, + of a full training step
SEED004_FP32_STEP_COST = 0.334  # [src] seed 004: fused FP32 attention kernel, + of a full training step
SEED004_LOSS_GAP = 0.2  # [src] seed 004: final loss of BF16 FlashAttention-3 above FP32 attention's, nat
NOTES_P_MAX_NOT_ONE = 0.42  # [derived] a numpy check made for this project, not seed 004's number: the fraction of
# random samples where FlashAttention-3's fused exp2(fma(m, c, -fl(m c))) in fp32 at the row max m is not exactly 1


def seed004_comparison(ds: xr.Dataset, var: str = "grid_dq_err"):
    """Per sharpness (largest N, first d, median over seeds): the grid's |mu| at which the unfixed
    kernel's median dQ error is nearest seed 004's 219% (in log), the errors of ``none``, the GProj
    variants and FP32 attention there, and seed 004's own before/after numbers, marked as theirs."""
    import pandas as pd

    sub = ds[var].isel(seq_len=-1, head_dim=0).median("seed")
    rows = []
    for s in ds["sharpness"].values:
        none = sub.sel(fix="none", sharpness=s)
        dist = np.abs(np.log(none.values / SEED004_DQ_ERR_BEFORE))
        mu = float(ds["mu_norm"].values[int(np.nanargmin(dist))])
        row = {"sharpness": float(s), "|mu|": mu}
        for fix in ("none", "gproj_dq", "gproj_dq_dk", "mean_key", "fp32_backward", "fp32_attention"):
            if fix in ds["fix"].values:
                row[f"ours: {fix}"] = float(sub.sel(fix=fix, sharpness=s, mu_norm=mu))
        row["theirs (seed 004): before GProj"] = SEED004_DQ_ERR_BEFORE
        row["theirs (seed 004): after GProj"] = SEED004_DQ_ERR_AFTER
        rows.append(row)
    return pd.DataFrame(rows).set_index(["sharpness", "|mu|"])


def offset_growth(ds: xr.Dataset, var: str = "grid_dq_err"):
    """Per fix and sharpness (largest N, first d, median over seeds): the error at |mu| = 0, at the
    largest |mu|, and their ratio (1: the offset does nothing)."""
    sub = ds[var].isel(seq_len=-1, head_dim=0).median("seed")
    first, last = sub.isel(mu_norm=0, drop=True), sub.isel(mu_norm=-1, drop=True)
    table = xr.Dataset({f"|mu| = {float(ds['mu_norm'][0]):g}": first, f"|mu| = {float(ds['mu_norm'][-1]):g}": last,
                        "growth": last / first})
    return table.to_dataframe().drop(columns=["seq_len", "head_dim"], errors="ignore").unstack("sharpness")


def grid_summary(ds: xr.Dataset, var: str = "grid_dq_err", mu_max: float = 1000.0):
    """One row per fix, over the whole grid (median over seeds): the largest error with |mu| <= ``mu_max``
    and with any |mu|, and the smallest and largest ratio of the fix's error to the unfixed kernel's."""
    import pandas as pd

    err = ds[var].median("seed")
    dims = [d for d in err.dims if d != "fix"]
    ratio = err / err.sel(fix="none")
    return pd.DataFrame({f"largest, |mu| <= {mu_max:g}": err.where(ds["mu_norm"] <= mu_max).max(dims).values,
                         "largest": err.max(dims).values,
                         "smallest ratio to none": ratio.min(dims).values,
                         "largest ratio to none": ratio.max(dims).values},
                        index=pd.Index(ds["fix"].values, name="fix"))


def emulation_device(ds: xr.Dataset) -> str:
    """'GPU' when the run's device (the ``device`` attribute) is CUDA, else 'CPU': where the emulator was timed."""
    return "GPU" if str(ds.attrs.get("device", "cpu")).startswith("cuda") else "CPU"



def cost_summary(ds: xr.Dataset):
    """One row per fix: analytic extras over the base kernel (per head, forward + backward) and the
    emulator's measured time relative to the base's (labelled as an emulation)."""
    import pandas as pd

    total = lambda name: ds[f"cost_{name}"].sum("kernel_pass")
    base = lambda name: float(total(name).sel(fix="none"))
    emul = ds["emul_forward_seconds"] + ds["emul_backward_seconds"]
    table = pd.DataFrame({
        "extra GEMM FLOPs, low precision (x base)": (total("gemm_flops_low") - base("gemm_flops_low")).values
        / base("gemm_flops_low"),
        "GEMM FLOPs in fp32 (x base GEMM FLOPs)": total("gemm_flops_fp32").values / base("gemm_flops_low"),
        "extra exponentials (x base)": (total("exp_ops") - base("exp_ops")).values / base("exp_ops"),
        "extra memory traffic (x base)": ds["cost_extra_traffic_vs_attention"].values,
        "extra tile passes per backward": ds["cost_tile_passes"].sel(kernel_pass="backward").values
        - float(ds["cost_tile_passes"].sel(kernel_pass="backward", fix="none")),
        "extra small kernels": (total("extra_kernels") - base("extra_kernels")).values,
        "workspace (KiB per head)": total("workspace_bytes").values / 1024,
        "extra arithmetic time at H100 peaks, / base backward": ds["cost_extra_compute_vs_backward"].values,
        "extra arithmetic time at H100 peaks, / base fwd+bwd": ds["cost_extra_compute_vs_attention"].values,
        f"EMULATION ({emulation_device(ds)}): fwd+bwd time / base": (emul / emul.sel(fix="none")).values,
    }, index=pd.Index(ds["fix"].values, name="fix"))
    return table


def current_form(ds: xr.Dataset | None) -> xr.Dataset | None:
    """A committed run (``ncio.committed_run``) as this code writes runs today: the yes/no coordinates of
    ``BOOLEAN_COORDINATES`` as booleans (older runs wrote 0/1 integers), the step without attention as
    ``STEP_NO_ATTENTION`` (older: "none (output = v)") and the FP32-attention training run under its kernel's
    registry name, its ``run_attention`` (older: "fp32"). None stays None."""
    if ds is None:
        return None
    ds = ncio.boolean_coordinates(ds, BOOLEAN_COORDINATES)
    if "step_kernel" in ds.coords and LEGACY_STEP_NO_ATTENTION in ds["step_kernel"].values:
        ds = ds.assign_coords(step_kernel=("step_kernel", [STEP_NO_ATTENTION if str(k) == LEGACY_STEP_NO_ATTENTION
                                                           else str(k) for k in ds["step_kernel"].values],
                                           ds["step_kernel"].attrs))
    if "run" in ds.coords and "run_attention" in ds and LEGACY_TRAIN_BASELINE in ds["run"].values:
        new = str(ds["run_attention"].sel(run=LEGACY_TRAIN_BASELINE).item())
        ds = ds.assign_coords(run=("run", [new if str(r) == LEGACY_TRAIN_BASELINE else str(r) for r in ds["run"].values],
                                       ds["run"].attrs))
    return ds


def baseline_run(ds: xr.Dataset) -> str:
    """The training run of FP32 attention: the one run not named after a fix (it has its kernel's registry
    name)."""
    from ...kernels.fixes import FIXES

    others = [str(r) for r in ds["run"].values if str(r) not in FIXES]
    if len(others) != 1:
        raise ValueError(f"expected one training run not named after a fix (the FP32 baseline), found {others}")
    return others[0]


TRAIN_GAP_COLUMN = "gap vs FP32 attention (nat)"


def training_table(ds: xr.Dataset, baseline: str | None = None, last: int = 10, late_fraction: float = 0.5):
    """One row per run: final loss (mean of the last ``last`` records), its gap to ``baseline`` (default
    ``baseline_run``: FP32 attention), the median late-training ratio of the global gradient norm to the
    baseline's, and the final key-mean norm of each layer."""
    import pandas as pd

    baseline = baseline_run(ds) if baseline is None else baseline
    steps = ds["step"].values
    late = steps >= steps[0] + (1 - late_fraction) * (steps[-1] - steps[0])
    final = ds["train_loss"].isel(step=slice(-last, None)).mean("step")
    ratio = (ds["train_grad_norm_total"] / ds["train_grad_norm_total"].sel(run=baseline)).isel(step=late)
    table = pd.DataFrame({"attention": ds["run_attention"].values, "final loss (nat)": final.values,
                          TRAIN_GAP_COLUMN: (final - final.sel(run=baseline)).values,
                          "late grad-norm ratio, median": ratio.median("step").values},
                         index=pd.Index(ds["run"].values, name="run"))
    for layer in ds["layer"].values:
        table[f"final key-mean norm, layer {layer}"] = ds["train_key_mean_norm"].sel(layer=layer).isel(
            step=slice(-last, None)).mean("step").values
    return table


# -- the exact problem, real kernels, measured costs, seed 004's claims -------------------------------

EXACT_CHANGE_LIMIT = 0.5
"""Relative L2 change of the exact dQ (against |mu| = 0) beyond which a grid point measures a different
problem: the exact gradient has moved by more than half its own size."""


def trusted_offset(ds: xr.Dataset, limit: float = EXACT_CHANGE_LIMIT) -> float:
    """The largest |mu| of the grid up to which the exact dQ of every sharpness, N, d and seed stays
    within ``limit`` (relative L2) of its value at |mu| = 0: beyond it, an error against fp64 is
    measured on a problem that rounding k + mu to bf16 has changed."""
    change = ds["grid_exact_dq_change"].max([d for d in ds["grid_exact_dq_change"].dims if d != "mu_norm"])
    ok = change.values <= limit
    mus = ds["mu_norm"].values
    trusted = mus[0]
    for mu, good in zip(mus, ok):
        if not good:
            break
        trusted = mu
    return float(trusted)


def exact_problem_table(ds: xr.Dataset):
    """Per sharpness and |mu| (largest N, first d, median over seeds): distinct rounded keys / N, the
    distinct values per key component / N, the relative perturbation rounding put on the keys, the
    median row norm of the exact dQ relative to |mu| = 0, the relative change of the exact dQ and
    output, and the unfixed kernel's dQ error there."""
    sub = ds[["grid_distinct_keys", "grid_distinct_key_values", "grid_key_perturbation", "grid_exact_dq_norm",
              "grid_exact_dq_change", "grid_exact_out_change"]]
    sub = sub.isel(seq_len=-1, head_dim=0).median("seed")
    table = xr.Dataset({"distinct keys / N": sub["grid_distinct_keys"],
                        "distinct values per component / N": sub["grid_distinct_key_values"],
                        "key perturbation ||dk|| / ||k||": sub["grid_key_perturbation"],
                        "exact |dQ| row norm / at |mu|=0": sub["grid_exact_dq_norm"]
                        / sub["grid_exact_dq_norm"].isel(mu_norm=0),
                        "exact dQ change": sub["grid_exact_dq_change"],
                        "exact output change": sub["grid_exact_out_change"],
                        "none: dQ error": ds["grid_dq_err"].sel(fix="none").isel(seq_len=-1, head_dim=0).median("seed")})
    return table.to_dataframe().drop(columns=["seq_len", "head_dim", "fix"], errors="ignore")


def has_real(ds: xr.Dataset) -> bool:
    """True when the dataset holds real-kernel results that ran (some status ok)."""
    return "real_status" in ds and bool((ds["real_status"] == "ok").any())


def real_kernel_table(ds: xr.Dataset):
    """Per real kernel that ran and sharpness (largest N and d of the grid, median over seeds): its
    median row dQ error at |mu| = 0, at the largest trusted |mu| and at the largest |mu|, its emulated
    equivalent's at the largest trusted |mu|, and over the whole grid the median correlation of
    their dQ errors and the median fraction of bitwise-equal dQ elements."""
    import pandas as pd

    at = dict(seq_len=int(ds["seq_len"][-1]), head_dim=int(ds["head_dim"][-1]))
    trusted = trusted_offset(ds)
    top = float(ds["mu_norm"][-1])
    rows = []
    for name in ds["real_kernel"].values:
        if str(ds["real_status"].sel(real_kernel=name, **at).item()) != "ok":
            continue
        err = ds["real_dq_err"].sel(real_kernel=name, **at).median("seed")
        emul = ds["real_emul_dq_err"].sel(real_kernel=name, **at).median("seed")
        for s in ds["sharpness"].values:
            rows.append({"kernel": str(name), "sharpness": float(s),
                         "emulated equivalent": str(ds["real_equivalent"].sel(real_kernel=name).item()) or "-",
                         "dQ err, |mu|=0": float(err.sel(sharpness=s).isel(mu_norm=0)),
                         f"dQ err, |mu|={trusted:g} (trusted)": float(err.sel(sharpness=s, mu_norm=trusted)),
                         f"dQ err, |mu|={top:g}": float(err.sel(sharpness=s, mu_norm=top)),
                         f"equivalent's dQ err, |mu|={trusted:g}": float(emul.sel(sharpness=s, mu_norm=trusted)),
                         "dQ error corr. (median over grid)": float(ds["real_dq_err_corr"].sel(real_kernel=name)
                                                                    .median()),
                         "dQ bitwise equal (median over grid)": float(ds["real_dq_bitwise"].sel(real_kernel=name)
                                                                      .median())})
    return pd.DataFrame(rows).set_index(["kernel", "sharpness"]) if rows else pd.DataFrame()


def regime_offset(ds: xr.Dataset, level: float = 0.1) -> float:
    """The smallest grid |mu| at which the unfixed kernel's median dQ error exceeds ``level`` at any
    sharpness (largest N, first d; median over seeds); inf if never."""
    err = ds["grid_dq_err"].sel(fix="none").isel(seq_len=-1, head_dim=0).median("seed").max("sharpness")
    over = ds["mu_norm"].values[err.values > level]
    return float(over.min()) if over.size else math.inf



def within_factor(ours: float, theirs: float, factor: float = 2.0) -> bool | None:
    """True when ``ours`` is ``theirs`` within ``factor`` either way (both positive), False when not,
    None when ``ours`` was not measured (NaN)."""
    if not np.isfinite(ours):
        return None
    return bool(ours > 0 and abs(math.log(ours / theirs)) <= math.log(factor))


# -- values the prose states (glued), and the tables behind them --------------------------------------

FLOOR_WORDS = {True: "falls to", False: "does not fall to", None: "was not compared with"}
"""The verdict words of ``sharp_floor_values``."""
FLOOR_TOLERANCE = 0.1
"""Our kernel's GProj dQ error 'falls to the emulator's GProj floor' when, at every trusted offset, N and d of
the sharpest rows, it is the emulator's within this relative margin (in log: |log(ratio)| <= log(1 + margin))."""


def _lo_hi(values) -> tuple[float | None, float | None]:
    """(min, max) of the finite values, (None, None) when there are none."""
    values = [float(v) for v in np.ravel(values) if np.isfinite(v)]
    return (min(values), max(values)) if values else (None, None)


def emulator_timing_values(ds: xr.Dataset) -> dict:
    """The emulator's forward + backward time of each fix over the base's (an emulation, not a kernel
    timing): where it ran (``emul_device``), at which N and d, the slowest fix and its ratio, two-pass
    GProj's ratio, and the span of the ratios."""
    emul = ds["emul_forward_seconds"] + ds["emul_backward_seconds"]
    rel = (emul / emul.sel(fix="none")).to_series()
    slow = rel.drop("none").idxmax()
    return {"emul_device": emulation_device(ds), "emul_n": ds.attrs.get("timing_seq_len"),
            "emul_d": ds.attrs.get("timing_head_dim"), "emul_slowest_fix": str(slow),
            "emul_slowest_ratio": float(rel[slow]),
            "emul_gproj_dq_dk_ratio": float(rel["gproj_dq_dk"]) if "gproj_dq_dk" in rel.index else None,
            "emul_ratio_min": float(rel.min()), "emul_ratio_max": float(rel.max())}


def exact_problem_values(ds: xr.Dataset) -> dict:
    """Section 1b's numbers: the trusted offset and the limit that defines it; at the largest |mu|, the
    largest key perturbation (relative), the fewest distinct values of a key component (a count over the
    largest N's keys), the largest change of the exact dQ, the span of the exact dQ's median row norm
    relative to |mu| = 0; the fewest distinct key vectors anywhere (fraction of N); whether every offset
    is trusted."""
    trusted, top = trusted_offset(ds), float(ds["mu_norm"][-1])
    others = [d for d in ds["grid_exact_dq_change"].dims if d != "mu_norm"]
    n = int(ds["seq_len"][-1])
    norm = (ds["grid_exact_dq_norm"] / ds["grid_exact_dq_norm"].isel(mu_norm=0)).sel(mu_norm=top)
    return {"trusted_mu": trusted, "top_mu": top, "exact_change_limit": EXACT_CHANGE_LIMIT, "exact_n": n,
            "top_key_perturbation": float(ds["grid_key_perturbation"].max(others).sel(mu_norm=top)),
            "top_distinct_values": float(ds["grid_distinct_key_values"].min(others).sel(mu_norm=top)) * n,
            "top_exact_dq_change": float(ds["grid_exact_dq_change"].max(others).sel(mu_norm=top)),
            "top_exact_dq_norm_min": float(norm.min()), "top_exact_dq_norm_max": float(norm.max()),
            "distinct_keys_min": float(ds["grid_distinct_keys"].min()), "all_trusted": bool(trusted >= top)}


def stable_table(ds: xr.Dataset):
    """Per regime (median over seeds): the coherence of the output errors across rows and the output error,
    for the unfixed kernel and STABLE; None without ``stable_max``."""
    import pandas as pd

    reg = ds[["regime_out_err_coherence", "regime_out_err"]].median("seed")
    if "stable_max" not in reg["fix"].values:
        return None
    return pd.DataFrame({"coherence, none": reg["regime_out_err_coherence"].sel(fix="none").values,
                         "coherence, stable_max": reg["regime_out_err_coherence"].sel(fix="stable_max").values,
                         "output error, none": reg["regime_out_err"].sel(fix="none").values,
                         "output error, stable_max": reg["regime_out_err"].sel(fix="stable_max").values},
                        index=pd.Index(reg["regime"].values, name="regime"))


def real_kernel_summary_table(ds: xr.Dataset):
    """One row per real kernel (largest N and d of the grid, median over seeds): its status there; its
    median dQ error over the sharpness values (min, max) at |mu| = 0 and at the largest trusted |mu|; its
    emulated equivalent (registry name) and that one's error at the trusted |mu|; over the whole grid the
    span of the correlation of their dQ errors and the median fraction of bitwise-equal dQ elements. A
    kernel that gave no gradients keeps its row, with its status and NaN errors."""
    import pandas as pd

    at = dict(seq_len=int(ds["seq_len"][-1]), head_dim=int(ds["head_dim"][-1]))
    trusted = trusted_offset(ds)
    rows = []
    for name in ds["real_kernel"].values:
        status = str(ds["real_status"].sel(real_kernel=name, **at).item())
        row = {"kernel": str(name), "status": status[:160],
               "equivalent": str(ds["real_equivalent"].sel(real_kernel=name).item())}
        err = ds["real_dq_err"].sel(real_kernel=name, **at).median("seed")
        emul = ds["real_emul_dq_err"].sel(real_kernel=name, **at).median("seed")
        ok = status == "ok"
        for label, values in (("dQ err |mu|=0", err.isel(mu_norm=0)), ("dQ err trusted", err.sel(mu_norm=trusted)),
                              ("equivalent's dQ err trusted", emul.sel(mu_norm=trusted)),
                              ("dQ error corr.", ds["real_dq_err_corr"].sel(real_kernel=name))):
            lo, hi = _lo_hi(values.values) if ok and (row["equivalent"] or "equivalent" not in label
                                                      and "corr" not in label) else (None, None)
            row[f"{label} min"], row[f"{label} max"] = (math.nan if lo is None else lo), (math.nan if hi is None else hi)
        bit = ds["real_dq_bitwise"].sel(real_kernel=name)
        row["dQ bitwise equal (median)"] = float(bit.median()) if ok and row["equivalent"] else math.nan
        rows.append(row)
    return pd.DataFrame(rows).set_index("kernel") if rows else None


def _floor_parts(ds: xr.Dataset, kernel: str):
    """(sharpness, trusted, our kernel's error, the emulator's gproj_dq error or None, the equivalent's
    error, the unfixed kernel's error or None) at the largest sharpness (median over seeds); None when
    ``kernel`` did not run everywhere."""
    if not has_real(ds) or kernel not in ds["real_kernel"].values:
        return None
    if not bool((ds["real_status"].sel(real_kernel=kernel) == "ok").all()):
        return None
    s = float(ds["sharpness"][-1])
    med = lambda var, **sel: ds[var].sel(sharpness=s, **sel).median("seed")  # noqa: E731
    emul_fix = med("grid_dq_err", fix="gproj_dq") if "gproj_dq" in ds["fix"].values else None
    unfixed = med("real_dq_err", real_kernel="triton:fa2") if "triton:fa2" in ds["real_kernel"].values else None
    return (s, trusted_offset(ds), med("real_dq_err", real_kernel=kernel), emul_fix,
            med("real_emul_dq_err", real_kernel=kernel), unfixed)


def sharp_floor_table(ds: xr.Dataset, kernel: str = "triton:fa2:gproj_dq"):
    """Per |mu| at the largest sharpness, over every N and d of the grid (median over seeds): whether the
    offset is beyond the trusted one, ``kernel``'s median dQ error (min, max), its ratio to the emulator's
    ``gproj_dq`` fix and to its emulated equivalent, and the unfixed kernel's (``triton:fa2``) error. None
    when ``kernel`` did not run."""
    import pandas as pd

    parts = _floor_parts(ds, kernel)
    if parts is None:
        return None
    s, trusted, err, emul_fix, equiv, unfixed = parts
    rows = []
    for mu in ds["mu_norm"].values:
        e = err.sel(mu_norm=mu)
        row = {"|mu|": float(mu), "changed problem": bool(mu > trusted)}
        row[f"{kernel} min"], row[f"{kernel} max"] = _lo_hi(e.values)
        if emul_fix is not None:
            row["/ emulator gproj_dq min"], row["/ emulator gproj_dq max"] = _lo_hi((e / emul_fix.sel(mu_norm=mu)).values)
        row["/ equivalent min"], row["/ equivalent max"] = _lo_hi((e / equiv.sel(mu_norm=mu)).values)
        if unfixed is not None:
            row["triton:fa2 min"], row["triton:fa2 max"] = _lo_hi(unfixed.sel(mu_norm=mu).values)
        rows.append(row)
    return pd.DataFrame(rows).set_index("|mu|")


def sharp_floor_values(ds: xr.Dataset, kernel: str = "triton:fa2:gproj_dq") -> dict:
    """Does ``kernel``'s GProj dQ error in the sharpest rows fall to the emulator's GProj floor? At the largest
    sharpness and the trusted offsets (every N and d): the largest relative gap to the emulator's ``gproj_dq``
    fix (to the emulated equivalent when the grid lacks that fix), whether it is within ``FLOOR_TOLERANCE``
    (and its word, ``FLOOR_WORDS``), and the smallest fraction of its dQ elements bitwise equal to its
    equivalent's at the trusted offsets (every sharpness, N and d); None when the kernel did not run."""
    parts = _floor_parts(ds, kernel)
    if parts is None:
        return {"floor_sharpness": None, "floor_gap": None, "floor_reached": None, "floor_verdict": FLOOR_WORDS[None],
                "floor_tolerance": FLOOR_TOLERANCE, "floor_bitwise_min": None}
    s, trusted, err, emul_fix, equiv, _ = parts
    near = err / (emul_fix if emul_fix is not None else equiv)
    worst = float(np.nanmax(np.abs(np.log(near.sel(mu_norm=near["mu_norm"] <= trusted).values))))
    reached = bool(worst <= math.log1p(FLOOR_TOLERANCE))
    bit = ds["real_dq_bitwise"].sel(real_kernel=kernel)
    return {"floor_sharpness": s, "floor_gap": math.exp(worst) - 1, "floor_reached": reached,
            "floor_verdict": FLOOR_WORDS[reached], "floor_tolerance": FLOOR_TOLERANCE,
            "floor_bitwise_min": float(bit.sel(mu_norm=bit["mu_norm"] <= trusted).min())}


def fidelity_table(ds: xr.Dataset, family: str = "triton:fa2"):
    """Per kernel of ``family`` that ran everywhere: its emulated equivalent, and the span of its fraction
    of bitwise-equal dQ elements and of its dQ-error correlation with it, at the trusted offsets and beyond
    (every sharpness, N and d). None when none ran."""
    import pandas as pd

    trusted = trusted_offset(ds)
    rows = []
    for name in [str(k) for k in ds["real_kernel"].values if str(k).startswith(family)]:
        if not bool((ds["real_status"].sel(real_kernel=name) == "ok").all()):
            continue
        row = {"kernel": name, "equivalent": str(ds["real_equivalent"].sel(real_kernel=name).item())}
        for label, var in (("bitwise equal", "real_dq_bitwise"), ("error corr.", "real_dq_err_corr")):
            x = ds[var].sel(real_kernel=name)
            for where, sel in (("trusted", x["mu_norm"] <= trusted), ("beyond", x["mu_norm"] > trusted)):
                lo, hi = _lo_hi(x.sel(mu_norm=sel).values)
                row[f"{label}, {where} min"] = math.nan if lo is None else lo
                row[f"{label}, {where} max"] = math.nan if hi is None else hi
        rows.append(row)
    return pd.DataFrame(rows).set_index("kernel") if rows else None


GRID_MU_MAX = 1000.0
"""The largest |mu| of the grid statements 'wherever |mu| <= ...' (the grid's offsets up to 10^3)."""


def grid_values(ds: xr.Dataset) -> dict:
    """Sections 1 and 3's numbers (median over seeds): GProj's largest median dQ error (either variant) over
    the whole grid with |mu| <= ``GRID_MU_MAX``; GProj dq's error at the largest |mu| and sharpness (largest N,
    first d); the span of GProj's error at the points nearest seed 004's 219% (``seed004_comparison``) and of
    those points' |mu|; two-pass
    GProj's largest 99th-percentile dK error in the sharpest rows (largest N, first d); STABLE's median dK and
    dV errors at the first sharpness and the largest |mu| and its largest fraction of zeroed rows."""
    gp = [f for f in ("gproj_dq", "gproj_dq_dk") if f in ds["fix"].values]
    err = ds["grid_dq_err"].median("seed")
    at = dict(seq_len=int(ds["seq_len"][-1]), head_dim=int(ds["head_dim"][0]))
    out = {"grid_mu_max": GRID_MU_MAX, "gproj_max_mu_max": None, "gproj_top": None, "gproj_near_min": None,
           "gproj_near_max": None, "near_mu_min": None, "near_mu_max": None, "gproj_dq_dk_dk_p99": None,
           "stable_dk_top": None, "stable_dv_top": None,
           "stable_zero_rows_max": None}
    if gp:
        out["gproj_max_mu_max"] = float(err.sel(fix=gp).where(ds["mu_norm"] <= GRID_MU_MAX).max())
        out["gproj_top"] = float(err.sel(fix=gp[0], **at).isel(sharpness=-1, mu_norm=-1))
        comparison = seed004_comparison(ds)
        near = comparison[[f"ours: {f}" for f in gp]].values
        mus = comparison.index.get_level_values("|mu|")
        out.update(gproj_near_min=float(near.min()), gproj_near_max=float(near.max()), near_mu_min=float(mus.min()),
                   near_mu_max=float(mus.max()))
    if "gproj_dq_dk" in ds["fix"].values:
        p99 = ds["grid_dk_err_p99"].median("seed").sel(fix="gproj_dq_dk", **at).isel(sharpness=-1)
        out["gproj_dq_dk_dk_p99"] = float(p99.max())
    if "stable_max" in ds["fix"].values:
        pick = lambda var: float(ds[var].median("seed").sel(fix="stable_max", **at)  # noqa: E731
                                 .isel(sharpness=0, mu_norm=-1))
        out.update(stable_dk_top=pick("grid_dk_err"), stable_dv_top=pick("grid_dv_err"),
                   stable_zero_rows_max=float(ds["grid_zero_rows"].sel(fix="stable_max").max()))
    return out


def stable_coherence_ratio(ds: xr.Dataset, regime: str = "tied_max_negative_v") -> float | None:
    """The unfixed kernel's coherence of the output errors across rows over STABLE's, in ``regime`` (median
    over seeds); None without ``stable_max``."""
    table = stable_table(ds)
    if table is None or regime not in table.index:
        return None
    return float(table.loc[regime, "coherence, none"] / table.loc[regime, "coherence, stable_max"])


def analytic_cost_values(ds: xr.Dataset) -> dict:
    """Section 5's analytic counts (``attnum.cost``, arithmetic at H100 datasheet peaks): each fix's extra
    arithmetic time over the base's backward and over its forward + backward; the datasheet's bf16
    tensor-core / fp32 CUDA-core rate ratio and the peaks themselves (TFLOP/s, the datasheet's numbers)."""
    from ...cost import H100_SXM

    out = {"peak_bf16_tflops": H100_SXM["low_gemm_flops_per_s"] / 1e12,
           "peak_fp32_tflops": H100_SXM["fp32_flops_per_s"] / 1e12, "peak_exp_tflops": H100_SXM["exp_per_s"] / 1e12,
           "peak_bf16_over_fp32": H100_SXM["low_gemm_flops_per_s"] / H100_SXM["fp32_flops_per_s"]}
    from ...kernels.fixes import FIXES

    for fix in FIXES:  # every fix's keys, None for a fix this run did not count
        have = fix in ds["fix"].values
        out[f"cost_{fix}_vs_backward"] = float(ds["cost_extra_compute_vs_backward"].sel(fix=fix)) if have else None
        out[f"cost_{fix}_vs_attention"] = float(ds["cost_extra_compute_vs_attention"].sel(fix=fix)) if have else None
    return out


def training_gap_max(ds: xr.Dataset, last: int = 10) -> float | None:
    """The largest |final loss - FP32 attention's| over every run (mean of the last ``last`` records)."""
    if "train_loss" not in ds:
        return None
    final = ds["train_loss"].isel(step=slice(-last, None)).mean("step")
    return float(abs(final - final.sel(run=baseline_run(ds))).max())


def keyed(prefix: str, values: dict) -> dict:
    """``values`` with every key prefixed (the notebook's glue keys: ``s05_``, ``s05_gpu_``)."""
    return {prefix + k: v for k, v in values.items()}
