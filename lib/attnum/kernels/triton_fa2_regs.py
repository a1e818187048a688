"""Registers, spills and shared memory of our Triton kernels as ptxas builds them for a GPU, on any machine.

    python -m attnum.kernels.triton_fa2_regs [OUT.json] [--dims=64,128] [--causal=0,1] [--gproj=off,dq,dq_dk]
                                             [--kernels=fwd,dq,kv] [--n=8192] [--arch=90]
                                             [--set FIELD=VALUE ...]
    python -m attnum.kernels.triton_fa2_regs [OUT.json] --tune TUNE.json [--dims=...] [--causal=...] [--kernels=...]

A kernel that needs more than the 255 registers a thread can hold keeps the rest in local memory ("spills"),
and one whose shared memory exceeds the multiprocessor's does not launch; both decide how fast a tile
configuration can go before anything is timed. Neither needs a GPU to be read: Triton compiles for a target
(``GPUTarget("cuda", arch, 32)``, sm_90a for the H100 and H200) on the CPU, and the ptxas Triton ships reports what
it allocated (``ptxas -v``). So this builds ``triton_fa2``'s forward, dQ and dK/dV kernels exactly as
``forward``/``backward`` would launch them (their launch arguments are recorded from those functions with
small bf16 CPU tensors, not restated here), at the tuned defaults of each (head dim, causal, GProj mode) or at
those defaults with ``--set`` fields changed (``BlockConfig`` fields, e.g. ``--set dq_rsum_mma=0 --set dq_warps=8``).
With ``--tune``, it compiles instead every timed case of a ``triton_fa2_tune`` file at the configuration the case
recorded, and sets each case's time beside its registers (``tune_report``).

Each row: the kernel, its tiles, warps, stages and switches; ptxas's registers per thread, spill stores and loads
(bytes per thread), stack frame and barriers; the shared memory Triton asks at launch (bytes per block) and
``shared_fits`` against the target's opt-in limit; how many tensor-core instructions of each kind the PTX holds
(``wgmma_ptx``: Hopper's warpgroup MMA; ``mma_sync_ptx``: the warp-level MMA of earlier GPUs) and how it waits for
them (``wgmma_waits``, ``wgmma_commit_to_wait``: ``wgmma_schedule``). ptxas is rerun on Triton's PTX with the flags
Triton's own build passes (``-lineinfo -v --gpu-name``, ``--fmad=false`` without fp fusion); ``cubin_matches`` says
whether that rerun produced Triton's own binary, byte for byte in every ELF section but ``.debug_line`` (which
records the source file's modification time); where it does not, the row describes a build of the same PTX, not
necessarily the one that runs.

The numbers are properties of the compiler (Triton, its ptxas) and of the kernel's source, not of a run: the
file records both versions. The kernels' speed is measured on a GPU (``triton_fa2_bench``, ``triton_fa2_tune``);
what this adds is where registers or shared memory could explain a slow configuration, and where they cannot.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KERNELS = ("fwd", "dq", "kv")
_KERNEL_NAMES = {"_fwd_kernel": "fwd", "_bwd_dq_kernel": "dq", "_bwd_dkdv_kernel": "kv"}
# the opt-in shared memory per block of each target's multiprocessor (CUDA C Programming Guide, "Compute
# Capabilities", table "Technical Specifications per Compute Capability"): 8.0 163 KB, 8.6/8.9 99 KB, 9.0 227 KB
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_BOOL_WORDS = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as ``forward``/``backward`` issue it: the kernel (a ``triton.JITFunction``), its
    positional arguments and its keyword arguments (constexprs and launch options)."""
    kernel: str
    function: object
    args: tuple
    kwargs: dict


