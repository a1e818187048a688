"""Speed of our Triton FlashAttention-2 kernel against PyTorch's attention kernels (GPU only).

    python -m attnum.kernels.triton_fa2_bench OUT.json [--quick] [--ns=4096,8192] [--dims=64,128]
                                              [--budget-s=240] [--tables-from=TUNE.json,...]
    python -m attnum.kernels.triton_fa2_bench table BENCH.json [BENCH2.json ...]
    python -m attnum.kernels.triton_fa2_bench bound BENCH.json [BENCH2.json ...]
    python -m attnum.kernels.triton_fa2_bench gproj-table GPROJ.json [GPROJ2.json ...]
    python -m attnum.kernels.triton_fa2_bench gproj OUT.json [--ns=8192] [--dims=64,128] [--rounds=7]
                                              [--budget-s=240]
    python -m attnum.kernels.triton_fa2_bench flex OUT.json [--ns=4096,8192] [--dims=64,128] [--rounds=7]
                                              [--budget-s=240] [--base=KEY=VALUE,...]

or ``main(out_path, quick=False)``. For every shape -- N in {4096, 8192, 16384, 32768} (quick:
{4096, 16384}), head dim 64 and 128, causal and not, bf16, batch * heads = 2^18 / N so every shape
holds 262,144 tokens (the 132 SMs of an H200 are full at every N) -- it times forward, backward and
forward + backward with CUDA events after warm-up (median of repeats) and reports TFLOP/s with the
usual count: forward 4 N^2 d per head (halved when causal), backward 2.5 x forward (5 matmuls
against 2; the recomputation is not counted), so TFLOP/s compare directly across implementations.

Implementations: ``triton_fa2`` at its default configuration (``triton_fa2.default_config``) with
gproj off / dq / dq_dk and with fp32_backward (fp32 dots ``"ieee"``, ``"tf32x3"`` and ``"bf16x3"``);
``scaled_dot_product_attention`` pinned to exactly one backend each (FLASH_ATTENTION,
CUDNN_ATTENTION; a backend that raises is recorded as ``refused`` with its error, never skipped
silently); FlexAttention compiled with ``torch.compile`` (causal through ``create_block_mask``);
FlashAttention-4 (the registry's ``fa4``, through autograd) where it is installed, else its reason in
``fa4_unavailable``. The tf32x3 and bf16x3 variants and FA4 go to ``extra_cases`` (``EXTRA_IMPLS``),
the others to ``cases``.
Each case is wrapped so one failure does not stop the rest, and the JSON is rewritten after every
case, so a run cut short (``--budget-s``: no new shape starts past it) still leaves its results.
Every case also records a correctness line: max |difference| of its output and dQ against SDPA's
math backend in fp32 on a small shape (2 x 3 heads, N = 512, bf16; N a multiple of every tile, so
the line checks the very kernel variant that is timed -- the bounds-masked variants are covered by
the GPU tests at N = 40 and 1000).

``gproj``: GProj's cost alone, paired. The main bench times each implementation once, one after another, so
GProj's cost is a ratio of two medians taken seconds apart, and the same shape read +12.1% in one call and +18.6%
in the next (``outputs/kernels/h200/README.md``). Here, per shape, one set of tensors is timed with GProj off,
``"dq"`` and ``"dq_dk"`` in turn, R rounds (each a median of repeats, forward + backward and backward alone), and
each round gives a paired cost ``t_mode / t_off - 1``. ``gproj_summary`` reports per mode the median of the paired
costs and their smallest and largest: for R independent rounds of a continuous cost, P(min <= true median <= max)
= 1 - 2^(1-R) (the sign-test interval for a median; 0.984 at R = 7), the ``confidence`` recorded beside it. The
rounds are not independent if the GPU's clocks drift over the run, which alternating the modes within each round
guards against but does not remove.

``flex``: our kernel against compiled FlexAttention, paired. The main bench's forward / Flex ratio for one shape
moved by up to 0.28 between two calls with the forward unchanged, which is larger than the gaps the target asks
about (ours at most Flex's time). Here, per shape, one set of tensors is timed with ``triton_fa2`` (default
configuration, GProj off) and Flex in turn, R rounds, the two taken in alternating order (ours first in even
rounds, Flex first in odd ones), forward alone and forward + backward, each a median of repeats; each round gives
a paired ratio ``t_ours / t_flex``. ``flex_summary`` reports per part the median ratio and its range (the same
sign-test coverage 1 - 2^(1-R) as ``gproj``), ``meets_*`` (median <= 1) and a ``verdict``: ``"under"`` if every
round had ours at or under Flex's time, ``"over"`` if every round had it over, else ``"not resolved"``.
``--base=KEY=VALUE,...`` (``triton_fa2_tune``'s syntax) times ours with
those BlockConfig fields over the default configuration, e.g. ``--base=exp2=1``. Before timing, the two outputs on
the timed tensors are compared (``max_abs_diff_out``), so a mask or layout
mismatch cannot pass as a speed difference.

``table`` prints the ``summary`` rows of bench files as one Markdown table (``summary_table``; the tables of
``outputs/kernels/h200/README.md`` are made by it). ``bound`` prints ``gproj_bound``'s rows (``bound_table``): the
rate of tensor-core work each backward runs at, and the rate GProj's backward would need for its targets.
``gproj-table`` prints the ``gproj`` files' paired costs the same way (``gproj_table``).

``summary`` (one entry per shape, rewritten with the JSON): ``triton_fa2``'s forward + backward
time over compiled FlexAttention's, ``sdpa:flash``'s, cuDNN's and FA4's (and the same for forward and
backward alone), GProj dq and dq_dk's cost over GProj off (``fwd_bwd`` and ``bwd`` time ratios
minus 1), the FP32 backward's time over the bf16 kernel's (``ieee``, ``tf32x3``, ``bf16x3``), and ``meets``:
the targets of ``TARGETS`` (fwd+bwd <= Flex; GProj dq <= +5% and dq_dk <= +15% in fwd+bwd; FP32 backward
fwd+bwd <= 3x; the stretch, fwd+bwd <= 1.25x FA4's; None where a side was not timed).

Runtime: the previous version (N 1024..32768, 8 implementations) took 165 s for ``quick`` on a fresh
H200, most of it compilation (FlexAttention one torch.compile per shape, ~7-14 s each; Triton a
few seconds a kernel variant), and 130 s for the full run with warm caches. This version drops
``sdpa:efficient`` and N = 1024, adds N = 8192 and the tf32x3 variant, and its correctness check
reuses the timed variants (N = 512), so a fresh full run is expected at ~4-5 minutes: the default
``--budget-s=240`` stops it before a new shape starts past 240 s. Split it with ``--ns`` (e.g.
``--ns=4096,8192`` and ``--ns=16384,32768``) when a call must stay well under 5 minutes.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from ..timing import median_ms
from ..versions import accelerator_versions

TOKENS = 2 ** 18
DTYPE = torch.bfloat16
CHECK_N = 512
TRITON_VARIANTS = {"triton_fa2": dict(gproj="off"), "triton_fa2_gproj_dq": dict(gproj="dq"),
                   "triton_fa2_gproj_dq_dk": dict(gproj="dq_dk"),
                   "triton_fa2_fp32_backward": dict(gproj="off", fp32_backward=True),
                   "triton_fa2_fp32_backward_tf32x3": dict(gproj="off", fp32_backward=True, fp32_dot="tf32x3"),
                   "triton_fa2_fp32_backward_bf16x3": dict(gproj="off", fp32_backward=True, fp32_dot="bf16x3")}
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION")
EXTRA_IMPLS = ("triton_fa2_fp32_backward_tf32x3", "triton_fa2_fp32_backward_bf16x3", "fa4")
"""Implementations written to ``extra_cases`` instead of ``cases``: labels that the readers of this file
(``attnum.studies.gproj_fix.readings_costs.BENCH_NAMES``) do not map to a registry kernel."""
TARGETS = {"fwd_bwd_vs_flex": 1.0, "gproj_dq_cost": 0.05, "gproj_dq_dk_cost": 0.15, "fp32_backward_ratio": 3.0,
           "fwd_bwd_vs_fa4": 1.25}
"""The speed targets ``summary`` checks: time ratios (or GProj's extra time) at most these. ``fwd_bwd_vs_fa4``
is the stretch goal, FlashAttention-4 (CuTe DSL, the ``fa4`` registry kernel) timed where it is installed."""


BWD_GEMMS = 7
"""Tile GEMMs per (query block, key block) pair in ``triton_fa2``'s backward with GProj off: 3 in the dQ kernel
(Q K^T, dO V^T, dS K) and 4 in the dK/dV kernel (K Q^T, P^T dO, V dO^T, dS^T Q), all of one size. GProj "dq"
adds one (P K), "dq_dk" two (and P K's rounding work): ``summary``'s ``*_extra_bwd_gemms`` is GProj's extra
backward time over one such GEMM's share of the GProj-off backward (backward time / 7)."""


def flops(n: int, d: int, bh: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs: 4 N^2 d per head forward, halved when causal; backward 2.5x."""
    fwd = 4.0 * n * n * d * bh * (0.5 if causal else 1.0)
    return fwd, 2.5 * fwd


def environment() -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the code version: the device runs an export without git history, whose command sets these
    # (``attnum.ncio.git_state`` reads the same variables; this layer sits below it)
    info = {"python": platform.python_version(), **accelerator_versions(device),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "git_commit": os.environ.get("ATTNUM_GIT_COMMIT", "unknown"),
            "git_dirty": os.environ.get("ATTNUM_GIT_DIRTY", "unknown")}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(sm_count=props.multi_processor_count, memory_gib=round(props.total_memory / 2 ** 30, 1))
    query = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,temperature.gpu"
    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        info["nvidia_smi"] = {"query": query, "output": res.stdout.strip() or res.stderr.strip()}
    except Exception as exc:  # noqa: BLE001
        info["nvidia_smi"] = f"unavailable: {exc}"
    return info


def _implementations():
    """name -> callable(q, k, v, causal) returning the attention output (differentiable)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from . import triton_fa2 as tfa

    impls = {}
    for name, opts in TRITON_VARIANTS.items():
        impls[name] = lambda q, k, v, causal, opts=opts: tfa.triton_attention(q, k, v, causal=causal, **opts)
    for backend in SDPA_BACKENDS:
        def run(q, k, v, causal, backend=getattr(SDPBackend, backend)):
            with sdpa_kernel([backend]):
                return sdpa(q, k, v, is_causal=causal)
        impls[f"sdpa_{backend.lower()}"] = run
    impls["flex_attention_compiled"] = _flex()
    fa4 = _fa4()
    if fa4 is not None:
        impls["fa4"] = lambda q, k, v, causal: fa4.differentiable(q, k, v, causal=causal)
    return impls


def fa4_unavailable() -> str | None:
    """Why the registry's ``fa4`` cannot be timed here (None: it can): not installed, no CUDA, or the GPU's
    compute capability; the bench then times the others and records this reason, replacing it by nothing."""
    from .registry import get

    return get("fa4").unavailable_reason("cuda")


def _fa4():
    from .registry import get

    return None if fa4_unavailable() else get("fa4")


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torch._dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v, causal):
        mask = None
        if causal:
            key = (q.shape[-2], q.device)
            if key not in masks:
                masks[key] = create_block_mask(causal_mod, None, None, q.shape[-2], q.shape[-2], device=q.device)
            mask = masks[key]
        return compiled(q, k, v, block_mask=mask)
    return run


def _reference_check(fn, d: int, causal: bool) -> dict:
    """max |out - ref| and max |dq - ref| on a small bf16 shape, ref = SDPA math in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, CHECK_N, d, device="cuda", generator=g, dtype=DTYPE) for _ in range(4))
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = sdpa(q32, k32, v32, is_causal=causal)
    (ref_dq,) = torch.autograd.grad(ref, (q32,), do.float())
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(ql, kl, vl, causal)
    (dq,) = torch.autograd.grad(out, (ql,), do)
    return {"check_shape": [2, 3, CHECK_N, d], "max_abs_diff_out": (out.float() - ref).abs().max().item(),
            "max_abs_diff_dq": (dq.float() - ref_dq).abs().max().item(),
            "ref_max_abs_out": ref.abs().max().item(), "ref_max_abs_dq": ref_dq.abs().max().item()}


def run_case(name: str, fn, n: int, d: int, causal: bool, warmup: int, reps: int) -> dict:
    bh = max(1, TOKENS // n)
    heads = 16 if bh % 16 == 0 else 1
    rec = {"impl": name, "n": n, "d": d, "causal": causal, "dtype": str(DTYPE).replace("torch.", ""),
           "batch": bh // heads, "heads": heads, "status": "ok"}
    try:
        rec.update(_reference_check(fn, d, causal))
        shape = (bh // heads, heads, n, d)
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=DTYPE) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        f_fwd, f_bwd = flops(n, d, bh, causal)

        def fwd():
            with torch.no_grad():
                fn(q, k, v, causal)

        out = fn(q, k, v, causal)

        def bwd():
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

        def fwd_bwd():
            torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)

        for label, call, work in (("fwd", fwd, f_fwd), ("bwd", bwd, f_bwd), ("fwd_bwd", fwd_bwd, f_fwd + f_bwd)):
            ms = median_ms(call, warmup, reps, "cuda")
            rec[f"{label}_ms"] = ms
            rec[f"{label}_tflops"] = work / (ms * 1e-3) / 1e12
        out = None  # free the graph before the next case
    except Exception as exc:  # noqa: BLE001
        message = f"{type(exc).__name__}: {exc}"
        # an SDPA backend that raises (at dispatch, or after) is recorded as refused, with its error
        rec["status"] = "refused" if name.startswith("sdpa_") else "error"
        rec["error"] = message[:2000]
        rec["traceback"] = traceback.format_exc()[-4000:]
    finally:
        torch.cuda.empty_cache()
    return rec


def summarize(cases) -> list[dict]:
    """Per shape (n, d, causal): the ratios of ``summary`` (see the module docstring) from the ok cases."""
    ok = {(c["impl"], c["n"], c["d"], c["causal"]): c for c in cases if c.get("status") == "ok"}
    shapes = sorted({(c["n"], c["d"], c["causal"]) for c in cases})
    out = []

    def ratio(a, b, key):
        return a[key] / b[key] if a and b and key in a and key in b and b[key] else None

    for n, d, causal in shapes:
        get = lambda impl: ok.get((impl, n, d, causal))  # noqa: E731
        base = get("triton_fa2")
        rec = {"n": n, "d": d, "causal": causal}
        for other, name in (("flex_attention_compiled", "flex"), ("sdpa_flash_attention", "sdpa_flash"),
                            ("sdpa_cudnn_attention", "sdpa_cudnn"), ("fa4", "fa4")):
            for key in ("fwd_bwd", "fwd", "bwd"):
                rec[f"{key}_vs_{name}"] = ratio(base, get(other), f"{key}_ms")
        for impl, name in (("triton_fa2_gproj_dq", "gproj_dq"), ("triton_fa2_gproj_dq_dk", "gproj_dq_dk")):
            for key in ("fwd_bwd", "bwd"):
                r = ratio(get(impl), base, f"{key}_ms")
                rec[f"{name}_cost_{key}"] = None if r is None else r - 1.0
            # GProj's extra backward time in units of one of the GProj-off backward's BWD_GEMMS tile GEMMs
            r = rec[f"{name}_cost_bwd"]
            rec[f"{name}_extra_bwd_gemms"] = None if r is None else r * BWD_GEMMS
        for impl, name in (("triton_fa2_fp32_backward", "fp32_backward"),
                           ("triton_fa2_fp32_backward_tf32x3", "fp32_backward_tf32x3"),
                           ("triton_fa2_fp32_backward_bf16x3", "fp32_backward_bf16x3")):
            for key in ("fwd_bwd", "bwd"):
                rec[f"{name}_ratio_{key}"] = ratio(get(impl), base, f"{key}_ms")
        checks = {"fwd_bwd_vs_flex": (rec["fwd_bwd_vs_flex"], TARGETS["fwd_bwd_vs_flex"]),
                  "gproj_dq_cost": (rec["gproj_dq_cost_fwd_bwd"], TARGETS["gproj_dq_cost"]),
                  "gproj_dq_dk_cost": (rec["gproj_dq_dk_cost_fwd_bwd"], TARGETS["gproj_dq_dk_cost"]),
                  "fp32_backward_ratio": (rec["fp32_backward_ratio_fwd_bwd"], TARGETS["fp32_backward_ratio"]),
                  "fp32_backward_tf32x3_ratio": (rec["fp32_backward_tf32x3_ratio_fwd_bwd"],
                                                 TARGETS["fp32_backward_ratio"]),
                  "fp32_backward_bf16x3_ratio": (rec["fp32_backward_bf16x3_ratio_fwd_bwd"],
                                                 TARGETS["fp32_backward_ratio"]),
                  "fwd_bwd_vs_fa4": (rec["fwd_bwd_vs_fa4"], TARGETS["fwd_bwd_vs_fa4"])}
        rec["meets"] = {key: (None if value is None else bool(value <= target)) for key, (value, target) in
                        checks.items()}
        out.append(rec)
    return out


TABLE_COLUMNS = (("fwd+bwd / Flex", "fwd_bwd_vs_flex", "x"), ("fwd / Flex", "fwd_vs_flex", "x"),
                 ("fwd+bwd / sdpa:flash", "fwd_bwd_vs_sdpa_flash", "x"), ("fwd+bwd / FA4", "fwd_bwd_vs_fa4", "x"),
                 ("GProj dq", "gproj_dq_cost_fwd_bwd", "%"), ("dq: extra bwd GEMMs", "gproj_dq_extra_bwd_gemms", "x"),
                 ("GProj dq_dk", "gproj_dq_dk_cost_fwd_bwd", "%"),
                 ("dq_dk: extra bwd GEMMs", "gproj_dq_dk_extra_bwd_gemms", "x"),
                 ("bf16x3 FP32 bwd", "fp32_backward_bf16x3_ratio_fwd_bwd", "x"))


def summary_table(results: dict) -> str:
    """A Markdown table of the ``summary`` rows of bench files (``{label: result dict}``), recomputed by
    ``summarize`` from each file's cases (so a file written before a column existed has it too), one row per
    file and shape, sorted by N, d, causality: the ratios against the other kernels (time over time), GProj's cost over
    GProj off in forward + backward time, and GProj's extra backward time in GEMMs (``BWD_GEMMS``). Values are
    printed from the files as they are (two decimals, costs in percent); "-" where a side was not timed."""
    head = ["N", "d", "causal", "file"] + [label for label, _, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [(s["n"], s["d"], s["causal"], label, s) for label, res in results.items()
            for s in summarize(res.get("cases", []) + res.get("extra_cases", []))]
    for n, d, causal, label, s in sorted(rows, key=lambda row: row[:4]):
        cells = [str(n), str(d), "yes" if causal else "no", f"`{label}`"]
        for _, key, kind in TABLE_COLUMNS:
            value = s.get(key)
            if value is None:
                cells.append("-")
            elif kind == "%":
                cells.append(f"{100 * value:+.1f}%")
            else:
                cells.append(f"{value:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


BENCH_BWD_GEMMS = 5
"""Tile GEMMs per (query block, key block) pair in the backward that the bench's FLOP count assumes (backward
2.5 x forward, the forward's 2 GEMMs being Q K^T and P V): S, dP, dV, dK and dQ, the GEMMs FlashAttention-2's and
FlashAttention-3's backward execute (Dao, "FlashAttention-2", 2023, arXiv:2307.08691, Algorithm 2; Shah et al.,
"FlashAttention-3", 2024, arXiv:2407.08608), so a 5-GEMM backward's bench TFLOP/s is the rate of its tensor-core
work."""


def gproj_bound(cases) -> list[dict]:
    """Per shape with a GProj-off ``triton_fa2`` case: the tensor-core rate each backward runs at, and the rate
    GProj's backward would need to meet its target, in TFLOP/s of the GEMMs it executes (one tile GEMM per
    (query block, key block) pair is half the forward's FLOPs, ``flops``):

    * ``off_bwd_exec_tflops``: ``BWD_GEMMS`` GEMMs over the GProj-off backward time B;
    * ``gproj_{mode}_exec_tflops``: ``BWD_GEMMS`` + 1 ("dq") or + 2 ("dq_dk") GEMMs over GProj's backward time;
    * ``gproj_{mode}_needed_exec_tflops``: the same GEMMs over B + c T, with c the target of ``TARGETS`` and T the
      GProj-off forward + backward time: GProj changes only the backward, so its forward + backward stays within
      (1 + c) T exactly when its backward takes at most B + c T;
    * ``{fa4, sdpa_cudnn, sdpa_flash}_bwd_tflops``: those kernels' backward on the bench's count
      (``BENCH_BWD_GEMMS``), which for FA4 and ``sdpa:flash`` is the rate of the GEMMs they execute; cuDNN's
      backward algorithm is not published, so its value is on the bench's count only.

    Where the needed rate exceeds every backward rate measured on the machine, the target asks GProj's kernel to
    run its tensor cores faster than any attention backward there does."""
    ok = {(c["impl"], c["n"], c["d"], c["causal"]): c for c in cases if c.get("status") == "ok"}
    out = []
    for n, d, causal in sorted({(c["n"], c["d"], c["causal"]) for c in cases}):
        base = ok.get(("triton_fa2", n, d, causal))
        if base is None or not base.get("bwd_ms") or not base.get("fwd_bwd_ms"):
            continue
        gemm = flops(n, d, base["batch"] * base["heads"], causal)[0] / 2.0

        def rate(gemms, ms):
            return gemms * gemm / (ms * 1e-3) / 1e12

        rec = {"n": n, "d": d, "causal": causal, "off_bwd_exec_tflops": rate(BWD_GEMMS, base["bwd_ms"])}
        for mode, extra, target in (("dq", 1, TARGETS["gproj_dq_cost"]), ("dq_dk", 2, TARGETS["gproj_dq_dk_cost"])):
            case = ok.get((f"triton_fa2_gproj_{mode}", n, d, causal))
            rec[f"gproj_{mode}_exec_tflops"] = rate(BWD_GEMMS + extra, case["bwd_ms"]) if case else None
            rec[f"gproj_{mode}_needed_exec_tflops"] = rate(BWD_GEMMS + extra,
                                                           base["bwd_ms"] + target * base["fwd_bwd_ms"])
        for impl, name in (("fa4", "fa4"), ("sdpa_cudnn_attention", "sdpa_cudnn"),
                           ("sdpa_flash_attention", "sdpa_flash")):
            other = ok.get((impl, n, d, causal))
            rec[f"{name}_bwd_tflops"] = other.get("bwd_tflops") if other else None
        out.append(rec)
    return out


BOUND_COLUMNS = (("ours, GProj off", "off_bwd_exec_tflops"), ("GProj dq", "gproj_dq_exec_tflops"),
                 ("dq needs (+5%)", "gproj_dq_needed_exec_tflops"), ("GProj dq_dk", "gproj_dq_dk_exec_tflops"),
                 ("dq_dk needs (+15%)", "gproj_dq_dk_needed_exec_tflops"), ("FA4", "fa4_bwd_tflops"),
                 ("cuDNN (bench count)", "sdpa_cudnn_bwd_tflops"), ("sdpa:flash", "sdpa_flash_bwd_tflops"))


def bound_table(results: dict) -> str:
    """``gproj_bound`` of bench files (``{label: result dict}``) as one Markdown table: backward TFLOP/s of the
    GEMMs each kernel executes, one row per file and shape; "-" where a side was not timed."""
    head = ["N", "d", "causal", "file"] + [label for label, _ in BOUND_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [(s["n"], s["d"], s["causal"], label, s) for label, res in results.items()
            for s in gproj_bound(res.get("cases", []) + res.get("extra_cases", []))]
    for n, d, causal, label, s in sorted(rows, key=lambda row: row[:4]):
        cells = [str(n), str(d), "yes" if causal else "no", f"`{label}`"]
        cells += ["-" if s.get(key) is None else f"{s[key]:.0f}" for _, key in BOUND_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gproj_table(results: dict) -> str:
    """The ``gproj_summary`` rows of paired GProj files (``{label: result dict}``) as one Markdown table: per file and
    shape, each mode's median forward + backward cost over GProj off with its [smallest, largest] round, sorted by
    N, d, causality, file; "-" where a mode was not timed."""
    lines = ["| N | d | causal | file | GProj dq: median [min, max] | GProj dq_dk: median [min, max] |",
             "|---|---|---|---|---|---|"]
    rows = [(s["n"], s["d"], s["causal"], label, s) for label, res in results.items()
            for s in res.get("gproj_summary", [])]
    for n, d, causal, label, s in sorted(rows, key=lambda row: row[:4]):
        cells = []
        for mode in ("dq", "dq_dk"):
            c = s.get(f"gproj_{mode}_fwd_bwd")
            cells.append("-" if not c else
                         f"{100 * c['median']:+.1f}% [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]")
        lines.append(f"| {n} | {d} | {'yes' if causal else 'no'} | `{label}` | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def apply_tables(tfa, tune_paths) -> dict:
    """Make ``tfa.default_config`` use the tables ``triton_fa2_tune.pick_configs`` picks from the sweep
    files ``tune_paths`` (for this process only: the committed tables are what ``format_tables`` prints
    from the same files, pasted into the module). Returns the picked tables (keys as strings, for JSON)."""
    from .triton_fa2_tune import pick_configs

    picked = pick_configs([json.loads(Path(p).read_text()) for p in tune_paths])
    tfa.TUNED_CONFIGS.update(picked["configs"])
    # GProj's launches merged over the existing entries (which may hold TMA and overlap switches); a launch the
    # sweep measured equal to GProj off's drops the entry's own warps and stages of that kernel
    for d, causal, kernel in picked.get("gproj_launch_same", []):
        for mode in (("dq", "dq_dk") if kernel == "dq" else ("dq_dk",)):
            entry = tfa.TUNED_GPROJ_LAUNCH.get((d, causal, mode))
            if entry is not None:
                tfa.TUNED_GPROJ_LAUNCH[d, causal, mode] = {
                    key: value for key, value in entry.items() if key not in (f"{kernel}_warps", f"{kernel}_stages")}
    for key, launch in picked["gproj_launch"].items():
        tfa.TUNED_GPROJ_LAUNCH[key] = {**tfa.TUNED_GPROJ_LAUNCH.get(key, {}), **launch}
    tfa.TUNED_FP32_BWD.update(picked["fp32_bwd"])
    # TMA loads, launch order and overlap over an existing entry (in this order: the overlap part re-times TMA)
    for switches in ("tma_flags", "order_flags", "overlap_flags"):
        for shape, flags in picked.get(switches, {}).items():
            if shape in tfa.TUNED_CONFIGS:
                tfa.TUNED_CONFIGS[shape] = {**tfa.TUNED_CONFIGS[shape], **flags}
    for key, flags in picked.get("gproj_schedule", {}).items():  # GProj's own TMA and overlap switches
        if key[:2] in tfa.TUNED_CONFIGS:
            tfa.TUNED_GPROJ_LAUNCH[key] = {**tfa.TUNED_GPROJ_LAUNCH.get(key, {}), **flags}
    return {name: {",".join(str(x) for x in key): value for key, value in table.items()} if isinstance(table, dict)
            else table for name, table in picked.items()}


def main(out_path, quick: bool = False, ns=None, dims=(64, 128), budget_s: float = 240.0, tables_from=()) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_bench needs a CUDA GPU")
    from . import triton_fa2 as tfa
    applied = apply_tables(tfa, tables_from) if tables_from else None
    reason = tfa.unavailable_reason("cuda")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ns = tuple(ns) if ns else ((4096, 16384) if quick else (4096, 8192, 16384, 32768))
    result = {"environment": environment(), "tokens_per_shape": TOKENS, "quick": quick, "ns": list(ns),
              "dims": list(dims), "budget_s": budget_s,
              "flop_count": "forward 4*N^2*d per head (x0.5 causal); backward 2.5x forward",
              "triton_fa2_unavailable": reason, "fa4_unavailable": fa4_unavailable(), "targets": TARGETS,
              "tables_from": [str(p) for p in tables_from], "tables_applied": applied,
              "triton_fa2_configs": {} if reason else {
                  f"{d},{int(c)}": vars(tfa.default_config(d, causal=c)) for d in dims for c in (False, True)},
              "cases": [], "extra_cases": [], "summary": [], "stopped_by_budget": False}
    warmup, reps = (1, 5) if not quick else (1, 3)
    impls = _implementations()
    t0 = time.time()

    def save():
        result["summary"] = summarize(result["cases"] + result["extra_cases"])
        result["total_s"] = round(time.time() - t0, 1)
        out_path.write_text(json.dumps(result, indent=1))

    for n in ns:
        for d in dims:
            for causal in (False, True):
                if time.time() - t0 > budget_s:
                    result["stopped_by_budget"] = True
                    save()
                    return result
                for name, fn in impls.items():
                    if name.startswith("triton") and reason:
                        rec = {"impl": name, "n": n, "d": d, "causal": causal, "status": "error", "error": reason}
                    else:
                        rec = run_case(name, fn, n, d, causal, warmup, reps)
                    rec["elapsed_s"] = round(time.time() - t0, 1)
                    result["extra_cases" if name in EXTRA_IMPLS else "cases"].append(rec)
                    save()
                    summary = " ".join(f"{key}={rec[key]:.1f}" for key in ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")
                                       if key in rec)
                    print(f"[{rec['elapsed_s']:7.1f}s] {name:32s} N={n:6d} d={d:3d} causal={causal!s:5s} "
                          f"{rec['status']:7s} {summary} {rec.get('error', '')[:160]}", flush=True)
                shape = [s for s in result["summary"] if (s["n"], s["d"], s["causal"]) == (n, d, causal)]
                if shape:
                    s = shape[0]
                    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
                    print(f"   summary N={n} d={d} causal={causal}: fwd+bwd vs flex {fmt(s['fwd_bwd_vs_flex'])}, "
                          f"vs sdpa flash {fmt(s['fwd_bwd_vs_sdpa_flash'])}, vs fa4 {fmt(s['fwd_bwd_vs_fa4'])}; "
                          f"gproj dq {fmt(s['gproj_dq_cost_fwd_bwd'])}, dq_dk {fmt(s['gproj_dq_dk_cost_fwd_bwd'])}; "
                          f"fp32 bwd x{fmt(s['fp32_backward_ratio_fwd_bwd'])}"
                          f" (tf32x3 x{fmt(s['fp32_backward_tf32x3_ratio_fwd_bwd'])},"
                          f" bf16x3 x{fmt(s['fp32_backward_bf16x3_ratio_fwd_bwd'])})", flush=True)
    save()
    return result


def paired_costs(off_rounds, mode_rounds) -> dict:
    """GProj's paired cost from per-round times (ms) of GProj off and of one mode, round i of each timed back to
    back: ``{"median", "lo", "hi", "rounds", "confidence", "costs"}`` with ``costs`` the per-round
    ``t_mode / t_off - 1``, ``lo``/``hi`` their extremes and ``confidence`` = 1 - 2^(1-R), the coverage of
    [lo, hi] for the median of a continuous cost over R independent rounds (sign test). Refuses unequal or empty
    round lists and non-positive times."""
    off, mode = list(off_rounds), list(mode_rounds)
    if not off or len(off) != len(mode):
        raise ValueError(f"paired rounds need equal, non-empty lists; got {len(off)} and {len(mode)}")
    if any(not t > 0 for t in off + mode):
        raise ValueError(f"round times must be positive milliseconds; got {off} and {mode}")
    costs = [m / o - 1.0 for o, m in zip(off, mode)]
    ordered = sorted(costs)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
    return {"median": median, "lo": ordered[0], "hi": ordered[-1], "rounds": len(costs),
            "confidence": 1.0 - 2.0 ** (1 - len(costs)), "costs": costs}


def gproj_summary(cases) -> list[dict]:
    """Per shape of a ``gproj`` run: ``paired_costs`` of ``"dq"`` and ``"dq_dk"`` against ``"off"`` for forward +
    backward (``fwd_bwd``) and backward alone (``bwd``), and whether the median meets ``TARGETS``."""
    by_shape = {}
    for c in cases:
        if c.get("status") == "ok":
            by_shape.setdefault((c["n"], c["d"], c["causal"]), {})[c["gproj"]] = c
    out = []
    for (n, d, causal), modes in sorted(by_shape.items()):
        if "off" not in modes:
            continue
        rec = {"n": n, "d": d, "causal": causal}
        for mode in ("dq", "dq_dk"):
            if mode not in modes:
                continue
            for part in ("fwd_bwd", "bwd"):
                rec[f"gproj_{mode}_{part}"] = paired_costs(modes["off"][f"{part}_ms_rounds"],
                                                           modes[mode][f"{part}_ms_rounds"])
            rec[f"meets_gproj_{mode}_cost"] = bool(rec[f"gproj_{mode}_fwd_bwd"]["median"]
                                                   <= TARGETS[f"gproj_{mode}_cost"])
        out.append(rec)
    return out


def paired_ratios(ref_rounds, rounds) -> dict:
    """``t / t_ref`` per round, from per-round times (ms) of two implementations timed back to back:
    ``{"median", "lo", "hi", "rounds", "confidence", "ratios"}`` (``paired_costs`` plus one; the same refusals)."""
    costs = paired_costs(ref_rounds, rounds)
    return {"median": 1.0 + costs["median"], "lo": 1.0 + costs["lo"], "hi": 1.0 + costs["hi"],
            "rounds": costs["rounds"], "confidence": costs["confidence"], "ratios": [1.0 + c for c in costs["costs"]]}


def flex_summary(cases) -> list[dict]:
    """Per shape of a ``flex`` run: ``paired_ratios`` of ``triton_fa2`` over compiled Flex for the forward
    (``fwd_vs_flex``) and forward + backward (``fwd_bwd_vs_flex``), ``meets_*`` (median <= ``TARGETS``'
    ``fwd_bwd_vs_flex``, the same bound for both parts) and ``verdict_*`` (module docstring)."""
    by_shape = {}
    for c in cases:
        if c.get("status") == "ok":
            by_shape.setdefault((c["n"], c["d"], c["causal"]), {})[c["impl"]] = c
    out = []
    for (n, d, causal), impls in sorted(by_shape.items()):
        if set(impls) != {"triton_fa2", "flex_attention_compiled"}:
            continue
        rec = {"n": n, "d": d, "causal": causal}
        for part in ("fwd", "fwd_bwd"):
            ratio = paired_ratios(impls["flex_attention_compiled"][f"{part}_ms_rounds"],
                                  impls["triton_fa2"][f"{part}_ms_rounds"])
            bound = TARGETS["fwd_bwd_vs_flex"]
            rec[f"{part}_vs_flex"] = ratio
            rec[f"meets_{part}_vs_flex"] = bool(ratio["median"] <= bound)
            rec[f"verdict_{part}_vs_flex"] = ("under" if ratio["hi"] <= bound else
                                              "over" if ratio["lo"] > bound else "not resolved")
        out.append(rec)
    return out


def flex_main(out_path, ns=(4096, 8192), dims=(64, 128), rounds: int = 7, budget_s: float = 240.0,
              base_change: dict | None = None) -> dict:
    """The ``flex`` command (module docstring): paired rounds of ``triton_fa2`` and compiled Flex per shape;
    ``base_change``: BlockConfig fields applied over ``default_config`` (``--base=exp2=1``)."""
    if not isinstance(rounds, int) or rounds < 2:
        raise SystemExit(f"--rounds must be an integer >= 2 (a paired interval needs two rounds), got {rounds!r}")
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_bench flex needs a CUDA GPU")
    from . import triton_fa2 as tfa

    reason = tfa.unavailable_reason("cuda")
    if reason:
        raise SystemExit(f"triton_fa2 is unavailable here: {reason}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    import dataclasses

    configs = {(d, c): dataclasses.replace(tfa.default_config(d, causal=c), **(base_change or {}))
               for d in dims for c in (False, True)}
    result = {"environment": environment(), "tokens_per_shape": TOKENS, "ns": list(ns), "dims": list(dims),
              "rounds": rounds, "warmup": 1, "repeats": 5, "budget_s": budget_s, "targets": TARGETS,
              "base_change": dict(base_change or {}),
              "triton_fa2_configs": {f"{d},{int(c)}": vars(cfg) for (d, c), cfg in configs.items()},
              "cases": [], "flex_summary": [], "stopped_by_budget": False}

    def ours(q, k, v, causal):
        # the default configuration itself where nothing is changed (its TMA choice per tensor included)
        config = configs[q.shape[-1], causal] if base_change else None
        return tfa.triton_attention(q, k, v, causal=causal, config=config)
    impls = {"triton_fa2": ours, "flex_attention_compiled": _flex()}
    t0 = time.time()

    def save():
        result["flex_summary"] = flex_summary(result["cases"])
        result["total_s"] = round(time.time() - t0, 1)
        out_path.write_text(json.dumps(result, indent=1))

    for n in ns:
        for d in dims:
            for causal in (False, True):
                if time.time() - t0 > budget_s:
                    result["stopped_by_budget"] = True
                    save()
                    return result
                bh = max(1, TOKENS // n)
                heads = 16 if bh % 16 == 0 else 1
                q, k, v, do = (torch.randn(bh // heads, heads, n, d, device="cuda", dtype=DTYPE) for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_()
                recs, calls, outs = {}, {}, {}
                for name, fn in impls.items():
                    rec = {"impl": name, "n": n, "d": d, "causal": causal, "batch": bh // heads, "heads": heads,
                           "status": "ok"}
                    try:
                        with torch.no_grad():
                            outs[name] = fn(q, k, v, causal).float()  # compiles / warms the forward

                        def fwd(fn=fn):
                            with torch.no_grad():
                                fn(q, k, v, causal)

                        def fwd_bwd(fn=fn):
                            torch.autograd.grad(fn(q, k, v, causal), (q, k, v), do)
                        fwd_bwd()  # compiles / warms the backward
                        calls[name] = {"fwd": fwd, "fwd_bwd": fwd_bwd}
                    except Exception as exc:  # noqa: BLE001
                        rec["status"] = "error"
                        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    recs[name] = rec
                if len(outs) == 2:
                    diff = (outs["triton_fa2"] - outs["flex_attention_compiled"]).abs().max().item()
                    for rec in recs.values():
                        rec["max_abs_diff_out"] = diff
                outs.clear()
                names = list(calls)
                for i in range(rounds):
                    for name in (names if i % 2 == 0 else names[::-1]):
                        for part, call in calls[name].items():
                            try:
                                recs[name].setdefault(f"{part}_ms_rounds", []).append(
                                    round(median_ms(call, 1, 5, "cuda"), 4))
                            except Exception as exc:  # noqa: BLE001
                                recs[name]["status"] = "error"
                                recs[name]["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                calls.clear()
                torch.cuda.empty_cache()
                for rec in recs.values():
                    rec["elapsed_s"] = round(time.time() - t0, 1)
                    result["cases"].append(rec)
                save()
                for s in result["flex_summary"]:
                    if (s["n"], s["d"], s["causal"]) == (n, d, causal):
                        print(f"   N={n} d={d} causal={causal}: " + "; ".join(
                            f"{part} x{s[f'{part}_vs_flex']['median']:.3f} [{s[f'{part}_vs_flex']['lo']:.3f}, "
                            f"{s[f'{part}_vs_flex']['hi']:.3f}] {s[f'verdict_{part}_vs_flex']}"
                            for part in ("fwd", "fwd_bwd")), flush=True)
    save()
    return result


def _paired_cli(command: str, run) -> None:
    """``gproj`` / ``flex`` command lines: OUT.json and --ns, --dims, --rounds, --budget-s (``flex`` also --base)."""
    args = [a for a in sys.argv[2:] if not a.startswith("--")]
    opts = dict(a.split("=", 1) for a in sys.argv[2:] if a.startswith("--") and "=" in a)
    flags = {a for a in sys.argv[2:] if a.startswith("--") and "=" not in a}
    default_ns = "8192" if command == "gproj" else "4096,8192"
    allowed = {"--ns", "--dims", "--rounds", "--budget-s"} | ({"--base"} if command == "flex" else set())
    if len(args) != 1 or set(opts) - allowed or flags:
        raise SystemExit(f"usage: python -m attnum.kernels.triton_fa2_bench {command} OUT.json [--ns={default_ns}]"
                         " [--dims=64,128] [--rounds=7] [--budget-s=240]"
                         + (" [--base=KEY=VALUE,...]" if command == "flex" else ""))
    try:
        rounds = int(opts.get("--rounds", "7"))
        ns = tuple(int(x) for x in opts.get("--ns", default_ns).split(","))
        dims = tuple(int(x) for x in opts.get("--dims", "64,128").split(","))
        budget_s = float(opts.get("--budget-s", 240))
    except ValueError as exc:
        raise SystemExit(f"{command}: --rounds, --ns and --dims take integers, --budget-s a number ({exc})") from None
    extra = {}
    if "--base" in opts:
        from .triton_fa2_tune import parse_change

        extra["base_change"] = parse_change(opts["--base"])
    run(args[0], ns=ns, dims=dims, rounds=rounds, budget_s=budget_s, **extra)


def gproj_main(out_path, ns=(8192,), dims=(64, 128), rounds: int = 7, budget_s: float = 240.0) -> dict:
    """The ``gproj`` command (module docstring): paired rounds of GProj off, dq and dq_dk per shape."""
    if not isinstance(rounds, int) or rounds < 2:
        raise SystemExit(f"--rounds must be an integer >= 2 (a paired interval needs two rounds), got {rounds!r}")
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_bench gproj needs a CUDA GPU")
    from . import triton_fa2 as tfa

    reason = tfa.unavailable_reason("cuda")
    if reason:
        raise SystemExit(f"triton_fa2 is unavailable here: {reason}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "tokens_per_shape": TOKENS, "ns": list(ns), "dims": list(dims),
              "rounds": rounds, "warmup": 1, "repeats": 5, "budget_s": budget_s, "targets": TARGETS,
              "triton_fa2_configs": {f"{d},{int(c)},{g}": vars(tfa.default_config(d, causal=c, gproj=g))
                                     for d in dims for c in (False, True) for g in tfa.GPROJ_MODES},
              "cases": [], "gproj_summary": [], "stopped_by_budget": False}
    t0 = time.time()

    def save():
        result["gproj_summary"] = gproj_summary(result["cases"])
        result["total_s"] = round(time.time() - t0, 1)
        out_path.write_text(json.dumps(result, indent=1))

    for n in ns:
        for d in dims:
            for causal in (False, True):
                if time.time() - t0 > budget_s:
                    result["stopped_by_budget"] = True
                    save()
                    return result
                bh = max(1, TOKENS // n)
                heads = 16 if bh % 16 == 0 else 1
                q, k, v, do = (torch.randn(bh // heads, heads, n, d, device="cuda", dtype=DTYPE) for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_()
                recs, calls = {}, {}
                for mode in tfa.GPROJ_MODES:
                    rec = {"impl": "triton_fa2", "gproj": mode, "n": n, "d": d, "causal": causal,
                           "batch": bh // heads, "heads": heads, "status": "ok"}
                    try:
                        out = tfa.triton_attention(q, k, v, causal=causal, gproj=mode)

                        def bwd(out=out):
                            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

                        def fwd_bwd(mode=mode):
                            torch.autograd.grad(tfa.triton_attention(q, k, v, causal=causal, gproj=mode), (q, k, v),
                                                do)
                        calls[mode] = {"fwd_bwd": fwd_bwd, "bwd": bwd}
                    except Exception as exc:  # noqa: BLE001
                        rec["status"] = "error"
                        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    recs[mode] = rec
                for _ in range(rounds):
                    for mode, parts in calls.items():
                        for part, call in parts.items():
                            try:
                                recs[mode].setdefault(f"{part}_ms_rounds", []).append(
                                    round(median_ms(call, 1, 5, "cuda"), 4))
                            except Exception as exc:  # noqa: BLE001
                                recs[mode]["status"] = "error"
                                recs[mode]["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                calls.clear()
                torch.cuda.empty_cache()
                for rec in recs.values():
                    rec["elapsed_s"] = round(time.time() - t0, 1)
                    result["cases"].append(rec)
                save()
                for s in result["gproj_summary"]:
                    if (s["n"], s["d"], s["causal"]) == (n, d, causal):
                        costs = {mode: s[f"gproj_{mode}_fwd_bwd"] for mode in ("dq", "dq_dk")
                                 if f"gproj_{mode}_fwd_bwd" in s}
                        print(f"   N={n} d={d} causal={causal}: " + "; ".join(
                            f"{mode} {100 * c['median']:+.1f}% [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]"
                            for mode, c in costs.items()), flush=True)
    save()
    return result


if __name__ == "__main__":
    if sys.argv[1:2] in (["gproj"], ["flex"]):
        _paired_cli(sys.argv[1], gproj_main if sys.argv[1] == "gproj" else flex_main)
        raise SystemExit(0)
    if sys.argv[1:2] in (["table"], ["bound"], ["gproj-table"]):
        if len(sys.argv) < 3:
            raise SystemExit(f"usage: python -m attnum.kernels.triton_fa2_bench {sys.argv[1]} BENCH.json "
                             "[BENCH2.json ...]")
        missing = [p for p in sys.argv[2:] if not Path(p).is_file()]
        if missing:
            raise SystemExit(f"no such bench file: {', '.join(missing)}")
        print({"table": summary_table, "bound": bound_table, "gproj-table": gproj_table}[sys.argv[1]](
            {Path(p).stem.removeprefix("triton_fa2_bench_"): json.loads(Path(p).read_text()) for p in sys.argv[2:]}))
        raise SystemExit(0)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    flags = {a for a in sys.argv[1:] if a.startswith("--") and "=" not in a}
    if len(args) != 1 or set(opts) - {"--ns", "--dims", "--budget-s", "--tables-from"} or flags - {"--quick"}:
        raise SystemExit("usage: python -m attnum.kernels.triton_fa2_bench OUT.json [--quick] [--ns=4096,8192]"
                         " [--dims=64,128] [--budget-s=240] [--tables-from=TUNE.json,...]")
    main(args[0], quick="--quick" in flags,
         ns=tuple(int(x) for x in opts["--ns"].split(",")) if "--ns" in opts else None,
         dims=tuple(int(x) for x in opts.get("--dims", "64,128").split(",")),
         budget_s=float(opts.get("--budget-s", 240)),
         tables_from=tuple(opts["--tables-from"].split(",")) if "--tables-from" in opts else ())
