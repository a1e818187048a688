"""Seeded attention operands (q, k, v, dO) of the backward studies (04 and 05), and their fp64 values.

``mechanism_operands``: seed 004's mechanism. N(0, 1) q scaled by a sharpness factor, keys
shifted by a common vector mu (``|mu|`` = ``mu_norm``; exact attention on the unrounded keys ignores
it, the rounded dS does not), rounded to bf16 as a bf16 kernel reads them. The rounding of k + mu
makes the exact problem itself depend on mu at large |mu| (see ``key_resolution``).

``regime_operands``: seed 004's key offset beside Qiu & Yao's tied maxima (arXiv 2510.04212).

``mechanism_operands_in``: the same operands rounded to another format (fp16 for seed 003's checks).

``axis_offset_operands``: operands whose exact problem does not change with mu at all: the same
q, v, dO, keys with their first component set to 0 and mu = |mu| e_1 rounded to the format, so
k + mu is exactly representable (no key value is lost at any |mu|) and only each row's scores shift.

``golden_values``: the fp64 output, gradients, P K and the largest probability per row.

``key_resolution``: what rounding k + mu leaves of the keys (distinct key vectors, distinct values
per component). The exact problem does depend on mu for these operands: the offset-free part of a
rounded key is resolved only to the format's spacing at |mu_c|, so at large |mu| each component of
the keys takes only a few values and the exact dQ changes (study 04 measures it).
"""
from __future__ import annotations

import math

import torch

from .inputs import generator, normal_qkv
from .kernels import golden_attention, golden_attention_backward
from .precision import round_to

REGIMES = ("key_offset", "tied_max_negative_v", "tied_max_zero_mean_v")


def unit_vector(n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    return x / torch.linalg.vector_norm(x)


def probabilities(q, k, scale) -> torch.Tensor:
    return torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, dim=-1)


def golden_values(q, k, v, do, chunk: int) -> dict[str, torch.Tensor]:
    out = golden_attention(q, k, v, chunk=chunk)
    dq, dk, dv = golden_attention_backward(q, k, v, do, chunk=chunk)
    p = probabilities(q, k, 1.0 / math.sqrt(q.shape[-1]))
    return {"out": out, "dq": dq, "dk": dk, "dv": dv, "pk": p @ k.double(), "max_prob": p.amax(-1)}


def mechanism_operands(seq_len: int, head_dim: int, sharpness: float, mu_norm: float, seed: int, *,
                       heads: int = 1, device="cpu"):
    """bf16 q (scaled by ``sharpness``), k + mu, v, dO and mu (fp32 carriers), seeded."""
    q, k, v = normal_qkv(1, heads, seq_len, head_dim, seed=seed, device=device)
    gen = generator(seed + 7_000_003)
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device)
    mu = unit_vector(head_dim, gen).to(device) * mu_norm
    q, k, v, do = (round_to(t.float(), "bf16") for t in (q * sharpness, k + mu, v, do))
    return q, k, v, do, mu


def mechanism_operands_in(fmt: str, seq_len: int, head_dim: int, sharpness: float, mu_norm: float, seed: int, *,
                          heads: int = 1, device="cpu"):
    """``mechanism_operands`` rounded to ``fmt`` instead of bf16 (same seeded values before rounding;
    ``fmt="bf16"`` gives exactly ``mechanism_operands``)."""
    q, k, v = normal_qkv(1, heads, seq_len, head_dim, seed=seed, device=device)
    gen = generator(seed + 7_000_003)
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device)
    mu = unit_vector(head_dim, gen).to(device) * mu_norm
    q, k, v, do = (round_to(t.float(), fmt) for t in (q * sharpness, k + mu, v, do))
    return q, k, v, do, mu


def axis_offset_operands(seq_len: int, head_dim: int, sharpness: float, mu_norm: float, seed: int, *,
                         fmt: str = "bf16", heads: int = 1, device="cpu"):
    """q, k + mu, v, dO and mu in ``fmt`` with an exact-arithmetic-invariant offset: q, v, dO as in
    ``mechanism_operands_in``; the keys rounded first, their first component set to 0; mu along the
    first axis with norm ``mu_norm`` rounded to ``fmt``. Then k_j + mu = (mu_1, k_j2, ..., k_jd) is a
    value of ``fmt`` for every key, so the rounded operands differ between offsets by mu alone, which
    shifts row i's scores by q_i1 * mu_1: the exact output and dQ are the same at every |mu| (up to
    fp64 rounding of the larger scores). ``mu`` returned as carried out (its norm is ``fmt``-rounded)."""
    q, k, v = normal_qkv(1, heads, seq_len, head_dim, seed=seed, device=device)
    gen = generator(seed + 7_000_003)
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device)
    k = round_to(k.float(), fmt)
    k[..., 0] = 0.0
    mu = torch.zeros(head_dim, dtype=torch.float32, device=device)
    mu[0] = round_to(torch.tensor(float(mu_norm)), fmt).item()
    q, v, do = (round_to(t.float(), fmt) for t in (q * sharpness, v, do))
    k = k + mu
    if not torch.equal(k, round_to(k, fmt)):
        raise ValueError(f"|mu| = {mu_norm} is beyond {fmt}'s range for these keys")
    return q, k, v, do, mu.double()


def key_resolution(k: torch.Tensor) -> dict[str, float]:
    """``distinct_keys``: distinct key vectors (rows of the last two dims, over every leading index);
    ``distinct_values``: median over components of the number of distinct values a component takes."""
    rows = k.reshape(-1, k.shape[-1])
    per_component = torch.tensor([float(torch.unique(rows[:, c]).numel()) for c in range(rows.shape[1])])
    return {"distinct_keys": float(torch.unique(rows, dim=0).shape[0]),
            "distinct_values": per_component.median().item()}


def regime_operands(regime: str, seq_len: int, head_dim: int, seed: int, *, n_ties: int = 8,
                    mu_norm: float = 100.0, device="cpu"):
    """bf16 operands of one regime and the offset mu (zero outside ``key_offset``).

    ``key_offset``: N(0, 1) q, k, v, dO and mu added to every key (seed 004).
    ``tied_max_*``: ``n_ties`` keys are the same vector e, and every query has a large
    component along e, so each row's maximum score is repeated ``n_ties`` times and
    P = 1 exactly there before normalisation (Qiu & Yao); V is N(-1, 0.2^2)
    (``negative_v``: every column mostly negative) or N(0, 1).
    """
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; allowed: {list(REGIMES)}")
    q, k, v = normal_qkv(1, 1, seq_len, head_dim, seed=seed, device="cpu")
    gen = generator(seed + 9_000_011)
    do = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    mu = torch.zeros(head_dim, dtype=torch.float64)
    if regime == "key_offset":
        mu = unit_vector(head_dim, gen) * mu_norm
        k = k + mu
    else:
        e = unit_vector(head_dim, gen)
        ties = torch.randperm(seq_len, generator=gen)[:n_ties]
        # scaled tie score 2 sqrt(d) * 4 / sqrt(d) = 8 at every d; the other keys' scores have std ~2
        q = 0.3 * q + 2.0 * math.sqrt(head_dim) * e
        k[..., ties, :] = 4.0 * e
        if regime == "tied_max_negative_v":
            v = 0.2 * v - 1.0
    q, k, v, do = (round_to(t.float(), "bf16").to(device) for t in (q, k, v, do))
    return q, k, v, do, mu.to(device)
