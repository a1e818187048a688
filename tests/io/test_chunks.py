"""Cache-sized query chunks give the same bits as the old chunkings, on the CPU.

The fp64 golden value and the unblocked reference walk over query rows in chunks; a chunk only
changes which rows share one matmul, so on the CPU every row's numbers must be bit for bit the
same whatever the chunk. These tests compare the outputs (and log-sum-exps) bitwise, NaN and inf
included, for the library's CPU defaults (``GOLDEN_CHUNK_CPU``, ``REFERENCE_CHUNK_CPU``) against
the old ones (1024 rows; all rows at once) and other sizes, over every precision preset, causal and
additive masks, fully masked rows and non-finite inputs.

Not every chunk keeps the bits: here the fp64 golden value changes in its last bits for chunks that
are not a multiple of 4 rows (37, 341, ...), and the fp32 reference when a chunk holds a single row
(N = 777 in chunks of 8: the last matmul is a matrix-vector product). The defaults and the values
recommended for the studies' parameters (multiples of 128; the studies' lengths are powers of two)
avoid both, and are what is checked here.
"""
import math

import pytest
import torch

import attnum.kernels.reference  # noqa: F401 (the module; attnum.kernels.reference is also a function)
import sys

ref = sys.modules["attnum.kernels.reference"]
from attnum.precision import PRESETS, get_policy, policy_for

DEVICE = "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so NaN == NaN and -0.0 != 0.0)."""
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}
    return t.contiguous().view(ints[t.dtype])


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _inputs(n: int, d: int, seed: int, kind: str):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    bias = None
    if kind == "scaled":  # large scores: exp of large differences, many exact zeros
        q = q * 30
    elif kind == "bias":  # an additive mask with -inf, one fully masked row, finite large negatives
        bias = torch.zeros(1, 1, n, n, dtype=torch.float64)
        bias[..., :, 1::3] = -math.inf
        bias[..., 5, :] = -math.inf
        bias[..., :, 2::7] = -5e4
    elif kind == "nonfinite":  # NaN in one key, inf in one value
        k[..., 3, 0] = float("nan")
        v[..., 7, 1] = float("inf")
    return q, k, v, bias


CASES = [(2048, 64, "normal"), (1000, 128, "normal"), (777, 64, "scaled"), (512, 32, "bias"),
         (300, 64, "nonfinite")]


def test_the_defaults_are_cache_sized_on_the_cpu_only():
    assert ref.default_golden_chunk("cpu") == ref.GOLDEN_CHUNK_CPU < ref.GOLDEN_CHUNK == 1024
    assert ref.default_golden_chunk("cuda") == ref.GOLDEN_CHUNK  # no CUDA needed to ask
    assert ref.REFERENCE_CHUNK_CPU < 1024
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        ref.golden_attention(*(torch.zeros(1, 1, 4, 8),) * 3, chunk=0)


@pytest.mark.parametrize("n,d,kind", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_golden_value_is_bitwise_the_same_for_every_chunk(n, d, kind, causal):
    q, k, v, bias = _inputs(n, d, seed=n, kind=kind)
    base = ref.golden_attention(q, k, v, causal=causal, attn_bias=bias, chunk=1024, return_lse=True)
    for chunk in (None, ref.GOLDEN_CHUNK_CPU, 256, 512, 64, 32, n):
        out = ref.golden_attention(q, k, v, causal=causal, attn_bias=bias, chunk=chunk, return_lse=True)
        assert _same(out[0], base[0]) and _same(out[1], base[1]), f"chunk {chunk} changed the golden value"
    if kind != "nonfinite":
        assert torch.isfinite(base[0]).all() or kind == "bias"


@pytest.mark.parametrize("n,d,kind", CASES[:2] + CASES[3:4])
def test_golden_dq_is_bitwise_the_same_for_every_chunk(n, d, kind):
    """dQ rows are computed per chunk (dK and dV are sums over chunks: their default chunk stays 1024)."""
    q, k, v, bias = _inputs(n, d, seed=n + 1, kind=kind)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    base = ref.golden_attention_backward(q, k, v, do, attn_bias=bias, chunk=1024)[0]
    for chunk in (ref.GOLDEN_CHUNK_CPU, 256, 64):
        assert _same(ref.golden_attention_backward(q, k, v, do, attn_bias=bias, chunk=chunk)[0], base)


POLICIES = sorted(PRESETS) + ["inside:bf16", "inside:fp16"]


def _policy(name):
    if name.startswith("inside:"):  # study 01's "fp32 inside, inputs and output in the dtype"
        fmt = name.split(":")[1]
        return policy_for("all", "fp32").replace(name=f"fp32_inside_{fmt}", inputs=fmt, output=fmt)
    return get_policy(name)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n,d,kind", [(2048, 64, "normal"), (1000, 128, "scaled"), (512, 32, "bias"),
                                      (300, 64, "nonfinite")])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_is_bitwise_the_same_for_every_query_chunk(policy, n, d, kind, causal):
    q, k, v, bias = _inputs(n, d, seed=2 * n, kind=kind)
    q, k, v = (t.to(torch.float32) for t in (q, k, v))
    pol = _policy(policy)
    base = ref.reference_attention(q, k, v, pol, causal=causal, attn_bias=bias, return_lse=True)
    for chunk in (ref.REFERENCE_CHUNK_CPU, 128, 512, 1024):
        out = ref.reference_attention(q, k, v, pol, causal=causal, attn_bias=bias, return_lse=True,
                                      query_chunk=chunk)
        assert _same(out[0], base[0]) and _same(out[1], base[1]), \
            f"{policy}: query_chunk {chunk} changed the reference"
