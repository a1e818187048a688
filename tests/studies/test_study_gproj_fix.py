"""Study 05 end to end: the smoke tier through the runner; and the study's helpers on small inputs."""
import json

import numpy as np
import pytest
import xarray as xr

from attnum import ncio, runner
from attnum.kernels import FIXES
from attnum.model import GPTConfig
from attnum.studies import gproj_fix as study
from attnum.tasks import Task
from attnum.training import TrainConfig

STUDY = "gproj_fix"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    return runner.run(STUDY, "smoke", outputs=outputs, progress=False)


@pytest.mark.slow
def test_smoke_run_writes_one_entry_per_fix(smoke_run):
    path = smoke_run
    assert json.loads((path / "RUN.json").read_text())["status"] == "ok"
    assert {"error_vs_offset.png", "delta_path.png", "dk_dv.png", "regimes.png", "costs.png",
            "training.png"} <= {p.name for p in path.glob("*.png")}
    ds = ncio.open_results(path / "results.nc")
    params = runner.load_param_set(STUDY, "smoke")
    assert ds["fix"].values.tolist() == params["fixes"] == list(FIXES)
    assert ds["grid_dq_err"].dims == ("fix", "sharpness", "mu_norm", "seq_len", "head_dim", "seed")
    assert ds["regime_dq_err"].dims == ("regime", "fix", "seed")
    assert ds["cost_gemm_flops_low"].dims == ("fix", "kernel_pass")
    assert ds["emul_backward_seconds"].dims == ("fix",)
    assert ds["train_loss"].dims == ("run", "step")
    assert ds["run"].values.tolist() == ["fp32"] + params["train_fixes"]
    assert ds["train_key_mean_norm"].dims == ("run", "step", "layer")
    assert ds.attrs["headline_figure"] == "error_vs_offset.png" and ds.attrs["study"] == STUDY
    for name, var in ds.data_vars.items():
        # CF: every variable has a long_name; numbers have units, strings none
        assert var.attrs.get("long_name") and (var.attrs.get("units") or var.dtype.kind in "OUS"), name
    # what must hold even on the smoke tier (first sharpness, the one (N, d), seed 0)
    err = ds["grid_dq_err"].isel(sharpness=0, seq_len=0, head_dim=0, seed=0)
    none, gproj = err.sel(fix="none").values, err.sel(fix="gproj_dq_dk").values
    assert np.all(np.diff(none) > 0) and none[-1] > 20 * none[0]
    assert gproj.max() < 1.5 * gproj[0] and gproj[-1] < none[-1] / 20
    assert float(ds["grid_ds_row_sum"].sel(fix="gproj_dq_dk").max()) < 1e-4 < float(
        ds["grid_ds_row_sum"].sel(fix="none").isel(sharpness=0).min())
    assert float(ds["grid_dq_err"].sel(fix="fp32_attention").isel(mu_norm=0).max()) < 1e-4
    assert np.isfinite(ds["train_loss"]).all()


def test_fix_grid_on_a_tiny_grid():
    ds = study.fix_grid([1.0], [0.0, 300.0], [64], [16], [0], fixes=["none", "mean_key", "gproj_dq_dk", "fp32_backward"],
                        block_q=16, block_k=16, golden_chunk=32, progress=False)
    err = ds["grid_dq_err"].squeeze()
    assert float(err.sel(fix="none", mu_norm=300.0)) > 10 * float(err.sel(fix="none", mu_norm=0.0))
    for fix in ("mean_key", "gproj_dq_dk"):
        assert float(err.sel(fix=fix, mu_norm=300.0)) < 2 * float(err.sel(fix=fix, mu_norm=0.0))
    # the FP32 backward's error is the stored output's: with D from the exact output it is at fp32 level
    exact = ds["grid_dq_err_exact_delta"].squeeze()
    assert float(exact.sel(fix="fp32_backward", mu_norm=0.0)) < 1e-5 < float(err.sel(fix="fp32_backward",
                                                                                      mu_norm=0.0))
    assert (ds["grid_zero_rows"] == 0).all()
    assert ds["fix_description"].sel(fix="gproj_dq_dk").item() == FIXES["gproj_dq_dk"].description
    assert set(ds.variables) <= set(study.VARIABLES) | set(ds.dims) | {"fix"}  # the writer's table covers it


