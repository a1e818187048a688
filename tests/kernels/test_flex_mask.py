"""The flex kernel's causal block mask: built per block (no N x N evaluation), equal to PyTorch's own.

``create_block_mask`` evaluates the mask on every (query, key) element; at N = 131072 that asked for
128 GiB on an H200 and ran out of memory (study 01's gpu run at 689a291). ``attnum.kernels.flex``
computes the same block tables from block bounds. These tests run on the CPU: they compare the tables,
which is all that FlexAttention reads of a block mask besides ``mask_mod`` itself.
"""
import shutil

import pytest
import torch

from attnum.kernels.flex import BLOCK, _block_mask, _causal_tables

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("n_q,n_k", [(128, 128), (256, 320), (300, 300), (1000, 513), (513, 1000), (1, 700),
                                     (700, 1), (129, 257), (2048, 2048), (640, 1920), (1920, 640), (127, 129)])
def test_causal_block_tables_equal_create_block_mask(n_q, n_k):
    from torch.nn.attention.flex_attention import create_block_mask

    offset = n_k - n_q
    expected = create_block_mask(lambda b, h, q, kv: kv <= q + offset, B=None, H=None, Q_LEN=n_q, KV_LEN=n_k,
                                 device="cpu")
    got = _block_mask(n_q, n_k, "cpu")
    for name in TABLES:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.seq_lengths == (n_q, n_k)
    # the mask_mod FlexAttention applies inside partial blocks is the bottom-right causal mask
    q_idx, kv_idx = torch.tensor([0, n_q - 1]), torch.tensor([offset, offset])
    assert got.mask_mod(0, 0, q_idx, kv_idx).tolist() == [True, True]
    assert got.mask_mod(0, 0, torch.tensor(0), torch.tensor(offset + 1)).item() is False


def test_long_sequence_tables_are_per_block():
    n = 131072  # study 01's longest length, where the element-wise construction ran out of memory
    (num, idx), (full_num, full_idx) = _causal_tables(n, n)
    blocks = n // BLOCK
    assert idx.shape == full_idx.shape == (1, 1, blocks, blocks)
    # square causal: block row i has block i partial (the diagonal) and blocks 0..i-1 full
    assert torch.equal(num[0, 0], torch.ones(blocks, dtype=torch.int32))
    assert torch.equal(full_num[0, 0], torch.arange(blocks, dtype=torch.int32))
    assert torch.equal(idx[0, 0, :, 0], torch.arange(blocks, dtype=torch.int32))


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="torch.compile on a CPU needs a C compiler")
def test_compiled_flex_attention_with_the_tables_gives_causal_attention_on_the_cpu():
    """End to end: FlexAttention compiled on the CPU (its fused C++ kernel reads the same block tables
    as the CUDA one: which blocks to visit, which are full, which need mask_mod) against masked softmax
    attention, at lengths that are not multiples of the block and with fewer queries than keys."""
    from torch.nn.attention.flex_attention import flex_attention

    n_q, n_k, d = 200, 450, 32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, generator=gen) for n in (n_q, n_k, n_k))
    out = torch.compile(flex_attention)(q, k, v, block_mask=_block_mask(n_q, n_k, "cpu"))
    scores = (q @ k.transpose(-1, -2)) / d ** 0.5
    seen = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
    expected = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)


def test_flex_runs_an_additive_bias_with_its_smaller_kernel_options(monkeypatch):
    # the compiled call is replaced by a recorder (FlexAttention's fused kernel needs CUDA): with a bias the
    # kernel passes BIAS_KERNEL_OPTIONS (the H200 default configuration did not fit its shared memory),
    # without one PyTorch's defaults; the GPU tests run the real thing
    from attnum.kernels import flex

    calls = []
    monkeypatch.setattr(flex, "_compiled", lambda: lambda *a, **kw: calls.append(kw) or (a[0], None))
    kernel = flex.FlexKernel()
    monkeypatch.setattr(kernel, "unavailable_reason", lambda device="cpu": None)
    q = torch.zeros(1, 1, 8, 16)
    kernel.forward(q, q, q, attn_bias=torch.zeros(1, 1, 8, 8))
    kernel.forward(q, q, q, causal=True)
    assert calls[0]["kernel_options"] == flex.BIAS_KERNEL_OPTIONS and calls[0]["score_mod"] is not None
    assert calls[1]["kernel_options"] is None and calls[1]["score_mod"] is None
    assert str(flex.BIAS_KERNEL_OPTIONS) in kernel.runs_as()
