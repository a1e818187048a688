"""The one NetCDF writer and reader of every study, with provenance and integrity checks.

Writer (``write_results``): NETCDF4 through the netcdf4 engine (named explicitly),
a Fletcher-32 checksum on every variable that has a dimension (HDF5 stores 0-d
variables contiguously, where no filter applies: those are covered by the
run's sha256, see below), zlib level 4 on every numeric one, and CF metadata
applied in one place from the study's table (``variables=`` name -> (units,
long_name)): every data variable needs ``units`` and ``long_name``, every
coordinate gets a ``long_name`` (the table's, else ``COORDINATE_LONG_NAMES``'s for
the names every study shares, also under a prefix such as ``real_seq_len``, else
the coordinate's own name), a boolean variable is stored as a CF flag (int8 0/1
with ``flag_values``/``flag_meanings``) and read back as booleans, so that
``sel(causal=True)`` works after the round trip, and a
unit UDUNITS does not know (``ulp``, ``1/step``, ``FLOP``) is written as "1"
with the unit named in the ``long_name``. The file declares CF-1.11, the
newest convention the IOOS compliance checker knows; int64 is a CF data type
since CF-1.9, so integer coordinates are kept exactly as computed. Global
attributes record the study, its parameters (JSON; ``output_dir`` as the run's
logical folder ``<study>/<run>``, never a temporary path), git commit and dirty
flag, package versions, device and creation time, and ``accelerator_versions``
(torch, CUDA, cuDNN, Triton, GPU, driver): a run on a CUDA device whose
``accelerator_versions`` names no GPU is refused before anything is written
(``check_accelerator_provenance``; committed GPU runs written before the
attribute existed are still read). Writes are atomic: a
temporary file in the same folder, fsync, then ``os.replace``.

Run records: each run folder holds ``RUN.json`` (written by the runner, or by
``runner.start`` for a JupyterLab run) with the sha256 of ``results.nc`` and of
``notebook.ipynb`` and a checksum of the record itself. ``verify_run`` checks
them; a damaged run raises ``DamagedRunError`` naming the run and what is wrong.

Reader: ``open_study`` opens the runs of a study that belong together (one
group: a single run, or the points of one sweep; ``study_groups`` lists them),
skips damaged runs with a ``DamagedRunWarning`` naming each, and merges the
rest with ``combine_by_coords``; scalar sweep parameters are stored as
length-1 dimensions (``sweep_dims``) so that runs of a sweep line up, and each
run's parameters survive the merge as the ``run_parameters`` variable.
"""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import math
import os
import platform
import re
import socket
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import xarray as xr

from .paths import UnsafePathError, git_state, open_own_file, outputs_root, pointer_target, project_root  # noqa: F401
from .versions import accelerator_versions  # noqa: F401  (ncio.accelerator_versions: provenance)

ENGINE = "netcdf4"
CONVENTIONS = "CF-1.11"
RECORD = "RUN.json"
PACKAGES = ("attnum", "torch", "numpy", "scipy", "xarray", "netCDF4", "pandas", "matplotlib", "seaborn",
            "papermill")
# Units UDUNITS does not know, written as "1" with the unit named in the long_name (used when cf_units,
# which asks UDUNITS itself, is not installed).
NON_UDUNITS = {"ulp": "units in the last place", "1/step": "per optimizer step", "FLOP": "floating-point operations",
               "flop": "floating-point operations", "FLOPs": "floating-point operations", "nat": "nats"}
# long_names of the coordinates every study shares; ``<prefix>_<name>`` (``real_seq_len``, ``block_seed``)
# gets the same description with its experiment named: "sequence length N (real experiments)".
COORDINATE_LONG_NAMES = {"seq_len": "sequence length N", "head_dim": "head dimension d", "seed": "random seed",
                         "layer": "transformer block (layer index)"}
BOOLEAN_FLAGS = "false true"  # CF flag_meanings of a boolean stored as int8 0/1
FINISHED = ("ok", "lab")  # RUN.json states of a run whose results may be read
MAX_RECORD_BYTES = 16 * 2**20  # a RUN.json larger than this is no record the runner wrote
# Decoded size above which a results file is refused before any value is loaded: a few MB of zlib can
# hold GiBs of zeros (a compression bomb). The largest committed run decodes to a few MB; override
# with $ATTNUM_MAX_RESULTS_BYTES for larger runs of one's own.
MAX_RESULTS_BYTES = 2**30
FIGURE_NAME = re.compile(r"[A-Za-z0-9_.@=,+-]+\.png")  # figures the site publishes; anything else is damage


