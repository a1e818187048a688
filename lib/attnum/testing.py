"""``assert_attention_close``: is an attention output what a correct kernel of its precision gives?

For a kernel project's own tests (CI)::

    from attnum.testing import assert_attention_close
    assert_attention_close(my_kernel, q, k, v, causal=True)   # q, k, v in the kernel's input dtype

or, with pytest, ``pytest_plugins = ["attnum.testing"]`` in a ``conftest.py`` and the fixture
``attention_close`` (the same function).

The tolerance is not a fixed number: it is the error that the tiled FlashAttention emulator
(``attnum.kernels.emulator``) makes **on the same inputs** under the production precision policy of
the output's format (``fa2_<fmt>``: fp32 scores, statistics and accumulator, P and O in the format),
times ``FACTOR``. So it follows N, the head dim, the format and the inputs themselves. Two checks:

* **global**: the output's relative L2 error against fp64 attention (``golden_attention`` on the
  inputs as given) at most ``FACTOR`` times the emulator's;
* **per row**: each row's largest error in units of ``u_fmt * (P|V|)`` (the first-order rounding
  bound of the output, ``acceptance.error_scale``; it does not vanish where V cancels) at most
  ``FACTOR`` times the emulator's worst row plus ``ROW_FLOOR`` (one rounding of P and one of O,
  as ``acceptance.scaled_elementwise_rule``), so an error confined to a few rows is caught too;
* NaN or inf where the fp64 value is finite fails, and so does a row with no visible key (fully
  masked by ``attn_bias``) that comes out finite and non-zero: it gave masked keys weight.
  Such a row may be 0 (FlashAttention's convention) or NaN (a softmax over no keys).

Why ``FACTOR = 2``: on one H200 the real kernels measured by study 01 (PyTorch SDPA's flash,
efficient, cuDNN and math backends, FlexAttention and the Triton FA2 kernel; the committed run
``outputs/length_scaling/gpu/results.nc``, N = 512 to 131072, bf16 and fp16, head dims 64 and 128) had
relative L2 errors between about 0.7 and 1.5 times the emulator's at the same policy and inputs
(``band_spread`` reads the range from that file; ``tests/report`` checks that it stays below
``FACTOR``). Its false-alarm rate on correct kernels and its miss rate on study 02's injected faults
are measured by ``attnum.report.rates`` and stated in the report notebook.
"""
from __future__ import annotations

import dataclasses
import math

import torch

FACTOR = 2.0
"""Allowed multiple of the emulator's own error (see the module docstring for its justification)."""
ROW_FLOOR = 2.0
"""Allowed per-row error in u * (P|V|) units on top of ``FACTOR`` times the emulator's worst row."""
_FORMAT_OF = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
_ROWS_SHOWN = 8


class AttentionMismatch(AssertionError):
    """The output is not what a correct kernel of its precision gives; ``.result`` holds the numbers."""

    def __init__(self, message: str, result: "Closeness"):
        super().__init__(message)
        self.result = result


@dataclasses.dataclass
class Closeness:
    """What ``check_attention_close`` measured (errors of the output, of the emulator, the tolerances)."""

    fmt: str
    policy: str
    shape: tuple
    rel_l2: float
    emulator_rel_l2: float
    tolerance_rel_l2: float
    row_error: torch.Tensor  # (batch, heads, n_q): each row's largest error in u * (P|V|) units
    emulator_worst_row: float
    tolerance_row: float
    bad_rows: list  # (batch, head, row) over the row tolerance, worst first
    nonfinite_rows: list  # rows with NaN/inf where the fp64 value is finite
    masked_weight_rows: list  # rows with no visible key that came out finite and non-zero
    masked_rows: int  # rows with no visible key

    @property
    def passed(self) -> bool:
        return (self.rel_l2 <= self.tolerance_rel_l2 and not self.bad_rows and not self.nonfinite_rows
                and not self.masked_weight_rows)

    @property
    def worst_row(self) -> tuple | None:
        err = torch.nan_to_num(self.row_error, nan=-1.0)
        if err.numel() == 0:
            return None
        flat = int(err.flatten().argmax())
        return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))

    def message(self) -> str:
        n, d = self.shape[-2], self.shape[-1]
        lines = [f"attention output ({self.fmt}, N={n}, head dim {d}) is not what a correct {self.fmt} kernel gives "
                 f"(tolerance: {FACTOR:g} x the error of the emulator {self.policy} on the same inputs):"]
        if self.rel_l2 > self.tolerance_rel_l2:
            lines.append(f"  relative L2 error {self.rel_l2:.4g} > {self.tolerance_rel_l2:.4g}: a correct kernel "
                         f"(the emulator) gives {self.emulator_rel_l2:.4g}, this output "
                         f"{self.rel_l2 / self.emulator_rel_l2 if self.emulator_rel_l2 else math.inf:.3g}x that")
        if self.bad_rows:
            shown = ", ".join(f"(b={b}, h={h}, row={r}): {float(self.row_error[b, h, r]):.3g}"
                              for b, h, r in self.bad_rows[:_ROWS_SHOWN])
            lines.append(f"  {len(self.bad_rows)} of {self.row_error.numel()} rows err more than {self.tolerance_row:.3g} "
                         f"u*(P|V|) units (the emulator's worst row: {self.emulator_worst_row:.3g}); worst first: "
                         f"{shown}{' ...' if len(self.bad_rows) > _ROWS_SHOWN else ''}")
        if self.nonfinite_rows:
            lines.append(f"  {len(self.nonfinite_rows)} rows hold NaN/inf where the fp64 value is finite, first: "
                         + ", ".join(f"(b={b}, h={h}, row={r})" for b, h, r in self.nonfinite_rows[:_ROWS_SHOWN]))
        if self.masked_weight_rows:
            lines.append(f"  {len(self.masked_weight_rows)} of {self.masked_rows} rows with no visible key came out "
                         "finite and non-zero (masked keys given weight; a correct kernel gives 0 or NaN), first: "
                         + ", ".join(f"(b={b}, h={h}, row={r})" for b, h, r in self.masked_weight_rows[:_ROWS_SHOWN]))
        return "\n".join(lines)


