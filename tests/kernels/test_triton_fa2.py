"""Our Triton FlashAttention-2 kernel (``attnum.kernels.triton_fa2``) against fp64 attention.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set below before
triton is imported) at tiny sizes, in fp32 and fp16 (not bf16: the interpreter's tl.dot on bf16
operands gave wrong results on our CPU machine). With CUDA the ``gpu`` tests run the compiled
kernels in bf16 and fp16 and the interpreter tests skip.

Tolerances are multiples of the unit roundoff u of the input format (fp16 2^-11, bf16 2^-8,
fp32 2^-24), applied to max-abs errors normalised by the largest reference value.
"""
import dataclasses
import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

from attnum.kernels import triton_fa2 as tfa  # noqa: E402

if not CUDA and tfa.triton is not None and not tfa._KERNELS_INTERPRETED:
    tfa = importlib.reload(tfa)  # imported earlier without TRITON_INTERPRET: rebuild for the interpreter

U = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
VARIANTS = [("off", False), ("dq", False), ("dq_dk", False), ("off", True)]
SMALL = tfa.BlockConfig(fwd_m=16, fwd_n=16, dq_m=16, dq_n=16, kv_n=16, kv_m=16) if tfa.triton else None

if CUDA:
    INTERP_SKIP = "a CUDA device is present: the gpu tests cover the compiled kernel"
else:
    INTERP_SKIP = tfa.unavailable_reason("cpu")
interp = pytest.mark.skipif(INTERP_SKIP is not None, reason=str(INTERP_SKIP))


def reference(q, k, v, grad_out, causal, scale):
    """Plain softmax attention in fp64 and its exact gradients: (out, lse, dq, dk, dv)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    out = torch.softmax(s, dim=-1) @ v
    out.backward(grad_out.double())
    return out.detach(), torch.logsumexp(s, dim=-1).detach(), q.grad, k.grad, v.grad


def rel_max(x, ref, floor=0.0):
    """max |x - ref| / max(max |ref|, floor)."""
    denom = max(ref.abs().max().item(), floor)
    return (x.double() - ref).abs().max().item() / denom


def rel_norm(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def inputs(shape, dtype, device="cpu", seed=0, q_gain=1.0, key_offset=0.0):
    """q, k, v, dO; ``key_offset`` adds mu * u (u a random unit vector) to every key."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=g) for _ in range(4))
    u = torch.randn(shape[-1], generator=g)
    k = k + key_offset * u / u.norm()
    return tuple(t.to(device=device, dtype=dtype) for t in (q * q_gain, k, v, do))


def check_against_fp64(q, k, v, do, causal, variants, config, out_tol, grad_tol):
    scale = q.shape[-1] ** -0.5
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, do, causal, scale)
    out, lse = tfa.forward(q, k, v, causal=causal, config=config)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
    assert rel_max(out, r_out) <= out_tol
    # lse: fp32 arithmetic on fp32 scores
    assert (lse.double() - r_lse).abs().max().item() <= 64 * U[torch.float32] * max(1.0, r_lse.abs().max().item())
    floor = r_dv.abs().max().item()  # N = 1: dq = dk = 0 exactly; judge them on the dv scale
    for gproj, fp32_backward in variants:
        dq, dk, dv = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj,
                                  fp32_backward=fp32_backward, config=config)
        errs = [rel_max(g, r, floor) for g, r in ((dq, r_dq), (dk, r_dk), (dv, r_dv))]
        assert max(errs) <= grad_tol, (gproj, fp32_backward, errs)


# -- interpreter tests ---------------------------------------------------------------------------
@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,d", [(1, 16), (7, 16), (33, 16), (33, 32)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_matches_fp64(dtype, n, d, causal):
    q, k, v, do = inputs((1, 2, n, d), dtype, seed=n + d)
    # fp16: out and gradients are rounded once to fp16 (u/2) after fp32 accumulation; fp32: sums
    # of up to 33 terms in fp32
    out_tol, grad_tol = (4 * U[dtype], 8 * U[dtype]) if dtype == torch.float16 else (32 * U[dtype], 64 * U[dtype])
    variants = VARIANTS if dtype == torch.float16 else VARIANTS[:3]
    check_against_fp64(q, k, v, do, causal, variants, SMALL, out_tol, grad_tol)


@interp
def test_interpreter_gproj_removes_key_offset_error():
    """Seed 004, cause 2: a common key offset mu*u leaves the exact dQ unchanged but multiplies the
    row sums r_i of the rounded dS; GProj restores sum_j dS'_ij ~ 0, so dQ stays at the fp16 level."""
    shape, u16 = (1, 2, 64, 16), U[torch.float16]
    errs = {}
    for mu in (0.0, 1e3):
        q, k, v, do = inputs(shape, torch.float16, seed=3, q_gain=2.0, key_offset=mu)
        r_dq = reference(q, k, v, do, False, 0.25)[2]
        out, lse = tfa.forward(q, k, v, config=SMALL)
        for gproj, f32 in VARIANTS + [("dq", True)]:
            dq = tfa.backward(q, k, v, out, lse, do, gproj=gproj, fp32_backward=f32, config=SMALL)[0]
            errs[mu, gproj, f32] = rel_norm(dq, r_dq)
        # FP32 attention end to end (fp32 tensors holding the same fp16 values): the fp32 level
        out32, lse32 = tfa.forward(q.float(), k.float(), v.float(), config=SMALL)
        dq32 = tfa.backward(q.float(), k.float(), v.float(), out32, lse32, do.float(), config=SMALL)[0]
        errs[mu, "fp32 attention"] = rel_norm(dq32, r_dq)
    big = 1e3
    # GProj keeps dQ at the level of the stored fp16 rounding, with or without the offset
    assert errs[big, "dq", False] < 2 * u16, errs
    assert errs[big, "dq_dk", False] < 2 * u16, errs
    assert errs[big, "dq", False] < 2 * errs[0.0, "off", False], errs
    # without it the offset's error dominates by far
    assert errs[big, "off", False] > 30 * errs[big, "dq", False], errs
    # fp32 P and dS alone do not cure it: D_i = rowsum(dO * O) is formed from the fp16-rounded O,
    # and that error also leaves the rows of dS with a non-zero sum (GProj removes it too)
    assert errs[big, "off", True] > 10 * errs[big, "dq", False], errs
    assert errs[big, "dq", True] < 2 * u16, errs
    # FP32 attention end to end is below the fp16 storage level even at mu = 1e3 (its own residual,
    # fp32 roundoff times mu, is ~1e-4 relative here): GProj in fp16 reaches the level of fp16 storage
    assert errs[big, "fp32 attention"] < u16 / 4, errs


@interp
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_matches_emulator(causal):
    """Same numerics as the emulators under the ``fa2_fp16`` policy, block_k = the kernel's BLOCK_N."""
    from attnum.kernels.backward import GPROJ_MODES, flash_attention_backward
    from attnum.kernels.flash import flash_attention
    from attnum.precision import get_policy

    q, k, v, do = inputs((1, 2, 45, 16), torch.float16, seed=11)
    out, lse = tfa.forward(q, k, v, causal=causal, config=SMALL)
    e_out, e_lse = flash_attention(q, k, v, "fa2_fp16", causal=causal, block_q=SMALL.fwd_m, block_k=SMALL.fwd_n,
                                   loop_order="q_outer", fused_scale_max=False)
    # Identical up to the order of fp32 sums and fp32 exp: a rare P~ or dS~ rounding on a boundary
    # flips by one fp16 ulp, which moves an output or gradient element by ~u * (its row's scale).
    def agree(x, e, what, max_changed):
        assert rel_max(x, e) <= 2 * U[torch.float16], what
        assert (x.float() != e).float().mean().item() <= max_changed, what

    agree(out, e_out, "out", 0.02)
    assert (lse - e_lse).abs().max().item() <= 8 * U[torch.float32] * e_lse.abs().max().item()
    assert "dq_dk" in GPROJ_MODES
    pol = get_policy("fa2_fp16")
    for gproj, fp32_backward in VARIANTS:
        dq, dk, dv = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                                  config=SMALL)
        e_grads = flash_attention_backward(
            q, k, v, out, lse, do, pol.replace(ds="fp32", p_bwd="fp32") if fp32_backward else pol, causal=causal,
            block_q=SMALL.dq_m, block_k=SMALL.fwd_n, gproj=gproj)
        for name, g, e in zip("dq dk dv".split(), (dq, dk, dv), e_grads):
            agree(g, e, (name, gproj, fp32_backward), 0.02)