class DamagedRunError(RuntimeError):
    """A run whose files are missing, truncated or do not match their recorded checksums."""


class DamagedRunWarning(UserWarning):
    """A damaged run was skipped (the message names it and says what is wrong)."""


class ProvenanceError(ValueError):
    """Results that must not be written: their provenance lacks what the README promises (nothing is written)."""


ACCELERATOR_KEYS = ("torch", "cuda", "cudnn", "triton", "gpu", "gpu_capability", "driver")  # versions.accelerator_versions


def check_accelerator_provenance(attrs: dict, device: str = "cpu") -> None:
    """Refuse (``ProvenanceError``) the attributes of a run on a CUDA device (``device``, or the recorded
    ``device`` description) unless ``accelerator_versions`` names what decides its kernels: JSON holding
    every key of ``ACCELERATOR_KEYS``, with a CUDA version and a GPU (not "none"). A CPU run needs none.

    Results written before the attribute existed (some committed GPU runs) are read as they are: this
    check is the writer's, never the reader's."""
    if not (str(device).startswith("cuda") or "cuda" in str(attrs.get("device", "")).lower()):
        return
    raw = attrs.get("accelerator_versions")
    try:
        versions = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        versions = None
    where = f"a run on {device!r}" + (f" ({attrs['device']})" if attrs.get("device") else "")
    if not isinstance(versions, dict):
        raise ProvenanceError(f"refusing to write the results of {where}: they lack the accelerator_versions "
                              "attribute (torch, CUDA, cuDNN, Triton, GPU, driver: what decides a GPU kernel's "
                              f"numbers); got {raw!r}. Nothing was written")
    missing = [k for k in ACCELERATOR_KEYS if k not in versions]
    absent = [k for k in ("cuda", "gpu") if str(versions.get(k, "none")) in ("none", "", "unknown")]
    if missing or absent:
        raise ProvenanceError(f"refusing to write the results of {where}: accelerator_versions "
                              + (f"lacks {missing}" if missing else f"names no {' and no '.join(absent)}")
                              + f" ({raw}); a CUDA run records the GPU it ran on (is CUDA visible to torch "
                              "here?). Nothing was written")


# -- provenance --

def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def real_kernel_backends(names) -> dict[str, str]:
    """Each kernel name's ``runs_as``: the backend or compiled kernel that computes its results (for a
    pinned SDPA backend, the one backend allowed to run; a call it refused raised instead)."""
    from . import kernels

    out = {}
    for name in names:
        try:
            out[str(name)] = kernels.get(str(name)).runs_as()
        except Exception as exc:  # noqa: BLE001 - a name the registry cannot build is recorded as such
            out[str(name)] = f"not built here: {type(exc).__name__}: {exc}"
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


def logical_run_path(folder: str | os.PathLike, root: str | os.PathLike | None = None) -> str:
    """``<study>/<run>`` of a run folder: what a run is called, wherever its files are staged.

    A versioned run folder ``<root>/<study>/.versions/<run>/<version>`` maps to
    ``<study>/<run>``; another folder under the outputs root to its path relative
    to the root; a folder elsewhere to its last two path parts.
    """
    folder = Path(folder).absolute()
    parts = folder.parts
    if ".versions" in parts:
        i = len(parts) - 1 - parts[::-1].index(".versions")
        if i >= 1 and i + 1 < len(parts):
            return f"{parts[i - 1]}/{parts[i + 1]}"
    try:
        base = Path(root).absolute() if root else outputs_root()
        return folder.relative_to(base).as_posix()
    except (ValueError, RuntimeError):
        return "/".join(p for p in parts[-2:] if p != folder.anchor)


def provenance(study: str, params: dict, device: str = "cpu") -> dict[str, str]:
    """Global attributes that tie a results file to what made it."""
    attrs = {
        "Conventions": CONVENTIONS,
        "study": study,
        "parameters": json.dumps(params, sort_keys=True, default=str),
        "device": device_description(device),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "package_versions": json.dumps(package_versions(), sort_keys=True),
        "accelerator_versions": json.dumps(accelerator_versions(device), sort_keys=True),
    }
    attrs.update(git_state())
    attrs["history"] = f"{attrs['created']}: written by attnum.ncio.write_results ({attrs['git_commit']})"
    return attrs


# -- CF metadata --

