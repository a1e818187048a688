"""``flashinfer:prefill`` and ``flashinfer:decode``: FlashInfer's single-request attention kernels
(Ye et al., "FlashInfer: Efficient and Customizable Attention Engine for LLM Inference Serving", 2025,
arXiv 2501.01005), through ``flashinfer.single_prefill_with_kv_cache`` (``backend="fa2"``, named, never
"auto") and ``flashinfer.single_decode_with_kv_cache``.

FlashInfer is an inference library: these kernels have a forward only (``has_backward`` is False; a
backward is refused). Its releases up to 0.6.18.post1 defined ``constexpr float inf = 5e4`` in
``include/flashinfer/math.cuh`` and used it as the score of masked keys; 0.7.0 defines it as IEEE
infinity (the sentinel study 02 measures). ``mask_sentinel()`` reads the installed package's own header,
so a run records which one it measured. Two versions cannot share one environment: install each into its
own folder and run each in its own process.

Inputs (batch, heads, n, d) are passed one batch element at a time in FlashInfer's ``NHD`` layout. Masks:
``causal``, or an ``attn_bias`` whose values are 0 (keep) or -inf (mask) and which is the same for every
batch element and head, passed as FlashInfer's boolean ``custom_mask``; a finite bias cannot be expressed
and is refused. ``decode`` computes one query row per call (a decode step); for several query rows it is
called once per row with the keys that row may see (bottom-right causal alignment). The log-sum-exp
FlashInfer returns is in base 2 (``log2 sum 2^(s log2 e)``); ``forward`` converts it to the natural log of
the other kernels. Install: ``pip install flashinfer-python`` (kernels JIT-compile with ``nvcc``; set
``CUDA_HOME``).
"""
from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import torch

from .registry import Kernel, KernelUnavailable

MODES = ("prefill", "decode")


@functools.cache
def _module():
    import flashinfer

    return flashinfer


def version() -> str | None:
    try:
        return str(getattr(_module(), "__version__", None))
    except ImportError:
        return None


def mask_sentinel() -> str | None:
    """The masked-score value the installed FlashInfer's kernels use, read from its ``math.cuh``
    (``"5e4"`` for releases up to 0.6.18.post1, ``"infinity"`` from 0.7.0), or None if not found."""
    try:
        root = Path(_module().__file__).parent
    except ImportError:
        return None
    for header in root.glob("**/include/flashinfer/math.cuh"):
        match = re.search(r"constexpr\s+float\s+inf\s*=\s*([^;]+);", header.read_text(errors="replace"))
        if match:
            value = match.group(1).strip()
            return "infinity" if "infinity" in value.lower() else value
    return None


def _bool_mask(attn_bias: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    bias = attn_bias
    while bias.dim() > 2:
        if bias.shape[0] != 1:
            raise ValueError("flashinfer takes one mask for every batch element and head; got a bias of shape "
                             f"{tuple(attn_bias.shape)}")
        bias = bias[0]
    bias = bias.expand(n_q, n_k)
    finite = torch.isfinite(bias)
    if bool((finite & (bias != 0)).any()) or bool((~finite & (bias > 0)).any()):
        raise ValueError("flashinfer takes a boolean mask only: attn_bias must hold 0 (keep) or -inf (mask)")
    return finite


class FlashInferKernel(Kernel):
    """FlashInfer's single-request prefill or decode kernel."""

    has_backward = False

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"flashinfer:<mode> with mode in {list(MODES)}, got {mode!r}")
        self.mode = mode
        self.name = f"flashinfer:{mode}"

    def unavailable_reason(self, device="cpu") -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return "FlashInfer runs on CUDA GPUs only"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        try:
            _module()
        except ImportError as exc:
            return f"flashinfer is not installed (pip install flashinfer-python): {exc}"
        return None

    def runs_as(self) -> str:
        what = ("single_prefill_with_kv_cache, backend fa2" if self.mode == "prefill"
                else "single_decode_with_kv_cache, one query row a call")
        return f"flashinfer {version()} {what}; masked-score sentinel {mask_sentinel()}"

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        raise KernelUnavailable(f"{self.name} has no backward (FlashInfer is an inference library)")

    def backward(self, *args, **kwargs):
        raise KernelUnavailable(f"{self.name} has no backward (FlashInfer is an inference library)")

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        self.require(q.device)
        fi = _module()
        batch, heads, n_q, d = q.shape
        n_k = k.shape[2]
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        mask = None if attn_bias is None else _bool_mask(attn_bias, n_q, n_k)
        if causal and mask is not None:
            raise ValueError(f"{self.name}: give causal or attn_bias, not both")
        outs, lses = [], []
        with torch.no_grad():
            for b in range(batch):
                qb, kb, vb = (t[b].transpose(0, 1).contiguous() for t in (q, k, v))  # (n, heads, d)
                if self.mode == "prefill":
                    o, lse = fi.single_prefill_with_kv_cache(qb, kb, vb, custom_mask=mask, causal=causal,
                                                             sm_scale=scale, backend="fa2", return_lse=True)
                else:
                    rows_o, rows_lse = [], []
                    for i in range(n_q):
                        seen = n_k if not causal else i + 1 + (n_k - n_q)
                        keys = slice(0, max(seen, 0))
                        if mask is not None:
                            raise ValueError("flashinfer:decode takes no mask (a decode step sees its whole cache)")
                        o_i, lse_i = fi.single_decode_with_kv_cache(qb[i], kb[keys], vb[keys], sm_scale=scale,
                                                                    return_lse=True)
                        rows_o.append(o_i)
                        rows_lse.append(lse_i)
                    o, lse = torch.stack(rows_o), torch.stack(rows_lse)
                outs.append(o.transpose(0, 1))  # (heads, n, d)
                lses.append(lse.transpose(0, 1).float() * math.log(2.0))  # base 2 -> natural log
        return torch.stack(outs), torch.stack(lses)


def build(options: list[str], **keywords) -> FlashInferKernel:
    if keywords:
        raise ValueError(f"flashinfer kernels take no keywords, got {sorted(keywords)}")
    if len(options) != 1:
        raise ValueError(f"name one kernel: flashinfer:<mode> with mode in {list(MODES)}")
    return FlashInferKernel(options[0])