@interp
def test_interpreter_autograd_function_and_checks():
    q, k, v, do = inputs((2, 1, 20, 16), torch.float32, seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = tfa.triton_attention(*leaves, causal=True, gproj="dq", config=SMALL)
    out.backward(do)
    o, lse = tfa.forward(q, k, v, causal=True, config=SMALL)
    grads = tfa.backward(q, k, v, o, lse, do, causal=True, gproj="dq", config=SMALL)
    assert torch.equal(out.detach(), o)
    for leaf, g in zip(leaves, grads):
        assert torch.equal(leaf.grad, g)
    # scale is honoured (not only 1/sqrt(d))
    r_out = reference(q, k, v, do, False, 0.7)[0]
    assert rel_max(tfa.forward(q, k, v, scale=0.7, config=SMALL)[0], r_out) <= 32 * U[torch.float32]
    with pytest.raises(ValueError, match="n_q == n_k"):
        tfa.forward(q, k[..., :10, :], v[..., :10, :], causal=True, config=SMALL)
    with pytest.raises(ValueError, match="gproj"):
        tfa.triton_attention(q, k, v, gproj="full")
    with pytest.raises(ValueError, match="one dtype"):
        tfa.forward(q, k.half(), v, config=SMALL)
    assert tfa.unavailable_reason("cpu") is None
    assert "interpreter" in tfa.unavailable_reason("cuda")


def test_import_without_triton_and_reasons():
    """The module imports where triton does not, and says why the kernel cannot run."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from attnum.kernels import triton_fa2 as t\n"
            "r = t.unavailable_reason('cpu'); assert r and 'triton is not importable' in r, r\n"
            "print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
    with pytest.raises(ValueError):
        tfa.BlockConfig(fwd_m=8)
    # untuned head dims fall back to 128 x 64 tiles, 4 warps for d <= 64 and 8 above
    assert tfa.default_config(256).num_warps == 8 and tfa.default_config(32).num_warps == 4
    assert (tfa.default_config(32).fwd_m, tfa.default_config(32).fwd_n) == (128, 64)


def test_default_config_table(monkeypatch):
    """The tuned table per (head_dim, causal), GProj's own warps/stages (never tiles), the FP32
    backward's halved tiles, and per-kernel launch fields."""
    for (d, causal), entry in tfa.TUNED_CONFIGS.items():
        cfg = tfa.default_config(d, causal=causal)
        assert {key: getattr(cfg, key) for key in entry if key != "source"} == {
            key: value for key, value in entry.items() if key != "source"}
        assert "source" in entry
    for key, launch in tfa.TUNED_GPROJ_LAUNCH.items():
        # GProj never gets tiles of its own: warps, stages and the schedule switches only
        assert set(launch) <= set(tfa.LAUNCH_FIELDS + tfa.SCHEDULE_FIELDS), key
    d = 128
    base = tfa.default_config(d, causal=True)
    monkeypatch.setitem(tfa.TUNED_GPROJ_LAUNCH, (d, True, "dq"), dict(dq_warps=8, dq_stages=3))
    g = tfa.default_config(d, causal=True, gproj="dq")
    assert g.tiles() == base.tiles() and g.launch("dq") == (8, 3) and g.launch("kv") == base.launch("kv")
    for (d2, causal2, gproj2) in tfa.TUNED_GPROJ_LAUNCH:  # GProj's entries keep GProj off's tiles
        assert tfa.default_config(d2, causal=causal2, gproj=gproj2).tiles() == tfa.default_config(
            d2, causal=causal2).tiles()
    for gproj in tfa.GPROJ_MODES:  # the FP32 backward (ieee, tf32x3) keeps the default order; bf16x3 the table's
        for fp32_dot in ("ieee", "tf32x3"):
            f = tfa.default_config(d, fp32_backward=True, causal=False, gproj=gproj, fp32_dot=fp32_dot)
            assert (f.dq_overlap, f.kv_overlap) == (False, False), (gproj, fp32_dot)
        x3 = tfa.default_config(d, fp32_backward=True, causal=False, gproj=gproj, fp32_dot="bf16x3")
        assert x3 == dataclasses.replace(tfa.default_config(d, causal=False, gproj=gproj), dq_exp2=False,
                                         kv_exp2=False)
    monkeypatch.delitem(tfa.TUNED_GPROJ_LAUNCH, (d, True, "dq_dk"), raising=False)
    assert tfa.default_config(d, causal=True, gproj="dq_dk") == base  # a mode without an entry: GProj off's
    f = tfa.default_config(d, fp32_backward=True, causal=True)
    assert (f.dq_m, f.dq_n, f.kv_n, f.kv_m) == (min(base.dq_m, 64), max(16, min(base.dq_n, 64) // 2),
                                                min(base.kv_n, 64), max(16, min(base.kv_m, 64) // 2))
    assert f.launch("dq")[1] == 1 and f.launch("kv")[1] == 1
    monkeypatch.setitem(tfa.TUNED_FP32_BWD, (d, True), dict(dq_m=32, dq_n=16, kv_n=32, kv_m=16, dq_warps=2,
                                                            dq_stages=2, kv_warps=4, kv_stages=1, source="test"))
    f = tfa.default_config(d, fp32_backward=True, causal=True)
    assert (f.dq_m, f.dq_n, f.kv_n, f.kv_m, f.launch("dq"), f.launch("kv")) == (32, 16, 32, 16, (2, 2), (4, 1))
    # per-kernel fields fall back to the shared ones; existing field names keep working
    c = tfa.BlockConfig(num_warps=8, fwd_stages=4, bwd_stages=1, kv_warps=2, dq_stages=3)
    assert c.launch("fwd") == (8, 4) and c.launch("dq") == (8, 3) and c.launch("kv") == (2, 1)
    with pytest.raises(ValueError):
        tfa.BlockConfig(dq_warps=3)
    with pytest.raises(ValueError):
        tfa.BlockConfig(kv_stages=0)


def test_tune_picker_on_a_synthetic_sweep():
    """``pick_configs`` takes the fastest ok and correct case per kernel, GProj's warps/stages only at
    the chosen tiles, and ``format_tables`` prints tables that ``default_config`` can use."""
    from attnum.kernels import triton_fa2_tune as tune

    base = dict(vars(tfa.BlockConfig()))

    def case(part, change, ms, status="ok", correct=True, d=64, causal=False, fp32_dot="ieee"):
        return {"d": d, "causal": causal, "part": part, "fp32_dot": fp32_dot, "status": status, "correct": correct,
                "ms": ms, "config": {**base, **change}}

    cases = [case("fwd", dict(fwd_m=128, fwd_n=64, fwd_warps=8, fwd_stages=2), 2.0),
             case("fwd", dict(fwd_m=64, fwd_n=64, fwd_warps=4, fwd_stages=3), 1.5),
             case("fwd", dict(fwd_m=128, fwd_n=128, fwd_warps=8, fwd_stages=3), 1.0, correct=False),  # wrong
             case("fwd", dict(fwd_m=128, fwd_n=128, fwd_warps=4, fwd_stages=4), 0.5, status="error"),
             case("dq", dict(dq_m=64, dq_n=64, dq_warps=4, dq_stages=2), 3.0),
             case("dq", dict(dq_m=128, dq_n=64, dq_warps=8, dq_stages=2), 2.5),
             case("kv", dict(kv_n=64, kv_m=64, kv_warps=4, kv_stages=2), 4.0),
             case("kv", dict(kv_n=128, kv_m=64, kv_warps=8, kv_stages=3), 4.5),
             # GProj: fastest at another tile is ignored; at the chosen tile 4 warps / 3 stages wins
             case("dq_gproj", dict(dq_m=64, dq_n=64, dq_warps=4, dq_stages=2), 1.0),
             case("dq_gproj", dict(dq_m=128, dq_n=64, dq_warps=8, dq_stages=2), 2.9),
             case("dq_gproj", dict(dq_m=128, dq_n=64, dq_warps=4, dq_stages=3), 2.7),
             case("kv_gproj", dict(kv_n=64, kv_m=64, kv_warps=4, kv_stages=2), 4.4),  # same launch as off
             case("dq_fp32", dict(dq_m=64, dq_n=32, dq_warps=4, dq_stages=1), 9.0),
             case("dq_fp32", dict(dq_m=64, dq_n=32, dq_warps=8, dq_stages=1), 5.0, fp32_dot="tf32x3"),
             case("kv_fp32", dict(kv_n=64, kv_m=32, kv_warps=4, kv_stages=2), 12.0),
             # a shape with no correct dq measurement is not tuned
             case("fwd", dict(fwd_m=64, fwd_n=64), 1.0, d=128),
             case("dq", dict(dq_m=64, dq_n=64), 1.0, d=128, correct=False),
             case("kv", dict(kv_n=64, kv_m=64), 1.0, d=128)]
    sweep = {"environment": {"time_utc": "2026-12-02T00:00:00Z"}, "n": 8192, "cases": cases}
    picked = tune.pick_configs(sweep)
    assert list(picked["configs"]) == [(64, False)]
    cfg = picked["configs"][64, False]
    assert (cfg["fwd_m"], cfg["fwd_n"], cfg["fwd_warps"], cfg["fwd_stages"]) == (64, 64, 4, 3)
    assert (cfg["dq_m"], cfg["dq_n"], cfg["dq_warps"], cfg["dq_stages"]) == (128, 64, 8, 2)
    assert (cfg["kv_n"], cfg["kv_m"], cfg["kv_warps"], cfg["kv_stages"]) == (64, 64, 4, 2)
    assert picked["gproj_launch"] == {(64, False, "dq"): dict(dq_warps=4, dq_stages=3),
                                      (64, False, "dq_dk"): dict(dq_warps=4, dq_stages=3)}
    assert picked["fp32_bwd"][64, False]["dq_warps"] == 4  # ieee's best, not tf32x3's
    assert any("d=128" in note and "not tuned" in note for note in picked["notes"])
    assert any("tf32x3" in note for note in picked["notes"])
    # the printed tables are Python that default_config reads as they are
    namespace = {}
    exec(tune.format_tables(picked), namespace)
    assert namespace["TUNED_CONFIGS"] == picked["configs"]
    saved = (dict(tfa.TUNED_CONFIGS), dict(tfa.TUNED_GPROJ_LAUNCH), dict(tfa.TUNED_FP32_BWD))
    try:
        for table, name in zip(saved, ("TUNED_CONFIGS", "TUNED_GPROJ_LAUNCH", "TUNED_FP32_BWD")):
            getattr(tfa, name).clear()
            getattr(tfa, name).update(namespace[name])
        c = tfa.default_config(64, causal=False, gproj="dq")
        assert c.tiles() == tfa.default_config(64).tiles() and c.launch("dq") == (4, 3)
        assert tfa.default_config(64, fp32_backward=True).launch("kv") == (4, 2)
    finally:
        for table, name in zip(saved, ("TUNED_CONFIGS", "TUNED_GPROJ_LAUNCH", "TUNED_FP32_BWD")):
            getattr(tfa, name).clear()
            getattr(tfa, name).update(table)


def test_bench_summary_ratios():
    from attnum.kernels.triton_fa2_bench import summarize

    def case(impl, fwd, bwd, status="ok"):
        return {"impl": impl, "n": 4096, "d": 64, "causal": True, "status": status, "fwd_ms": fwd, "bwd_ms": bwd,
                "fwd_bwd_ms": fwd + bwd}

    (s,) = summarize([case("triton_fa2", 1.0, 3.0), case("flex_attention_compiled", 1.0, 4.0),
                      case("sdpa_flash_attention", 1.0, 3.0), case("triton_fa2_gproj_dq", 1.0, 3.16),
                      case("triton_fa2_gproj_dq_dk", 1.0, 4.0), case("triton_fa2_fp32_backward", 1.0, 15.0),
                      case("triton_fa2_fp32_backward_tf32x3", 1.0, 7.0), case("sdpa_cudnn_attention", 0, 0, "refused"),
                      case("triton_fa2_fp32_backward_bf16x3", 1.0, 10.0)])
    assert s["fwd_bwd_vs_flex"] == pytest.approx(0.8) and s["fwd_bwd_vs_sdpa_flash"] == pytest.approx(1.0)
    assert s["gproj_dq_cost_fwd_bwd"] == pytest.approx(0.04) and s["gproj_dq_dk_cost_bwd"] == pytest.approx(1 / 3)
    assert s["fp32_backward_ratio_fwd_bwd"] == pytest.approx(4.0) and s["fwd_bwd_vs_sdpa_cudnn"] is None
    assert s["meets"] == {"fwd_bwd_vs_flex": True, "gproj_dq_cost": True, "gproj_dq_dk_cost": False,
                          "fp32_backward_ratio": False, "fp32_backward_tf32x3_ratio": True,
                          "fp32_backward_bf16x3_ratio": True, "fwd_bwd_vs_fa4": None}
    assert s["fp32_backward_bf16x3_ratio_bwd"] == pytest.approx(10 / 3)
    # FA4 where it was timed: the stretch target is 1.25x its forward + backward time
    (s,) = summarize([case("triton_fa2", 1.0, 3.0), case("fa4", 0.5, 2.0)])
    assert s["fwd_bwd_vs_fa4"] == pytest.approx(1.6) and s["fwd_vs_fa4"] == pytest.approx(2.0)
    assert s["meets"]["fwd_bwd_vs_fa4"] is False and s["meets"]["fwd_bwd_vs_flex"] is None
    (s,) = summarize([case("triton_fa2", 1.0, 3.0), case("fa4", 1.0, 2.5)])
    assert s["meets"]["fwd_bwd_vs_fa4"] is True


def test_bench_table_recomputes_the_summary_from_the_cases():
    """``summary_table`` (``triton_fa2_bench table``): one row per file and shape, sorted by N, d, causality,
    its values recomputed from the cases (a stale stored summary is not read); GProj's extra backward time in
    backward GEMMs is its backward cost times ``BWD_GEMMS``; a side not timed prints "-"."""
    from attnum.kernels.triton_fa2_bench import BWD_GEMMS, TABLE_COLUMNS, summary_table

    def case(impl, n, causal, fwd, bwd):
        return {"impl": impl, "n": n, "d": 128, "causal": causal, "status": "ok", "fwd_ms": fwd, "bwd_ms": bwd,
                "fwd_bwd_ms": fwd + bwd}

    first = {"summary": [{"n": 1, "d": 1, "causal": False, "fwd_bwd_vs_flex": 99.0}],  # stale: not read
             "cases": [case("triton_fa2", 8192, True, 1.0, 7.0), case("triton_fa2_gproj_dq", 8192, True, 1.0, 8.0),
                       case("flex_attention_compiled", 8192, True, 2.0, 8.0)]}
    second = {"cases": [case("triton_fa2", 4096, False, 1.0, 3.5)], "extra_cases": [case("fa4", 4096, False, 1.0, 1.5)]}
    lines = summary_table({"a": first, "b": second}).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == len(TABLE_COLUMNS) + 5
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[:4] for row in rows] == [["4096", "128", "no", "`b`"], ["8192", "128", "yes", "`a`"]]
    col = {label: i + 4 for i, (label, _, _) in enumerate(TABLE_COLUMNS)}
    assert rows[0][col["fwd+bwd / FA4"]] == "1.80" and rows[0][col["fwd+bwd / Flex"]] == "-"
    assert rows[1][col["fwd+bwd / Flex"]] == "0.80" and rows[1][col["GProj dq"]] == "+12.5%"
    assert float(rows[1][col["dq: extra bwd GEMMs"]]) == pytest.approx(BWD_GEMMS * (8.0 / 7.0 - 1), abs=0.005)
    assert rows[1][col["GProj dq_dk"]] == "-"


def test_bench_bound_is_the_rate_of_the_gemms_executed():
    """``gproj_bound`` (``triton_fa2_bench bound``): a backward's rate is its tile GEMMs (7 GProj off, 8 under "dq",
    9 under "dq_dk"; each half the forward's 4 N^2 d per head) over its time; the rate GProj needs is those GEMMs
    over B + c T (c = +5% / +15%, T the GProj-off forward + backward); other kernels keep the bench's count."""
    from attnum.kernels.triton_fa2_bench import BOUND_COLUMNS, bound_table, gproj_bound

    n, d, bh = 1024, 64, 4
    gemm = 4.0 * n * n * d * bh / 2  # one tile GEMM over the whole shape, non-causal

    def case(impl, bwd, fwd_bwd, status="ok", **extra):
        return {"impl": impl, "n": n, "d": d, "causal": False, "status": status, "batch": 2, "heads": 2,
                "bwd_ms": bwd, "fwd_bwd_ms": fwd_bwd, **extra}

    cases = [case("triton_fa2", 2.0, 3.0), case("triton_fa2_gproj_dq", 2.5, 3.5),
             case("triton_fa2_gproj_dq_dk", 4.0, 5.0, status="error"), case("fa4", 1.0, 1.5, bwd_tflops=123.0)]
    (s,) = gproj_bound(cases)
    assert s["off_bwd_exec_tflops"] == pytest.approx(7 * gemm / 2.0e-3 / 1e12)
    assert s["gproj_dq_exec_tflops"] == pytest.approx(8 * gemm / 2.5e-3 / 1e12)
    assert s["gproj_dq_needed_exec_tflops"] == pytest.approx(8 * gemm / (2.0 + 0.05 * 3.0) / 1e-3 / 1e12)
    assert s["gproj_dq_dk_needed_exec_tflops"] == pytest.approx(9 * gemm / (2.0 + 0.15 * 3.0) / 1e-3 / 1e12)
    assert s["gproj_dq_dk_exec_tflops"] is None and s["sdpa_cudnn_bwd_tflops"] is None
    assert s["fa4_bwd_tflops"] == 123.0
    # causal shapes count half the FLOPs; a shape without a GProj-off case has no row
    (c,) = gproj_bound([{**case("triton_fa2", 2.0, 3.0), "causal": True}, {**case("fa4", 1.0, 1.5), "n": 2048}])
    assert c["causal"] and c["off_bwd_exec_tflops"] == pytest.approx(s["off_bwd_exec_tflops"] / 2)
    lines = bound_table({"x": {"cases": cases[:3], "extra_cases": cases[3:]}}).splitlines()
    row = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert len(lines) == 3 and len(row) == len(BOUND_COLUMNS) + 4
    assert row[4:] == [f"{s[key]:.0f}" if s[key] is not None else "-" for _, key in BOUND_COLUMNS]


def test_bench_gproj_table_reads_the_paired_summaries():
    """``gproj_table`` (``triton_fa2_bench gproj-table``): one row per file and shape, sorted, each mode's median
    cost and its range in percent from the file's ``gproj_summary``; "-" for a mode not timed."""
    from attnum.kernels.triton_fa2_bench import gproj_table

    def cost(median, lo, hi):
        return {"median": median, "lo": lo, "hi": hi}

    a = {"gproj_summary": [{"n": 8192, "d": 64, "causal": True, "gproj_dq_fwd_bwd": cost(0.1, -0.02, 0.125)}]}
    b = {"gproj_summary": [{"n": 4096, "d": 128, "causal": False, "gproj_dq_fwd_bwd": cost(0.05, 0.01, 0.2),
                            "gproj_dq_dk_fwd_bwd": cost(0.25, 0.2, 0.3)}]}
    lines = gproj_table({"a": a, "b": b}).splitlines()
    assert lines[2] == "| 4096 | 128 | no | `b` | +5.0% [+1.0, +20.0] | +25.0% [+20.0, +30.0] |"
    assert lines[3] == "| 8192 | 64 | yes | `a` | +10.0% [-2.0, +12.5] | - |" and len(lines) == 4


def test_bench_names_fa4_as_unavailable_on_a_machine_without_it():
    from attnum.kernels.triton_fa2_bench import EXTRA_IMPLS, fa4_unavailable

    reason = fa4_unavailable()
    assert isinstance(reason, str) and reason  # CPU-only here: no CUDA, or the package is absent
    assert "fa4" in EXTRA_IMPLS  # study 05's bench reader maps only the labels of ``cases``


# tiles (fwd_m, fwd_n, dq_m, dq_n, kv_n, kv_m) with unequal sizes, so the diagonal split meets
# BLOCK_M > BLOCK_N and BLOCK_M < BLOCK_N in both kernels
SPLIT_TILES = [(16, 16, 16, 16, 16, 16), (32, 16, 16, 32, 32, 16), (16, 32, 32, 16, 16, 32)]


@interp
@pytest.mark.parametrize("tiles", SPLIT_TILES, ids=["t16", "mixed_a", "mixed_b"])
@pytest.mark.parametrize("n,d", [(64, 16), (45, 16), (32, 24)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_split_and_even_n_bitwise(tiles, n, d, causal):
    """The causal split (unmasked blocks below the diagonal, masked diagonal blocks), the bounds tail
    and EVEN_N / EVEN_D (masks dropped) give bit for bit the reference path's output, lse and
    gradients (every block masked, as before the split): N a multiple of every tile (64) and not (45);
    d a power of two (16) and not (24, padded to 32)."""
    cfg = tfa.BlockConfig(**dict(zip(tfa.TILE_FIELDS, tiles)))
    q, k, v, do = inputs((1, 2, n, d), torch.float16, seed=n + d + len(tiles))
    out, lse = tfa.forward(q, k, v, causal=causal, config=cfg)
    ref_out, ref_lse = tfa.forward(q, k, v, causal=causal, config=cfg, _split=False)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for gproj, fp32_backward in VARIANTS + [("dq_dk", True)]:
        got = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward, config=cfg)
        ref = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward, config=cfg,
                           _split=False)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            assert torch.equal(g, r), (name, gproj, fp32_backward)


@interp
def test_interpreter_launch_fields_fp32_dot_and_single_kernels():
    """Per-kernel warps/stages never change the arithmetic; ``fp32_dot="tf32x3"`` runs (the CPU
    interpreter computes every dot in fp32 whatever the precision, so there it equals ``"ieee"``);
    ``_only`` launches one backward kernel and gives that kernel's gradients unchanged."""
    q, k, v, do = inputs((1, 2, 40, 16), torch.float16, seed=21)
    other = dataclasses.replace(SMALL, fwd_warps=2, dq_warps=8, kv_warps=1, dq_stages=3, kv_stages=1)
    assert other.launch("dq") == (8, 3) and other.launch("kv") == (1, 1) and other.launch("fwd") == (2, 3)
    out, lse = tfa.forward(q, k, v, causal=True, config=SMALL)
    assert torch.equal(tfa.forward(q, k, v, causal=True, config=other)[0], out)
    for gproj in tfa.GPROJ_MODES:
        ref = tfa.backward(q, k, v, out, lse, do, causal=True, gproj=gproj, config=SMALL)
        got = tfa.backward(q, k, v, out, lse, do, causal=True, gproj=gproj, config=other)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), gproj
        assert torch.equal(tfa.backward(q, k, v, out, lse, do, causal=True, gproj=gproj, config=SMALL,
                                        _only="dq")[0], ref[0])
        if gproj != "dq_dk":  # under dq_dk the dK/dV kernel alone reads r = 0 (timing only)
            assert all(torch.equal(a, b) for a, b in zip(
                tfa.backward(q, k, v, out, lse, do, causal=True, gproj=gproj, config=SMALL, _only="kv")[1:],
                ref[1:]))
    ieee = tfa.backward(q, k, v, out, lse, do, gproj="dq", fp32_backward=True, config=SMALL)
    x3 = tfa.backward(q, k, v, out, lse, do, gproj="dq", fp32_backward=True, config=SMALL, fp32_dot="tf32x3")
    assert all(torch.equal(a, b) for a, b in zip(ieee, x3))
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    tfa.triton_attention(*leaves, fp32_backward=True, fp32_dot="tf32x3", config=SMALL).backward(do.float())
    with pytest.raises(ValueError, match="fp32_dot"):
        tfa.backward(q, k, v, out, lse, do, fp32_backward=True, config=SMALL, fp32_dot="tf32")
    with pytest.raises(ValueError, match="fp32_dot"):
        tfa.triton_attention(q, k, v, fp32_dot="bf16x9")


@interp
def test_interpreter_bf16x3_split_is_exact():
    """``"bf16x3"``'s split, run by the kernels' own ``_split3``: hi + mid + lo is the fp32 value bit for bit,
    over values from 2^-103 to 2^121 (below 2^-103 the lower pieces go subnormal; module docstring), both
    signs, zeros and fp32's largest; hi holds the leading bits
    (|x - hi| at most one bf16 ulp of x: the interpreter's conversion need not round to nearest as the
    GPU's does) and each later piece is at most one bf16 ulp of the piece before."""
    g = torch.Generator().manual_seed(11)
    m = torch.rand(6000, generator=g) + 1.0  # [1, 2): every fp32 significand
    x = torch.ldexp(m * torch.randn(6000, generator=g).sign(), torch.randint(-103, 120, (6000,), generator=g))
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, 1 / 3, 2.0 ** -103, -3.0e38, 1.0 - 2 ** -24])])
    hi, mid, lo = tfa.split3(x)
    assert all(piece.dtype == torch.bfloat16 and piece.shape == x.shape for piece in (hi, mid, lo))
    assert torch.equal(hi.double() + mid.double() + lo.double(), x.double())
    assert torch.equal((hi.float() + mid.float()) + lo.float(), x)

    def ulp(t):  # one bf16 ulp of t: 2^(exponent - 7)
        return torch.ldexp(torch.ones_like(t, dtype=torch.float64), torch.frexp(t.double()).exponent - 8)

    nz = x != 0
    assert ((x.double() - hi.double()).abs()[nz] <= ulp(x)[nz]).all()
    assert ((mid.double().abs() <= ulp(hi.float())) | (mid == 0))[nz].all()
    assert (hi[x == 0] == 0).all() and (mid[x == 0] == 0).all() and (lo[x == 0] == 0).all()
    with pytest.raises(ValueError, match="fp32"):
        tfa.split3(x.double())


