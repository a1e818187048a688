"""Launch-configuration sweep of our Triton FlashAttention-2 kernel on a GPU (the data behind
``triton_fa2.default_config``).

    python -m attnum.kernels.triton_fa2_tune OUT.json [--budget-s=240] [--n=8192]
    python -m attnum.kernels.triton_fa2_tune OUT.json --same-numerics=D:KEY=VALUE,...

The second form asks whether a configuration (the default's fields, changed by KEY=VALUE) gives
bit for bit the default's output, log-sum-exp and gradients (every GProj mode, causal and not, N
a multiple of no tile) on head dim D: ``torch.equal`` per tensor, written to OUT.json.

For head dim 64 and 128, causal and not, bf16, one shape of 2^18 tokens (batch x 16 heads x N), it
times the forward alone over tile sizes (``fwd_m`` x ``fwd_n``), warps and pipeline stages, and the
backward (dQ kernel then dK/dV kernel, ``triton_fa2.backward``) over the backward tiles, warps and
stages, with CUDA events (median of repeats after warm-up), beside ``sdpa:flash`` (FlashAttention-2
through PyTorch, pinned to that one backend) on the same tensors. Every configuration is also checked
against PyTorch's math backend on a small shape (output and dQ max |difference|), so a fast but wrong
configuration shows as such. A configuration Triton cannot compile or launch (shared memory, registers)
is recorded with its error; nothing is skipped silently. The JSON is rewritten after every case, and
the sweep stops cleanly when ``--budget-s`` is spent, so a run cut short keeps what it measured.

Tile sizes change which partial sums are rounded together, so a configuration other than the
default is a different kernel numerically (the emulator matches it only at the same tiles); warps and
stages change only the schedule, never the arithmetic.
"""
from __future__ import annotations

import itertools
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from ..timing import median_ms

TOKENS = 2 ** 18
HEADS = 16
FWD_TILES = ((128, 64), (128, 128), (64, 64), (128, 32))
BWD_TILES = ((128, 64, 128, 64), (64, 64, 64, 64), (128, 32, 128, 32))
WARPS = (4, 8)
FWD_STAGES = (2, 3, 4)
BWD_STAGES = (1, 2, 3)