def describe(ds: xr.Dataset, *tables: dict[str, tuple[str, str]]) -> xr.Dataset:
    """Set CF ``units`` and ``long_name`` of every data variable from ``name -> (units, long_name)`` tables.

    Variables that already carry both keep them; the first table naming a
    variable wins. A variable no table names is an error, named.
    (``write_results(..., variables=table)`` does the same in the writer.)
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


@functools.lru_cache(maxsize=256)
def udunits_knows(units: str) -> bool:
    """Whether UDUNITS parses ``units`` (through cf_units when installed, else a list of known misses)."""
    try:
        import cf_units
    except ImportError:
        return units not in NON_UDUNITS
    try:
        cf_units.Unit(units)
    except (ValueError, TypeError):
        return False
    return True


def _cf_metadata(ds: xr.Dataset, variables: dict | None) -> xr.Dataset:
    """Apply the study's table, default coordinate long_names and UDUNITS-safe units (in place)."""
    table = dict(variables or {})
    for name, var in ds.data_vars.items():
        if name in table and not {"units", "long_name"} <= set(var.attrs):
            units, long_name = table[name]
            var.attrs.setdefault("units", units)
            var.attrs.setdefault("long_name", long_name)
    check_cf(ds)
    for name, var in ds.coords.items():
        if "long_name" not in var.attrs and "standard_name" not in var.attrs:
            var.attrs["long_name"] = table[name][1] if name in table else coordinate_long_name(name)
        if name in table and "units" not in var.attrs and var.dtype.kind in "iuf":
            var.attrs["units"] = table[name][0]
    for name, var in ds.variables.items():
        units = var.attrs.get("units")
        if units is None:
            continue
        if var.dtype.kind not in "iufcmM":  # strings and booleans (flags) carry no units in CF
            if units in ("1", ""):
                del var.attrs["units"]
            continue
        if not udunits_knows(str(units)):
            what = NON_UDUNITS.get(str(units), str(units))
            var.attrs["units"] = "1"
            long_name = var.attrs.get("long_name", f"variable {name}")
            if str(units) not in long_name:
                var.attrs["long_name"] = f"{long_name} (counted in {what}, {units})"
    return ds


def coordinate_long_name(name: str) -> str:
    """The ``long_name`` of a coordinate the study's table does not describe: ``COORDINATE_LONG_NAMES``'s
    (``seq_len`` -> "sequence length N"; ``real_seq_len`` -> "sequence length N (real experiments)"), else
    the name itself."""
    if name in COORDINATE_LONG_NAMES:
        return COORDINATE_LONG_NAMES[name]
    for common, long_name in COORDINATE_LONG_NAMES.items():
        prefix = name[:-len(common) - 1]
        if name.endswith("_" + common) and prefix:
            return f"{long_name} ({prefix.replace('_', ' ')} experiments)"
    return name


def _boolean_flags(ds: xr.Dataset) -> None:
    """Mark every boolean variable as a CF flag (xarray stores it as int8 0/1); ``open_results`` reads it back
    as booleans, so a coordinate such as ``causal`` is selected with ``sel(causal=True)`` after the round trip."""
    for var in ds.variables.values():
        if var.dtype == np.bool_:
            var.attrs.update(flag_values=np.array([0, 1], dtype=np.int8), flag_meanings=BOOLEAN_FLAGS)
            var.attrs.pop("units", None)


def _booleans_back(ds: xr.Dataset) -> xr.Dataset:
    """Integer 0/1 variables marked as boolean flags (``flag_meanings`` "false true": written by
    ``_boolean_flags``, where a tool copying the file dropped xarray's own ``dtype`` mark) as booleans."""
    for name, var in list(ds.variables.items()):
        if var.dtype.kind in "iu" and str(var.attrs.get("flag_meanings", "")) == BOOLEAN_FLAGS:
            values = np.asarray(var.values)
            if np.isin(values, (0, 1)).all():
                converted = var.copy(data=values.astype(bool))
                if name in ds.indexes:
                    ds = ds.assign_coords({name: converted})
                else:
                    ds[name] = converted
    return ds


