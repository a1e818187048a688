"""Study 05's measured costs, read from a run's ``results.nc`` (the attention-call and training-step timings of
the real kernels) and from the committed H200 benchmark of our Triton kernel: numbers, booleans and tables, no
English. Kernels are named by their registry names throughout, the benchmark file's own labels included.
"""
from __future__ import annotations

import math

import numpy as np
import xarray as xr

from . import STEP_NO_ATTENTION

GPROJ_TARGET = 0.05
"""The project's target for GProj dq: at most this extra forward + backward time over the same kernel."""
FLASH_TARGET = 1.0
"""The project's target for our kernel without GProj: at most this multiple of ``sdpa:flash``'s time at N >= 4096."""
FLEX_TARGET = 1.2
"""The project's target for our kernel without GProj: within this multiple of compiled FlexAttention's time."""
TARGET_MIN_N = 4096
"""The shortest N at which the ``sdpa:flash`` target applies."""


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


def attention_flops(seq_len: int, head_dim: int, heads: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs by the usual count: 4 N^2 d per head forward (halved causal), backward 2.5x."""
    fwd = 4.0 * seq_len ** 2 * head_dim * heads * (0.5 if causal else 1.0)
    return fwd, 2.5 * fwd


def _call_ms(ds: xr.Dataset, name: str, dtype: str, d, c) -> float:
    """Forward + backward time of one timed case; NaN when the kernel was not timed or gave no time."""
    if "timing_fwd_bwd_ms" not in ds or name not in ds["timing_kernel"].values:
        return math.nan
    at = dict(timing_kernel=name, timing_dtype=dtype, timing_head_dim=d, timing_causal=c)
    if str(ds["timing_status"].sel(**at).item()) != "ok":
        return math.nan
    return float(ds["timing_fwd_bwd_ms"].sel(**at))


def measured_cost_table(ds: xr.Dataset):
    """One row per timed kernel, format, head dim and mask that was asked for (a kernel that gave no time
    keeps its row, with its status): measured forward, backward and forward + backward times, TFLOP/s
    (the usual count), forward + backward relative to our Triton kernel without GProj and to ``sdpa:flash``
    (same d, mask, bf16), and the analytic arithmetic time's ratio to our kernel's beside it."""
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
                    row["fwd+bwd / sdpa:flash (measured)"] = row["fwd+bwd ms"] / _call_ms(ds, "sdpa:flash", "bf16", d, c)
                    row["fwd+bwd / triton:fa2 (analytic)"] = (float(ds["timing_analytic_fwd_bwd_ms"].sel(**at))
                                                              / float(ds["timing_analytic_fwd_bwd_ms"].sel(**base))
                                                              if has_base else math.nan)
                    row["status"] = status[:120]
                    rows.append(row)
    return pd.DataFrame(rows).set_index(["kernel", "dtype", "d", "causal"]) if rows else pd.DataFrame()


def call_targets_table(ds: xr.Dataset):
    """Per timed head dim and mask, forward + backward in bf16 (None without GPU timings): GProj dq's extra
    over our kernel without it, measured and analytic, and whether it meets ``GPROJ_TARGET``; two-pass
    GProj's extra; GProj dq over ``sdpa:flash`` (the fix through our kernel against PyTorch's kernel); our
    kernel over ``sdpa:flash`` (target ``FLASH_TARGET``, met or not), over ``sdpa:cudnn`` and over ``fa4``;
    the FP32 backward's extra; our kernel fed fp32 (extra and TFLOP/s); and the fastest other kernel fed fp32
    with its extra over ours."""
    import pandas as pd

    if not has_timings(ds):
        return None
    n, heads = int(ds.attrs["real_timing_seq_len"]), int(ds.attrs["real_timing_heads"])
    rows = []
    for d in ds["timing_head_dim"].values:
        for c in ds["timing_causal"].values:
            t = lambda name, dtype="bf16": _call_ms(ds, name, dtype, d, c)  # noqa: E731
            base = t("triton:fa2")
            if not np.isfinite(base):
                continue
            at = dict(timing_head_dim=d, timing_causal=c, timing_dtype="bf16")
            a = lambda name: float(ds["timing_analytic_fwd_bwd_ms"].sel(timing_kernel=name, **at))  # noqa: E731
            g = t("triton:fa2:gproj_dq") / base - 1
            ours_flash = base / t("sdpa:flash")
            fp32_ours = t("triton:fa2", "fp32")
            others = {str(k): t(str(k), "fp32") for k in ds["timing_kernel"].values if str(k) != "triton:fa2"}
            others = {k: v for k, v in others.items() if np.isfinite(v)}
            fastest = min(others, key=others.get) if others else None
            flops = sum(attention_flops(n, int(d), heads, bool(c)))
            rows.append({"d": int(d), "causal": bool(c),
                         "triton:fa2:gproj_dq / triton:fa2 - 1": g,
                         "analytic": (a("triton:fa2:gproj_dq") / a("triton:fa2") - 1
                                      if "triton:fa2:gproj_dq" in ds["timing_kernel"].values else math.nan),
                         "GProj target met": bool(g <= GPROJ_TARGET) if np.isfinite(g) else None,
                         "triton:fa2:gproj_dq_dk / triton:fa2 - 1": t("triton:fa2:gproj_dq_dk") / base - 1,
                         "triton:fa2:gproj_dq / sdpa:flash - 1": t("triton:fa2:gproj_dq") / t("sdpa:flash") - 1,
                         "triton:fa2 / sdpa:flash": ours_flash,
                         "sdpa:flash target met": bool(ours_flash <= FLASH_TARGET) if np.isfinite(ours_flash) else None,
                         "triton:fa2 / sdpa:cudnn": base / t("sdpa:cudnn"),
                         "triton:fa2 / fa4": base / t("fa4"),
                         "triton:fa2:fp32_bwd / triton:fa2 - 1": t("triton:fa2:fp32_bwd") / base - 1,
                         "triton:fa2 fp32 / triton:fa2 - 1": fp32_ours / base - 1,
                         "triton:fa2 fp32 TFLOP/s": flops / (fp32_ours * 1e-3) / 1e12,
                         "fastest other fp32": fastest or "",
                         "fastest other fp32 / triton:fa2 - 1": others[fastest] / base - 1 if fastest else math.nan})
    return pd.DataFrame(rows).set_index(["d", "causal"]) if rows else None


def call_extras(ds: xr.Dataset, head_dim: int | None = None, causal: bool | None = None) -> dict:
    """Per attention call (forward + backward, bf16) at ``head_dim`` (default the largest timed d) and mask
    ``causal`` (default the first timed): GProj dq over our kernel without it and over ``sdpa:flash``; our
    kernel over ``sdpa:flash``; ``fa4`` over ``sdpa:flash`` and our kernel over ``fa4``; the fastest FP32 attention (kernels fed fp32)
    over our kernel, its name, and its extra's ratio to GProj's; our kernel fed fp32 and the FP32 backward
    over ours; the shape. NaN where a time is absent."""
    nan = math.nan
    if "timing_fwd_bwd_ms" not in ds:
        return {"call_gproj_over_ours": nan, "call_gproj_over_flash": nan, "call_ours_over_flash": nan,
                "call_fa4_over_flash": nan, "call_ours_over_fa4": nan, "call_fp32_fastest": "", "call_fp32_fastest_over_ours": nan,
                "call_fp32_over_gproj": nan, "call_fp32_ours_over_ours": nan, "call_fp32_bwd_over_ours": nan,
                "call_d": None, "call_causal": None, "call_n": None, "call_heads": None}
    d = int(ds["timing_head_dim"][-1]) if head_dim is None else head_dim
    c = bool(ds["timing_causal"][0]) if causal is None else bool(causal)
    t = lambda name, dtype="bf16": _call_ms(ds, name, dtype, d, c)  # noqa: E731
    ours, flash, gq = t("triton:fa2"), t("sdpa:flash"), t("triton:fa2:gproj_dq")
    fp32 = {str(k): t(str(k), "fp32") for k in ds["timing_kernel"].values}
    fp32 = {k: v for k, v in fp32.items() if np.isfinite(v)}
    fastest = min(fp32, key=fp32.get) if fp32 else None
    g, fast = gq / ours - 1, (fp32[fastest] / ours - 1 if fastest else nan)
    return {"call_gproj_over_ours": g, "call_gproj_over_flash": gq / flash - 1, "call_ours_over_flash": ours / flash - 1,
            "call_fa4_over_flash": t("fa4") / flash - 1, "call_ours_over_fa4": ours / t("fa4") - 1,
            "call_fp32_fastest": fastest or "",
            "call_fp32_fastest_over_ours": fast, "call_fp32_over_gproj": fast / g if g > 0 else nan,
            "call_fp32_ours_over_ours": fp32.get("triton:fa2", nan) / ours - 1,
            "call_fp32_bwd_over_ours": t("triton:fa2:fp32_bwd") / ours - 1, "call_d": d, "call_causal": bool(c),
            "call_n": int(ds.attrs["real_timing_seq_len"]), "call_heads": int(ds.attrs["real_timing_heads"])}


def step_cost_table(ds: xr.Dataset):
    """One row per step timing that was asked for: the step time, its extra over the step with our Triton
    kernel without GProj in bf16 (else ``sdpa:flash``) and over the step with ``sdpa:flash``, and
    attention's share of the step (1 - the no-attention step / the step)."""
    import pandas as pd

    ok = ds["step_status"] == "ok"
    good = lambda k: k in ds["step_kernel"].values and bool(ok.sel(step_kernel=k, step_dtype="bf16"))  # noqa: E731
    base_name = next((k for k in ("triton:fa2", "sdpa:flash") if good(k)), None)
    base = float(ds["step_ms"].sel(step_kernel=base_name, step_dtype="bf16")) if base_name else math.nan
    flash = float(ds["step_ms"].sel(step_kernel="sdpa:flash", step_dtype="bf16")) if good("sdpa:flash") else math.nan
    rest = float(ds["step_ms"].sel(step_kernel=STEP_NO_ATTENTION, step_dtype="bf16"))
    rows = []
    for name in ds["step_kernel"].values:
        for dtype in ds["step_dtype"].values:
            status = str(ds["step_status"].sel(step_kernel=name, step_dtype=dtype).item())
            if status == "not requested":
                continue
            t = float(ds["step_ms"].sel(step_kernel=name, step_dtype=dtype))
            rows.append({"attention": str(name), "dtype": str(dtype), "step ms": t,
                         f"extra over {base_name or 'base'}": t / base - 1, "extra over sdpa:flash": t / flash - 1,
                         "attention share of the step": (t - rest) / t if name != STEP_NO_ATTENTION else 0.0,
                         "status": status[:120]})
    return pd.DataFrame(rows).set_index(["attention", "dtype"]) if rows else pd.DataFrame()


