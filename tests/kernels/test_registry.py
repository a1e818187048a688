"""The kernel registry: names, the one interface, kernels that cannot run here, pinned SDPA backends."""
import math
from pathlib import Path

import pytest
import torch
import yaml

from attnum import kernels
from attnum.inputs import normal_qkv
from attnum.kernels import AttentionImpl, KernelUnavailable, flash_attention, flash_attention_backward
from attnum.kernels.sdpa import BackendRefused

ROOT = Path(__file__).resolve().parents[2]


def _qkv(n=40, d=16, seed=0):
    return tuple(t.float() for t in normal_qkv(1, 2, n, d, seed=seed))


def test_every_listed_name_builds_a_kernel_of_that_name():
    listed = kernels.names()
    assert {"emulator", "reference", "golden", "textbook", "sdpa", "flex", "triton"} <= {n.split(":")[0] for n in listed}
    for name in listed:
        kernel = kernels.get(name)
        assert isinstance(kernel, kernels.Kernel)
        assert kernels.get(kernel.name).name == kernel.name  # canonical names round-trip


def test_unknown_names_and_options_are_refused_with_the_families_named():
    with pytest.raises(ValueError, match="no family 'flashy'.*emulator"):
        kernels.get("flashy:fa2_bf16")
    with pytest.raises(ValueError, match="unknown precision policy"):
        kernels.get("emulator:fa9_bf16")
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        kernels.get("sdpa:fastest")
    with pytest.raises(ValueError, match="do not apply to 'reference'"):
        kernels.get("reference:fp32", mask_fill=-5e4)
    with pytest.raises(ValueError, match="non-empty string"):
        kernels.get("")