def _sanitized(params: dict) -> dict:
    """Parameters as recorded: ``output_dir`` is the run's logical folder, not where it was staged."""
    params = dict(params)
    if params.get("output_dir"):
        params["output_dir"] = logical_run_path(params["output_dir"])
    return params


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_results(ds: xr.Dataset, path: str | os.PathLike, *, study: str, params: dict,
                  sweep_dims=(), device: str = "cpu", title: str | None = None,
                  references: str | None = None, variables: dict | None = None) -> Path:
    """Write ``ds`` atomically to ``path`` with provenance and checksums. Returns the final path.

    ``variables``: the study's table ``name -> (units, long_name)`` for data variables
    and coordinates that do not carry them yet. ``sweep_dims`` names scalar parameters
    to add as length-1 dimensions so that ``xr.open_mfdataset(..., combine="by_coords")``
    merges the runs of a sweep.
    """
    path = Path(path)
    ds = ds.copy()
    for var in ds.variables.values():  # copies of the attributes: the caller's dataset is left as it was
        var.attrs = dict(var.attrs)
    params = _sanitized(params)
    for key in sweep_dims:
        if key not in params:
            raise ValueError(f"sweep dimension {key!r} is not a parameter; parameters: {sorted(params)}")
        if key in ds.dims:
            raise ValueError(f"sweep dimension {key!r} is already a dimension of the results")
        ds = ds.expand_dims({key: [params[key]]})
        described = (variables or {}).get(key, (None, None))[1] or COORDINATE_LONG_NAMES.get(key)
        ds[key].attrs.setdefault("long_name", f"parameter {key}" + (f": {described}" if described else ""))
    _cf_metadata(ds, variables)
    _boolean_flags(ds)
    ds.attrs.update(provenance(study, params, device))
    check_accelerator_provenance(ds.attrs, device)  # before any file or folder is made
    if "real_kernel" in ds.coords:
        ds.attrs["real_kernel_backends"] = json.dumps(real_kernel_backends(ds["real_kernel"].values), sort_keys=True)
    ds.attrs["sweep_dims"] = json.dumps(list(sweep_dims))
    ds.attrs["title"] = title or ds.attrs.get("title") or f"attnum study {study}"
    if references:
        ds.attrs["references"] = references
    ds.attrs["source"] = f"attnum study {study}"

    encoding = {}
    for name, var in ds.variables.items():
        if var.ndim == 0:
            continue  # contiguous in HDF5: no filter applies (the run's sha256 covers it)
        enc = {"fletcher32": True}
        if np.issubdtype(var.dtype, np.number) and var.dtype != np.bool_:
            enc.update(zlib=True, complevel=4)
        encoding[name] = enc
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        ds.to_netcdf(tmp, engine=ENGINE, format="NETCDF4", encoding=encoding)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()
    _note_lab_results(path)
    return path


# -- run records and checksums --

def _read_own(folder: Path, name: str, max_bytes: int | None = None) -> bytes:
    """A run's own file, read without following a link at ``name``, never blocking on a FIFO."""
    with os.fdopen(open_own_file(folder, Path(folder) / name, max_bytes=max_bytes), "rb") as fh:
        return fh.read()


