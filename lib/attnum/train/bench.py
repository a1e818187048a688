"""The cost of each attention choice in a whole training step: the byte-level GPT trained with each, step
time median over steps, beside the time of attention alone at the same shape.

For each context N (``contexts``) the batch is ``tokens_per_step // N`` sequences, so every N
trains the same number of tokens per step and attention's share grows with N (its FLOPs per
token grow ~N, the linear layers' do not: forward FLOPs of causal attention / linear layers ~
N / (12 d_model), 0.11 at N = 1024 and 0.44 at N = 4096 for d_model = 768). All models of one N
are built first from the same seed; then ``rounds`` rounds each run ``steps`` timed steps of every
model in turn (after ``warmup`` untimed ones), so a clock drift during the benchmark spreads over
all choices instead of falling on the last. Each step is timed with CUDA events (synchronised);
the result is the median over the rounds' steps, with the 10th and 90th percentiles.

Status as data: a kernel that cannot run here (Triton without a GPU), refuses the shape, or runs
out of memory is recorded with that status and no times. ``overhead_vs_<base>`` is the step time
over the base's step time minus 1 at the same N (the +4.7% for GProj and +33.4% for FP32 attention of the
report on late-training gradient blowup in BF16 FlashAttention-3, the project's seed 004, docs/sources.md, are
such overheads: the source's claims, measured on their setup, not ours).
"""
from __future__ import annotations

import gc
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from .. import ncio
from ..timing import Timer
from . import diag
from ..model import GPT, AttentionChoice, GPTConfig

# fa4 (FlashAttention-4, where flash-attn-4 is installed; recorded "unavailable: ..." where it is not) is the
# fastest kernel on an H200, so its training throughput says how many tokens a device minute buys
DEFAULT_KERNELS = ("sdpa:flash", "sdpa:cudnn", "sdpa:math", "fa4", "triton:fa2", "triton:fa2:gproj_dq",
                   "triton:fa2:gproj_dq_dk", "triton:fa2:fp32_bwd", "triton:fa2:fp32_bwd:bf16x3")
BASES = ("sdpa:flash@bf16", "triton:fa2@bf16")


def gpu_clocks(device) -> dict:
    """The GPU's clocks and power state from nvidia-smi, where there is one (else empty)."""
    if torch.device(device).type != "cuda":
        return {}
    fields = "name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,pstate"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"nvidia_smi": f"unavailable: {exc}"}
    return {"nvidia_smi_fields": fields, "nvidia_smi": out.stdout.strip()}


def _step(model, opt, x, y):
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def bench(kernels=DEFAULT_KERNELS, *, n_layer=12, n_head=12, d_model=768, contexts=(1024, 4096),
          tokens_per_step=8192, warmup=3, steps=8, rounds=3, device="cuda", lr=3e-4, seed=0,
          progress=print) -> dict:
    """Step times of every attention choice at every context; a JSON-able dict."""
    device = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    choices = [AttentionChoice.parse(k) for k in kernels]
    bad = [n for n in contexts if tokens_per_step // n < 1]
    if bad:
        raise ValueError(f"tokens_per_step {tokens_per_step} is smaller than the contexts {bad}")
    config = dict(kernels=[c.label for c in choices], n_layer=n_layer, n_head=n_head, d_model=d_model,
                  contexts=list(contexts), tokens_per_step=tokens_per_step, warmup=warmup, steps=steps,
                  rounds=rounds, device=str(device), lr=lr, seed=seed, optimizer="AdamW (fused on CUDA), clip 1.0",
                  amp="bf16 autocast for the matmuls; attention in the choice's dtype")
    t0 = time.monotonic()
    results = []
    for n in contexts:
        batch = tokens_per_step // n
        gen = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randint(0, 256, (batch, n + 1), generator=gen).to(device)
        x, y = x[:, :-1], x[:, 1:]
        runs = []
        for choice in choices:
            rec = {"context": n, "batch": batch, "attention": choice.label, "kernel": choice.kernel_name,
                   "dtype": choice.dtype, "status": "ok", "step_s": []}
            reason = choice.unavailable_reason(device)
            if reason:
                rec["status"] = f"unavailable: {reason}"
                runs.append((rec, None, None))
                continue
            model = GPT(GPTConfig.byte_lm(choice, n_layer=n_layer, n_head=n_head, d_model=d_model, context=n),
                        seed=seed).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                                    fused=device.type == "cuda")
            rec["attention_alone"] = diag.time_attention(choice, (batch, n_head, n, d_model // n_head), device)
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                for _ in range(max(1, warmup)):
                    rec["loss_first"] = float(_step(model, opt, x, y))
                if device.type == "cuda":  # the step's own peak, beyond what was held before it
                    rec["peak_step_memory_gib"] = (torch.cuda.max_memory_allocated(device) - before) / 2 ** 30
            except torch.OutOfMemoryError:
                rec["status"] = "out of memory"
            except Exception as exc:  # a refusal (e.g. a backend that does not take the shape): data
                rec["status"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
            runs.append((rec, model, opt) if rec["status"] == "ok" else (rec, None, None))
            if rec["status"] != "ok":
                del model, opt
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        timer = Timer(device)
        for _ in range(rounds):
            for rec, model, opt in runs:
                if model is None or rec["status"] != "ok":
                    continue
                try:
                    for _ in range(steps):
                        start = timer.mark()
                        loss = _step(model, opt, x, y)
                        rec["step_s"].append(timer.seconds(start, timer.mark()))
                    rec["loss_last"] = float(loss)
                except torch.OutOfMemoryError:
                    rec["status"] = "out of memory"
                except Exception as exc:
                    rec["status"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        for rec, model, opt in runs:
            times = np.array(rec.pop("step_s"), dtype=np.float64)
            if rec["status"] == "ok" and times.size:
                rec.update(step_s_median=float(np.median(times)), step_s_p10=float(np.quantile(times, 0.1)),
                           step_s_p90=float(np.quantile(times, 0.9)), timed_steps=int(times.size),
                           tokens_per_s=batch * n / float(np.median(times)))
                alone = rec.get("attention_alone", {})
                if alone.get("status") == "ok":
                    rec["attention_share"] = n_layer * alone["fwd_bwd_s"] / rec["step_s_median"]
            results.append(rec)
            progress(f"[bench] N {n} {rec['attention']}: {rec['status']}"
                     + (f", {rec['step_s_median'] * 1e3:.1f} ms/step" if "step_s_median" in rec else ""))
        del runs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for rec in results:
        for base in BASES:
            ref = next((r for r in results if r["context"] == rec["context"] and r["attention"] == base
                        and "step_s_median" in r), None)
            if ref is not None and "step_s_median" in rec:
                rec[f"overhead_vs_{base.split('@')[0].replace(':', '_')}"] = \
                    rec["step_s_median"] / ref["step_s_median"] - 1
    versions = {"python": platform.python_version(), **ncio.accelerator_versions(str(device))}
    return {"what": "training-step cost of each attention choice (attnum.train.bench)",
            "config": config, "results": results, "versions": versions,
            "device": ncio.device_description(str(device)), "clocks": gpu_clocks(device),
            **ncio.git_state(), "wall_s": time.monotonic() - t0,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write(result: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1))  # NaN written as NaN (Python's json reads it back)
    tmp.replace(path)
    return path
