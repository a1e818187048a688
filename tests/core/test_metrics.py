import math

import numpy as np
import pytest
import torch

from attnum import acceptance
from attnum.metrics import (error_summary, fit_growth, growth_lines, max_abs_error, max_rel_error,
                            mean_abs_error, rel_l2_error, row_rel_l2, strata_bounds, stratified, ulp_error)


def t(*vals):
    return torch.tensor(vals, dtype=torch.float64)


def test_hand_computed_errors():
    a, b = t(1.0, 2.0, 3.0, 4.0), t(1.0, 2.5, 3.0, 2.0)
    assert max_abs_error(a, b) == 2.0
    assert mean_abs_error(a, b) == pytest.approx(2.5 / 4)
    assert rel_l2_error(a, b) == pytest.approx(math.sqrt(0.25 + 4.0) / math.sqrt(1 + 6.25 + 9 + 4))
    assert max_rel_error(a, b) == pytest.approx(1.0)  # |4 - 2| / 2
    assert max_rel_error(t(1.0, 5.0), t(0.0, 4.0)) == pytest.approx(0.25)  # zeros of b are skipped
    assert rel_l2_error(t(0.0), t(0.0)) == 0.0 and math.isinf(rel_l2_error(t(1.0), t(0.0)))
    with pytest.raises(ValueError, match="shape"):
        max_abs_error(t(1.0), t(1.0, 2.0))


def test_ulp_error_counts_last_places():
    one = t(1.0, 1.0, 2.0)
    err = ulp_error(one + t(2.0 ** -7, 2.0 ** -6, 2.0 ** -6), one, "bf16")
    assert err.tolist() == [1.0, 2.0, 1.0]
    summary = error_summary(one + t(2.0 ** -7, 0, 0), one, "bf16")
    assert summary["max_ulp"] == 1.0 and summary["max_abs"] == 2.0 ** -7


def test_row_errors_and_strata():
    a = torch.zeros(1, 10, 2, dtype=torch.float64)
    b = torch.ones(1, 10, 2, dtype=torch.float64)
    a[0, :, 0] = 1.0
    rows = row_rel_l2(a, b)
    assert rows.shape == (1, 10) and torch.allclose(rows, torch.full((1, 10), math.sqrt(0.5), dtype=torch.float64))
    assert strata_bounds(10) == {"first_10pct": slice(0, 1), "middle_80pct": slice(1, 9), "last_10pct": slice(9, 10)}
    assert strata_bounds(1000)["middle_80pct"] == slice(100, 900)
    vals = torch.arange(100, dtype=torch.float64)
    s = stratified(vals, "mean")
    assert s == {"first_10pct": 4.5, "middle_80pct": 49.5, "last_10pct": 94.5}
    assert stratified(vals, "max")["middle_80pct"] == 89.0


def test_growth_fits_recover_known_laws():
    n = 2.0 ** np.arange(7, 15)
    fits = fit_growth(n, 3e-4 * np.sqrt(n))
    assert fits["power_law"]["slope"] == pytest.approx(0.5)
    assert fits["sqrt_n"]["r2"] == pytest.approx(1.0) and fits["sqrt_n"]["slope"] == pytest.approx(3e-4)
    assert fits["log2_n"]["r2"] < 0.99
    log_fits = fit_growth(n, 1e-3 + 2e-4 * np.log2(n))
    assert log_fits["log2_n"]["r2"] == pytest.approx(1.0) and log_fits["log2_n"]["slope"] == pytest.approx(2e-4)
    assert math.isnan(fit_growth(n[:2], [1e-3, 2e-3])["power_law"]["slope"])
    lines = growth_lines([4, 16], "bf16")
    assert lines["sqrt_n_u"].tolist() == [2 * 2.0 ** -8, 4 * 2.0 ** -8] and lines["n_u"][1] == 16 * 2.0 ** -8


def test_dynamic_threshold_at_known_points():
    assert acceptance.dynamic_threshold(512, 1.0, "fp32") == pytest.approx(0.8e-4)
    assert acceptance.dynamic_threshold(2048, 5.0, "bf16") == pytest.approx(1e-4 * 1.1 * 1.2)
    assert acceptance.dynamic_threshold(512, 30.0, "fp32") == pytest.approx(1e-4 * 0.8 * 2.0)
    assert acceptance.dynamic_threshold(4096, 1e6, "fp16") == 5e-3  # capped
    assert acceptance.dynamic_threshold_rule(1e-4, 2048, 1.0, "fp16") is True
    assert acceptance.dynamic_threshold_rule(2e-4, 2048, 1.0, "fp16") is False


def test_fixed_and_reference_relative_rules():
    assert acceptance.fixed_relative_rule(0.9e-3) and not acceptance.fixed_relative_rule(1.1e-3)
    assert acceptance.reference_relative_rule(3e-3, 1e-3, floor=1.5e-3)
    assert not acceptance.reference_relative_rule(3e-3, 1e-3, floor=0.5e-3)


def test_dtype_floor_is_the_rounding_of_a_shift():
    # bf16: 1 + 0.3 -> 1.296875, - 0.3 -> 0.996875 -> rounds to 0.99609375; floor = 2 * 0.00390625
    assert acceptance.dtype_floor(t(1.0), "bf16") == pytest.approx(2 * 2.0 ** -8)
    assert acceptance.dtype_floor(t(1.0), "fp32") < 1e-6


def test_mean_rel_error_is_elementwise_and_dilutes_linearly():
    from attnum.metrics import mean_rel_error

    a, b = t(1.0, 2.5, 3.0, 1.0), t(1.0, 2.0, 3.0, 2.0)
    assert mean_rel_error(a, b) == pytest.approx((0.25 + 0.5) / 4)
    assert mean_rel_error(t(5.0, 1.1), t(0.0, 1.0)) == pytest.approx(0.1)  # zeros of b are skipped
    assert mean_rel_error(t(1.0), t(0.0)) == 0.0
    # one of R rows scaled by 1 + e: the mean relative error is e / R, the relative L2 e / sqrt(R)
    gold = torch.randn(1, 1, 400, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    faulty = gold.clone()
    faulty[..., -1, :] *= 1.12
    assert mean_rel_error(faulty, gold) == pytest.approx(0.12 / 400)
    row_share = gold[..., -1, :].norm() / gold.norm()
    assert rel_l2_error(faulty, gold) == pytest.approx(0.12 * row_share.item())
    with pytest.raises(ValueError, match="shape"):
        mean_rel_error(t(1.0), t(1.0, 2.0))
