"""Differentiable attention: the flash emulator as an autograd Function, and a drop-in module.

``AttentionImpl`` names one implementation of softmax(Q K^T * scale) V:

    reference  ``attnum.reference_attention`` under a policy; autograd through it
               (every cast rounds the gradient too, like plain low-precision PyTorch)
    flash      ``attnum.flash_attention`` forward + ``attnum.backward`` backward,
               glued by ``FlashAttentionFunction``
    sdpa       ``torch.nn.functional.scaled_dot_product_attention`` in the tensors' dtype

``Attention`` is a module with the signature of ``scaled_dot_product_attention``
(q, k, v of shape (batch, heads, seq, head_dim); ``is_causal``; ``scale``). Setting
its ``backward_impl`` keeps the forward exactly as the module's own implementation
computes it and replaces only the backward by a recomputation under another
implementation: the FP32 backward-recompute diagnostic of seed 004
(``attnum.diagnostics``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .backward import flash_attention_backward
from .flash import LOOP_ORDERS, flash_attention
from .precision import PrecisionPolicy, get_policy
from .reference import default_scale, reference_attention

KINDS = ("reference", "flash", "sdpa")


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
    """One attention implementation and the numerics of its forward and backward."""

    kind: str = "flash"
    policy: PrecisionPolicy | str = "fa2_bf16"
    block_q: int = 64
    block_k: int = 64
    loop_order: str = "q_outer"
    fused_scale_max: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown attention implementation {self.kind!r}; allowed: {list(KINDS)}")
        if self.loop_order not in LOOP_ORDERS:
            raise ValueError(f"loop_order must be one of {LOOP_ORDERS}, got {self.loop_order!r}")
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"block sizes must be positive, got {self.block_q}, {self.block_k}")
        object.__setattr__(self, "policy", get_policy(self.policy))

    @classmethod
    def parse(cls, text: str, **options) -> "AttentionImpl":
        """From ``"flash:fa2_bf16"``, ``"flash:fa2_bf16:fused"``, ``"reference:fp32"`` or ``"sdpa"``."""
        kind, *rest = text.split(":")
        if rest and rest[-1] == "fused":
            options["fused_scale_max"] = True
            rest = rest[:-1]
        if len(rest) > 1:
            raise ValueError(f"cannot read attention implementation {text!r}; e.g. 'flash:fa2_bf16:fused'")
        policy = rest[0] if rest else ("fp32" if kind == "sdpa" else "fa2_bf16")
        return cls(kind=kind, policy=policy, **options)

    @property
    def label(self) -> str:
        if self.kind == "sdpa":
            return "sdpa"
        return f"{self.kind}:{self.policy.name}" + (":fused" if self.fused_scale_max else "")

    def replace(self, **changes) -> "AttentionImpl":
        return dataclasses.replace(self, **changes)


FP32_BACKWARD = AttentionImpl("flash", "fp32")
"""The FP32 recompute of the diagnostic: the flash emulator with no rounding anywhere."""


def _scale(q, scale):
    return default_scale(q.shape[-1]) if scale is None else float(scale)


class FlashAttentionFunction(torch.autograd.Function):
    """Emulated FlashAttention forward and backward under ``impl`` (kind ``flash``)."""

    @staticmethod
    def forward(ctx, q, k, v, impl: AttentionImpl, causal: bool, scale: float):
        out, lse = flash_attention(q, k, v, impl.policy, scale=scale, causal=causal, block_q=impl.block_q,
                                   block_k=impl.block_k, loop_order=impl.loop_order,
                                   fused_scale_max=impl.fused_scale_max)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.impl, ctx.causal, ctx.scale = impl, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        impl = ctx.impl
        dq, dk, dv = flash_attention_backward(q, k, v, out, lse, grad_out, impl.policy, scale=ctx.scale,
                                              causal=ctx.causal, block_q=impl.block_q, block_k=impl.block_k,
                                              fused_scale_max=impl.fused_scale_max)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def attention_forward(q, k, v, impl: AttentionImpl, *, causal: bool = False, scale: float | None = None):
    """Differentiable attention output under ``impl``."""
    scale = _scale(q, scale)
    if impl.kind == "flash":
        return FlashAttentionFunction.apply(q, k, v, impl, causal, scale)
    if impl.kind == "reference":
        return reference_attention(q, k, v, impl.policy, scale=scale, causal=causal).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def attention_grads(q, k, v, grad_out, impl: AttentionImpl, *, causal: bool = False,
                    scale: float | None = None, out=None, lse=None):
    """``(dq, dk, dv)`` of attention under ``impl`` for the upstream gradient ``grad_out``.

    For ``flash``, ``out`` and ``lse`` may be what a forward stored (kept exactly as it
    ran); otherwise the forward is recomputed under ``impl``.
    """
    scale = _scale(q, scale)
    if impl.kind == "flash":
        if out is None or lse is None:
            out, lse = flash_attention(q, k, v, impl.policy, scale=scale, causal=causal, block_q=impl.block_q,
                                       block_k=impl.block_k, loop_order=impl.loop_order,
                                       fused_scale_max=impl.fused_scale_max)
        return flash_attention_backward(q, k, v, out, lse, grad_out, impl.policy, scale=scale, causal=causal,
                                        block_q=impl.block_q, block_k=impl.block_k,
                                        fused_scale_max=impl.fused_scale_max)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        o = attention_forward(*leaves, impl, causal=causal, scale=scale)
        return torch.autograd.grad(o, leaves, grad_out.to(o.dtype))


class _RecomputedBackward(torch.autograd.Function):
    """Pass a forward output through unchanged; its backward recomputes attention under another impl."""

    @staticmethod
    def forward(ctx, q, k, v, out, impl: AttentionImpl, causal: bool, scale: float):
        ctx.save_for_backward(q, k, v)
        ctx.impl, ctx.causal, ctx.scale = impl, causal, scale
        return out.clone()

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = attention_grads(q, k, v, grad_out, ctx.impl, causal=ctx.causal, scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


class Attention(nn.Module):
    """Drop-in for ``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)``.

    ``backward_impl`` (default None): when set, the forward value is still this module's
    ``impl`` (computed without autograd, bit for bit what it would be) and the backward
    is recomputed under ``backward_impl``. ``capture``: when a dict, the forward stores
    q, k, v and its output there and the backward stores dO (for diagnostics).
    """

    def __init__(self, impl: AttentionImpl | str = AttentionImpl()):
        super().__init__()
        self.impl = AttentionImpl.parse(impl) if isinstance(impl, str) else impl
        self.backward_impl: AttentionImpl | None = None
        self.capture: dict | None = None

    def forward(self, q, k, v, is_causal: bool = False, scale: float | None = None):
        scale = _scale(q, scale)
        if self.backward_impl is None:
            out = attention_forward(q, k, v, self.impl, causal=is_causal, scale=scale)
        else:
            with torch.no_grad():
                value = attention_forward(q, k, v, self.impl, causal=is_causal, scale=scale)
            out = _RecomputedBackward.apply(q, k, v, value, self.backward_impl, is_causal, scale)
        if self.capture is not None:
            self.capture.update(q=q.detach().clone(), k=k.detach().clone(), v=v.detach().clone(),
                                out=out.detach().clone(), causal=is_causal, scale=scale)
            if out.requires_grad:
                out.register_hook(lambda g, store=self.capture: store.__setitem__("grad_out", g.detach().clone()))
        return out

    def extra_repr(self) -> str:
        extra = f", backward={self.backward_impl.label}" if self.backward_impl is not None else ""
        return f"impl={self.impl.label}{extra}"
