"""Kernels of one's own, as a user would write them for ``python -m attnum report``: one correct, two broken."""
import math

import torch
import torch.nn.functional as F


def _scores(q, k, scale):
    return (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)


def _mask(s, is_causal, attn_mask, fill):
    """Masked scores set to ``fill`` (-inf: correct; -5e4: FlashInfer's former finite sentinel)."""
    masked = torch.zeros(s.shape, dtype=torch.bool)
    if is_causal:
        n_q, n_k = s.shape[-2:]
        masked = masked | ~torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    if attn_mask is not None:
        masked = masked | (attn_mask == -math.inf)
        s = s + torch.where(attn_mask == -math.inf, torch.zeros_like(attn_mask), attn_mask)
    return s.masked_fill(masked, fill)


def correct(q, k, v, is_causal=False, attn_mask=None, scale=None):
    """SDPA's math backend: fp32 inside for bf16/fp16 inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def sentinel_5e4(q, k, v, is_causal=False, attn_mask=None, scale=None):
    """Masked scores set to -5e4 (not -inf), softmax in fp32: masked keys get weight once a row's valid
    logits fall below the sentinel, and a row with no visible key averages the masked values."""
    s = _mask(_scores(q.float(), k.float(), scale), is_causal, None if attn_mask is None else attn_mask.float(), -5e4)
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)


def softmax_bf16(q, k, v, is_causal=False, attn_mask=None, scale=None):
    """Every step in the input format: scores, exp, a running row sum (cumulative, rounded at every step), P V."""
    s = _mask(_scores(q, k, scale), is_causal, attn_mask, -math.inf)
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return (e @ v) / torch.cumsum(e, dim=-1)[..., -1:]


def lost_row(q, k, v, is_causal=False, attn_mask=None, scale=None):
    """Not a kernel the report can measure: it loses the last query row."""
    return correct(q, k, v, is_causal=is_causal, attn_mask=attn_mask, scale=scale)[..., :-1, :]