def test_regime_comparison_and_stable_max_in_tied_rows():
    ds = study.regime_comparison(64, 16, [0], fixes=["none", "stable_max", "gproj_dq_dk"], n_ties=4, block_q=16,
                                 block_k=16, golden_chunk=32, progress=False)
    assert ds["regime_dq_err"].dims == ("regime", "fix", "seed")
    tied = ds["regime_out_err"].sel(regime="tied_max_negative_v").squeeze()
    assert float(tied.sel(fix="stable_max")) != float(tied.sel(fix="none"))  # STABLE acts on tied rows
    offset = ds["regime_out_err"].sel(regime="key_offset").squeeze()
    assert float(offset.sel(fix="gproj_dq_dk")) == float(offset.sel(fix="none"))  # GProj leaves the forward alone


def _grid_like():
    coords = {"fix": ["none", "gproj_dq_dk", "fp32_attention"], "sharpness": [1.0, 8.0], "mu_norm": [0.0, 100.0, 1000.0],
              "seq_len": [64], "head_dim": [16], "seed": [0]}
    base = np.array([1e-3, 0.3, 2.5])  # none: nearest 2.19 at |mu| = 1000
    vals = np.stack([np.stack([base, base * 2]), np.full((2, 3), 2e-3), np.full((2, 3), 1e-6)])
    return xr.Dataset({"grid_dq_err": (tuple(coords), vals[..., None, None, None])}, coords=coords)


def test_seed004_comparison_marks_theirs_and_picks_the_nearest_offset():
    table = study.seed004_comparison(_grid_like())
    assert table.index.get_level_values("|mu|").tolist() == [1000.0, 1000.0]
    assert table["theirs (seed 004): before GProj"].eq(2.19).all()
    assert table["theirs (seed 004): after GProj"].eq(0.0034).all()
    assert table["ours: gproj_dq_dk"].tolist() == [2e-3, 2e-3]
    growth = study.offset_growth(_grid_like())
    assert growth[("growth", 1.0)].loc["none"] == pytest.approx(2500.0)


def test_fix_training_and_tables():
    task = Task("induction", context=8, n_symbols=4, lm_loss=True)
    model = GPTConfig(vocab_size=task.vocab_size, context=8, n_layer=1, n_head=1, d_model=8)
    records = study.fix_training(task, model, TrainConfig(steps=4, batch_size=2, warmup_steps=1, record_every=1),
                                 baseline="sdpa:flash", fixes=["none", "gproj_dq_dk"], block=4,
                                 progress=False)
    assert records["run"].values.tolist() == ["fp32", "none", "gproj_dq_dk"]
    assert records["run_attention"].sel(run="gproj_dq_dk").item() == "emulator:fa2_bf16:bk4:fused:gproj_dq_dk"
    table = study.training_table(records, last=2)
    assert table.loc["fp32", "gap vs fp32 (nat)"] == 0.0 and list(table.index) == ["fp32", "none", "gproj_dq_dk"]
    assert np.isfinite(table["final loss (nat)"]).all()
    costs = study.fix_costs(["none", "gproj_dq_dk"], seq_len=256, head_dim=32, block=64, causal=True, timing_seq_len=32,
                            timing_head_dim=8, block_q=8, block_k=8, repeats=1)
    summary = study.cost_summary(costs)
    assert summary.loc["none"].drop("EMULATION (CPU): fwd+bwd time / base").eq(0).all()
    assert summary.loc["gproj_dq_dk", "extra tile passes per backward"] == 1
    assert summary.loc["none", "EMULATION (CPU): fwd+bwd time / base"] == 1.0