def test_bf16x3_configuration_and_refusals():
    """``"bf16x3"`` keeps the bf16 kernel's configuration (its fp32 pieces are register operands) but for exp2,
    which the FP32 backward leaves off; the ieee FP32 backward halves the backward tiles. A non-bf16 input is
    refused by name before any work."""
    for d, causal in ((64, False), (64, True), (128, False), (128, True), (96, False)):
        bf16 = tfa.default_config(d, causal=causal, gproj="dq")
        assert tfa.default_config(d, True, causal=causal, gproj="dq", fp32_dot="bf16x3") == dataclasses.replace(
            bf16, dq_exp2=False, kv_exp2=False)
        ieee = tfa.default_config(d, True, causal=causal, gproj="dq")
        assert ieee.dq_n < bf16.dq_n and ieee.kv_m < bf16.kv_m
    with pytest.raises(ValueError, match="fp32_dot"):
        tfa.default_config(64, True, fp32_dot="bf16")
    if tfa.triton is None:
        return
    q = torch.zeros(1, 1, 16, 16, dtype=torch.float16)
    lse = torch.zeros(1, 1, 16)
    for call in (lambda: tfa.backward(q, q, q, q, lse, q, fp32_backward=True, fp32_dot="bf16x3"),
                 lambda: tfa.triton_attention(q, q, q, fp32_backward=True, fp32_dot="bf16x3"),
                 lambda: tfa.dot_f32_tile(torch.zeros(16, 16), q[0, 0], "bf16x3")):
        if INTERP_SKIP is None or CUDA:
            with pytest.raises(ValueError, match="bf16x3.*bf16"):
                call()


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_tma_bitwise(dtype, causal, monkeypatch):
    """``BlockConfig.tma``: the inner loops' unmasked tiles through tensor descriptors give bit for bit the
    pointer loads' output, lse and gradients (N a multiple of the tiles and not, unequal tiles), and the
    descriptors are really read (the interpreter's descriptor loads are counted), at the rows of the
    [B*H*N, d] view a tile starts at; the reference path (every load masked) reads none."""
    from triton.runtime import interpreter

    rows = []
    original = interpreter.InterpreterBuilder.create_descriptor_load

    def counted(self, desc, indices, *args, **kwargs):
        rows.append((tuple(desc.block_shape), int(indices[0].data.reshape(-1)[0])))
        return original(self, desc, indices, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_descriptor_load", counted)
    base = tfa.BlockConfig(**dict(zip(tfa.TILE_FIELDS, SPLIT_TILES[1])))  # fwd 32 x 16, dq 16 x 32, kv 32 x 16
    on = dataclasses.replace(base, tma=True)
    for n in (64, 45):
        q, k, v, do = inputs((1, 2, n, 16), dtype, seed=n + 3)
        rows.clear()
        out, lse = tfa.forward(q, k, v, causal=causal, config=base)
        assert not rows
        got = tfa.forward(q, k, v, causal=causal, config=on)
        assert torch.equal(got[0], out) and torch.equal(got[1], lse), n
        assert rows and {shape for shape, _ in rows} == {(base.fwd_n, 16)}
        assert all(row % n % base.fwd_n == 0 and row % n + base.fwd_n <= n for _, row in rows), rows
        for gproj, fp32_backward in VARIANTS + [("dq_dk", True)]:
            if fp32_backward and dtype == torch.float32:
                continue
            ref = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                               config=base)
            rows.clear()
            got = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                               config=on)
            for name, g, r in zip(("dq", "dk", "dv"), got, ref):
                assert torch.equal(g, r), (n, name, gproj, fp32_backward)
            # both kernels read descriptors when N is a multiple of the tiles; at N = 45 the dK/dV kernel's
            # causal query blocks may all be diagonal or in the tail, hence masked
            shapes, expected = {shape for shape, _ in rows}, {(base.dq_n, 16), (base.kv_m, 16)}
            assert rows and shapes <= expected and (n != 64 or shapes == expected), rows
        rows.clear()
        ref_out, _ = tfa.forward(q, k, v, causal=causal, config=on, _split=False)
        assert torch.equal(ref_out, out) and not rows


