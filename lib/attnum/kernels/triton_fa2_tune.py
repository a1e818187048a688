"""Launch-configuration sweep of our Triton FlashAttention-2 kernel on a GPU (the data behind
``triton_fa2.default_config``), and the picker that turns its JSON into the tuned table.

    python -m attnum.kernels.triton_fa2_tune OUT.json [--budget-s=240] [--n=8192] [--dims=128,64]
                                             [--causal=0,1] [--parts=fwd,dq,kv,dq_gproj,kv_gproj,dq_fp32,kv_fp32]
    python -m attnum.kernels.triton_fa2_tune OUT.json --parts=tma,order,overlap,exp2 [--dims=128,64] [--causal=0,1]
                                             [--base=KEY=VALUE,...] [--rounds=1]
    python -m attnum.kernels.triton_fa2_tune OUT.json --same-numerics=D:KEY=VALUE,...
    python -m attnum.kernels.triton_fa2_tune OUT.json --split-check=D
    python -m attnum.kernels.triton_fa2_tune pick TUNE.json [TUNE2.json ...]

Sweep. For each head dim and causality (bf16, one shape of 2^18 tokens: batch x 16 heads x N), it
times each of the three kernels *alone* over a short candidate list (``CANDIDATES``), so the search
is a sum over kernels, not a product: the forward (``fwd``: tiles ``fwd_m`` x ``fwd_n``, warps,
stages), the dQ kernel (``dq``: ``dq_m`` x ``dq_n``) and the dK/dV kernel (``kv``: ``kv_n`` x
``kv_m``) with GProj off. Then, at the fastest GProj-off tile of that kernel so far (GProj never gets
tiles of its own), warps and stages again with GProj on: ``dq_gproj`` (the dQ kernel under ``"dq"``,
which is also ``"dq_dk"``'s dQ kernel but for one store of r) and ``kv_gproj`` (the dK/dV kernel under
``"dq_dk"``). Last, ``dq_fp32`` / ``kv_fp32``: the FP32 backward's kernels over a few tiles, with the
fp32 dots in ``"ieee"`` and in ``"tf32x3"``. Each kernel is timed with CUDA events (median of repeats
after warm-up; ``backward(..., _only=...)`` launches one backward kernel, plus the D preprocessing,
a few microseconds, the same for every candidate). ``sdpa:flash`` is timed on the same tensors.

Every configuration is also checked on a small shape (2 x 3 heads x 512, a multiple of every tile,
so the check runs the same compiled variant as the timing) against PyTorch's math backend in fp32:
max |difference| of out, dQ, dK, dV, and ``correct`` when each is within ``CHECK_REL`` of the
reference's largest value (a coarse gate against a broken configuration, not an accuracy test). A
configuration Triton cannot compile or launch (shared memory, registers) is recorded with its
error; nothing is skipped silently. The JSON is rewritten after every case, and the sweep stops
cleanly when ``--budget-s`` is spent (``stopped_by_budget``), so a run cut short keeps what it
measured. The order is per (d, causal): fwd, dq, kv, dq_gproj, kv_gproj; the FP32 parts come after
every shape's others.

``tma`` (not among the default parts; ``--parts=tma``): each of the three kernels (GProj off) at the
default configuration of the shape, timed with its own TMA switch off and on, two cases per kernel
recorded as parts ``fwd_tma``, ``dq_tma``, ``kv_tma`` (``change`` ``{"fwd_tma": false}`` and
``{"fwd_tma": true}``, and so on),
each with the small-shape check. On a GPU below compute capability 9.0 the tma-on cases are recorded
with the kernel's refusal as their error. ``pick`` reports the on/off times per kernel in ``notes`` and
``"tma"``, and in ``"tma_flags"`` each kernel's own switch (``fwd_tma``, ``dq_tma``, ``kv_tma``): on where
its time with TMA loads is at most ``TMA_GAIN`` of its time without. The switches are measured at the
default tiles, so they belong to those tiles: ``triton_fa2_bench --tables-from`` merges them into the
existing ``TUNED_CONFIGS`` entries, and ``format_tables`` prints them as comments beside the tables.

``order`` (not among the default parts; ``--parts=order``, causal shapes only): the forward and the dQ
kernel at the default configuration with ``heavy_first`` off and on (parts ``fwd_order``, ``dq_order``);
``pick`` reports them in ``"order"`` and the switch in ``"order_flags"``.

``overlap`` (not among the default parts; ``--parts=overlap``): where the backward kernels issue an accumulating
product (``BlockConfig.dq_overlap``, ``kv_overlap``; ``triton_fa2``'s docstring, "Overlap"), crossed with the
kernel's TMA switch, since in the TTGIR the overlap only exists where the loop loads through TMA: four
configurations a kernel, timed round-robin like the switch parts, the first being the switches as the table has
them. Parts ``dq_overlap`` (the dQ kernel under GProj ``"dq"``, the only mode it changes), ``kv_overlap`` (the dK/dV
kernel, GProj off) and ``kvg_overlap`` (the dK/dV kernel under ``"dq_dk"``), each at the table's configuration for
its GProj mode (``TUNED_GPROJ_LAUNCH`` included). ``pick`` keeps the table's switches unless another of the four
took at most ``OVERLAP_GAIN`` of their time, then the fastest: GProj off's choice in ``"overlap_flags"`` (merged
into ``TUNED_CONFIGS``), the GProj parts' in ``"gproj_schedule"`` (merged into ``TUNED_GPROJ_LAUNCH``: ``"dq"``'s
into both GProj modes, ``"kvg"``'s into ``"dq_dk"``), every time in ``"overlap"`` and ``notes``.

``exp2`` (not among the default parts; ``--parts=exp2``): each kernel at the table's configuration with its own
exp2 switch (``BlockConfig.fwd_exp2``, ``dq_exp2``, ``kv_exp2``; ``triton_fa2``'s docstring, "exp2") off and on,
alternately like the switch parts: parts ``fwd_exp2``, ``dq_exp2``, ``kv_exp2`` (GProj off) and ``dqg_exp2`` (the dQ
kernel under GProj ``"dq"``, which shares the dQ kernel's switch: GProj never gets arithmetic of its own). ``pick``
reports each kernel's times in ``"exp2"`` and ``notes`` and its choice in ``"exp2_flags"`` (on where exp2 took at
most ``EXP2_GAIN`` of the time without), printed as a comment, never merged into the tables: the switch changes the
arithmetic, so adopting it is not a speed decision alone (the GPU tests run first).

``rsum`` (not among the default parts; ``--parts=rsum``): GProj's dQ kernel (under ``"dq"``) with its row sum r in
registers and as a product with a column of ones (``BlockConfig.dq_rsum_mma``; ``triton_fa2``'s docstring, "GProj's
row sum"), each at the table's launch and at every ``GPROJ_LAUNCH``, all timed round-robin (part ``dqg_rsum``).
``pick`` reports each side's fastest in ``"rsum"`` and ``notes``; never merged: the product sums r in another order.

``--rounds=R`` (default 1): the ``tma``, ``order`` and ``overlap`` parts time a switch's two sides alternately, off then
on, R times over (each round a median of the repeats), and record every round (``ms_rounds``) and their
median (``ms``): a switch worth a few percent is smaller than one median's run-to-run spread. With R > 1 the
``fwd``, ``dq``, ``kv``, ``dq_gproj`` and ``kv_gproj`` parts time their candidates the same way, round-robin
(the switch parts always do, once with R = 1); the FP32 parts time one median per case.

``--base=KEY=VALUE,...`` (same syntax as ``--same-numerics``): BlockConfig fields applied over the default
configuration of every case before the case's own change (recorded as ``base_change``), e.g. the GProj
launches timed with TMA loads on.

On a fresh H200 one case costs about one Triton compilation (~1-3 s), so
a full sweep of both head dims is ~2x the 240 s budget: run it as two calls (``--dims=128`` and
``--dims=64``) and give both JSONs to ``pick``.

``pick``: the fastest correct configuration per (d, causal) and kernel, printed as the Python
tables ``TUNED_CONFIGS``, ``TUNED_GPROJ_LAUNCH`` and ``TUNED_FP32_BWD`` of ``triton_fa2`` (paste
them there), with the measured times as comments. ``pick_configs`` is the pure function behind it.

``--same-numerics``: does a configuration (the default's fields, changed by KEY=VALUE: integers,
``None`` for the per-kernel fields, 0/1 or false/true for ``tma``) give bit for bit the default's
output, log-sum-exp and gradients (every GProj mode, causal and not, N a multiple of no tile and of
every tile) on head dim D: ``torch.equal`` per tensor, written to OUT.json. ``--split-check``: the
same comparison between the kernel as it runs (unmasked blocks split from the masked ones, masks
dropped when N is a multiple of the tiles) and its reference path (every block masked,
``_split=False``), at the default config, N a multiple of the tiles and not.

Tile sizes change which partial sums are rounded together, so a configuration other than the
default is a different kernel numerically (the emulator matches it only at the same tiles); warps and
stages change only the schedule, never the arithmetic.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from ..timing import median_ms

TOKENS = 2 ** 18
HEADS = 16
CHECK_N = 512
CHECK_REL = 2.0 ** -4
PARTS = ("fwd", "dq", "kv", "dq_gproj", "kv_gproj", "dq_fp32", "kv_fp32", "tma", "order", "overlap", "exp2", "rsum")
DEFAULT_PARTS = PARTS[:-5]  # tma, order, overlap, exp2 and rsum only when asked for
# The ``exp2`` part: (part, GProj mode it is timed under); each kernel at the table's configuration for that mode.
EXP2_PARTS = (("fwd_exp2", "off"), ("dq_exp2", "off"), ("kv_exp2", "off"), ("dqg_exp2", "dq"))
# The ``overlap`` part: (part, GProj mode it is timed under, the kernel's TMA and overlap fields); its four
# configurations are the product of the two switches, the first (both as the table has them) the baseline.
OVERLAP_PARTS = (("dq_overlap", "dq", ("dq_tma", "dq_overlap")), ("kv_overlap", "off", ("kv_tma", "kv_overlap")),
                 ("kvg_overlap", "dq_dk", ("kv_tma", "kv_overlap")))
# (tile 1, tile 2, warps, stages): fwd (fwd_m, fwd_n), dq (dq_m, dq_n), kv (kv_n, kv_m), per head dim
CANDIDATES = {
    "fwd": {128: ((64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2),
                  (128, 128, 8, 2), (64, 128, 4, 2), (128, 32, 8, 4)),
            64: ((128, 64, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3),
                 (64, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 2))},
    "dq": {128: ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3), (64, 64, 8, 2)),
           64: ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
                (128, 128, 8, 2), (64, 128, 4, 2))},
    "kv": {128: ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3), (64, 64, 8, 2)),
           64: ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
                (128, 32, 4, 3), (128, 128, 8, 2))},
    "fp32": {128: ((64, 32, 4, 1), (64, 32, 8, 1), (64, 32, 4, 2)),
             64: ((64, 32, 4, 1), (64, 64, 4, 1), (64, 32, 4, 2))},
}
# (warps, stages) tried with GProj on, at the fastest GProj-off tile of that kernel
GPROJ_LAUNCH = ((4, 2), (4, 3), (8, 2), (8, 3), (4, 1))
TILE_KEYS = {"fwd": ("fwd_m", "fwd_n"), "dq": ("dq_m", "dq_n"), "kv": ("kv_n", "kv_m")}
LAUNCH_KEYS = {"fwd": ("fwd_warps", "fwd_stages"), "dq": ("dq_warps", "dq_stages"), "kv": ("kv_warps", "kv_stages")}


def _kernel_of(part: str) -> str:
    kernel = part.split("_")[0]
    return {"kvg": "kv", "dqg": "dq"}.get(kernel, kernel)


def _change(part: str, cand) -> dict:
    """BlockConfig fields of one candidate (tile 1, tile 2, warps, stages) of ``part``."""
    kernel = _kernel_of(part)
    a, b, warps, stages = cand
    return {**dict(zip(TILE_KEYS[kernel], (a, b))), **dict(zip(LAUNCH_KEYS[kernel], (warps, stages)))}


def _part_options(part: str) -> dict:
    """(gproj, fp32_backward, fp32_dot list) a part is timed under."""
    return {"fwd": ("off", False, ("ieee",)), "dq": ("off", False, ("ieee",)), "kv": ("off", False, ("ieee",)),
            "dq_gproj": ("dq", False, ("ieee",)), "kv_gproj": ("dq_dk", False, ("ieee",)),
            "dq_fp32": ("off", True, ("ieee", "tf32x3")), "kv_fp32": ("off", True, ("ieee", "tf32x3")),
            "fwd_tma": ("off", False, ("ieee",)), "dq_tma": ("off", False, ("ieee",)),
            "kv_tma": ("off", False, ("ieee",)), "fwd_order": ("off", False, ("ieee",)),
            "dq_order": ("off", False, ("ieee",)),
            **{name: (gproj, False, ("ieee",)) for name, gproj, _ in OVERLAP_PARTS},
            **{name: (gproj, False, ("ieee",)) for name, gproj in EXP2_PARTS},
            "dqg_rsum": ("dq", False, ("ieee",))}[part]


def _check_small(tfa, config, d: int, causal: bool, gproj: str, fp32_backward: bool, fp32_dot: str) -> dict:
    """max |x - ref| for out, dq, dk, dv on (2, 3, CHECK_N, d) bf16, ref = SDPA math in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, CHECK_N, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = sdpa(q32, k32, v32, is_causal=causal)
    refs = (ref, *torch.autograd.grad(ref, (q32, k32, v32), do.float()))
    out, lse = tfa.forward(q, k, v, causal=causal, config=config)
    got = (out, *tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                              config=config, fp32_dot=fp32_dot))
    rec, correct = {}, True
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, refs):
        diff = (x.float() - r).abs().max().item()
        rec[f"max_abs_diff_{name}"] = diff
        correct = correct and diff == diff and diff <= CHECK_REL * r.abs().max().item()
    rec["correct"] = bool(correct)
    return rec


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