def _check_small(tfa, config, d: int, causal: bool) -> dict:
    """max |out - ref|, max |dq - ref| on (2, 3, 300, d) bf16, ref = SDPA math in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 300, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = sdpa(q32, k32, v32, is_causal=causal)
    (ref_dq,) = torch.autograd.grad(ref, (q32,), do.float())
    out, lse = tfa.forward(q, k, v, causal=causal, config=config)
    dq, _, _ = tfa.backward(q, k, v, out, lse, do, causal=causal, config=config)
    return {"max_abs_diff_out": (out.float() - ref).abs().max().item(),
            "max_abs_diff_dq": (dq.float() - ref_dq).abs().max().item()}


def _sdpa_flash(q, k, v, do, causal: bool, warmup: int, reps: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            def fwd():
                with torch.no_grad():
                    sdpa(q, k, v, is_causal=causal)
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out = sdpa(qg, kg, vg, is_causal=causal)

            def bwd():
                torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
            return {"status": "ok", "fwd_ms": median_ms(fwd, warmup, reps, "cuda"),
                    "bwd_ms": median_ms(bwd, warmup, reps, "cuda")}
    except Exception as exc:  # noqa: BLE001
        return {"status": "refused", "error": f"{type(exc).__name__}: {exc}"[:2000]}


def main(out_path, budget_s: float = 240.0, n: int = 8192, warmup: int = 2, reps: int = 7) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_tune needs a CUDA GPU")
    from . import triton_fa2 as tfa
    from .triton_fa2_bench import environment

    reason = tfa.unavailable_reason("cuda")
    if reason:
        raise SystemExit(f"triton_fa2 is unavailable here: {reason}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "n": n, "heads": HEADS, "batch": TOKENS // n // HEADS,
              "dtype": "bf16", "warmup": warmup, "repeats": reps, "budget_s": budget_s,
              "default_configs": {str(d): vars(tfa.default_config(d)) for d in (64, 128)},
              "sdpa_flash": [], "cases": [], "stopped_by_budget": False}
    t0 = time.time()

    def save():
        result["elapsed_s"] = round(time.time() - t0, 1)
        out_path.write_text(json.dumps(result, indent=1))

    shape = (TOKENS // n // HEADS, HEADS, n)
    for d, causal in itertools.product((128, 64), (False, True)):
        q, k, v, do = (torch.randn(*shape, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        result["sdpa_flash"].append({"d": d, "causal": causal, **_sdpa_flash(q, k, v, do, causal, warmup, reps)})
        base = tfa.default_config(d)
        out, lse = tfa.forward(q, k, v, causal=causal, config=base)
        grid = [("fwd", dict(fwd_m=m, fwd_n=nn, num_warps=w, fwd_stages=s))
                for (m, nn), w, s in itertools.product(FWD_TILES, WARPS, FWD_STAGES)]
        grid += [("bwd", dict(dq_m=a, dq_n=b, kv_n=c, kv_m=e, num_warps=w, bwd_stages=s))
                 for (a, b, c, e), w, s in itertools.product(BWD_TILES, WARPS, BWD_STAGES)]
        grid += [("bwd_gproj_dq", dict(dq_m=a, dq_n=b, kv_n=c, kv_m=e, num_warps=w, bwd_stages=s))
                 for (a, b, c, e), w, s in itertools.product(BWD_TILES, WARPS, BWD_STAGES)]
        for part, change in grid:
            if time.time() - t0 > budget_s:
                result["stopped_by_budget"] = True
                save()
                return result
            cfg = tfa.BlockConfig(**{**vars(base), **change})
            rec = {"d": d, "causal": causal, "part": part, "config": vars(cfg), "status": "ok"}
            try:
                rec.update(_check_small(tfa, cfg, d, causal))
                if part == "fwd":
                    def call():
                        tfa.forward(q, k, v, causal=causal, config=cfg)
                else:
                    gproj = "dq" if part == "bwd_gproj_dq" else "off"

                    def call():
                        tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, config=cfg)
                rec["ms"] = median_ms(call, warmup, reps, "cuda")
            except Exception as exc:  # noqa: BLE001
                rec["status"] = "error"
                rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
                rec["traceback"] = traceback.format_exc()[-2000:]
            finally:
                torch.cuda.empty_cache()
            rec["elapsed_s"] = round(time.time() - t0, 1)
            result["cases"].append(rec)
            save()
            print(f"[{rec['elapsed_s']:6.1f}s] d={d} causal={causal!s:5s} {part:12s} {change} "
                  f"{rec['status']} {rec.get('ms', float('nan')):.3f} ms", flush=True)
    save()
    return result


def same_numerics(out_path, head_dim: int, change: dict) -> dict:
    """Bit-for-bit comparison of ``default_config(head_dim)`` and that config with ``change`` applied."""
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_tune needs a CUDA GPU")
    from . import triton_fa2 as tfa

    base = tfa.default_config(head_dim)
    other = tfa.BlockConfig(**{**vars(base), **change})
    cases = []
    for n, causal, gproj in itertools.product((300, 1000, 4096), (False, True), tfa.GPROJ_MODES):
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, do = (torch.randn(2, 4, n, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
                       for _ in range(4))
        res = {}
        for name, cfg in (("base", base), ("other", other)):
            out, lse = tfa.forward(q, k, v, causal=causal, config=cfg)
            dq, dk, dv = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, config=cfg)
            res[name] = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        cases.append({"n": n, "causal": causal, "gproj": gproj,
                      **{f"equal_{t}": bool(torch.equal(res["base"][t], res["other"][t])) for t in res["base"]},
                      "max_abs_diff_dq": (res["base"]["dq"].float() - res["other"]["dq"].float()).abs().max().item()})
    result = {"head_dim": head_dim, "base": vars(base), "other": vars(other), "cases": cases,
              "all_equal": all(all(v for key, v in c.items() if key.startswith("equal_")) for c in cases)}
    Path(out_path).write_text(json.dumps(result, indent=1))
    print(f"d={head_dim} {change}: bit-identical in every case: {result['all_equal']}", flush=True)
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    if len(args) != 1 or set(opts) - {"--budget-s", "--n", "--same-numerics"}:
        raise SystemExit("usage: python -m attnum.kernels.triton_fa2_tune OUT.json [--budget-s=240] [--n=8192]"
                         " | OUT.json --same-numerics=D:KEY=VALUE,...")
    if "--same-numerics" in opts:
        dim, _, pairs = opts["--same-numerics"].partition(":")
        same_numerics(args[0], int(dim), {key: int(value) for key, value in
                                          (pair.split("=", 1) for pair in pairs.split(",") if pair)})
    else:
        main(args[0], budget_s=float(opts.get("--budget-s", 240)), n=int(opts.get("--n", 8192)))