def step_extras(ds: xr.Dataset) -> dict:
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


# -- the committed benchmark of our kernel -------------------------------------------------------------

BENCH_JSON = "outputs/kernels/h200/triton_fa2_bench.json"
BENCH_NAMES = {"triton_fa2": "triton:fa2", "triton_fa2_gproj_dq": "triton:fa2:gproj_dq",
               "triton_fa2_gproj_dq_dk": "triton:fa2:gproj_dq_dk", "triton_fa2_fp32_backward": "triton:fa2:fp32_bwd",
               "sdpa_flash_attention": "sdpa:flash", "sdpa_efficient_attention": "sdpa:efficient",
               "sdpa_cudnn_attention": "sdpa:cudnn", "flex_attention_compiled": "flex"}
"""The benchmark file's labels of its cases (``attnum.kernels.triton_fa2_bench``) and the registry names of
the kernels they time."""


def bench_summary(path=None):
    """Our Triton kernel's committed H200 benchmark (``attnum.kernels.triton_fa2_bench``, default
    ``outputs/kernels/h200/triton_fa2_bench.json``), one row per shape, kernels by registry name: our
    kernel's forward + backward time, the extra time of GProj dq / dq_dk and of the FP32 backward over it,
    and its time (forward + backward, forward, backward) relative to ``sdpa:flash``, and relative to
    ``sdpa:cudnn`` and ``flex`` (compiled FlexAttention). ``(table, environment)``, or ``(None, None)``
    when the file is absent. A label the file uses that is not in ``BENCH_NAMES`` is an error."""
    import json

    import pandas as pd

    from ...paths import project_root

    path = project_root() / BENCH_JSON if path is None else path
    if not path.exists():
        return None, None
    record = json.loads(path.read_text())
    unknown = sorted({c["impl"] for c in record["cases"]} - set(BENCH_NAMES))
    if unknown:
        raise ValueError(f"{path}: benchmark labels {unknown} have no registry name in BENCH_NAMES")
    times = {}
    for case in record["cases"]:
        if case.get("status") == "ok":
            times[(case["n"], case["d"], bool(case["causal"]), BENCH_NAMES[case["impl"]])] = (
                case["fwd_bwd_ms"], case.get("fwd_ms", math.nan), case.get("bwd_ms", math.nan))
    rows = []
    for n, d, causal in sorted({key[:3] for key in times}):
        get = lambda name, i=0: times.get((n, d, causal, name), (math.nan,) * 3)[i]  # noqa: E731
        base = get("triton:fa2")
        rows.append({"N": n, "d": d, "causal": causal, "triton:fa2 fwd+bwd ms": base,
                     "triton:fa2:gproj_dq / triton:fa2 - 1": get("triton:fa2:gproj_dq") / base - 1,
                     "triton:fa2:gproj_dq_dk / triton:fa2 - 1": get("triton:fa2:gproj_dq_dk") / base - 1,
                     "triton:fa2:fp32_bwd / triton:fa2 - 1": get("triton:fa2:fp32_bwd") / base - 1,
                     "triton:fa2 / sdpa:flash": base / get("sdpa:flash"),
                     "fwd: triton:fa2 / sdpa:flash": get("triton:fa2", 1) / get("sdpa:flash", 1),
                     "bwd: triton:fa2 / sdpa:flash": get("triton:fa2", 2) / get("sdpa:flash", 2),
                     "triton:fa2 / sdpa:cudnn": base / get("sdpa:cudnn"),
                     "triton:fa2 / flex": base / get("flex")})
    return pd.DataFrame(rows).set_index(["N", "d", "causal"]), record["environment"]


