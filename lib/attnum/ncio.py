"""The one NetCDF writer and reader of every study, with provenance.

Writer: NETCDF4 through the netcdf4 engine (named explicitly), zlib level 4 on
every numeric variable, CF-style ``units`` and ``long_name`` required on every
data variable, global attributes recording the study, its parameters (JSON),
git commit and dirty flag, package versions, device and creation time. Writes
are atomic: a temporary file in the same folder, then ``os.replace``.

Reader: ``open_study`` opens every finished run of a study and merges them with
``combine="by_coords"``; scalar sweep parameters are stored as length-1
dimensions (``sweep_dims``) so that runs of a sweep line up.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import numpy as np
import xarray as xr

from .paths import outputs_root, project_root

ENGINE = "netcdf4"
PACKAGES = ("attnum", "torch", "numpy", "scipy", "xarray", "netCDF4", "pandas", "matplotlib", "seaborn",
            "papermill")


def git_state(root: Path | None = None) -> dict[str, str]:
    """Commit hash and dirty flag of the project checkout ("unknown" outside git).

    ``$ATTNUM_GIT_COMMIT`` (and ``$ATTNUM_GIT_DIRTY``) stand in where the code runs
    from a copy of the tree without its git history, e.g. on a lent GPU machine.
    """
    if os.environ.get("ATTNUM_GIT_COMMIT"):
        return {"git_commit": os.environ["ATTNUM_GIT_COMMIT"],
                "git_dirty": os.environ.get("ATTNUM_GIT_DIRTY", "unknown")}
    try:
        root = root or project_root()
    except RuntimeError:
        return {"git_commit": "unknown", "git_dirty": "unknown"}

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"git_commit": "unknown", "git_dirty": "unknown"}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"git_commit": head.stdout.strip(), "git_dirty": str(bool(dirty.stdout.strip())).lower()}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "git_dirty": "unknown"}


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def device_description(device: str = "cpu") -> str:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        return f"cuda:{idx} {torch.cuda.get_device_name(idx)} (CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {cpu}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}"


def provenance(study: str, params: dict, device: str = "cpu") -> dict[str, str]:
    """Global attributes that tie a results file to what made it."""
    attrs = {
        "Conventions": "CF-1.8",
        "study": study,
        "parameters": json.dumps(params, sort_keys=True, default=str),
        "device": device_description(device),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "package_versions": json.dumps(package_versions(), sort_keys=True),
    }
    attrs.update(git_state())
    attrs["history"] = f"{attrs['created']}: written by attnum.ncio.write_results ({attrs['git_commit']})"
    return attrs


def describe(ds: xr.Dataset, *tables: dict[str, tuple[str, str]]) -> xr.Dataset:
    """Set CF ``units`` and ``long_name`` of every data variable from ``name -> (units, long_name)`` tables.

    Variables that already carry both keep them; the first table naming a
    variable wins. A variable no table names is an error, named.
    """
    missing = []
    for name, var in ds.data_vars.items():
        if {"units", "long_name"} <= set(var.attrs):
            continue
        entry = next((t[name] for t in tables if name in t), None)
        if entry is None:
            missing.append(name)
            continue
        var.attrs.update(units=entry[0], long_name=entry[1])
    if missing:
        raise KeyError(f"no units/long_name for data variable(s) {missing}")
    return ds


def check_cf(ds: xr.Dataset) -> None:
    missing = [f"{name} lacks {attr!r}" for name, var in ds.data_vars.items()
               for attr in ("units", "long_name") if attr not in var.attrs]
    if missing:
        raise ValueError("every data variable needs CF 'units' and 'long_name': " + "; ".join(missing))


def write_results(ds: xr.Dataset, path: str | os.PathLike, *, study: str, params: dict,
                  sweep_dims=(), device: str = "cpu", title: str | None = None,
                  references: str | None = None) -> Path:
    """Write ``ds`` atomically to ``path`` with provenance. Returns the final path.

    ``sweep_dims`` names scalar parameters to add as length-1 dimensions so
    that ``xr.open_mfdataset(..., combine="by_coords")`` merges the runs of a sweep.
    """
    check_cf(ds)
    path = Path(path)
    ds = ds.copy()
    for key in sweep_dims:
        if key not in params:
            raise ValueError(f"sweep dimension {key!r} is not a parameter; parameters: {sorted(params)}")
        if key in ds.dims:
            raise ValueError(f"sweep dimension {key!r} is already a dimension of the results")
        ds = ds.expand_dims({key: [params[key]]})
        ds[key].attrs.setdefault("long_name", f"parameter {key}")
    ds.attrs.update(provenance(study, params, device))
    ds.attrs["sweep_dims"] = json.dumps(list(sweep_dims))
    if title:
        ds.attrs["title"] = title
    if references:
        ds.attrs["references"] = references
    ds.attrs["source"] = f"attnum study {study}"

    encoding = {}
    for name, var in ds.variables.items():
        if np.issubdtype(var.dtype, np.number) and var.ndim > 0 and var.dtype != np.bool_:
            encoding[name] = {"zlib": True, "complevel": 4}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        ds.to_netcdf(tmp, engine=ENGINE, format="NETCDF4", encoding=encoding)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def open_results(path: str | os.PathLike, squeeze_sweep_dims: bool = False) -> xr.Dataset:
    """Open one results file fully into memory (the file is closed afterwards).

    ``squeeze_sweep_dims`` turns the length-1 sweep dimensions back into scalar
    coordinates, so a notebook reads its own results the same way inside and
    outside a sweep.
    """
    with xr.open_dataset(path, engine=ENGINE) as ds:
        ds = ds.load()
    if squeeze_sweep_dims:
        ds = ds.squeeze(json.loads(ds.attrs.get("sweep_dims", "[]")))
    return ds


def study_runs(study: str, root: str | os.PathLike | None = None) -> list[Path]:
    """``results.nc`` of every finished (not failed, not in-progress) run of a study."""
    base = Path(root) if root else outputs_root()
    return sorted(p for p in (base / study).glob("*/results.nc")
                  if not p.parent.name.startswith(".") and not (p.parent / "FAILED").exists())


def open_study(study: str, root: str | os.PathLike | None = None, runs=None) -> xr.Dataset:
    """Every run of a study merged by coordinates (``runs``: names of run folders to keep)."""
    paths = study_runs(study, root)
    if runs is not None:
        paths = [p for p in paths if p.parent.name in set(runs)]
    if not paths:
        raise FileNotFoundError(f"no finished runs of study {study!r} under {Path(root) if root else outputs_root()}")
    try:
        return xr.combine_by_coords([open_results(p) for p in paths], combine_attrs="drop_conflicts",
                                    data_vars="all", coords="different", compat="no_conflicts",
                                    join="outer")
    except ValueError as exc:
        raise ValueError(f"runs {[p.parent.name for p in paths]} of {study!r} do not line up by coordinates "
                         f"({exc}); pass runs=[...] to pick runs that differ only in swept parameters") from exc
