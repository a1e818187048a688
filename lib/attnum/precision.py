"""Precision policy: which number format each stage of attention uses.

A policy names a format for every place where a FlashAttention-style kernel
stores or rounds a value (Golden et al., arXiv 2405.02803, Sec. 3; Dao,
FlashAttention-2, Alg. 1):

    inputs   q, k, v as the kernel reads them
    score    S = Q K^T, the score matmul's result (its accumulator, rounded)
    stats    softmax statistics: running row max m and running row sum l
    p        P = exp(S - m) as fed to the P V matmul
    out_acc  the output accumulator carried across key blocks
    output   the stored output O
    lse      the stored log-sum-exp (what a backward pass reads)

and, for the backward pass (``attnum.kernels.backward``; Dao, FlashAttention-2, Alg. 2):

    grad_out dO as the backward kernel reads it
    delta    D_i = sum_j dO_ij O_ij, from the stored output O
    dp       dP = dO V^T and dS = P * (dP - D): the backward's accumulator format
    ds       dS as fed to the dQ = dS K and dK = dS^T Q matmuls (seed 004, cause 2)
    p_bwd    the recomputed P as fed to the dV = P^T dO matmul
    grad_acc the dQ, dK, dV accumulators (dQ is carried across key blocks)
    grad     the stored dQ, dK, dV

A backward stage left unset means "no rounding": the carrier format (fp64 if
a forward stage is fp64, else fp32), so a forward-only policy gets an exact
backward and "FP32 backward" is the same code with no rounding.

Rounding is emulated by casting through real torch dtypes: every stage is
computed in a *carrier* dtype (float64 when any stage is float64, else
float32) and rounded to its stage format with ``x.to(fmt).to(carrier)``.
A matmul whose stage format is bf16 is therefore computed with a float32
accumulator and rounded once at the end, which is what low-precision matmuls
in torch (and tensor cores) do; it is not a sequentially rounded bf16 sum.

One option departs from that, for seed 000's MI210 port (``score_mac``, default ``None``: the
matmul above, every existing policy unchanged): the flash emulator's score product Q K^T
accumulated term by term over the head dimension in the *score* format, each multiply-add
either fused (``"fma"``: the exact product added, the sum rounded once) or with two roundings
(``"two_rounding"``: the product rounded to the score format, then the sum rounded). Only the
flash emulator (``attnum.kernels.flash``) reads it.
"""
from __future__ import annotations

import dataclasses
import math

import torch

FORMATS: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}

# Significand bits including the hidden bit, and the smallest normal exponent.
SIGNIFICAND_BITS = {"fp64": 53, "fp32": 24, "fp16": 11, "bf16": 8}
MIN_EXPONENT = {"fp64": -1022, "fp32": -126, "fp16": -14, "bf16": -126}

SCORE_MACS = (None, "fma", "two_rounding")
"""``PrecisionPolicy.score_mac``: the score matmul (None), or a term-by-term multiply-add in the
score format, fused or with the product and the sum rounded separately (seed 000, MI210)."""

STAGES = ("inputs", "score", "stats", "p", "out_acc", "output", "lse")
BACKWARD_STAGES = ("grad_out", "delta", "dp", "ds", "p_bwd", "grad_acc", "grad")
ALL_STAGES = STAGES + BACKWARD_STAGES


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown number format {fmt!r}; allowed: {sorted(FORMATS)}")
    return fmt


def unit_roundoff(fmt: str) -> float:
    """u = 2^-t for round-to-nearest (torch.finfo(dtype).eps == 2u)."""
    return 2.0 ** -SIGNIFICAND_BITS[check_format(fmt)]