GPROJ_EXTRA, OURS_OVER_FLASH = "triton:fa2:gproj_dq / triton:fa2 - 1", "triton:fa2 / sdpa:flash"


def bench_extras(bench) -> dict:
    """From ``bench_summary``'s table, over its shapes (min and max): GProj dq's forward + backward
    extra over our kernel without it, our kernel's time over ``sdpa:flash``'s, and our kernel with
    GProj dq over ``sdpa:flash`` (``(1 + extra) x ratio - 1``: the attention call's cost of the fix
    through our kernel against PyTorch's FlashAttention-2); with the number of shapes. NaN when the
    benchmark is absent."""
    keys = ("gproj_over_ours", "ours_over_flash", "gproj_over_flash")
    if bench is None or len(bench) == 0:
        return {**{f"{k}_{e}": math.nan for k in keys for e in ("min", "max")}, "shapes": 0}
    cols = {"gproj_over_ours": bench[GPROJ_EXTRA], "ours_over_flash": bench[OURS_OVER_FLASH] - 1,
            "gproj_over_flash": (1 + bench[GPROJ_EXTRA]) * bench[OURS_OVER_FLASH] - 1}
    out = {}
    for k in keys:
        out[f"{k}_min"], out[f"{k}_max"] = float(cols[k].min()), float(cols[k].max())
    out["shapes"] = len(bench)
    return out


