"""The fixes study 05 compares, in one registry, and the kernel-side pieces they need.

``FIXES`` maps each fix's name to what it changes and how it changes a base implementation
(``attnum.kernels.autograd.AttentionImpl``). The kernels, the cost model (``attnum.cost``), the
parameter schema of study 05 (``params/gproj_fix/schema.yaml``, checked against this registry by
a test) and the notebook all read these names. The base of study 05 is BF16 FlashAttention-3:
``fa2_bf16`` with the fused scale-max.

Where each fix acts:
  * ``forward_fix``: the exponent (``attnum.kernels.common.exponent``, ``fused=False``).
  * ``mean_key``: ``center_keys`` below, before the forward and the backward, and
    ``uncenter_key_grad`` on dK. Mean-key subtraction ("key smoothing", SageAttention, Zhang et al.
    2024, arXiv 2410.02367; seed 004 tried it): K - mean_j K_j over the key sequence of each
    (batch, head). Each row's scores shift by the constant q_i . mean, which softmax ignores, so
    the forward is unchanged in exact arithmetic, and so is the gradient: the centering's
    backward removes the mean of dK over keys, which is exactly 0 because the rows of dS sum to 0.
  * ``stable_max``: Qiu & Yao's STABLE offset, an option of the one forward emulator
    (``attnum.kernels.flash.flash_attention(stable_beta=...)``).
  * ``fp32_backward`` / ``fp32_attention``: precision policies (``PrecisionPolicy.with_backward``).
  * ``gproj_dq`` / ``gproj_dq_dk``: GProj in the backward emulator
    (``attnum.kernels.backward``, ``gproj="dq"`` / ``"dq_dk"``), named for the gradients corrected.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..precision import PRESETS


def center_keys(k: torch.Tensor) -> torch.Tensor:
    """K - mean_j K_j over the key sequence (dim -2), in k's dtype."""
    return k - k.mean(dim=-2, keepdim=True)


def uncenter_key_grad(dk: torch.Tensor) -> torch.Tensor:
    """The gradient with respect to the keys before centering: dK - mean_j dK_j."""
    return dk - dk.mean(dim=-2, keepdim=True)


@dataclasses.dataclass(frozen=True)
class Fix:
    """One fix: what it changes, and the change applied to a base ``AttentionImpl``."""

    name: str
    description: str
    apply: Callable  # (impl, stable_beta) -> impl


def _fp32_attention(impl, _beta):
    return impl.replace(policy=PRESETS["fp32"]) if impl.policy.carrier == torch.float32 else impl


FIXES: dict[str, Fix] = {fix.name: fix for fix in (
    Fix("none", "the kernel as it is (study 05's base: BF16 FlashAttention-3, fused scale-max)",
        lambda impl, _beta: impl),
    Fix("forward_fix", "seed 004's forward fix: subtract the row max, then scale (no fused scale-max)",
        lambda impl, _beta: impl.replace(fused_scale_max=False)),
    Fix("mean_key", "mean-key subtraction: the kernel reads K - mean_j K_j (forward unchanged in exact arithmetic)",
        lambda impl, _beta: impl.replace(center_keys=True)),
    Fix("stable_max", "Qiu & Yao's STABLE: on rows with a repeated max, offset beta*max (max > 0) or 0 (max < 0)",
        lambda impl, beta: impl.replace(stable_beta=float(beta))),
    Fix("fp32_backward", "FP32 attention backward: every backward stage in fp32 (dS not rounded), forward as it is",
        lambda impl, _beta: impl.replace(policy=impl.policy.backward_at_least("fp32"))),
    Fix("gproj_dq", "GProj, dQ only: r_i and (P K)_i accumulated beside dQ in the existing pass",
        lambda impl, _beta: impl.replace(gproj="dq")),
    Fix("gproj_dq_dk", "GProj, dQ and dK: one extra pass computes r first, then dS~ - r P feeds both matmuls",
        lambda impl, _beta: impl.replace(gproj="dq_dk")),
    Fix("fp32_attention", "FP32 attention, forward and backward (the level a fix should reach)", _fp32_attention),
)}


def with_fix(impl, fix: str, *, stable_beta: float = 2.0):
    """``impl`` with one fix of ``FIXES`` applied (``stable_beta``: the beta of ``stable_max``)."""
    if fix not in FIXES:
        raise ValueError(f"unknown fix {fix!r}; allowed: {list(FIXES)}")
    return FIXES[fix].apply(impl, stable_beta)
