"""Every attention implementation of the project, behind one interface and one registry.

``get(name)`` returns a ``Kernel`` (``registry``: ``forward -> (out, lse)``, ``backward ->
(dq, dk, dv)``, callable as a model's attention); ``names()`` lists an example of each family.

    emulator:<policy>[:bk<N>][:bq<N>][:fa1][:fused][:gproj_dq|:gproj_dq_dk][:center_keys][:stable[=b]]
                     the tiled FlashAttention forward (``flash``) and backward (``backward``)
                     emulators under a precision policy (``attnum.precision``)
    reference:<policy>   unblocked attention under a policy (``reference``), autograd backward
    golden               fp64 attention and its exact gradients, in query chunks
    textbook:<policy>[:no_max]   the unguarded formula a first implementation writes (forward)
    sdpa:<backend>       PyTorch SDPA pinned to one backend (``sdpa``): flash, efficient, cudnn, math
    triton:fa2[:gproj_dq|:gproj_dq_dk][:fp32_bwd]   our FlashAttention-2 Triton kernel (``triton_fa2``)
    flex                 FlexAttention compiled with torch.compile (``flex``; CUDA only)
    fa4                  FlashAttention-4's CuTe DSL kernels (``fa4``; CUDA, compute capability >= 9.0)
    flashinfer:prefill|decode   FlashInfer's single-request kernels, forward only (``flashinfer``; CUDA)

Modules: ``common`` (input checks, scale, the causal mask, the key-block loop, exponent
helpers), ``reference``, ``flash`` (forward emulator, STABLE as an option), ``backward``
(backward emulator, GProj), ``fixes`` (the fixes' registry), ``faults`` (injected bugs),
``autograd`` (``AttentionImpl``, the emulator's autograd Function, the ``Attention`` module),
``sdpa``, ``registry``.
"""
from __future__ import annotations

from ..precision import get_policy
from . import fa4 as _fa4
from . import flashinfer as _flashinfer
from . import flex as _flex
from . import sdpa as _sdpa
from .autograd import FP32_BACKWARD, Attention, AttentionImpl, ImplKernel, as_kernel, impl_kernel
from .backward import GPROJ_MODES, flash_attention_backward
from .common import causal_mask, default_scale
from .faults import FAULTS, make_fault
from .fixes import FIXES, with_fix
from .flash import flash_attention
from .reference import golden_attention, golden_attention_backward, reference_attention, textbook_attention
from .registry import CallableKernel, Kernel, KernelUnavailable, check_runs, families, get, names, register


class GoldenKernel(Kernel):
    """fp64 attention (``golden_attention``) and its exact gradients (``golden_attention_backward``)."""

    name = "golden"

    def __init__(self, chunk: int = 1024):
        self.chunk = chunk

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        return golden_attention(q, k, v, scale=scale, causal=causal, attn_bias=attn_bias, chunk=self.chunk,
                                return_lse=True)

    def backward(self, q, k, v, grad_out, *, causal=False, attn_bias=None, scale=None, out=None, lse=None,
                 stats=None):
        return golden_attention_backward(q, k, v, grad_out, scale=scale, causal=causal, attn_bias=attn_bias,
                                         chunk=self.chunk)

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        raise NotImplementedError("the golden kernel is a measuring stick, not a model's attention")


class TextbookKernel(Kernel):
    """``textbook_attention``: no guard for fully masked rows; ``no_max`` skips the max subtraction."""

    gives_lse = False

    def __init__(self, policy: str = "fp32", subtract_max: bool = True):
        self.policy, self.subtract_max = get_policy(policy), subtract_max
        self.name = f"textbook:{self.policy.name}" + ("" if subtract_max else ":no_max")

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        if causal:
            raise ValueError("the textbook kernel takes masks as attn_bias only")
        return textbook_attention(q, k, v, self.policy, subtract_max=self.subtract_max, attn_bias=attn_bias,
                                  scale=scale)

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        return self.differentiable(q, k, v, causal=causal, attn_bias=attn_bias, scale=scale), None


