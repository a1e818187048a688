"""The emulated and reference kernels as registry kernels, with autograd, and a drop-in module.

``AttentionImpl`` configures one emulated implementation of softmax(Q K^T * scale) V:

    emulator   the tiled FlashAttention forward (``attnum.kernels.flash``) and backward
               (``attnum.kernels.backward``), glued by ``FlashAttentionFunction``
    reference  unblocked attention (``attnum.kernels.reference``) under a policy; autograd through it
               (every cast rounds the gradient too, like plain low-precision PyTorch)

Its ``name`` is the registry name (``emulator:fa2_bf16:bk64``); ``ImplKernel`` is the registry's
kernel for it. Fixes of the emulator (study 05) are options of ``AttentionImpl``:
``fused_scale_max`` off is seed 004's forward fix, ``gproj`` its backward projection,
``center_keys`` mean-key subtraction and ``stable_beta`` Qiu & Yao's max shift; an FP32
backward is a policy. ``attnum.kernels.fixes.FIXES`` names each one as a change of a base.

``Attention`` is a module with the signature of ``scaled_dot_product_attention`` around any
registry kernel. Setting its ``backward_kernel`` keeps the forward exactly as the module's own
kernel computes it and replaces only the backward by a recomputation under another kernel: the
FP32 backward-recompute diagnostic of seed 004 (``attnum.train.diag``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..precision import PrecisionPolicy, get_policy
from .backward import GPROJ_MODES, flash_attention_backward
from .common import check_scale
from .fixes import center_keys, uncenter_key_grad
from .flash import LOOP_ORDERS, flash_attention
from .reference import reference_attention
from .registry import Kernel

FAMILIES = ("emulator", "reference")


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """One emulated attention implementation and the numerics of its forward and backward."""

    family: str = "emulator"
    policy: PrecisionPolicy | str = "fa2_bf16"
    block_q: int = 64
    block_k: int = 64
    loop_order: str = "q_outer"
    fused_scale_max: bool = False
    gproj: str = "off"  # GProj: "off", "dq" (dQ correction, one pass) or "dq_dk" (dQ and dK, two passes)
    center_keys: bool = False  # mean-key subtraction: the kernel reads K - mean_j K_j
    stable_beta: float = 0.0  # > 0: Qiu & Yao's STABLE max shift with this beta (0: the plain row max)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown emulated implementation {self.family!r}; allowed: {list(FAMILIES)}")
        if self.loop_order not in LOOP_ORDERS:
            raise ValueError(f"loop_order must be one of {LOOP_ORDERS}, got {self.loop_order!r}")
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"block sizes must be positive, got {self.block_q}, {self.block_k}")
        if self.gproj not in GPROJ_MODES:
            raise ValueError(f"gproj must be one of {GPROJ_MODES}, got {self.gproj!r}")
        if self.stable_beta != 0 and self.stable_beta < 1:
            raise ValueError(f"stable_beta must be 0 (off) or >= 1, got {self.stable_beta}")
        if self.stable_beta and self.loop_order != "q_outer":
            raise ValueError("the STABLE max shift is emulated in the FlashAttention-2 loop order only")
        if self.family != "emulator" and (self.has_fix or self.fused_scale_max or self.loop_order != "q_outer"):
            raise ValueError(f"fused, fa1, gproj, center_keys and stable are options of the emulator, "
                             f"not of {self.family!r}")
        object.__setattr__(self, "policy", get_policy(self.policy))

    @property
    def has_fix(self) -> bool:
        """True when a study 05 option (GProj, mean-key subtraction, STABLE) is on."""
        return self.gproj != "off" or self.center_keys or self.stable_beta > 0

    @classmethod
    def parse(cls, text: str, **defaults) -> "AttentionImpl":
        """From a registry name: ``emulator:fa2_bf16[:bk64][:bq32][:fa1][:fused][:gproj_dq|:gproj_dq_dk]
        [:center_keys][:stable|:stable=<beta>]`` or ``reference:fp32``. ``defaults`` (e.g. block
        sizes) apply where the name says nothing."""
        family, *options = text.split(":")
        return cls.from_options(family, options, **defaults)

    @classmethod
    def from_options(cls, family: str, options: list[str], **defaults) -> "AttentionImpl":
        fields = dict(defaults)
        policy = None
        named_blocks = set()
        for option in options:
            if option in _FLAGS:
                fields.update(_FLAGS[option])
            elif option.startswith("stable="):
                fields["stable_beta"] = float(option.split("=", 1)[1])
            elif option[:2] in ("bk", "bq") and option[2:].isdigit():
                named_blocks.add("block_k" if option[:2] == "bk" else "block_q")
                fields["block_k" if option[:2] == "bk" else "block_q"] = int(option[2:])
            elif policy is None:
                policy = option
            else:
                raise ValueError(f"unknown option {option!r} of {family!r}; options: a policy, bk<N>, bq<N>, "
                                 f"{', '.join(_FLAGS)}, stable=<beta>")
        if "block_k" in named_blocks and "block_q" not in named_blocks:
            fields["block_q"] = fields["block_k"]  # "bk128" alone: square tiles, as the name reads
        return cls(family=family, policy=policy or fields.pop("policy", "fa2_bf16"), **fields)

    @property
    def name(self) -> str:
        """The registry name; block sizes only where they matter (the emulator)."""
        if self.family == "reference":
            return f"reference:{self.policy.name}"
        flags = [f":bk{self.block_k}", f":bq{self.block_q}" if self.block_q != self.block_k else "",
                 ":fa1" if self.loop_order == "k_outer" else "",
                 ":fused" if self.fused_scale_max else "",
                 {"off": "", "dq": ":gproj_dq", "dq_dk": ":gproj_dq_dk"}[self.gproj],
                 ":center_keys" if self.center_keys else "",
                 f":stable={self.stable_beta:g}" if self.stable_beta else ""]
        return f"emulator:{self.policy.name}" + "".join(flags)

    def replace(self, **changes) -> "AttentionImpl":
        return dataclasses.replace(self, **changes)


_FLAGS = {"fused": {"fused_scale_max": True}, "fa1": {"loop_order": "k_outer"},
          "gproj_dq": {"gproj": "dq"}, "gproj_dq_dk": {"gproj": "dq_dk"},
          "center_keys": {"center_keys": True}, "stable": {"stable_beta": 2.0}}

FP32_BACKWARD = AttentionImpl("emulator", "fp32")
"""The FP32 recompute of the diagnostic: the emulator with no rounding anywhere."""


def flash_forward(q, k, v, impl: AttentionImpl, *, causal: bool = False, scale: float | None = None,
                  attn_bias=None, **options):
    """``(out, lse)`` of the emulator under ``impl``, its forward-side fixes included.
    ``options``: the forward emulator's ``fault`` and ``mask_fill``."""
    scale = check_scale(scale, q.shape[-1])
    if impl.center_keys:
        k = center_keys(k.to(impl.policy.carrier))
    return flash_attention(q, k, v, impl.policy, scale=scale, causal=causal, attn_bias=attn_bias,
                           block_q=impl.block_q, block_k=impl.block_k, loop_order=impl.loop_order,
                           fused_scale_max=impl.fused_scale_max, stable_beta=impl.stable_beta, **options)


