"""``attnum.kernels.triton_fa2_regs``: our Triton kernels compiled for sm_90a on this CPU and read by ptxas.

The compiling tests run in a subprocess without TRITON_INTERPRET (``tests/kernels/test_triton_fa2.py`` sets it for
the whole session, and a kernel built for the interpreter cannot be compiled for a GPU)."""
import json
import os
import subprocess
import sys

import pytest

from attnum.kernels import triton_fa2_regs as regs

try:
    import triton  # noqa: F401
    NO_TRITON = None
except ImportError as exc:
    NO_TRITON = f"triton is not importable ({exc})"

# the report of one entry function in ptxas -v's wording (CUDA 12.8's ptxas, as Triton 3.6 ships it)
PTXAS_LOG = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_bwd_dq_kernel' for 'sm_90a'
ptxas info    : Function properties for _bwd_dq_kernel
    24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size
ptxas info    : Compile time = 370.263 ms
"""


def _run(code: str, interpret: bool = False, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


def test_parse_ptxas_reads_each_number_once():
    assert regs.parse_ptxas(PTXAS_LOG) == {"registers": 255, "spill_stores": 20, "spill_loads": 16,
                                           "stack_frame": 24, "barriers": 1}
    # a kernel without barriers: ptxas leaves them out
    no_barrier = PTXAS_LOG.replace(", used 1 barriers", "").replace("255 registers", "96 registers")
    assert regs.parse_ptxas(no_barrier)["barriers"] == 0
    assert regs.parse_ptxas(no_barrier)["registers"] == 96
    with pytest.raises(ValueError, match="registers"):
        regs.parse_ptxas(PTXAS_LOG.replace("Used 255 registers", "Used many registers"))
    with pytest.raises(ValueError, match="2 matches of 'spill_stores'"):
        regs.parse_ptxas(PTXAS_LOG + PTXAS_LOG.splitlines()[3] + "\n")


def test_parse_changes_types_and_refusals():
    assert regs.parse_changes(["dq_rsum_mma=0", "dq_warps=8", "dq_tma=none", "kv_overlap=on"]) == {
        "dq_rsum_mma": False, "dq_warps": 8, "dq_tma": None, "kv_overlap": True}
    with pytest.raises(ValueError, match="BlockConfig field"):
        regs.parse_changes(["dq_tile=64"])
    with pytest.raises(ValueError, match="BlockConfig field"):
        regs.parse_changes(["dq_m"])
    with pytest.raises(ValueError, match="switch"):
        regs.parse_changes(["dq_rsum_mma=maybe"])
    with pytest.raises(ValueError, match="integer"):
        regs.parse_changes(["dq_m=sixty-four"])
    with pytest.raises(ValueError, match="power of two"):  # BlockConfig's own check, before any compiling
        regs.parse_changes(["dq_m=48"])


@pytest.mark.parametrize("argv, message", [
    (["--set", "dq_m=48"], "power of two"),
    (["--gproj", "full"], "--gproj"),
    (["--causal", "2"], "--causal"),
    (["--dims", "64,x"], "--dims"),
    (["--arch", "75"], "--arch"),
])
def test_cli_refuses_bad_input_before_compiling(argv, message, tmp_path, capsys):
    out = tmp_path / "regs.json"
    with pytest.raises(SystemExit) as exc:
        regs.main([str(out), *argv])
    assert message in str(exc.value.code)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert "regs" not in capsys.readouterr().out  # no table started


@pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
def test_compiled_for_sm90a_on_the_cpu(tmp_path):
    """The dQ kernel at d = 64 with GProj "dq", recorded from ``backward`` and compiled for sm_90a: the launch
    carries the default configuration's tiles and switches, ptxas's rerun is Triton's own binary, registers and
    shared memory lie within the H200's limits, ``--set`` changes reach the compiled kernel, and the kernels are
    restored after recording (also when the configuration is refused)."""
    code = f"""
import dataclasses, json
from attnum.kernels import triton_fa2 as tfa, triton_fa2_regs as regs
cfg = tfa.default_config(64, causal=False, gproj="dq")
(launch,) = regs.launches(64, False, "dq", n=256, kernels=("dq",))
assert launch.kernel == "dq" and launch.function is tfa._bwd_dq_kernel
kw = launch.kwargs
assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["GPROJ"], kw["num_warps"], kw["num_stages"]) == (
    cfg.dq_m, cfg.dq_n, 1, *cfg.launch("dq")), kw
assert kw["RSUM_MMA"] == cfg.dq_rsum_mma and kw["TMA"] == cfg.uses_tma("dq") and kw["EVEN_N"] is True
row = regs.kernel_row(launch)
eight = regs.kernel_row(regs.launches(64, False, "dq", n=256, changes=dict(dq_warps=8), kernels=("dq",))[0])
try:
    regs.launches(64, False, "dq", n=256, changes=dict(dq_m=48))
except ValueError:
    pass
else:
    raise AssertionError("dq_m=48 was accepted")
