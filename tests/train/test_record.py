"""attnum.train.record: one schema for every run; the committed records of the old corpus layout read in it."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from conftest import without_triton_interpreter

from attnum import ncio
from attnum.train import TrainConfig, record, train

ROOT = Path(__file__).parents[2]
RECORDS = sorted((ROOT / "outputs" / "lm" / "records").glob("lm_*.nc"))
GATHERED = sorted((ROOT / "outputs").glob("*/gpu_training/results.nc"))
FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}

_no_interpreter = pytest.fixture(scope="module", autouse=True)(without_triton_interpreter)


def _raw(path):
    with xr.open_dataset(path, engine=ncio.ENGINE) as ds:
        return ds.load()


def test_the_committed_records_exist():
    assert len(RECORDS) >= 18 and len(GATHERED) == 2


@pytest.mark.parametrize("path", RECORDS, ids=[p.stem for p in RECORDS])
def test_a_committed_record_of_the_old_layout_loads_in_the_one_schema(path):
    raw, ds = _raw(path), record.open_record(path)
    assert "grad_norm_layer" in raw and "grad_norm_layer" not in ds  # the old layout, converted
    assert ds["grad_norm"].dims == ("member", "step", "layer") and ds["grad_norm_total"].dims == ("member", "step")
    np.testing.assert_array_equal(ds["grad_norm"].values, raw["grad_norm_layer"].values)
    np.testing.assert_array_equal(ds["grad_norm_total"].values, raw["grad_norm"].values)
    for name in set(raw.data_vars) - {"grad_norm", "grad_norm_layer"}:
        np.testing.assert_array_equal(ds[name].values, raw[name].values, err_msg=name)
    old, new = json.loads(raw.attrs["parameters"]), json.loads(ds.attrs["parameters"])
    assert new["data"] == "corpus" and set(new) <= FIELDS
    assert (new["grad_clip"], new["warmup_steps"], new["autocast"]) == (old["clip"], old["warmup"], old["amp"])
    assert ds.attrs["record_converted_from"] == "corpus record (old layout)"
    assert record.convert(ds) is ds  # today's schema: unchanged


def test_the_committed_records_gather_in_the_one_schema():
    ds = record.gather(ROOT / "outputs" / "lm" / "records")
    assert ds.sizes["run"] == len(RECORDS) and "grad_norm_layer" not in ds
    params = [json.loads(str(p)) for p in ds["run_parameters"].values]
    assert all(p["data"] == "corpus" and "clip" not in p for p in params)
    raw = {p.stem: json.loads(_raw(p).attrs["parameters"]) for p in RECORDS}
    assert [p["grad_clip"] for p in params] == [raw[str(r)]["clip"] for r in ds["run"].values]
    summary = record.summary(ds)
    np.testing.assert_array_equal(summary["max_grad_norm"].values,
                                  ds["grad_norm_total"].isel(step=slice(1, None)).max("step").values)


def old_layout(ds: xr.Dataset) -> xr.Dataset:
    """A gathered run in today's schema written back in the corpus trainer's old layout (the inverse of
    ``record.convert``): per-block ``grad_norm`` as ``grad_norm_layer``, ``grad_norm_total`` as ``grad_norm``,
    the runs' parameters under their old names."""
    names = {"grad_norm_total": "grad_norm"}
    if "grad_norm" in ds and "layer" in ds["grad_norm"].dims:
        names["grad_norm"] = "grad_norm_layer"
    ds = ds.rename({n: f"_{n}" for n in names}).rename({f"_{n}": m for n, m in names.items()})
    back = {new: old for old, new in record.OLD_PARAMETERS.items()}
    params = [json.dumps({back.get(k, k): v for k, v in json.loads(str(p)).items() if k != "data"}, sort_keys=True)
              for p in ds["run_parameters"].values]
    return ds.assign_coords(run_parameters=(ds["run_parameters"].dims, np.array(params, dtype=object)))


@pytest.mark.parametrize("path", GATHERED, ids=[p.parts[-3] for p in GATHERED])
def test_a_committed_gpu_training_run_is_in_the_one_schema_and_the_old_layout_converts_to_it(path):
    raw = ncio.open_results(path)
    assert record.convert(raw) is raw and "grad_norm_layer" not in raw and "grad_norm_total" in raw
    params = [json.loads(str(p)) for p in np.ravel(raw["run_parameters"].values)]
    assert params and all(p["data"] == "corpus" and "grad_clip" in p for p in params)
    old = old_layout(raw)
    assert "grad_clip" not in str(old["run_parameters"].values[0])
    ds = record.convert(old)
    assert ds.attrs["record_converted_from"] == "corpus record (old layout)" and "grad_norm_layer" not in ds
    for name in ("grad_norm", "grad_norm_total"):
        if name in raw:
            np.testing.assert_array_equal(ds[name].values, raw[name].values)
            assert ds[name].dims == raw[name].dims
    assert [json.loads(str(p)) for p in ds["run_parameters"].values] == \
        [record.convert_parameters(json.loads(str(p))) for p in raw["run_parameters"].values]
    assert ds.attrs["parameters"] == raw.attrs["parameters"]  # the study's own parameters are not a trainer's


def test_convert_parameters_is_idempotent():
    old = {"clip": 0.5, "warmup": 7, "amp": "off", "pair_amp": "fp16", "min_lr": 1e-5, "lr": 1e-3}
    new = record.convert_parameters(old)
    assert new == {"data": "corpus", "grad_clip": 0.5, "warmup_steps": 7, "autocast": "off",
                   "pair_autocast": "fp16", "lr": 1e-3}
    assert record.convert_parameters(new) == new


def test_a_new_record_round_trips_its_config(tmp_path):
    cfg = TrainConfig.byte_lm(n_layer=1, n_head=2, d_model=16, context=16, batch_size=4, steps=6, log_every=3,
                              eval_every=3, snapshot_every=3, corpus_max_bytes=2_000_000, val_windows=4, diag_batch=2,
                              sketch_size=8, device="cpu", time_attention=False, pair=True, pair_seed=1, tag="rt")
    result = train(cfg, out_dir=tmp_path, progress=False)
    ds = record.open_record(result.path)
    assert "record_converted_from" not in ds.attrs and record.convert(ds) is ds
    assert TrainConfig(**json.loads(ds.attrs["parameters"])) == cfg  # the record states the whole config
    assert set(ds.data_vars) <= set(record.VARIABLES) | {"weight_sketch"}
    assert ds["grad_norm"].dims == ("member", "step", "layer") and ds["grad_norm_total"].dims == ("member", "step")
    assert list(ds["step"].values) == [0, 3, 6] and list(ds["member_seed"].values) == [0, 1]
    # the same configuration again: the same bits (CPU)
    again = record.open_record(train(cfg, out_dir=tmp_path / "again", progress=False).path)
    for name in ("loss", "val_loss", "grad_norm", "grad_norm_total", "dq_rel_err", "weight_sketch", "pair_w1"):
        np.testing.assert_array_equal(ds[name].values, again[name].values, err_msg=name)