def test_tma_configuration_and_refusals():
    """``tma`` is a bool, off in a bare BlockConfig and in every untuned default; ``--same-numerics`` parses it;
    a head dim that is not a power of two >= 16 or a misaligned tensor is refused by name before any launch
    when a ``config=`` asks for TMA (on the CPU interpreter, which runs descriptors, and on CUDA), while the
    tuned default (``config=None``) loads such tensors through pointers and gives the aligned copy's bits."""
    from attnum.kernels import triton_fa2_tune as tune

    assert tfa.BlockConfig().tma is False
    assert not any(tfa.BlockConfig().uses_tma(kernel) for kernel in ("fwd", "dq", "kv"))
    mixed = tfa.BlockConfig(tma=True, kv_tma=False)  # a kernel's own switch over the shared one
    assert (mixed.uses_tma("fwd"), mixed.uses_tma("dq"), mixed.uses_tma("kv")) == (True, True, False)
    assert tfa.BlockConfig(dq_tma=True).uses_tma("dq") and not tfa.BlockConfig(dq_tma=True).uses_tma("fwd")
    with pytest.raises(ValueError, match="kernel must be"):
        mixed.uses_tma("bwd")
    untuned = [tfa.default_config(96, causal=c) for c in (False, True)]  # no table entry: no TMA
    assert not any(cfg.uses_tma(kernel) for cfg in untuned for kernel in ("fwd", "dq", "kv"))
    with pytest.raises(ValueError, match="tma"):
        tfa.BlockConfig(tma=1)
    with pytest.raises(ValueError, match="fwd_tma"):
        tfa.BlockConfig(fwd_tma=1)
    assert tune.parse_change("tma=1,dq_warps=None,fwd_m=64") == dict(tma=True, dq_warps=None, fwd_m=64)
    assert tune.parse_change("kv_tma=true,fwd_tma=None") == dict(kv_tma=True, fwd_tma=None)
    assert tune.parse_change("tma=false") == dict(tma=False) and tune.parse_change("") == {}
    for bad in ("tma=2", "tma", "no_such_field=1"):
        with pytest.raises(SystemExit):
            tune.parse_change(bad)
    if tfa.triton is None or (INTERP_SKIP is not None and not CUDA):
        return
    device = "cuda" if CUDA else "cpu"
    cfg = dataclasses.replace(SMALL, tma=True)
    q = torch.zeros(1, 1, 16, 24, dtype=torch.float16, device=device)
    lse = torch.zeros(1, 1, 16, device=device)
    for call in (lambda: tfa.forward(q, q, q, config=cfg), lambda: tfa.backward(q, q, q, q, lse, q, config=cfg),
                 lambda: tfa.triton_attention(q, q, q, config=cfg)):
        with pytest.raises(ValueError, match="tma=True needs a head dim that is a power of two >= 16"):
            call()
    if CUDA and torch.cuda.get_device_capability()[0] < 9:
        return  # the capability refusal comes first there (test_gpu_tma_bitwise)
    flat = torch.zeros(16 * 16 + 1, dtype=torch.float16, device=device)
    shifted = flat[1:].view(1, 1, 16, 16)  # contiguous, 2 bytes past an aligned address
    with pytest.raises(ValueError, match="16-byte aligned"):
        tfa.forward(shifted, shifted, shifted, config=cfg)
    # the tuned default of a head dim whose entry turns TMA on: refused when asked for by config=, and
    # loaded through pointers, with the same bits, when left to the default
    d = next(dim for (dim, causal), entry in tfa.TUNED_CONFIGS.items() if not causal and entry.get("fwd_tma"))
    tuned = tfa.default_config(d)
    assert tuned.uses_tma("fwd")
    assert tfa._default_tma(tuned, *(torch.zeros(1, 1, 16, d, device=device, dtype=torch.bfloat16)
                                     for _ in range(3))) == tuned
    for dtype in (torch.float32, torch.float16):  # not run on a GPU with descriptors: pointer loads
        other = tfa._default_tma(tuned, *(torch.zeros(1, 1, 16, d, device=device, dtype=dtype) for _ in range(3)))
        assert not any(other.uses_tma(kernel) for kernel in ("fwd", "dq", "kv")), dtype
    fp32 = tfa._default_tma(tuned, *(torch.zeros(1, 1, 16, d, device=device) for _ in range(3)))
    assert dataclasses.replace(fp32, fwd_tma=None, dq_tma=None, kv_tma=None, tma=tuned.tma) == dataclasses.replace(
        tuned, fwd_tma=None, dq_tma=None, kv_tma=None)  # only the switches change
    flat = torch.randn(2 * 32 * d + 1, device=device).to(torch.float16)
    qs, ks = (flat[1 + i * 32 * d:1 + (i + 1) * 32 * d].view(1, 1, 32, d) for i in range(2))
    assert qs.is_contiguous() and qs.data_ptr() % 16 and ks.data_ptr() % 16
    with pytest.raises(ValueError, match="16-byte aligned"):
        tfa.forward(qs, ks, ks, config=tuned)
    assert not any(tfa._default_tma(tuned, qs, ks).uses_tma(kernel) for kernel in ("fwd", "dq", "kv"))
    out, lse = tfa.forward(qs, ks, ks)
    ref_out, ref_lse = tfa.forward(qs.clone(), ks.clone(), ks.clone())
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    grads = tfa.backward(qs, ks, ks, out, lse, qs)
    assert all(torch.equal(g, r) for g, r in zip(grads, tfa.backward(qs.clone(), ks.clone(), ks.clone(), out, lse,
                                                                        qs.clone())))


def test_tune_records_tma_part_and_picks_each_kernels_switch(tmp_path):
    """``pick_configs`` reports the ``tma`` part's on/off times per kernel and turns a kernel's own switch on only
    where TMA loads saved at least 1 - ``TMA_GAIN``; the bench's ``apply_tables`` merges the switches into the
    existing entries."""
    import json

    from attnum.kernels import triton_fa2_tune as tune

    base = dict(vars(tfa.BlockConfig()))
    assert "tma" in tune.PARTS and "tma" not in tune.DEFAULT_PARTS
    cases = [{"d": 64, "causal": True, "part": part, "fp32_dot": "ieee", "status": "ok", "correct": True, "ms": ms,
              "config": {**base, **change}}
             for part, change, ms in (("fwd", {}, 2.0), ("dq", {}, 3.0), ("kv", {}, 4.0),
                                      ("fwd_tma", {}, 2.0), ("fwd_tma", {"tma": True}, 1.5),
                                      ("dq_tma", {}, 3.0), ("dq_tma", {"tma": True}, 3.5))]
    cases.append({**cases[-1], "part": "kv_tma", "status": "error", "ms": None})
    picked = tune.pick_configs({"environment": {"time_utc": "t"}, "n": 8192, "cases": cases})
    assert picked["tma"] == {(64, True): {"fwd": {"off": 2.0, "on": 1.5}, "dq": {"off": 3.0, "on": 3.5}}}
    assert "tma" not in picked["configs"][64, True] and "fwd_tma" not in picked["configs"][64, True]
    assert picked["tma_flags"] == {(64, True): {"fwd_tma": True, "dq_tma": False}}  # kv: no "on" measurement
    assert picked["configs"][64, True]["fwd_m"] == base["fwd_m"]
    assert any("fwd at the default tiles, tma off 2.0 ms, on 1.5 ms" in note for note in picked["notes"])
    assert "(64, True)" in tune.format_tables(picked).splitlines()[-1]
    # a kernel's own switch decides over the shared one (an entry may already carry switches)
    own = [dict(c, config={**c["config"], "tma": True, "dq_tma": c["config"].get("tma", False) is True})
           if c["part"] == "dq_tma" else c for c in cases]
    assert tune.pick_configs({"environment": {"time_utc": "t"}, "n": 8192, "cases": own})["tma"][64, True]["dq"] == {
        "off": 3.0, "on": 3.5}
    # a saving under 1 - TMA_GAIN leaves the switch off
    near = [dict(c, ms=2.0 * (tune.TMA_GAIN + 0.005)) if c["part"] == "fwd_tma" and c["config"].get("tma") else c
            for c in cases]
    assert tune.pick_configs({"environment": {"time_utc": "t"}, "n": 8192, "cases": near})["tma_flags"][64, True][
        "fwd_tma"] is False
    from attnum.kernels import triton_fa2_bench as bench

    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"environment": {"time_utc": "t"}, "n": 8192, "cases": cases}))
    saved = (dict(tfa.TUNED_CONFIGS), dict(tfa.TUNED_GPROJ_LAUNCH), dict(tfa.TUNED_FP32_BWD))
    try:
        tfa.TUNED_CONFIGS[64, True] = dict(tfa.TUNED_CONFIGS[64, True])
        bench.apply_tables(tfa, [path])
        cfg = tfa.default_config(64, causal=True)
        assert cfg.uses_tma("fwd") and not cfg.uses_tma("dq") and not cfg.uses_tma("kv")
    finally:
        for table, old in zip((tfa.TUNED_CONFIGS, tfa.TUNED_GPROJ_LAUNCH, tfa.TUNED_FP32_BWD), saved):
            table.clear()
            table.update(old)


@interp
def test_interpreter_heavy_first_reverses_the_query_blocks_and_keeps_the_bits():
    """``BlockConfig.heavy_first``: a query-outer program owns block ``n_blocks - 1 - pid`` (each block exactly
    once), and the causal forward and backward give bit for bit the grid-order outputs (N a multiple of the
    tiles and not, every GProj mode and the FP32 backward); it is refused as a non-bool and leaves
    non-causal launches alone."""
    import triton
    import triton.language as tl

    @triton.jit
    def owner(OUT, HEAVY_FIRST: tl.constexpr):
        tl.store(OUT + tl.program_id(0), tfa._query_block(HEAVY_FIRST))

    for heavy_first, expected in ((False, list(range(7))), (True, list(range(6, -1, -1)))):
        got = torch.full((7,), -1, dtype=torch.int32)
        owner[(7,)](got, HEAVY_FIRST=heavy_first)
        assert got.tolist() == expected
    base = tfa.BlockConfig(**dict(zip(tfa.TILE_FIELDS, SPLIT_TILES[1])))  # fwd 32 x 16, dq 16 x 32, kv 32 x 16
    on = dataclasses.replace(base, heavy_first=True)
    for n, causal in ((64, True), (45, True), (45, False)):
        q, k, v, do = inputs((1, 2, n, 16), torch.float16, seed=n + 11)
        out, lse = tfa.forward(q, k, v, causal=causal, config=base)
        got = tfa.forward(q, k, v, causal=causal, config=on)
        assert torch.equal(got[0], out) and torch.equal(got[1], lse), n
        for gproj, fp32_backward in VARIANTS:
            ref = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                               config=base)
            got = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                               config=on)
            for name, g, r in zip(("dq", "dk", "dv"), got, ref):
                assert torch.equal(g, r), (n, causal, name, gproj, fp32_backward)
    with pytest.raises(ValueError, match="heavy_first"):
        tfa.BlockConfig(heavy_first=1)
    assert tfa.BlockConfig().heavy_first is False


