"""A CUDA run's results must record accelerator_versions (README: torch, CUDA, cuDNN, Triton, GPU, driver):
the writer refuses them otherwise, before any file or folder is made; committed GPU runs written before the
attribute existed are still read."""
import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from attnum import ncio, runs

OUTPUTS = Path(__file__).resolve().parents[2] / "outputs"
H200 = {"torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": "91900", "triton": "3.6.0", "gpu": "NVIDIA H200",
        "gpu_capability": "9.0", "driver": "580.159.04"}


def _ds() -> xr.Dataset:
    return xr.Dataset({"err": ("seq_len", np.array([1e-3, 2e-3]), {"units": "1", "long_name": "error"})},
                      coords={"seq_len": [64, 128]})


def _fake_gpu(monkeypatch, versions):
    """This CPU machine as a CUDA one for the writer: accelerator_versions and the device description faked."""
    monkeypatch.setattr(ncio, "accelerator_versions", lambda device="cpu": dict(versions))
    monkeypatch.setattr(ncio, "device_description", lambda device="cpu": "cuda:0 NVIDIA H200 (CUDA 13.0)")


def test_a_cuda_run_with_its_accelerator_versions_is_written_and_reads_them_back(tmp_path, monkeypatch):
    _fake_gpu(monkeypatch, H200)
    path = ncio.write_results(_ds(), tmp_path / "run" / "results.nc", study="t", params={"device": "cuda"},
                              device="cuda")
    assert json.loads(ncio.open_results(path).attrs["accelerator_versions"]) == H200


@pytest.mark.parametrize("versions,named", [
    ({**H200, "gpu": "none"}, "names no gpu"),
    ({**H200, "cuda": "none", "gpu": "none"}, "names no cuda and no gpu"),
    ({k: v for k, v in H200.items() if k != "driver"}, "lacks ['driver']"),
    ({}, "lacks ['torch', 'cuda', 'cudnn', 'triton', 'gpu', 'gpu_capability', 'driver']"),
])
def test_a_cuda_run_whose_accelerator_versions_name_no_gpu_is_refused_and_nothing_is_written(tmp_path, monkeypatch,
                                                                                          versions, named):
    _fake_gpu(monkeypatch, versions)
    target = tmp_path / "run" / "results.nc"
    with pytest.raises(ncio.ProvenanceError) as exc:
        ncio.write_results(_ds(), target, study="t", params={"device": "cuda"}, device="cuda")
    assert named in str(exc.value) and "Nothing was written" in str(exc.value)
    assert not target.parent.exists() and list(tmp_path.iterdir()) == []


def test_a_cuda_run_without_the_attribute_is_refused(tmp_path, monkeypatch):
    """provenance() without accelerator_versions at all (as the writer's attributes looked before it existed)."""
    real = ncio.provenance

    def without(*args, **kwargs):
        attrs = real(*args, **kwargs)
        attrs.pop("accelerator_versions")
        return attrs

    monkeypatch.setattr(ncio, "provenance", without)
    with pytest.raises(ncio.ProvenanceError, match="lack the accelerator_versions attribute"):
        ncio.write_results(_ds(), tmp_path / "run" / "results.nc", study="t", params={}, device="cuda:0")
    assert list(tmp_path.iterdir()) == []


def test_on_a_machine_without_cuda_a_cuda_run_is_refused(tmp_path):
    """Here torch sees no CUDA device: accelerator_versions('cuda') names gpu 'none', so the write is refused."""
    import torch

    assert not torch.cuda.is_available()
    with pytest.raises(ncio.ProvenanceError, match="names no cuda and no gpu"):
        ncio.write_results(_ds(), tmp_path / "x" / "results.nc", study="t", params={}, device="cuda")
    assert list(tmp_path.iterdir()) == []


def test_an_earlier_results_file_is_left_as_it_was_when_a_rewrite_is_refused(tmp_path, monkeypatch):
    path = ncio.write_results(_ds(), tmp_path / "results.nc", study="t", params={}, device="cpu")
    before = path.read_bytes()
    _fake_gpu(monkeypatch, {**H200, "gpu": "none"})
    with pytest.raises(ncio.ProvenanceError):
        ncio.write_results(_ds() * 2, path, study="t", params={}, device="cuda")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["results.nc"]


def test_a_cpu_run_needs_no_gpu(tmp_path):
    path = ncio.write_results(_ds(), tmp_path / "results.nc", study="t", params={}, device="cpu")
    versions = json.loads(ncio.open_results(path).attrs["accelerator_versions"])
    assert versions["gpu"] == "none" and set(ncio.ACCELERATOR_KEYS) <= set(versions)


def _committed_gpu_runs():
    out = []
    # study runs only: outputs/report/<name>/ holds kernel reports, recorded in REPORT.json rather than RUN.json
    for results in sorted(p for study in runs.studies() for p in (OUTPUTS / study).glob("*/results.nc")):
        with xr.open_dataset(results, engine=ncio.ENGINE) as ds:
            if "cuda" in str(ds.attrs.get("device", "")).lower():
                out.append((results.parent.parent.name, results.parent.name, "accelerator_versions" in ds.attrs))
    return out


def test_committed_gpu_runs_read_with_and_without_the_attribute():
    """The refusal is the writer's: every committed run made on a CUDA device still verifies and opens, those
    written before accelerator_versions existed included, and the ones that have it name a GPU."""
    gpu_runs = _committed_gpu_runs()
    assert {has for _, _, has in gpu_runs} == {True, False}  # both kinds are committed
    for study, name, has in gpu_runs:
        ds = ncio.committed_run(study, name, root=OUTPUTS)
        assert ds is not None and ds.attrs["run"] == f"{study}/{name}"
        if has:
            ncio.check_accelerator_provenance(ds.attrs, "cuda")  # what the writer would have accepted
        else:
            with pytest.raises(ncio.ProvenanceError):
                ncio.check_accelerator_provenance(ds.attrs, "cuda")
