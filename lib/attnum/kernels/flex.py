"""``flex``: PyTorch's FlexAttention, compiled with ``torch.compile`` into its fused Triton kernel.

FlexAttention generates a fused kernel only under ``torch.compile``; eager mode is a slow
reference path, not the kernel users run, so this registry entry always compiles and runs only
on CUDA (on a CPU it says so). Masks are expressed as FlexAttention's own functions: the causal
mask as a ``mask_mod`` turned into a block mask (bottom-right aligned, like every kernel of the
package), an additive bias as a ``score_mod`` that adds ``bias[b, h, q, kv]`` to the scaled score.
``return_lse=True`` gives the log-sum-exp of the scaled scores, which the forward returns.
The backward is FlexAttention's own, through autograd.
"""
from __future__ import annotations

import functools

import torch

from .registry import Kernel


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    # Every new shape, dtype or mask recompiles; past dynamo's default limit (8) it would fall back to
    # running eagerly, i.e. to another computation under the same name. Raise the limit instead.
    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(256, getattr(torch._dynamo.config, limit)))
    return torch.compile(flex_attention)


def _block_mask(n_q: int, n_k: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = n_k - n_q

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return create_block_mask(causal, B=None, H=None, Q_LEN=n_q, KV_LEN=n_k, device=device)


class FlexKernel(Kernel):
    name = "flex"

    def unavailable_reason(self, device="cpu") -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return "FlexAttention's fused kernel is generated for CUDA devices (its CPU path is not the kernel)"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        return None

    def _run(self, q, k, v, causal, attn_bias, scale, return_lse):
        self.require(q.device)
        block_mask = _block_mask(q.shape[-2], k.shape[-2], q.device) if causal else None
        score_mod = None
        if attn_bias is not None:
            bias = attn_bias.to(torch.float32).expand(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[b, h, q_idx, kv_idx]

        return _compiled()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                           return_lse=return_lse)

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        with torch.no_grad():
            out, lse = self._run(q, k, v, causal, attn_bias, scale, True)
        return out, lse

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        return self._run(q, k, v, causal, attn_bias, scale, False)


def build(options: list[str], **keywords) -> FlexKernel:
    if options or keywords:
        raise ValueError("flex takes no options")
    return FlexKernel()
