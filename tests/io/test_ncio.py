import json

import numpy as np
import pytest
import xarray as xr

from attnum import ncio


def _dataset(value=1.0):
    ds = xr.Dataset({"rel_l2_err": (("seq_len", "seed"), np.full((3, 2), value))},
                    coords={"seq_len": [128, 256, 512], "seed": [0, 1]})
    ds["rel_l2_err"].attrs.update(units="1", long_name="relative L2 error")
    return ds


def test_round_trip_keeps_values_and_provenance(tmp_path):
    ds = _dataset(0.25)
    ds["rel_l2_err"][1, 0] = np.nan
    params = {"seq_lens": [128, 256, 512], "device": "cpu"}
    path = ncio.write_results(ds, tmp_path / "results.nc", study="length_scaling", params=params)
    back = ncio.open_results(path)
    np.testing.assert_array_equal(back["rel_l2_err"].values, ds["rel_l2_err"].values)
    assert back["rel_l2_err"].attrs["units"] == "1" and back["rel_l2_err"].attrs["long_name"]
    assert json.loads(back.attrs["parameters"]) == params
    assert back.attrs["study"] == "length_scaling" and back.attrs["Conventions"].startswith("CF")
    versions = json.loads(back.attrs["package_versions"])
    assert versions["torch"].startswith("2.") and versions["xarray"]
    assert len(back.attrs["git_commit"]) in (40, 7) and back.attrs["git_dirty"] in ("true", "false", "unknown")
    for key in ("device", "created", "hostname"):
        assert back.attrs[key]
    # the versions that decide what a GPU kernel computes; on this CPU torch has no CUDA and no GPU
    import torch

    accel = json.loads(back.attrs["accelerator_versions"])
    assert set(accel) == {"torch", "cuda", "cudnn", "triton", "gpu", "gpu_capability", "driver"}
    assert accel["torch"] == torch.__version__ and accel["gpu"] == "none" and accel["driver"] == "none"
    assert accel["cuda"] == str(torch.version.cuda or "none")
    assert "real_kernel_backends" not in back.attrs  # no real kernel in these results


def test_results_with_real_kernels_record_the_backend_each_ran_as(tmp_path):
    ds = _dataset().expand_dims(real_kernel=["sdpa:flash", "sdpa:math", "triton:fa2:gproj_dq", "flex"])
    ds["real_kernel"].attrs.update(units="1", long_name="real kernel")
    path = ncio.write_results(ds, tmp_path / "results.nc", study="length_scaling", params={})
    backends = json.loads(ncio.open_results(path).attrs["real_kernel_backends"])
    assert list(backends) == ["flex", "sdpa:flash", "sdpa:math", "triton:fa2:gproj_dq"]
    assert "SDPBackend.FLASH_ATTENTION the only backend enabled" in backends["sdpa:flash"]
    assert "SDPBackend.MATH the only backend enabled" in backends["sdpa:math"]
    assert "GProj dq" in backends["triton:fa2:gproj_dq"] and "flex_attention compiled" in backends["flex"]
    with xr.open_dataset(path, engine="netcdf4") as raw:
        assert raw["rel_l2_err"].encoding.get("zlib") is True


def test_missing_cf_attributes_are_refused(tmp_path):
    ds = _dataset()
    ds["bare"] = ("seed", [1.0, 2.0])
    with pytest.raises(ValueError, match="bare lacks 'units'"):
        ncio.write_results(ds, tmp_path / "r.nc", study="s", params={})
    assert not (tmp_path / "r.nc").exists()


