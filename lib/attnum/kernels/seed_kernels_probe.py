"""The source documents' own kernels on a CUDA GPU, as data: FlashAttention-4 (``fa4``) and FlashInfer
(``flashinfer:prefill`` / ``flashinfer:decode`` / ``flashinfer:decode_paged``), whichever are installed in
this process.

    python -m attnum.kernels.seed_kernels_probe OUT.json [--kernels fa4,flashinfer:prefill,...] [--quick] [--jobs N]

Per kernel:
* ``accepts``: what it takes (dtype x head dim x mask: none, causal, boolean, additive), forward and,
  where it has one, backward: "ok" or the refusal's message (nothing falls back to another kernel);
* ``accuracy``: relative L2 error of the output against fp64 attention on the same (rounded) inputs, and
  the largest absolute error of its log-sum-exp, over N, head dim and causality (bf16, N(0, 1) inputs);
* ``fidelity`` (fa4): the share of output elements bit-identical to the emulator at FA4's own SM90 key tile,
  with the scale and max subtraction separate (``emulator:fa2_bf16:bk128``) and fused into one multiply-add
  (``:fused``, FlashAttention-3's forward as the report on its late-training blowup describes it);
* ``offset_backward`` (fa4, beside ``sdpa:flash`` and ``triton:fa2`` with and without GProj): the relative L2
  error of dQ, dK, dV against fp64 gradients as a common vector of norm |mu| is added to every key (exact
  attention ignores it: every score of a row moves by q . mu);
* ``sentinel`` (flashinfer): rows whose valid scaled logits all equal -L, for L across FlashInfer's former
  5e4 sentinel: without a mask (the right answer is the mean of V), with half the keys masked (masked keys
  carry V = 1, valid keys V = 0, so the output is the weight given to masked keys; right answer 0), and a
  fully masked row (what comes back: NaN, zeros or a value).
The file records the package versions, the masked-score sentinel read from FlashInfer's own header, the
GPU and torch. Written for one H200; every case is timed by nothing (no timings here).

``--jobs N`` probes up to N kernels at once, each in its own process (``OUT.json.<kernel>.part``, merged
into OUT.json in the order of ``--kernels`` and then removed). Most of a probe's time is JIT compilation
on the host (every new dtype and head dim is a new FlashInfer module, 10-40 s each), so kernels probed in
parallel overlap their compilations; the GPU work is small and its results do not depend on what else
runs (nothing is timed). A part whose process fails is kept beside OUT.json and named in the error.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

from . import fa4 as _fa4
from . import flashinfer as _flashinfer
from .registry import get

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOGIT_LEVELS = (1e2, 1e3, 1e4, 2e4, 3e4, 3.4e4, 3.6e4, 4e4, 4.8e4, 5.2e4, 6e4, 1e5, 1e6)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if float(b.norm()) > 0 else float((a - b).norm())


def _qkv(n, d, dtype, seed, device="cuda", batch=1, heads=4):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(batch, heads, n, d, generator=g).to(device=device, dtype=dtype) for _ in range(4)]


def _try(fn):
    try:
        fn()
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # a refusal: record the kernel's own message
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def accepts(kernel, quick=False) -> list[dict]:
    rows = []
    # quick: bf16 (what the sources ran) and fp32 (refused or not), head dims 64 and 128; every new dtype, head dim
    # and mask compiles a kernel variant (FA4's CuTe DSL, FlashInfer's JIT: 10-40 s each)
    for dtype in ("bf16", "fp32") if quick else tuple(DTYPES):
        for d in (64, 128) if quick else (64, 128, 256):
            q, k, v, do = _qkv(256, d, DTYPES[dtype], 0)
            n = q.shape[2]
            bool_bias = torch.zeros(n, n, device="cuda")
            bool_bias[:, n // 2:] = -math.inf
            additive = torch.randn(n, n, device="cuda") * 0.1
            for mask, kw in (("none", {}), ("causal", {"causal": True}), ("boolean", {"attn_bias": bool_bias}),
                             ("additive", {"attn_bias": additive})):
                row = {"dtype": dtype, "head_dim": d, "mask": mask,
                       "forward": _try(lambda: kernel.forward(q, k, v, **kw))}
                if kernel.has_backward:
                    row["backward"] = _try(lambda: kernel.backward(q, k, v, do, **kw))
                rows.append(row)
    return rows


def accuracy(kernel, quick=False) -> list[dict]:
    golden = get("golden")
    rows = []
    for n in (1024, 4096) if quick else (1024, 4096, 16384):
        for d in (64, 128):
            for causal in (False, True):
                q, k, v, _ = _qkv(n, d, torch.bfloat16, 1)
                row = {"n": n, "head_dim": d, "causal": causal, "dtype": "bf16"}
                try:
                    out, lse = kernel.forward(q, k, v, causal=causal)
                    gold, gold_lse = golden.forward(q, k, v, causal=causal)
                    row["rel_l2_err"] = _rel(out, gold)
                    if lse is not None:
                        row["lse_max_abs_err"] = float((lse.double() - gold_lse).abs().max())
                        # the other reading of the kernel's log-sum-exp (natural log <-> base 2): which one is right
                        other = lse.double() * math.log(2.0) if kernel.name == "fa4" else lse.double() / math.log(2.0)
                        row["lse_max_abs_err_other_base"] = float((other - gold_lse).abs().max())
                    row["status"] = "ok"
                except Exception as exc:
                    row["status"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
    return rows


def fidelity(kernel, quick=False) -> list[dict]:
    rows = []
    for n in (1024,) if quick else (1024, 2048):
        for d in (64, 128):
            for causal in (False, True):
                q, k, v, _ = _qkv(n, d, torch.bfloat16, 2, heads=2)
                out, _ = kernel.forward(q, k, v, causal=causal)
                row = {"n": n, "head_dim": d, "causal": causal}
                for name in ("emulator:fa2_bf16:bk128", "emulator:fa2_bf16:bk128:fused",
                             "emulator:fa2_bf16:bk64", "emulator:fa2_bf16:bk64:fused"):
                    emu, _ = get(name).forward(q, k, v, causal=causal)
                    row[name] = float((emu.to(out.dtype) == out).double().mean())
                rows.append(row)
    return rows


def offset_backward(names, quick=False) -> list[dict]:
    golden = get("golden")
    rows = []
    n, d = (1024, 128) if quick else (2048, 128)
    q, k, v, do = _qkv(n, d, torch.bfloat16, 3)
    g = torch.Generator(device="cpu").manual_seed(4)
    u = torch.randn(d, generator=g)
    u = (u / u.norm()).to("cuda")
    for mu in (0.0, 1.0, 4.0, 16.0, 64.0, 256.0):
        ks = (k.float() + mu * u).to(torch.bfloat16)
        gold = golden.backward(q, ks, v, do)
        for name in names:
            kernel = get(name)
            row = {"kernel": name, "mu_norm": mu, "n": n, "head_dim": d}
            reason = kernel.unavailable_reason("cuda")
            if reason:
                row["status"] = reason
            else:
                grads = kernel.backward(q, ks, v, do)
                row.update({f"{g_}_rel_l2_err": _rel(x, y) for g_, x, y in zip(("dq", "dk", "dv"), grads, gold)})
                row["status"] = "ok"
            rows.append(row)
    return rows


def sentinel(kernel) -> list[dict]:
    """Valid scaled logits all equal to -L (scale 1: q = e1, k_j = -L e1)."""
    rows = []
    n, d = 256, 64
    for level in LOGIT_LEVELS:
        q = torch.zeros(1, 2, n, d, device="cuda")
        q[..., 0] = 1.0
        k = torch.zeros(1, 2, n, d, device="cuda")
        k[..., 0] = -level
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
        actual = float(-k[0, 0, 0, 0].float())
        g = torch.Generator(device="cpu").manual_seed(5)
        v = torch.randn(1, 2, n, d, generator=g).to("cuda", torch.bfloat16)
        row = {"kernel": kernel.name, "logit_level": level, "logit_level_bf16": actual}
        # (a) no mask: every row uniform over its keys
        for case, kw in (("nomask", {}), ("causal", {"causal": True})):
            try:
                out, _ = kernel.forward(q, k, v, scale=1.0, **kw)
                gold, _ = get("golden").forward(q, k, v, scale=1.0, **kw)
                row[f"{case}_rel_l2_err"] = _rel(out.float().nan_to_num(nan=1e30), gold)
                row[f"{case}_nan_rows"] = int(out.isnan().any(-1).sum())
            except Exception as exc:
                row[f"{case}_status"] = f"{type(exc).__name__}: {exc}"[:300]
        if kernel.name == "flashinfer:prefill":
            # (b) half the keys masked; masked keys' raw logit 0 (they would win if given any weight), V = 1
            km = k.clone()
            km[..., n // 2:, 0] = 0.0
            vm = torch.zeros_like(v)
            vm[..., n // 2:, :] = 1.0
            bias = torch.zeros(n, n, device="cuda")
            bias[:, n // 2:] = -math.inf
            try:
                out, _ = kernel.forward(q, km, vm, scale=1.0, attn_bias=bias)
                row["masked_weight_max"] = float(out.float().nan_to_num(nan=math.inf).max())
                row["masked_weight_median_row"] = float(out.float()[..., 0].nan_to_num(nan=math.inf).median())
                row["masked_nan_rows"] = int(out.isnan().any(-1).sum())
            except Exception as exc:
                row["masked_status"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    if kernel.name == "flashinfer:prefill":
        q, k, v, _ = _qkv(256, 64, torch.bfloat16, 6, heads=2)
        bias = torch.zeros(256, 256, device="cuda")
        bias[:8] = -math.inf  # the first eight query rows see no key
        out, _ = kernel.forward(q, k, v, attn_bias=bias)
        rows.append({"kernel": kernel.name, "case": "fully_masked_rows",
                     "nan_rows": int(out[..., :8, :].isnan().any(-1).sum()),
                     "zero_rows": int((out[..., :8, :] == 0).all(-1).sum()),
                     "rows": int(out[..., :8, :].shape[-2] * out.shape[1]),
                     "max_abs_value": float(out[..., :8, :].float().nan_to_num(nan=0).abs().max())})
    return rows


HEADER_KEYS = ("device", "capability", "torch", "cuda", "fa4_version", "flashinfer_version", "flashinfer_mask_sentinel")


def merge_records(parts: list[dict], names: list[str]) -> dict:
    """One probe record from per-kernel records of one machine: the header of the first, the kernels in the
    order of ``names``. Parts that disagree on a header field (another GPU or package version) are refused,
    as is a name no part probed or a kernel in two parts."""
    if not parts:
        raise ValueError("merge_records: no records to merge")
    for key in HEADER_KEYS:
        seen = {json.dumps(p.get(key)) for p in parts}
        if len(seen) > 1:
            raise ValueError(f"merge_records: the parts disagree on {key!r}: {sorted(seen)}")
    found: dict[str, dict] = {}
    for p in parts:
        for name, entry in p["kernels"].items():
            if name in found:
                raise ValueError(f"merge_records: kernel {name!r} is in more than one part")
            found[name] = entry
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"merge_records: no part probed {', '.join(missing)}")
    merged = {k: v for k, v in parts[0].items() if k != "kernels"}
    merged["kernels"] = {n: found[n] for n in names}
    return merged


def part_path(out: str, name: str) -> str:
    """Where ``--jobs`` puts one kernel's record: beside OUT, named by the kernel (':' -> '_')."""
    return f"{out}.{name.replace(':', '_')}.part"