def round_to(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round ``x`` to ``fmt`` and return it in its own (carrier) dtype."""
    dtype = FORMATS[fmt]
    if x.dtype == dtype or _width(dtype) >= _width(x.dtype):
        return x
    return x.to(dtype).to(x.dtype)


def _width(dtype: torch.dtype) -> int:
    # bf16 and fp16 are both 16 bits wide but neither contains the other;
    # give them distinct ranks below fp32 so a cast between them is never skipped.
    return {torch.float64: 64, torch.float32: 32, torch.float16: 17, torch.bfloat16: 16}[dtype]


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """Stage-by-stage number formats of one attention computation."""

    name: str
    inputs: str
    score: str
    stats: str
    p: str
    out_acc: str
    output: str
    lse: str
    grad_out: str | None = None
    delta: str | None = None
    dp: str | None = None
    ds: str | None = None
    p_bwd: str | None = None
    grad_acc: str | None = None
    grad: str | None = None
    score_mac: str | None = None  # SCORE_MACS; not a stage: how the flash emulator accumulates Q K^T

    def __post_init__(self) -> None:
        if self.score_mac not in SCORE_MACS:
            raise ValueError(f"score_mac must be one of {SCORE_MACS}, got {self.score_mac!r}")
        for stage in STAGES:
            check_format(getattr(self, stage))
        exact = "fp64" if "fp64" in self.forward_formats() else "fp32"
        for stage in BACKWARD_STAGES:
            if getattr(self, stage) is None:
                object.__setattr__(self, stage, exact)  # frozen: fill the default once
            check_format(getattr(self, stage))

    @property
    def carrier(self) -> torch.dtype:
        """The dtype arithmetic is carried out in between rounding points."""
        return torch.float64 if "fp64" in self.formats() else torch.float32

    @property
    def low(self) -> str:
        """The narrowest format of the policy (its 'dtype' in plots and tables)."""
        return min(self.formats(), key=lambda f: SIGNIFICAND_BITS[f])

    def formats(self) -> tuple[str, ...]:
        """Formats of every stage, forward then backward."""
        return tuple(getattr(self, s) for s in ALL_STAGES)

    def forward_formats(self) -> tuple[str, ...]:
        return tuple(getattr(self, s) for s in STAGES)

    def backward_formats(self) -> tuple[str, ...]:
        return tuple(getattr(self, s) for s in BACKWARD_STAGES)

    def round(self, x: torch.Tensor, stage: str) -> torch.Tensor:
        return round_to(x, getattr(self, stage))

    def replace(self, **stages: str) -> "PrecisionPolicy":
        """A copy with some stages changed (e.g. ``stats="bf16"`` for a fault)."""
        unknown = set(stages) - set(ALL_STAGES) - {"name"}
        if unknown:
            raise ValueError(f"unknown policy stage(s) {sorted(unknown)}; allowed: {list(ALL_STAGES)}")
        name = stages.pop("name", None) or self.name + "+" + ",".join(f"{k}={v}" for k, v in sorted(stages.items()))
        return dataclasses.replace(self, name=name, **stages)

    def with_backward(self, fmt: str, name: str | None = None) -> "PrecisionPolicy":
        """The same forward with every backward stage in ``fmt`` (``"fp32"``: the FP32 backward)."""
        check_format(fmt)
        return self.replace(name=name or f"{self.name}+bwd={fmt}", **{s: fmt for s in BACKWARD_STAGES})

    def backward_at_least(self, fmt: str) -> "PrecisionPolicy":
        """Every backward stage narrower than ``fmt`` widened to it (``"fp32"``: the FP32 backward of
        study 05, which leaves an fp64 policy as it is)."""
        bits = SIGNIFICAND_BITS[check_format(fmt)]
        narrow = {s: fmt for s in BACKWARD_STAGES if SIGNIFICAND_BITS[getattr(self, s)] < bits}
        return self.replace(name=f"{self.name}+bwd={fmt}", **narrow) if narrow else self

    def with_score_mac(self, mode: str | None) -> "PrecisionPolicy":
        """The same stages with the score product accumulated term by term (``SCORE_MACS``)."""
        if mode not in SCORE_MACS:
            raise ValueError(f"score_mac must be one of {SCORE_MACS}, got {mode!r}")
        if mode is None:
            return dataclasses.replace(self, score_mac=None)
        return dataclasses.replace(self, name=f"{self.name}+mac={mode}", score_mac=mode)

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def _uniform(name: str, fmt: str) -> PrecisionPolicy:
    return PrecisionPolicy(name, *([fmt] * len(ALL_STAGES)))


def _production(name: str, fmt: str) -> PrecisionPolicy:
    # FlashAttention-2/3 in bf16/fp16: inputs in the low format, fp32 score
    # accumulation and softmax statistics, P rounded before the PV matmul,
    # fp32 output accumulator, output rounded once at the end, fp32 LSE.
    # Backward (FA2 Alg. 2, FA3): dO read in the low format, D, dP and dS computed in
    # fp32, dS and P rounded to the low format for the tensor-core matmuls, fp32
    # accumulators for dQ, dK, dV, gradients stored in the low format.
    return PrecisionPolicy(name, inputs=fmt, score="fp32", stats="fp32", p=fmt,
                           out_acc="fp32", output=fmt, lse="fp32",
                           grad_out=fmt, delta="fp32", dp="fp32", ds=fmt, p_bwd=fmt,
                           grad_acc="fp32", grad=fmt)


PRESETS: dict[str, PrecisionPolicy] = {
    "fp64": _uniform("fp64", "fp64"),
    "fp32": _uniform("fp32", "fp32"),
    "all_bf16": _uniform("all_bf16", "bf16"),
    "all_fp16": _uniform("all_fp16", "fp16"),
    "all_fp32": _uniform("all_fp32", "fp32"),
    "fa2_bf16": _production("fa2_bf16", "bf16"),
    "fa2_fp16": _production("fa2_fp16", "fp16"),
    "fa2_fp32": _production("fa2_fp32", "fp32"),
}


def get_policy(policy: str | PrecisionPolicy) -> PrecisionPolicy:
    """Look up a preset by name (``"fa2_bf16"``), or pass a policy through."""
    if isinstance(policy, PrecisionPolicy):
        return policy
    try:
        return PRESETS[policy]
    except KeyError:
        raise ValueError(f"unknown precision policy {policy!r}; presets: {sorted(PRESETS)}") from None


def policy_for(family: str, fmt: str) -> PrecisionPolicy:
    """The preset of a policy family (``all`` or ``fa2``) at a format."""
    if fmt == "fp64":
        return PRESETS["fp64"]
    return get_policy(f"{family}_{fmt}")


def min_normal(fmt: str) -> float:
    """The smallest positive normal number of a format (``torch.finfo(dtype).tiny``)."""
    return 2.0 ** MIN_EXPONENT[check_format(fmt)]


def min_subnormal(fmt: str) -> float:
    """The smallest positive (subnormal) number of a format."""
    return 2.0 ** (MIN_EXPONENT[check_format(fmt)] - (SIGNIFICAND_BITS[fmt] - 1))


def ulp(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Unit in the last place of ``x`` in ``fmt`` (subnormal spacing below the normal range)."""
    t = SIGNIFICAND_BITS[check_format(fmt)]
    _, exponent = torch.frexp(x.abs().to(torch.float64))  # |x| = m * 2^e, m in [0.5, 1)
    exponent = torch.clamp(exponent, min=MIN_EXPONENT[fmt] + 1)
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float64), exponent - t)


LOG2E = 1.0 / math.log(2.0)
