"""Study 05 on the registry's real kernels: each one's emulated equivalent, one kernel on the grid's
operands (``real_point``, called by ``experiments.fix_grid``), the measured times of the attention
call (``real_timings``) and of a whole training step of a GPT with each attention (``step_timings``).
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import xarray as xr

from ... import kernels
from ...kernels import AttentionImpl
from ...metrics import gradient_errors, output_errors
from ...progress import tqdm
from ...timing import median_ms
from . import STEP_NO_ATTENTION


def emulator_equivalent(name: str):
    """The emulated configuration that models a real kernel of the registry on the mechanism
    grid's bf16 operands, or None. Our Triton kernel: ``fa2_bf16`` with 128 x 64 tiles (its untuned
    fallback and its tuned d = 64 forward; the tuned d = 128 table uses 64 x 64, so there the equivalent
    sums in another fp32 order: an approximation at the fp32 level, one name per kernel whatever the head
    dim), max subtracted before scaling (no fused scale-max: seed 004's forward fix is built in), its GProj
    mode; ``:fp32_bwd`` keeps dS and P in fp32 for the matmuls and still stores bf16 gradients.
    ``sdpa:flash`` / ``sdpa:efficient`` / ``sdpa:cudnn``: ``fa2_bf16``, tiles 128, max subtracted
    before scaling: an approximation. PyTorch compiles its FlashAttention-2 copy with ``UNFUSE_FMA``
    (``aten/src/ATen/native/transformers/cuda/flash_attn/softmax.h``): ``exp2(round(s c) - round(m c))``,
    exactly 1 at the row max like subtract-then-scale, but rounded differently elsewhere; the efficient
    and cuDNN backends' tiles and exponent are not documented. ``sdpa:math``: FP32 attention (it
    computes in fp32 inside; its gradients are rounded to bf16 on the way out, the emulator's are not).
    ``fa4`` (FlashAttention-4, whose SM90 kernels follow FlashAttention-3's design): study 05's base kernel,
    seed 004's BF16 FlashAttention-3 as the emulator models it (``fa2_bf16``, fused scale-max), with 128 x 128
    tiles: an approximation (the package's tiles depend on the head dim and are not a parameter here)."""
    from ...precision import PRESETS

    family, *options = name.split(":")
    if family == "triton" and options[:1] == ["fa2"]:
        flags = set(options[1:])
        policy = PRESETS["fa2_bf16"]
        if "fp32_bwd" in flags:
            policy = policy.replace(name="fa2_bf16+fp32_ds_p", ds="fp32", p_bwd="fp32")
        gproj = "dq_dk" if "gproj_dq_dk" in flags else "dq" if "gproj_dq" in flags else "off"
        return AttentionImpl("emulator", policy, block_q=128, block_k=64, gproj=gproj)
    if family == "sdpa" and options[:1] in (["flash"], ["efficient"], ["cudnn"]):
        return AttentionImpl("emulator", "fa2_bf16", block_q=128, block_k=128)
    if family == "sdpa" and options[:1] == ["math"]:
        return AttentionImpl("emulator", "fp32")
    if family == "fa4" and not options:
        return AttentionImpl("emulator", "fa2_bf16", block_q=128, block_k=128, fused_scale_max=True)
    return None


def _failure(exc: BaseException) -> str:
    """Why a real kernel gave no result, with the first line of the reason: out of memory; refused (a
    pinned SDPA backend's ``BackendRefused``, an input the kernel rejects, ``ValueError``, or one the
    package asserts against, ``AssertionError``, as flash-attn-4 does for dtypes and head dims); or
    error (anything else, e.g. a Triton compile error such as ``OutOfResources``)."""
    from ...kernels.sdpa import BackendRefused

    first = (str(exc).splitlines() or [""])[0]
    if isinstance(exc, torch.OutOfMemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return f"out of memory: {first[:200]}"
    kind = "refused" if isinstance(exc, (BackendRefused, ValueError, AssertionError)) else "error"
    return f"{kind}: {type(exc).__name__}: {first[:300]}"


def _error_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    ok = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[ok] - a[ok].mean(), b[ok] - b[ok].mean()
    den = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    return (a @ b / den).item() if den > 0 else math.nan


def real_point(kernel, q, k, v, do, gold: dict, equivalent=None) -> dict[str, float]:
    """One real kernel on bf16 operands (``kernel.forward`` then ``kernel.backward`` with what the
    forward stored), measured like the fixes; beside it the emulated ``equivalent`` (already run:
    a dict with its ``grads``): its errors, the correlation of the two dQ errors over all elements,
    and the fraction of dQ elements bitwise equal. Raises what the kernel raises."""
    low = [t.to(torch.bfloat16) for t in (q, k, v, do)]
    out, lse = kernel.forward(*low[:3])
    stored = dict(out=out, lse=lse) if lse is not None else {}
    grads = kernel.backward(*low, **stored)
    res = {**gradient_errors(grads, gold, quantiles=(0.99,)), **output_errors(out, gold["out"])}
    res = {m: res[m] for m in ("dq_err", "dk_err", "dv_err", "dq_err_p99", "out_err")}
    if equivalent is not None:
        emul = equivalent["grads"]
        res.update({f"emul_{m}": equivalent["errors"][m] for m in ("dq_err", "dk_err", "dv_err")})
        res["dq_err_corr"] = _error_correlation(grads[0].double() - gold["dq"], emul[0].double() - gold["dq"])
        res["dq_bitwise"] = (grads[0].float() == emul[0].float()).double().mean().item()
    return res


TIMING_DTYPES = ("bf16", "fp32")
TIMING_PASSES = ("fwd", "bwd", "fwd_bwd")
TIMING_FIX = {"triton:fa2": "none", "triton:fa2:gproj_dq": "gproj_dq", "triton:fa2:gproj_dq_dk": "gproj_dq_dk",
              "triton:fa2:fp32_bwd": "fp32_backward"}
"""The fix each Triton variant implements (the same kernel fed fp32 tensors: ``fp32_attention``)."""


def timing_variant(name: str, dtype: str) -> str | None:
    """The ``attnum.cost.TRITON_VARIANTS`` entry a timed (kernel, dtype) is, or None (not our kernel)."""
    if dtype == "fp32":
        return "fp32_attention" if name == "triton:fa2" else None
    return TIMING_FIX.get(name)


def fp32_input_config(head_dim: int):
    """Our Triton kernel's tiles for fp32 inputs (FP32 attention in the same kernel): the FP32
    backward's halved tiles in the forward too, since fp32 operands take twice the shared memory."""
    from ...kernels import triton_fa2

    return triton_fa2.BlockConfig(fwd_m=64, fwd_n=32, dq_m=64, dq_n=32, kv_n=64, kv_m=32,
                                  num_warps=4 if head_dim <= 64 else 8, fwd_stages=2, bwd_stages=1)


def _attention_fn(kernel, dtype: str, head_dim: int):
    """The differentiable attention call of a timed case: the registry kernel, except our Triton
    kernel fed fp32 tensors, which gets ``fp32_input_config``'s tiles."""
    if dtype == "fp32" and isinstance(kernel, kernels.TritonKernel):
        from ...kernels import triton_fa2

        config = fp32_input_config(head_dim)
        return lambda q, k, v, causal: triton_fa2.triton_attention(q, k, v, causal=causal, gproj=kernel.gproj,
                                                                   fp32_backward=kernel.fp32_backward, config=config)
    return lambda q, k, v, causal: kernel(q, k, v, is_causal=causal)


def timing_environment(device) -> dict[str, str]:
    """What the timings ran on, as string attributes: the GPU, its clocks and power limit
    (``nvidia-smi``), torch/CUDA/triton versions; on a CPU, the processor and thread count."""
    import platform

    env = {"timing_torch": torch.__version__, "timing_time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if str(device).startswith("cuda"):
        from ...kernels.triton_fa2_bench import environment

        info = environment()
        env.update(timing_clock="CUDA events (torch.cuda.Event), after warm-up; median of repeats",
                   timing_gpu=str(info.get("gpu")), timing_cuda=str(info.get("cuda")),
                   timing_triton=str(info.get("triton")),
                   timing_nvidia_smi=json_dumps(info.get("nvidia_smi")))
    else:
        env.update(timing_clock="wall clock (time.perf_counter) on a CPU, after warm-up; median of repeats",
                   timing_gpu="none", timing_cpu=platform.processor() or platform.machine(),
                   timing_threads=str(torch.get_num_threads()))
    return env


def json_dumps(value) -> str:
    import json

    return json.dumps(value)


def real_timings(kernel_names, *, seq_len: int, tokens: int, head_dims, causal, fp32_kernels, warmup: int,
                 repeats: int, device="cpu", progress: bool = True) -> xr.Dataset:
    """Measured forward, backward and forward + backward time of every real kernel in bf16 (and in
    fp32 for ``fp32_kernels``: FP32 attention), at N = ``seq_len`` with ``tokens / seq_len`` heads
    of head dim d, causal or not; after ``warmup`` calls, median of ``repeats`` (CUDA events on a
    GPU). Beside each, ``timing_analytic_*``: the arithmetic time at H200 datasheet peaks of our
    Triton kernel's own structure (``attnum.cost.triton_fa2_seconds``; NaN for other kernels).
    ``timing_status``: "ok", "not requested" (fp32 of a kernel not in ``fp32_kernels``), or why
    the kernel gave no time (unavailable, refused, out of memory)."""
    from ...cost import triton_fa2_seconds

    heads = max(1, tokens // seq_len)
    cuda = str(device).startswith("cuda")
    shape = (len(kernel_names), len(TIMING_DTYPES), len(head_dims), len(causal))
    ms = {p: np.full(shape, np.nan) for p in TIMING_PASSES}
    analytic = {p: np.full(shape, np.nan) for p in TIMING_PASSES}
    status = np.full(shape, "ok", dtype=object)
    work = [(r, name, t, dtype, e, d, c, cz) for r, name in enumerate(kernel_names)
            for t, dtype in enumerate(TIMING_DTYPES) for e, d in enumerate(head_dims) for c, cz in enumerate(causal)]
    gen = torch.Generator(device="cpu").manual_seed(0)
    env = timing_environment(device)
    for r, name, t, dtype, e, d, c, cz in tqdm(work, desc="real-kernel timings", disable=not progress):
        at = (r, t, e, c)
        variant = timing_variant(name, dtype)
        if variant is not None:
            secs = triton_fa2_seconds(variant, seq_len, d, causal=bool(cz), heads=heads)
            for p, key in zip(TIMING_PASSES, ("forward", "backward", "fwd_bwd")):
                analytic[p][at] = secs[key] * 1e3
        if dtype == "fp32" and name not in fp32_kernels:
            status[at] = "not requested"
            continue
        kernel = kernels.get(name)
        reason = kernel.unavailable_reason(device)
        if reason:
            status[at] = f"unavailable: {reason}"
            continue
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        q, k, v, do = (torch.randn(1, heads, seq_len, d, generator=gen).to(device=device, dtype=torch_dtype)
                       for _ in range(4))
        fn = _attention_fn(kernel, dtype, d)
        try:
            with torch.no_grad():
                ms["fwd"][at] = median_ms(lambda: fn(q, k, v, bool(cz)), warmup, repeats, device)
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out = fn(*leaves, bool(cz))
            ms["bwd"][at] = median_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), warmup,
                                      repeats, device)
            del out
            ms["fwd_bwd"][at] = median_ms(lambda: torch.autograd.grad(fn(*leaves, bool(cz)), leaves, do), warmup,
                                          repeats, device)
        except Exception as exc:  # noqa: BLE001 -- recorded as data; Triton's compile errors are not RuntimeErrors
            status[at] = _failure(exc)
            for p in TIMING_PASSES:
                ms[p][at] = np.nan
        finally:
            q = k = v = do = leaves = out = None  # free the case's tensors and graph before the next
            if cuda:
                torch.cuda.empty_cache()
    dims = ("timing_kernel", "timing_dtype", "timing_head_dim", "timing_causal")
    coords = {"timing_kernel": list(kernel_names), "timing_dtype": list(TIMING_DTYPES),
              "timing_head_dim": list(head_dims), "timing_causal": [bool(x) for x in causal]}
    ds = xr.Dataset({f"timing_{p}_ms": (dims, ms[p]) for p in TIMING_PASSES}, coords=coords)
    for p in TIMING_PASSES:
        ds[f"timing_analytic_{p}_ms"] = (dims, analytic[p])
    ds["timing_status"] = (dims, status.astype(str))
    if cuda:  # the clocks again, after the timings (the first reading is taken before them)
        env["timing_nvidia_smi_after"] = timing_environment(device)["timing_nvidia_smi"]
    ds.attrs.update(real_timing_seq_len=seq_len, real_timing_heads=heads, real_timing_warmup=warmup,
                    real_timing_repeats=repeats,
                    **env)
    return ds


# -- a training step's cost with each attention ---------------------------------------------------



class FormatAttention(kernels.Kernel):
    """A model's attention: ``kernel`` fed q, k, v in ``fmt`` ("bf16" or "fp32": FP32 attention),
    its output handed back in the model's dtype; our Triton kernel gets ``fp32_input_config``'s tiles
    for fp32. ``kernel=None``: no attention at all (the output is v), to time the rest of a step."""

    gives_lse = False

    def __init__(self, kernel, fmt: str = "bf16"):
        self.inner, self.fmt = kernel, fmt
        self.name = f"{kernel.name if kernel is not None else 'none'}@{fmt}"

    def unavailable_reason(self, device="cpu"):
        return None if self.inner is None else self.inner.unavailable_reason(device)

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        if self.inner is None:
            return v
        dtype = torch.bfloat16 if self.fmt == "bf16" else torch.float32
        fn = _attention_fn(self.inner, self.fmt, q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):  # autocast would cast SDPA's fp32 inputs to bf16
            return fn(q.to(dtype), k.to(dtype), v.to(dtype), causal).to(q.dtype)

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        with torch.no_grad():
            return self.differentiable(q, k, v, causal=causal), None


def step_timings(kernel_names, fp32_kernels, *, n_layer: int, d_model: int, n_head: int, context: int,
                 batch_size: int, warmup: int, repeats: int, vocab_size: int = 256, device="cpu",
                 progress: bool = True) -> xr.Dataset:
    """Measured time of one training step (forward, backward, AdamW update) of the small GPT with
    every layer's attention one kernel, everything else under bf16 autocast: each name of
    ``kernel_names`` fed bf16, each of ``fp32_kernels`` fed fp32 (FP32 attention), and a step
    without attention (output = v: what the rest of the step costs). Same weights and batch for
    every kernel; after ``warmup`` steps, median of ``repeats`` (CUDA events on a GPU).
    ``step_status``: "ok", "not requested", or why the kernel gave no time."""
    from ...model import GPT, GPTConfig

    cuda = str(device).startswith("cuda")
    names = [STEP_NO_ATTENTION] + list(kernel_names) + [k for k in fp32_kernels if k not in kernel_names]
    ms = np.full((len(names), len(TIMING_DTYPES)), np.nan)
    status = np.full(ms.shape, "not requested", dtype=object)
    gen = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randint(0, vocab_size, (batch_size, context + 1), generator=gen).to(device)
    x, y = idx[:, :-1], idx[:, 1:]
    work = [(r, name, t, dtype) for r, name in enumerate(names) for t, dtype in enumerate(TIMING_DTYPES)
            if (dtype == "bf16" and (name == STEP_NO_ATTENTION or name in kernel_names))
            or (dtype == "fp32" and name in fp32_kernels)]
    for r, name, t, dtype in tqdm(work, desc="training-step timings", disable=not progress):
        inner = None if name == STEP_NO_ATTENTION else kernels.get(name)
        attention = FormatAttention(inner, dtype)
        reason = attention.unavailable_reason(device)
        if reason:
            status[r, t] = f"unavailable: {reason}"
            continue
        try:
            cfg = GPTConfig(vocab_size=vocab_size, context=context, n_layer=n_layer, n_head=n_head, d_model=d_model,
                            attention=(attention,))
            model = GPT(cfg, seed=0).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step():
                with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                    _, loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            ms[r, t] = median_ms(step, warmup, repeats, device)
            status[r, t] = "ok"
        except Exception as exc:  # noqa: BLE001 -- recorded as data, never fatal
            status[r, t] = _failure(exc)
        finally:
            model = opt = None
            if cuda:
                torch.cuda.empty_cache()
    ds = xr.Dataset({"step_ms": (("step_kernel", "step_dtype"), ms),
                     "step_status": (("step_kernel", "step_dtype"), status.astype(str))},
                    coords={"step_kernel": names, "step_dtype": list(TIMING_DTYPES)})
    ds.attrs.update(step_n_layer=n_layer, step_d_model=d_model, step_n_head=n_head, step_context=context,
                    step_batch_size=batch_size, step_warmup=warmup, step_repeats=repeats)
    return ds