def _parallel(out: str, names: list[str], jobs: int, quick: bool) -> int:
    """Each kernel in its own process, at most ``jobs`` at once, then one merged file."""
    pending, running, failed = list(names), [], []
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            cmd = [sys.executable, "-m", "attnum.kernels.seed_kernels_probe", part_path(out, name), "--kernels", name]
            running.append((name, subprocess.Popen(cmd + (["--quick"] if quick else []))))
        time.sleep(1.0)
        for item in [r for r in running if r[1].poll() is not None]:
            running.remove(item)
            if item[1].returncode != 0:
                failed.append(f"{item[0]} (exit status {item[1].returncode})")
    if failed:
        print(f"error: {', '.join(failed)} failed; the parts are kept beside {out}", file=sys.stderr)
        return 1
    parts = []
    for name in names:
        with open(part_path(out, name)) as fh:
            parts.append(json.load(fh))
    record = merge_records(parts, names)
    record["jobs"] = jobs
    with open(out, "w") as fh:
        json.dump(record, fh, indent=1)
    for name in names:
        os.remove(part_path(out, name))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attnum.kernels.seed_kernels_probe", description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--kernels", default="fa4,flashinfer:prefill,flashinfer:decode,flashinfer:decode_paged")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="kernels probed at once, each in its own process")
    args = ap.parse_args(argv)
    names = [s for s in args.kernels.split(",") if s]
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    if not names or len(set(names)) != len(names):
        print(f"error: --kernels must name each kernel once, got {args.kernels!r}", file=sys.stderr)
        return 2
    for name in names:
        try:
            get(name)
        except (KeyError, ValueError) as exc:
            print(f"error: --kernels: {exc}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    if args.jobs > 1 and len(names) > 1:
        return _parallel(args.out, names, args.jobs, args.quick)
    record = {"what": "the source documents' own kernels (attnum.kernels.seed_kernels_probe)",
              "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "fa4_version": _fa4.version(), "flashinfer_version": _flashinfer.version(),
              "flashinfer_mask_sentinel": _flashinfer.mask_sentinel(), "kernels": {}}
    for name in names:
        kernel = get(name)
        reason = kernel.unavailable_reason("cuda")
        entry = record["kernels"][name] = {"runs_as": kernel.runs_as(), "unavailable": reason}
        if reason:
            print(f"{name}: unavailable: {reason}")
            continue
        start = time.perf_counter()
        entry["accepts"] = accepts(kernel, args.quick)
        entry["accuracy"] = accuracy(kernel, args.quick)
        if name == "fa4":
            entry["fidelity"] = fidelity(kernel, args.quick)
            entry["offset_backward"] = offset_backward(["fa4", "sdpa:flash", "triton:fa2", "triton:fa2:gproj_dq"],
                                                       args.quick)
        if name.startswith("flashinfer"):
            entry["sentinel"] = sentinel(kernel)
        entry["probe_seconds"] = time.perf_counter() - start
        ok = sum(r["forward"] == "ok" for r in entry["accepts"])
        print(f"{name}: {ok}/{len(entry['accepts'])} cases accepted; accuracy",
              [(r["n"], r["head_dim"], r["causal"], f"{r.get('rel_l2_err', float('nan')):.2e}") for r in entry["accuracy"]])
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
