"""Run study notebooks through papermill, with checked parameters.

A study is a notebook ``notebooks/NN_<study>.ipynb`` whose first code cell is
tagged ``parameters``; ``params/<study>/`` holds named parameter sets
(``smoke.yaml``, ``default.yaml``, ``full.yaml``, ...) and ``schema.yaml``,
the allowed values of every parameter the notebook declares.

``run`` checks every parameter before anything is written (unknown key, wrong
type, value out of range: ``ParameterError`` naming the key and what is
allowed), executes the notebook in a staging folder, and only on success
swaps it in as ``outputs/<study>/<run-name>/``. A failed or interrupted run
leaves the earlier results in place and becomes ``<run-name>.failed/`` with a
``FAILED`` file saying why.
"""
from __future__ import annotations

import datetime as _dt
import itertools
import json
import os
import re
import shutil
import time
import traceback
from pathlib import Path

import yaml

from .paths import notebooks_dir, outputs_root, params_dir

# Parameters every study notebook declares; the runner sets output_dir and sweep_dims itself.
COMMON_PARAMETERS = ("device", "output_dir", "sweep_dims")
RUNNER_SET = ("output_dir", "sweep_dims")
TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list": list}


class ParameterError(ValueError):
    """A parameter set that must not run: names the key and what is allowed."""


class RunError(RuntimeError):
    """The notebook failed while running; its folder was marked failed."""


# -- studies and their declared parameters --

def studies() -> dict[str, Path]:
    """Study name -> notebook path, from ``notebooks/NN_<name>.ipynb``."""
    out = {}
    for path in sorted(notebooks_dir().glob("[0-9][0-9]_*.ipynb")):
        out[path.stem[3:]] = path
    return out


def notebook_path(study: str) -> Path:
    known = studies()
    if study not in known:
        raise ParameterError(f"unknown study {study!r}; studies: {sorted(known)}")
    return known[study]


def declared_parameters(study: str) -> dict[str, dict]:
    """Name -> {type, default, help} as papermill reads the notebook's parameters cell."""
    import papermill

    info = papermill.inspect_notebook(str(notebook_path(study)))
    return {name: {"type": p["inferred_type_name"], "default": p["default"], "help": p["help"]}
            for name, p in info.items()}


def schema(study: str) -> dict[str, dict]:
    path = params_dir() / study / "schema.yaml"
    if not path.exists():
        raise ParameterError(f"study {study!r} has no parameter schema at {path}")
    return yaml.safe_load(path.read_text()) or {}


def parameter_names(study: str) -> list[str]:
    """The parameters a study declares (its schema's keys, kept equal to the notebook's by a test)."""
    return list(schema(study))


def param_sets(study: str) -> list[str]:
    return sorted(p.stem for p in (params_dir() / study).glob("*.yaml") if p.stem != "schema")


def load_param_set(study: str, name: str) -> dict:
    path = params_dir() / study / f"{name}.yaml"
    if not path.exists():
        raise ParameterError(f"study {study!r} has no parameter set {name!r}; sets: {param_sets(study)}")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ParameterError(f"{path} must hold a mapping of parameter names to values")
    return values


# -- checking values --

