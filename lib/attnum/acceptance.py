"""Acceptance rules: does a kernel's output pass?

* ``fixed_relative_rule``: a fixed relative tolerance (0.1% in seed 000).
* ``dynamic_threshold``: seed 000's length-, range- and dtype-scaled threshold,
  transcribed verbatim from its formula (the ROCm migration report, docs/sources.md).
* ``reference_relative_rule``: the FlashAttention / PyTorch test-suite rule
  ``err_kernel <= c * err_same_precision_reference + dtype_floor``, with the
  FlashAttention Hopper tests' floor ``2 * max|(ref + 0.3 - 0.3) - ref|``
  computed in the low dtype (testing-and-tools.md).
* ``scaled_elementwise_rule`` (study 02): every element's error in units of
  u * (P|V|), the first-order rounding bound of the output, at most ``c`` times
  the same measure of the same-policy unblocked reference plus a floor; the
  log-sum-exp is checked the same way (see ``error_scale``).
"""
from __future__ import annotations

import math

import torch

from .precision import round_to, unit_roundoff

RULES = ("fixed_0.1pct", "dynamic_threshold", "reference_relative")
DETECTION_RULES = RULES + ("scaled_elementwise", "scaled_elementwise_lse")
"""Study 02's rules: ``scaled_elementwise`` checks O only, ``scaled_elementwise_lse`` O and the LSE."""


def fixed_relative_rule(rel_err: float, rtol: float = 1e-3) -> bool:
    return bool(rel_err <= rtol)


def length_scale(n: int) -> float:
    return 0.8 + 0.15 * math.log2(n / 512)


def range_scale(x_max: float) -> float:
    return 1 + 0.05 * (x_max - 10) if x_max > 10 else 1.0


def precision_scale(fmt: str) -> float:
    return 1.0 if fmt == "fp32" else 1.2


def dynamic_threshold(n: int, x_max: float, fmt: str) -> float:
    """Seed 000: min(1e-4 * length_scale * range_scale * precision_scale, 5e-3)."""
    return min(1e-4 * length_scale(n) * range_scale(x_max) * precision_scale(fmt), 5e-3)


def dynamic_threshold_rule(rel_err: float, n: int, x_max: float, fmt: str) -> bool:
    return bool(rel_err <= dynamic_threshold(n, x_max, fmt))


def dtype_floor(golden: torch.Tensor, fmt: str) -> float:
    """2 * max|(g + 0.3 - 0.3) - g| with every step rounded to ``fmt`` (FA Hopper tests)."""
    g = round_to(golden.to(torch.float64), fmt)
    shifted = round_to(round_to(g + 0.3, fmt) - 0.3, fmt)
    return 2.0 * (shifted - g).abs().max().item()


def reference_relative_rule(err_kernel: float, err_reference: float, floor: float = 0.0,
                            c: float = 2.0) -> bool:
    """FlashAttention's rule: max error at most ``c`` times the same-precision reference's, plus a floor."""
    return bool(err_kernel <= c * err_reference + floor)


def error_scale(golden_abs: torch.Tensor, fmt: str) -> torch.Tensor:
    """u_fmt * golden_abs: the first-order size of a correct kernel's rounding error, elementwise.

    For the output pass ``golden_abs = softmax(S)|V|`` (attention applied to |V|,
    in fp64): rounding P with unit roundoff u moves O_ij by at most u (P|V|)_ij and
    rounding O adds at most u |O_ij| <= u (P|V|)_ij, so a correct production kernel
    (fp32 scores and statistics) errs by about 2 of these units; unlike |O| the scale
    does not vanish where the entries of V cancel. For the LSE pass
    ``max(|lse_golden|, 1)``.
    """
    return unit_roundoff(fmt) * golden_abs.to(torch.float64)


def scaled_elementwise_rule(kappa_kernel: float, kappa_reference: float, c: float = 2.0,
                            floor: float = 2.0) -> bool:
    """Pass when kappa_kernel <= c * kappa_reference + floor (kappa: max error in ``error_scale`` units).

    ``kappa_reference`` is the same measure for unblocked attention under the kernel's
    own precision policy, so policy-specific terms (fp32 scores of huge logits, low
    precision statistics) are allowed for; ``floor`` = 2 is the first-order bound
    itself (one rounding of P, one of O), so the rule accepts a correct kernel even
    where the reference happens to be exact.
    """
    return bool(kappa_kernel <= c * kappa_reference + floor)


def judge(*, rel_l2: float, max_abs: float, n: int, x_max: float, fmt: str, reference_max_abs: float,
          floor: float, kappa: float | None = None, kappa_reference: float | None = None,
          kappa_lse: float | None = None, kappa_reference_lse: float | None = None) -> dict[str, bool]:
    """The verdict of every rule on one output, ``{rule: passed}``: the one place studies apply rules.

    ``rel_l2``/``max_abs``: the output's errors against the golden value; ``n``, ``x_max``,
    ``fmt``: what seed 000's dynamic threshold scales with; ``reference_max_abs`` and ``floor``:
    the same-precision reference's max error and the dtype floor of the reference-relative
    rule. With ``kappa`` (and ``kappa_reference``), the scaled elementwise rule on O; with
    ``kappa_lse`` (and ``kappa_reference_lse``) also on the log-sum-exp (``DETECTION_RULES``).
    """
    verdict = {
        "fixed_0.1pct": fixed_relative_rule(rel_l2, 1e-3),
        "dynamic_threshold": dynamic_threshold_rule(rel_l2, n, x_max, fmt),
        "reference_relative": reference_relative_rule(max_abs, reference_max_abs, floor, c=2.0),
    }
    if kappa is not None:
        verdict["scaled_elementwise"] = scaled_elementwise_rule(kappa, kappa_reference)
        if kappa_lse is not None:
            verdict["scaled_elementwise_lse"] = (verdict["scaled_elementwise"]
                                                 and scaled_elementwise_rule(kappa_lse, kappa_reference_lse))
    return verdict
