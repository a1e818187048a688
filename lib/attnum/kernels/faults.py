"""Injected faults: realistic FlashAttention forward bugs, each with a severity knob.

Each fault is a ``KernelHooks`` subclass (``attnum.kernels.flash``) that overrides one
hook of the emulator, so ``flash_attention(..., fault=make_fault(name))`` runs
the tiled algorithm with exactly that bug. Severities are listed mildest
first; ``severity_level`` 0 is the mildest. The bugs:

  missed_rescale      the output accumulator is not rescaled by exp(m_old - m_new)
                      on the first ``severity`` key blocks after block 0
                      (a software-pipelining slip: the rescale of the prologue's
                      successor is dropped). Severity: number of blocks.
  stale_max           P of the first ``severity`` key blocks after block 0 uses the
                      running max from *before* the block (max update issued after
                      the exponent), so a block that raises the max is overweighted
                      and P can exceed 1. Severity: number of blocks.
  dropped_tail        the key loop stops ``severity`` keys early (seed 003's 1025
                      case: a loop over whole 128-key tiles reads 1024 of 1025
                      keys). Severity: keys never read.
  low_precision_sum   the running row sum l is stored with ``severity`` significand
                      bits (8 = bf16) instead of fp32.
  narrow_p            P is rounded to ``severity`` significand bits before the PV
                      matmul (4 = fp8 e4m3's significand) instead of the policy's
                      p format.
  finite_sentinel     masked scores and the running-max start are the finite value
                      ``severity`` instead of -inf (FlashInfer's -5e4 up to
                      0.6.18.post1; FlashInfer issue 4267). Rows whose valid raw logits are all far below it
                      come out zero.
  off_by_one_causal   the causal mask lets query i see keys up to i + ``severity``
                      (future keys leak). No effect without a causal mask.
  low_precision_lse   the stored log-sum-exp keeps ``severity`` significand bits
                      (8 = bf16). The output O is unchanged: only a check of the
                      LSE (what the backward pass reads) can see it.

The significand rounding of the bit-width faults keeps fp32's exponent range: it
models lost precision, not a narrower format's overflow or underflow.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from .flash import KernelHooks


def round_significand(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round to ``bits`` significand bits (hidden bit included), to nearest even, same dtype.

    ``bits=8`` equals bf16 rounding and ``bits=11`` fp16 rounding for values in
    their normal range; inf, NaN and 0 pass through.
    """
    if not 1 <= int(bits) <= 52:
        raise ValueError(f"significand bits must be in 1..52, got {bits!r}")
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    rounded = torch.ldexp(torch.round(torch.ldexp(mantissa, torch.tensor(int(bits), device=x.device))), exponent - int(bits))
    return torch.where(torch.isfinite(x), rounded.to(x.dtype), x)


@dataclasses.dataclass(frozen=True)
class Fault(KernelHooks):
    """A kernel bug at one severity. Subclasses set the class attributes and override one hook."""

    severity: float
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    severity_meaning: ClassVar[str] = ""
    severities: ClassVar[tuple] = ()
    default_severity: ClassVar[float] = 0
    needs_causal: ClassVar[bool] = False

    def __str__(self) -> str:
        return f"{self.name}(severity={self.severity:g})"


def _blocks_affected(block: int, severity) -> bool:
    return 1 <= block <= int(severity)


@dataclasses.dataclass(frozen=True)
class MissedRescale(Fault):
    name: ClassVar[str] = "missed_rescale"
    description: ClassVar[str] = "output accumulator not rescaled when the running max moves"
    severity_meaning: ClassVar[str] = "key blocks (after the first) whose rescale is skipped"
    severities: ClassVar[tuple] = (1, 2, 4, 8)
    default_severity: ClassVar[float] = 1

    def acc_rescale(self, block, alpha):
        return torch.ones_like(alpha) if _blocks_affected(block, self.severity) else alpha


@dataclasses.dataclass(frozen=True)
class StaleMax(Fault):
    name: ClassVar[str] = "stale_max"
    description: ClassVar[str] = "P computed with the running max from before the block"
    severity_meaning: ClassVar[str] = "key blocks (after the first) whose exponent uses the stale max"
    severities: ClassVar[tuple] = (1, 2, 4, 8)
    default_severity: ClassVar[float] = 1

    def exponent_max(self, block, m_old, m_new):
        return m_old if _blocks_affected(block, self.severity) else m_new