def _kernels_module():
    """``triton_fa2``, refused where its kernels were built for the CPU interpreter (nothing to compile then)."""
    from . import triton_fa2 as tfa

    if tfa.triton is None:
        raise RuntimeError(f"triton is not importable: {tfa.unavailable_reason('cpu')}")
    if tfa._KERNELS_INTERPRETED:
        raise RuntimeError("triton_fa2 was imported with TRITON_INTERPRET set: its kernels are the CPU interpreter's "
                           "and cannot be compiled for a GPU; run this in a process without TRITON_INTERPRET")
    return tfa


@contextlib.contextmanager
def _recording(tfa, launches: list):
    """Within: ``tfa``'s kernels record their launches into ``launches`` instead of running, and the
    device check lets CPU tensors through (nothing runs on them). The module's globals are swapped for the
    duration, so this is not for a process whose other threads launch the kernels meanwhile."""

    class Recorder:
        def __init__(self, name, function):
            self.name, self.function = name, function

        def __getitem__(self, grid):
            def record(*args, **kwargs):
                if self.name in _KERNEL_NAMES:
                    launches.append(Launch(_KERNEL_NAMES[self.name], self.function, args, kwargs))
            return record

    names = (*_KERNEL_NAMES, "_bwd_preprocess_kernel")
    saved = {name: getattr(tfa, name) for name in names}
    saved_reason = tfa.unavailable_reason
    try:
        for name in names:
            setattr(tfa, name, Recorder(name, saved[name]))
        tfa.unavailable_reason = lambda device=None: None
        yield
    finally:
        for name, function in saved.items():
            setattr(tfa, name, function)
        tfa.unavailable_reason = saved_reason


def launches(head_dim: int, causal: bool, gproj: str = "off", n: int = 8192, changes: dict | None = None,
             kernels=KERNELS, config=None, fp32_backward: bool = False, fp32_dot: str = "ieee") -> list[Launch]:
    """The launches of ``kernels`` (of ``KERNELS``) that ``forward`` and ``backward`` make for bf16 (1, 1, n,
    head_dim) inputs at ``config`` (a ``BlockConfig``; default: the default configuration of (head_dim, causal,
    gproj, fp32_backward, fp32_dot)), with ``changes`` (BlockConfig fields) applied. The forward does not depend
    on GProj."""
    import torch

    tfa = _kernels_module()
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"kernels must be among {KERNELS}, got {sorted(unknown)}")
    if gproj not in tfa.GPROJ_MODES:
        raise ValueError(f"gproj must be one of {tfa.GPROJ_MODES}, got {gproj!r}")
    cfg = config or tfa.default_config(head_dim, fp32_backward, causal=causal, gproj=gproj, fp32_dot=fp32_dot)
    cfg = dataclasses.replace(cfg, **(changes or {}))
    q = torch.zeros(1, 1, n, head_dim, dtype=torch.bfloat16)
    recorded: list[Launch] = []
    with _recording(tfa, recorded):
        if "fwd" in kernels:
            tfa.forward(q, q, q, causal=causal, config=cfg)
        if "dq" in kernels or "kv" in kernels:
            only = None if {"dq", "kv"} <= set(kernels) else ("dq" if "dq" in kernels else "kv")
            tfa.backward(q, q, q, q, torch.zeros(1, 1, n), q, causal=causal, gproj=gproj, config=cfg, _only=only,
                         fp32_backward=fp32_backward, fp32_dot=fp32_dot)
    return recorded


