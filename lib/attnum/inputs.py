"""Seeded input generators for q, k, v of shape (batch, heads, seq_len, head_dim).

Every generator draws from an explicit ``torch.Generator`` on the CPU in
float64 and then moves to the requested device, so a seed gives the same
inputs on every machine and device.

``normal_qkv`` is the N(0, 1) baseline; ``INPUT_FAMILIES`` names the extreme
and structured families of study 02 (``make_inputs(name, ...)``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch

from .precision import round_to


def generator(seed: int) -> torch.Generator:
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return torch.Generator(device="cpu").manual_seed(seed)


def normal_qkv(batch: int, heads: int, seq_len: int, head_dim: int, *, seed: int, std: float = 1.0,
               kv_len: int | None = None, device: str | torch.device = "cpu"):
    """q, k, v with i.i.d. N(0, std^2) entries (float64). ``kv_len`` defaults to ``seq_len``."""
    for name, val in (("batch", batch), ("heads", heads), ("seq_len", seq_len), ("head_dim", head_dim)):
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    kv_len = seq_len if kv_len is None else kv_len
    gen = generator(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=gen, dtype=torch.float64) * std
    k = torch.randn(batch, heads, kv_len, head_dim, generator=gen, dtype=torch.float64) * std
    v = torch.randn(batch, heads, kv_len, head_dim, generator=gen, dtype=torch.float64) * std
    return q.to(device), k.to(device), v.to(device)


# -- named input families --------------------------------------------------------------------
#
# Every family is a function (batch, heads, seq_len, head_dim, *, seed, device) -> AttentionInputs,
# registered in INPUT_FAMILIES. All draws come from one torch.Generator per call, in float64 on the
# CPU; the tensors move to ``device`` at the end. Families follow seed 000's list (extreme values,
# boundaries, structured patterns, its stratified mix), seed 003's fp16-overflow and boundary cases,
# and FlashInfer's extreme-logit regression cases (FlashInfer issues 4267 and 4450; docs/sources.md).

FLASHINFER_TARGET_LOGITS = (-1e4, -5e4, -5.5e4, -6e4, -1e5, -2e5, -2.45e5)
FP16_MAX = 65504.0


@dataclasses.dataclass
class AttentionInputs:
    """q, k, v (batch, heads, seq, head_dim) in float64, and an optional boolean mask.

    ``mask`` broadcasts to (batch, heads, n_q, n_k) and is True where a query may
    attend a key; ``None`` means every key is visible.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None

    def to(self, device) -> "AttentionInputs":
        return AttentionInputs(*(t.to(device) for t in (self.q, self.k, self.v)),
                               None if self.mask is None else self.mask.to(device))

    def rounded(self, fmt: str) -> "AttentionInputs":
        """The inputs as a kernel with ``fmt`` inputs reads them (values beyond the range become inf)."""
        return AttentionInputs(*(round_to(t, fmt) for t in (self.q, self.k, self.v)), self.mask)

    @property
    def attn_bias(self) -> torch.Tensor | None:
        """The mask as an additive bias: 0 where visible, -inf where masked."""
        return None if self.mask is None else mask_to_bias(self.mask)


def mask_to_bias(mask: torch.Tensor, masked_value: float = -math.inf) -> torch.Tensor:
    """Additive bias (float64) from a boolean mask: 0 where True, ``masked_value`` where False."""
    return torch.where(mask, torch.zeros((), dtype=torch.float64, device=mask.device),
                       torch.full((), masked_value, dtype=torch.float64, device=mask.device))


def _check_shape(batch, heads, seq_len, head_dim, min_head_dim=1):
    for name, val in (("batch", batch), ("heads", heads), ("seq_len", seq_len), ("head_dim", head_dim)):
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    if head_dim < min_head_dim:
        raise ValueError(f"this family needs head_dim >= {min_head_dim}, got {head_dim}")