def flash_backward(q, k, v, out, lse, grad_out, impl: AttentionImpl, *, causal: bool = False,
                   scale: float | None = None, attn_bias=None, stats: dict | None = None):
    """``(dq, dk, dv)`` of the emulator under ``impl`` from what its forward stored."""
    scale = check_scale(scale, q.shape[-1])
    k_read = center_keys(k.to(impl.policy.carrier)) if impl.center_keys else k
    dq, dk, dv = flash_attention_backward(q, k_read, v, out, lse, grad_out, impl.policy, scale=scale,
                                          causal=causal, attn_bias=attn_bias, block_q=impl.block_q,
                                          block_k=impl.block_k, fused_scale_max=impl.fused_scale_max,
                                          gproj=impl.gproj, stats=stats)
    if impl.center_keys:
        dk = impl.policy.round(uncenter_key_grad(dk), "grad")  # the centering's own backward
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Emulated FlashAttention forward and backward under ``impl`` (family ``emulator``)."""

    @staticmethod
    def forward(ctx, q, k, v, impl: AttentionImpl, causal: bool, scale: float, attn_bias):
        out, lse = flash_forward(q, k, v, impl, causal=causal, scale=scale, attn_bias=attn_bias)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.impl, ctx.causal, ctx.scale, ctx.attn_bias = impl, causal, scale, attn_bias
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, out, lse, grad_out, ctx.impl, causal=ctx.causal, scale=ctx.scale,
                                    attn_bias=ctx.attn_bias)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class ImplKernel(Kernel):
    """The registry kernel of an ``AttentionImpl``: the emulator or the reference.

    ``options`` (emulator only): ``fault`` (a ``KernelHooks``, ``attnum.kernels.faults``) and
    ``mask_fill``; (reference only) ``query_chunk``. A fault is part of the name (``+fault=...``).
    """

    def __init__(self, impl: AttentionImpl, **options):
        allowed = {"emulator": {"fault", "mask_fill"}, "reference": {"query_chunk"}}[impl.family]
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"options {sorted(unknown)} do not apply to {impl.family!r}; allowed: {sorted(allowed)}")
        if impl.family == "emulator" and options.get("fault") is not None and impl.has_fix:
            raise ValueError("faults are injected into the plain emulator, not into one with a fix")
        self.impl, self.options = impl, options
        extra = [f"fault={options['fault']}" if options.get("fault") is not None else "",
                 f"mask_fill={options['mask_fill']}" if options.get("mask_fill", "-inf") != "-inf" else ""]
        self.name = impl.name + "".join(f"+{e}" for e in extra if e)

    @property
    def policy(self) -> PrecisionPolicy:
        return self.impl.policy

    def read_operands(self, q, k, v, grad_out):
        """q, k, v and dO rounded by the policy's ``inputs`` and ``grad_out`` stages, as the kernel reads them."""
        pol = self.impl.policy
        q, k, v = (pol.round(t.to(pol.carrier), "inputs") for t in (q, k, v))
        return q, k, v, pol.round(grad_out.to(pol.carrier), "grad_out")

    def forward(self, q, k, v, *, causal: bool = False, attn_bias=None, scale: float | None = None):
        if self.impl.family == "emulator":
            return flash_forward(q, k, v, self.impl, causal=causal, scale=scale, attn_bias=attn_bias, **self.options)
        return reference_attention(q, k, v, self.impl.policy, scale=scale, causal=causal, attn_bias=attn_bias,
                                   return_lse=True, **self.options)

    def differentiable(self, q, k, v, *, causal: bool = False, attn_bias=None, scale: float | None = None):
        scale = check_scale(scale, q.shape[-1])
        if self.impl.family == "emulator":
            if self.options:
                raise ValueError("a fault or a mask fill has no backward: use forward()")
            return FlashAttentionFunction.apply(q, k, v, self.impl, causal, scale, attn_bias)
        return reference_attention(q, k, v, self.impl.policy, scale=scale, causal=causal,
                                   attn_bias=attn_bias).to(q.dtype)

    def backward(self, q, k, v, grad_out, *, causal: bool = False, attn_bias=None, scale: float | None = None,
                 out=None, lse=None, stats: dict | None = None):
        """For the emulator, ``out``/``lse`` may be what a forward stored (kept exactly as it ran);
        otherwise the forward is recomputed. ``stats``: the backward's per-row dS diagnostics."""
        if self.impl.family != "emulator":
            return super().backward(q, k, v, grad_out, causal=causal, attn_bias=attn_bias, scale=scale)
        if out is None or lse is None:
            out, lse = flash_forward(q, k, v, self.impl, causal=causal, scale=scale, attn_bias=attn_bias)
        return flash_backward(q, k, v, out, lse, grad_out, self.impl, causal=causal, scale=scale,
                              attn_bias=attn_bias, stats=stats)


