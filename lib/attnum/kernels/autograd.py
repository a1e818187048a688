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

Fixes of the flash kernel (study 05) are options of ``AttentionImpl``: ``fused_scale_max``
off is seed 004's forward fix, ``gproj`` its backward projection (``attnum.backward``),
``center_keys`` mean-key subtraction and ``stable_beta`` Qiu & Yao's max shift
(``attnum.fixes``); an FP32 backward is a policy (``PrecisionPolicy.with_backward``).
``FIXES`` names each one as a change of a base implementation (``with_fix``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .backward import GPROJ_MODES, flash_attention_backward
from .fixes import center_keys, stable_flash_attention, uncenter_key_grad
from .flash import LOOP_ORDERS, flash_attention
from .precision import BACKWARD_STAGES, SIGNIFICAND_BITS, PrecisionPolicy, get_policy
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
    gproj: str = "off"  # GProj: "off", "dq" (dQ correction, one pass) or "full" (dQ and dK, two passes)
    center_keys: bool = False  # mean-key subtraction: the kernel reads K - mean_j K_j
    stable_beta: float = 0.0  # > 0: Qiu & Yao's STABLE max shift with this beta (0: the plain row max)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown attention implementation {self.kind!r}; allowed: {list(KINDS)}")
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
        if self.kind != "flash" and self.has_fix:
            raise ValueError(f"gproj, center_keys and stable_beta are options of the flash kernel, not {self.kind!r}")
        object.__setattr__(self, "policy", get_policy(self.policy))

    @property
    def has_fix(self) -> bool:
        """True when a study 05 option (GProj, mean-key subtraction, STABLE) is on."""
        return self.gproj != "off" or self.center_keys or self.stable_beta > 0

    @classmethod
    def parse(cls, text: str, **options) -> "AttentionImpl":
        """From ``"flash:fa2_bf16"``, ``"flash:fa2_bf16:fused"``, ``"reference:fp32"`` or ``"sdpa"``.

        Flags after the policy, in any order: ``fused``, ``gproj`` (two-pass GProj), ``gproj_dq``,
        ``center_keys``, ``stable`` (beta 2) or ``stable=<beta>``.
        """
        kind, *rest = text.split(":")
        while rest and (rest[-1] in _FLAGS or rest[-1].startswith("stable=")):
            flag = rest.pop()
            if flag.startswith("stable="):
                options["stable_beta"] = float(flag.split("=", 1)[1])
            else:
                options.update(_FLAGS[flag])
        if len(rest) > 1:
            raise ValueError(f"cannot read attention implementation {text!r}; e.g. 'flash:fa2_bf16:fused'")
        policy = rest[0] if rest else ("fp32" if kind == "sdpa" else "fa2_bf16")
        return cls(kind=kind, policy=policy, **options)

    @property
    def label(self) -> str:
        if self.kind == "sdpa":
            return "sdpa"
        flags = [":fused" if self.fused_scale_max else "",
                 {"off": "", "dq": ":gproj_dq", "full": ":gproj"}[self.gproj],
                 ":center_keys" if self.center_keys else "",
                 f":stable={self.stable_beta:g}" if self.stable_beta else ""]
        return f"{self.kind}:{self.policy.name}" + "".join(flags)

    def replace(self, **changes) -> "AttentionImpl":
        return dataclasses.replace(self, **changes)


_FLAGS = {"fused": {"fused_scale_max": True}, "gproj": {"gproj": "full"}, "gproj_dq": {"gproj": "dq"},
          "center_keys": {"center_keys": True}, "stable": {"stable_beta": 2.0}}

FP32_BACKWARD = AttentionImpl("flash", "fp32")
"""The FP32 recompute of the diagnostic: the flash emulator with no rounding anywhere."""


def _backward_at_least_fp32(policy: PrecisionPolicy) -> PrecisionPolicy:
    """Every backward stage narrower than fp32 widened to fp32 (an fp64 policy stays as it is)."""
    narrow = {s: "fp32" for s in BACKWARD_STAGES if SIGNIFICAND_BITS[getattr(policy, s)] < SIGNIFICAND_BITS["fp32"]}
    return policy.replace(name=f"{policy.name}+bwd=fp32", **narrow) if narrow else policy


# name -> (what it changes, the change applied to a base implementation)
FIXES = {
    "none": ("the kernel as it is (study 05's base: BF16 FlashAttention-3, fused scale-max)",
             lambda impl: impl),
    "forward_fix": ("seed 004's forward fix: subtract the row max, then scale (no fused scale-max)",
                    lambda impl: impl.replace(fused_scale_max=False)),
    "mean_key": ("mean-key subtraction: the kernel reads K - mean_j K_j (forward unchanged in exact arithmetic)",
                 lambda impl: impl.replace(center_keys=True)),
    "stable_max": ("Qiu & Yao's STABLE: on rows with a repeated max, offset beta*max (max > 0) or 0 (max < 0)",
                   lambda impl, beta=2.0: impl.replace(stable_beta=float(beta))),
    "fp32_backward": ("FP32 attention backward: every backward stage in fp32 (dS not rounded), forward as it is",
                      lambda impl: impl.replace(policy=_backward_at_least_fp32(impl.policy))),
    "gproj_dq": ("GProj, dQ only: r_i and (P K)_i accumulated beside dQ in the existing pass",
                 lambda impl: impl.replace(gproj="dq")),
    "gproj": ("GProj, dQ and dK: one extra pass computes r first, then dS~ - r P feeds both matmuls",
              lambda impl: impl.replace(gproj="full")),
    "fp32_attention": ("FP32 attention, forward and backward (the level a fix should reach)",
                       lambda impl: impl.replace(policy=get_policy("fp32") if impl.policy.carrier == torch.float32
                                                 else impl.policy)),
}


def with_fix(impl: AttentionImpl, fix: str, *, stable_beta: float = 2.0) -> AttentionImpl:
    """``impl`` with one fix of ``FIXES`` applied (``stable_beta``: the beta of ``stable_max``)."""
    if fix not in FIXES:
        raise ValueError(f"unknown fix {fix!r}; allowed: {list(FIXES)}")
    change = FIXES[fix][1]
    return change(impl, stable_beta) if fix == "stable_max" else change(impl)


def _scale(q, scale):
    return default_scale(q.shape[-1]) if scale is None else float(scale)


class FlashAttentionFunction(torch.autograd.Function):
    """Emulated FlashAttention forward and backward under ``impl`` (kind ``flash``)."""

    @staticmethod
    def forward(ctx, q, k, v, impl: AttentionImpl, causal: bool, scale: float):
        out, lse = flash_forward(q, k, v, impl, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.impl, ctx.causal, ctx.scale = impl, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, out, lse, grad_out, ctx.impl, causal=ctx.causal, scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def flash_forward(q, k, v, impl: AttentionImpl, *, causal: bool = False, scale: float | None = None):
    """``(out, lse)`` of the flash emulator under ``impl``, its forward-side fixes included."""
    scale = _scale(q, scale)
    if impl.center_keys:
        k = center_keys(k.to(impl.policy.carrier))
    if impl.stable_beta:
        return stable_flash_attention(q, k, v, impl.policy, scale=scale, causal=causal, block_q=impl.block_q,
                                      block_k=impl.block_k, fused_scale_max=impl.fused_scale_max,
                                      beta=impl.stable_beta)
    return flash_attention(q, k, v, impl.policy, scale=scale, causal=causal, block_q=impl.block_q,
                           block_k=impl.block_k, loop_order=impl.loop_order, fused_scale_max=impl.fused_scale_max)


def flash_backward(q, k, v, out, lse, grad_out, impl: AttentionImpl, *, causal: bool = False,
                   scale: float | None = None, stats: dict | None = None):
    """``(dq, dk, dv)`` of the flash emulator under ``impl`` from what its forward stored."""
    scale = _scale(q, scale)
    k_read = center_keys(k.to(impl.policy.carrier)) if impl.center_keys else k
    dq, dk, dv = flash_attention_backward(q, k_read, v, out, lse, grad_out, impl.policy, scale=scale,
                                          causal=causal, block_q=impl.block_q, block_k=impl.block_k,
                                          fused_scale_max=impl.fused_scale_max, gproj=impl.gproj, stats=stats)
    if impl.center_keys:
        dk = impl.policy.round(uncenter_key_grad(dk), "grad")  # the centering's own backward
    return dq, dk, dv


def attention_forward(q, k, v, impl: AttentionImpl, *, causal: bool = False, scale: float | None = None):
    """Differentiable attention output under ``impl``."""
    scale = _scale(q, scale)
    if impl.kind == "flash":
        return FlashAttentionFunction.apply(q, k, v, impl, causal, scale)
    if impl.kind == "reference":
        return reference_attention(q, k, v, impl.policy, scale=scale, causal=causal).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def attention_grads(q, k, v, grad_out, impl: AttentionImpl, *, causal: bool = False,
                    scale: float | None = None, out=None, lse=None, stats: dict | None = None):
    """``(dq, dk, dv)`` of attention under ``impl`` for the upstream gradient ``grad_out``.

    For ``flash``, ``out`` and ``lse`` may be what a forward stored (kept exactly as it
    ran); otherwise the forward is recomputed under ``impl``. ``stats``: filled with the
    backward's per-row dS diagnostics (flash only; see ``flash_attention_backward``).
    """
    scale = _scale(q, scale)
    if impl.kind == "flash":
        if out is None or lse is None:
            out, lse = flash_forward(q, k, v, impl, causal=causal, scale=scale)
        return flash_backward(q, k, v, out, lse, grad_out, impl, causal=causal, scale=scale, stats=stats)
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
