"""Speed and memory benchmarks (``make bench``); numbers go in the notes, never into tests.

Each case runs in a fresh subprocess so that its peak resident memory is its
own: the peak is read from ``VmHWM`` after resetting it through
``/proc/self/clear_refs`` once the inputs exist, so it measures the operation
alone. Wall times are the median of ``repeats`` runs after a small warm-up.

Targets (issue "Foundation and study 01"):
  * emulator at N = 16384, d = 64, 4 heads, fp32: peak memory <= 1/8 of the
    naive reference's, time <= 3x the naive reference's;
  * the golden reference at N = 65536 runs without running out of memory;
  * each study's default tier within its budget and smoke tier under 30 s.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STUDY_BUDGETS_S = {"length_scaling": 180, "extreme_inputs": 180, "wasserstein_weight_drift": 240,
                   "late_training_gradient_blowup": 240, "gproj_fix": 240}
SMOKE_BUDGET_S = 30


def _rss_field(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(case: str, n: int, heads: int, head_dim: int, repeats: int) -> dict:
    """Run one case in this process; returns seconds (median) and peak extra memory in bytes."""
    import torch

    from .kernels import flash_attention
    from .inputs import normal_qkv
    from .kernels import golden_attention, reference_attention

    ops = {
        "naive_reference_fp32": lambda q, k, v: reference_attention(q, k, v, "fp32"),
        "flash_emulator_fp32": lambda q, k, v: flash_attention(q, k, v, "fp32", block_q=128, block_k=128),
        "golden_fp64": lambda q, k, v: golden_attention(q, k, v, chunk=1024),
    }
    op = ops[case]
    dtype = torch.float64 if case == "golden_fp64" else torch.float32
    op(*(t.to(dtype) for t in normal_qkv(1, 1, 256, head_dim, seed=0)))  # warm-up
    q, k, v = (t.to(dtype) for t in normal_qkv(1, heads, n, head_dim, seed=0))
    times, peaks = [], []
    for _ in range(repeats):
        base = _rss_field("VmRSS")
        exact = _reset_peak()
        start = time.perf_counter()
        out = op(q, k, v)
        times.append(time.perf_counter() - start)
        peaks.append(_rss_field("VmHWM") - base if exact else -1)
        del out
    return {"case": case, "n": n, "heads": heads, "head_dim": head_dim, "seconds": statistics.median(times),
            "seconds_all": times, "peak_extra_bytes": max(peaks), "peak_exact": exact,
            "torch_threads": torch.get_num_threads()}


def _subprocess_case(case, n, heads, head_dim, repeats) -> dict:
    cmd = [sys.executable, "-m", "attnum.bench", "_measure", case, str(n), str(heads), str(head_dim), str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"case": case, "n": n, "error": (proc.stderr or proc.stdout)[-2000:], "returncode": proc.returncode}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _study_tier(study: str, tier: str, outputs: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "attnum", "run", study, "--params", tier, "--outputs",
                           str(outputs), "--no-progress"], capture_output=True, text=True)
    return {"study": study, "tier": tier, "seconds": time.perf_counter() - start, "ok": proc.returncode == 0,
            "error": "" if proc.returncode == 0 else proc.stderr[-1500:]}


def main(quick: bool = False, outputs=None) -> int:
    from .ncio import device_description, git_state, package_versions
    from .paths import outputs_root
    from .runs import studies

    n, golden_n, repeats = (2048, 4096, 1) if quick else (16384, 65536, 3)
    report = {"machine": device_description("cpu"), "versions": package_versions(), **git_state(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": quick, "kernels": [], "studies": []}
    print(f"# attnum bench on {report['machine']}" + (" (quick)" if quick else ""), flush=True)
    for case in ("naive_reference_fp32", "flash_emulator_fp32"):
        r = _subprocess_case(case, n, 4, 64, repeats)
        report["kernels"].append(r)
        print(f"{case:24s} N={n} H=4 d=64: " + (f"{r['seconds']:.2f} s, peak +{r['peak_extra_bytes'] / 2**20:.0f} MiB"
                                              if "error" not in r else f"FAILED {r['error'][-300:]}"), flush=True)
    g = _subprocess_case("golden_fp64", golden_n, 1, 64, 1)
    report["kernels"].append(g)
    print(f"{'golden_fp64':24s} N={golden_n} H=1 d=64: " + (
        f"{g['seconds']:.1f} s, peak +{g['peak_extra_bytes'] / 2**20:.0f} MiB" if "error" not in g else
        f"FAILED {g['error'][-300:]}"), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for study in studies():
            for tier in (("smoke",) if quick else ("smoke", "default")):
                r = _study_tier(study, tier, Path(tmp))
                report["studies"].append(r)
                print(f"study {study:32s} {tier:8s}: {r['seconds']:.1f} s{'' if r['ok'] else ' FAILED'}", flush=True)

    naive, emu = report["kernels"][0], report["kernels"][1]
    checks = []
    if "error" not in naive and "error" not in emu:
        checks.append(("emulator peak memory <= naive / 8", emu["peak_extra_bytes"] * 8 <= naive["peak_extra_bytes"],
                       f"{emu['peak_extra_bytes'] / 2**20:.0f} MiB vs {naive['peak_extra_bytes'] / 2**20:.0f} MiB"))
        checks.append(("emulator time <= 3x naive", emu["seconds"] <= 3 * naive["seconds"],
                       f"{emu['seconds']:.2f} s vs {naive['seconds']:.2f} s ({emu['seconds'] / naive['seconds']:.2f}x)"))
    else:
        checks.append(("naive and emulator ran", False, "see errors above"))
    checks.append((f"golden at N={golden_n} runs", "error" not in g, "ok" if "error" not in g else "failed"))
    for r in report["studies"]:
        budget = SMOKE_BUDGET_S if r["tier"] == "smoke" else STUDY_BUDGETS_S.get(r["study"], 180)
        checks.append((f"{r['study']} {r['tier']} <= {budget} s", r["ok"] and r["seconds"] <= budget,
                       f"{r['seconds']:.1f} s"))
    report["checks"] = [{"target": t, "met": ok, "measured": m} for t, ok, m in checks]
    print("\n| target | met | measured |\n|---|---|---|")
    for t, ok, m in checks:
        print(f"| {t} | {'yes' if ok else 'NO'} | {m} |")
    out = Path(outputs) if outputs else outputs_root()
    path = out / "bench" / ("bench-quick.json" if quick else "bench.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")
    return 0 if all(ok for _, ok, _ in checks) else 1


def measure_kernel(name: str, n: int, heads: int, head_dim: int, repeats: int, device: str = "cpu") -> dict:
    """One registry or user kernel (``package.module:function``) in this process: median forward and
    forward + backward seconds on bf16 inputs, and peak extra memory of the forward (CPU: ``VmHWM``)."""
    import torch

    from . import kernels
    from .inputs import normal_qkv
    from .timing import median_ms

    kernel = kernels.get(name)
    kernel.require(device)
    q, k, v, do = (t.to(device=device, dtype=torch.bfloat16) for t in
                   normal_qkv(1, heads, n, head_dim, seed=0) + (torch.randn(1, heads, n, head_dim, dtype=torch.float64),))
    with torch.no_grad():
        base, exact = _rss_field("VmRSS"), _reset_peak()
        fwd = median_ms(lambda: kernel.forward(q, k, v), 1, repeats, device) / 1e3
        peak = _rss_field("VmHWM") - base if exact and device == "cpu" else -1

    def step():
        out, lse = kernel.forward(q, k, v)
        kernel.backward(q, k, v, do, **({"out": out, "lse": lse} if lse is not None else {}))

    both = median_ms(step, 1, repeats, device) / 1e3 if kernel.has_backward else None
    return {"case": f"kernel {name}", "n": n, "heads": heads, "head_dim": head_dim, "seconds": fwd,
            "forward_backward_seconds": both, "peak_extra_bytes": peak, "device": device,
            "torch_threads": torch.get_num_threads()}


def kernel_main(names, quick: bool = False, outputs=None, device: str = "cpu") -> int:
    """``bench --kernel NAME``: each kernel timed in its own subprocess; ``bench-kernels.json``."""
    from .ncio import device_description, git_state, package_versions
    from .paths import outputs_root

    n, repeats = (1024, 1) if quick else (4096, 3)
    report = {"machine": device_description(device), "versions": package_versions(), **git_state(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": quick, "kernels": []}
    failed = False
    for name in names:
        cmd = [sys.executable, "-m", "attnum.bench", "_kernel", name, str(n), "4", "64", str(repeats), device]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            r = {"case": f"kernel {name}", "error": (proc.stderr or proc.stdout)[-2000:]}
            failed = True
            print(f"kernel {name}: FAILED {r['error'][-300:]}", flush=True)
        else:
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            fb = r["forward_backward_seconds"]
            print(f"kernel {name} N={n} H=4 d=64 bf16: forward {r['seconds'] * 1e3:.1f} ms"
                  + (f", forward+backward {fb * 1e3:.1f} ms" if fb is not None else ", no backward"), flush=True)
        report["kernels"].append(r)
    out = Path(outputs) if outputs else outputs_root()
    path = out / "bench" / ("bench-kernels-quick.json" if quick else "bench-kernels.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "_kernel":
        name, n, heads, head_dim, repeats = sys.argv[2], *map(int, sys.argv[3:7])
        print(json.dumps(measure_kernel(name, n, heads, head_dim, repeats, sys.argv[7] if len(sys.argv) > 7 else "cpu")))
        sys.exit(0)
    if len(sys.argv) >= 2 and sys.argv[1] == "_measure":
        case, n, heads, head_dim, repeats = sys.argv[2], *map(int, sys.argv[3:7])
        print(json.dumps(measure(case, n, heads, head_dim, repeats)))
    else:
        sys.exit(main(quick="--quick" in sys.argv))