def test_the_emulator_through_the_registry_is_the_emulator_bit_for_bit():
    q, k, v = _qkv()
    do = torch.randn_like(q)
    kernel = kernels.get("emulator:fa2_bf16:bk16:fused")
    assert kernel.impl == AttentionImpl("emulator", "fa2_bf16", block_q=16, block_k=16, fused_scale_max=True)
    out, lse = kernel.forward(q, k, v, causal=True)
    ref_out, ref_lse = flash_attention(q, k, v, "fa2_bf16", causal=True, block_q=16, block_k=16,
                                       fused_scale_max=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    grads = kernel.backward(q, k, v, do, causal=True, out=out, lse=lse)
    expected = flash_attention_backward(q, k, v, out, lse, do, "fa2_bf16", causal=True, block_q=16, block_k=16,
                                        fused_scale_max=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    assert kernel.name == "emulator:fa2_bf16:bk16:fused"


@pytest.mark.parametrize("name", ["emulator:fp32:bk16", "reference:fp32", "sdpa:math", "sdpa:flash", "golden"])
def test_every_kernel_gives_out_lse_and_gradients_near_the_golden_value(name):
    q, k, v = _qkv(n=33)
    do = torch.randn_like(q)
    gold, gold_lse = kernels.get("golden").forward(q, k, v, causal=True)
    gold_grads = kernels.get("golden").backward(q, k, v, do, causal=True)
    kernel = kernels.get(name)
    out, lse = kernel.forward(q, k, v, causal=True)
    assert out.shape == q.shape and ((out.double() - gold).abs().max().item() < 1e-5)
    if kernel.gives_lse:
        assert (lse.double() - gold_lse).abs().max().item() < 1e-5
    else:
        assert lse is None  # SDPA's public API stores no log-sum-exp: none is invented
    grads = kernel.backward(q, k, v, do, causal=True)
    for g, ref in zip(grads, gold_grads):
        assert g.shape == ref.shape and (g.double() - ref).abs().max().item() < 1e-4


def test_kernels_that_need_a_gpu_are_listed_and_say_why_they_cannot_run_here():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nothing to refuse")
    q, k, v = _qkv()
    for name in ("sdpa:efficient", "sdpa:cudnn", "flex"):
        assert name in kernels.names()
        kernel = kernels.get(name)
        reason = kernel.unavailable_reason("cpu")
        assert reason and "CUDA" in reason
        with pytest.raises(KernelUnavailable, match=name):
            kernel.forward(q, k, v)
        assert kernel.unavailable_reason("cuda") == "torch sees no CUDA device"
    triton = kernels.get("triton:fa2:gproj_dq")
    if triton.unavailable_reason("cpu"):  # (the Triton tests may have switched on the CPU interpreter)
        with pytest.raises(KernelUnavailable, match="triton:fa2:gproj_dq"):
            triton.forward(q, k, v)


def test_triton_names_parse_and_refuse_what_the_kernel_lacks():
    assert kernels.get("triton:fa2:gproj_dq_dk:fp32_bwd").name == "triton:fa2:gproj_dq_dk:fp32_bwd"
    x3 = kernels.get("triton:fa2:fp32_bwd:bf16x3")
    assert (x3.name, x3.gproj, x3.fp32_backward, x3.fp32_dot) == ("triton:fa2:fp32_bwd:bf16x3", "off", True, "bf16x3")
    assert kernels.get("triton:fa2:fp32_bwd").fp32_dot == "ieee"
    with pytest.raises(ValueError, match="bf16x3 \\(with fp32_bwd\\)"):
        kernels.get("triton:fa2:bf16x3")
    with pytest.raises(ValueError, match="one of gproj_dq/gproj_dq_dk"):
        kernels.get("triton:fa2:gproj_dq:gproj_dq_dk")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="no additive mask"):
        kernels.get("triton:fa2").forward(q, k, v, attn_bias=torch.zeros(1, 1, 40, 40))


def test_a_pinned_backend_that_refuses_raises_and_never_falls_back():
    q, k, v = _qkv()
    mask = torch.zeros(1, 1, 40, 40)
    # SDPA refuses an explicit mask together with is_causal in every backend: the error names the backend
    with pytest.raises(BackendRefused, match="sdpa:math refused"):
        kernels.get("sdpa:math").forward(q, k, v, causal=True, attn_bias=mask)


def test_sdpa_math_takes_an_additive_mask_on_the_cpu():
    q, k, v = _qkv()
    bias = torch.zeros(1, 1, 40, 40, dtype=torch.float64)
    bias[..., :, 30:] = -math.inf
    gold, _ = kernels.get("golden").forward(q, k, v, attn_bias=bias)
    out, _ = kernels.get("sdpa:math").forward(q, k, v, attn_bias=bias)
    assert (out.double() - gold).abs().max().item() < 1e-5


def test_model_kernel_gives_unnamed_emulator_tiles_the_models_block():
    assert kernels.model_kernel("emulator:fa2_bf16:fused", block=8).name == "emulator:fa2_bf16:bk8:fused"
    assert kernels.model_kernel("emulator:fa2_bf16:bk16", block=8).name == "emulator:fa2_bf16:bk16"
    assert kernels.model_kernel("sdpa:math", block=8).name == "sdpa:math"


def test_study_05_schema_allows_exactly_the_registered_fixes():
    schema = yaml.safe_load((ROOT / "params" / "gproj_fix" / "schema.yaml").read_text())
    for key in ("fixes", "train_fixes"):
        assert schema[key]["item"]["choices"] == list(kernels.FIXES)


def test_entry_checks_refuse_empty_sizes_bad_scales_and_a_wrong_lse():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="empty size in q"):
        kernels.get("emulator:fp32").forward(q[..., :0, :], k, v)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        kernels.get("reference:fp32").forward(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        flash_attention(q, k, v, "fp32", scale=math.nan)
    out, lse = flash_attention(q, k, v, "fp32")
    with pytest.raises(ValueError, match="lse has shape"):
        flash_attention_backward(q, k, v, out, lse[:, :1], torch.ones_like(out), "fp32")


# -- bring your own kernel ------------------------------------------------------------------------

def test_a_plain_function_of_your_own_is_a_kernel_named_after_it():
    kernel = kernels.get("byo_kernel_example:sdpa_math")
    assert isinstance(kernel, kernels.CallableKernel) and kernel.name == "byo_kernel_example:sdpa_math"
    assert kernel.runs_as() == "your own callable byo_kernel_example:sdpa_math (byo_kernel_example.sdpa_math)"
    assert kernels.check_runs(kernel) is None
    q, k, v = _qkv()
    do = torch.randn_like(q)
    out, lse = kernel.forward(q, k, v, causal=True)
    assert lse is None  # a plain function stores none: none is invented
    assert torch.equal(out, kernels.get("sdpa:math").forward(q, k, v, causal=True)[0])
    expected = kernels.get("sdpa:math").backward(q, k, v, do, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(kernel.backward(q, k, v, do, causal=True), expected))


def test_a_kernel_class_of_your_own_keeps_its_interface():
    kernel = kernels.get("byo_kernel_example:Doubled")
    q, k, v = _qkv()
    assert kernel.name == "byo_kernel_example:Doubled" and kernel.forward(q, k, v)[1].shape == q.shape[:-1]


def test_kernels_of_your_own_are_checked_before_a_run():
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        kernels.get("no_such_module_xyz:attention")
    with pytest.raises(ValueError, match="has no 'missing'"):
        kernels.get("byo_kernel_example:missing")
    with pytest.raises(ValueError, match="not a callable"):
        kernels.get("byo_kernel_example:not_callable")
    problem = kernels.check_runs(kernels.get("byo_kernel_example:broken"))
    assert problem and "shape (1, 2, 23, 16)" in problem


def test_the_tiny_check_runs_at_the_head_dim_it_is_given():
    # a production kernel may refuse small head dims (FlashInfer's prefill refuses 16 on an H200): a caller
    # measuring at d = 64 checks at 64, and a refusal names the shape it was given
    def only_64(q, k, v, attn_mask=None, is_causal=False, **_):
        if q.shape[-1] != 64:
            raise RuntimeError(f"head dim {q.shape[-1]} not supported")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    kernel = kernels.CallableKernel("only_64", only_64)
    assert kernels.check_runs(kernel, head_dim=64) is None
    problem = kernels.check_runs(kernel, head_dim=16)
    assert problem == "it failed on a tiny input (1, 2, 24, 16) on cpu: RuntimeError: head dim 16 not supported"


def test_sdpa_takes_a_boolean_mask_as_its_own_path_and_it_matches_the_minus_inf_bias():
    q, k, v = _qkv()
    keep = torch.ones(40, 40, dtype=torch.bool)
    keep[:, 30:] = False
    keep[7] = False  # a fully masked row: PyTorch's convention gives 0
    bias = torch.zeros(40, 40).masked_fill(~keep, -math.inf)
    gold, _ = kernels.get("golden").forward(q, k, v, attn_bias=bias)
    for name in ("sdpa:math", "sdpa:flash"):
        kernel = kernels.get(name)
        out, _ = kernel.forward(q, k, v, bool_mask=keep)
        assert (out.double() - gold).abs().max().item() < 1e-5, name
        assert bool((out[..., 7, :] == 0).all()), name
        assert torch.equal(out, kernel.forward(q, k, v, attn_bias=bias)[0]), name
    with pytest.raises(ValueError, match="not both"):
        kernels.get("sdpa:math").forward(q, k, v, attn_bias=bias, bool_mask=keep)
    with pytest.raises(ValueError, match="torch.bool"):
        kernels.get("sdpa:math").forward(q, k, v, bool_mask=keep.float())
    # a boolean mask together with is_causal is refused like an additive one, and the message says bool
    with pytest.raises(BackendRefused, match=r"sdpa:math refused .*mask=bool"):
        kernels.get("sdpa:math").forward(q, k, v, causal=True, bool_mask=keep)