def test_interrupted_write_leaves_no_file_at_the_final_path(tmp_path, monkeypatch):
    final = tmp_path / "results.nc"

    def broken(self, path, *args, **kwargs):
        with open(path, "wb") as fh:  # a partial file, then the "crash"
            fh.write(b"CDF\x01partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(xr.Dataset, "to_netcdf", broken)
    with pytest.raises(KeyboardInterrupt):
        ncio.write_results(_dataset(), final, study="s", params={})
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone too


def test_interrupted_rewrite_keeps_the_previous_file(tmp_path, monkeypatch):
    final = ncio.write_results(_dataset(1.0), tmp_path / "results.nc", study="s", params={})
    monkeypatch.setattr(xr.Dataset, "to_netcdf", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        ncio.write_results(_dataset(2.0), final, study="s", params={})
    monkeypatch.undo()
    assert float(ncio.open_results(final)["rel_l2_err"][0, 0]) == 1.0


def test_sweep_runs_merge_by_coordinates(tmp_path):
    for head_dim in (32, 64):
        run = tmp_path / "length_scaling" / f"default__head_dim={head_dim}"
        ncio.write_results(_dataset(head_dim / 1000), run / "results.nc", study="length_scaling",
                           params={"head_dim": head_dim}, sweep_dims=["head_dim"])
        ncio.write_record(run, {"status": "ok", "sweep_dims": ["head_dim"],
                                "results_sha256": ncio.file_sha256(run / "results.nc")})
    merged = ncio.open_study("length_scaling", root=tmp_path)
    assert merged["rel_l2_err"].dims == ("head_dim", "seq_len", "seed")
    assert merged["head_dim"].values.tolist() == [32, 64]
    assert float(merged["rel_l2_err"].sel(head_dim=64)[0, 0]) == pytest.approx(0.064)
    paths = ncio.study_runs("length_scaling", root=tmp_path)
    with xr.open_mfdataset(paths, combine="by_coords", engine="netcdf4") as mf:
        assert mf.sizes["head_dim"] == 2
    with pytest.raises(ValueError, match="not a parameter"):
        ncio.write_results(_dataset(), tmp_path / "x.nc", study="s", params={}, sweep_dims=["head_dim"])


def test_open_study_skips_failed_runs_and_names_missing_ones(tmp_path):
    ok = tmp_path / "st" / "default"
    ncio.write_results(_dataset(), ok / "results.nc", study="st", params={})
    bad = tmp_path / "st" / "smoke.failed"
    ncio.write_results(_dataset(5.0), bad / "results.nc", study="st", params={})
    (bad / "FAILED").write_text("boom")
    assert ncio.study_runs("st", root=tmp_path) == [ok / "results.nc"]
    with pytest.raises(FileNotFoundError, match="nothing"):
        ncio.open_study("nothing", root=tmp_path)


def test_a_sweep_run_reads_back_like_a_plain_run(tmp_path):
    path = ncio.write_results(_dataset(0.5), tmp_path / "r.nc", study="s", params={"head_dim": 32},
                              sweep_dims=["head_dim"])
    assert ncio.open_results(path)["rel_l2_err"].dims == ("head_dim", "seq_len", "seed")
    squeezed = ncio.open_results(path, squeeze_sweep_dims=True)
    assert squeezed["rel_l2_err"].dims == ("seq_len", "seed") and int(squeezed["head_dim"]) == 32


def test_describe_fills_cf_attributes_and_names_what_it_cannot():
    ds = xr.Dataset({"a": ("x", [1.0]), "b": ("x", [2.0])})
    ds["b"].attrs.update(units="s", long_name="kept")
    ncio.describe(ds, {"a": ("1", "first")}, {"a": ("m", "second")})
    assert ds["a"].attrs == {"units": "1", "long_name": "first"} and ds["b"].attrs["long_name"] == "kept"
    with pytest.raises(KeyError, match=r"\['c'\]"):
        ncio.describe(xr.Dataset({"c": ("x", [0.0])}), {"a": ("1", "first")})


def test_commit_can_be_given_where_there_is_no_git_history(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNUM_GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.setenv("ATTNUM_GIT_DIRTY", "false")
    back = ncio.open_results(ncio.write_results(_dataset(), tmp_path / "r.nc", study="s", params={}))
    assert back.attrs["git_commit"].startswith("0123456789") and back.attrs["git_dirty"] == "false"


def test_compare_results_names_what_differs_over_the_shared_coordinates(tmp_path, capsys):
    from attnum.cli import main

    a = _dataset(0.25)
    a["status"] = (("seq_len",), np.array(["ok", "ok", "refused"], dtype=object))
    a["only_a"] = (("seed",), np.zeros(2))
    b = a.drop_vars("only_a").copy(deep=True)
    b = xr.concat([b, b.isel(seq_len=[0]).assign_coords(seq_len=[1024])], "seq_len")  # b has one more length
    b["rel_l2_err"].loc[dict(seq_len=256, seed=1)] = 0.25 * (1 + 1e-3)
    b["rel_l2_err"].loc[dict(seq_len=512, seed=0)] = np.nan
    b["only_b"] = (("seed",), np.ones(2))
    rows = {r["variable"]: r for r in ncio.compare_results(a, b)}
    err = rows["rel_l2_err"]
    assert err["status"] == "differs" and err["max_rel_diff"] == pytest.approx(1e-3)
    assert err["differing"] == pytest.approx(2 / 6) and err["nan_in_one"] == pytest.approx(1 / 6)
    assert rows["status"]["status"] == "equal"  # only the lengths both have are compared
    assert rows["only_a"]["status"] == "only in a" and rows["only_b"]["status"] == "only in b"
    assert ncio.compare_results(a, a.copy(deep=True))[0]["status"] == "equal"
    # the command line, on files
    for name, ds in (("a", a), ("b", b)):
        ds = ds.drop_vars(["status", "only_a", "only_b"], errors="ignore")
        ncio.write_results(ds, tmp_path / f"{name}.nc", study="length_scaling", params={})
    assert main(["compare", str(tmp_path / "a.nc"), str(tmp_path / "b.nc")]) == 0
    out = capsys.readouterr().out
    assert "rel_l2_err: differs, 33.3% of elements differ, max relative difference 0.001, 16.7% NaN in one" in out
    assert main(["compare", str(tmp_path / "a.nc"), str(tmp_path / "missing.nc")]) == 2


def test_compare_results_with_no_shared_coordinate_compares_nothing(tmp_path):
    """Two sweep points (head_dim 32 and 64) share no value of the swept dimension: nothing is compared,
    which must not read as equal; a run folder is read as its results.nc."""
    a = xr.Dataset({"err": (("head_dim", "n"), np.ones((1, 3)))}, coords={"head_dim": [32], "n": [1, 2, 3]})
    b = xr.Dataset({"err": (("head_dim", "n"), np.ones((1, 3)))}, coords={"head_dim": [64], "n": [1, 2, 3]})
    assert [r["status"] for r in ncio.compare_results(a, b)] == ["nothing shared"]
    folder = tmp_path / "run"
    folder.mkdir()
    a.to_netcdf(folder / "results.nc")
    assert [r["status"] for r in ncio.compare_results(folder, a)] == ["equal"]


def test_compare_results_matches_boolean_coordinates_whole_and_against_the_old_0_1_form():
    """A boolean coordinate is compared at every value (a list of booleans given to ``sel`` would be a mask,
    comparing the True entries only), and a run written with 0/1 integers lines up with one written with
    booleans."""
    err = np.array([[1.0, 2.0], [3.0, 4.0]])
    new = xr.Dataset({"err": (("causal", "n"), err)}, coords={"causal": [False, True], "n": [1, 2]})
    other = new.copy(deep=True)
    other["err"][0, 0] = 9.0  # differs only where causal is False
    row = ncio.compare_results(new, other)[0]
    assert row["status"] == "differs" and row["differing"] == 0.25
    old = xr.Dataset({"err": (("causal", "n"), err[::-1])}, coords={"causal": [1, 0], "n": [1, 2]})
    assert ncio.compare_results(old, new)[0]["status"] == "equal"
    assert ncio.compare_results(new, old)[0]["status"] == "equal"


def test_compare_command_exits_non_zero_when_nothing_is_shared(tmp_path, capsys):
    from attnum.cli import main

    for name, dim in (("a", 32), ("b", 64)):
        ds = xr.Dataset({"err": (("head_dim", "n"), np.ones((1, 3)), {"units": "1", "long_name": "error"})},
                        coords={"head_dim": [dim], "n": [1, 2, 3]})
        (tmp_path / name).mkdir()
        ncio.write_results(ds, tmp_path / name / "results.nc", study="length_scaling", params={})
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "a")]) == 0