from triton.runtime.jit import JITFunction
assert all(isinstance(getattr(tfa, n), JITFunction) for n in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"))
both = regs.launches(64, True, "dq_dk", n=200)
print(json.dumps({{"row": row, "eight": eight, "both": [(l.kernel, l.kwargs["EVEN_N"]) for l in both]}}))
"""
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    row, eight = out["row"], out["eight"]
    assert row["cubin_matches"] is True and eight["cubin_matches"] is True
    assert 0 < row["registers"] <= 255 and 0 < eight["registers"] <= 255
    assert row["num_warps"] == 4 and eight["num_warps"] == 8
    assert 0 < row["shared_bytes"] <= regs.SHARED_LIMIT[90] and row["shared_fits"] is True
    assert min(row["spill_stores"], row["spill_loads"], row["stack_frame"]) >= 0
    assert (row["block_m"], row["block_n"], row["block_d"]) == (64, 64, 64)
    # Hopper's warpgroup MMA, not the warp-level mma.sync, at either warp count
    assert row["wgmma_ptx"] > 0 and eight["wgmma_ptx"] > 0 and row["mma_sync_ptx"] == eight["mma_sync_ptx"] == 0
    # every commit group is waited for, each wait named by how many groups it leaves in flight
    assert row["wgmma_commit_to_wait"] and all(isinstance(n, int) and n >= 0 for n in row["wgmma_commit_to_wait"])
    assert row["wgmma_waits"] and all(key.isdigit() for key in row["wgmma_waits"])
    # n = 200 is no multiple of the tiles: every kernel launches with the masked tail, in forward/backward's order
    assert out["both"] == [["fwd", False], ["dq", False], ["kv", False]]


@pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
def test_refused_where_the_kernels_are_the_interpreters():
    code = """
from attnum.kernels import triton_fa2_regs as regs
try:
    regs.launches(64, False)
except RuntimeError as exc:
    print(exc)
"""
    res = _run(code, interpret=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TRITON_INTERPRET" in res.stdout and "cannot be compiled for a GPU" in res.stdout


@pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))
def test_tune_cases_compiled_at_their_recorded_configuration(tmp_path):
    """``--tune``: a timed case is compiled at the configuration it recorded (fields added since take their bare
    BlockConfig value), beside its time; a failed case, a whole-backward part, a removed field and a case outside
    the filters give no row, the first three named in ``skipped`` with the reason."""
    code = """
import dataclasses, json, sys
from attnum.kernels import triton_fa2 as tfa, triton_fa2_regs as regs
old = {k: v for k, v in dataclasses.asdict(tfa.default_config(64, causal=False, gproj="dq")).items()
       if k not in ("dq_rsum_mma", "dq_exp2", "exp2")}
cases = [
    {"d": 64, "causal": False, "part": "dq_gproj", "gproj": "dq", "config": dict(old, dq_warps=8), "status": "ok",
     "ms": 2.5, "ms_rounds": [2.5, 2.6]},
    {"d": 64, "causal": False, "part": "dq", "gproj": "off", "config": old, "status": "error"},
    {"d": 64, "causal": False, "part": "bwd", "gproj": "off", "config": old, "status": "ok", "ms": 1.0},
    {"d": 64, "causal": False, "part": "dq", "gproj": "off", "config": dict(old, dq_ws=True), "status": "ok",
     "ms": 1.0},
    {"d": 128, "causal": False, "part": "dq", "gproj": "off", "config": old, "status": "ok", "ms": 1.0},
]
tune = {"n": 256, "cases": cases}
print(json.dumps(regs.tune_report(tune, dims=(64,))))
"""
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    (row,) = out["rows"]
    assert (row["case"], row["kernel"], row["gproj"], row["ms"], row["ms_rounds"]) == (0, "dq", "dq", 2.5, [2.5, 2.6])
    assert (row["num_warps"], row["n"], row["exp2"], row["rsum_mma"]) == (8, 256, False, False)
    assert 0 < row["registers"] <= 255 and row["cubin_matches"] is True
    assert [(s["case"], s["reason"].split(":")[0].split(" ")[0]) for s in out["skipped"]] == [
        (1, "status"), (2, "part"), (3, "configuration")]
    assert "dq_ws" in out["skipped"][2]["reason"]
    with pytest.raises(ValueError, match="no list of 'cases'"):
        regs.tune_report({"n": 8192})
    with pytest.raises(ValueError, match="'n' must be a positive integer"):
        regs.tune_report({"cases": [], "n": "8192"})


def test_cli_tune_refusals(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot be read as JSON"):
        regs.main(["--tune", str(bad)])
    bad.write_text(json.dumps({"n": 8192}))
    with pytest.raises(SystemExit, match="not a triton_fa2_tune file"):
        regs.main(["--tune", str(bad)])
    with pytest.raises(SystemExit, match="do not apply"):
        regs.main(["--tune", str(bad), "--set", "dq_warps=8"])


def test_wgmma_schedule_reads_waits_and_distances():
    """Per commit, the PTX instructions that follow it before the next wait (a later commit counts; labels,
    directives, comments and braces do not), and the waits by how many groups they leave in flight; a commit no
    wait follows gives None."""
    ptx = """
.visible .entry k(
)
{
$L__BB0_1:
    wgmma.fence.sync.aligned;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;
    wgmma.commit_group.sync.aligned;
    // a comment
    mov.f32 %f2, 0f00000000;
    add.f32 %f3, %f2, %f2;
    wgmma.wait_group.sync.aligned 0;
    wgmma.commit_group.sync.aligned;
    wgmma.commit_group.sync.aligned;
    mul.f32 %f4, %f3, %f3;
    wgmma.wait_group.sync.aligned 1;
    wgmma.commit_group.sync.aligned;
    ret;
}
"""
    out = regs.wgmma_schedule(ptx)
    assert out == {"wgmma_waits": {"0": 1, "1": 1}, "wgmma_commit_to_wait": [2, 2, 1, None]}
    with pytest.raises(ValueError, match="ELF"):
        regs.elf_sections(b"\x7fELF\x01\x01" + bytes(58))  # a 32-bit header
