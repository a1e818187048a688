"""Error metrics between a kernel's output and the golden value.

Conventions: ``a`` is the value under test, ``b`` the reference (usually the
fp64 golden). Relative errors divide by the reference. All reductions run in
float64. Position strata follow seed 000: the first 10% of query rows, the
middle 80%, the last 10%.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .precision import ulp, unit_roundoff

STRATA = ("first_10pct", "middle_80pct", "last_10pct")


def _pair(a, b):
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    return a.to(torch.float64), b.to(torch.float64)


def max_abs_error(a, b) -> float:
    a, b = _pair(a, b)
    return (a - b).abs().max().item()


def mean_abs_error(a, b) -> float:
    a, b = _pair(a, b)
    return (a - b).abs().mean().item()


def rel_l2_error(a, b) -> float:
    """||a - b||_2 / ||b||_2 over all elements (0 when both are 0)."""
    a, b = _pair(a, b)
    num, den = torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def max_rel_error(a, b) -> float:
    """max |a - b| / |b| over elements with b != 0 (elementwise; blows up near zeros of b)."""
    a, b = _pair(a, b)
    nz = b != 0
    if not bool(nz.any()):
        return 0.0
    return ((a - b).abs()[nz] / b.abs()[nz]).max().item()


def mean_rel_error(a, b) -> float:
    """mean |a - b| / |b| over elements with b != 0 (elementwise; 0 when every b is 0).

    Seed 000's reading of "mean relative error" (its 0.05% .. 1.2% are such means): unlike
    ``rel_l2_error``, every element counts alike, so an error confined to r of R rows is diluted
    by r / R (relative L2: by sqrt(r / R)), and entries of b near 0 weigh heavily.
    """
    a, b = _pair(a, b)
    nz = b != 0
    if not bool(nz.any()):
        return 0.0
    return ((a - b).abs()[nz] / b.abs()[nz]).mean().item()


def ulp_error(a, b, fmt: str) -> torch.Tensor:
    """|a - b| in units of the last place of ``b`` in ``fmt``, elementwise."""
    a, b = _pair(a, b)
    return (a - b).abs() / ulp(b, fmt)


def row_rel_l2(a, b) -> torch.Tensor:
    """Relative L2 error of every query row (norm over the last dim): shape a.shape[:-1]."""
    a, b = _pair(a, b)
    den = torch.linalg.vector_norm(b, dim=-1)
    num = torch.linalg.vector_norm(a - b, dim=-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)),
                       torch.where(num > 0, torch.full_like(num, math.inf), torch.zeros_like(num)))


def row_max_abs(a, b) -> torch.Tensor:
    a, b = _pair(a, b)
    return (a - b).abs().amax(dim=-1)


def strata_bounds(n: int) -> dict[str, slice]:
    """Row ranges of the three position strata of an ``n``-row sequence."""
    if n < 3:
        raise ValueError(f"position strata need at least 3 rows, got {n}")
    lo = max(1, int(round(0.1 * n)))
    hi = min(n - 1, n - lo)
    return {"first_10pct": slice(0, lo), "middle_80pct": slice(lo, hi), "last_10pct": slice(hi, n)}


def stratified(row_values: torch.Tensor, reduce: str = "mean") -> dict[str, float]:
    """Reduce per-row values (..., n) over each position stratum ("mean", "median" or "max")."""
    out = {}
    for name, rows in strata_bounds(row_values.shape[-1]).items():
        vals = row_values[..., rows].to(torch.float64).flatten()
        out[name] = {"mean": vals.mean, "median": vals.median, "max": vals.max}[reduce]().item()
    return out


def error_summary(a, b, fmt: str) -> dict[str, float]:
    """The standard set of scalar errors of one output against its reference."""
    ulps = ulp_error(a, b, fmt)
    return {
        "max_abs": max_abs_error(a, b),
        "mean_abs": mean_abs_error(a, b),
        "rel_l2": rel_l2_error(a, b),
        "max_rel": max_rel_error(a, b),
        "max_ulp": ulps.max().item(),
        "mean_ulp": ulps.mean().item(),
    }


def growth_lines(n, fmt: str) -> dict[str, np.ndarray]:
    """The probabilistic sqrt(N)*u and worst-case N*u growth lines (Higham; Higham & Mary 2019)."""
    n = np.asarray(n, dtype=float)
    u = unit_roundoff(fmt)
    return {"sqrt_n_u": np.sqrt(n) * u, "n_u": n * u}


def _linear_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least-squares y = a + b x; returns (a, b, R^2)."""
    design = np.stack([np.ones_like(x), x], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - (a + b * x)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return float(a), float(b), r2


GROWTH_MODELS = ("log2_n", "sqrt_n", "power_law")


def fit_growth(n, err) -> dict[str, dict[str, float]]:
    """Fit error against length three ways.

    ``log2_n``: err = a + b log2 N (seed 000's claim of logarithmic growth);
    ``sqrt_n``: err = a + b sqrt(N) (probabilistic rounding-error growth);
    ``power_law``: log err = a + b log N, so b is the growth exponent.
    Each entry has intercept, slope and R^2 (of the fit in its own space).
    """
    n = np.asarray(n, dtype=float)
    err = np.asarray(err, dtype=float)
    ok = np.isfinite(err) & (err > 0)
    if ok.sum() < 3:
        nan = {"intercept": math.nan, "slope": math.nan, "r2": math.nan}
        return {m: dict(nan) for m in GROWTH_MODELS}
    n, err = n[ok], err[ok]
    fits = {
        "log2_n": _linear_fit(np.log2(n), err),
        "sqrt_n": _linear_fit(np.sqrt(n), err),
        "power_law": _linear_fit(np.log(n), np.log(err)),
    }
    return {m: {"intercept": a, "slope": b, "r2": r2} for m, (a, b, r2) in fits.items()}


# -- NaN-aware helpers for extreme inputs (study 02) ------------------------------------------

def finiteness_counts(a, b) -> dict[str, int]:
    """How finite-ness of ``a`` departs from the golden ``b``, elementwise counts.

    ``nan_where_golden_finite`` / ``inf_where_golden_finite``: the kernel made a NaN or
    inf where the exact answer is finite; ``finite_where_golden_nonfinite``: the kernel
    returned a number where the exact answer is not one; ``golden_nonfinite``: entries
    of the golden that are inf or NaN.
    """
    a, b = _pair(a, b)
    golden_finite = torch.isfinite(b)
    return {
        "nan_where_golden_finite": int((torch.isnan(a) & golden_finite).sum()),
        "inf_where_golden_finite": int((torch.isinf(a) & golden_finite).sum()),
        "finite_where_golden_nonfinite": int((torch.isfinite(a) & ~golden_finite).sum()),
        "golden_nonfinite": int((~golden_finite).sum()),
    }


def finite_error_summary(a, b, fmt: str) -> dict[str, float]:
    """``max_abs``, ``rel_l2`` and ``max_ulp`` over the entries where both ``a`` and ``b`` are finite.

    NaN when no entry is finite in both; ``finite_fraction`` says how many entries counted.
    """
    a, b = _pair(a, b)
    both = torch.isfinite(a) & torch.isfinite(b)
    out = {"finite_fraction": both.double().mean().item() if both.numel() else math.nan}
    if not bool(both.any()):
        return dict(out, max_abs=math.nan, rel_l2=math.nan, max_ulp=math.nan)
    a, b = a[both], b[both]
    return dict(out, max_abs=max_abs_error(a, b), rel_l2=rel_l2_error(a, b), max_ulp=ulp_error(a, b, fmt).max().item())


def zero_rows(a, b) -> int:
    """Rows (last dim) of ``a`` that are exactly zero where the golden row ``b`` is not."""
    a, b = _pair(a, b)
    return int(((a == 0).all(dim=-1) & (b != 0).any(dim=-1)).sum())


def scaled_max_error(a, b, scale) -> float:
    """max |a - b| / scale, elementwise (``scale`` broadcasts).

    Equal entries (including equal infinities and NaN against NaN) count 0; a NaN or inf
    where ``b`` is finite counts inf; a nonzero difference over a zero scale counts inf.
    """
    a, b = _pair(a, b)
    scale = torch.as_tensor(scale, dtype=torch.float64, device=a.device).expand_as(a)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = (a - b).abs()
    ratio = torch.where(scale > 0, diff / torch.where(scale > 0, scale, torch.ones_like(scale)),
                        torch.full_like(diff, math.inf))
    ratio = torch.where(same, torch.zeros_like(ratio), torch.nan_to_num(ratio, nan=math.inf, posinf=math.inf))
    return ratio.max().item() if ratio.numel() else 0.0


def row_rel_l2_max(a, b) -> float:
    """The worst row's relative L2 error (NaN-safe: a non-finite row error counts inf)."""
    rows = row_rel_l2(a, b)
    return torch.nan_to_num(rows, nan=math.inf, posinf=math.inf).max().item()


def _finite_median(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return x.median().item() if x.numel() else math.nan


def _finite_quantile(x: torch.Tensor, q: float) -> float:
    x = x[torch.isfinite(x)].double()
    return torch.quantile(x, q).item() if x.numel() else math.nan


GRADS = ("dq", "dk", "dv")


def gradient_errors(grads, gold, *, quantiles=(), global_l2: bool = False) -> dict[str, float]:
    """Errors of attention gradients ``grads = (dq, dk, dv)`` against ``gold`` (a matching tuple or
    a dict with dq, dk, dv), the one measure of gradient error of every study:

    ``<g>_err``       median over rows of the row relative L2 error (seed 004's 219% is such a median)
    ``<g>_err_p<NN>`` that row error's quantiles (``quantiles``, e.g. (0.9,) gives ``_p90``)
    ``<g>_rel_err``   the global relative L2 error, and ``<g>_norm_ratio`` ||g|| / ||gold|| (``global_l2``)
    """
    gold = tuple(gold[g] for g in GRADS) if isinstance(gold, dict) else tuple(gold)
    out = {}
    for name, grad, ref in zip(GRADS, grads, gold):
        rows = row_rel_l2(grad, ref)
        out[f"{name}_err"] = _finite_median(rows)
        for q in quantiles:
            out[f"{name}_err_p{round(q * 100):02d}"] = _finite_quantile(rows, q)
        if global_l2:
            out[f"{name}_rel_err"] = rel_l2_error(grad, ref)
            ref_norm = torch.linalg.vector_norm(ref.double()).item()
            norm = torch.linalg.vector_norm(grad.double()).item()
            out[f"{name}_norm_ratio"] = (1.0 if norm == 0 else math.inf) if ref_norm == 0 else norm / ref_norm
    return out


def output_errors(out: torch.Tensor, gold: torch.Tensor) -> dict[str, float]:
    """``out_err``: relative L2 error of a forward output; ``out_err_coherence``: mean over columns
    of |mean_i e_ic| / rms_i e_ic of the error e (1: every row errs alike; ~N^-1/2: independent)."""
    err = out.double() - gold
    rms = err.pow(2).mean(-2).sqrt()
    return {"out_err": (torch.linalg.vector_norm(err) / torch.linalg.vector_norm(gold)).item(),
            "out_err_coherence": (err.mean(-2).abs() / rms.clamp_min(1e-300)).mean().item()}


def ds_row_sums(stats: dict, keys=("ds_exact_row_sum", "ds_rounded_row_sum", "ds_row_sum")) -> dict[str, float]:
    """Median over rows of |sum_j dS_ij| / sum_j |dS~_ij| for the backward emulator's ``stats``
    (NaN for each key when the kernel has no such statistics)."""
    if not stats:
        return {key: math.nan for key in keys}
    abs_sum = stats["ds_row_abs_sum"].clamp_min(1e-300)
    return {key: _finite_median(stats[key].abs() / abs_sum) for key in keys}