# -- coordinates: their long_names, and booleans that survive the round trip --

def test_a_boolean_coordinate_is_selected_by_true_and_false_after_the_round_trip(tmp_path):
    import netCDF4

    ds = xr.Dataset({"err": (("causal", "seq_len"), np.array([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])),
                     "passed": (("seq_len",), np.array([True, False, True]))},
                    coords={"causal": [False, True], "seq_len": [128, 256, 512]})
    table = {"err": ("1", "relative L2 error"), "passed": ("1", "acceptance verdict"),
             "causal": ("1", "causal mask (bottom-right aligned)")}
    path = ncio.write_results(ds, tmp_path / "results.nc", study="length_scaling", params={}, variables=table)
    with netCDF4.Dataset(path) as raw:  # stored as a CF flag: int8 0/1 with its meanings
        assert raw["causal"].dtype == np.int8 and raw["causal"][:].tolist() == [0, 1]
        assert raw["causal"].flag_meanings == "false true" and raw["causal"].flag_values.tolist() == [0, 1]
    back = ncio.open_results(path)
    assert back["causal"].dtype == np.bool_ and back["passed"].dtype == np.bool_
    assert back["err"].sel(causal=True).values.tolist() == [10.0, 20.0, 30.0]
    assert back["err"].sel(causal=False, seq_len=256).item() == 2.0
    assert back["passed"].values.tolist() == [True, False, True]
    assert back["causal"].attrs["long_name"] == "causal mask (bottom-right aligned)"


