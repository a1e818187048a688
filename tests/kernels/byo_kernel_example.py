"""Kernels of one's own, as a user would write them (``package.module:function`` names them)."""
import torch
import torch.nn.functional as F

from attnum.kernels import Kernel


def sdpa_math(q, k, v, is_causal=False, attn_mask=None, scale=None):
    """A few-line wrapper around one SDPA backend: a plain attention function."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def broken(q, k, v, is_causal=False, attn_mask=None, scale=None):
    """A kernel with a bug the check before a run must catch: it loses the last query row."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)[..., :-1, :]


class Doubled(Kernel):
    """A ``Kernel`` subclass with its own forward and lse (the registry's full interface)."""


    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, is_causal=causal, scale=scale)

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        out = self.differentiable(q, k, v, causal=causal, attn_bias=attn_bias, scale=scale)
        return out, torch.zeros(q.shape[:-1])


not_callable = 3