def _as_output(kernel_or_output, q, k, v, causal, attn_bias, scale):
    if isinstance(kernel_or_output, torch.Tensor):
        return kernel_or_output
    from . import kernels

    kernel = kernel_or_output
    if isinstance(kernel, str):
        kernel = kernels.get(kernel)
    elif not isinstance(kernel, kernels.Kernel):
        if not callable(kernel):
            raise TypeError(f"kernel_or_output is an output tensor, a kernel name, a Kernel or an attention "
                            f"function f(q, k, v, is_causal=, attn_mask=, scale=), got {type(kernel).__name__}")
        kernel = kernels.CallableKernel(getattr(kernel, "__name__", "your kernel"), kernel)
    kernel.require(q.device)
    with torch.no_grad():
        return kernel.forward(q, k, v, causal=causal, attn_bias=attn_bias, scale=scale)[0]


def _rows(mask: torch.Tensor) -> list:
    return [tuple(int(i) for i in idx) for idx in mask.nonzero().tolist()]


def reference_values(q, k, v, *, fmt: str, causal: bool = False, attn_bias=None, scale: float | None = None,
                     policy=None, block_k: int = 128) -> dict:
    """What a check compares with, on inputs q, k, v as given: fp64 attention (``gold``), fp64 attention
    applied to |V| (``pv_abs``, the error scale's P|V|), and the emulator's output under ``policy``
    (default ``fa2_<fmt>``; ``emulator``). Computed once, it serves every output on the same inputs."""
    from . import kernels
    from .precision import get_policy, policy_for

    pol = get_policy(policy) if policy is not None else policy_for("fa2", fmt)
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
    opts = dict(causal=causal, attn_bias=attn_bias, scale=scale)
    return {"fmt": fmt, "policy": pol.name, "n_k": k.shape[-2],
            "gold": kernels.golden_attention(q64, k64, v64, **opts),
            "pv_abs": kernels.golden_attention(q64, k64, v64.abs(), **opts),
            "emulator": kernels.emulator(pol, block_q=128, block_k=block_k).forward(q64, k64, v64, **opts)[0].to(
                torch.float64),
            "masked": _fully_masked(attn_bias, q.shape[:-1], k.shape[-2], q.device)}


def _fully_masked(attn_bias, rows_shape, n_k, device) -> torch.Tensor:
    """Rows with no visible key (every bias entry -inf)."""
    if attn_bias is None:
        return torch.zeros(rows_shape, dtype=torch.bool, device=device)
    visible = (attn_bias.to(torch.float64) > -math.inf).expand(*rows_shape, n_k)
    return ~visible.any(dim=-1)


def _input_format(q, out) -> str | None:
    if q.dtype in (torch.bfloat16, torch.float16):
        return _FORMAT_OF[q.dtype]
    return _FORMAT_OF.get(out.dtype)