class TritonKernel(Kernel):
    """``triton:fa2[:gproj_dq|:gproj_dq_dk][:fp32_bwd[:bf16x3]]``: our FlashAttention-2 Triton kernel
    (``triton_fa2``), GProj and the FP32 backward as compile-time switches; ``bf16x3`` runs the FP32
    backward's dots as three exact bf16 products each (``triton_fa2``'s ``fp32_dot``; bf16 inputs only)
    instead of fp32 dots off the tensor cores. No additive masks."""

    def __init__(self, gproj: str = "off", fp32_backward: bool = False, fp32_dot: str = "ieee"):
        if fp32_dot != "ieee" and not fp32_backward:
            raise ValueError("triton:fa2's bf16x3 option sets the FP32 backward's dots: it needs fp32_bwd")
        self.gproj, self.fp32_backward, self.fp32_dot = gproj, fp32_backward, fp32_dot
        self.name = "triton:fa2" + {"off": "", "dq": ":gproj_dq", "dq_dk": ":gproj_dq_dk"}[gproj] + (
            ":fp32_bwd" if fp32_backward else "") + (f":{fp32_dot}" if fp32_dot != "ieee" else "")

    def runs_as(self) -> str:
        return (f"attnum's Triton FlashAttention-2 kernel (attnum.kernels.triton_fa2), GProj {self.gproj}, "
                f"{'FP32' if self.fp32_backward else 'input-format'} backward"
                f"{' (dots as three exact bf16 products)' if self.fp32_dot == 'bf16x3' else ''}; tiles, warps and stages fixed "
                "per (head dim, causal, GProj mode) (triton_fa2.default_config's tuned table, no autotuning)")

    def unavailable_reason(self, device="cpu"):
        from . import triton_fa2

        return triton_fa2.unavailable_reason(device)

    def _no_bias(self, attn_bias):
        if attn_bias is not None:
            raise ValueError(f"{self.name} takes no additive mask (causal only)")

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        from . import triton_fa2

        self._no_bias(attn_bias)
        self.require(q.device)
        return triton_fa2.forward(q, k, v, causal=causal, scale=scale)

    def backward(self, q, k, v, grad_out, *, causal=False, attn_bias=None, scale=None, out=None, lse=None,
                 stats=None):
        from . import triton_fa2

        self._no_bias(attn_bias)
        self.require(q.device)
        if out is None or lse is None:
            out, lse = triton_fa2.forward(q, k, v, causal=causal, scale=scale)
        return triton_fa2.backward(q, k, v, out, lse, grad_out, causal=causal, scale=scale, gproj=self.gproj,
                                   fp32_backward=self.fp32_backward, fp32_dot=self.fp32_dot)

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        from . import triton_fa2

        self._no_bias(attn_bias)
        self.require(q.device)
        return triton_fa2.triton_attention(q, k, v, causal=causal, scale=scale, gproj=self.gproj,
                                           fp32_backward=self.fp32_backward, fp32_dot=self.fp32_dot)


def _build_triton(options, **kw):
    if kw or not options or options[0] != "fa2":
        raise ValueError("triton:fa2[:gproj_dq|:gproj_dq_dk][:fp32_bwd[:bf16x3]]")
    flags = set(options[1:])
    unknown = flags - {"gproj_dq", "gproj_dq_dk", "fp32_bwd", "bf16x3"}
    if unknown or {"gproj_dq", "gproj_dq_dk"} <= flags or ("bf16x3" in flags and "fp32_bwd" not in flags):
        raise ValueError(f"options of triton:fa2 are one of gproj_dq/gproj_dq_dk, fp32_bwd, and bf16x3 (with "
                         f"fp32_bwd), got {options[1:]}")
    gproj = "dq_dk" if "gproj_dq_dk" in flags else "dq" if "gproj_dq" in flags else "off"
    return TritonKernel(gproj, "fp32_bwd" in flags, "bf16x3" if "bf16x3" in flags else "ieee")