def parse_value(text: str):
    """A command-line value, read as YAML: ``3`` -> int, ``[1, 2]`` -> list, ``cpu`` -> str."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ParameterError(f"cannot read value {text!r}: {exc}") from None


def _type_ok(value, type_name: str) -> bool:
    if type_name == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, TYPES[type_name])


def _check_scalar(key: str, value, rule: dict, what: str = "") -> None:
    where = f"parameter {key!r}{what}"
    choices = rule.get("choices")
    if choices is not None and value not in choices:
        raise ParameterError(f"{where}: {value!r} is not allowed; allowed values: {choices}")
    lo, hi = rule.get("min"), rule.get("max")
    if lo is not None and value < lo or hi is not None and value > hi:
        raise ParameterError(f"{where}: {value!r} is out of range; allowed: {lo} <= value <= {hi}")
    if rule.get("pattern") and not re.fullmatch(rule["pattern"], str(value)):
        raise ParameterError(f"{where}: {value!r} does not match {rule['pattern']!r}"
                             + (f" ({rule['pattern_help']})" if rule.get("pattern_help") else ""))
    if rule.get("power_of_two") and (value < 1 or value & (value - 1)):
        raise ParameterError(f"{where}: {value!r} must be a power of two")


def check_parameters(study: str, values: dict) -> None:
    """Raise ``ParameterError`` unless every key is declared, well typed and in range."""
    declared = declared_parameters(study)
    rules = schema(study)
    for key, value in values.items():
        if key not in declared:
            raise ParameterError(f"unknown parameter {key!r} for study {study!r}; "
                                 f"allowed parameters: {sorted(declared)}")
        type_name = rules.get(key, {}).get("type", declared[key]["type"])
        if type_name not in TYPES:
            raise ParameterError(f"parameter {key!r} has no checkable type ({type_name!r}); "
                                 "annotate it in the notebook and in schema.yaml")
        if not _type_ok(value, type_name):
            raise ParameterError(f"parameter {key!r} must be of type {type_name}, "
                                 f"got {type(value).__name__} {value!r}")
        rule = rules.get(key, {})
        if type_name == "list":
            if "min_len" in rule and len(value) < rule["min_len"]:
                raise ParameterError(f"parameter {key!r} needs at least {rule['min_len']} entries, got {value!r}")
            item_rule = rule.get("item", {})
            for i, item in enumerate(value):
                item_type = item_rule.get("type")
                if item_type and not _type_ok(item, item_type):
                    raise ParameterError(f"parameter {key!r}[{i}] must be of type {item_type}, "
                                         f"got {type(item).__name__} {item!r}")
                _check_scalar(key, item, item_rule, f"[{i}]")
        else:
            _check_scalar(key, value, rule)


def resolve_parameters(study: str, param_set: str = "default", overrides: dict | None = None) -> dict:
    """Parameter set plus overrides, checked. Raises ``ParameterError`` before anything runs."""
    notebook_path(study)  # an unknown study is named first
    values = dict(load_param_set(study, param_set))
    values.update(overrides or {})
    bad = sorted(set(values) & set(RUNNER_SET))
    if bad:
        raise ParameterError(f"parameter(s) {bad} are set by the runner, not by parameter sets or -p")
    check_parameters(study, values)
    return values


def run_name(param_set: str, overrides: dict | None = None) -> str:
    """Folder name of a run: the set name, then ``__key=value`` for each override, sorted."""
    parts = [param_set]
    for key, value in sorted((overrides or {}).items()):
        text = json.dumps(value, separators=(",", ":")) if not isinstance(value, str) else value
        parts.append(f"{key}={text}")
    name = "__".join(parts)
    return re.sub(r"[^A-Za-z0-9_.=,+-]", "", name.replace("[", "").replace("]", "").replace('"', ""))


# -- running --

def _swap_in(staging: Path, final: Path) -> None:
    trash = None
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, trash)
    os.replace(staging, final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _mark_failed(staging: Path, final: Path, error: str) -> Path:
    failed = final.with_name(final.name + ".failed")
    if failed.exists():
        shutil.rmtree(failed)
    (staging / "FAILED").write_text(error)
    os.replace(staging, failed)
    return failed


def run(study: str, param_set: str = "default", overrides: dict | None = None, *,
        outputs: str | os.PathLike | None = None, sweep_dims=(), progress: bool = True,
        name: str | None = None, timeout: int | None = None) -> Path:
    """Execute one study notebook; returns the finished run folder."""
    import papermill

    values = resolve_parameters(study, param_set, overrides)
    nb_path = notebook_path(study)
    name = name or run_name(param_set, overrides)
    base = Path(outputs).resolve() if outputs else outputs_root()
    final = base / study / name
    staging = base / study / f".{name}.running-{os.getpid()}-{int(time.time())}"
    staging.mkdir(parents=True)
    record = {"study": study, "param_set": param_set, "overrides": overrides or {}, "parameters": values,
              "sweep_dims": list(sweep_dims), "notebook": nb_path.name,
              "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    injected = dict(values, output_dir=str(staging), sweep_dims=list(sweep_dims))
    try:
        papermill.execute_notebook(str(nb_path), str(staging / "notebook.ipynb"), parameters=injected,
                                   progress_bar=progress, cwd=str(nb_path.parent), kernel_name="python3",
                                   execution_timeout=timeout, report_mode=False)
        if not (staging / "results.nc").exists():
            raise RunError(f"notebook {nb_path.name} finished without writing results.nc")
    except BaseException as exc:  # KeyboardInterrupt too: mark the run, keep earlier results
        record["status"] = "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"
        (staging / "RUN.json").write_text(json.dumps(record, indent=2, default=str))
        failed = _mark_failed(staging, final, record["error"] + "\n\n" + traceback.format_exc())
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise RunError(f"study {study!r} run {name!r} failed; see {failed}: {record['error']}") from exc
    record["status"] = "ok"
    record["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    (staging / "RUN.json").write_text(json.dumps(record, indent=2, default=str))
    _swap_in(staging, final)
    stale_failure = final.with_name(final.name + ".failed")
    if stale_failure.exists():
        shutil.rmtree(stale_failure)
    return final


def parse_grid(spec: str) -> dict[str, list]:
    """A grid from ``"key=v1,v2;key2=[1,2],[3]"`` or from a YAML file mapping keys to lists."""
    path = Path(spec)
    if spec.endswith((".yaml", ".yml")):
        if not path.exists():
            raise ParameterError(f"grid file {spec!r} does not exist")
        grid = yaml.safe_load(path.read_text())
    else:
        grid = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            if "=" not in part:
                raise ParameterError(f"grid entry {part!r} must look like key=value1,value2")
            key, _, vals = part.partition("=")
            grid[key.strip()] = parse_value(f"[{vals}]")
    if not isinstance(grid, dict) or not grid:
        raise ParameterError(f"grid {spec!r} names no parameters")
    for key, vals in grid.items():
        if not isinstance(vals, list) or not vals:
            raise ParameterError(f"grid parameter {key!r} needs a non-empty list of values, got {vals!r}")
    return grid


def grid_points(grid: dict[str, list]) -> list[dict]:
    keys = sorted(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def sweep(study: str, grid: dict[str, list], param_set: str = "default", overrides: dict | None = None, *,
          outputs=None, progress: bool = True) -> list[Path]:
    """Run every point of ``grid``: one folder per point, swept keys recorded as length-1 dims."""
    declared = declared_parameters(study)
    for key in grid:
        if key in declared and declared[key]["type"] == "list":
            raise ParameterError(f"grid parameter {key!r} is a list; sweeps take scalar parameters "
                                 "(a list parameter is already swept inside one run)")
    points = grid_points(grid)
    for point in points:  # check every point before running any
        resolve_parameters(study, param_set, {**(overrides or {}), **point})
    done = []
    for i, point in enumerate(points, 1):
        print(f"[sweep {i}/{len(points)}] {study} {point}", flush=True)
        # the folder: set and fixed overrides first, then the grid point
        name = run_name(param_set, overrides) + "__" + run_name("", point).lstrip("_")
        done.append(run(study, param_set, {**(overrides or {}), **point}, outputs=outputs,
                        sweep_dims=sorted(point), progress=progress, name=name))
    return done