@dataclasses.dataclass(frozen=True)
class DroppedTail(Fault):
    name: ClassVar[str] = "dropped_tail"
    description: ClassVar[str] = "the key loop stops early: the last keys are never read"
    severity_meaning: ClassVar[str] = "trailing keys never read (1: the N = 1025 whole-tile loop)"
    severities: ClassVar[tuple] = (1, 4, 16, 64)
    default_severity: ClassVar[float] = 1

    def keys_read(self, n_k):
        return max(0, n_k - int(self.severity))


@dataclasses.dataclass(frozen=True)
class LowPrecisionSum(Fault):
    name: ClassVar[str] = "low_precision_sum"
    description: ClassVar[str] = "running row sum l kept in a narrow format (8 bits = bf16)"
    severity_meaning: ClassVar[str] = "significand bits of l (fewer is worse)"
    severities: ClassVar[tuple] = (12, 10, 8, 6)
    default_severity: ClassVar[float] = 8

    def store_row_sum(self, l):
        return round_significand(l, int(self.severity))


@dataclasses.dataclass(frozen=True)
class NarrowP(Fault):
    name: ClassVar[str] = "narrow_p"
    description: ClassVar[str] = "P rounded to a narrower format than intended before PV"
    severity_meaning: ClassVar[str] = "significand bits of P (8 = bf16, 4 = fp8 e4m3)"
    severities: ClassVar[tuple] = (8, 6, 5, 4)
    default_severity: ClassVar[float] = 4

    def store_p(self, p):
        return round_significand(p, int(self.severity))


@dataclasses.dataclass(frozen=True)
class FiniteSentinel(Fault):
    name: ClassVar[str] = "finite_sentinel"
    description: ClassVar[str] = "masked scores and the running-max start are a finite sentinel"
    severity_meaning: ClassVar[str] = "the sentinel on raw scores (closer to 0 is worse)"
    severities: ClassVar[tuple] = (-2e5, -1e5, -5e4, -1e4)
    default_severity: ClassVar[float] = -5e4

    def mask_fill(self, fill):
        return float(self.severity)


@dataclasses.dataclass(frozen=True)
class OffByOneCausal(Fault):
    name: ClassVar[str] = "off_by_one_causal"
    description: ClassVar[str] = "causal mask admits future keys (kj > qi + severity masked)"
    severity_meaning: ClassVar[str] = "future keys each query may see"
    severities: ClassVar[tuple] = (1, 2, 4, 8)
    default_severity: ClassVar[float] = 1
    needs_causal: ClassVar[bool] = True

    def causal_offset(self, offset):
        return offset + int(self.severity)


@dataclasses.dataclass(frozen=True)
class LowPrecisionLse(Fault):
    name: ClassVar[str] = "low_precision_lse"
    description: ClassVar[str] = "log-sum-exp stored in a narrow format (8 bits = bf16); O unchanged"
    severity_meaning: ClassVar[str] = "significand bits of the stored LSE (fewer is worse)"
    severities: ClassVar[tuple] = (12, 10, 8, 6)
    default_severity: ClassVar[float] = 8

    def store_lse(self, lse):
        return round_significand(lse, int(self.severity))


FAULTS: dict[str, type[Fault]] = {cls.name: cls for cls in (
    MissedRescale, StaleMax, DroppedTail, LowPrecisionSum, NarrowP, FiniteSentinel, OffByOneCausal,
    LowPrecisionLse)}


def make_fault(name: str, severity: float | None = None, *, level: int | None = None) -> Fault:
    """The fault ``name`` at a severity value, at a severity level (0 = mildest), or at its default."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; faults: {sorted(FAULTS)}")
    cls = FAULTS[name]
    if level is not None:
        if severity is not None:
            raise ValueError("give a severity or a level, not both")
        if not 0 <= level < len(cls.severities):
            raise ValueError(f"fault {name!r} has severity levels 0..{len(cls.severities) - 1}, got {level}")
        severity = cls.severities[level]
    return cls(cls.default_severity if severity is None else severity)