def impl_kernel(impl: AttentionImpl | str, **options) -> ImplKernel:
    """The registry kernel of an implementation (or of its name)."""
    return ImplKernel(AttentionImpl.parse(impl) if isinstance(impl, str) else impl, **options)


class _RecomputedBackward(torch.autograd.Function):
    """Pass a forward output through unchanged; its backward recomputes attention under another kernel."""

    @staticmethod
    def forward(ctx, q, k, v, out, kernel: Kernel, causal: bool, scale: float):
        ctx.save_for_backward(q, k, v)
        ctx.kernel, ctx.causal, ctx.scale = kernel, causal, scale
        return out.clone()

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(q, k, v, grad_out, causal=ctx.causal, scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class Attention(nn.Module):
    """Drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)`` around a kernel.

    ``kernel``: a registry ``Kernel``, its name, or an ``AttentionImpl``. ``backward_kernel``
    (default None): when set, the forward value is still this module's kernel (computed without
    autograd, bit for bit what it would be) and the backward is recomputed under
    ``backward_kernel``. ``capture``: when a dict, the forward stores q, k, v and its output there
    and the backward stores dO (for diagnostics).
    """

    def __init__(self, kernel: Kernel | AttentionImpl | str = AttentionImpl()):
        super().__init__()
        self.kernel = as_kernel(kernel)
        self.backward_kernel: Kernel | None = None
        self.capture: dict | None = None

    def forward(self, q, k, v, is_causal: bool = False, scale: float | None = None):
        scale = check_scale(scale, q.shape[-1])
        if self.backward_kernel is None:
            out = self.kernel(q, k, v, is_causal=is_causal, scale=scale)
        else:
            with torch.no_grad():
                value = self.kernel(q, k, v, is_causal=is_causal, scale=scale)
            out = _RecomputedBackward.apply(q, k, v, value, self.backward_kernel, is_causal, scale)
        if self.capture is not None:
            self.capture.update(q=q.detach().clone(), k=k.detach().clone(), v=v.detach().clone(),
                                out=out.detach().clone(), causal=is_causal, scale=scale)
            if out.requires_grad:
                out.register_hook(lambda g, store=self.capture: store.__setitem__("grad_out", g.detach().clone()))
        return out

    def extra_repr(self) -> str:
        extra = f", backward={self.backward_kernel.name}" if self.backward_kernel is not None else ""
        return f"kernel={self.kernel.name}{extra}"


def as_kernel(kernel: Kernel | AttentionImpl | str) -> Kernel:
    """A registry kernel from a kernel, an ``AttentionImpl`` or a registry name."""
    if isinstance(kernel, Kernel):
        return kernel
    if isinstance(kernel, AttentionImpl):
        return ImplKernel(kernel)
    from .registry import get

    return get(kernel)
