"""Numbers and tables of study 05, read from its Dataset (a run's ``results.nc``) and from the committed
H200 benchmark of our Triton kernel: no English. Seed 004's own numbers are constants marked ``[src]``.
"""
from __future__ import annotations

import math

import numpy as np
import xarray as xr

from . import STEP_NO_ATTENTION

SEED004_DQ_ERR_BEFORE = 2.19  # [src] seed 004: median relative dQ error before GProj
SEED004_DQ_ERR_AFTER = 0.0034  # [src] seed 004: after GProj
SEED004_GPROJ_STEP_COST = 0.047  # [src] seed 004: GProj, + of a full training step
SEED004_FP32_STEP_COST = 0.334  # [src] seed 004: fused FP32 attention kernel, + of a full training step
NOTES_P_MAX_NOT_ONE = 0.42  # [derived] papers.md section 4: the notes' own numpy check (not seed 004's number)


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


def training_table(ds: xr.Dataset, baseline: str = "fp32", last: int = 10, late_fraction: float = 0.5):
    """One row per run: final loss (mean of the last ``last`` records), its gap to ``baseline``, the
    median late-training ratio of the global gradient norm to the baseline's, and the final key-mean
    norm of each layer."""
    import pandas as pd

    steps = ds["step"].values
    late = steps >= steps[0] + (1 - late_fraction) * (steps[-1] - steps[0])
    final = ds["train_loss"].isel(step=slice(-last, None)).mean("step")
    ratio = (ds["train_grad_norm_total"] / ds["train_grad_norm_total"].sel(run=baseline)).isel(step=late)
    table = pd.DataFrame({"attention": ds["run_attention"].values, "final loss (nat)": final.values,
                          f"gap vs {baseline} (nat)": (final - final.sel(run=baseline)).values,
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


def has_timings(ds: xr.Dataset) -> bool:
    """True when the dataset holds measured times of our Triton kernel on a GPU."""
    return ("timing_status" in ds and "triton:fa2" in ds["timing_kernel"].values
            and bool((ds["timing_status"].sel(timing_kernel="triton:fa2", timing_dtype="bf16") == "ok").any())
            and ds.attrs.get("timing_gpu", "none") != "none")


def has_step_timings(ds: xr.Dataset) -> bool:
    """True when the dataset holds training-step times on a GPU with our Triton kernel and without attention."""
    if "step_status" not in ds or ds.attrs.get("timing_gpu", "none") == "none":
        return False
    names = ds["step_kernel"].values
    return ("triton:fa2" in names and str(ds["step_status"].sel(step_kernel="triton:fa2", step_dtype="bf16").item()) == "ok"
            and str(ds["step_status"].sel(step_kernel=STEP_NO_ATTENTION, step_dtype="bf16").item()) == "ok")


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


def attention_flops(seq_len: int, head_dim: int, heads: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs by the usual count: 4 N^2 d per head forward (halved causal), backward 2.5x."""
    fwd = 4.0 * seq_len ** 2 * head_dim * heads * (0.5 if causal else 1.0)
    return fwd, 2.5 * fwd


def measured_cost_table(ds: xr.Dataset):
    """One row per timed kernel, format, head dim and mask that ran: measured forward, backward and
    forward + backward times, TFLOP/s (the usual count), forward + backward relative to our Triton
    kernel without GProj (same d, mask, bf16), and the analytic arithmetic time's ratio beside it."""
    import pandas as pd

    n, heads = int(ds.attrs["real_timing_seq_len"]), int(ds.attrs["real_timing_heads"])
    rows = []
    for name in ds["timing_kernel"].values:
        for dtype in ds["timing_dtype"].values:
            for d in ds["timing_head_dim"].values:
                for c in ds["timing_causal"].values:
                    at = dict(timing_kernel=name, timing_dtype=dtype, timing_head_dim=d, timing_causal=c)
                    status = str(ds["timing_status"].sel(**at).item())
                    if status == "not requested":
                        continue
                    base = dict(timing_kernel="triton:fa2", timing_dtype="bf16", timing_head_dim=d, timing_causal=c)
                    has_base = "triton:fa2" in ds["timing_kernel"].values
                    f_fwd, f_bwd = attention_flops(n, int(d), heads, bool(c))
                    row = {"kernel": str(name), "dtype": str(dtype), "d": int(d), "causal": bool(c),
                           "fwd ms": float(ds["timing_fwd_ms"].sel(**at)),
                           "bwd ms": float(ds["timing_bwd_ms"].sel(**at)),
                           "fwd+bwd ms": float(ds["timing_fwd_bwd_ms"].sel(**at))}
                    row["fwd+bwd TFLOP/s"] = (f_fwd + f_bwd) / (row["fwd+bwd ms"] * 1e-3) / 1e12
                    row["fwd+bwd / triton:fa2 (measured)"] = (row["fwd+bwd ms"] / float(ds["timing_fwd_bwd_ms"].sel(**base))
                                                              if has_base else math.nan)
                    row["fwd+bwd / triton:fa2 (analytic)"] = (float(ds["timing_analytic_fwd_bwd_ms"].sel(**at))
                                                              / float(ds["timing_analytic_fwd_bwd_ms"].sel(**base))
                                                              if has_base else math.nan)
                    row["status"] = status[:120]
                    rows.append(row)
    return pd.DataFrame(rows).set_index(["kernel", "dtype", "d", "causal"]) if rows else pd.DataFrame()



def regime_offset(ds: xr.Dataset, level: float = 0.1) -> float:
    """The smallest grid |mu| at which the unfixed kernel's median dQ error exceeds ``level`` at any
    sharpness (largest N, first d; median over seeds); inf if never."""
    err = ds["grid_dq_err"].sel(fix="none").isel(seq_len=-1, head_dim=0).median("seed").max("sharpness")
    over = ds["mu_norm"].values[err.values > level]
    return float(over.min()) if over.size else math.inf



BENCH_JSON = "outputs/kernels/h200/triton_fa2_bench.json"


def bench_summary(path=None):
    """Our Triton kernel's committed H200 benchmark (``attnum.kernels.triton_fa2_bench``, default
    ``outputs/kernels/h200/triton_fa2_bench.json``), one row per shape: its forward + backward time,
    the extra time of GProj dq / dq_dk and of the FP32 backward over it, and its time relative to
    PyTorch's FlashAttention-2 backend, cuDNN and compiled FlexAttention. ``(table, environment)``,
    or ``(None, None)`` when the file is absent."""
    import json

    import pandas as pd

    from ...paths import project_root

    path = project_root() / BENCH_JSON if path is None else path
    if not path.exists():
        return None, None
    record = json.loads(path.read_text())
    times = {}
    for case in record["cases"]:
        if case.get("status") == "ok":
            times[(case["n"], case["d"], bool(case["causal"]), case["impl"])] = (
                case["fwd_bwd_ms"], case.get("fwd_ms", math.nan), case.get("bwd_ms", math.nan))
    rows = []
    for n, d, causal in sorted({key[:3] for key in times}):
        get = lambda impl, i=0: times.get((n, d, causal, impl), (math.nan,) * 3)[i]
        base = get("triton_fa2")
        rows.append({"N": n, "d": d, "causal": causal, "triton:fa2 fwd+bwd ms": base,
                     "GProj dq extra": get("triton_fa2_gproj_dq") / base - 1,
                     "GProj dq_dk extra": get("triton_fa2_gproj_dq_dk") / base - 1,
                     "FP32 backward extra": get("triton_fa2_fp32_backward") / base - 1,
                     "/ sdpa:flash": base / get("sdpa_flash_attention"),
                     "fwd / sdpa:flash": get("triton_fa2", 1) / get("sdpa_flash_attention", 1),
                     "bwd / sdpa:flash": get("triton_fa2", 2) / get("sdpa_flash_attention", 2),
                     "/ sdpa:cudnn": base / get("sdpa_cudnn_attention"),
                     "/ flex (compiled)": base / get("flex_attention_compiled")})
    return pd.DataFrame(rows).set_index(["N", "d", "causal"]), record["environment"]



def step_cost_table(ds: xr.Dataset):
    """One row per step timing that ran: the step time, its extra over the step with our Triton
    kernel without GProj in bf16 (else ``sdpa:flash``), and attention's share of that base step
    (1 - the no-attention step / the base step)."""
    import pandas as pd

    ok = ds["step_status"] == "ok"
    base_name = next((k for k in ("triton:fa2", "sdpa:flash") if k in ds["step_kernel"].values
                      and bool(ok.sel(step_kernel=k, step_dtype="bf16"))), None)
    base = float(ds["step_ms"].sel(step_kernel=base_name, step_dtype="bf16")) if base_name else math.nan
    rest = float(ds["step_ms"].sel(step_kernel=STEP_NO_ATTENTION, step_dtype="bf16"))
    rows = []
    for name in ds["step_kernel"].values:
        for dtype in ds["step_dtype"].values:
            status = str(ds["step_status"].sel(step_kernel=name, step_dtype=dtype).item())
            if status == "not requested":
                continue
            t = float(ds["step_ms"].sel(step_kernel=name, step_dtype=dtype))
            rows.append({"attention": str(name), "dtype": str(dtype), "step ms": t,
                         f"extra over {base_name or 'base'}": t / base - 1,
                         "attention share of the step": (t - rest) / t if name != STEP_NO_ATTENTION else 0.0,
                         "status": status[:120]})
    return pd.DataFrame(rows).set_index(["attention", "dtype"]) if rows else pd.DataFrame()



def step_extras(ds: xr.Dataset) -> dict[str, float]:
    """A whole training step's time with each attention, as extras (``t / t_base - 1``): GProj dq
    through our Triton kernel over the same kernel without it (what seed 004's +4.7% counts) and over
    ``sdpa:flash`` (what using the fix through our kernel costs against PyTorch's faster kernel), our
    kernel without GProj over ``sdpa:flash``, two-pass GProj and the FP32 backward over ours, the
    fastest FP32 attention (kernels fed fp32) over ours and over ``sdpa:flash``, and attention's share
    of the step (1 - no-attention step / step) with ours and with ``sdpa:flash``. NaN where a time is
    absent (no step timings, a kernel that gave none)."""
    nan = math.nan
    names = ds["step_kernel"].values.tolist() if "step_ms" in ds else []

    def t(name, dtype="bf16"):
        if name not in names or str(ds["step_status"].sel(step_kernel=name, step_dtype=dtype).item()) != "ok":
            return nan
        return float(ds["step_ms"].sel(step_kernel=name, step_dtype=dtype))

    ours, flash, gq, rest = t("triton:fa2"), t("sdpa:flash"), t("triton:fa2:gproj_dq"), t(STEP_NO_ATTENTION)
    fp32 = {name: t(name, "fp32") for name in names}
    fp32 = {k: v for k, v in fp32.items() if np.isfinite(v)}
    fastest = min(fp32, key=fp32.get) if fp32 else None
    fast = fp32[fastest] if fastest else nan
    return {"gproj_over_ours": gq / ours - 1, "gproj_over_flash": gq / flash - 1, "ours_over_flash": ours / flash - 1,
            "gproj_dq_dk_over_ours": t("triton:fa2:gproj_dq_dk") / ours - 1,
            "fp32_bwd_over_ours": t("triton:fa2:fp32_bwd") / ours - 1,
            "fp32_fastest_over_ours": fast / ours - 1, "fp32_fastest_over_flash": fast / flash - 1,
            "fp32_ours_over_ours": fp32.get("triton:fa2", nan) / ours - 1,
            "attention_share_ours": (ours - rest) / ours, "attention_share_flash": (flash - rest) / flash,
            "fp32_fastest": fastest or ""}


def bench_extras(bench) -> dict[str, float]:
    """From ``bench_summary``'s table, over its shapes (min and max): GProj dq's forward + backward
    extra over our kernel without it, our kernel's time over ``sdpa:flash``'s, and our kernel with
    GProj dq over ``sdpa:flash`` (``(1 + extra) x ratio - 1``: the attention call's cost of the fix
    through our kernel against PyTorch's FlashAttention-2); with the number of shapes. NaN when the
    benchmark is absent."""
    keys = ("gproj_over_ours", "ours_over_flash", "gproj_over_flash")
    if bench is None or len(bench) == 0:
        return {**{f"{k}_{e}": math.nan for k in keys for e in ("min", "max")}, "shapes": 0}
    cols = {"gproj_over_ours": bench["GProj dq extra"], "ours_over_flash": bench["/ sdpa:flash"] - 1,
            "gproj_over_flash": (1 + bench["GProj dq extra"]) * bench["/ sdpa:flash"] - 1}
    out = {}
    for k in keys:
        out[f"{k}_min"], out[f"{k}_max"] = float(cols[k].min()), float(cols[k].max())
    out["shapes"] = len(bench)
    return out


def within_factor(ours: float, theirs: float, factor: float = 2.0) -> bool | None:
    """True when ``ours`` is ``theirs`` within ``factor`` either way (both positive), False when not,
    None when ``ours`` was not measured (NaN)."""
    if not np.isfinite(ours):
        return None
    return bool(ours > 0 and abs(math.log(ours / theirs)) <= math.log(factor))