def _own_sha256(folder: Path, name: str) -> str:
    digest = hashlib.sha256()
    with os.fdopen(open_own_file(folder, Path(folder) / name), "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def figure_hashes(folder: str | os.PathLike) -> dict[str, str]:
    """sha256 of every figure (``*.png``) of a run folder, by file name (recorded in ``RUN.json``)."""
    folder = Path(folder)
    return {p.name: _own_sha256(folder, p.name) for p in sorted(folder.glob("*.png"))}


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def record_checksum(record: dict) -> str:
    """sha256 of the record's canonical JSON without its own ``checksum`` entry."""
    body = {k: v for k, v in record.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def write_record(folder: str | os.PathLike, record: dict) -> Path:
    """Write ``RUN.json`` atomically (temporary file, fsync, ``os.replace``) with its own checksum."""
    folder = Path(folder)
    record = dict(record)
    record["checksum"] = record_checksum(record)
    text = json.dumps(record, indent=2, default=str)
    tmp = folder / f".{RECORD}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, folder / RECORD)
    finally:
        if tmp.exists():
            tmp.unlink()
    return folder / RECORD


def read_record(folder: str | os.PathLike) -> dict:
    """The run's ``RUN.json``, checked; ``DamagedRunError`` if missing, unreadable or altered."""
    folder = Path(folder)
    try:
        record = json.loads(_read_own(folder, RECORD, MAX_RECORD_BYTES).decode())
    except FileNotFoundError:
        raise DamagedRunError(f"run {_run_label(folder)}: {RECORD} is missing") from None
    except UnsafePathError as exc:
        raise DamagedRunError(f"run {_run_label(folder)}: {RECORD} is refused ({exc})") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DamagedRunError(f"run {_run_label(folder)}: {RECORD} cannot be read ({exc})") from None
    if not isinstance(record, dict):
        raise DamagedRunError(f"run {_run_label(folder)}: {RECORD} does not hold a record")
    if "checksum" not in record:
        raise DamagedRunError(f"run {_run_label(folder)}: {RECORD} has no checksum (not a record the runner wrote)")
    if record["checksum"] != record_checksum(record):
        raise DamagedRunError(f"run {_run_label(folder)}: {RECORD} does not match its checksum")
    return record


def _run_label(folder: Path) -> str:
    return logical_run_path(folder)


def verify_run(folder: str | os.PathLike, *, require_record: bool = True) -> dict:
    """Check a finished run's files against its record; returns the record (``{}`` if none and allowed).

    Raises ``DamagedRunError`` naming the run when ``RUN.json`` is missing (unless
    ``require_record`` is false), truncated or altered, when ``results.nc`` or
    ``notebook.ipynb`` is missing or does not match its recorded sha256. A finished
    run's record must hold ``results_sha256`` and its own ``checksum``: a run whose
    record lost them (or whose record was deleted, with ``require_record``) is damaged.
    Figures: with ``figures_sha256`` recorded, every ``*.png`` of the folder must be one
    of them, unchanged, and each must be there; records written before figure hashes
    (the committed runs) have ``record["figures_verified"]`` false. Every file is
    opened without following a link and never blocks (a FIFO or a folder in a file's
    place is damage, named).
    """
    folder = Path(folder)
    try:
        if not os.path.lexists(folder / RECORD) and not require_record:
            if not (folder / "results.nc").exists():
                raise DamagedRunError(f"run {_run_label(folder)}: results.nc is missing")
            return {"verified": False, "figures_verified": False}
        record = read_record(folder)
        if record.get("status") in FINISHED:
            _verify_files(folder, record)
    except PermissionError as exc:
        raise DamagedRunError(f"run {_run_label(folder)}: cannot be read ({exc})") from None
    record["verified"] = bool(record.get("results_sha256"))
    record["figures_verified"] = isinstance(record.get("figures_sha256"), dict)
    return record


def _verify_files(folder: Path, record: dict) -> None:
    label = _run_label(folder)
    if not os.path.lexists(folder / "results.nc"):
        raise DamagedRunError(f"run {label}: results.nc is missing")
    if not record.get("results_sha256"):
        raise DamagedRunError(f"run {label}: {RECORD} records no results_sha256 (not a record the runner wrote)")
    for name, key in (("results.nc", "results_sha256"), ("notebook.ipynb", "notebook_sha256")):
        if record.get(key):
            _check_hash(folder, name, record[key], label)
    figures = record.get("figures_sha256")
    if figures is None:
        return
    if not isinstance(figures, dict):
        raise DamagedRunError(f"run {label}: figures_sha256 in {RECORD} is not a table of file names")
    present = sorted(p.name for p in folder.glob("*.png"))
    extra = [n for n in present if n not in figures]
    if extra:
        raise DamagedRunError(f"run {label}: figure(s) {extra} were not written by the run (not in {RECORD})")
    for name, digest in figures.items():
        if not FIGURE_NAME.fullmatch(str(name)):
            raise DamagedRunError(f"run {label}: figure name {name!r} holds characters other than letters, digits "
                                  "and _ . @ = , + -")
        _check_hash(folder, name, digest, label)


def _check_hash(folder: Path, name: str, digest: str, label: str) -> None:
    try:
        actual = _own_sha256(folder, name)
    except FileNotFoundError:
        raise DamagedRunError(f"run {label}: {name} is missing") from None
    except UnsafePathError as exc:
        raise DamagedRunError(f"run {label}: {name} is refused ({exc})") from None
    if actual != digest:
        raise DamagedRunError(f"run {label}: {name} does not match its sha256 in {RECORD} (truncated or altered)")


def _note_lab_results(path: Path) -> None:
    """A JupyterLab run (RUN.json status "lab") records the checksum of the results it wrote."""
    folder = path.parent
    if path.name != "results.nc" or not (folder / RECORD).exists():
        return
    try:
        record = read_record(folder)
    except DamagedRunError:
        return
    if record.get("status") == "lab":
        record.update(results_sha256=file_sha256(path),
                      finished=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        write_record(folder, record)


# -- reading --

def open_results(path: str | os.PathLike, squeeze_sweep_dims: bool = False) -> xr.Dataset:
    """Open one results file fully into memory (the file is closed afterwards).

    Reading every value checks the Fletcher-32 checksums; a truncated or damaged
    file raises ``DamagedRunError`` naming it. ``squeeze_sweep_dims`` turns the
    length-1 sweep dimensions back into scalar coordinates, so a notebook reads
    its own results the same way inside and outside a sweep.
    """
    import stat

    st = os.stat(path)  # FileNotFoundError as such
    if not stat.S_ISREG(st.st_mode):
        raise DamagedRunError(f"{path}: not a regular file (a folder, FIFO or device); cannot be read")
    limit = int(os.environ.get("ATTNUM_MAX_RESULTS_BYTES") or MAX_RESULTS_BYTES)
    try:
        with xr.open_dataset(path, engine=ENGINE) as ds:  # lazy: nothing decoded yet
            decoded = sum(int(v.size) * v.dtype.itemsize for v in ds.variables.values())
            if decoded > limit:
                raise DamagedRunError(f"{path}: its variables decode to {decoded} bytes, more than the {limit} "
                                      "a results file may hold (a compression bomb?); set "
                                      "$ATTNUM_MAX_RESULTS_BYTES to read a larger run of your own")
            ds = ds.load()
    except FileNotFoundError:
        raise
    except DamagedRunError:
        raise
    except MemoryError:
        raise DamagedRunError(f"{path}: does not fit in memory when decoded") from None
    except (OSError, RuntimeError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise DamagedRunError(f"{path}: cannot be read, damaged or truncated ({type(exc).__name__}: {exc})") from None
    ds = _booleans_back(ds)
    if squeeze_sweep_dims:
        ds = ds.squeeze(json.loads(ds.attrs.get("sweep_dims", "[]")))
    return ds


def boolean_coordinates(ds: xr.Dataset | None, names) -> xr.Dataset | None:
    """``ds`` with each coordinate of ``names`` that a run wrote as 0/1 integers (runs made before booleans
    were written as CF flags) read as booleans, so ``sel(name=True)`` works on old and new runs alike; any other
    integer there is refused. None stays None."""
    if ds is None:
        return None
    for name in names:
        if name in ds.coords and ds[name].dtype.kind in "iu":
            values = ds[name].values
            if not np.isin(values, (0, 1)).all():
                raise ValueError(f"coordinate {name} holds {values.tolist()}, not the 0/1 of a yes/no coordinate")
            ds = ds.assign_coords({name: (ds[name].dims, values.astype(bool), ds[name].attrs)})
    return ds


def _match_key(value):
    """A coordinate value as ``compare_results`` matches it: booleans as 0/1."""
    return int(value) if isinstance(value, (bool, np.bool_)) else value


def compare_results(a, b) -> list[dict]:
    """Two results files, run folders or Datasets, variable by variable, over the coordinate values both have:
    per variable ``status`` ("equal": the same values, NaN where NaN; "differs"; "only in a"/"only in b";
    "shape": dimensions that do not match; "nothing shared": no coordinate value in common, so nothing
    was compared) and, where numbers differ, ``max_rel_diff`` (largest
    |a - b| / |a| where both are finite and a is non-zero), ``differing`` (the fraction of elements that
    differ) and ``nan_in_one`` (the fraction that is NaN in one file only).
    What two runs of one tier have in common, and where they part, as data."""
    def opened(x):
        if not isinstance(x, (str, os.PathLike)):
            return x
        path = Path(x)
        return open_results(path / "results.nc" if path.is_dir() else path)

    da, db = opened(a), opened(b)
    rows = []
    for name in sorted(set(da.data_vars) | set(db.data_vars)):
        if name not in db or name not in da:
            rows.append({"variable": name, "status": "only in a" if name in da else "only in b"})
            continue
        x, y = da[name], db[name]
        if set(x.dims) != set(y.dims):
            rows.append({"variable": name, "status": "shape"})
            continue
        for dim in x.dims:
            if dim in x.coords and dim in y.coords:
                # matched by position, not by label: a list of booleans given to ``sel`` is read as a mask, and
                # a boolean coordinate of one run meets the 0/1 integers of a run written before booleans were
                xs = [_match_key(v) for v in x[dim].values]
                ys = {_match_key(v): i for i, v in enumerate(y[dim].values)}
                ix = [i for i, v in enumerate(xs) if v in ys]
                x, y = x.isel({dim: ix}), y.isel({dim: [ys[xs[i]] for i in ix]})
        y = y.transpose(*x.dims)
        xv, yv = x.values, y.values
        if xv.size == 0 and (da[name].size or db[name].size):
            # no coordinate value in common (e.g. two sweep points): nothing was compared, which is no equality
            rows.append({"variable": name, "status": "nothing shared"})
            continue
        if xv.shape != yv.shape:
            rows.append({"variable": name, "status": "shape"})
            continue
        numeric = xv.dtype.kind in "fiub" and yv.dtype.kind in "fiub"
        same = (np.isclose(xv, yv, rtol=0, atol=0, equal_nan=True) if numeric and xv.dtype.kind == "f"
                else xv == yv)
        row = {"variable": name, "status": "equal" if bool(np.all(same)) else "differs",
               "differing": float(1 - np.mean(same)) if same.size else 0.0}
        if numeric and not np.all(same):
            xf, yf = xv.astype(float), yv.astype(float)
            ok = np.isfinite(xf) & np.isfinite(yf) & (xf != 0)
            row["max_rel_diff"] = float(np.max(np.abs(xf[ok] - yf[ok]) / np.abs(xf[ok]))) if ok.any() else math.nan
            row["nan_in_one"] = float(np.mean(np.isnan(xf) != np.isnan(yf)))
        rows.append(row)
    return rows


def run_folders(study: str, root: str | os.PathLike | None = None) -> list[Path]:
    """Run folders of a study that may hold finished results (not hidden, not ``.failed``)."""
    base = (Path(root) if root else outputs_root()) / study
    if not base.is_dir() or base.is_symlink():
        return []
    return sorted(p for p in base.iterdir()
                  if not p.name.startswith(".") and not p.name.endswith(".failed") and _own_run_folder(p))


def _own_run_folder(p: Path) -> bool:
    """A plain folder, or a run pointer to a version of its own (never a link planted elsewhere), that
    holds results or a record; one that cannot be read is listed (reading it names the damage)."""
    if p.is_symlink() and pointer_target(p.parent, p.name) is None:
        return False
    if not p.is_dir():
        return False
    for name in ("results.nc", RECORD):
        try:
            os.lstat(p / name)  # os.path.lexists would answer False for a folder it may not read
            return True
        except FileNotFoundError:
            continue
        except OSError:
            return True
    return False


def study_runs(study: str, root: str | os.PathLike | None = None) -> list[Path]:
    """``results.nc`` of every finished (not failed, not in-progress) run of a study (unverified)."""
    out = []
    for folder in run_folders(study, root):
        try:
            if (folder / "FAILED").exists() or not os.path.lexists(folder / "results.nc"):
                continue
            status = read_record(folder).get("status", "ok")
        except (DamagedRunError, OSError, ValueError, AttributeError):
            status = "damaged"  # listed: reading it reports the damage by name
        if status in FINISHED or status == "damaged":
            out.append(folder / "results.nc")
    return out


def group_label(name: str, sweep_dims=()) -> str:
    """The group of a run: its own name, or ``<set and fixed overrides>@<swept keys>`` for a sweep point."""
    sweep_dims = sorted(sweep_dims or ())
    if not sweep_dims:
        return name
    if "@" in name:
        base = name.split("@", 1)[0]
    else:  # folders of sweeps made before the "@" marker
        base = "__".join(p for p in name.split("__") if p.split("=", 1)[0] not in sweep_dims)
    return f"{base}@{','.join(sweep_dims)}"


def _run_sweep_dims(folder: Path) -> list[str]:
    import stat

    try:
        return list(read_record(folder).get("sweep_dims", []))
    except (DamagedRunError, OSError, ValueError, AttributeError, TypeError):
        pass
    try:  # a damaged record: the group its results file says (read lazily; a FIFO or folder is never opened)
        if not stat.S_ISREG(os.lstat(folder / "results.nc").st_mode):
            return []
        with xr.open_dataset(folder / "results.nc", engine=ENGINE) as ds:
            return json.loads(ds.attrs.get("sweep_dims", "[]"))
    except PermissionError:  # an unreadable folder: the swept keys its name holds (``<set>@key=value,...``)
        return re.findall(r"(?:^|,)([A-Za-z_][A-Za-z0-9_]*)=", folder.name.split("@", 1)[1]) if "@" in folder.name else []
    except (OSError, RuntimeError, ValueError, TypeError):
        return []


def study_groups(study: str, root: str | os.PathLike | None = None) -> dict[str, list[str]]:
    """Group label -> run folder names: runs that belong together (one run, or one sweep's points)."""
    groups: dict[str, list[str]] = {}
    for results in study_runs(study, root):
        folder = results.parent
        groups.setdefault(group_label(folder.name, _run_sweep_dims(folder)), []).append(folder.name)
    return groups


def _with_run_parameters(ds: xr.Dataset, name: str) -> xr.Dataset:
    """Carry the run's name and parameters as variables along its sweep dimensions."""
    dims = [d for d in json.loads(ds.attrs.get("sweep_dims", "[]")) if d in ds.dims]
    shape = tuple(ds.sizes[d] for d in dims)
    ds = ds.copy()
    ds["run_parameters"] = (dims, np.full(shape, ds.attrs.get("parameters", "{}"), dtype=object))
    ds["run_parameters"].attrs["long_name"] = "parameters of the run (JSON)"
    ds["run_name"] = (dims, np.full(shape, name, dtype=object))
    ds["run_name"].attrs["long_name"] = "run folder"
    return ds


def open_study(study: str, root: str | os.PathLike | None = None, runs=None, group: str | None = None) -> xr.Dataset:
    """The runs of a study that belong together, merged by coordinates.

    ``group``: a label of ``study_groups`` (a single run's name, or ``<set>@<swept keys>``
    for the points of one sweep). Without it: the only group there is, else the group of
    the ``default`` run, else ``ValueError`` listing the groups. ``runs``: names of run
    folders to merge instead (any runs that line up). Damaged runs are skipped with a
    ``DamagedRunWarning`` naming each; the result's attributes ``runs`` and
    ``skipped_runs`` say what was merged and what was not, and ``run_parameters``
    keeps each run's parameters.
    """
    where = Path(root) if root else outputs_root()
    groups = study_groups(study, root)
    if runs is not None:
        names, label = [n for g in groups.values() for n in g if n in set(runs)], "selected runs"
        missing = sorted(set(runs) - set(names))
        if missing:
            raise FileNotFoundError(f"no finished run(s) {missing} of study {study!r} under {where}")
    elif group is not None:
        if group not in groups:
            raise KeyError(f"study {study!r} has no group {group!r}; groups: {groups}")
        names, label = groups[group], group
    elif len(groups) == 1:
        label, names = next(iter(groups.items()))
    elif "default" in groups:
        label, names = "default", groups["default"]
    elif not groups:
        names, label = [], ""
    else:
        raise ValueError(f"study {study!r} has {len(groups)} groups of runs that do not belong together: "
                         f"{groups}; pass group=<label> (or runs=[...])")
    if not names:
        raise FileNotFoundError(f"no finished runs of study {study!r} under {where}")
    datasets, merged, skipped = [], [], {}
    for name in sorted(names):
        folder = where / study / name
        try:
            verify_run(folder)  # a run without its record, or without its hashes, is damaged
            datasets.append(_with_run_parameters(open_results(folder / "results.nc"), name))
            merged.append(name)
        except (DamagedRunError, OSError) as exc:
            skipped[name] = str(exc)
            warnings.warn(f"skipping damaged run {study}/{name}: {exc}", DamagedRunWarning, stacklevel=2)
    if not datasets:
        raise DamagedRunError(f"every run of group {label!r} of study {study!r} is damaged: {skipped}")
    try:
        out = xr.combine_by_coords(datasets, combine_attrs="drop_conflicts", data_vars="all",
                                   coords="different", compat="no_conflicts", join="outer")
    except ValueError as exc:
        raise ValueError(f"runs {merged} of {study!r} do not line up by coordinates "
                         f"({exc}); pass runs=[...] to pick runs that differ only in swept parameters") from exc
    out.attrs.update(group=label, runs=json.dumps(merged), skipped_runs=json.dumps(skipped))
    return out


def committed_run(study: str, name: str = "gpu", *, root: str | os.PathLike | None = None,
                  squeeze_sweep_dims: bool = True) -> xr.Dataset | None:
    """The one loader of a finished run of this checkout: ``<outputs>/<study>/<name>/results.nc``, where
    ``<outputs>`` is ``root`` or ``paths.outputs_root()`` (``$ATTNUM_OUTPUTS`` when set).

    Returns None when the run is absent; checks the run against its ``RUN.json`` first
    (``verify_run``, so a damaged run raises ``DamagedRunError`` naming it, never silently feeds a
    notebook) and records where it came from in ``attrs["run"]`` (``<study>/<name>``). Callers that
    need a particular kind of run (a CUDA device, certain variables) test the returned Dataset."""
    if not re.fullmatch(r"[A-Za-z0-9_.@=,+-]+", str(name)):
        raise ValueError(f"run name {name!r} may hold only letters, digits and _ . @ = , + -")
    folder = Path(root if root is not None else outputs_root()) / study / name
    if not (folder / "results.nc").exists():
        return None
    verify_run(folder)
    ds = open_results(folder / "results.nc", squeeze_sweep_dims=squeeze_sweep_dims)
    ds.attrs["run"] = f"{study}/{name}"
    return ds
