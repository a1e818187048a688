"""Study 04 on real kernels of the registry.

``real_mechanism_grid`` and ``real_kernel_diagnostics``
    real kernels of the registry (PyTorch SDPA pinned to one backend, our Triton
    FlashAttention-2, a kernel of your own) on the mechanism grid's operands, fed to
    them as bf16 tensors, beside the emulator variants on the same operands: median
    row dQ, dK, dV errors against fp64 and the correlation of the real kernel's dQ
    error with the emulator's; and the FP32 backward-recompute diagnostic on the
    trained checkpoint with a real kernel as every layer's attention (``InFormat``:
    q, k, v and dO handed to it in bf16, as the emulator rounds them). A kernel that
    cannot run here, refuses the inputs or runs out of memory is recorded with the
    reason, never replaced by another; a forward-only kernel (``has_backward`` False, e.g.
    FlashInfer's) is recorded as not applicable.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import xarray as xr

from ...progress import tqdm
from ... import kernels
from ...metrics import gradient_errors
from ...operands import golden_values, mechanism_operands
from ...precision import FORMATS, round_to
from .trainer import DIAG_ATTRS, recompute_backward_fp32, GPTConfig, add_key_offset, load_checkpoint, torch_threads
from .experiments import _median, _offset_vectors, _row_cos, variant_kernel

# -- real kernels on the mechanism grid ------------------------------------------------------------

REAL_FORMAT = "bf16"
"""The format real kernels are fed in (the mechanism operands are bf16 values)."""
REAL_GRADS = ("dq_err", "dk_err", "dv_err")


def error_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation over all elements of two error tensors (NaN when either is constant
    or has no finite element in common)."""
    a, b = a.double().flatten(), b.double().flatten()
    ok = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[ok] - a[ok].mean(), b[ok] - b[ok].mean()
    den = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    return (a @ b / den).item() if den > 0 else math.nan


NOT_APPLICABLE = "not applicable"
"""The status prefix of a kernel without a backward (an inference kernel): this study measures gradients."""


def kernel_status(kernel: kernels.Kernel, device: str) -> str:
    """"ok", or why ``kernel`` gives no gradients on ``device`` before anything runs: "not applicable: ..."
    for a forward-only kernel (on any device), "unavailable: ..." with the kernel's own reason."""
    if not getattr(kernel, "has_backward", True):
        return f"{NOT_APPLICABLE}: {kernel.name} has a forward only (no backward), and this study measures gradients"
    reason = kernel.unavailable_reason(device)
    return f"unavailable: {reason}" if reason else "ok"