def compile_launch(launch: Launch, arch: int = 90):
    """``launch``'s kernel compiled for CUDA compute capability ``arch`` on this machine, specialized as
    Triton's launcher specializes it (argument types, 16-byte alignment and divisibility by 16, constexprs)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.function
    target = GPUTarget("cuda", int(arch), 32)
    backend = make_backend(target)
    kwargs = {"debug": False, **launch.kwargs}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


_PTXAS_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
    "stack_frame": r"(\d+) bytes stack frame",
    "barriers": r"used (\d+) barriers",
}


def parse_ptxas(log: str) -> dict[str, int]:
    """ptxas ``-v``'s report of one entry function: registers per thread, spill stores and loads and stack frame
    (bytes per thread), barriers. A report without one of them is refused (another ptxas's wording)."""
    out = {}
    for key, pattern in _PTXAS_PATTERNS.items():
        found = re.findall(pattern, log)
        if key == "barriers" and not found:
            found = ["0"]  # ptxas names barriers only where the kernel uses them
        if len(found) != 1:
            raise ValueError(f"ptxas's report holds {len(found)} matches of {key!r} ({pattern!r}), not one:\n{log}")
        out[key] = int(found[0])
    return out


def ptxas_report(compiled, arch: int = 90) -> dict:
    """ptxas ``-v`` rerun on ``compiled``'s PTX with Triton's flags: ``parse_ptxas``'s numbers, the ptxas
    version, and whether the rerun's binary is Triton's own (``cubin_matches``)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(int(arch)).path
    flags = ["-lineinfo", "-v"]
    if not compiled.metadata.enable_fp_fusion:
        flags.append("--fmad=false")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(compiled.asm["ptx"])
        res = subprocess.run([ptxas, *flags, f"--gpu-name={sm_arch_from_capability(int(arch))}", str(src), "-o",
                              str(src) + ".o"], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"ptxas failed ({res.returncode}): {res.stderr}")
        cubin = Path(str(src) + ".o").read_bytes()
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    ours, theirs = elf_sections(cubin), elf_sections(compiled.asm["cubin"])
    # .debug_line records the Python source file's modification time when ptxas ran (DWARF's file entry), so
    # it differs between two builds of the same PTX whenever the file was touched in between
    same = ours.keys() == theirs.keys() and all(ours[k] == theirs[k] for k in ours if k != ".debug_line")
    return {**parse_ptxas(res.stderr), "ptxas": version[-1] if version else "unknown", "cubin_matches": same}


def elf_sections(blob: bytes) -> dict[str, bytes]:
    """The sections of a 64-bit little-endian ELF file (a cubin) by name: their bytes (empty for NOBITS ones).
    Refuses anything else."""
    import struct

    if blob[:4] != b"\x7fELF" or blob[4] != 2 or blob[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", blob, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name, kind, _flags, _addr, offset, size in headers:
        label = blob[names_at + name:blob.index(b"\0", names_at + name)].decode()
        out[label] = b"" if kind == 8 else blob[offset:offset + size]  # 8: SHT_NOBITS, no bytes in the file
    return out


_ROW_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_D", "TMA", "OVERLAP", "EXP2", "RSUM_MMA",
                   "HEAVY_FIRST", "EVEN_N", "EVEN_D")


def kernel_row(launch: Launch, arch: int = 90) -> dict:
    """One launch compiled and read: its constexprs of ``_ROW_CONSTEXPRS``, warps, stages, shared memory,
    ptxas's report, and the static counts of tensor-core instructions in its PTX (``wgmma_ptx``,
    ``mma_sync_ptx``)."""
    compiled = compile_launch(launch, arch)
    row = {"kernel": launch.kernel, "function": launch.function.fn.__name__}
    row.update({key.lower(): launch.kwargs[key] for key in _ROW_CONSTEXPRS if key in launch.kwargs})
    row.update(num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
               shared_bytes=int(compiled.metadata.shared))
    limit = SHARED_LIMIT.get(int(arch))
    row["shared_fits"] = None if limit is None else row["shared_bytes"] <= limit
    row.update(ptxas_report(compiled, arch))
    # which tensor-core instructions the PTX issues (static counts, not executions): Hopper's warpgroup MMA
    # (wgmma.mma_async) or the warp-level mma.sync of earlier GPUs
    ptx = compiled.asm["ptx"]
    row.update(wgmma_ptx=len(re.findall(r"\bwgmma\.mma_async\b", ptx)),
               mma_sync_ptx=len(re.findall(r"\bmma\.sync\b", ptx)), **wgmma_schedule(ptx))
    return row


def wgmma_schedule(ptx: str) -> dict:
    """How the PTX waits for its warpgroup MMAs, read statically in program order: ``wgmma_waits`` maps the
    number of groups a ``wgmma.wait_group N`` leaves in flight (N) to how many such waits there are, and
    ``wgmma_commit_to_wait`` gives, for each ``wgmma.commit_group``, how many PTX instructions follow it before
    the next wait (instructions: the lines ending in ";" that are not directives; labels, braces and comments are
    not counted; None where no wait follows). A product waited for a few instructions after it is issued overlaps
    little with other work; FlashAttention-3 keeps products in flight across the softmax's elementwise work on
    purpose (Shah et al., "FlashAttention-3", 2024, section 3.2, https://arxiv.org/abs/2407.08608). Static: a
    loop body's distances are per iteration, and how the warps interleave at run time is not visible here."""
    waits: dict[str, int] = {}
    distances: list[int | None] = []
    open_commits: list[int] = []
    count = 0
    for raw in ptx.splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line.endswith(";") or line.startswith("."):
            continue  # an instruction ends with ";"; directives (".reg", ".loc", ...) start with "."
        if "wgmma.wait_group" in line:
            pending = re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", line)
            key = pending.group(1) if pending else "?"
            waits[key] = waits.get(key, 0) + 1
            distances.extend(count - start for start in open_commits)
            open_commits = []
        count += 1
        if "wgmma.commit_group" in line:
            open_commits.append(count)
    distances.extend(None for _ in open_commits)
    return {"wgmma_waits": waits, "wgmma_commit_to_wait": distances}


def parse_changes(items) -> dict:
    """``--set FIELD=VALUE`` items as BlockConfig changes: a field of ``BlockConfig`` (refused otherwise), an
    integer for a size, warps or stages, 0/1/true/false/on/off for a switch, ``none`` for a per-kernel field's
    "use the shared value"."""
    from . import triton_fa2 as tfa

    fields = {field.name: field for field in dataclasses.fields(tfa.BlockConfig)}
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set wants FIELD=VALUE with FIELD a BlockConfig field ({', '.join(fields)}); "
                             f"got {item!r}")
        text = value.strip().lower()
        bool_field = "bool" in str(fields[name].type)
        if text == "none" and "None" in str(fields[name].type):
            out[name] = None
        elif bool_field:
            if text not in _BOOL_WORDS:
                raise ValueError(f"--set {name} is a switch: 0/1/true/false/on/off, got {value!r}")
            out[name] = _BOOL_WORDS[text]
        else:
            try:
                out[name] = int(text)
            except ValueError:
                raise ValueError(f"--set {name} is an integer, got {value!r}") from None
    tfa.BlockConfig(**out)  # every value checked before anything compiles
    return out


