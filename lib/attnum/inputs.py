"""Seeded input generators for q, k, v of shape (batch, heads, seq_len, head_dim).

Every generator draws from an explicit ``torch.Generator`` on the CPU in
float64 and then moves to the requested device, so a seed gives the same
inputs on every machine and device.
"""
from __future__ import annotations

import torch


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
