"""Study 04's designed sweep (``designed``): the gathering of the committed records and the analysis the plan
states, checked by value against the records read directly and against intervals computed here."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from scipy import stats

from attnum.paths import project_root
from attnum.studies.late_training_gradient_blowup import designed
from attnum.train import record

SWEEP = project_root() / "outputs" / "lm" / "lr_sweep"
needs_records = pytest.mark.skipif(not (SWEEP / "sweep.yaml").is_file(), reason="no committed sweep records here")


def test_an_interval_is_read_against_zero_and_the_margin():
    assert designed.read_interval(0.01, 0.2, 0.05) == "higher"
    assert designed.read_interval(-0.3, -0.01, 0.05) == "lower"
    assert designed.read_interval(-0.02, 0.03, 0.05) == "within margin"
    assert designed.read_interval(-0.02, 0.08, 0.05) == "cannot tell"
    assert designed.read_interval(math.nan, math.nan, 0.05) == "cannot tell"


def test_the_t_interval_is_students():
    x = [0.1, 0.3, -0.05, 0.2]
    mean, lo, hi, n = designed.t_interval(x + [math.nan], 0.95)
    half = stats.t.ppf(0.975, 3) * np.std(x, ddof=1) / 2
    assert n == 4 and mean == pytest.approx(np.mean(x)) and (lo, hi) == pytest.approx((np.mean(x) - half, np.mean(x) + half))
    one = designed.t_interval([0.4], 0.95)
    assert one[0] == 0.4 and one[3] == 1 and math.isnan(one[1]) and math.isnan(one[2])  # no interval from one value


def test_without_a_sweep_every_value_is_missing_and_every_table_empty():
    assert set(designed.values(None)) == set(designed.VALUE_KEYS) and set(designed.values(None).values()) == {None}
    assert all(t.empty for t in designed.tables(None).values())


def _synthetic(diff: float, spread: float) -> xr.Dataset:
    """Five seeds, two rates; triton's endpoint = gproj's + diff (+- spread by seed); triton in the regime at
    the higher rate."""
    arms, lrs, seeds = ["fp32", "triton", "gproj"], [0.01, 0.03], [0, 1, 2, 3, 4]
    base = np.array([0.70, 0.72, 0.69, 0.71, 0.73])
    end = np.zeros((3, 2, 5))
    for j in range(2):
        end[0, j], end[2, j] = base + j, base + j
        end[1, j] = base + j + diff + spread * np.array([-1, 1, -1, 1, 0])
    dq = np.zeros((3, 2, 5))
    dq[1, 1] = 5.0
    plan = {"reference": "fp32", "contrasts": [["triton", "gproj"], ["gproj", "fp32"]], "confidence": 0.95,
            "margin_nat": 0.05, "regime_dq_err": 0.1}
    dims = ("dx_arm", "dx_lr", "dx_seed")
    ones = np.ones((3, 2, 5))
    return xr.Dataset({"dx_endpoint": (dims, end), "dx_ran": (dims, ones), "dx_in_design": (dims, ones),
                       "dx_max_dq_rel_err": (dims, dq), "dx_signature": (dims, np.full((3, 2, 5), np.nan)),
                       "dx_max_logit": (dims, ones), "dx_max_key_mean_ratio": (dims, ones),
                       "dx_diverged": (dims, 0 * ones), "dx_wall_s": (dims, ones)},
                      coords={"dx_arm": arms, "dx_lr": lrs, "dx_seed": seeds},
                      attrs={"dx_analysis": json.dumps(plan), "dx_design_lrs": json.dumps(lrs), "dx_name": "t"})


def test_the_dq_effect_is_read_where_the_triton_runs_reached_the_regime():
    assert designed.verdict(_synthetic(0.5, 0.01))["dx_dq_effect"] == "higher"
    assert designed.verdict(_synthetic(0.0, 0.001))["dx_dq_effect"] == "within margin"
    assert designed.verdict(_synthetic(0.0, 0.3))["dx_dq_effect"] == "cannot tell"
    v = designed.verdict(_synthetic(0.5, 0.01))
    assert v["dx_dq_effect_lrs"] == "0.03" and v["dx_dq_effect_n_min"] == 5 and v["dx_triton_regime_runs"] == 5
    row = designed.contrasts(_synthetic(0.5, 0.01)).query("first == 'triton' and lr == 0.03").iloc[0]
    d = 0.5 + 0.01 * np.array([-1, 1, -1, 1, 0])
    half = stats.t.ppf(0.975, 4) * d.std(ddof=1) / math.sqrt(5)
    assert (row["mean"], row["lo"], row["hi"]) == pytest.approx((d.mean(), d.mean() - half, d.mean() + half))


@pytest.fixture(scope="module")
def sweep():
    return designed.sweep_dataset(SWEEP)


@needs_records
def test_the_gathered_sweep_is_the_records(sweep):
    files = sorted(SWEEP.glob("lm_lrs_*.nc"))
    assert int(sweep["dx_ran"].sum()) == len(files)
    for path in files[:: max(1, len(files) // 6)]:  # a spread of records, read directly
        rec = record.open_record(path)
        arm = path.stem[len("lm_lrs_"):].rsplit("_lr", 1)[0]
        rest = path.stem.split("_lr")[-1]
        lr, seed = float(rest.split("_s")[0]), int(rest.split("_s")[1].split("_")[0])
        val = rec["val_loss"].isel(member=0).dropna("step")
        got = sweep["dx_final_val_loss"].sel(dx_arm=arm, dx_lr=lr, dx_seed=seed)
        assert float(got) == float(val[-1])
        assert float(sweep["dx_max_logit"].sel(dx_arm=arm, dx_lr=lr, dx_seed=seed)) == \
            float(np.nanmax(rec["max_logit"].isel(member=0).isel(step=slice(1, None)).values))


@needs_records
def test_each_contrast_is_the_paired_difference_of_the_records(sweep):
    table = designed.contrasts(sweep)
    end = sweep["dx_endpoint"]
    for _, row in table.iterrows():
        d = (end.sel(dx_arm=row["first"], dx_lr=row["lr"]) - end.sel(dx_arm=row["second"], dx_lr=row["lr"])).values
        d = d[np.isfinite(d)]
        assert row["n"] == len(d) and row["mean"] == pytest.approx(d.mean())
        if len(d) >= 2:
            half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
            assert (row["lo"], row["hi"]) == pytest.approx((d.mean() - half, d.mean() + half))
            assert row["reading"] == designed.read_interval(row["lo"], row["hi"], 0.05)
    values = designed.values(sweep)
    assert values["dx_runs"] == len(list(SWEEP.glob("lm_lrs_*.nc"))) and values["dx_plan_sha256"] == \
        json.loads((SWEEP / "sweep_status.json").read_text())["plan_sha256"][:12]