def _randn(gen, shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _three(batch, heads, seq_len, head_dim):
    return [(batch, heads, seq_len, head_dim)] * 3


def _done(q, k, v, device, mask=None) -> AttentionInputs:
    return AttentionInputs(q, k, v, mask).to(device)


def _random_positions(gen, numel: int, count: int) -> torch.Tensor:
    """``count`` distinct flat indices out of ``numel``."""
    return torch.randperm(numel, generator=gen)[:min(count, numel)]


def normal_family(batch, heads, seq_len, head_dim, *, seed, std: float = 1.0, device="cpu") -> AttentionInputs:
    """i.i.d. N(0, std^2): the baseline every amplification is measured against."""
    _check_shape(batch, heads, seq_len, head_dim)
    return AttentionInputs(*normal_qkv(batch, heads, seq_len, head_dim, seed=seed, std=std, device=device))


def outliers_family(batch, heads, seq_len, head_dim, *, seed, count: int = 8, factor: float = 1000.0,
                    device="cpu") -> AttentionInputs:
    """N(0, 1) with ``count`` entries of each of q, k, v set to +-``factor`` (1000x the rest's scale)."""
    _check_shape(batch, heads, seq_len, head_dim)
    gen = generator(seed)
    out = []
    for shape in _three(batch, heads, seq_len, head_dim):
        x = _randn(gen, shape)
        idx = _random_positions(gen, x.numel(), count)
        signs = torch.where(torch.rand(len(idx), generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0).double()
        x.view(-1)[idx] = factor * signs
        out.append(x)
    return _done(*out, device)


def constant_magnitude_family(batch, heads, seq_len, head_dim, *, seed, value: float = 1e6,
                              random_signs: bool = True, device="cpu") -> AttentionInputs:
    """Every entry is +-``value`` (random signs) or exactly ``value``."""
    _check_shape(batch, heads, seq_len, head_dim)
    gen = generator(seed)
    out = []
    for shape in _three(batch, heads, seq_len, head_dim):
        x = torch.full(shape, float(value), dtype=torch.float64)
        if random_signs:
            x = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5, -x, x)
        out.append(x)
    return _done(*out, device)


def zeros_family(batch, heads, seq_len, head_dim, *, seed, device="cpu") -> AttentionInputs:
    """All zeros (seed 000's boundary case): every score is 0 and the exact output is 0."""
    _check_shape(batch, heads, seq_len, head_dim)
    return _done(*(torch.zeros(s, dtype=torch.float64) for s in _three(batch, heads, seq_len, head_dim)), device)


SPECIAL_VALUES = (math.inf, -math.inf, math.nan, 0.0, -0.0)


def special_values_family(batch, heads, seq_len, head_dim, *, seed, count: int = 2,
                          device="cpu") -> AttentionInputs:
    """N(0, 1) with ``count`` entries each of +inf, -inf, NaN, +0 and -0 in each of q, k, v."""
    _check_shape(batch, heads, seq_len, head_dim)
    gen = generator(seed)
    out = []
    for shape in _three(batch, heads, seq_len, head_dim):
        x = _randn(gen, shape)
        idx = _random_positions(gen, x.numel(), count * len(SPECIAL_VALUES))
        values = torch.tensor(SPECIAL_VALUES, dtype=torch.float64).repeat_interleave(count)[:len(idx)]
        x.view(-1)[idx] = values
        out.append(x)
    return _done(*out, device)


def sawtooth_family(batch, heads, seq_len, head_dim, *, seed, period: int = 64, amplitude: float = 10.0,
                    device="cpu") -> AttentionInputs:
    """Linear ramps from -amplitude up along the sequence, restarting every ``period`` positions.

    Each (head, feature) column has its own random phase, so rows are not all equal.
    """
    _check_shape(batch, heads, seq_len, head_dim)
    if period < 2:
        raise ValueError(f"period must be >= 2, got {period}")
    gen = generator(seed)
    pos = torch.arange(seq_len, dtype=torch.float64)[:, None]
    out = []
    for shape in _three(batch, heads, seq_len, head_dim):
        phase = torch.randint(0, period, (batch, heads, 1, head_dim), generator=gen).to(torch.float64)
        out.append(amplitude * (2.0 * torch.remainder(pos + phase, period) / period - 1.0).expand(shape).clone())
    return _done(*out, device)


def pulse_family(batch, heads, seq_len, head_dim, *, seed, amplitude: float = 1e4,
                 device="cpu") -> AttentionInputs:
    """N(0, 1) with one entry of each of q, k, v set to ``amplitude`` (one huge value)."""
    _check_shape(batch, heads, seq_len, head_dim)
    gen = generator(seed)
    out = []
    for shape in _three(batch, heads, seq_len, head_dim):
        x = _randn(gen, shape)
        x.view(-1)[_random_positions(gen, x.numel(), 1)] = amplitude
        out.append(x)
    return _done(*out, device)


def sparse_family(batch, heads, seq_len, head_dim, *, seed, zero_fraction: float = 0.95,
                  device="cpu") -> AttentionInputs:
    """N(0, 1) entries, each zeroed with probability ``zero_fraction`` (95% zeros)."""
    _check_shape(batch, heads, seq_len, head_dim)
    gen = generator(seed)
    out = []
    for shape in _three(batch, heads, seq_len, head_dim):
        x = _randn(gen, shape)
        out.append(torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < zero_fraction, 0.0, x))
    return _done(*out, device)