def test_a_flagged_0_1_integer_written_by_another_tool_is_read_as_booleans(tmp_path):
    ds = xr.Dataset({"err": (("causal",), [1.0, 10.0])}, coords={"causal": np.array([0, 1], dtype=np.int8)})
    ds["causal"].attrs.update(flag_values=np.array([0, 1], dtype=np.int8), flag_meanings="false true")
    ds["err"].attrs.update(units="1", long_name="error")
    ds.to_netcdf(tmp_path / "other.nc", engine="netcdf4")  # an int8 variable, no xarray boolean mark
    back = ncio.open_results(tmp_path / "other.nc")
    assert back["causal"].dtype == np.bool_ and back["err"].sel(causal=True).item() == 10.0
    plain = xr.Dataset({"err": (("mode",), [1.0, 10.0])}, coords={"mode": np.array([0, 1], dtype=np.int8)})
    plain.to_netcdf(tmp_path / "plain.nc", engine="netcdf4")  # 0/1 without the flag: integers it stays
    assert ncio.open_results(tmp_path / "plain.nc")["mode"].dtype.kind == "i"


def test_every_coordinate_gets_a_meaningful_long_name_and_plots_label_with_it(tmp_path):
    from xarray.plot.utils import label_from_attrs

    ds = xr.Dataset({"err": (("seq_len", "real_seq_len", "block_seed", "variant"), np.ones((2, 2, 1, 1)))},
                    coords={"seq_len": [128, 256], "real_seq_len": [64, 128], "block_seed": [0], "variant": ["a"]})
    table = {"err": ("1", "relative L2 error"), "variant": ("1", "emulator variant")}
    path = ncio.write_results(ds, tmp_path / "results.nc", study="length_scaling", params={"head_dim": 32},
                              sweep_dims=["head_dim"], variables=table)
    back = ncio.open_results(path)
    names = {name: back[name].attrs["long_name"] for name in back.coords}
    assert names == {"seq_len": "sequence length N", "real_seq_len": "sequence length N (real experiments)",
                     "block_seed": "random seed (block experiments)", "variant": "emulator variant",
                     "head_dim": "parameter head_dim: head dimension d"}
    assert label_from_attrs(back["seq_len"]) == "sequence length N"  # what xarray's .plot() puts on the axis
    assert ncio.coordinate_long_name("fidelity_config") == "fidelity_config"  # no description: its own name
    assert ncio.coordinate_long_name("seed") == "random seed" and ncio.coordinate_long_name("_seed") == "_seed"
