"""``flashinfer:prefill``, ``flashinfer:decode`` and ``flashinfer:decode_paged``: FlashInfer's attention
kernels (Ye et al., "FlashInfer: Efficient and Customizable Attention Engine for LLM Inference Serving",
2025, arXiv 2501.01005), through ``flashinfer.single_prefill_with_kv_cache`` (``backend="fa2"``, named,
never "auto"), ``flashinfer.single_decode_with_kv_cache`` and the paged-cache batch decode
``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` (``backend="fa2"``, CUDA-core decode kernel, ``NHD``
layout), the kernel of FlashInfer issue 4450's report.

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
called once per row with the keys that row may see (bottom-right causal alignment). ``decode_paged``
(option ``p<page size>``, default 16 tokens a page) stores each batch element's keys and values once as a
paged cache, ``[pages, page size, heads, d]``, and runs every query row as one request of a single batch
call whose page table lists the pages of the keys that row may see (rows of one element share its pages,
as requests with a common prefix do in a server; the last page's length cuts it). The log-sum-exp
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

MODES = ("prefill", "decode", "decode_paged")
DEFAULT_PAGE_SIZE = 16
_WORKSPACE_BYTES = 128 * 2**20  # the float workspace FlashInfer's examples allocate for a batch decode


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


def rows_keys(n_q: int, n_k: int, causal: bool) -> list[int]:
    """How many keys (a prefix of the cache) each of ``n_q`` query rows sees: all ``n_k``, or under
    ``causal`` bottom-right alignment ``i + 1 + n_k - n_q``. A row that would see none is refused."""
    seen = [n_k if not causal else i + 1 + (n_k - n_q) for i in range(n_q)]
    if n_k < 1 or min(seen) < 1:
        raise ValueError(f"flashinfer:decode_paged: every query row must see at least one key (n_q {n_q}, "
                         f"n_k {n_k}, causal {causal}); a decode step with an empty cache has no answer")
    return seen


def page_table(seen: list[int], page_size: int, first_page: int = 0) -> tuple[list[int], list[int], list[int]]:
    """FlashInfer's CSR page table (``indptr``, ``indices``, ``last_page_len``) for requests that read the
    first ``seen[r]`` tokens of one cache stored from page ``first_page`` on: request r's pages are
    ``indices[indptr[r]:indptr[r + 1]]``, the first ceil(seen / page size) pages, and ``last_page_len[r]``
    (1 to the page size) the tokens it reads of the last."""
    indptr, indices, last = [0], [], []
    for n in seen:
        pages = -(-n // page_size)
        indices.extend(range(first_page, first_page + pages))
        indptr.append(len(indices))
        last.append(n - (pages - 1) * page_size)
    return indptr, indices, last


def paged_cache(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """Keys or values ``(n, heads, d)`` as pages ``(ceil(n / page size), page size, heads, d)`` (``NHD``),
    the last page's unused slots zero (a page table's ``last_page_len`` keeps them out)."""
    n, heads, d = x.shape
    pages = -(-n // page_size)
    out = x.new_zeros(pages * page_size, heads, d)
    out[:n] = x
    return out.view(pages, page_size, heads, d)


class FlashInferKernel(Kernel):
    """FlashInfer's single-request prefill or decode kernel, or its paged-cache batch decode."""

    has_backward = False

    def __init__(self, mode: str, page_size: int = DEFAULT_PAGE_SIZE):
        if mode not in MODES:
            raise ValueError(f"flashinfer:<mode> with mode in {list(MODES)}, got {mode!r}")
        if page_size < 1:
            raise ValueError(f"flashinfer:decode_paged: the page size must be >= 1 token, got {page_size}")
        self.mode, self.page_size = mode, int(page_size)
        own_pages = mode == "decode_paged" and page_size != DEFAULT_PAGE_SIZE
        self.name = f"flashinfer:{mode}" + (f":p{page_size}" if own_pages else "")

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
        what = {"prefill": "single_prefill_with_kv_cache, backend fa2",
                "decode": "single_decode_with_kv_cache, one query row a call",
                "decode_paged": f"BatchDecodeWithPagedKVCacheWrapper, backend fa2, NHD, {self.page_size} tokens a page, "
                                "every query row one request"}[self.mode]
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
        if self.mode == "decode_paged":
            if mask is not None:
                raise ValueError("flashinfer:decode_paged takes no mask (a decode step sees its whole cache)")
            return self._paged(fi, q, k, v, causal, scale)
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

    def _paged(self, fi, q, k, v, causal, scale):
        """Every query row of every batch element as one request of a single batch decode call."""
        batch, heads, n_q, d = q.shape
        kv_heads, n_k = k.shape[1], k.shape[2]
        seen = rows_keys(n_q, n_k, causal)
        caches_k, caches_v, indptr, indices, last = [], [], [0], [], []
        first_page = 0
        for b in range(batch):
            kb, vb = (t[b].transpose(0, 1).contiguous() for t in (k, v))  # (n_k, kv heads, d)
            caches_k.append(paged_cache(kb, self.page_size))
            caches_v.append(paged_cache(vb, self.page_size))
            ptr, idx, lst = page_table(seen, self.page_size, first_page)
            base = indptr[-1]
            indptr.extend(p + base for p in ptr[1:])
            indices.extend(idx)
            last.extend(lst)
            first_page += caches_k[-1].shape[0]
        device = q.device
        as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=device)
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=False, backend="fa2")
        with torch.no_grad():
            wrapper.plan(as_int(indptr), as_int(indices), as_int(last), heads, kv_heads, d, self.page_size,
                         q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=scale)
            rows = q.permute(0, 2, 1, 3).reshape(batch * n_q, heads, d).contiguous()  # one request a row
            o, lse = wrapper.run(rows, (torch.cat(caches_k), torch.cat(caches_v)), return_lse=True)
        out = o.reshape(batch, n_q, heads, d).permute(0, 2, 1, 3)
        lse = lse.reshape(batch, n_q, heads).permute(0, 2, 1).float() * math.log(2.0)  # base 2 -> natural log
        return out, lse


def build(options: list[str], **keywords) -> FlashInferKernel:
    if keywords:
        raise ValueError(f"flashinfer kernels take no keywords, got {sorted(keywords)}")
    if not options or len(options) > 2:
        raise ValueError(f"name one kernel: flashinfer:<mode> with mode in {list(MODES)} "
                         "(decode_paged also takes :p<page size>)")
    mode, rest = options[0], options[1:]
    if rest and (mode != "decode_paged" or not re.fullmatch(r"p[1-9][0-9]*", rest[0])):
        raise ValueError(f"flashinfer:{':'.join(options)}: only decode_paged takes an option, p<page size> "
                         "(e.g. flashinfer:decode_paged:p16)")
    return FlashInferKernel(mode, int(rest[0][1:]) if rest else DEFAULT_PAGE_SIZE)