def check_attention_close(kernel_or_output, q, k, v, *, causal: bool = False, attn_bias=None,
                          scale: float | None = None, fmt: str | None = None, policy=None,
                          factor: float = FACTOR, block_k: int = 128, reference: dict | None = None) -> Closeness:
    """Measure an output (or run a kernel) against fp64 attention and the emulator; never raises on a
    mismatch (``assert_attention_close`` does). ``fmt``: the format the kernel computes in (default:
    q's dtype when it is bf16 or fp16, else the output's dtype); ``policy``: the emulator's precision
    policy (default ``fa2_<fmt>``); ``reference``: ``reference_values`` of these inputs, computed once."""
    from . import acceptance
    from .precision import unit_roundoff

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a tensor of shape (batch, heads, seq, head_dim), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    out = _as_output(kernel_or_output, q, k, v, causal, attn_bias, scale)
    expected = q.shape[:-1] + (v.shape[-1],)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(expected):
        raise ValueError(f"the attention output has shape {tuple(getattr(out, 'shape', ()))}, want {tuple(expected)}")
    fmt = fmt or (reference or {}).get("fmt") or _input_format(q, out)
    if fmt is None:
        raise ValueError(f"cannot tell the format of an output of dtype {out.dtype}; pass fmt='bf16'|'fp16'|'fp32'")
    ref = reference or reference_values(q, k, v, fmt=fmt, causal=causal, attn_bias=attn_bias, scale=scale,
                                        policy=policy, block_k=block_k)
    gold, masked = ref["gold"], ref["masked"]
    unit_fmt = fmt if fmt != "fp64" else "fp32"
    out64 = out.detach().to(torch.float64)
    finite_gold = torch.isfinite(gold).all(dim=-1)
    finite_out = torch.isfinite(out64).all(dim=-1)
    nonfinite = finite_gold & ~finite_out & ~masked
    masked_weight = masked & finite_out & (out64 != 0).any(dim=-1)
    scale_ = acceptance.error_scale(ref["pv_abs"], unit_fmt).clamp_min(torch.finfo(torch.float64).tiny)
    judged = finite_gold & ~masked

    def row_error(o):
        e = ((o - gold).abs() / scale_).amax(dim=-1)
        return torch.where(judged & torch.isfinite(o).all(dim=-1), e, torch.full_like(e, math.nan))

    def rel_l2(o):
        keep = (judged & torch.isfinite(o).all(dim=-1)).unsqueeze(-1).expand_as(o)
        den = torch.linalg.vector_norm(gold[keep])
        num = torch.linalg.vector_norm((o - gold)[keep])
        return float(num / den) if den > 0 else float(num)

    rows, rows_emu = row_error(out64), row_error(ref["emulator"])
    emu_worst = float(torch.nan_to_num(rows_emu, nan=0.0).max()) if rows_emu.numel() else 0.0
    tol_row = factor * emu_worst + ROW_FLOOR
    over = torch.nan_to_num(rows, nan=-1.0) > tol_row
    bad = sorted(_rows(over), key=lambda i: -float(rows[i]))
    rel, rel_emu = rel_l2(out64), rel_l2(ref["emulator"])
    return Closeness(fmt=fmt, policy=ref["policy"], shape=tuple(out.shape), rel_l2=rel, emulator_rel_l2=rel_emu,
                     tolerance_rel_l2=factor * rel_emu, row_error=rows, emulator_worst_row=emu_worst,
                     tolerance_row=tol_row, bad_rows=bad, nonfinite_rows=_rows(nonfinite),
                     masked_weight_rows=_rows(masked_weight), masked_rows=int(masked.sum()))


def assert_attention_close(kernel_or_output, q, k, v, **options) -> Closeness:
    """Raise ``AttentionMismatch`` (an ``AssertionError``) naming the rows, how far they are and what a
    correct kernel gives, unless the output is what a correct kernel of its precision gives
    (``check_attention_close``; same options). Returns the measurement when it passes.

    ``kernel_or_output``: the output tensor, a registry name (``"sdpa:math"``, ``"mypkg.mod:fn"``), a
    ``Kernel``, or a function with ``scaled_dot_product_attention``'s signature. Pass q, k, v in the
    kernel's input dtype (what it reads): the fp64 value is computed on exactly those numbers."""
    result = check_attention_close(kernel_or_output, q, k, v, **options)
    if not result.passed:
        raise AttentionMismatch(result.message(), result)
    return result


def band_spread(run=None) -> dict:
    """The spread of real kernels over the emulator in a committed study 01 GPU run (default
    ``outputs/length_scaling/gpu``): min, median and max over every output of the ratio of a real
    kernel's relative L2 error to the emulator's (``fa2_<dtype>``, FA2 loop, key block 128) on the
    same inputs, the number of outputs, and the kernels; None values when the run is not there."""
    import numpy as np

    if run is None:
        from .ncio import committed_run

        run = committed_run("length_scaling", "gpu")
    out = {"ratio_min": None, "ratio_median": None, "ratio_max": None, "outputs": 0, "kernels": None,
           "commit": None}
    if run is None or "real_rel_l2_err" not in run:
        return out
    emu = run["real_emulator_rel_l2_err"].sel(fidelity_config="bk128")
    ratio = (run["real_rel_l2_err"] / emu).values
    ratio = ratio[np.isfinite(ratio)]
    if ratio.size:
        out.update(ratio_min=float(ratio.min()), ratio_median=float(np.median(ratio)), ratio_max=float(ratio.max()),
                   outputs=int(ratio.size), kernels=", ".join(str(x) for x in run["real_kernel"].values),
                   commit=str(run.attrs.get("git_commit", ""))[:7] or None)
    return out


try:  # the pytest fixture, for ``pytest_plugins = ["attnum.testing"]``
    import pytest

    @pytest.fixture
    def attention_close():
        """``assert_attention_close``, as a fixture."""
        return assert_attention_close
except ImportError:  # pragma: no cover - pytest is not needed to use the function
    pass
