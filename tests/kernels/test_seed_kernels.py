"""The source documents' own kernels: FlashAttention-4 (``fa4``) and FlashInfer (``flashinfer:prefill``,
``flashinfer:decode``). On the CPU: the registry entries, the refusals and their messages, the mask
conversion and the sentinel read from FlashInfer's header. On CUDA (marked gpu, where the packages are
installed): forward (and FA4's backward) against fp64."""
import math
import types

import pytest
import torch

from attnum import kernels
from attnum.kernels import fa4, flashinfer
from attnum.kernels.registry import KernelUnavailable, check_runs


def test_registry_names_and_options():
    assert {"fa4", "flashinfer:prefill", "flashinfer:decode"} <= set(kernels.names())
    assert kernels.get("fa4").name == "fa4"
    assert kernels.get("flashinfer:decode").name == "flashinfer:decode"
    with pytest.raises(ValueError, match="mode in"):
        kernels.get("flashinfer:paged")
    with pytest.raises(ValueError, match="takes no options"):
        kernels.get("fa4:bk128")


def test_cpu_refusals_say_why_and_run_nothing():
    for name in ("fa4", "flashinfer:prefill", "flashinfer:decode"):
        kernel = kernels.get(name)
        reason = kernel.unavailable_reason("cpu")
        assert reason and "CUDA" in reason
        q = torch.randn(1, 1, 8, 16)
        with pytest.raises(KernelUnavailable, match=name):
            kernel.forward(q, q, q)
        assert check_runs(kernel, "cpu") == reason


def test_flashinfer_has_no_backward_and_says_so():
    kernel = kernels.get("flashinfer:prefill")
    assert kernel.has_backward is False and kernels.get("fa4").has_backward is True
    with pytest.raises(KernelUnavailable, match="no backward"):
        kernel.backward(*(torch.randn(1, 1, 4, 8) for _ in range(4)))


def test_flashinfer_mask_is_boolean_and_shared():
    bias = torch.zeros(1, 1, 4, 6)
    bias[..., 4:] = -math.inf
    mask = flashinfer._bool_mask(bias, 4, 6)
    assert mask.dtype == torch.bool and mask.shape == (4, 6)
    assert mask[:, :4].all() and not mask[:, 4:].any()
    with pytest.raises(ValueError, match="boolean mask only"):
        flashinfer._bool_mask(torch.full((4, 6), 0.5), 4, 6)
    with pytest.raises(ValueError, match="one mask for every batch"):
        flashinfer._bool_mask(torch.zeros(2, 1, 4, 6), 4, 6)


@pytest.mark.parametrize("text, expected", [("constexpr float inf = 5e4;", "5e4"),
                                            ("constexpr float inf = cuda::std::numeric_limits<float>::infinity();",
                                             "infinity")])
def test_mask_sentinel_is_read_from_the_installed_header(tmp_path, monkeypatch, text, expected):
    header = tmp_path / "flashinfer" / "data" / "include" / "flashinfer" / "math.cuh"
    header.parent.mkdir(parents=True)
    header.write_text(f"namespace math {{\n{text}\n}}\n")
    fake = types.SimpleNamespace(__file__=str(tmp_path / "flashinfer" / "__init__.py"), __version__="0.0-test")
    monkeypatch.setattr(flashinfer, "_module", lambda: fake)
    assert flashinfer.mask_sentinel() == expected
    assert "0.0-test" in kernels.get("flashinfer:prefill").runs_as() and expected in kernels.get(
        "flashinfer:prefill").runs_as()


def test_fa4_refuses_an_additive_bias_rather_than_dropping_it(monkeypatch):
    kernel = kernels.get("fa4")
    monkeypatch.setattr(kernel, "require", lambda device: None)
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="refused rather than dropped"):
        kernel.forward(q, q, q, attn_bias=torch.zeros(4, 4))


# -- on a CUDA device with the packages installed (.ci/gpu-seed-kernels) -------------------------------

def _installed(name):
    return kernels.get(name).unavailable_reason("cuda") is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fa4", "flashinfer:prefill", "flashinfer:decode"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_seed_kernels_forward_against_golden(name, causal):
    if not _installed(name):
        pytest.skip(kernels.get(name).unavailable_reason("cuda"))
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128 if name.endswith("decode") else 512, 64, generator=gen)
               .to("cuda", torch.bfloat16) for _ in range(3))
    out, lse = kernels.get(name).forward(q, k, v, causal=causal)
    gold, gold_lse = kernels.get("golden").forward(q, k, v, causal=causal)
    assert float((out.double() - gold).norm() / gold.norm()) < 1e-2
    assert float((lse.double() - gold_lse).abs().max()) < 1e-2


@pytest.mark.gpu
def test_cuda_fa4_backward_against_golden():
    if not _installed("fa4"):
        pytest.skip(kernels.get("fa4").unavailable_reason("cuda"))
    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k, v, do = (torch.randn(1, 2, 512, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    grads = kernels.get("fa4").backward(q, k, v, do, causal=True)
    gold = kernels.get("golden").backward(q, k, v, do, causal=True)
    for g, ref in zip(grads, gold):
        assert float((g.double() - ref).norm() / ref.norm()) < 2e-2
