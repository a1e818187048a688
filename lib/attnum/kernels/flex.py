"""``flex``: PyTorch's FlexAttention, compiled with ``torch.compile`` into its fused Triton kernel.

FlexAttention generates a fused kernel only under ``torch.compile``; eager mode is a slow
reference path, not the kernel users run, so this registry entry always compiles and runs only
on CUDA (on a CPU it says so). Masks are expressed as FlexAttention's own functions: the causal
mask as a ``mask_mod`` with its block tables computed per block (bottom-right aligned, like every
kernel of the package; ``_causal_tables``), an additive bias as a ``score_mod`` that adds ``bias[b, h, q, kv]`` to the scaled score.
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


BLOCK = 128  # FlexAttention's default block size, both axes

# With an additive bias (a score_mod that reads a [B, H, N, N] fp32 tensor) FlexAttention's default configuration
# did not fit the H200: study 02's gpu run at 13832f9 had every additive-mask cell of flex fail with "No valid
# triton configs ... out of resource: Required: 245760, Hardware limit: 232448" (shared memory, bytes). PyTorch's
# defaults for this GPU (torch/_inductor/template_heuristics, capability 9.0) are, forward, 128 x 128 tiles in 3
# stages (bf16/fp16, d = 64) or 128 x 64 in 3 (d = 128), and, backward, 64 x 128 / 128 x 64 in 3 stages with 8
# warps (d <= 128); which of the two overflowed was not recorded. With a bias the kernel therefore always runs with
# smaller tiles and fewer stages in both directions (never as a retry after a failure), and says so in
# ``runs_as``. The ``fwd_``/``bwd_`` prefixes address each direction's template (an unprefixed option would reach
# both); the backward's tiles keep its constraints (BLOCK_N1 a multiple of BLOCK_M1, BLOCK_M2 of BLOCK_N2, the
# 128-wide mask blocks a multiple of each). Whether they fit is checked on the GPU by tests/kernels/test_real_kernels.py.
BIAS_KERNEL_OPTIONS = {
    "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 2,
    "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 1,
}


def _causal_tables(n_q: int, n_k: int, block: int = BLOCK, device=None):
    """The bottom-right causal mask's block tables, computed per block, never per element.

    Query block i covers rows [i*block, (i+1)*block - 1], key block j the columns likewise; row q
    sees column c when c <= q + (n_k - n_q). Block j is *visible* to block i when its first column is
    seen by the block's last row, and *full* when its last column is seen by the block's first row and
    neither block runs past the end of its axis; a visible block that is not full is partial
    (FlexAttention applies ``mask_mod`` inside it). Each index table lists its blocks in ascending order first, then the others (ignored past
    the count), the layout ``create_block_mask`` produces. Memory: (n_q/block) x (n_k/block) entries,
    where ``create_block_mask`` evaluates the mask on all n_q x n_k elements (128 GiB at 131072^2,
    which ran out of memory on an H200).
    """
    offset = n_k - n_q
    n_qb, n_kb = -(-n_q // block), -(-n_k // block)
    q_first = torch.arange(n_qb, device=device) * block
    k_first = torch.arange(n_kb, device=device) * block
    # a block that runs past the end of its axis is padded: never full (the padding is masked), and its
    # padded rows count towards visibility, as in create_block_mask, which evaluates the mask on them
    q_whole, k_whole = q_first + block <= n_q, k_first + block <= n_k
    visible = k_first[None, :] <= (q_first + block - 1)[:, None] + offset
    full = (k_first + block - 1)[None, :] <= q_first[:, None] + offset
    full &= q_whole[:, None] & k_whole[None, :]
    partial = visible & ~full

    def table(selected):
        order = torch.argsort((~selected).to(torch.int8), dim=1, stable=True)  # selected first, ascending
        return selected.sum(1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    return table(partial), table(full)


def _block_mask(n_q: int, n_k: int, device):
    from torch.nn.attention.flex_attention import BlockMask

    offset = n_k - n_q

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    (num, idx), (full_num, full_idx) = _causal_tables(n_q, n_k, BLOCK, device)
    return BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK, causal, (n_q, n_k))


class FlexKernel(Kernel):
    name = "flex"

    def runs_as(self) -> str:
        return (f"torch {torch.__version__} flex_attention compiled by torch.compile (Inductor's Triton template), "
                f"PyTorch's default kernel options; with an additive bias {BIAS_KERNEL_OPTIONS}; causal mask as "
                f"per-block tables of {BLOCK} x {BLOCK}")

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
        score_mod, options = None, None
        if attn_bias is not None:
            options = dict(BIAS_KERNEL_OPTIONS)
            bias = attn_bias.to(torch.float32).expand(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[b, h, q_idx, kv_idx]

        return _compiled()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                           return_lse=return_lse, kernel_options=options)

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