def seed000_mix_family(batch, heads, seq_len, head_dim, *, seed, device="cpu") -> AttentionInputs:
    """Seed 000's stratified mix, per entry: 80% uniform in [-10, 10], 15% +-1e6, 5% special.

    Special values are drawn uniformly from +inf, -inf, NaN, +0, -0.
    """
    _check_shape(batch, heads, seq_len, head_dim)
    gen = generator(seed)
    specials = torch.tensor(SPECIAL_VALUES, dtype=torch.float64)
    out = []
    for shape in _three(batch, heads, seq_len, head_dim):
        u = torch.rand(shape, generator=gen, dtype=torch.float64)
        regular = 20.0 * torch.rand(shape, generator=gen, dtype=torch.float64) - 10.0
        extreme = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5, -1e6, 1e6).double()
        special = specials[torch.randint(0, len(SPECIAL_VALUES), shape, generator=gen)]
        out.append(torch.where(u < 0.80, regular, torch.where(u < 0.95, extreme, special)))
    return _done(*out, device)


def _split_product(value: float) -> tuple[float, float]:
    """(a, b) with a * b == value exactly, both near sqrt(|value|) (b a power of two).

    Keeps each factor inside fp16's range for products up to ~4e9 while the product
    itself (a raw score) can be as large as asked.
    """
    if value == 0:
        return 0.0, 1.0
    b = 2.0 ** math.ceil(math.log2(math.sqrt(abs(value))))
    return value / b, b


def logit_targeted_family(batch, heads, seq_len, head_dim, *, seed, target: float = -6e4, rows=None,
                          spread: float | None = None, device="cpu") -> AttentionInputs:
    """q, k whose raw scores q.k of the chosen rows sit at ``target`` (FlashInfer's regression cases).

    Feature 0 carries the target: q[r, 0] * k[j, 0] = target exactly (in fp64) for every
    chosen row r and key j; the other features add a zero-mean spread delta_rj with
    standard deviation ``spread`` (default sqrt(head_dim), so that after the 1/sqrt(d)
    scaling the softmax sees an N(0, 1)-like spread). Rows not chosen have delta only.
    ``rows``: None (every row), a slice, or indices. v is N(0, 1).
    """
    _check_shape(batch, heads, seq_len, head_dim, min_head_dim=2)
    gen = generator(seed)
    spread = math.sqrt(head_dim) if spread is None else float(spread)
    a = (spread ** 2 / (head_dim - 1)) ** 0.25  # delta = sum of (d - 1) products of N(0, a^2) terms
    q = _randn(gen, (batch, heads, seq_len, head_dim)) * a
    k = _randn(gen, (batch, heads, seq_len, head_dim)) * a
    v = _randn(gen, (batch, heads, seq_len, head_dim))
    q_part, k_part = _split_product(float(target))
    q[..., 0] = 0.0
    q[..., slice(None) if rows is None else rows, 0] = q_part
    k[..., 0] = k_part
    return _done(q, k, v, device)