def report(dims=(64, 128), causals=(False, True), gprojs=("off", "dq", "dq_dk"), n: int = 8192, arch: int = 90,
           changes: dict | None = None, progress=None, kernels=KERNELS) -> dict:
    """Every kernel of every (head dim, causal, GProj mode): rows of ``kernel_row`` with the shape's keys, each
    distinct compilation once (the forward is the same for every GProj mode, so it is listed under "off")."""
    if int(arch) not in SHARED_LIMIT:
        raise ValueError(f"arch must be one of {sorted(SHARED_LIMIT)} (compute capability x 10), got {arch}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rows = []
    for d in dims:
        for causal in causals:
            for gproj in gprojs:
                these = [k for k in kernels if gproj == "off" or k != "fwd"]
                if not these:
                    continue
                for launch in launches(d, causal, gproj, n, changes, these):
                    row = {"head_dim": d, "causal": bool(causal), "gproj": gproj, "n": n, **kernel_row(launch, arch)}
                    rows.append(row)
                    if progress:
                        progress(row)
    return {**_header(arch), "changes": changes or {}, "kernels": list(kernels), "rows": rows}


def _header(arch: int) -> dict:
    """Where a report's numbers come from: the machine, the versions, the code and the target."""
    from ..paths import git_state
    from ..versions import accelerator_versions

    versions = accelerator_versions("cpu")
    env = {"python": platform.python_version(), "triton": versions["triton"], "torch": versions["torch"],
           "machine": platform.machine(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           **git_state()}
    return {"environment": env, "target": {"backend": "cuda", "arch": int(arch), "warp_size": 32,
                                           "shared_limit_bytes": SHARED_LIMIT[int(arch)]}, "dtype": "bf16"}


def tune_report(tune: dict, arch: int = 90, dims=None, causals=None, kernels=KERNELS, progress=None) -> dict:
    """The cases of a ``triton_fa2_tune`` file (its JSON, loaded) compiled as they were timed: each timed case
    whose part times one kernel of ``kernels`` (and whose head dim and causality are among ``dims``/``causals``,
    where given) gives ``kernel_row`` at the case's recorded configuration, beside the case's part, change and
    ``ms``/``ms_rounds``. Today's kernel source is compiled: a configuration field the file holds and
    ``BlockConfig`` no longer has refuses the case (``skipped``, with the reason), and a field added since takes
    its bare ``BlockConfig`` value, which is off for every switch (the code before the switch). Cases that failed
    on the GPU, or timed the whole backward (two kernels), are skipped likewise."""
    from . import triton_fa2 as tfa
    from .triton_fa2_tune import _kernel_of

    if not isinstance(tune, dict) or not isinstance(tune.get("cases"), list):
        raise ValueError("not a triton_fa2_tune file: no list of 'cases'")
    n = tune.get("n")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"not a triton_fa2_tune file: 'n' must be a positive integer, got {n!r}")
    fields = {field.name for field in dataclasses.fields(tfa.BlockConfig)}
    rows, skipped = [], []
    for index, case in enumerate(tune["cases"]):
        if not isinstance(case, dict):
            raise ValueError(f"case {index} is not an object")
        if (dims is not None and case.get("d") not in dims) or (causals is not None
                                                                and case.get("causal") not in causals):
            continue
        kernel = _kernel_of(str(case.get("part", "")))
        why = None
        if kernel not in KERNELS:
            why = f"part {case.get('part')!r} times no single kernel"
        elif kernel not in kernels:
            continue
        elif case.get("status") != "ok" or not isinstance(case.get("ms"), (int, float)):
            why = f"status {case.get('status')!r}: not timed"
        elif not isinstance(case.get("config"), dict) or set(case["config"]) - fields:
            why = f"configuration fields no longer in BlockConfig: {sorted(set(case.get('config') or {}) - fields)}"
        if why:
            skipped.append({"case": index, "part": case.get("part"), "reason": why})
            continue
        d, causal, gproj = int(case["d"]), bool(case["causal"]), str(case.get("gproj", "off"))
        (launch,) = launches(d, causal, gproj, n, kernels=(kernel,), config=tfa.BlockConfig(**case["config"]),
                             fp32_backward=bool(case.get("fp32_backward", False)),
                             fp32_dot=str(case.get("fp32_dot", "ieee")))
        row = {"case": index, "part": case["part"], "change": case.get("change"), "ms": case["ms"],
               "ms_rounds": case.get("ms_rounds"), "head_dim": d, "causal": causal, "gproj": gproj, "n": n,
               "fp32_backward": bool(case.get("fp32_backward", False)), **kernel_row(launch, arch)}
        rows.append(row)
        if progress:
            progress(row)
    return {"rows": rows, "skipped": skipped}


HEADER = ("d", "causal", "gproj", "kernel", "tile", "warps", "stages", "regs", "spill st/ld B", "smem KiB", "wgmma")


def format_row(row: dict) -> tuple:
    cells = (row["head_dim"], int(row["causal"]), row["gproj"], row["kernel"], f"{row['block_m']}x{row['block_n']}",
             row["num_warps"], row["num_stages"], row["registers"], f"{row['spill_stores']}/{row['spill_loads']}",
             f"{row['shared_bytes'] / 1024:.1f}", row["wgmma_ptx"])
    return cells + ((row["ms"],) if "ms" in row else ())


def _line(cells) -> str:
    return "  ".join(f"{c!s:>13}" if i == 8 else f"{c!s:>6}" for i, c in enumerate(cells))


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--{name} wants comma-separated integers, got {text!r}") from None


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m attnum.kernels.triton_fa2_regs",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", help="write the report here as JSON (else print only)")
    parser.add_argument("--dims", help="head dims (default 64,128; with --tune: every case's)")
    parser.add_argument("--causal", help="0 and/or 1 (default both)")
    parser.add_argument("--gproj", help="GProj modes (default off,dq,dq_dk; not with --tune)")
    parser.add_argument("--kernels", default="fwd,dq,kv")
    parser.add_argument("--n", type=int, help="sequence length the launch is specialized for (default 8192; "
                                              "with --tune: the file's)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100, H200)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="changes")
    parser.add_argument("--tune", metavar="TUNE.json", help="compile the timed cases of a triton_fa2_tune file, at "
                                                             "their recorded configurations, beside their times")
    args = parser.parse_args(argv)
    if args.tune and (args.changes or args.gproj or args.n is not None):
        raise SystemExit("--tune compiles each case at its recorded configuration, GProj mode and N: "
                         "--set, --gproj and --n do not apply")
    dims = _ints(args.dims, "dims") if args.dims else (None if args.tune else (64, 128))
    causal_ints = _ints(args.causal, "causal") if args.causal else (0, 1)
    causals = tuple(bool(c) for c in causal_ints)
    gprojs = tuple((args.gproj or "off,dq,dq_dk").split(","))
    n = 8192 if args.n is None else args.n
    if dims is not None and any(d < 1 or d > 256 for d in dims):
        raise SystemExit(f"--dims must lie in 1..256, got {args.dims!r}")
    if not set(causal_ints) <= {0, 1}:
        raise SystemExit(f"--causal wants 0 and/or 1, got {args.causal!r}")
    kernels = tuple(args.kernels.split(","))
    if not set(kernels) <= set(KERNELS):
        raise SystemExit(f"--kernels wants among {', '.join(KERNELS)}, got {args.kernels!r}")
    if not set(gprojs) <= {"off", "dq", "dq_dk"}:
        raise SystemExit(f"--gproj wants among off, dq, dq_dk, got {args.gproj!r}")
    tune = None
    try:
        if args.arch not in SHARED_LIMIT or n < 1:
            raise ValueError(f"--arch must be one of {sorted(SHARED_LIMIT)} and --n >= 1, got {args.arch}, {n}")
        changes = parse_changes(args.changes)
        if args.tune:
            try:
                tune = json.loads(Path(args.tune).read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"--tune {args.tune}: cannot be read as JSON ({exc})") from None
            if not isinstance(tune, dict) or not isinstance(tune.get("cases"), list):
                raise ValueError(f"--tune {args.tune}: not a triton_fa2_tune file (no list of 'cases')")
        _kernels_module()
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(str(exc)) from None
    print(_line(HEADER + (("ms",) if tune is not None else ())), flush=True)

    def show(row):
        print(_line(format_row(row)), flush=True)

    if tune is not None:
        joined = tune_report(tune, args.arch, dims, causals, kernels, progress=show)
        result = {**_header(args.arch), "tune_file": Path(args.tune).name,
                  "tune_environment": tune.get("environment"), "n": tune.get("n"), "kernels": list(kernels),
                  **joined}
        for skip in joined["skipped"]:
            print(f"skipped case {skip['case']} ({skip['part']}): {skip['reason']}")
    else:
        result = report(dims, causals, gprojs, n, args.arch, changes, progress=show, kernels=kernels)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".part")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