def test_tune_order_part_and_its_pick(tmp_path):
    """``--parts=order`` is opt-in; ``pick_configs`` reports the forward's and dQ kernel's times with
    ``heavy_first`` off and on and turns the one switch on only where their sum fell by at least
    1 - ``ORDER_GAIN``; ``apply_tables`` merges it into the existing entry; ``--base`` parses like
    ``--same-numerics``."""
    import json

    from attnum.kernels import triton_fa2_tune as tune

    assert "order" in tune.PARTS and "order" not in tune.DEFAULT_PARTS
    base = dict(vars(tfa.BlockConfig()))

    def cases(times):
        return [{"d": 128, "causal": True, "part": part, "fp32_dot": "ieee", "status": "ok", "correct": True,
                 "ms": ms, "config": {**base, "heavy_first": on}}
                for (part, on), ms in times.items()]

    faster = {("fwd_order", False): 2.0, ("fwd_order", True): 1.8, ("dq_order", False): 3.0,
              ("dq_order", True): 3.05}
    picked = tune.pick_configs({"environment": {"time_utc": "t"}, "n": 8192, "cases": cases(faster)})
    assert picked["order"] == {(128, True): {"fwd": {"off": 2.0, "on": 1.8}, "dq": {"off": 3.0, "on": 3.05}}}
    assert picked["order_flags"] == {(128, True): {"heavy_first": True}}  # 4.85 <= 0.99 * 5.0
    near = {**faster, ("fwd_order", True): 1.97}  # 5.02 > 4.95
    assert tune.pick_configs({"cases": cases(near)})["order_flags"] == {(128, True): {"heavy_first": False}}
    paired = cases(faster)
    for rec, rounds in zip(paired, ([2.0, 2.1, 1.9], [1.8, 2.2, 1.7], [3.0, 3.0, 3.0], [3.05, 2.9, 3.1])):
        rec["ms_rounds"] = rounds
    notes = tune.pick_configs({"cases": paired})["notes"]
    assert any("fwd heavy_first off 2.0 ms, on 1.8 ms, on faster in 2 of 3 paired rounds" in n for n in notes)
    assert any("dq heavy_first off 3.0 ms, on 3.05 ms, on faster in 1 of 3 paired rounds" in n for n in notes)
    assert not any("paired" in n for n in picked["notes"])  # single medians: no round count
    half = {key: ms for key, ms in faster.items() if key[0] == "fwd_order"}
    assert tune.pick_configs({"cases": cases(half)})["order_flags"] == {}  # the dQ kernel not measured
    assert "launch order for (128, True)" in tune.format_tables(picked)
    assert tune.parse_change("heavy_first=1,dq_tma=1") == dict(heavy_first=True, dq_tma=True)
    assert tune._rounds("5") == 5
    for bad in ("0", "-2", "x", "1.5"):
        with pytest.raises(SystemExit, match="--rounds must be an integer >= 1"):
            tune._rounds(bad)
    from attnum.kernels import triton_fa2_bench as bench

    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"environment": {"time_utc": "t"}, "n": 8192, "cases": cases(faster)}))
    saved = dict(tfa.TUNED_CONFIGS)
    try:
        tfa.TUNED_CONFIGS[128, True] = {**tfa.TUNED_CONFIGS[128, True], "heavy_first": False}
        bench.apply_tables(tfa, [path])
        assert tfa.default_config(128, causal=True).heavy_first is True
        assert tfa.default_config(128, causal=False).heavy_first == saved[128, False].get("heavy_first", False)
    finally:
        tfa.TUNED_CONFIGS.clear()
        tfa.TUNED_CONFIGS.update(saved)


# -- GPU tests -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [40, 1000])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_matches_fp64(dtype, n, d, causal):
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    q, k, v, do = inputs((2, 3, n, d), dtype, device="cuda", seed=n + d)
    # one rounding of the output / gradients (u/2) after fp32 accumulation, plus the GPU's
    # approximate exp and the order of fp32 sums
    check_against_fp64(q, k, v, do, causal, VARIANTS, None, 4 * U[dtype], 8 * U[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_gproj_sharp_regime(dtype):
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    u = U[dtype]
    errs = {}
    for mu in (0.0, 1e3):
        q, k, v, do = inputs((2, 4, 1000, 64), dtype, device="cuda", seed=7, q_gain=2.0, key_offset=mu)
        r_dq = reference(q, k, v, do, False, 64 ** -0.5)[2]
        out, lse = tfa.forward(q, k, v)
        for gproj, f32 in VARIANTS + [("dq", True)]:
            dq = tfa.backward(q, k, v, out, lse, do, gproj=gproj, fp32_backward=f32)[0]
            errs[mu, gproj, f32] = rel_norm(dq, r_dq)
    big = 1e3
    assert errs[big, "dq", False] < 2 * u, errs
    assert errs[big, "dq_dk", False] < 2 * u, errs
    # at the level of the FP32 backward with GProj and of the no-offset kernel
    assert errs[big, "dq", False] < 2 * errs[big, "dq", True] + u / 4, errs
    assert errs[big, "dq", False] < 2 * errs[0.0, "off", False], errs
    assert errs[big, "off", False] > 20 * errs[big, "dq", False], errs
    # the FP32 backward alone still reads D from the rounded O (see the interpreter test)
    assert errs[big, "off", True] > 5 * errs[big, "dq", False], errs


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_split_matches_reference_path(d, causal):
    """Compiled, the split loops and the dropped masks give the every-block-masked path's bits
    (N a multiple of the default tiles, and not)."""
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    for n in (1000, 1024):
        q, k, v, do = inputs((2, 3, n, d), torch.bfloat16, device="cuda", seed=n + d)
        out, lse = tfa.forward(q, k, v, causal=causal)
        ref_out, ref_lse = tfa.forward(q, k, v, causal=causal, _split=False)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), n
        for gproj, fp32_backward in VARIANTS:
            got = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward)
            ref = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                               _split=False)
            for name, g, r in zip(("dq", "dk", "dv"), got, ref):
                assert torch.equal(g, r), (n, name, gproj, fp32_backward)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_fp32_dot_tf32x3(dtype):
    """The FP32 backward with 3xTF32 dots agrees with the ieee one up to a rare last-bit flip of the
    stored gradient (its products are within a few 2^-22 relative of fp32's), and with fp64."""
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    q, k, v, do = inputs((2, 3, 1000, 128), dtype, device="cuda", seed=5)
    out, lse = tfa.forward(q, k, v, causal=True)
    r_dq, r_dk, r_dv = reference(q, k, v, do, True, 128 ** -0.5)[2:]
    for gproj in tfa.GPROJ_MODES:
        ieee = tfa.backward(q, k, v, out, lse, do, causal=True, gproj=gproj, fp32_backward=True)
        x3 = tfa.backward(q, k, v, out, lse, do, causal=True, gproj=gproj, fp32_backward=True, fp32_dot="tf32x3")
        for name, a, b, r in zip(("dq", "dk", "dv"), ieee, x3, (r_dq, r_dk, r_dv)):
            assert rel_max(b, a.double()) <= 2 * U[dtype], (name, gproj)
            assert (a != b).float().mean().item() <= 0.02, (name, gproj)
            assert rel_max(b, r, r_dv.abs().max().item()) <= 8 * U[dtype], (name, gproj)


@pytest.mark.gpu
def test_gpu_bf16x3_split_and_dot_are_fp32_exact():
    """On the GPU: hi is round-to-nearest bf16(x) and the split is exact; one ``_dot_f32`` with
    ``"bf16x3"`` is ``a @ b`` within fp32 summation error, 2 (K + 2) u_fp32 sum_k |a||b|, which a split
    that dropped ``lo`` (2^-17 relative per product) would exceed."""
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    g = torch.Generator().manual_seed(17)
    m = (torch.rand(100_000, generator=g) + 1.0) * torch.randn(100_000, generator=g).sign()
    x = torch.ldexp(m, torch.randint(-100, 100, (100_000,), generator=g)).cuda()
    hi, mid, lo = tfa.split3(x)
    assert torch.equal(hi, x.bfloat16())
    assert torch.equal(hi.double() + mid.double() + lo.double(), x.double())
    for k in (16, 32):
        a = torch.ldexp(torch.randn(64, k, generator=g), torch.randint(-10, 10, (64, k), generator=g)).cuda()
        b = torch.randn(k, 64, generator=g).bfloat16().cuda()
        exact = a.double() @ b.double()
        bound = 2 * (k + 2) * U[torch.float32] * (a.double().abs() @ b.double().abs())
        err = (tfa.dot_f32_tile(a, b, "bf16x3").double() - exact).abs()
        assert (err <= bound).all(), (k, (err / bound).max().item())
        a_hi, a_mid, _ = tfa.split3(a)
        dropped = (a_hi.double() + a_mid.double()) @ b.double()  # what hi + mid alone would give, exactly
        assert ((dropped - exact).abs() > bound).any(), "the bound would not see a dropped lo piece"


@pytest.mark.gpu
def test_gpu_fp32_dot_bf16x3():
    """The FP32 backward with bf16x3 dots agrees with the ieee one up to a rare last-bit flip of the stored
    bf16 gradient (both are fp32-exact products summed in fp32, at different tiles), and with fp64."""
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    dtype = torch.bfloat16
    for causal, n in ((True, 1000), (False, 512)):
        q, k, v, do = inputs((2, 3, n, 128), dtype, device="cuda", seed=6)
        out, lse = tfa.forward(q, k, v, causal=causal)
        r_dq, r_dk, r_dv = reference(q, k, v, do, causal, 128 ** -0.5)[2:]
        for gproj in tfa.GPROJ_MODES:
            ieee = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=True)
            x3 = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=True,
                              fp32_dot="bf16x3")
            for name, a, b, r in zip(("dq", "dk", "dv"), ieee, x3, (r_dq, r_dk, r_dv)):
                assert rel_max(b, a.double()) <= 2 * U[dtype], (name, gproj, causal)
                assert (a != b).float().mean().item() <= 0.02, (name, gproj, causal)
                assert rel_max(b, r, r_dv.abs().max().item()) <= 8 * U[dtype], (name, gproj, causal)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    tfa.triton_attention(*leaves, fp32_backward=True, fp32_dot="bf16x3").backward(do)
    assert all(torch.equal(t.grad, g) for t, g in zip(leaves, tfa.backward(
        q, k, v, out, lse, do, fp32_backward=True, fp32_dot="bf16x3")))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_heavy_first_bitwise(d):
    """Compiled, ``heavy_first`` (causal query blocks last block first) gives the grid order's out, lse, dq, dk,
    dv bit for bit in bf16 at the default tiles, every GProj mode, N a multiple of the tiles and not."""
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    for n in (1000, 1024):
        q, k, v, do = inputs((2, 3, n, d), torch.bfloat16, device="cuda", seed=n + d + 5)
        for flag in (False, True):
            cfgs = {gproj: dataclasses.replace(tfa.default_config(d, causal=True, gproj=gproj), heavy_first=flag)
                    for gproj in tfa.GPROJ_MODES}
            out, lse = tfa.forward(q, k, v, causal=True, config=cfgs["off"])
            grads = {gproj: tfa.backward(q, k, v, out, lse, do, causal=True, gproj=gproj, config=cfg)
                     for gproj, cfg in cfgs.items()}
            if not flag:
                ref = (out, lse, grads)
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1]), n
        for gproj in tfa.GPROJ_MODES:
            for name, g, r in zip(("dq", "dk", "dv"), grads[gproj], ref[2][gproj]):
                assert torch.equal(g, r), (n, name, gproj)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_tma_bitwise(d, causal):
    """Compiled, ``tma=True`` (descriptor loads of the inner loops' unmasked tiles) gives the pointer loads'
    out, lse, dq, dk, dv bit for bit in bf16 at the default configuration, every GProj mode and the FP32
    backward, N a multiple of the tiles and not. Below compute capability 9.0 it must be refused."""
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    if torch.cuda.get_device_capability()[0] < 9:
        q = torch.zeros(1, 1, 64, d, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="compute capability >= 9.0"):
            tfa.forward(q, q, q, config=dataclasses.replace(tfa.default_config(d), tma=True))
        pytest.skip("tma needs compute capability >= 9.0 (refusal checked)")
    for n in (1000, 1024):
        q, k, v, do = inputs((2, 3, n, d), torch.bfloat16, device="cuda", seed=n + d + 1)
        fwd_cfg = tfa.default_config(d, causal=causal)
        out, lse = tfa.forward(q, k, v, causal=causal, config=fwd_cfg)
        got_out, got_lse = tfa.forward(q, k, v, causal=causal, config=dataclasses.replace(fwd_cfg, tma=True))
        assert torch.equal(got_out, out) and torch.equal(got_lse, lse), n
        for gproj, fp32_backward in VARIANTS:
            cfg = tfa.default_config(d, fp32_backward, causal=causal, gproj=gproj)
            ref = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                               config=cfg)
            got = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                               config=dataclasses.replace(cfg, tma=True))
            for name, g, r in zip(("dq", "dk", "dv"), got, ref):
                assert torch.equal(g, r), (n, name, gproj, fp32_backward)


