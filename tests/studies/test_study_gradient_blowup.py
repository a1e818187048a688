"""Study 04 end to end: the smoke tier through the runner; and the study's helpers on small inputs."""
import json

import numpy as np
import pytest
import xarray as xr

from attnum import ncio, runner
from attnum.studies import late_training_gradient_blowup as study

STUDY = "late_training_gradient_blowup"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    return runner.run(STUDY, "smoke", outputs=outputs, progress=False)


@pytest.mark.slow
def test_smoke_run_writes_results_with_the_expected_dims(smoke_run):
    path = smoke_run
    assert json.loads((path / "RUN.json").read_text())["status"] == "ok"
    assert {"error_vs_offset.png", "row_sums.png", "error_vs_size.png", "training.png", "checkpoint_offsets.png",
            "tied_maxima.png"} <= {p.name for p in path.glob("*.png")}
    ds = ncio.open_results(path / "results.nc")
    params = runner.load_param_set(STUDY, "smoke")
    assert ds["mech_dq_err"].dims == ("variant", "sharpness", "mu_norm", "seq_len", "head_dim", "seed")
    assert ds["variant"].values.tolist() == params["variants"]
    assert ds["mu_norm"].values.tolist() == params["mu_norms"]
    assert ds["train_loss"].dims == ("run", "step") and ds["run"].values.tolist() == ["bf16", "fp32"]
    assert ds["train_key_mean_norm"].dims == ("run", "step", "layer")
    assert ds["diag_dq_rel_err"].dims == ("checkpoint", "offset_norm", "layer")
    assert ds["checkpoint"].values.tolist() == params["checkpoint_steps"]
    assert ds["qy_dq_err"].dims == ("regime", "variant", "tiling", "seed")
    assert ds["live_dq_rel_err"].dims == ("diag_step", "layer")
    assert set(range(0, params["steps"], params["diagnose_every"])) <= set(ds["diag_step"].values.tolist())
    assert ds.attrs["headline_figure"] == "error_vs_offset.png" and ds.attrs["study"] == STUDY
    for name, var in ds.data_vars.items():
        assert var.attrs.get("units") and var.attrs.get("long_name"), name
    # what must hold even on the smoke tier
    assert (ds["diag_forward_identical"] == 1).all()
    bf16 = ds["mech_dq_err"].sel(variant="bf16").isel(sharpness=0, seq_len=0, head_dim=0, seed=0).values
    assert np.all(np.diff(bf16) > 0) and bf16[-1] > 20 * bf16[0]
    reference = ds["mech_dq_err"].sel(variant="reference_bf16")
    assert float(reference.max()) < 0.01


def test_mechanism_grid_isolates_kernel_error():
    ds = study.mechanism_grid([1.0], [0.0, 300.0], [64], [16], [0], variants=["fp32", "fp32_ds_bf16", "bf16"],
                              block_q=16, block_k=16, progress=False)
    err = ds["mech_dq_err"].squeeze()
    assert float(err.sel(variant="fp32", mu_norm=300.0)) < 1e-4
    for variant in ("fp32_ds_bf16", "bf16"):
        assert float(err.sel(variant=variant, mu_norm=300.0)) > 10 * float(err.sel(variant=variant, mu_norm=0.0))
    cos = ds["mech_dq_err_cos_mu"].squeeze().sel(variant="bf16", mu_norm=300.0)
    assert float(cos) > 0.9
    rows = ds["mech_ds_row_sum"].squeeze().sel(mu_norm=0.0)
    assert float(rows.sel(variant="fp32")) < 1e-6 < 1e-5 < float(rows.sel(variant="fp32_ds_bf16"))
    assert np.isnan(ds["mech_dq_err_cos_mu"].sel(mu_norm=0.0)).all()


def test_level_crossing_interpolates_in_log_log():
    da = xr.DataArray([0.01, 0.1, 1.0, 10.0], coords={"x": [0.0, 10.0, 100.0, 1000.0]}, dims="x", name="e")
    assert float(study.level_crossing(da, "x", 1.0)) == pytest.approx(100.0)
    assert float(study.level_crossing(da, "x", 3.1622776601683795)) == pytest.approx(316.227766, rel=1e-6)
    assert np.isnan(float(study.level_crossing(da, "x", 100.0)))


def test_regimes_have_tied_maxima_and_offsets():
    q, k, v, do, mu = study.regime_operands("tied_max_negative_v", 64, 16, seed=0, n_ties=4)
    scores = q @ k.transpose(-1, -2)
    top = scores.max(dim=-1, keepdim=True).values
    assert ((scores == top).sum(-1) >= 4).all()  # every row's maximum is repeated
    assert float(v.mean()) < -0.5 and float(mu.abs().sum()) == 0
    _, _, _, _, mu = study.regime_operands("key_offset", 64, 16, seed=0, mu_norm=50.0)
    assert float(mu.norm()) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="regime"):
        study.regime_operands("ties", 64, 16, seed=0)
