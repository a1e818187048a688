"""attnum.testing: the tolerance, the failure's contents, the fixture, and the factor against the committed band."""
import math

import pytest
import torch

from attnum import kernels
from attnum.inputs import make_inputs, normal_qkv
from attnum.kernels import make_fault
from attnum.testing import (FACTOR, ROW_FLOOR, AttentionMismatch, assert_attention_close, band_spread,
                            check_attention_close)

import user_kernels


def _qkv(n=128, d=32, dtype=torch.bfloat16, seed=0):
    return tuple(t.to(dtype) for t in normal_qkv(1, 2, n, d, seed=seed))


def test_a_correct_kernel_passes_and_the_tolerance_is_the_emulators_error_times_the_factor():
    q, k, v = _qkv()
    res = assert_attention_close("sdpa:math", q, k, v, causal=True)
    assert res.passed and res.fmt == "bf16" and res.policy == "fa2_bf16"
    assert res.tolerance_rel_l2 == FACTOR * res.emulator_rel_l2
    assert res.tolerance_row == FACTOR * res.emulator_worst_row + ROW_FLOOR
    assert 0 < res.rel_l2 <= res.tolerance_rel_l2


def test_the_tolerance_follows_the_format_and_the_inputs():
    bf16 = check_attention_close("sdpa:math", *_qkv(dtype=torch.bfloat16))
    fp16 = check_attention_close("sdpa:math", *_qkv(dtype=torch.float16))
    longer = check_attention_close("sdpa:math", *_qkv(n=256))
    assert fp16.policy == "fa2_fp16" and fp16.tolerance_rel_l2 < bf16.tolerance_rel_l2 / 4  # 3 more mantissa bits
    assert longer.tolerance_rel_l2 != bf16.tolerance_rel_l2


def test_a_fault_in_a_few_rows_is_named_row_by_row_worst_first():
    q, k, v = _qkv()
    out = kernels.emulator("fa2_bf16", block_q=128, block_k=128,
                           fault=make_fault("dropped_tail", level=3)).forward(q, k, v)[0]
    with pytest.raises(AttentionMismatch) as info:
        assert_attention_close(out, q, k, v, fmt="bf16")
    res = info.value.result
    assert not res.passed and res.bad_rows
    errors = [float(res.row_error[r]) for r in res.bad_rows]
    assert errors == sorted(errors, reverse=True) and errors[-1] > res.tolerance_row
    assert res.bad_rows[0] == res.worst_row
    b, h, r = res.worst_row  # the message names the worst row with its error, and how many rows fail of how many
    assert f"(b={b}, h={h}, row={r}): {float(res.row_error[b, h, r]):.3g}" in str(info.value)
    assert f"{len(res.bad_rows)} of {res.row_error.numel()} rows" in str(info.value)


def test_an_all_bf16_softmax_fails_the_global_check():
    q, k, v = _qkv(n=256)
    res = check_attention_close(user_kernels.softmax_bf16, q, k, v)
    assert res.rel_l2 > res.tolerance_rel_l2 and not res.passed


def test_masked_keys_given_weight_and_nan_are_named():
    inp = make_inputs("fully_masked_rows", 1, 2, 64, 32, seed=0).rounded("bf16")
    q, k, v = (t.to(torch.bfloat16) for t in (inp.q, inp.k, inp.v))
    bias = inp.attn_bias.to(torch.bfloat16)
    res = check_attention_close(user_kernels.sentinel_5e4, q, k, v, attn_bias=bias)
    fully = (~(bias > -math.inf).any(dim=-1)).expand(1, 2, 64)
    assert res.masked_rows == int(fully.sum()) > 0
    assert sorted(res.masked_weight_rows) == sorted(tuple(i) for i in fully.nonzero().tolist())
    assert check_attention_close("sdpa:math", q, k, v, attn_bias=bias).masked_weight_rows == []
    out = kernels.get("sdpa:math").forward(*_qkv())[0].clone()
    out[0, 1, 5, 0] = float("nan")
    nan = check_attention_close(out, *_qkv())
    assert nan.nonfinite_rows == [(0, 1, 5)] and not nan.passed


def test_bad_input_is_refused_before_any_work():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="shape"):
        check_attention_close("sdpa:math", q[0], k, v)
    with pytest.raises(ValueError, match="factor"):
        check_attention_close("sdpa:math", q, k, v, factor=0)


def test_the_fixture_is_the_function(attention_close):
    assert attention_close is assert_attention_close
    attention_close(user_kernels.correct, *_qkv())


def test_the_factor_is_above_the_widest_real_kernel_of_the_committed_gpu_run():
    band = band_spread()
    assert band["outputs"] > 100  # the committed run outputs/length_scaling/gpu
    assert band["ratio_min"] < 1 < band["ratio_max"] < FACTOR
