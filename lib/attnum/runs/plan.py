"""Run names, grids and plans: what a run, a sweep or a batch will write, decided before anything runs.

A run's folder is named after its parameter set and overrides (``run_name``); a sweep point's after
the set, the fixed overrides and the point, joined by ``SWEEP_MARK`` (``sweep_point_name``). A name of
one's own (``--name``: ``check_label``) replaces the generated one, or for a sweep the part before
``SWEEP_MARK``; a name already used by a run of other parameters is refused (``name_conflict``). A plan is
a list of ``PlannedRun``: every run of a batch (a study of ``run-all``, a grid point of ``sweep``) with
its parameters checked, so that a bad value anywhere refuses the whole batch and no folder appears.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .params import (ParameterError, declared_parameters, load_yaml_file, normalize_param_set, parse_value,
                     resolve_parameters, resolve_study, set_label)
from .params import param_sets
from .params import studies as _studies

MAX_GRID_POINTS = 1024  # runs of one sweep; planning checks every point (about 50 ms each), so it stays under a minute
MAX_NAME = 100  # characters of a run name's readable part (sweep points: two parts joined by SWEEP_MARK)
SWEEP_MARK = "@"  # in the folder name of every sweep point, never in a single run's
MAX_LABEL = 24  # characters of a name of one's own (--name): what the site's run tables show whole
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


# -- run names --

def _value_text(value) -> tuple[str, bool]:
    """Text of an override value in a folder name, and whether the text alone identifies the value."""
    if isinstance(value, str):
        return value, bool(value) and "," not in value
    if isinstance(value, list):
        parts = [_value_text(v) for v in value]
        return ",".join(t for t, _ in parts), all(exact and not isinstance(v, list) for (_, exact), v in zip(parts, value))
    return json.dumps(value), True


def _readable(param_set: str, overrides: dict | None) -> str:
    parts = [set_label(param_set)] if param_set else []
    exact = True
    for key, value in sorted((overrides or {}).items()):
        text, ok = _value_text(value)
        clean = re.sub(r"[^A-Za-z0-9_.,+-]", "", text)
        exact &= ok and clean == text and "__" not in text and not text.startswith("_") and not text.endswith("_")
        parts.append(f"{key}={clean}")
    name = "__".join(parts)
    if not exact or len(name) > MAX_NAME:
        digest = hashlib.sha256(json.dumps([param_set, overrides or {}], sort_keys=True, default=str)
                                .encode()).hexdigest()[:10]
        name = name[:MAX_NAME - 12].rstrip("_") + "-h" + digest
    return name


def run_name(param_set: str, overrides: dict | None = None) -> str:
    """Folder name of a run: the set name, then ``__key=value`` for each override, sorted.

    Unique: when cleaning the text for a file name loses anything, or the name
    would pass ``MAX_NAME`` characters, a hash of the exact overrides is appended.
    """
    return _readable(param_set, overrides)


def sweep_point_name(param_set: str, overrides: dict | None, point: dict) -> str:
    """Folder name of a sweep point: ``<set and fixed overrides>@<point>``; ``@`` marks every sweep point."""
    fixed = {k: v for k, v in (overrides or {}).items() if k not in point}
    return f"{_readable(param_set, fixed)}{SWEEP_MARK}{_readable('', point)}"


def check_label(name, what: str = "--name") -> str:
    """A run name of one's own (``--name``; a sweep's prefix): letters, digits and ``_ . + -``, starting with
    a letter or digit, at most ``MAX_LABEL`` characters, not ``lab-...`` (JupyterLab runs) nor ``....failed``.
    Returns it; raises ``ParameterError`` saying what is allowed."""
    if (not isinstance(name, str) or not LABEL.fullmatch(name) or len(name) > MAX_LABEL
            or name.startswith("lab-") or name.endswith(".failed")):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 2 * MAX_LABEL else repr(name[:2 * MAX_LABEL]) + "..."
        raise ParameterError(f"{what} {shown} is not allowed: letters, digits and _ . + - only, starting with a "
                             f"letter or digit, at most {MAX_LABEL} characters, not starting with 'lab-' "
                             "(JupyterLab runs) nor ending in '.failed'")
    return name


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def name_conflict(study_dir: Path, name: str, param_set: str, overrides: dict | None,
                  sweep_dims=()) -> str | None:
    """Why a run of ``name`` must not be written into ``study_dir``, or None.

    A single run: a run of that folder name (finished or ``.failed``) whose ``RUN.json`` records another
    parameter set, other overrides or a sweep. A sweep point ``<prefix>@<point>``: any point of that
    prefix made by another set, other fixed overrides or other swept keys (the points of one sweep may
    grow, never mix with another's). A run of the same parameters is a re-run: it replaces the earlier
    one, as for a generated name. A record that cannot be read counts as another run's. The name of one of
    the study's parameter sets (``default``, ``smoke``, ``gpu``, ...) is that set's plain run's only."""
    from .. import ncio

    overrides = dict(overrides or {})
    dims = sorted(sweep_dims or ())
    if dims:
        prefix = name.split(SWEEP_MARK, 1)[0]
        want = (param_set, {k: v for k, v in overrides.items() if k not in dims}, dims)
        try:
            found = [p for p in study_dir.iterdir() if p.name.startswith(prefix + SWEEP_MARK)]
        except OSError:
            found = []
    else:
        want = (param_set, overrides, [])
        if name in param_sets(study_dir.name) and (param_set, overrides) != (name, {}):
            return (f"the name {name!r} is a parameter set of study {study_dir.name!r}: it names that set's "
                    f"plain run (--params {name}, no -p), which the site shows as such; choose another name")
        found = [study_dir / n for n in (name, name + ".failed") if os.path.lexists(study_dir / n)]
    for folder in sorted(found):
        try:
            record = ncio.read_record(folder)
        except (ncio.DamagedRunError, OSError) as exc:
            return f"run {study_dir.name}/{folder.name} exists and its record cannot be read ({exc})"
        their_dims = sorted(record.get("sweep_dims") or [])
        theirs = (record.get("param_set"), {k: v for k, v in (record.get("overrides") or {}).items()
                                            if k not in their_dims}, their_dims)
        if not _same(theirs, want):
            what = "sweep points" if dims else "a run"
            return (f"the name {name.split(SWEEP_MARK, 1)[0] if dims else name!r} is already used by {what} of "
                    f"study {study_dir.name!r} with other parameters: {folder.name} (set {theirs[0]!r}, overrides "
                    f"{json.dumps(theirs[1], sort_keys=True, default=str)}, swept {theirs[2]}); choose another name")
    return None


def check_names_free(tasks, outputs) -> None:
    """``ParameterError`` for the first named task (``PlannedRun.named``) whose name ``name_conflict`` refuses
    under the outputs root ``outputs``; nothing is written."""
    from ..paths import outputs_root

    base = Path(outputs).resolve() if outputs else outputs_root()
    for t in tasks:
        if t.named:
            problem = name_conflict(base / t.study, t.name, t.param_set, t.overrides, t.sweep_dims)
            if problem:
                raise ParameterError(problem)


def folder_name(param_set: str, overrides: dict, sweep_dims, name: str | None) -> str:
    if sweep_dims:
        if not name or SWEEP_MARK not in name:
            point = {k: overrides[k] for k in sweep_dims if k in overrides}
            name = sweep_point_name(param_set, overrides, point)
    else:
        name = name or run_name(param_set, overrides)
        if SWEEP_MARK in name:
            raise ParameterError(f"run name {name!r} holds {SWEEP_MARK!r}, which marks sweep points; "
                                 "a single run cannot take a sweep point's folder")
    if (not re.fullmatch(r"[A-Za-z0-9_.=,+@-]+", name) or name.startswith(".") or name.endswith(".failed")
            or name.startswith("lab-") or len(name) > 2 * MAX_NAME + 1):
        raise ParameterError(f"run name {name!r} is not allowed: letters, digits and _ . = , + - only, "
                             f"at most {2 * MAX_NAME + 1} characters, not starting with '.' or 'lab-', "
                             "not ending in '.failed'")
    return name


# -- grids --

def parse_grid(spec: str) -> dict[str, list]:
    """A grid from ``"key=v1,v2;key2=[1,2],[3]"`` or from a YAML file mapping keys to lists."""
    path = Path(spec)
    if spec.endswith((".yaml", ".yml")):
        if not path.exists():
            raise ParameterError(f"grid file {spec!r} does not exist")
        grid = load_yaml_file(path)
    else:
        grid = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            if "=" not in part:
                raise ParameterError(f"grid entry {part!r} must look like key=value1,value2")
            key, _, vals = part.partition("=")
            if key.strip() in grid:
                raise ParameterError(f"grid parameter {key.strip()!r} appears twice in {spec!r}")
            grid[key.strip()] = parse_value(f"[{vals}]")
    if not isinstance(grid, dict) or not grid:
        raise ParameterError(f"grid {spec!r} names no parameters")
    for key, vals in grid.items():
        if not isinstance(vals, list) or not vals:
            raise ParameterError(f"grid parameter {key!r} needs a non-empty list of values, got {vals!r}")
    check_grid_size(grid)
    for key, vals in grid.items():
        seen = set()
        for v in vals:
            marker = json.dumps(v, sort_keys=True, default=str)
            if marker in seen:
                raise ParameterError(f"grid parameter {key!r} repeats the value {v!r}")
            seen.add(marker)
    return grid


def grid_size(grid: dict[str, list]) -> int:
    """How many points ``grid`` has: the product of its list lengths (nothing is expanded)."""
    size = 1
    for values in grid.values():
        size *= len(values)
    return size


def check_grid_size(grid: dict[str, list]) -> int:
    """``grid_size``, or ``ParameterError`` (saying how many points and the limit) above ``MAX_GRID_POINTS``."""
    size = grid_size(grid)
    if size > MAX_GRID_POINTS:
        shape = " x ".join(f"{len(v)} {k}" for k, v in sorted(grid.items()))
        raise ParameterError(f"the grid has {size} points ({shape}), more than the {MAX_GRID_POINTS} runs a "
                             "sweep may hold; sweep fewer values (or split it into several sweeps)")
    return size


def grid_points(grid: dict[str, list]) -> list[dict]:
    check_grid_size(grid)
    keys = sorted(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


# -- plans --

@dataclass(frozen=True)
class PlannedRun:
    """One run of a plan: the arguments of one ``attnum.runs.run`` call, and what it needs."""

    study: str
    param_set: str
    overrides: dict
    name: str
    sweep_dims: tuple = ()
    device: str = "cpu"
    parameters: dict = field(default_factory=dict, compare=False, repr=False)  # the checked values
    named: bool = False  # a name of one's own (--name): refused if a run of other parameters holds it

    @property
    def resources(self) -> dict:
        return {"GPU": 1} if str(self.device).startswith("cuda") else {}

    @property
    def label(self) -> str:
        return f"{self.study}/{self.name}"


def _check_unique(planned: list[PlannedRun]) -> list[PlannedRun]:
    seen = {}
    for t in planned:
        if t.label in seen:
            raise ParameterError(f"two runs of the batch would write the same folder {t.label!r}: "
                                 f"{seen[t.label].overrides} and {t.overrides}; "
                                 "remove the repeated grid value")
        seen[t.label] = t
    return planned


def plan_run_all(param_set: str = "default", overrides: dict | None = None,
                 studies: list[str] | None = None) -> list[PlannedRun]:
    """One run per study (all studies unless named); every study's parameters checked first."""
    overrides = dict(overrides or {})
    planned = []
    for study in [resolve_study(s) for s in studies] if studies else list(_studies()):
        values = resolve_parameters(study, param_set, overrides)
        own_set = normalize_param_set(study, param_set)
        planned.append(PlannedRun(study, own_set, overrides, run_name(own_set, overrides), (),
                                  str(values.get("device", "cpu")), values))
    return _check_unique(planned)


def plan_sweep(study: str, grid: dict[str, list], param_set: str = "default",
               overrides: dict | None = None, prefix: str | None = None) -> list[PlannedRun]:
    """One run per point of ``grid``, every point checked before any runs.

    ``prefix`` (``--name``): the points are named ``<prefix>@<point>`` instead of
    ``<set and fixed overrides>@<point>``.

    Raises ``ParameterError`` for a list parameter in the grid, any invalid point, or two points
    that would write the same folder; nothing is written. Swept keys are recorded as length-1 dims.
    """
    check_grid_size(grid)  # counted before anything is expanded or checked
    if prefix is not None:
        check_label(prefix)
    study = resolve_study(study)
    param_set = normalize_param_set(study, param_set)
    declared = declared_parameters(study)
    for key in grid:
        if key in declared and declared[key]["type"] == "list":
            raise ParameterError(f"grid parameter {key!r} is a list; sweeps take scalar parameters "
                                 "(a list parameter is already swept inside one run)")
    planned, names = [], set()
    for point in grid_points(grid):
        merged = {**(overrides or {}), **point}
        values = resolve_parameters(study, param_set, merged)
        name = (f"{prefix}{SWEEP_MARK}{_readable('', point)}" if prefix is not None
                else sweep_point_name(param_set, overrides, point))  # <set and fixed overrides>@<point>
        if name in names:
            raise ParameterError(f"grid point {point} repeats run {name!r}; remove the repeated value")
        names.add(name)
        planned.append(PlannedRun(study, param_set, merged, name, tuple(sorted(point)),
                                  str(values.get("device", "cpu")), values, named=prefix is not None))
    return _check_unique(planned)