def _best(cases, d: int, causal: bool, part: str, fp32_dot: str = "ieee", tiles: dict | None = None):
    """The fastest ok and correct case of ``part`` (at ``tiles`` when given), or None."""
    good = [c for c in cases if c.get("d") == d and c.get("causal") == causal and c.get("part") == part
            and c.get("status") == "ok" and c.get("correct", False) and c.get("fp32_dot", "ieee") == fp32_dot
            and isinstance(c.get("ms"), (int, float))
            and (tiles is None or all(c["config"][key] == value for key, value in tiles.items()))]
    return min(good, key=lambda c: c["ms"]) if good else None


def main(out_path, budget_s: float = 240.0, n: int = 8192, warmup: int = 2, reps: int = 7,
         dims=(128, 64), causals=(False, True), parts=DEFAULT_PARTS, base_change: dict | None = None,
         rounds: int = 1) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_tune needs a CUDA GPU")
    from . import triton_fa2 as tfa
    from .triton_fa2_bench import environment

    reason = tfa.unavailable_reason("cuda")
    if reason:
        raise SystemExit(f"triton_fa2 is unavailable here: {reason}")
    if not isinstance(rounds, int) or rounds < 1:
        raise SystemExit(f"--rounds must be an integer >= 1, got {rounds!r}")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; allowed: {PARTS}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "n": n, "heads": HEADS, "batch": TOKENS // n // HEADS,
              "dtype": "bf16", "warmup": warmup, "repeats": reps, "budget_s": budget_s, "parts": list(parts),
              "base_change": dict(base_change or {}), "rounds": rounds,
              "check": {"shape": [2, 3, CHECK_N, "d"], "rel": CHECK_REL},
              "default_configs": {f"{d},{int(c)}": vars(tfa.default_config(d, causal=c))
                                  for d in dims for c in causals},
              "sdpa_flash": [], "cases": [], "stopped_by_budget": False}
    t0 = time.time()

    def save():
        result["elapsed_s"] = round(time.time() - t0, 1)
        out_path.write_text(json.dumps(result, indent=1))

    shape = (TOKENS // n // HEADS, HEADS, n)
    tensors = {}

    def inputs(d, causal):
        if (d, causal) not in tensors:
            tensors.clear()
            torch.cuda.empty_cache()
            q, k, v, do = (torch.randn(*shape, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            out, lse = tfa.forward(q, k, v, causal=causal, config=tfa.default_config(d, causal=causal))
            tensors[d, causal] = (q, k, v, do, out, lse)
        return tensors[d, causal]

    def prepare(d, causal, part, change, fp32_dot="ieee"):
        """One case's record (its config and small-shape check) and the call that times it (None on error)."""
        gproj, fp32_backward, _ = _part_options(part)
        # GProj's own tuned launch (TUNED_GPROJ_LAUNCH) under the GProj parts; their candidates set warps and
        # stages whole, so only the overlap part's cases differ by it
        base = tfa.default_config(d, fp32_backward, causal=causal, gproj=gproj)
        cfg = tfa.BlockConfig(**{**vars(base), **(base_change or {}), **change})
        rec = {"d": d, "causal": causal, "part": part, "gproj": gproj, "fp32_backward": fp32_backward,
               "fp32_dot": fp32_dot, "change": change, "config": vars(cfg), "status": "ok"}
        call = None
        try:
            q, k, v, do, out, lse = inputs(d, causal)
            rec.update(_check_small(tfa, cfg, d, causal, gproj, fp32_backward, fp32_dot))
            if _kernel_of(part) == "fwd":  # "fwd", "fwd_tma", "fwd_order": the forward kernel alone
                def call():
                    tfa.forward(q, k, v, causal=causal, config=cfg)
            else:
                def call():
                    tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                                 config=cfg, fp32_dot=fp32_dot, _only=_kernel_of(part))
        except Exception as exc:  # noqa: BLE001
            failed(rec, exc)
        return rec, call

    def failed(rec, exc):
        rec["status"] = "error"
        rec["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        rec["traceback"] = traceback.format_exc()[-2000:]

    def record(rec):
        torch.cuda.empty_cache()
        rec["elapsed_s"] = round(time.time() - t0, 1)
        result["cases"].append(rec)
        save()
        spread = f" rounds {rec['ms_rounds']}" if "ms_rounds" in rec else ""
        print(f"[{rec['elapsed_s']:6.1f}s] d={rec['d']} causal={rec['causal']!s:5s} {rec['part']:9s} "
              f"{rec['fp32_dot']:6s} {rec['change']} {rec['status']} {rec.get('ms', float('nan')):.3f} ms"
              f"{spread} correct={rec.get('correct')}", flush=True)

    def over_budget():
        if time.time() - t0 > budget_s:
            result["stopped_by_budget"] = True
            save()
            return True
        return False

    def run(d, causal, part, change, fp32_dot="ieee"):
        """Time one case and record it; False once the budget is spent."""
        if over_budget():
            return False
        rec, call = prepare(d, causal, part, change, fp32_dot)
        if call is not None:
            try:
                rec["ms"] = median_ms(call, warmup, reps, "cuda")
            except Exception as exc:  # noqa: BLE001
                failed(rec, exc)
        record(rec)
        return True

    def run_group(d, causal, part, changes):
        """The configurations ``changes`` of one part: with ``rounds`` > 1 timed round-robin, as
        ``run_rounds``; else one after another, as ``run``. False once the budget is spent."""
        if rounds > 1:
            return run_rounds(d, causal, part, changes)
        return all(run(d, causal, part, change) for change in changes)

    def run_rounds(d, causal, part, changes):
        """The configurations ``changes`` (a switch off and on, or a part's candidates) timed round-robin for
        ``rounds`` rounds (each a median of ``reps``), so that a drift of the GPU's clocks reaches every
        configuration alike; ``ms`` is the median of the rounds, ``ms_rounds`` all of them. False once the
        budget is spent (checked before the group, which then runs whole)."""
        if over_budget():
            return False
        pairs = [prepare(d, causal, part, change) for change in changes]
        for _ in range(rounds):
            for rec, call in pairs:
                if call is not None and rec["status"] == "ok":
                    try:
                        rec.setdefault("ms_rounds", []).append(round(median_ms(call, warmup, reps, "cuda"), 4))
                    except Exception as exc:  # noqa: BLE001
                        failed(rec, exc)
        for rec, _ in pairs:
            if rec["status"] == "ok" and rec.get("ms_rounds"):
                rec["ms"] = float(statistics.median(rec["ms_rounds"]))
            record(rec)
        return True

    shapes = list(itertools.product(dims, causals))
    for d, causal in shapes:
        if any(p in parts for p in ("fwd", "dq", "kv")):
            q, k, v, do, _, _ = inputs(d, causal)
            result["sdpa_flash"].append({"d": d, "causal": causal, **_sdpa_flash(q, k, v, do, causal, warmup, reps)})
            save()
        for part in ("fwd", "dq", "kv"):
            if part in parts:
                if not run_group(d, causal, part, [_change(part, cand)
                                                   for cand in CANDIDATES[part][d if d in CANDIDATES[part] else 128]]):
                    return result
        for part in ("dq_gproj", "kv_gproj"):
            if part not in parts:
                continue
            kernel = _kernel_of(part)
            best = _best(result["cases"], d, causal, kernel)
            base = tfa.default_config(d, causal=causal)
            tiles = ({key: best["config"][key] for key in TILE_KEYS[kernel]} if best else
                     {key: getattr(base, key) for key in TILE_KEYS[kernel]})
            if not run_group(d, causal, part, [{**tiles, **dict(zip(LAUNCH_KEYS[kernel], (warps, stages)))}
                                               for warps, stages in GPROJ_LAUNCH]):
                return result
        if "tma" in parts:
            for kernel in ("fwd", "dq", "kv"):
                # the kernel's own switch, so that a table entry's switches never decide "off"
                if not run_rounds(d, causal, f"{kernel}_tma", ({f"{kernel}_tma": False}, {f"{kernel}_tma": True})):
                    return result
        if "order" in parts and causal:  # heavy_first only changes causal runs
            for kernel in ("fwd", "dq"):
                if not run_rounds(d, causal, f"{kernel}_order", ({"heavy_first": False}, {"heavy_first": True})):
                    return result
        if "overlap" in parts:
            for part, gproj, (tma_key, overlap_key) in OVERLAP_PARTS:
                table = tfa.default_config(d, causal=causal, gproj=gproj)
                first = (table.uses_tma(_kernel_of(part)), getattr(table, overlap_key))
                combos = [first] + [c for c in itertools.product((False, True), repeat=2) if c != first]
                if not run_rounds(d, causal, part, [{tma_key: t, overlap_key: o} for t, o in combos]):
                    return result
        if "exp2" in parts:
            for part, _ in EXP2_PARTS:
                key = f"{_kernel_of(part)}_exp2"
                if not run_rounds(d, causal, part, ({key: False}, {key: True})):
                    return result
        if "rsum" in parts:
            # GProj's dQ kernel with its row sum in registers and as a product (BlockConfig.dq_rsum_mma), at its
            # table launch and at each GProj launch candidate (the product changes the kernel's register use)
            launches = [{}] + [dict(zip(LAUNCH_KEYS["dq"], launch)) for launch in GPROJ_LAUNCH]
            changes = [{**launch, "dq_rsum_mma": on} for launch in launches for on in (False, True)]
            if not run_rounds(d, causal, "dqg_rsum", changes):
                return result
    for d, causal in shapes:
        for part in ("dq_fp32", "kv_fp32"):
            if part not in parts:
                continue
            for cand, fp32_dot in itertools.product(CANDIDATES["fp32"][d if d in CANDIDATES["fp32"] else 128],
                                                    ("ieee", "tf32x3")):
                if not run(d, causal, part, _change(part, cand), fp32_dot):
                    return result
    save()
    return result


# -- picking the table from sweep JSONs (pure: tested on CPU with a synthetic JSON) ------------------
def pick_configs(results) -> dict:
    """From one or more sweep results (dicts as ``main`` writes them), the fastest ok and correct
    configuration per (d, causal): ``{"configs": {(d, causal): fields}, "gproj_launch":
    {(d, causal, gproj): fields}, "fp32_bwd": {(d, causal): fields}, "notes": [...]}``. ``configs``
    needs all three of fwd, dq, kv for a shape (else the shape is left out, with a note); GProj's
    warps/stages are kept only at the chosen GProj-off tiles and only where they differ from GProj
    off's; the FP32 backward's tiles from the ``"ieee"`` cases (tf32x3's best goes to ``notes``). The
    ``tma`` part's on/off times go to ``"tma"`` (``{(d, causal): {kernel: {"off": ms, "on": ms}}}``) and
    ``notes``, and each kernel's switch to ``"tma_flags"`` (``{(d, causal): {"fwd_tma": bool, ...}}``, on
    where TMA loads took at most ``TMA_GAIN`` of the time without), never into ``configs``. The ``order`` part
    likewise: ``"order"`` (``{(d, True): {"fwd"|"dq": {"off": ms, "on": ms}}}``) and ``"order_flags"``
    (``{(d, True): {"heavy_first": bool}}``, on where the forward's and the dQ kernel's summed time with it is
    at most ``ORDER_GAIN`` of the sum without; one switch serves both kernels)."""
    if isinstance(results, dict):
        results = [results]
    cases = [c for res in results for c in res.get("cases", [])]
    stamps = sorted({res.get("environment", {}).get("time_utc", "?") for res in results})
    source = f"h200 tune {', '.join(stamps)}, N={results[0].get('n', '?') if results else '?'}"
    shapes = sorted({(c["d"], c["causal"]) for c in cases if "d" in c and "causal" in c})
    # the GProj-off configuration each sweep ran under (the table at its commit), for sweeps of GProj parts only
    table = {}
    for res in results:
        for key, fields in res.get("default_configs", {}).items():
            d_text, _, causal_text = key.partition(",")
            table[int(d_text), bool(int(causal_text))] = fields
    picked = {"configs": {}, "gproj_launch": {}, "gproj_launch_same": [], "fp32_bwd": {}, "tma": {}, "tma_flags": {},
              "order": {},
              "order_flags": {}, "overlap": {}, "overlap_flags": {}, "gproj_schedule": {}, "exp2": {},
              "exp2_flags": {}, "rsum": {}, "notes": []}
    for d, causal in shapes:
        best = {kernel: _best(cases, d, causal, kernel) for kernel in ("fwd", "dq", "kv")}
        missing = [kernel for kernel, case in best.items() if case is None]
        if missing:
            picked["notes"].append(f"d={d} causal={causal}: no correct measurement of {missing}; not tuned")
            if (d, causal) in table:  # GProj's launches against the table the sweep ran under
                fields = {key: value for key, value in table[d, causal].items()
                          if key in TILE_KEYS["dq"] + TILE_KEYS["kv"]}
                for kernel in ("dq", "kv"):
                    fields.update(dict(zip(LAUNCH_KEYS[kernel], _launch_of(table[d, causal], kernel))))
                _pick_gproj(cases, d, causal, fields, {}, picked, "the sweep's table")
            continue
        fields, times = {}, {}
        for kernel, case in best.items():
            cfg = case["config"]
            fields.update({key: cfg[key] for key in TILE_KEYS[kernel]})
            warps, stages = _launch_of(cfg, kernel)
            fields.update(dict(zip(LAUNCH_KEYS[kernel], (warps, stages))))
            times[kernel] = round(case["ms"], 3)
        fields["num_warps"] = fields["fwd_warps"]
        fields["bwd_stages"] = fields["dq_stages"]
        fields["source"] = f"{source}; ms fwd {times['fwd']}, dq {times['dq']}, kv {times['kv']}"
        picked["configs"][d, causal] = fields
        _pick_gproj(cases, d, causal, fields, times, picked, "this sweep")
        fp32 = {}
        for kernel in ("dq", "kv"):
            for dot in ("ieee", "tf32x3"):
                g = _best(cases, d, causal, f"{kernel}_fp32", fp32_dot=dot)
                if g is None:
                    continue
                cfg = g["config"]
                if dot == "ieee":
                    fp32.update({key: cfg[key] for key in TILE_KEYS[kernel]})
                    fp32.update(dict(zip(LAUNCH_KEYS[kernel], _launch_of(cfg, kernel))))
                picked["notes"].append(f"d={d} causal={causal}: {kernel}_fp32 {dot} best {round(g['ms'], 3)} ms at "
                                       f"{ {key: cfg[key] for key in TILE_KEYS[kernel]} } "
                                       f"{dict(zip(LAUNCH_KEYS[kernel], _launch_of(cfg, kernel)))}")
        if all(key in fp32 for key in TILE_KEYS["dq"] + TILE_KEYS["kv"]):
            picked["fp32_bwd"][d, causal] = {**fp32, "source": source}
    for d, causal in shapes:
        tma = {}
        for kernel in ("fwd", "dq", "kv"):
            times = _switch_times(cases, d, causal, f"{kernel}_tma", lambda cfg, k=kernel: _tma_on(cfg, k),
                                  picked["notes"], f"{kernel} at the default tiles, tma")
            if times:
                tma[kernel] = times
        if tma:
            picked["tma"][d, causal] = tma
            # a kernel's own switch where both were measured: on when it saves at least 1 - TMA_GAIN
            flags = {f"{kernel}_tma": bool(times["on"] <= TMA_GAIN * times["off"])
                     for kernel, times in tma.items() if "on" in times and "off" in times}
            if flags:
                picked["tma_flags"][d, causal] = flags
    for d, causal in shapes:
        order = {}
        for kernel in ("fwd", "dq"):
            times = _switch_times(cases, d, causal, f"{kernel}_order",
                                  lambda cfg: bool(cfg.get("heavy_first", False)), picked["notes"],
                                  f"{kernel} heavy_first")
            if times:
                order[kernel] = times
        if order:
            picked["order"][d, causal] = order
            # one switch for both query-outer kernels: on when their summed time falls by 1 - ORDER_GAIN
            if all("on" in t and "off" in t for t in order.values()) and len(order) == 2:
                on = sum(t["on"] for t in order.values())
                off = sum(t["off"] for t in order.values())
                picked["order_flags"][d, causal] = {"heavy_first": bool(on <= ORDER_GAIN * off)}
    for d, causal in shapes:
        for part, gproj, keys in OVERLAP_PARTS:
            chosen = _overlap_choice(cases, d, causal, part, keys, picked["notes"])
            if chosen is None:
                continue
            picked["overlap"].setdefault((d, causal), {})[part] = chosen
            if gproj == "off":
                picked["overlap_flags"].setdefault((d, causal), {}).update(chosen["fields"])
            else:
                for mode in (("dq", "dq_dk") if gproj == "dq" else ("dq_dk",)):
                    picked["gproj_schedule"].setdefault((d, causal, mode), {}).update(chosen["fields"])
    for d, causal in shapes:
        exp2 = {}
        for part, _ in EXP2_PARTS:
            kernel = _kernel_of(part)
            times = _switch_times(cases, d, causal, part, lambda cfg, k=kernel: _exp2_on(cfg, k), picked["notes"],
                                  f"{part.replace('_exp2', '')} exp2")
            if times:
                exp2[part] = times
        if exp2:
            picked["exp2"][d, causal] = exp2
            # the GProj-off kernels decide: the dQ kernel's switch is GProj's too (dqg_exp2 is reported only)
            flags = {f"{_kernel_of(part)}_exp2": bool(times["on"] <= EXP2_GAIN * times["off"])
                     for part, times in exp2.items() if part != "dqg_exp2" and "on" in times and "off" in times}
            if flags:
                picked["exp2_flags"][d, causal] = flags
    for d, causal in shapes:
        # GProj's row sum: each side's fastest launch (reported only: the product changes the order of r's sum)
        times = _switch_times(cases, d, causal, "dqg_rsum", lambda cfg: bool(cfg.get("dq_rsum_mma", False)),
                              picked["notes"], "GProj dQ row sum as a product")
        if times:
            picked["rsum"][d, causal] = times
    return picked


def _pick_gproj(cases, d: int, causal: bool, fields: dict, times: dict, picked: dict, where: str) -> None:
    """GProj's warps/stages at one shape (the fastest ``dq_gproj``/``kv_gproj`` case at the GProj-off tiles of
    ``fields``) into ``picked["gproj_launch"]`` where they differ from GProj off's launch in ``fields``, else
    the (d, causal, kernel) into ``picked["gproj_launch_same"]``; a note either way."""
    for kernel, part, modes in (("dq", "dq_gproj", ("dq", "dq_dk")), ("kv", "kv_gproj", ("dq_dk",))):
        tiles = {key: fields[key] for key in TILE_KEYS[kernel]}
        g = _best(cases, d, causal, part, tiles=tiles)
        if g is None:
            continue
        launch = dict(zip(LAUNCH_KEYS[kernel], _launch_of(g["config"], kernel)))
        off = {key: fields[key] for key in LAUNCH_KEYS[kernel]}
        if launch != off:
            for mode in modes:
                picked["gproj_launch"].setdefault((d, causal, mode), {}).update(launch)
        else:
            picked["gproj_launch_same"].append((d, causal, kernel))
        off_ms = f"{times[kernel]} ms " if kernel in times else ""
        others = ", ".join(f"{_launch_of(c['config'], kernel)} {round(c['ms'], 3)}" for c in cases
                           if c.get("d") == d and c.get("causal") == causal and c.get("part") == part
                           and c.get("status") == "ok" and isinstance(c.get("ms"), (int, float)))
        picked["notes"].append(f"d={d} causal={causal}: {part} best {round(g['ms'], 3)} ms at {launch}"
                               f"{_rounds_note(g)} (GProj off {off_ms}at {off}, {where}); (warps, stages) ms: {others}")


def _rounds_note(case: dict) -> str:
    """" (median of R rounds)" for a case timed in rounds, else ""."""
    return f" (median of {len(case['ms_rounds'])} rounds)" if case.get("ms_rounds") else ""


def _overlap_choice(cases, d: int, causal: bool, part: str, keys, notes: list) -> dict | None:
    """The ``overlap`` part's choice at one shape: its baseline (the first case recorded: the switches as the table
    had them) unless another of the four took at most ``OVERLAP_GAIN`` of the baseline's time, then the fastest.
    ``{"fields": {tma_key: bool, overlap_key: bool}, "ms": {"tma=0 overlap=1": ms, ...}, "baseline": label}``, or
    None when the baseline was not measured; appends a note with every time and the paired-round wins."""
    good = [c for c in cases if c.get("d") == d and c.get("causal") == causal and c.get("part") == part
            and c.get("status") == "ok" and c.get("correct", False) and isinstance(c.get("ms"), (int, float))]
    if not good:
        return None

    def label(case):
        return " ".join(f"{key.split('_')[1]}={int(bool(case['change'][key]))}" for key in keys)

    baseline = good[0]
    fastest = min(good, key=lambda c: c["ms"])
    chosen = fastest if fastest["ms"] <= OVERLAP_GAIN * baseline["ms"] else baseline
    wins = ""
    if chosen is not baseline:
        wins = _paired_wins({"off": baseline, "on": chosen}).replace(", on faster", ", faster than the baseline")
    notes.append(f"d={d} causal={causal}: {part} " + ", ".join(f"{label(c)} {round(c['ms'], 3)} ms" for c in good)
                 + f"; baseline {label(baseline)}, chosen {label(chosen)}{wins}")
    return {"fields": {key: bool(chosen["change"][key]) for key in keys},
            "ms": {label(c): round(c["ms"], 3) for c in good}, "baseline": label(baseline)}


def _switch_times(cases, d: int, causal: bool, part: str, is_on, notes: list, what: str) -> dict:
    """``{"off": ms, "on": ms}`` of a switch part (``tma`` or ``order``) at one shape: each side's fastest ok and
    correct case, ``is_on(config)`` telling the sides apart; appends the note ``what off X ms, on Y ms`` (with the
    paired-round count where there is one) when either side was measured."""
    times, sides = {}, {}
    for label, on in (("off", False), ("on", True)):
        good = [c for c in cases if c.get("d") == d and c.get("causal") == causal and c.get("part") == part
                and c.get("status") == "ok" and c.get("correct", False) and isinstance(c.get("ms"), (int, float))
                and is_on(c["config"]) == on]
        if good:
            sides[label] = min(good, key=lambda c: c["ms"])
            times[label] = round(sides[label]["ms"], 3)
    if times:
        notes.append(f"d={d} causal={causal}: {what} off {times.get('off', 'not measured')} ms, on "
                     f"{times.get('on', 'not measured')} ms{_paired_wins(sides)}")
    return times


def _paired_wins(sides: dict) -> str:
    """", on faster in K of R paired rounds" when the off and on cases both carry ``ms_rounds`` of one length
    (``--rounds``: round i of each side ran back to back), else ""."""
    off, on = (sides.get(label, {}).get("ms_rounds") for label in ("off", "on"))
    if not off or not on or len(off) != len(on):
        return ""
    return f", on faster in {sum(b < a for a, b in zip(off, on))} of {len(on)} paired rounds"


def _switch_on(cfg: dict, kernel: str, switch: str) -> bool:
    """Whether a recorded config has ``switch`` (``"tma"``, ``"exp2"``) on for ``kernel``: its own field, else the
    shared one (configs recorded before the per-kernel fields, like the first sweep of 2026-12-03, have only the
    shared one, or none: off)."""
    own = cfg.get(f"{kernel}_{switch}")
    return bool(cfg.get(switch, False) if own is None else own)


def _tma_on(cfg: dict, kernel: str) -> bool:
    """Whether a recorded config loads ``kernel``'s tiles through TMA."""
    return _switch_on(cfg, kernel, "tma")


def _exp2_on(cfg: dict, kernel: str) -> bool:
    """Whether a recorded config computes ``kernel``'s exponentials as exp2."""
    return _switch_on(cfg, kernel, "exp2")


TMA_GAIN = 0.99
"""``pick_configs`` turns a kernel's TMA loads on when its time with them is at most this fraction of its time
without (the same kernel, tiles and launch; the loads change no arithmetic, ``--same-numerics=D:tma=1``)."""


OVERLAP_GAIN = 0.99
"""``pick_configs`` moves a kernel off its table's TMA/overlap switches when another of the overlap part's four
configurations took at most this fraction of the table's time (both switches change no arithmetic)."""


ORDER_GAIN = 0.99
"""``pick_configs`` turns ``heavy_first`` on when the forward's and the dQ kernel's summed time with it is at most
this fraction of the sum without (the launch order changes no arithmetic)."""


EXP2_GAIN = 0.99
"""``pick_configs`` reports a kernel's exp2 switch as on (``"exp2_flags"``) when its time with exp2 is at most this
fraction of its time without; reported only, never merged (exp2 changes the arithmetic)."""


def _launch_of(cfg: dict, kernel: str) -> tuple[int, int]:
    """(warps, stages) a recorded config gives ``kernel`` (the shared fields where its own is None)."""
    warps_key, stages_key = LAUNCH_KEYS[kernel]
    warps = cfg.get(warps_key) or cfg["num_warps"]
    stages = cfg.get(stages_key) or (cfg["fwd_stages"] if kernel == "fwd" else cfg["bwd_stages"])
    return warps, stages


def format_tables(picked: dict) -> str:
    """The Python source of ``TUNED_CONFIGS``, ``TUNED_GPROJ_LAUNCH``, ``TUNED_FP32_BWD`` (notes as comments)."""
    lines = [f"# {note}" for note in picked["notes"]]
    for name, key, table in (("TUNED_CONFIGS", "tuple[int, bool]", picked["configs"]),
                             ("TUNED_GPROJ_LAUNCH", "tuple[int, bool, str]", picked["gproj_launch"]),
                             ("TUNED_FP32_BWD", "tuple[int, bool]", picked["fp32_bwd"])):
        lines.append(f"{name}: dict[{key}, dict] = {{")
        for shape, fields in sorted(table.items()):
            lines.append(f"    {shape!r}: {fields!r},")
        lines.append("}")
    for shape, flags in sorted(picked.get("tma_flags", {}).items()):
        lines.append(f"# TMA loads for {shape!r} (merged into its TUNED_CONFIGS entry): {flags!r}")
    for shape, flags in sorted(picked.get("order_flags", {}).items()):
        lines.append(f"# launch order for {shape!r} (merged into its TUNED_CONFIGS entry): {flags!r}")
    for shape, flags in sorted(picked.get("overlap_flags", {}).items()):
        lines.append(f"# TMA and overlap for {shape!r} (merged into its TUNED_CONFIGS entry): {flags!r}")
    for key, flags in sorted(picked.get("gproj_schedule", {}).items()):
        lines.append(f"# TMA and overlap for {key!r} (merged into its TUNED_GPROJ_LAUNCH entry): {flags!r}")
    for shape, flags in sorted(picked.get("exp2_flags", {}).items()):
        lines.append(f"# exp2 for {shape!r} (changes the arithmetic: merged by hand, after the GPU tests): {flags!r}")
    return "\n".join(lines)


def same_numerics(out_path, head_dim: int, change: dict) -> dict:
    """Bit-for-bit comparison of ``default_config(head_dim)`` and that config with ``change`` applied."""
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_tune needs a CUDA GPU")
    from . import triton_fa2 as tfa

    base = tfa.default_config(head_dim)
    other = tfa.BlockConfig(**{**vars(base), **change})
    result = _compare(tfa, head_dim, (("base", dict(config=base)), ("other", dict(config=other))), (300, 1000, 4096))
    result.update(base=vars(base), other=vars(other))
    Path(out_path).write_text(json.dumps(result, indent=1))
    print(f"d={head_dim} {change}: bit-identical in every case: {result['all_equal']}", flush=True)
    return result


def split_check(out_path, head_dim: int) -> dict:
    """Bit-for-bit comparison of the kernel as it runs and its every-block-masked reference path."""
    if not torch.cuda.is_available():
        raise SystemExit("triton_fa2_tune needs a CUDA GPU")
    from . import triton_fa2 as tfa

    result = _compare(tfa, head_dim, (("base", dict(_split=True)), ("other", dict(_split=False))), (300, 1000, 4096))
    result["compared"] = "default config per (d, causal): _split=True (as run) against _split=False (reference)"
    Path(out_path).write_text(json.dumps(result, indent=1))
    print(f"d={head_dim} split against every block masked: bit-identical in every case: {result['all_equal']}",
          flush=True)
    return result


def _compare(tfa, head_dim: int, variants, ns) -> dict:
    cases = []
    for n, causal, gproj in itertools.product(ns, (False, True), tfa.GPROJ_MODES):
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, do = (torch.randn(2, 4, n, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
                       for _ in range(4))
        res = {}
        for name, opts in variants:
            fwd_opts = {key: value for key, value in opts.items() if key in ("config", "_split")}
            out, lse = tfa.forward(q, k, v, causal=causal, **fwd_opts)
            dq, dk, dv = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, **opts)
            res[name] = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        cases.append({"n": n, "causal": causal, "gproj": gproj,
                      **{f"equal_{t}": bool(torch.equal(res["base"][t], res["other"][t])) for t in res["base"]},
                      "max_abs_diff_dq": (res["base"]["dq"].float() - res["other"]["dq"].float()).abs().max().item()})
    return {"head_dim": head_dim, "cases": cases,
            "all_equal": all(all(v for key, v in c.items() if key.startswith("equal_")) for c in cases)}


def parse_change(pairs: str) -> dict:
    """``KEY=VALUE,...`` of ``--same-numerics`` as BlockConfig fields: integers; ``None`` for the fields
    that may be None; ``tma`` and the per-kernel ``*_tma`` switches from 0/1 or false/true. Unknown keys are
    refused."""
    from . import triton_fa2 as tfa

    fields = {f.name: f for f in dataclasses.fields(tfa.BlockConfig)}
    change = {}
    for pair in (p for p in pairs.split(",") if p):
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in fields:
            raise SystemExit(f"--same-numerics / --base: {pair!r} is not KEY=VALUE with KEY a BlockConfig field "
                             f"({', '.join(fields)})")
        if isinstance(fields[key].default, bool) or key.endswith(("_tma", "_overlap", "_exp2", "_mma")):
            if value == "None" and fields[key].default is None:
                change[key] = None
                continue
            if value.lower() not in ("0", "1", "false", "true"):
                raise SystemExit(f"--same-numerics / --base: {key} takes 0/1 or false/true, got {value!r}")
            change[key] = value.lower() in ("1", "true")
        elif value == "None" and fields[key].default is None:
            change[key] = None
        else:
            change[key] = int(value)
    return change


def _rounds(text: str) -> int:
    """``--rounds``: a positive integer, refused before any work otherwise."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise SystemExit(f"--rounds must be an integer >= 1, got {text!r}")
    return value


USAGE = ("usage: python -m attnum.kernels.triton_fa2_tune OUT.json [--budget-s=240] [--n=8192] [--dims=128,64]"
         " [--causal=0,1] [--parts=...] [--base=KEY=VALUE,...] [--rounds=R]"
         " | OUT.json --same-numerics=D:KEY=VALUE,... | OUT.json --split-check=D | pick TUNE.json [TUNE2.json ...]")

if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    if args[:1] == ["pick"]:
        if len(args) < 2 or opts:
            raise SystemExit(USAGE)
        print(format_tables(pick_configs([json.loads(Path(p).read_text()) for p in args[1:]])))
    elif len(args) != 1 or set(opts) - {"--budget-s", "--n", "--same-numerics", "--split-check", "--dims",
                                        "--causal", "--parts", "--base", "--rounds"}:
        raise SystemExit(USAGE)
    elif "--same-numerics" in opts:
        dim, _, pairs = opts["--same-numerics"].partition(":")
        same_numerics(args[0], int(dim), parse_change(pairs))
    elif "--split-check" in opts:
        split_check(args[0], int(opts["--split-check"]))
    else:
        main(args[0], budget_s=float(opts.get("--budget-s", 240)), n=int(opts.get("--n", 8192)),
             dims=tuple(int(x) for x in opts.get("--dims", "128,64").split(",")),
             causals=tuple(bool(int(x)) for x in opts.get("--causal", "0,1").split(",")),
             parts=tuple(opts.get("--parts", ",".join(DEFAULT_PARTS)).split(",")),
             base_change=parse_change(opts.get("--base", "")), rounds=_rounds(opts.get("--rounds", "1")))
