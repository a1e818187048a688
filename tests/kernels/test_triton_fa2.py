"""Our Triton FlashAttention-2 kernel (``attnum.kernels.triton_fa2``) against fp64 attention.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set below before
triton is imported) at tiny sizes, in fp32 and fp16 (not bf16: the interpreter's tl.dot on bf16
operands gave wrong results on our CPU machine). With CUDA the ``gpu`` tests run the compiled
kernels in bf16 and fp16 and the interpreter tests skip.

Tolerances are multiples of the unit roundoff u of the input format (fp16 2^-11, bf16 2^-8,
fp32 2^-24), applied to max-abs errors normalised by the largest reference value.
"""
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
    assert tfa.default_config(128).num_warps == 8 and tfa.default_config(64).num_warps == 4


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
