"""Where GProj's time goes in our Triton dQ kernel: timing-only ablations (GPU only).

    python -m attnum.kernels.triton_fa2_ablate OUT.json [--n=8192] [--dims=64,128] [--causal=0,1] [--rounds=5]

GProj "dq" adds two pieces of work to the dQ kernel (``triton_fa2``'s docstring, "GProj"): the row sum
``r_i = sum_j dS~_ij`` and the product ``(P~ K)_i``. To see what each costs, this times the dQ kernel alone
(``backward(..., _only="dq")``) in copies of ``triton_fa2``'s source with one piece, the other, or both deleted
(``ABLATIONS``: each is a statement replaced by ``pass``), beside the kernel as it is, with the row sum in registers
and as a product (``BlockConfig.dq_rsum_mma``), and with GProj off. The copies compute wrong gradients: they exist
for timing only, are written to a temporary folder, and are never imported by anything else. A copy whose
statement is no longer in the source is refused (the source changed: the ablation must be rewritten), so a
silently unablated copy cannot be timed as an ablated one.

Every variant is timed round-robin for R rounds (each a median of repeats after warm-up, CUDA events) on one set
of bf16 tensors per shape (batch x 16 heads x N, 2^18 tokens), at the default configuration for GProj "dq" (the
tables' tiles, launch and switches) with ``dq_rsum_mma`` off except where a variant sets it; ``ms`` is the median
of the rounds, ``ms_rounds`` all of them. The JSON is rewritten after every shape.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..timing import median_ms

TOKENS = 2 ** 18
HEADS = 16
ROW_SUM = "r += tl.sum(ds_lo.to(tl.float32), 1)"
PK = "pk = _gproj_pk(p, k, pk, FP32_BWD, F32_DOT)"
ABLATIONS = {"no_row_sum": (ROW_SUM,), "no_pk": (PK,), "neither": (ROW_SUM, PK)}
"""Variant -> the statements of ``triton_fa2``'s source replaced by ``pass`` (every occurrence: P~ K is issued in
one of two places, by the overlap switch)."""


def ablated_source(source: str, statements) -> str:
    """``source`` with every occurrence of each statement replaced by ``pass``; refuses a statement not present."""
    for statement in statements:
        if statement not in source:
            raise ValueError(f"triton_fa2's source no longer holds {statement!r}: rewrite the ablation")
        source = source.replace(statement, "pass")
    return source


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def main(out_path, n: int = 8192, dims=(64, 128), causals=(False, True), rounds: int = 5, warmup: int = 2,
         reps: int = 7) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_ablate needs a CUDA GPU")
    if rounds < 1 or n < 1 or TOKENS % n or (TOKENS // n) % HEADS:
        raise SystemExit(f"need rounds >= 1 and N dividing {TOKENS // HEADS}, got rounds={rounds}, n={n}")
    from . import triton_fa2 as tfa
    from .triton_fa2_bench import environment

    reason = tfa.unavailable_reason("cuda")
    if reason:
        raise SystemExit(f"triton_fa2 is unavailable here: {reason}")
    source = Path(tfa.__file__).read_text()
    result = {"environment": environment(), "n": n, "heads": HEADS, "batch": TOKENS // n // HEADS, "dtype": "bf16",
              "rounds": rounds, "warmup": warmup, "repeats": reps, "ablations": {k: list(v) for k, v in
                                                                              ABLATIONS.items()}, "shapes": []}
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        modules = {}
        for name, statements in ABLATIONS.items():
            path = Path(tmp) / f"triton_fa2_{name}.py"
            path.write_text(ablated_source(source, statements))
            modules[name] = _load(path, f"_attnum_triton_fa2_{name}")
        for d in dims:
            for causal in causals:
                shape = (TOKENS // n // HEADS, HEADS, n, d)
                q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                out, lse = tfa.forward(q, k, v, causal=causal)
                base = dataclasses.replace(tfa.default_config(d, causal=causal, gproj="dq"), dq_rsum_mma=False)
                off = tfa.default_config(d, causal=causal, gproj="off")

                def call(module, gproj, cfg):
                    return lambda: module.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, config=cfg,
                                                   _only="dq")

                calls = {"gproj_off": call(tfa, "off", off), "gproj_dq": call(tfa, "dq", base),
                         "gproj_dq_rsum_mma": call(tfa, "dq", dataclasses.replace(base, dq_rsum_mma=True))}
                calls.update({name: call(module, "dq", base) for name, module in modules.items()})
                times = {name: [] for name in calls}
                for _ in range(rounds):
                    for name, fn in calls.items():
                        times[name].append(round(median_ms(fn, warmup, reps, "cuda"), 4))
                rec = {"d": d, "causal": causal, "config": vars(base),
                       "ms": {name: float(statistics.median(ts)) for name, ts in times.items()}, "ms_rounds": times}
                result["shapes"].append(rec)
                result["elapsed_s"] = round(time.time() - t0, 1)
                out_path.write_text(json.dumps(result, indent=1))
                print(f"d={d} causal={causal}: " + ", ".join(f"{k} {v:.3f}" for k, v in rec["ms"].items()) + " ms",
                      flush=True)
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    if len(args) != 1 or set(opts) - {"--n", "--dims", "--causal", "--rounds"}:
        raise SystemExit("usage: python -m attnum.kernels.triton_fa2_ablate OUT.json [--n=8192] [--dims=64,128] "
                         "[--causal=0,1] [--rounds=5]")
    main(args[0], n=int(opts.get("--n", 8192)), dims=tuple(int(x) for x in opts.get("--dims", "64,128").split(",")),
         causals=tuple(bool(int(x)) for x in opts.get("--causal", "0,1").split(",")),
         rounds=int(opts.get("--rounds", 5)))