def test_bench_applies_the_tables_a_sweep_picks(tmp_path):
    """``triton_fa2_bench --tables-from`` times the configuration ``pick_configs`` chooses from the sweep
    files: ``default_config`` returns the picked tiles and launches for that process."""
    import json

    from attnum.kernels import triton_fa2_bench as bench

    base = dict(vars(tfa.BlockConfig()))
    cases = [{"d": 64, "causal": True, "part": part, "fp32_dot": "ieee", "status": "ok", "correct": True, "ms": 1.0,
              "config": {**base, **change}}
             for part, change in (("fwd", dict(fwd_m=64, fwd_n=32, fwd_warps=4, fwd_stages=4)),
                                  ("dq", dict(dq_m=32, dq_n=64, dq_warps=2, dq_stages=3)),
                                  ("kv", dict(kv_n=32, kv_m=32, kv_warps=8, kv_stages=1)))]
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"environment": {"time_utc": "t"}, "n": 8192, "cases": cases}))
    saved = (dict(tfa.TUNED_CONFIGS), dict(tfa.TUNED_GPROJ_LAUNCH), dict(tfa.TUNED_FP32_BWD))
    try:
        applied = bench.apply_tables(tfa, [path])
        cfg = tfa.default_config(64, causal=True)
        assert (cfg.fwd_m, cfg.fwd_n, cfg.dq_m, cfg.dq_n, cfg.kv_n, cfg.kv_m) == (64, 32, 32, 64, 32, 32)
        assert (cfg.launch("fwd"), cfg.launch("dq"), cfg.launch("kv")) == ((4, 4), (2, 3), (8, 1))
        assert applied["configs"]["64,True"]["dq_warps"] == 2
        assert tfa.default_config(64, causal=False).tiles() == tfa.BlockConfig(**{
            k: v for k, v in saved[0][64, False].items() if k != "source"}).tiles()  # other shapes untouched
    finally:
        for table, name in zip(saved, ("TUNED_CONFIGS", "TUNED_GPROJ_LAUNCH", "TUNED_FP32_BWD")):
            getattr(tfa, name).clear()
            getattr(tfa, name).update(table)


@interp
def test_interpreter_overlap_keeps_the_bits():
    """``dq_overlap`` and ``kv_overlap`` (where the backward kernels issue GProj's P~ K and dV's product) give bit
    for bit the default schedule's gradients: causal and not, N a multiple of the tiles and not, every GProj mode
    and the FP32 backward, with the pointer loads and the descriptor loads. Non-bools are refused."""
    base = tfa.BlockConfig(**dict(zip(tfa.TILE_FIELDS, SPLIT_TILES[1])))  # fwd 32 x 16, dq 16 x 32, kv 32 x 16
    for n, causal, tma in ((64, True, False), (45, True, True), (45, False, False), (64, False, True)):
        q, k, v, do = inputs((1, 2, n, 16), torch.float16, seed=n + 23)
        cfg = dataclasses.replace(base, tma=tma)
        on = dataclasses.replace(cfg, dq_overlap=True, kv_overlap=True)
        out, lse = tfa.forward(q, k, v, causal=causal, config=cfg)
        for gproj, fp32_backward in VARIANTS:
            ref = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                               config=cfg)
            got = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward,
                               config=on)
            for name, g, r in zip(("dq", "dk", "dv"), got, ref):
                assert torch.equal(g, r), (n, causal, tma, name, gproj, fp32_backward)
    for name in ("dq_overlap", "kv_overlap"):
        with pytest.raises(ValueError, match=name):
            tfa.BlockConfig(**{name: 1})
        assert getattr(tfa.BlockConfig(), name) is False
    assert {"dq_overlap", "kv_overlap"} <= set(tfa.SCHEDULE_FIELDS)


def test_tune_overlap_part_and_its_pick(tmp_path):
    """``--parts=overlap`` is opt-in; ``pick_configs`` keeps the table's switches (the first case of each part)
    unless another of the four configurations took at most ``OVERLAP_GAIN`` of their time; GProj off's choice
    goes to ``overlap_flags``, the GProj parts' to ``gproj_schedule`` (``dq_overlap`` to both GProj modes,
    ``kvg_overlap`` to ``dq_dk`` only); ``apply_tables`` merges both over the existing entries."""
    import json

    from attnum.kernels import triton_fa2_bench as bench
    from attnum.kernels import triton_fa2_tune as tune

    assert "overlap" in tune.PARTS and "overlap" not in tune.DEFAULT_PARTS
    assert tune._kernel_of("kvg_overlap") == "kv" and tune._part_options("dq_overlap")[0] == "dq"
    base = dict(vars(tfa.BlockConfig()))

    def cases(part, keys, times):
        """``times``: ms per (tma, overlap) in the order recorded, the first the baseline."""
        return [{"d": 64, "causal": False, "part": part, "fp32_dot": "ieee", "status": "ok", "correct": True,
                 "ms": ms, "change": dict(zip(keys, flags)), "config": {**base, **dict(zip(keys, flags))}}
                for flags, ms in times.items()]

    dq = cases("dq_overlap", ("dq_tma", "dq_overlap"),
               {(True, False): 2.0, (False, False): 2.1, (False, True): 2.1, (True, True): 1.9})
    kv = cases("kv_overlap", ("kv_tma", "kv_overlap"),
               {(False, False): 3.0, (False, True): 2.98, (True, False): 3.2, (True, True): 3.1})
    kvg = cases("kvg_overlap", ("kv_tma", "kv_overlap"),
                {(False, False): 4.0, (False, True): 3.5, (True, False): 3.6, (True, True): 3.7})
    picked = tune.pick_configs({"environment": {"time_utc": "t"}, "n": 8192, "cases": dq + kv + kvg})
    # kv: 2.98 > 0.99 * 3.0, so the table's switches stay; dq: 1.9 <= 1.98; kvg: the fastest of the four
    assert picked["overlap_flags"] == {(64, False): {"kv_tma": False, "kv_overlap": False}}
    assert picked["gproj_schedule"] == {(64, False, "dq"): {"dq_tma": True, "dq_overlap": True},
                                        (64, False, "dq_dk"): {"dq_tma": True, "dq_overlap": True,
                                                               "kv_tma": False, "kv_overlap": True}}
    assert picked["overlap"][64, False]["dq_overlap"]["ms"] == {"tma=1 overlap=0": 2.0, "tma=0 overlap=0": 2.1,
                                                                "tma=0 overlap=1": 2.1, "tma=1 overlap=1": 1.9}
    assert picked["overlap"][64, False]["dq_overlap"]["baseline"] == "tma=1 overlap=0"
    for rec, rounds in zip(dq, ([2.0, 2.0, 2.0], [2.1] * 3, [2.1] * 3, [1.9, 2.1, 1.8])):
        rec["ms_rounds"] = rounds
    notes = tune.pick_configs({"cases": dq})["notes"]
    assert any("chosen tma=1 overlap=1, faster than the baseline in 2 of 3 paired rounds" in n for n in notes)
    text = tune.format_tables(picked)
    assert "TMA and overlap for (64, False, 'dq_dk')" in text and "TMA and overlap for (64, False)" in text
    assert tune.parse_change("dq_overlap=1,kv_overlap=false") == dict(dq_overlap=True, kv_overlap=False)
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"environment": {"time_utc": "t"}, "n": 8192, "cases": dq + kv + kvg}))
    saved = (dict(tfa.TUNED_CONFIGS), dict(tfa.TUNED_GPROJ_LAUNCH))
    try:
        tfa.TUNED_CONFIGS[64, False] = {**tfa.TUNED_CONFIGS[64, False], "kv_tma": True, "kv_overlap": True}
        tfa.TUNED_GPROJ_LAUNCH[64, False, "dq_dk"] = dict(dq_warps=4, dq_stages=3)
        bench.apply_tables(tfa, [path])
        off = tfa.default_config(64, causal=False)
        assert (off.kv_tma, off.kv_overlap, off.dq_overlap) == (False, False, False)
        dq_cfg = tfa.default_config(64, causal=False, gproj="dq")
        assert (dq_cfg.dq_tma, dq_cfg.dq_overlap, dq_cfg.kv_overlap) == (True, True, False)
        both = tfa.default_config(64, causal=False, gproj="dq_dk")
        assert (both.dq_tma, both.dq_overlap, both.kv_tma, both.kv_overlap) == (True, True, False, True)
        assert both.launch("dq") == (4, 3)  # the earlier GProj launch kept under the merged switches
        assert both.tiles() == off.tiles()
    finally:
        for table, old in zip((tfa.TUNED_CONFIGS, tfa.TUNED_GPROJ_LAUNCH), saved):
            table.clear()
            table.update(old)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_overlap_bitwise(d, causal):
    """Compiled, ``dq_overlap`` and ``kv_overlap`` give the default schedule's dq, dk, dv bit for bit in bf16 at
    the default tiles, every GProj mode, with the backward kernels' loads through TMA (where the switches move
    the asynchronous products) and through pointers, N a multiple of the tiles and not."""
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA half needs compute capability >= 9.0")
    for n in (1000, 1024):
        q, k, v, do = inputs((2, 3, n, d), torch.bfloat16, device="cuda", seed=n + d + 9)
        out, lse = tfa.forward(q, k, v, causal=causal)
        for gproj in tfa.GPROJ_MODES:
            for tma in (False, True):
                cfg = dataclasses.replace(tfa.default_config(d, causal=causal, gproj=gproj), dq_tma=tma, kv_tma=tma,
                                          dq_overlap=False, kv_overlap=False)
                ref = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, config=cfg)
                got = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj,
                                   config=dataclasses.replace(cfg, dq_overlap=True, kv_overlap=True))
                for name, g, r in zip(("dq", "dk", "dv"), got, ref):
                    assert torch.equal(g, r), (n, name, gproj, tma)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_exp2_matches_fp64_and_stays_near_exp(dtype, causal):
    """``exp2`` (every exponential as exp2, log2 e folded into the scale): the fp64 tolerances of the exp kernel
    hold for the output and every GProj mode's gradients (and the FP32 backward's), N a multiple of the tiles and
    not; against the exp kernel it differs by the one rounding it drops per exponent argument: within a few dozen
    fp32 roundings of the largest value in fp32, within one rounding of the output in fp16."""
    cfg = dataclasses.replace(SMALL, exp2=True)
    out_tol, grad_tol = (4 * U[dtype], 8 * U[dtype]) if dtype == torch.float16 else (32 * U[dtype], 64 * U[dtype])
    variants = VARIANTS if dtype == torch.float16 else VARIANTS[:3]
    for n in (32, 33):
        q, k, v, do = inputs((1, 2, n, 32), dtype, seed=n + 41)
        check_against_fp64(q, k, v, do, causal, variants, cfg, out_tol, grad_tol)
        out_e, lse_e = tfa.forward(q, k, v, causal=causal, config=SMALL)
        out_2, lse_2 = tfa.forward(q, k, v, causal=causal, config=cfg)
        near = 2 * U[dtype] if dtype == torch.float16 else 64 * U[dtype]
        assert rel_max(out_2, out_e.double()) <= near
        assert (lse_2 - lse_e).abs().max().item() <= 64 * U[torch.float32] * max(1.0, lse_e.abs().max().item())
        for gproj in tfa.GPROJ_MODES:
            got = tfa.backward(q, k, v, out_e, lse_e, do, causal=causal, gproj=gproj, config=cfg)
            ref = tfa.backward(q, k, v, out_e, lse_e, do, causal=causal, gproj=gproj, config=SMALL)
            for g, r in zip(got, ref):
                assert rel_max(g, r.double()) <= (4 * U[dtype] if dtype == torch.float16 else 256 * U[dtype])
        # exp2 is engaged: it moves fp32 results (the LSE is fp32 in either dtype)
        assert not torch.equal(lse_2, lse_e)
        if dtype == torch.float32:
            assert not torch.equal(out_2, out_e)
    with pytest.raises(ValueError, match="exp2"):
        tfa.BlockConfig(exp2=1)
    assert tfa.BlockConfig().exp2 is False and "exp2" not in tfa.SCHEDULE_FIELDS


@interp
def test_interpreter_exp2_switch_per_kernel():
    """A kernel's own exp2 switch reaches that kernel alone: ``fwd_exp2`` gives the shared switch's forward and
    leaves the backward bit for bit the exp kernel's; ``dq_exp2`` moves dQ only, ``kv_exp2`` dK and dV only."""
    q, k, v, do = inputs((1, 2, 33, 32), torch.float32, seed=5)
    out_e, lse_e = tfa.forward(q, k, v, config=SMALL)
    out_2, lse_2 = tfa.forward(q, k, v, config=dataclasses.replace(SMALL, exp2=True))
    out_f, lse_f = tfa.forward(q, k, v, config=dataclasses.replace(SMALL, fwd_exp2=True))
    assert torch.equal(out_f, out_2) and torch.equal(lse_f, lse_2) and not torch.equal(lse_f, lse_e)
    ref = tfa.backward(q, k, v, out_e, lse_e, do, config=SMALL)
    fwd_only = tfa.backward(q, k, v, out_e, lse_e, do, config=dataclasses.replace(SMALL, fwd_exp2=True))
    assert all(torch.equal(g, r) for g, r in zip(fwd_only, ref))
    dq_only = tfa.backward(q, k, v, out_e, lse_e, do, config=dataclasses.replace(SMALL, dq_exp2=True))
    assert not torch.equal(dq_only[0], ref[0]) and torch.equal(dq_only[1], ref[1]) and torch.equal(dq_only[2], ref[2])
    kv_only = tfa.backward(q, k, v, out_e, lse_e, do, config=dataclasses.replace(SMALL, kv_exp2=True))
    assert torch.equal(kv_only[0], ref[0]) and not torch.equal(kv_only[1], ref[1])
    # the shared switch with one kernel's own turned off
    mixed = tfa.backward(q, k, v, out_e, lse_e, do, config=dataclasses.replace(SMALL, exp2=True, kv_exp2=False))
    assert torch.equal(mixed[0], dq_only[0]) and torch.equal(mixed[1], ref[1]) and torch.equal(mixed[2], ref[2])


