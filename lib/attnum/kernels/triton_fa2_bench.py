"""Speed of our Triton FlashAttention-2 kernel against PyTorch's attention kernels (GPU only).

    python -m attnum.kernels.triton_fa2_bench OUT.json [--quick]

or ``main(out_path, quick=False)``. For every shape -- N in {1024, 4096, 16384, 32768} (quick:
{1024, 4096}), head dim 64 and 128, causal and not, bf16, batch * heads = 2^18 / N so every shape
holds 262,144 tokens (the forward grid is 2048 thread blocks of 128 rows: the 132 SMs of an H200
are full at every N) -- it times forward, backward and forward + backward with CUDA events after
warm-up (median of repeats) and reports TFLOP/s with the usual count: forward 4 N^2 d per head
(halved when causal), backward 2.5 x forward (5 matmuls against 2; the recomputation is not
counted), so TFLOP/s compare directly across implementations.

Implementations: ``triton_fa2`` with gproj off / dq / dq_dk and with fp32_backward;
``scaled_dot_product_attention`` pinned to exactly one backend each (FLASH_ATTENTION,
CUDNN_ATTENTION, EFFICIENT_ATTENTION; a backend that raises is recorded as ``refused`` with its
error, never skipped silently); FlexAttention compiled with ``torch.compile`` (causal through
``create_block_mask``). Each case is wrapped so one failure does not stop the rest, and the JSON is
rewritten after every case, so a run cut short still leaves its results. Every case also records
a correctness line: max |difference| of its output and dQ against SDPA's math backend in fp32 on
a small shape (2 x 3 heads, N = 300, not a multiple of any block) in bf16.

Runtime on one H200 (torch 2.11, triton 3.6, 2026-11-30): ``quick`` took 165 s on a fresh machine,
most of it compilation (FlexAttention: one torch.compile per shape, ~7-14 s each; Triton: 20
kernel variants, a few seconds each); the full run then took 130 s on the same machine with those
compile caches warm. Fresh, the full run should take about 4-5 minutes (the quick run's compilation
plus ~2 min): under the 6-minute budget.
"""
from __future__ import annotations

import json
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
TRITON_VARIANTS = {"triton_fa2": dict(gproj="off"), "triton_fa2_gproj_dq": dict(gproj="dq"),
                   "triton_fa2_gproj_dq_dk": dict(gproj="dq_dk"),
                   "triton_fa2_fp32_backward": dict(gproj="off", fp32_backward=True)}
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def flops(n: int, d: int, bh: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs: 4 N^2 d per head forward, halved when causal; backward 2.5x."""
    fwd = 4.0 * n * n * d * bh * (0.5 if causal else 1.0)
    return fwd, 2.5 * fwd


def environment() -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {"python": platform.python_version(), **accelerator_versions(device),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
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
    return impls


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
    q, k, v, do = (torch.randn(2, 3, 300, d, device="cuda", generator=g, dtype=DTYPE) for _ in range(4))
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = sdpa(q32, k32, v32, is_causal=causal)
    (ref_dq,) = torch.autograd.grad(ref, (q32,), do.float())
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(ql, kl, vl, causal)
    (dq,) = torch.autograd.grad(out, (ql,), do)
    return {"check_shape": [2, 3, 300, d], "max_abs_diff_out": (out.float() - ref).abs().max().item(),
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


def main(out_path, quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_bench needs a CUDA GPU")
    from . import triton_fa2 as tfa
    reason = tfa.unavailable_reason("cuda")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "tokens_per_shape": TOKENS, "quick": quick,
              "flop_count": "forward 4*N^2*d per head (x0.5 causal); backward 2.5x forward",
              "triton_fa2_unavailable": reason, "cases": []}
    ns = (1024, 4096) if quick else (1024, 4096, 16384, 32768)
    warmup, reps = (1, 5) if not quick else (1, 3)
    impls = _implementations()
    t0 = time.time()
    for n in ns:
        for d in (64, 128):
            for causal in (False, True):
                for name, fn in impls.items():
                    if name.startswith("triton") and reason:
                        rec = {"impl": name, "n": n, "d": d, "causal": causal, "status": "error", "error": reason}
                    else:
                        rec = run_case(name, fn, n, d, causal, warmup, reps)
                    rec["elapsed_s"] = round(time.time() - t0, 1)
                    result["cases"].append(rec)
                    out_path.write_text(json.dumps(result, indent=1))
                    summary = " ".join(f"{key}={rec[key]:.1f}" for key in ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops")
                                       if key in rec)
                    print(f"[{rec['elapsed_s']:7.1f}s] {name:28s} N={n:6d} d={d:3d} causal={causal!s:5s} "
                          f"{rec['status']:7s} {summary} {rec.get('error', '')[:160]}", flush=True)
    result["total_s"] = round(time.time() - t0, 1)
    out_path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        raise SystemExit("usage: python -m attnum.kernels.triton_fa2_bench OUT.json [--quick]")
    main(args[0], quick="--quick" in sys.argv[1:])
