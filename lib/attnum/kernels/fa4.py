"""``fa4``: FlashAttention-4 (the ``flash-attn-4`` package, written in NVIDIA's CuTe DSL), through its own
``flash_attn.cute.flash_attn_func``.

On Hopper (compute capability 9.0, the H100 and H200) the package runs its SM90 forward and backward,
which follow FlashAttention-3's design (Shah et al., "FlashAttention-3: Fast and Accurate Attention with
Asynchrony and Low-precision", 2024, arXiv 2407.08608): the kernels whose BF16 rounding the report on
late-training gradient blowup (the project's seed 004) analyses. Inputs are bf16 or fp16 with head dims
8-256 (multiples of 8) on SM90; the package asserts that itself, and a refusal is raised, never replaced by
another kernel. Masks are the package's own ``mask_mod``/``score_mod`` functions: an additive ``attn_bias``
is refused here rather than dropped. Its causal mask is bottom-right aligned when ``n_q != n_k``, as every
kernel of this package. ``forward`` returns the kernel's own log-sum-exp (natural log of the scaled scores'
sum of exponentials, shape (batch, heads, n_q)); the backward is the package's, through autograd.
Install: ``pip install flash-attn-4`` (the first call of each shape compiles, tens of seconds).
"""
from __future__ import annotations

import functools

import torch

from .registry import Kernel

MIN_CAPABILITY = (9, 0)


@functools.cache
def _module():
    from flash_attn import cute  # noqa: F401  (the package's CuTe DSL kernels)

    return cute


def version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        return None


def _bhnd(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, n, d) <-> (batch, n, heads, d): the package's layout is sequence-major."""
    return t.transpose(1, 2)


class FA4Kernel(Kernel):
    """FlashAttention-4's CuTe DSL kernels (flash_attn.cute.flash_attn_func)."""

    name = "fa4"

    def unavailable_reason(self, device="cpu") -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return "FlashAttention-4 runs on CUDA GPUs only (compute capability 9.0 or later)"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            return (f"FlashAttention-4 needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later "
                    f"(Hopper, Blackwell); this GPU has {capability[0]}.{capability[1]}")
        try:
            _module()
        except ImportError as exc:
            return f"flash-attn-4 is not installed (pip install flash-attn-4): {exc}"
        return None

    def runs_as(self) -> str:
        return (f"flash_attn.cute.flash_attn_func of flash-attn-4 {version() or '(not installed)'} "
                "(CuTe DSL; on compute capability 9.0 its SM90 forward and backward)")

    def _call(self, q, k, v, causal, attn_bias, scale, return_lse):
        self.require(q.device)
        if attn_bias is not None:
            raise ValueError("fa4 takes no additive attn_bias (its masks are mask_mod/score_mod functions); "
                             "refused rather than dropped")
        out, lse = _module().flash_attn_func(_bhnd(q), _bhnd(k), _bhnd(v), softmax_scale=scale, causal=causal,
                                             return_lse=return_lse)
        return _bhnd(out), lse

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        return self._call(q, k, v, causal, attn_bias, scale, False)[0]

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        with torch.no_grad():
            out, lse = self._call(q, k, v, causal, attn_bias, scale, True)
        if lse is not None and tuple(lse.shape) == (q.shape[0], q.shape[2], q.shape[1]):
            lse = lse.transpose(1, 2)  # (batch, n, heads) layouts of the package
        return out, lse


def build(options: list[str], **keywords) -> FA4Kernel:
    if options or keywords:
        raise ValueError(f"fa4 takes no options, got {options or sorted(keywords)}")
    return FA4Kernel()