def test_exp2_switches_and_the_tables():
    """``uses_exp2``: a kernel's own switch over the shared one, refused kernel names and non-bool values; the
    tuned entries' exp2 choices reach ``default_config``, the FP32 backward keeps exp (every ``fp32_dot``), and an
    untuned head dim has exp2 nowhere; ``parse_change`` reads the per-kernel switches."""
    from attnum.kernels import triton_fa2_tune as tune

    mixed = tfa.BlockConfig(exp2=True, kv_exp2=False)
    assert (mixed.uses_exp2("fwd"), mixed.uses_exp2("dq"), mixed.uses_exp2("kv")) == (True, True, False)
    assert tfa.BlockConfig(dq_exp2=True).uses_exp2("dq") and not tfa.BlockConfig(dq_exp2=True).uses_exp2("fwd")
    with pytest.raises(ValueError, match="kernel must be"):
        mixed.uses_exp2("bwd")
    for name in ("fwd_exp2", "dq_exp2", "kv_exp2"):
        with pytest.raises(ValueError, match=name):
            tfa.BlockConfig(**{name: 1})
    assert not any(tfa.default_config(96, causal=c).uses_exp2(kernel) for c in (False, True)
                   for kernel in ("fwd", "dq", "kv"))
    for (d, causal), entry in tfa.TUNED_CONFIGS.items():
        for gproj in tfa.GPROJ_MODES:
            cfg = tfa.default_config(d, causal=causal, gproj=gproj)
            assert [cfg.uses_exp2(kernel) for kernel in ("fwd", "dq", "kv")] == [
                entry.get(f"{kernel}_exp2", entry.get("exp2", False)) for kernel in ("fwd", "dq", "kv")]
            for fp32_dot in ("ieee", "tf32x3", "bf16x3"):
                f = tfa.default_config(d, fp32_backward=True, causal=causal, gproj=gproj, fp32_dot=fp32_dot)
                assert f.uses_exp2("fwd") == cfg.uses_exp2("fwd")  # the forward is the bf16 kernel's
                assert not f.uses_exp2("dq") and not f.uses_exp2("kv"), (d, causal, gproj, fp32_dot)
    assert tune.parse_change("fwd_exp2=0,kv_exp2=None,exp2=1") == dict(fwd_exp2=False, kv_exp2=None, exp2=True)
    with pytest.raises(SystemExit):
        tune.parse_change("dq_exp2=2")


def test_tune_picks_exp2_flags_per_kernel():
    """``pick_configs`` reports the exp2 part's off/on times per kernel and calls a kernel's switch on only where
    exp2 took at most ``EXP2_GAIN`` of the time without; GProj's dQ part is reported, never decides; the tables are
    left alone (exp2 changes the arithmetic) and ``format_tables`` prints the choice as a comment."""
    from attnum.kernels import triton_fa2_tune as tune

    base = dict(vars(tfa.BlockConfig()))
    rows = [("fwd", {}, 2.0), ("dq", {}, 3.0), ("kv", {}, 4.0),
            ("fwd_exp2", {"fwd_exp2": False}, 2.0), ("fwd_exp2", {"fwd_exp2": True}, 1.8),
            ("dq_exp2", {"dq_exp2": False}, 3.0), ("dq_exp2", {"dq_exp2": True}, 3.0 * tune.EXP2_GAIN + 0.01),
            ("kv_exp2", {"kv_exp2": False}, 2.188), ("kv_exp2", {"kv_exp2": True}, 2.676),
            ("dqg_exp2", {"dq_exp2": False}, 4.0), ("dqg_exp2", {"exp2": True}, 3.0)]
    cases = [{"d": 128, "causal": True, "part": part, "fp32_dot": "ieee", "status": "ok", "correct": True, "ms": ms,
              "config": {**base, **change}} for part, change, ms in rows]
    picked = tune.pick_configs({"environment": {"time_utc": "t"}, "n": 8192, "cases": cases})
    assert picked["exp2"][128, True] == {"fwd_exp2": {"off": 2.0, "on": 1.8},
                                         "dq_exp2": {"off": 3.0, "on": round(3.0 * tune.EXP2_GAIN + 0.01, 3)},
                                         "kv_exp2": {"off": 2.188, "on": 2.676}, "dqg_exp2": {"off": 4.0, "on": 3.0}}
    assert picked["exp2_flags"] == {(128, True): {"fwd_exp2": True, "dq_exp2": False, "kv_exp2": False}}
    assert not any("exp2" in key for key in picked["configs"][128, True])
    assert "exp2 for (128, True)" in tune.format_tables(picked).splitlines()[-1]


@interp
def test_interpreter_exp2_keeps_gproj_floor():
    """Seed 004, cause 2 under ``exp2``: with a key offset of 1e3, GProj keeps dQ at the fp16 level and the
    uncorrected kernel's error is over 30 times larger, as with exp (the key-offset test above)."""
    cfg = dataclasses.replace(SMALL, exp2=True)
    q, k, v, do = inputs((1, 2, 64, 16), torch.float16, seed=3, q_gain=2.0, key_offset=1e3)
    r_dq = reference(q, k, v, do, False, 0.25)[2]
    out, lse = tfa.forward(q, k, v, config=cfg)
    errs = {gproj: rel_norm(tfa.backward(q, k, v, out, lse, do, gproj=gproj, config=cfg)[0], r_dq)
            for gproj in tfa.GPROJ_MODES}
    assert errs["dq"] < 2 * U[torch.float16] and errs["dq_dk"] < 2 * U[torch.float16], errs
    assert errs["off"] > 30 * errs["dq"], errs


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_exp2_matches_fp64_and_stays_near_exp(d, causal):
    """Compiled in bf16 at the default tiles, ``exp2`` in all three kernels meets the exp kernel's fp64 tolerances
    (every GProj mode, N a multiple of the tiles and not), and its output is within one bf16 rounding of the same
    configuration with exp everywhere. Where the scale 1/sqrt(d) is a power of two (d = 64), the forward's exp2
    argument is the exp lowering's ``fl(fl(s - m) scale fl(log2 e))`` exactly, so the forward gives exp's bits;
    at d = 128 its LSE moves. The backward's argument is a difference either way: dQ moves at both."""
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    base = tfa.default_config(d, causal=causal)
    cfg_e = dataclasses.replace(base, exp2=False, fwd_exp2=False, dq_exp2=False, kv_exp2=False)
    cfg = dataclasses.replace(base, exp2=True, fwd_exp2=None, dq_exp2=None, kv_exp2=None)
    for n in (1000, 1024):
        q, k, v, do = inputs((2, 3, n, d), torch.bfloat16, device="cuda", seed=n + d + 17)
        check_against_fp64(q, k, v, do, causal, VARIANTS[:3], cfg, 4 * U[torch.bfloat16], 8 * U[torch.bfloat16])
        out_e, lse_e = tfa.forward(q, k, v, causal=causal, config=cfg_e)
        out_2, lse_2 = tfa.forward(q, k, v, causal=causal, config=cfg)
        assert rel_max(out_2, out_e.double()) <= 2 * U[torch.bfloat16]
        if math.log2(d) % 2 == 0:  # the scale is a power of two: no rounding to drop in the forward
            assert torch.equal(out_2, out_e) and torch.equal(lse_2, lse_e)
        else:
            assert not torch.equal(lse_2, lse_e)
        dq_e = tfa.backward(q, k, v, out_e, lse_e, do, causal=causal, config=cfg_e)[0]
        dq_2 = tfa.backward(q, k, v, out_e, lse_e, do, causal=causal, config=cfg)[0]
        assert not torch.equal(dq_2, dq_e)  # the backward's exp2 is engaged


def test_tune_gproj_only_sweep_picks_against_its_table(tmp_path):
    """A sweep of the GProj parts alone (no GProj-off tiles of its own) picks GProj's warps/stages against the
    GProj-off configuration it recorded (``default_configs``); ``apply_tables`` merges a launch over an entry's
    schedule switches, and a launch measured equal to GProj off's drops the entry's own warps and stages."""
    import json

    from attnum.kernels import triton_fa2_bench as bench
    from attnum.kernels import triton_fa2_tune as tune

    table = dict(vars(tfa.BlockConfig(dq_m=64, dq_n=64, kv_n=64, kv_m=64, num_warps=4, bwd_stages=2)))

    def case(part, warps, stages, ms):
        kernel = tune._kernel_of(part)
        return {"d": 128, "causal": False, "part": part, "fp32_dot": "ieee", "status": "ok", "correct": True,
                "ms": ms, "ms_rounds": [ms, ms + 0.1, ms - 0.1],
                "config": {**table, f"{kernel}_warps": warps, f"{kernel}_stages": stages}}

    sweep = {"environment": {"time_utc": "t"}, "n": 8192, "default_configs": {"128,0": table},
             "cases": [case("dq_gproj", 4, 2, 3.0), case("dq_gproj", 8, 3, 2.7), case("kv_gproj", 4, 2, 4.0),
                       case("kv_gproj", 8, 2, 4.2)]}
    picked = tune.pick_configs(sweep)
    assert picked["configs"] == {}
    assert picked["gproj_launch"] == {(128, False, "dq"): dict(dq_warps=8, dq_stages=3),
                                      (128, False, "dq_dk"): dict(dq_warps=8, dq_stages=3)}
    assert picked["gproj_launch_same"] == [(128, False, "kv")]
    assert any("dq_gproj best 2.7 ms at {'dq_warps': 8, 'dq_stages': 3} (median of 3 rounds)" in n
               for n in picked["notes"])
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(sweep))
    saved = (dict(tfa.TUNED_CONFIGS), dict(tfa.TUNED_GPROJ_LAUNCH))
    try:
        tfa.TUNED_GPROJ_LAUNCH[128, False, "dq"] = dict(dq_tma=True, dq_overlap=True)
        tfa.TUNED_GPROJ_LAUNCH[128, False, "dq_dk"] = dict(kv_warps=8, kv_stages=3, kv_overlap=True)
        bench.apply_tables(tfa, [path])
        assert tfa.TUNED_GPROJ_LAUNCH[128, False, "dq"] == dict(dq_tma=True, dq_overlap=True, dq_warps=8,
                                                                 dq_stages=3)
        assert tfa.TUNED_GPROJ_LAUNCH[128, False, "dq_dk"] == dict(kv_overlap=True, dq_warps=8, dq_stages=3)
    finally:
        for table_, old in zip((tfa.TUNED_CONFIGS, tfa.TUNED_GPROJ_LAUNCH), saved):
            table_.clear()
            table_.update(old)


