"""The one interface every attention implementation offers, and the registry that names them.

A ``Kernel`` computes softmax(Q K^T * scale + mask) V for q, k, v of shape
(batch, heads, seq, head_dim):

    forward(q, k, v, *, causal, attn_bias, scale)           -> (out, lse)   lse None if it cannot give one
    backward(q, k, v, grad_out, *, causal, attn_bias, scale, out=None, lse=None) -> (dq, dk, dv)
    kernel(q, k, v, is_causal=..., scale=...)                -> out, differentiable (a model's attention)

``attn_bias`` is an additive mask broadcastable to (batch, heads, n_q, n_k) (-inf masks a key);
``causal`` the bottom-right aligned causal mask (``attnum.kernels.common.causal_mask``).

Every kernel has a short name that the studies, the NetCDF coordinates and the site use:
``family[:option...]``, e.g. ``emulator:fa2_bf16:bk128``, ``reference:fp32``, ``golden``,
``textbook:fp32:no_max``. ``get(name)`` builds the kernel a name stands for; ``names()`` lists
an example of every family, including kernels that cannot run on this machine: those answer
``unavailable_reason(device)`` with a sentence saying why, and refuse to run with
``KernelUnavailable``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch


class KernelUnavailable(RuntimeError):
    """The kernel cannot run here (no GPU, a missing package); the message says why."""


class Kernel:
    """Base of every attention implementation: the interface studies call."""

    name: str = ""
    gives_lse: bool = True  # False: ``forward`` returns (out, None); the kernel stores no log-sum-exp

    def unavailable_reason(self, device: str | torch.device = "cpu") -> str | None:
        """None when the kernel can run on ``device``; otherwise a sentence saying why not."""
        return None

    def require(self, device) -> None:
        reason = self.unavailable_reason(device)
        if reason:
            raise KernelUnavailable(f"kernel {self.name!r} cannot run on {device}: {reason}")

    def forward(self, q, k, v, *, causal: bool = False, attn_bias=None, scale: float | None = None):
        raise NotImplementedError

    def read_operands(self, q, k, v, grad_out):
        """q, k, v and dO as the kernel reads them (here: as given; emulators round them)."""
        return q, k, v, grad_out

    def differentiable(self, q, k, v, *, causal: bool = False, attn_bias=None, scale: float | None = None):
        """The output as an autograd graph (the default backward differentiates this)."""
        raise NotImplementedError

    def backward(self, q, k, v, grad_out, *, causal: bool = False, attn_bias=None, scale: float | None = None,
                 out=None, lse=None, stats: dict | None = None):
        """``(dq, dk, dv)`` for the upstream gradient ``grad_out``; by default through autograd.

        ``out``/``lse``: what a forward stored, for kernels whose backward reads them (the
        emulator); others recompute. ``stats``: per-row diagnostics, where a kernel has them.
        """
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            o = self.differentiable(*leaves, causal=causal, attn_bias=attn_bias, scale=scale)
            return torch.autograd.grad(o, leaves, grad_out.to(o.dtype))

    def __call__(self, q, k, v, is_causal: bool = False, scale: float | None = None, attn_mask=None):
        """Drop-in for ``F.scaled_dot_product_attention`` (an additive float ``attn_mask``)."""
        self.require(q.device)
        return self.differentiable(q, k, v, causal=is_causal, attn_bias=attn_mask, scale=scale)

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    doc: str
    build: Callable[..., Kernel]  # (options: list[str], **keywords) -> Kernel
    examples: tuple[str, ...]


_FAMILIES: dict[str, Family] = {}


def register(name: str, build: Callable[..., Kernel], *, doc: str, examples: tuple[str, ...]) -> None:
    """Add a family of kernels: ``build(options, **keywords)`` makes the kernel of ``name:opt1:opt2``."""
    if name in _FAMILIES:
        raise ValueError(f"kernel family {name!r} is registered already")
    _FAMILIES[name] = Family(name, doc, build, tuple(examples))


def families() -> dict[str, Family]:
    return dict(_FAMILIES)


def names() -> list[str]:
    """An example name of every kernel the registry can build (every family's listed examples)."""
    return [example for family in _FAMILIES.values() for example in family.examples]


def get(name: str, **keywords) -> Kernel:
    """The kernel ``name`` stands for. ``keywords`` are options a family takes beyond its name
    (the emulator's ``fault`` and ``mask_fill``, the reference's ``query_chunk``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a kernel name is a non-empty string like 'emulator:fa2_bf16:bk128', got {name!r}")
    family, *options = name.split(":")
    if family not in _FAMILIES:
        raise ValueError(f"unknown kernel {name!r}: no family {family!r}; families: {sorted(_FAMILIES)} "
                         f"(examples: {names()})")
    try:
        return _FAMILIES[family].build(options, **keywords)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"cannot build kernel {name!r}: {exc}") from None
