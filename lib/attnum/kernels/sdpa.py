"""PyTorch's ``scaled_dot_product_attention``, pinned to exactly one backend.

``sdpa:flash``, ``sdpa:efficient``, ``sdpa:cudnn``, ``sdpa:math``: each runs inside
``torch.nn.attention.sdpa_kernel([one backend])``, so inputs that backend does not take raise
(PyTorch's "No available kernel") instead of falling back to another backend; the error is
re-raised as ``BackendRefused`` naming the backend and PyTorch's reasons, so a study records it
as data. On a CPU, PyTorch has a math backend and a flash backend of its own (a C++ kernel, not
FlashAttention-2); the efficient and cuDNN backends need CUDA.

None of them returns the log-sum-exp through the public API: ``forward`` gives ``(out, None)``.
The backward is the backend's own, through autograd.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .registry import Kernel

BACKENDS = ("flash", "efficient", "cudnn", "math")
_CPU_BACKENDS = ("flash", "math")


class BackendRefused(RuntimeError):
    """The pinned backend refused these inputs (no fall-back to another backend was allowed)."""


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name]


class SdpaKernel(Kernel):
    gives_lse = False

    def __init__(self, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"unknown SDPA backend {backend!r}; backends: {list(BACKENDS)}")
        self.backend = backend
        self.name = f"sdpa:{backend}"

    def runs_as(self) -> str:
        return (f"torch {torch.__version__} scaled_dot_product_attention with SDPBackend."
                f"{_backend(self.backend).name} the only backend enabled (torch.nn.attention.sdpa_kernel): a call "
                "that returned ran on it; one it refused raised BackendRefused")

    def unavailable_reason(self, device="cpu") -> str | None:
        device = torch.device(device)
        if device.type == "cuda":
            return None if torch.cuda.is_available() else "torch sees no CUDA device"
        if device.type == "cpu" and self.backend not in _CPU_BACKENDS:
            return f"PyTorch's {self.backend} backend exists on CUDA devices only"
        return None

    def differentiable(self, q, k, v, *, causal: bool = False, attn_bias=None, scale: float | None = None,
                       bool_mask=None):
        """``bool_mask``: SDPA's boolean ``attn_mask`` (True: the query may attend the key), given
        instead of ``attn_bias`` to measure the backend's boolean-mask path; one or the other."""
        from torch.nn.attention import sdpa_kernel

        self.require(q.device)
        if bool_mask is not None:
            if attn_bias is not None:
                raise ValueError(f"{self.name}: give attn_bias or bool_mask, not both")
            if bool_mask.dtype != torch.bool:
                raise ValueError(f"{self.name}: bool_mask must be a torch.bool tensor, got {bool_mask.dtype}")
            mask = bool_mask
        else:
            mask = None if attn_bias is None else attn_bias.to(q.dtype)
        with sdpa_kernel([_backend(self.backend)]), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
            except torch.OutOfMemoryError:
                raise  # not a refusal: the backend took the inputs and ran out of memory
            except RuntimeError as exc:
                reasons = "; ".join(str(w.message).strip() for w in caught) or "no reason given"
                shown = "none" if mask is None else f"{'bool ' if mask.dtype == torch.bool else ''}{tuple(mask.shape)}"
                raise BackendRefused(f"{self.name} refused q {tuple(q.shape)} {q.dtype}, causal={causal}, "
                                     f"mask={shown}: {exc} "
                                     f"[PyTorch's reasons: {reasons}]") from None

    def forward(self, q, k, v, *, causal: bool = False, attn_bias=None, scale: float | None = None,
                bool_mask=None):
        with torch.no_grad():
            return self.differentiable(q, k, v, causal=causal, attn_bias=attn_bias, scale=scale,
                                       bool_mask=bool_mask), None


def build(options: list[str], **keywords) -> SdpaKernel:
    if keywords:
        raise ValueError(f"sdpa kernels take no options, got {sorted(keywords)}")
    if len(options) != 1:
        raise ValueError(f"name one backend: sdpa:<backend> with backend in {list(BACKENDS)}")
    return SdpaKernel(options[0])


MASKS = ("none", "causal", "additive", "boolean")


def probe(device="cuda", dtypes=("bf16", "fp16", "fp32"), head_dims=(64, 128, 256), masks=MASKS,
          seq_len: int = 256, backward: bool = True) -> list[dict]:
    """What each pinned backend accepts on ``device``, as data: one record per (backend, dtype,
    head_dim, mask) with ``forward`` / ``backward`` "ok" or the refusal's message. Nothing falls
    back: a refusal is ``BackendRefused`` (PyTorch's "No available kernel" under a single pinned backend, with
    PyTorch's reasons)."""
    from ..precision import FORMATS

    records = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for backend in BACKENDS:
        kernel = SdpaKernel(backend)
        reason = kernel.unavailable_reason(device)
        for fmt in dtypes:
            for d in head_dims:
                q, k, v = (torch.randn(1, 2, seq_len, d, generator=gen).to(device=device, dtype=FORMATS[fmt])
                           for _ in range(3))
                for mask in masks:
                    rec = {"backend": backend, "dtype": fmt, "head_dim": d, "mask": mask}
                    if reason:
                        rec.update(forward=f"unavailable: {reason}", backward=f"unavailable: {reason}")
                        records.append(rec)
                        continue
                    bias = None
                    if mask == "additive":
                        bias = torch.zeros(1, 1, seq_len, seq_len, device=device, dtype=q.dtype)
                        bias[..., :, seq_len // 2:] = float("-inf")
                    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
                    try:
                        keep = None
                        if mask == "boolean":  # SDPA's boolean mask: True = take part
                            keep = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
                        out = kernel.differentiable(*leaves, causal=mask == "causal", attn_bias=bias, bool_mask=keep)
                        rec["forward"] = "ok"
                    except (BackendRefused, RuntimeError) as exc:
                        rec.update(forward=str(exc)[:400], backward="no forward")
                        records.append(rec)
                        continue
                    if backward:
                        try:
                            out.float().sum().backward()
                            rec["backward"] = "ok"
                        except RuntimeError as exc:
                            rec["backward"] = str(exc)[:400]
                    records.append(rec)
    return records