def test_bench_gproj_paired_costs_and_summary():
    """``triton_fa2_bench gproj``: each round's cost is ``t_mode / t_off - 1`` of that round's pair, the median
    and extremes are of those paired costs (not a ratio of medians), the interval's coverage is 1 - 2^(1-R), the
    target is read off the median, and malformed rounds are refused."""
    from attnum.kernels import triton_fa2_bench as bench

    off = [2.0, 2.2, 1.8, 2.0, 2.1]
    dq = [2.08, 2.2, 1.98, 2.3, 2.1]  # costs +4%, 0%, +10%, +15%, 0%
    got = bench.paired_costs(off, dq)
    assert got["costs"] == pytest.approx([0.04, 0.0, 0.10, 0.15, 0.0])
    assert got["median"] == pytest.approx(0.04) and got["lo"] == pytest.approx(0.0)
    assert got["hi"] == pytest.approx(0.15) and got["rounds"] == 5 and got["confidence"] == pytest.approx(0.9375)
    # paired, not a ratio of medians (which would give 2.4 / 2.0 - 1 = +20% below)
    assert bench.paired_costs([1.0, 2.0], [1.1, 2.4])["median"] == pytest.approx(0.15)
    for a, b in (([], []), ([1.0], [1.0, 2.0]), ([1.0, 0.0], [1.0, 1.0])):
        with pytest.raises(ValueError):
            bench.paired_costs(a, b)

    def case(mode, fwd_bwd, bwd, n=8192, status="ok"):
        return {"impl": "triton_fa2", "gproj": mode, "n": n, "d": 128, "causal": False, "status": status,
                "fwd_bwd_ms_rounds": fwd_bwd, "bwd_ms_rounds": bwd}

    summary = bench.gproj_summary([case("off", off, [1.0] * 5), case("dq", dq, [1.1] * 5),
                                   case("dq_dk", [x * 1.2 for x in off], [1.3] * 5),
                                   case("off", off, off, n=4096), case("dq", dq, dq, n=4096, status="error")])
    assert [(s["n"], "gproj_dq_fwd_bwd" in s) for s in summary] == [(4096, False), (8192, True)]
    s = summary[1]
    assert s["gproj_dq_bwd"]["median"] == pytest.approx(0.1)
    assert s["gproj_dq_dk_fwd_bwd"]["median"] == pytest.approx(0.2)
    assert s["meets_gproj_dq_cost"] is True  # median +4% <= the 5% target
    over = bench.gproj_summary([case("off", [2.0, 2.0], [1.0, 1.0]), case("dq", [2.2, 2.3], [1.0, 1.0])])
    assert over[0]["meets_gproj_dq_cost"] is False  # +10%, +15%
    assert s["meets_gproj_dq_dk_cost"] is False  # +20% > 15%
    with pytest.raises(SystemExit, match="--rounds must be an integer >= 2"):
        bench.gproj_main("unused.json", rounds=1)


def test_bench_flex_paired_ratios_and_verdicts():
    """``triton_fa2_bench flex``: each round's ratio is ours over Flex of that round's pair; the verdict is "under"
    only when every round was at or under Flex's time, "over" only when every round was over, and a shape missing
    one side (or with an error) is left out of the summary."""
    from attnum.kernels import triton_fa2_bench as bench

    flex = [2.0, 2.0, 2.5, 2.0, 1.6]
    ours = [1.9, 2.1, 2.0, 1.8, 1.6]  # ratios 0.95, 1.05, 0.8, 0.9, 1.0
    got = bench.paired_ratios(flex, ours)
    assert got["ratios"] == pytest.approx([0.95, 1.05, 0.8, 0.9, 1.0])
    assert (got["median"], got["lo"], got["hi"]) == pytest.approx((0.95, 0.8, 1.05))
    assert got["confidence"] == pytest.approx(0.9375)
    with pytest.raises(ValueError):
        bench.paired_ratios([1.0, 2.0], [1.0])

    def case(impl, fwd, fwd_bwd, n=8192, causal=False, status="ok"):
        return {"impl": impl, "n": n, "d": 64, "causal": causal, "status": status, "fwd_ms_rounds": fwd,
                "fwd_bwd_ms_rounds": fwd_bwd}

    summary = bench.flex_summary([
        case("triton_fa2", ours, [0.9, 0.95, 0.99]), case("flex_attention_compiled", flex, [1.0, 1.0, 1.0]),
        case("triton_fa2", [1.2, 1.3], [2.2, 2.4], causal=True),
        case("flex_attention_compiled", [1.0, 1.0], [2.0, 2.0], causal=True),
        case("triton_fa2", [1.0], [1.0], n=4096),
        case("flex_attention_compiled", [1.0], [1.0], n=4096, status="error"),
        case("triton_fa2", [1.0], [1.0], n=16384)])
    assert [(s["n"], s["causal"]) for s in summary] == [(8192, False), (8192, True)]
    mixed, over = summary
    assert mixed["verdict_fwd_vs_flex"] == "not resolved" and mixed["meets_fwd_vs_flex"] is True
    assert mixed["verdict_fwd_bwd_vs_flex"] == "under" and mixed["fwd_bwd_vs_flex"]["hi"] == pytest.approx(0.99)
    assert over["verdict_fwd_vs_flex"] == "over" and over["meets_fwd_bwd_vs_flex"] is False
    assert over["fwd_bwd_vs_flex"]["median"] == pytest.approx(1.15)
    with pytest.raises(SystemExit, match="--rounds must be an integer >= 2"):
        bench.flex_main("unused.json", rounds=0)


def test_bench_paired_commands_refuse_bad_options(monkeypatch):
    """The ``gproj`` and ``flex`` command lines name a malformed option before any GPU work."""
    from attnum.kernels import triton_fa2_bench as bench

    def never(*args, **kwargs):
        raise AssertionError("ran despite a bad option")

    for argv, message in ((["flex", "out.json", "--ns=4096,x"], "take integers"),
                          (["gproj", "out.json", "--rounds=two"], "take integers"),
                          (["flex", "out.json", "--repeats=3"], "usage"),
                          (["flex"], "usage"), (["gproj", "a.json", "--quick"], "usage"),
                          (["gproj", "a.json", "--base=exp2=1"], "usage"),
                          (["flex", "a.json", "--base=warps=4"], "not KEY=VALUE with KEY a BlockConfig field")):
        monkeypatch.setattr(bench.sys, "argv", ["triton_fa2_bench", *argv])
        with pytest.raises(SystemExit, match=message):
            bench._paired_cli(argv[0], never)


def test_bench_environment_records_the_code_version(monkeypatch):
    """The bench and tune JSONs' ``environment`` names the commit the device's export ran (``ATTNUM_GIT_COMMIT``,
    ``ATTNUM_GIT_DIRTY``), and says "unknown" where they are unset."""
    from attnum.kernels import triton_fa2_bench as bench

    monkeypatch.setenv("ATTNUM_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("ATTNUM_GIT_DIRTY", "0")
    env = bench.environment()
    assert (env["git_commit"], env["git_dirty"]) == ("0123abc", "0")
    monkeypatch.delenv("ATTNUM_GIT_COMMIT")
    monkeypatch.delenv("ATTNUM_GIT_DIRTY")
    assert bench.environment()["git_commit"] == "unknown"


@interp
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_rsum_mma_is_the_same_row_sum(causal):
    """``dq_rsum_mma``: GProj's r as dS~ times a column of ones (exact products) gives the register sum's gradients
    up to the order of r's fp32 sum, and the fp64 tolerances; with GProj off, with the FP32 backward and with fp32
    inputs the switch changes nothing (the register sum runs there), bit for bit."""
    on = dataclasses.replace(SMALL, dq_rsum_mma=True)
    q, k, v, do = inputs((1, 2, 45, 16), torch.float16, seed=31, key_offset=30.0)
    out, lse = tfa.forward(q, k, v, causal=causal, config=SMALL)
    for gproj, fp32_backward in VARIANTS + [("dq_dk", True)]:
        a = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward, config=SMALL)
        b = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, fp32_backward=fp32_backward, config=on)
        if gproj == "off" or fp32_backward:
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (gproj, fp32_backward)
        else:
            assert torch.equal(a[2], b[2])  # dV never reads r
            for x, y in zip(a[:2], b[:2]):
                assert rel_max(y, x.double(), x.abs().max().item()) <= 2 * U[torch.float16]
                assert (x != y).float().mean().item() <= 0.02
    check_against_fp64(q, k, v, do, causal, VARIANTS, on, 4 * U[torch.float16], 8 * U[torch.float16])
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))
    out32, lse32 = tfa.forward(q32, k32, v32, causal=causal, config=SMALL)
    for gproj in ("dq", "dq_dk"):
        assert all(torch.equal(x, y) for x, y in zip(
            tfa.backward(q32, k32, v32, out32, lse32, do32, causal=causal, gproj=gproj, config=SMALL),
            tfa.backward(q32, k32, v32, out32, lse32, do32, causal=causal, gproj=gproj, config=on)))


def test_ablation_sources_delete_what_they_name():
    """``triton_fa2_ablate``: each ablation replaces every occurrence of its statements in the kernel's source by
    ``pass`` (P~ K has two, one per overlap order), leaves the rest alone, and refuses a statement the source no
    longer holds."""
    from pathlib import Path

    from attnum.kernels import triton_fa2_ablate as ab

    source = Path(tfa.__file__).read_text()
    assert source.count(ab.ROW_SUM) == 1 and source.count(ab.PK) == 2
    for name, statements in ab.ABLATIONS.items():
        patched = ab.ablated_source(source, statements)
        assert all(statement not in patched for statement in statements), name
        removed = sum(source.count(statement) for statement in statements)
        assert patched.count("pass") == source.count("pass") + removed, name
        kept = [s for s in (ab.ROW_SUM, ab.PK) if s not in statements]
        assert all(patched.count(s) == source.count(s) for s in kept), name
    with pytest.raises(ValueError, match="rewrite the ablation"):
        ab.ablated_source("x = 1\n", (ab.ROW_SUM,))


@interp
def test_ablated_copies_load_and_drop_their_work(tmp_path):
    """An ablated copy loads as a module of its own and runs: without the row sum, GProj "dq" leaves dQ as GProj
    off's (r = 0, so the correction r (P~ K) is zero); with both pieces deleted too; without only P~ K likewise
    (pk = 0), while the kernel as it is does move dQ."""
    from pathlib import Path

    from attnum.kernels import triton_fa2_ablate as ab

    source = Path(tfa.__file__).read_text()
    q, k, v, do = inputs((1, 2, 32, 16), torch.float16, seed=41, key_offset=30.0)
    out, lse = tfa.forward(q, k, v, config=SMALL)
    off = tfa.backward(q, k, v, out, lse, do, gproj="off", config=SMALL, _only="dq")[0]
    assert not torch.equal(tfa.backward(q, k, v, out, lse, do, gproj="dq", config=SMALL, _only="dq")[0], off)
    for name, statements in ab.ABLATIONS.items():
        path = tmp_path / f"triton_fa2_{name}.py"
        path.write_text(ab.ablated_source(source, statements))
        module = ab._load(path, f"_attnum_test_triton_fa2_{name}")
        assert module is not tfa and module.BlockConfig is not tfa.BlockConfig
        dq = module.backward(q, k, v, out, lse, do, gproj="dq", config=SMALL, _only="dq")[0]
        assert torch.equal(dq, off), name


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_rsum_mma_meets_fp64_and_stays_near_the_register_sum(d, causal):
    """Compiled in bf16 at the default tiles, GProj's row sum as a product meets the fp64 tolerances in every GProj
    mode (N a multiple of the tiles and not), and its dQ and dK differ from the register sum's in at most 1 in 1000
    elements, by at most one bf16 ulp at the gradient's largest magnitude (the order of r's sum alone); dV not at
    all."""
    reason = tfa.unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    base = tfa.default_config(d, causal=causal)
    on, off = (dataclasses.replace(base, dq_rsum_mma=flag) for flag in (True, False))
    for n in (1000, 1024):
        q, k, v, do = inputs((2, 3, n, d), torch.bfloat16, device="cuda", seed=n + d + 29, key_offset=20.0)
        check_against_fp64(q, k, v, do, causal, VARIANTS[:3], on, 4 * U[torch.bfloat16], 8 * U[torch.bfloat16])
        out, lse = tfa.forward(q, k, v, causal=causal, config=base)
        for gproj in ("dq", "dq_dk"):
            a = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, config=off)
            b = tfa.backward(q, k, v, out, lse, do, causal=causal, gproj=gproj, config=on)
            assert torch.equal(a[2], b[2]), gproj
            for x, y in zip(a[:2], b[:2]):
                assert rel_max(y, x.double(), x.abs().max().item()) <= 2 * U[torch.bfloat16], gproj
                assert (x != y).float().mean().item() <= 1e-3, gproj


def test_tune_pick_reports_the_row_sum_part():
    """``pick_configs`` reads the ``rsum`` part's cases as a switch (``dq_rsum_mma`` off / on): each side's fastest
    ok and correct case (an incorrect one is never picked); reported only, never merged into a table."""
    from attnum.kernels import triton_fa2_tune as tune

    def case(on, ms, rounds, warps=4, correct=True):
        return {"d": 64, "causal": False, "part": "dqg_rsum", "fp32_dot": "ieee", "status": "ok", "correct": correct,
                "ms": ms, "ms_rounds": rounds, "config": {"dq_rsum_mma": on, "dq_warps": warps}}

    cases = [case(False, 2.2, [2.2, 2.3, 2.1]), case(True, 1.8, [1.8, 1.9, 2.2]), case(True, 1.5, [1.5] * 3, 8, False),
             case(False, 2.4, [2.4] * 3, 8)]
    picked = tune.pick_configs({"cases": cases})
    assert picked["rsum"] == {(64, False): {"off": 2.2, "on": 1.8}}
    assert picked["configs"] == {} and picked["gproj_launch"] == {}