def _failure(exc: BaseException) -> str:
    """The status of a kernel that raised: out of memory or refused, with the first line of the reason."""
    first = (str(exc).splitlines() or [""])[0]
    if isinstance(exc, torch.OutOfMemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return f"out of memory: {first[:200]}"
    return f"refused: {type(exc).__name__}: {first[:300]}"


def real_mechanism_grid(kernel_names, sharpness, mu_norms, seq_lens, head_dims, seeds, *,
                        variants, block_q: int, block_k: int, golden_chunk: int, device: str,
                        heads: int = 1, progress: bool = True,
                        threads: int = 1) -> xr.Dataset:
    """Real kernels on the mechanism grid's operands, beside the emulator ``variants`` on the same ones.

    Per sharpness x |mu| x N x d x seed: the operands of ``mechanism_operands`` (bf16 values) go
    to every real kernel as bf16 tensors (``kernel.forward`` / ``kernel.backward``, the registry's
    interface; SDPA kernels back-propagate through autograd) and to the emulator variants as in
    ``mechanism_grid``. Measured with ``gradient_errors`` against the fp64 gradients: median row
    dQ, dK, dV errors, the dQ error's alignment with mu, and the correlation over all elements of
    each real kernel's dQ error with each variant's. ``real_mech_status`` per (kernel, N, d): "ok",
    or the first reason it gave no gradients there ("not applicable: ...", "unavailable: ...",
    "refused: ...", "out of memory: ..."); after a failure the kernel is skipped for the rest of that (N, d).
    """
    real = [kernels.get(name) for name in kernel_names]
    emulated = [variant_kernel(name, block_q, block_k) for name in variants]
    grid = (len(sharpness), len(mu_norms), len(seq_lens), len(head_dims), len(seeds))
    err = {m: np.full((len(real),) + grid, np.nan) for m in REAL_GRADS + ("dq_err_cos_mu",)}
    emu = {m: np.full((len(emulated),) + grid, np.nan) for m in REAL_GRADS}
    corr = np.full((len(real), len(emulated)) + grid, np.nan)
    status = np.full((len(real), len(seq_lens), len(head_dims)), "ok", dtype=object)
    for r, kernel in enumerate(real):
        status[r] = kernel_status(kernel, device)
    low = FORMATS[REAL_FORMAT]
    work = [(c, n, e, d, f, seed, a, s, b, m) for c, n in enumerate(seq_lens) for e, d in enumerate(head_dims)
            for f, seed in enumerate(seeds) for a, s in enumerate(sharpness) for b, m in enumerate(mu_norms)]
    with torch_threads(threads):
        for c, n, e, d, f, seed, a, s, b, m in tqdm(work, desc="real kernels, mechanism grid",
                                                    disable=not progress):
            at = (a, b, c, e, f)
            q, k, v, do, mu = mechanism_operands(n, d, s, m, seed, heads=heads, device=device)
            gold = golden_values(q, k, v, do, golden_chunk)
            emu_dq_err = []
            for i, impl in enumerate(emulated):
                out, lse = impl.forward(q, k, v)
                grads = impl.backward(q, k, v, do, out=out, lse=lse)
                res = gradient_errors(grads, gold)
                for metric in REAL_GRADS:
                    emu[metric][(i,) + at] = res[metric]
                emu_dq_err.append(grads[0].double() - gold["dq"])
                del grads
            for r, kernel in enumerate(real):
                if status[r, c, e] != "ok":
                    continue
                operands = [t.to(low) for t in (q, k, v, do)]
                try:
                    out, lse = kernel.forward(*operands[:3])
                    stored = dict(out=out, lse=lse) if lse is not None else {}  # a forward the backward reads
                    grads = kernel.backward(*operands, **stored)
                    del out, lse, stored
                except (torch.OutOfMemoryError, RuntimeError, ValueError) as exc:  # recorded, never replaced
                    status[r, c, e] = _failure(exc)
                    continue
                res = gradient_errors(grads, gold)
                for metric in REAL_GRADS:
                    err[metric][(r,) + at] = res[metric]
                dq_err = grads[0].double() - gold["dq"]
                err["dq_err_cos_mu"][(r,) + at] = (_median(_row_cos(dq_err, mu)) if mu.abs().sum() > 0
                                                   else math.nan)
                for i, other in enumerate(emu_dq_err):
                    corr[(r, i) + at] = error_correlation(dq_err, other)
                del grads, dq_err
    dims = ("sharpness", "mu_norm", "real_seq_len", "real_head_dim", "seed")
    coords = {"real_kernel": list(kernel_names), "real_variant": list(variants),
              "sharpness": list(map(float, sharpness)), "mu_norm": list(map(float, mu_norms)),
              "real_seq_len": list(seq_lens), "real_head_dim": list(head_dims), "seed": list(seeds)}
    ds = xr.Dataset({f"real_mech_{m}": (("real_kernel",) + dims, err[m]) for m in err}, coords=coords)
    for m in REAL_GRADS:
        ds[f"real_mech_emulator_{m}"] = (("real_variant",) + dims, emu[m])
    ds["real_mech_dq_err_corr"] = (("real_kernel", "real_variant") + dims, corr)
    ds["real_mech_status"] = (("real_kernel", "real_seq_len", "real_head_dim"), status.astype(str))
    ds["real_variant_kernel"] = ("real_variant", [impl.name for impl in emulated])
    return ds


class InFormat(kernels.Kernel):
    """A kernel fed q, k, v and dO in ``fmt`` by an fp32 model, its output and gradients handed
    back in the model's format: a real kernel in the model the way the emulator's ``fa2_bf16``
    reads its operands (rounded by its ``inputs`` and ``grad_out`` stages), so the FP32
    recompute reads what the kernel read (``read_operands``). Without it an SDPA kernel in the
    fp32 model would run in fp32 (it reads q, k, v as given)."""

    def __init__(self, kernel: kernels.Kernel, fmt: str = REAL_FORMAT):
        self.inner, self.fmt, self.low = kernel, fmt, FORMATS[fmt]
        self.name = f"{kernel.name}+in={fmt}"
        self.gives_lse = kernel.gives_lse

    def unavailable_reason(self, device="cpu"):
        return self.inner.unavailable_reason(device)

    def read_operands(self, q, k, v, grad_out):
        return tuple(round_to(t.float(), self.fmt) for t in (q, k, v, grad_out))

    def _low(self, *ts):
        return [t.to(self.low) for t in ts]

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        out, lse = self.inner.forward(*self._low(q, k, v), causal=causal, attn_bias=attn_bias, scale=scale)
        return out.to(q.dtype), lse

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        return self.inner.differentiable(*self._low(q, k, v), causal=causal, attn_bias=attn_bias,
                                         scale=scale).to(q.dtype)

    def backward(self, q, k, v, grad_out, *, causal=False, attn_bias=None, scale=None, out=None, lse=None,
                 stats=None):
        grads = self.inner.backward(*self._low(q, k, v, grad_out), causal=causal, attn_bias=attn_bias,
                                    scale=scale)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def real_kernel_diagnostics(result, model_cfg: GPTConfig, batch, kernel_names, offset_norms, *,
                            threshold: float, seed: int, device: str, fmt: str = REAL_FORMAT,
                            progress: bool = True, threads: int = 1) -> xr.Dataset:
    """The FP32 recompute diagnostic on the run's last checkpoint with every layer's attention a real
    kernel (``InFormat``: fed in ``fmt``), with the common key offsets of ``checkpoint_diagnostics``.
    The recompute reference is the FP32 emulator. ``real_diag_status``: "ok" or why not."""
    step = max(result.checkpoints)
    directions = _offset_vectors(model_cfg, seed)
    names = [n for n in DIAG_ATTRS if n != "threshold"]
    n_layer = model_cfg.n_layer
    data = {n: np.full((len(kernel_names), len(offset_norms), n_layer), np.nan) for n in names}
    real = [kernels.get(name) for name in kernel_names]
    status = np.array([kernel_status(kernel, device) for kernel in real], dtype=object)
    work = [(r, o, norm) for r in range(len(real)) for o, norm in enumerate(offset_norms)]
    with torch_threads(threads):
        for r, o, norm in tqdm(work, desc="real-kernel diagnostics", disable=not progress):
            kernel = real[r]
            if status[r] != "ok":
                continue
            model = load_checkpoint(model_cfg, result.checkpoints[step], device=device)
            for layer, direction in enumerate(directions):
                add_key_offset(model, layer, direction.to(device) * float(norm))
            model.set_attention(InFormat(kernel, fmt))
            try:
                diag = recompute_backward_fp32(model, batch, threshold=threshold)
            except (torch.OutOfMemoryError, RuntimeError, ValueError) as exc:
                status[r] = _failure(exc)
                continue
            for n in names:
                data[n][r, o] = np.broadcast_to(diag[n].values, (n_layer,))
    dims = ("real_kernel", "offset_norm", "layer")
    ds = xr.Dataset({f"real_diag_{n}": (dims, data[n]) for n in names},
                    coords={"real_kernel": list(kernel_names), "offset_norm": list(map(float, offset_norms)),
                            "layer": list(range(n_layer))})
    for n in ("total_grad_norm_ratio", "forward_identical"):  # one value per model, not per layer
        ds[f"real_diag_{n}"] = ds[f"real_diag_{n}"].isel(layer=0, drop=True)
    ds["real_diag_status"] = ("real_kernel", status.astype(str))
    ds["real_diag_checkpoint"] = step
    return ds
