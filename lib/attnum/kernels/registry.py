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
``textbook:fp32:no_max``, or ``package.module:function`` for a kernel of your own
(``CallableKernel``). ``get(name)`` builds the kernel a name stands for; ``names()`` lists
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
    has_backward: bool = True  # False: an inference kernel; ``backward`` raises KernelUnavailable

    def unavailable_reason(self, device: str | torch.device = "cpu") -> str | None:
        """None when the kernel can run on ``device``; otherwise a sentence saying why not."""
        return None

    def runs_as(self) -> str:
        """What computes this kernel's results, in words: for a real kernel, the backend or compiled
        kernel that runs (recorded in a results file's ``real_kernel_backends`` attribute)."""
        doc = (type(self).__doc__ or "").strip().split("\n")[0]
        return f"{type(self).__module__}.{type(self).__name__}" + (f": {doc}" if doc else "")

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


def family_table() -> str:
    """The registry as a Markdown table, one row per family in registration order: its name, its example
    names (``names()``) and its description. The README's kernel-family table is this text (checked by
    tests/io/test_environment.py); print it with ``python -c "from attnum.kernels.registry import
    family_table; print(family_table())"`` (importing the package registers every family first)."""
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    rows = ["| family | example names | what it is |", "|---|---|---|"]
    for family in _FAMILIES.values():
        examples = ", ".join(f"`{cell(name)}`" for name in family.examples)
        rows.append(f"| {cell(family.name)} | {examples} | {cell(family.doc)} |")
    return "\n".join(rows)


def names() -> list[str]:
    """An example name of every kernel the registry can build (every family's listed examples)."""
    return [example for family in _FAMILIES.values() for example in family.examples]


class CallableKernel(Kernel):
    """Bring your own kernel: ``package.module:function`` names an importable callable.

    The callable is either a ``Kernel`` (an instance, or a class or factory taking no arguments
    that returns one), used as it is, or a plain attention function with the signature of
    ``scaled_dot_product_attention``: ``f(q, k, v, is_causal=..., attn_mask=..., scale=...)``
    returning the output. A plain function gives no log-sum-exp, and its backward is autograd
    through it. Either way the kernel carries its own name, ``package.module:function``.
    """

    gives_lse = False

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def runs_as(self) -> str:
        return f"your own callable {self.name} ({getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', '?')})"

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        return self.fn(q, k, v, is_causal=causal, attn_mask=attn_bias, scale=scale)

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        with torch.no_grad():
            return self.differentiable(q, k, v, causal=causal, attn_bias=attn_bias, scale=scale), None


def _import_callable(name: str) -> Kernel:
    import importlib

    module_name, _, attr = name.partition(":")
    if not attr or ":" in attr:
        raise ValueError(f"a kernel of your own is named 'package.module:function', got {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} for kernel {name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"module {module_name!r} has no {attr!r} (kernel {name!r})")
    if isinstance(fn, Kernel):
        kernel = fn
    elif isinstance(fn, type) and issubclass(fn, Kernel):
        kernel = fn()
    elif callable(fn):
        kernel = CallableKernel(name, fn)
    else:
        raise ValueError(f"{name!r} is a {type(fn).__name__}, not a callable or a Kernel")
    if not kernel.name:
        kernel.name = name
    return kernel


def check_runs(kernel: Kernel, device="cpu", dtype=torch.float32, head_dim: int = 16) -> str | None:
    """None when ``kernel`` runs forward and backward on a tiny input (1 x 2 heads x 24 rows x ``head_dim``)
    on ``device`` and returns the right shapes and finite values; otherwise what went wrong (checked before a
    study runs). Production kernels take only some head dims (FlashInfer's prefill refuses 16): a caller
    that measures at a head dim checks at that one."""
    reason = kernel.unavailable_reason(device)
    if reason:
        return reason
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (1, 2, 24, head_dim)
    q, k, v, do = (torch.randn(*shape, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    try:
        out, lse = kernel.forward(q, k, v, causal=True)
        if tuple(out.shape) != tuple(q.shape) or not torch.isfinite(out).all():
            return (f"its output on a tiny input has shape {tuple(out.shape)} (want {tuple(q.shape)}) "
                    "or non-finite values")
        if lse is not None and tuple(lse.shape) != tuple(q.shape[:-1]):
            return f"its log-sum-exp has shape {tuple(lse.shape)}, want {tuple(q.shape[:-1])}"
        if not kernel.has_backward:
            return None
        grads = kernel.backward(q, k, v, do, causal=True)
    except Exception as exc:  # a user's kernel may raise anything: report it, before the study runs
        return f"it failed on a tiny input {shape} on {device}: {type(exc).__name__}: {exc}"
    if [tuple(g.shape) for g in grads] != [tuple(t.shape) for t in (q, k, v)]:
        return f"its gradients have shapes {[tuple(g.shape) for g in grads]}"
    return None


def get(name: str, **keywords) -> Kernel:
    """The kernel ``name`` stands for. ``keywords`` are options a family takes beyond its name
    (the emulator's ``fault`` and ``mask_fill``, the reference's ``query_chunk``). A name whose
    first part is a dotted module path (``package.module:function``) imports your own kernel."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a kernel name is a non-empty string like 'emulator:fa2_bf16:bk128', got {name!r}")
    family, *options = name.split(":")
    if family not in _FAMILIES:
        if len(options) == 1 and family.replace(".", "").replace("_", "").isalnum():
            if keywords:
                raise ValueError(f"a kernel of your own takes no options, got {sorted(keywords)}")
            try:
                return _import_callable(name)
            except ValueError as exc:
                raise ValueError(f"unknown kernel {name!r}: no family {family!r} (families: {sorted(_FAMILIES)}), "
                                 f"and not a kernel of your own: {exc}") from None
        raise ValueError(f"unknown kernel {name!r}: no family {family!r}; families: {sorted(_FAMILIES)} "
                         f"(examples: {names()}), or 'package.module:function' for a kernel of your own")
    try:
        return _FAMILIES[family].build(options, **keywords)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"cannot build kernel {name!r}: {exc}") from None