def masked_huge_scores_family(batch, heads, seq_len, head_dim, *, seed, masked_fraction: float = 0.25,
                              huge: float = 1e5, valid_target: float = 0.0, spread: float | None = None,
                              device="cpu") -> AttentionInputs:
    """A random ``masked_fraction`` of the keys is masked for every query, and those keys score ``huge``.

    Raw scores: ``huge + delta`` on masked keys, ``valid_target + delta`` on visible ones
    (delta as in ``logit_targeted_family``). A correct kernel gives masked keys no weight
    however large their scores; an additive mask that is too small (-1e4) does not.
    At least one key stays visible.
    """
    _check_shape(batch, heads, seq_len, head_dim, min_head_dim=2)
    gen = generator(seed)
    spread = math.sqrt(head_dim) if spread is None else float(spread)
    a = (spread ** 2 / (head_dim - 1)) ** 0.25
    q = _randn(gen, (batch, heads, seq_len, head_dim)) * a
    k = _randn(gen, (batch, heads, seq_len, head_dim)) * a
    v = _randn(gen, (batch, heads, seq_len, head_dim))
    n_masked = min(seq_len - 1, int(round(masked_fraction * seq_len)))
    masked = torch.zeros(seq_len, dtype=torch.bool)
    masked[_random_positions(gen, seq_len, n_masked)] = True
    scale_q = 2.0 ** math.ceil(math.log2(math.sqrt(max(abs(huge), abs(valid_target), 1.0))))
    q[..., 0] = scale_q
    k[..., 0] = torch.where(masked, huge / scale_q, valid_target / scale_q)
    mask = (~masked)[None, None, None, :].expand(1, 1, seq_len, seq_len).clone()
    return _done(q, k, v, device, mask)


def fully_masked_rows_family(batch, heads, seq_len, head_dim, *, seed, masked_row_fraction: float = 0.1,
                             device="cpu") -> AttentionInputs:
    """N(0, 1) q, k, v; a random ``masked_row_fraction`` of the query rows (at least one) sees no key.

    PyTorch's convention (``_safe_softmax``) and the golden value give those rows output 0.
    """
    _check_shape(batch, heads, seq_len, head_dim)
    base = normal_family(batch, heads, seq_len, head_dim, seed=seed)
    gen = generator(seed + 1)
    n_rows = max(1, int(round(masked_row_fraction * seq_len)))
    masked_rows = torch.zeros(seq_len, dtype=torch.bool)
    masked_rows[_random_positions(gen, seq_len, n_rows)] = True
    mask = (~masked_rows)[None, None, :, None].expand(1, 1, seq_len, seq_len).clone()
    return _done(base.q, base.k, base.v, device, mask)


INPUT_FAMILIES: dict[str, Callable[..., AttentionInputs]] = {
    "normal": normal_family,
    "normal_sigma10": functools.partial(normal_family, std=10.0),
    "normal_sigma100": functools.partial(normal_family, std=100.0),
    "outliers": outliers_family,
    "pm_1e6": functools.partial(constant_magnitude_family, value=1e6),
    "zeros": zeros_family,
    "fp16_max": functools.partial(constant_magnitude_family, value=FP16_MAX, random_signs=False),
    "special_values": special_values_family,
    "sawtooth": sawtooth_family,
    "pulse": pulse_family,
    "sparse": sparse_family,
    "seed000_mix": seed000_mix_family,
    "logit_targeted": logit_targeted_family,
    "masked_huge_scores": masked_huge_scores_family,
    "fully_masked_rows": fully_masked_rows_family,
}
"""Name -> generator. ``logit_targeted`` defaults to raw logits at -6e4 on every row."""


def make_inputs(family: str, batch: int, heads: int, seq_len: int, head_dim: int, *, seed: int,
                device="cpu", **options) -> AttentionInputs:
    """Inputs of a named family; ``options`` go to the family's generator (e.g. ``target=-5e4``)."""
    if family not in INPUT_FAMILIES:
        raise ValueError(f"unknown input family {family!r}; families: {sorted(INPUT_FAMILIES)}")
    return INPUT_FAMILIES[family](batch, heads, seq_len, head_dim, seed=seed, device=device, **options)