def _build_impl(family):
    return lambda options, **kw: ImplKernel(AttentionImpl.from_options(family, options), **kw)


def _build_textbook(options, **kw):
    if kw or len(options) > 2 or (len(options) == 2 and options[1] != "no_max"):
        raise ValueError("textbook:<policy>[:no_max]")
    return TextbookKernel(options[0] if options else "fp32", subtract_max=len(options) < 2)


def _build_golden(options, **kw):
    if options:
        raise ValueError("the golden kernel takes no options (chunk= as a keyword)")
    return GoldenKernel(**kw)


register("emulator", _build_impl("emulator"), doc="the tiled FlashAttention forward and backward emulators under a precision policy",
         examples=("emulator:fa2_bf16:bk128", "emulator:fa2_fp16:bk128", "emulator:all_bf16:bk128",
                   "emulator:fa2_bf16:bk128:fused", "emulator:fa2_bf16:bk128:fused:gproj_dq"))
register("reference", _build_impl("reference"), doc="unblocked attention under a precision policy",
         examples=("reference:fp32", "reference:fa2_bf16"))
register("golden", _build_golden, doc="fp64 attention and its exact gradients", examples=("golden",))
register("textbook", _build_textbook, doc="the unguarded textbook formula", examples=("textbook:fp32",))
register("triton", _build_triton, doc="our FlashAttention-2 Triton kernel, GProj as a switch",
         examples=("triton:fa2", "triton:fa2:gproj_dq", "triton:fa2:gproj_dq_dk", "triton:fa2:fp32_bwd",
                   "triton:fa2:fp32_bwd:bf16x3"))
register("fa4", _fa4.build, doc="FlashAttention-4's CuTe DSL kernels (flash-attn-4; SM90 on Hopper)", examples=("fa4",))
register("flashinfer", _flashinfer.build, doc="FlashInfer's prefill, decode and paged-cache decode kernels (forward only)",
         examples=("flashinfer:prefill", "flashinfer:decode", "flashinfer:decode_paged"))
register("flex", _flex.build, doc="FlexAttention compiled with torch.compile (CUDA)", examples=("flex",))
register("sdpa", _sdpa.build, doc="PyTorch SDPA pinned to one backend",
         examples=tuple(f"sdpa:{b}" for b in _sdpa.BACKENDS))


def emulator(policy="fa2_bf16", **config) -> ImplKernel:
    """The emulator kernel of any policy object (a preset name or a ``PrecisionPolicy``) and
    ``AttentionImpl`` fields; ``fault``/``mask_fill`` pass to the kernel."""
    options = {key: config.pop(key) for key in ("fault", "mask_fill") if key in config}
    return ImplKernel(AttentionImpl("emulator", policy, **config), **options)


def model_kernel(name: str, *, block: int) -> Kernel:
    """A model's attention kernel from its registry name; an emulator named without tile sizes
    gets ``block`` x ``block`` tiles (a study's ``model_block``)."""
    if name.split(":", 1)[0] == "emulator":
        return ImplKernel(AttentionImpl.parse(name, block_q=block, block_k=block))
    return get(name)


def reference(policy="fp32", **options) -> ImplKernel:
    """The reference kernel of any policy object; ``query_chunk`` passes to the kernel."""
    return ImplKernel(AttentionImpl("reference", policy), **options)


__all__ = ["FAULTS", "FIXES", "FP32_BACKWARD", "GPROJ_MODES", "Attention", "AttentionImpl", "CallableKernel",
           "GoldenKernel", "check_runs",
           "ImplKernel", "Kernel", "KernelUnavailable", "TextbookKernel", "TritonKernel", "as_kernel", "causal_mask",
           "default_scale", "emulator", "families", "flash_attention", "flash_attention_backward", "get",
           "golden_attention", "golden_attention_backward", "impl_kernel", "make_fault", "model_kernel", "names",
           "reference", "reference_attention", "register", "textbook_attention", "with_fix"]
