import math

import pytest
import torch

from attnum.precision import PRESETS, get_policy, policy_for, round_to, ulp, unit_roundoff


def test_presets_name_every_stage_format():
    fa2 = get_policy("fa2_bf16")
    assert (fa2.inputs, fa2.score, fa2.stats, fa2.p, fa2.out_acc, fa2.output) == \
        ("bf16", "fp32", "fp32", "bf16", "fp32", "bf16")
    assert set(get_policy("all_fp16").formats()) == {"fp16"}
    assert get_policy("fp64").carrier == torch.float64 and fa2.carrier == torch.float32
    assert fa2.low == "bf16" and policy_for("fa2", "fp64") is PRESETS["fp64"]
    for name in ("fp64", "fp32", "all_bf16", "all_fp16", "fa2_bf16", "fa2_fp16"):
        assert name in PRESETS


def test_unknown_policy_and_format_are_named():
    with pytest.raises(ValueError, match="fa3_bf16"):
        get_policy("fa3_bf16")
    with pytest.raises(ValueError, match="fp8"):
        get_policy("fp32").replace(p="fp8")


def test_round_to_really_rounds():
    x = torch.tensor([1.0 + 2.0 ** -9, 1.0 + 2.0 ** -7, 70000.0], dtype=torch.float32)
    r = round_to(x, "bf16")
    assert r.dtype == torch.float32
    assert r[0].item() == 1.0  # below half an ulp of bf16 at 1 (2^-8)
    assert r[1].item() == 1.0 + 2.0 ** -7
    assert math.isinf(round_to(x, "fp16")[2].item())  # beyond fp16's max 65504
    # fp16 -> bf16 is a real cast even though both are 16 bits wide
    h = torch.tensor([1.0 + 2.0 ** -10], dtype=torch.float16)
    assert round_to(h, "bf16").item() == 1.0


def test_unit_roundoff_and_ulp():
    assert unit_roundoff("bf16") == 2.0 ** -8 and unit_roundoff("fp32") == 2.0 ** -24
    assert unit_roundoff("fp16") == torch.finfo(torch.float16).eps / 2
    x = torch.tensor([1.0, 1.5, 2.0, 0.75], dtype=torch.float64)
    assert ulp(x, "bf16").tolist() == [2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 2.0 ** -8]
    # subnormal spacing below fp16's normal range
    assert ulp(torch.tensor([1e-7], dtype=torch.float64), "fp16").item() == 2.0 ** -24


def test_replace_makes_a_named_variant():
    pol = get_policy("fa2_bf16").replace(stats="bf16")
    assert pol.stats == "bf16" and pol.name == "fa2_bf16+stats=bf16"
    with pytest.raises(ValueError, match="sram"):
        get_policy("fa2_bf16").replace(sram="bf16")