def cost_targets() -> dict:
    """The project's cost targets (``GPROJ_TARGET``, ``FLASH_TARGET``, ``FLEX_TARGET``, ``TARGET_MIN_N``)."""
    return {"gproj_target": GPROJ_TARGET, "flash_target": FLASH_TARGET, "flex_target": FLEX_TARGET,
            "target_min_n": TARGET_MIN_N}


def bench_target_values(bench) -> dict:
    """The project's cost targets over the benchmark's shapes: at how many shapes GProj dq meets
    ``GPROJ_TARGET``, our kernel ``FLASH_TARGET`` (at N >= ``TARGET_MIN_N``, and how many such shapes) and
    ``FLEX_TARGET``; the span of two-pass GProj's and the FP32 backward's extras and of our kernel over
    ``sdpa:cudnn`` and ``flex``. Counts 0 and NaN spans when the benchmark is absent (``bench_extras`` gives
    the number of shapes)."""
    cols = {"gproj_dq_dk": "triton:fa2:gproj_dq_dk / triton:fa2 - 1", "fp32_bwd": "triton:fa2:fp32_bwd / triton:fa2 - 1",
            "over_cudnn": "triton:fa2 / sdpa:cudnn", "over_flex": "triton:fa2 / flex"}
    if bench is None or len(bench) == 0:
        return {"gproj_met": 0, "flash_met": 0, "flash_shapes": 0, "flex_met": 0,
                **{f"{k}_{e}": math.nan for k in cols for e in ("min", "max")}}
    big = bench[bench.index.get_level_values("N") >= TARGET_MIN_N]
    out = {"gproj_met": int((bench[GPROJ_EXTRA] <= GPROJ_TARGET).sum()),
           "flash_met": int((big[OURS_OVER_FLASH] <= FLASH_TARGET).sum()), "flash_shapes": len(big),
           "flex_met": int((bench["triton:fa2 / flex"] <= FLEX_TARGET).sum())}
    for k, col in cols.items():
        out[f"{k}_min"], out[f"{k}_max"] = float(bench[col].min()), float(bench[col].max())
    return out


def bench_gproj_met_table(bench):
    """The benchmark's shapes where GProj dq meets ``GPROJ_TARGET``, with its extra there (None when the
    benchmark is absent)."""
    if bench is None or len(bench) == 0:
        return None
    return bench.loc[bench[GPROJ_EXTRA] <= GPROJ_TARGET, [GPROJ_EXTRA]]


def bench_pass_table(bench):
    """Per head dim at N >= ``TARGET_MIN_N``: the span of our kernel's time over ``sdpa:flash``'s, forward,
    backward and forward + backward (None when the benchmark is absent or has no such shape)."""
    import pandas as pd

    if bench is None or len(bench) == 0:
        return None
    big = bench[bench.index.get_level_values("N") >= TARGET_MIN_N]
    if len(big) == 0:
        return None
    cols = ["fwd: triton:fa2 / sdpa:flash", "bwd: triton:fa2 / sdpa:flash", OURS_OVER_FLASH]
    table = big[cols].groupby(level="d").agg(["min", "max"])
    return table if isinstance(table, pd.DataFrame) else None
