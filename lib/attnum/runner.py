"""Run study notebooks through papermill, with checked parameters, atomically.

A study is a notebook ``notebooks/NN_<study>.ipynb`` whose first code cell is
tagged ``parameters``: that cell is the single statement of the **default**
tier (``load_param_set(study, "default")`` reads it with papermill's inspection;
there is no ``default.yaml``). ``params/<study>/`` holds the other named
parameter sets (``smoke.yaml``, ``full.yaml``, ...) and ``schema.yaml``, the
allowed values of every parameter the notebook declares, plus two reserved
entries: ``_rules`` (rules between parameters: ``{expr, message}``, the
expression in a small safe language, see ``evaluate``) and ``_memory``
(``{bytes: <expression>, note: ...}``: the dominant term of the run's peak
memory, compared with the machine's before anything runs).

Checks, all before anything is written: unknown key, wrong type, a non-finite
number, a value out of range or not allowed, a repeated item in a list marked
``unique``, an unknown kernel name (``kernel: true``), a broken rule, a device
that is not there, an estimated peak memory above the machine's (unless
``allow_large``); YAML files are read refusing repeated keys, and their errors
name the file and line. Each raises ``ParameterError`` naming the key.

Runs are versioned: ``run`` executes the notebook in a new folder
``outputs/<study>/.versions/<run>/<version>/`` (its ``RUN.json`` written first,
status "running", then updated) and, on success, points the symlink
``outputs/<study>/<run>`` at it with one ``os.replace`` (rename(2): atomic), so
``outputs/<study>/<run>/results.nc`` is at every moment the old complete run or
the new complete run. A plain folder in the way (the committed
``outputs/length_scaling/gpu/``) is exchanged atomically with ``renameat2``'s
``RENAME_EXCHANGE``. One ``fcntl.flock`` lock per run name: a second run of the
same name fails at once with ``RunLocked`` (or queues with ``wait=True``). A
failed or interrupted run (SIGINT, SIGTERM) leaves the earlier results in
place; ``<run>.failed`` then points at its folder, which holds ``FAILED`` and
``RUN.json``. ``clean`` removes leftovers, never a live run.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import ctypes
import datetime as _dt
import fcntl
import functools
import hashlib
import importlib
import importlib.util
import itertools
import json
import math
import operator
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import types
from pathlib import Path

import yaml

from . import ncio
from .paths import notebooks_dir, outputs_root, params_dir

# Parameters every study notebook declares; the runner sets output_dir and sweep_dims itself.
COMMON_PARAMETERS = ("device", "output_dir", "sweep_dims")
RUNNER_SET = ("output_dir", "sweep_dims")
TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list": list}
RULE_KEYS = ("type", "min", "max", "choices", "pattern", "pattern_help", "power_of_two", "min_len", "max_len",
             "unique", "item", "kernel")
MAX_NAME = 100  # characters of a run name's readable part (sweep points: two parts joined by SWEEP_MARK)
SWEEP_MARK = "@"  # in the folder name of every sweep point, never in a single run's
VERSIONS = ".versions"
LOCKS = ".locks"
ALLOW_LARGE_ENV = "ATTNUM_ALLOW_LARGE"
SWAP_STEPS = ("before-link", "link-created", "replaced", "failure-cleared", "cleaned")
_SWAP_HOOK = None  # tests: a callable(step) run at each step of the swap


class ParameterError(ValueError):
    """A parameter set that must not run: names the key and what is allowed."""


class RunError(RuntimeError):
    """The notebook failed while running; its folder was marked failed."""


class RunLocked(RunError):
    """Another process is running the same run (same study and run name)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the runner like Ctrl-C so that the run is marked and cleaned up."""


# -- YAML: no repeated keys, errors that name the file and line --

class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"key {key!r} appears twice (first on line {seen[key].line + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str):
    """YAML as the project reads it: a repeated key is an error; errors name ``source`` and the line."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        raise ParameterError(f"{where}: {problem}" + (f" ({context})" if context else "")) from None


def load_yaml_file(path: Path):
    try:
        text = path.read_text()
    except OSError as exc:
        raise ParameterError(f"cannot read {path}: {exc}") from None
    return load_yaml(text, str(path))


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


DEFERRED_IMPORTS = {"rfc3987_syntax": ("is_valid_syntax",)}
"""Modules imported by papermill's import chain (nbformat -> jsonschema's optional format checkers) that
papermill never uses, with the names jsonschema takes from them: loaded on first use instead."""


def _defer_import(name: str, functions: tuple[str, ...]) -> None:
    """Put a placeholder for module ``name`` in ``sys.modules`` that imports the real module on first use.

    ``rfc3987_syntax`` builds a grammar when imported (about 0.8 s, most of papermill's import time);
    jsonschema imports it only to offer the ``iri`` format checks, which nbformat's notebook
    validation never uses. The placeholder's functions and any other attribute load the real module
    (which then replaces the placeholder), so a program that does check an IRI gets the same answer.
    Nothing happens if the module is already imported or not installed.
    """
    if name in sys.modules or importlib.util.find_spec(name) is None:
        return
    placeholder = types.ModuleType(name, f"placeholder: {name} is imported on first use (attnum.runner)")

    def load():
        if sys.modules.get(name) is placeholder:
            del sys.modules[name]
        return importlib.import_module(name)

    def forward(function: str):
        def call(*args, **kwargs):
            return getattr(load(), function)(*args, **kwargs)

        call.__name__ = call.__qualname__ = function
        return call

    for function in functions:
        setattr(placeholder, function, forward(function))
    def attribute(attr: str):
        if attr.startswith("__"):  # the import system's questions (__path__, ...): a plain module
            raise AttributeError(attr)
        return getattr(load(), attr)

    placeholder.__getattr__ = attribute
    placeholder.__attnum_deferred__ = True
    sys.modules[name] = placeholder


def import_papermill():
    """``papermill``, imported without building what it never uses (``DEFERRED_IMPORTS``)."""
    if "papermill" not in sys.modules:
        for name, functions in DEFERRED_IMPORTS.items():
            _defer_import(name, functions)
    import papermill

    return papermill


ENGINE = "attnum"  # papermill engine name of the runner's runs (``_register_engine``)
SAVE_EVERY = 1.0  # seconds: the executing notebook is written at most this often while cells run


def _register_engine(papermill) -> str:
    """papermill's nbclient engine, writing the executing notebook at most every ``SAVE_EVERY`` seconds.

    papermill writes the whole notebook (JSON, schema-validated) when each cell starts and ends:
    about 100 writes of a notebook that grows to 1-2 MB in a 50-cell smoke run, each one between
    two cells. Here a write less than ``SAVE_EVERY`` s after the previous one is skipped while the
    cells run; the final write (papermill's, when execution ends, ends in an error or is
    interrupted) always happens, so the notebook on disk is complete at the end and at most
    ``SAVE_EVERY`` s behind while the run executes.
    """
    from papermill.engines import NBClientEngine, papermill_engines

    if ENGINE in papermill_engines._engines:
        return ENGINE

    class ThrottledSaves(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
            write = type(nb_man).save.__get__(nb_man)
            last = [float("-inf")]

            def save(**save_kwargs):
                now = time.monotonic()
                if now - last[0] >= SAVE_EVERY:
                    write(**save_kwargs)
                    last[0] = time.monotonic()

            nb_man.save = save
            try:
                return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)
            finally:
                del nb_man.save  # the final write (notebook_complete) goes through

    papermill_engines.register(ENGINE, ThrottledSaves)
    return ENGINE


@functools.lru_cache(maxsize=32)
def _inspect(path: str, mtime: float) -> dict:
    return import_papermill().inspect_notebook(path)


def declared_parameters(study: str) -> dict[str, dict]:
    """Name -> {type, default, help} as papermill reads the notebook's parameters cell."""
    path = notebook_path(study)
    info = _inspect(str(path), path.stat().st_mtime)
    return {name: {"type": p["inferred_type_name"], "default": p["default"], "help": p["help"]}
            for name, p in info.items()}


def notebook_defaults(study: str) -> dict:
    """The notebook's own values (its parameters cell), without the runner-set ones: the default tier."""
    out = {}
    for name, info in declared_parameters(study).items():
        if name in RUNNER_SET:
            continue
        try:
            out[name] = ast.literal_eval(info["default"])
        except (ValueError, SyntaxError) as exc:
            raise ParameterError(f"{notebook_path(study).name}: the default of parameter {name!r} "
                                 f"({info['default']!r}) is not a literal value ({exc})") from None
    return out


_SCHEMAS: dict[str, tuple[tuple, dict]] = {}  # path -> ((mtime_ns, size, inode), parsed schema)


def _schema_file(study: str) -> dict:
    """``params/<study>/schema.yaml``, parsed once per version of the file (a check reads it several times)."""
    path = params_dir() / study / "schema.yaml"
    try:
        st = path.stat()
    except OSError:
        raise ParameterError(f"study {study!r} has no parameter schema at {path}") from None
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    cached = _SCHEMAS.get(str(path))
    if cached is None or cached[0] != stamp:
        data = load_yaml_file(path) or {}
        if not isinstance(data, dict):
            raise ParameterError(f"{path} must hold a mapping of parameter names to rules")
        cached = _SCHEMAS[str(path)] = (stamp, data)
    return copy.deepcopy(cached[1])


def schema(study: str) -> dict[str, dict]:
    """The allowed values of every parameter (``schema.yaml`` without its reserved ``_`` entries)."""
    return {k: v for k, v in _schema_file(study).items() if not str(k).startswith("_")}


def study_checks(study: str) -> dict:
    """The reserved entries of ``schema.yaml``: ``rules`` (list) and ``memory`` (dict or None)."""
    data = _schema_file(study)
    return {"rules": list(data.get("_rules") or []), "memory": data.get("_memory")}


def parameter_names(study: str) -> list[str]:
    """The parameters a study declares (its schema's keys, kept equal to the notebook's by a test)."""
    return list(schema(study))


def param_sets(study: str) -> list[str]:
    """``default`` (the notebook's parameters cell) and every ``params/<study>/<name>.yaml``."""
    files = {p.stem for p in (params_dir() / study).glob("*.yaml") if p.stem != "schema"}
    return sorted(files | {"default"})


def load_param_set(study: str, name: str) -> dict:
    if name == "default":
        if (params_dir() / study / "default.yaml").exists():
            raise ParameterError(f"params/{study}/default.yaml must not exist: the notebook's parameters cell "
                                 "is the default tier")
        notebook_path(study)
        return notebook_defaults(study)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name or ""):
        raise ParameterError(f"parameter set name {name!r} may hold only letters, digits, '_', '.', '-'")
    path = params_dir() / study / f"{name}.yaml"
    if not path.exists():
        raise ParameterError(f"study {study!r} has no parameter set {name!r}; sets: {param_sets(study)}")
    values = load_yaml_file(path) or {}
    if not isinstance(values, dict):
        raise ParameterError(f"{path} must hold a mapping of parameter names to values")
    return values


# -- checking values --

def parse_value(text: str):
    """A command-line value, read as YAML: ``3`` -> int, ``[1, 2]`` -> list, ``cpu`` -> str."""
    return load_yaml(text, f"value {text!r}")


def _type_ok(value, type_name: str) -> bool:
    if type_name == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, TYPES[type_name])


KERNEL_CACHE_ENV = "ATTNUM_CACHE"  # folder of the registry-name cache (default $XDG_CACHE_HOME/attnum)


@functools.lru_cache(maxsize=1)
def _code_key() -> str:
    """A digest of everything that decides whether ``kernels.get(name)`` accepts a registry name: this
    package's source files, torch's version and Python's. (Reads files only: imports nothing.)"""
    import importlib.metadata

    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    digest.update(f"torch {torch_version}; python {sys.version}".encode())
    return digest.hexdigest()[:32]


def _kernel_cache_file() -> Path | None:
    base = os.environ.get(KERNEL_CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "attnum")
    try:
        return Path(base) / f"registry-names-{_code_key()}.json"
    except OSError:
        return None


def _known_registry_names() -> set[str]:
    path = _kernel_cache_file()
    try:
        data = json.loads(path.read_text()) if path is not None else []
        return {n for n in data if isinstance(n, str)} if isinstance(data, list) else set()
    except (OSError, ValueError):
        return set()


def _remember_registry_name(name: str) -> None:
    """Add ``name`` to the cache of registry names accepted by this exact code (atomic write; best effort)."""
    path = _kernel_cache_file()
    if path is None:
        return
    try:
        names = _known_registry_names() | {name}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(3)}")
        tmp.write_text(json.dumps(sorted(names)))
        os.replace(tmp, path)
    except OSError:
        pass


def _kernel_problem(name, device: str = "cpu") -> str | None:
    """None if ``name`` names a kernel of the registry (``attnum.kernels.get``); otherwise why not.
    A kernel of your own (``package.module:function``) must also run a tiny input on ``device``.

    Checking a name imports torch and the kernels (about 1 s of a short run's start). A registry name
    that this exact code (``_code_key``: attnum's sources, torch's and Python's versions) accepted
    before is accepted again without the import; kernels of your own, and families registered at run
    time by other code, are checked every time.
    """
    if not isinstance(name, str):
        return f"a kernel name is a string, got {type(name).__name__}"
    if name in _known_registry_names():
        return None
    from . import kernels

    try:
        kernel = kernels.get(name)
    except ValueError as exc:
        return str(exc)
    family = kernels.families().get(name.split(":")[0])
    if isinstance(kernel, kernels.CallableKernel) or family is None:
        return kernels.check_runs(kernel, device)
    if getattr(family.build, "__module__", "").startswith(__package__ + "."):  # a family of attnum's own code
        _remember_registry_name(name)
    return None


def _check_scalar(key: str, value, rule: dict, what: str = "") -> None:
    where = f"parameter {key!r}{what}"
    if isinstance(value, float) and not math.isfinite(value):
        raise ParameterError(f"{where}: {value!r} is not a finite number")
    choices = rule.get("choices")
    if choices is not None and value not in choices:
        raise ParameterError(f"{where}: {value!r} is not allowed; allowed values: {choices}")
    lo, hi = rule.get("min"), rule.get("max")
    if lo is not None and not value >= lo or hi is not None and not value <= hi:
        raise ParameterError(f"{where}: {value!r} is out of range; allowed: {lo} <= value <= {hi}")
    if rule.get("pattern") and not re.fullmatch(rule["pattern"], str(value)):
        raise ParameterError(f"{where}: {value!r} does not match {rule['pattern']!r}"
                             + (f" ({rule['pattern_help']})" if rule.get("pattern_help") else ""))
    if rule.get("power_of_two") and (value < 1 or value & (value - 1)):
        raise ParameterError(f"{where}: {value!r} must be a power of two")
    if rule.get("kernel"):
        problem = _kernel_problem(value)
        if problem:
            raise ParameterError(f"{where}: {value!r} is not a known kernel: {problem}")


def _check_value(study: str, key: str, value, type_name: str, rule: dict) -> None:
    if type_name not in TYPES:
        raise ParameterError(f"parameter {key!r} has no checkable type ({type_name!r}); "
                             "annotate it in the notebook and in schema.yaml")
    if not _type_ok(value, type_name):
        raise ParameterError(f"parameter {key!r} must be of type {type_name}, "
                             f"got {type(value).__name__} {value!r}")
    if type_name != "list":
        _check_scalar(key, value, rule)
        return
    if "min_len" in rule and len(value) < rule["min_len"]:
        raise ParameterError(f"parameter {key!r} needs at least {rule['min_len']} entries, got {value!r}")
    if "max_len" in rule and len(value) > rule["max_len"]:
        raise ParameterError(f"parameter {key!r} takes at most {rule['max_len']} entries, got {len(value)}")
    item_rule = rule.get("item", {})
    for i, item in enumerate(value):
        item_type = item_rule.get("type")
        if item_type and not _type_ok(item, item_type):
            raise ParameterError(f"parameter {key!r}[{i}] must be of type {item_type}, "
                                 f"got {type(item).__name__} {item!r}")
        _check_scalar(key, item, item_rule, f"[{i}]")
    if rule.get("unique"):
        seen = {}
        for i, item in enumerate(value):
            marker = json.dumps(item, sort_keys=True)
            if marker in seen:
                raise ParameterError(f"parameter {key!r}: {item!r} appears twice (entries {seen[marker]} and {i}); "
                                     "its entries must be distinct")
            seen[marker] = i


def check_parameters(study: str, values: dict) -> None:
    """Raise ``ParameterError`` unless every key is declared, well typed, in range and the rules hold.

    The rules of ``schema.yaml``'s ``_rules`` are evaluated on the notebook's
    defaults updated with ``values``.
    """
    declared = declared_parameters(study)
    rules = schema(study)
    for key, value in values.items():
        if key not in declared:
            raise ParameterError(f"unknown parameter {key!r} for study {study!r}; "
                                 f"allowed parameters: {sorted(declared)}")
        rule = rules.get(key, {})
        _check_value(study, key, value, rule.get("type", declared[key]["type"]), rule)
    full = {**notebook_defaults(study), **values}
    for rule in study_checks(study)["rules"]:
        expr, message = rule["expr"], rule.get("message", "")
        used = sorted(n for n in _names_in(expr) if n in full)
        got = ", ".join(f"{n}={full[n]!r}" for n in used)
        try:
            ok = evaluate(expr, full)
        except (ValueError, TypeError, ArithmeticError, KeyError, IndexError) as exc:
            raise ParameterError(f"rule {expr!r} of study {study!r} cannot be checked ({exc}); got {got}") from None
        if not ok:
            raise ParameterError(f"parameters break the rule {expr!r}: {message} (got {got})")


def resolve_parameters(study: str, param_set: str = "default", overrides: dict | None = None, *,
                       allow_large: bool = False, machine: bool = True) -> dict:
    """Parameter set plus overrides, checked. Raises ``ParameterError`` before anything runs.

    ``machine``: also check the device and the memory estimate (``check_machine``).
    """
    notebook_path(study)  # an unknown study is named first
    values = dict(load_param_set(study, param_set))
    values.update(overrides or {})
    bad = sorted(set(values) & set(RUNNER_SET))
    if bad:
        raise ParameterError(f"parameter(s) {bad} are set by the runner, not by parameter sets or -p")
    check_parameters(study, values)
    if machine:
        check_machine(study, values, allow_large=allow_large)
    return values


# -- a small safe expression language for rules and memory estimates --

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b}
_FUNCTIONS = {"min": min, "max": max, "len": len, "sum": sum, "abs": abs, "all": all, "any": any,
              "sorted": sorted, "int": int, "float": float}


def _names_in(expr: str) -> set[str]:
    try:
        return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}
    except SyntaxError:
        return set()


def evaluate(expr: str, names: dict):
    """Evaluate ``expr`` over ``names`` without ``eval``: literals, names, arithmetic, comparisons,
    ``and``/``or``/``not``, ``a if c else b``, lists, indexing, and ``min max len sum abs all any
    sorted int float``. Anything else (attributes, other calls, comprehensions) is a ``ValueError``."""
    tree = ast.parse(expr, mode="eval")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in names:
                return names[node.id]
            raise KeyError(f"unknown name {node.id!r}")
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else (+value if isinstance(node.op, ast.UAdd) else not value)
        if isinstance(node, ast.BoolOp):
            values = (ev(v) for v in node.values)
            if isinstance(node.op, ast.And):
                result = True
                for result in values:
                    if not result:
                        return result
                return result
            result = False
            for result in values:
                if result:
                    return result
            return result
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            left = ev(node.left)
            for op, comp in zip(node.ops, node.comparators):
                right = ev(comp)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return ev(node.body) if ev(node.test) else ev(node.orelse)
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            return ev(node.value)[ev(node.slice)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords):
            return _FUNCTIONS[node.func.id](*(ev(a) for a in node.args))
        raise ValueError(f"{type(node).__name__} is not allowed in a rule or estimate: {ast.unparse(node)!r}")

    return ev(tree)


# -- the machine: device and memory --

def machine_memory(device: str = "cpu") -> int:
    """Bytes of memory the run may use: the CUDA device's, or the host's (cgroup limit if lower)."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory)
    total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if total is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def memory_estimate(study: str, values: dict) -> tuple[int, str] | None:
    """(bytes, note) of the study's declared peak-memory estimate (``_memory`` in schema.yaml), or None."""
    spec = study_checks(study)["memory"]
    if not spec:
        return None
    full = {**notebook_defaults(study), **values}
    try:
        estimate = evaluate(spec["bytes"], full)
    except (ValueError, TypeError, ArithmeticError, KeyError, IndexError) as exc:
        raise ParameterError(f"the memory estimate of study {study!r} cannot be computed ({exc})") from None
    return int(estimate), spec.get("note", "")


def check_machine(study: str, values: dict, *, allow_large: bool = False) -> None:
    """Refuse a device that is not there and a run whose estimated peak memory exceeds the machine's."""
    device = str({**notebook_defaults(study), **values}.get("device", "cpu"))
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ParameterError(f"parameter 'device': {device!r} was asked for but torch sees no CUDA device "
                                 "on this machine")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise ParameterError(f"parameter 'device': {device!r} was asked for but this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s)")
    if allow_large or os.environ.get(ALLOW_LARGE_ENV, "") not in ("", "0"):
        return
    estimate = memory_estimate(study, values)
    if estimate is None:
        return
    need, note = estimate
    have = machine_memory(device)
    if need > have:
        raise ParameterError(f"estimated peak memory {need / 2**30:.1f} GiB ({note}) exceeds the "
                             f"{have / 2**30:.1f} GiB of this machine's {device}; reduce the sizes, or pass "
                             f"allow_large=True (--allow-large, or {ALLOW_LARGE_ENV}=1) to run anyway")


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
    parts = [param_set] if param_set else []
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


def _folder_name(param_set: str, overrides: dict, sweep_dims, name: str | None) -> str:
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


# -- the atomic swap, locks, records --

def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _hook(step: str) -> None:
    if _SWAP_HOOK is not None:
        _SWAP_HOOK(step)


@contextlib.contextmanager
def run_lock(study_dir: Path, name: str, *, wait: bool = False):
    """Hold the lock of one run name (``<study>/.locks/<name>.lock``, ``fcntl.flock``)."""
    locks = study_dir / LOCKS
    locks.mkdir(parents=True, exist_ok=True)
    fh = open(locks / f"{name}.lock", "a+")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise RunLocked(f"run {study_dir.name}/{name} is already running ({holder}); wait for it to "
                            "finish (or pass wait=True to queue)") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {_now()}\n")
        fh.flush()
        yield
    finally:
        fh.close()  # closing releases the lock


def flock_held(path: Path) -> bool:
    """Whether another process holds the ``fcntl.flock`` of the lock file ``path`` now."""
    if not path.exists():
        return False
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def _lock_held(study_dir: Path, name: str) -> bool:
    return flock_held(study_dir / LOCKS / f"{name}.lock")


def _pid_alive(pid, host=None) -> bool:
    if host and host != socket.gethostname():
        return True  # cannot tell: assume alive
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """In the main thread: SIGTERM raises ``Terminated`` (a KeyboardInterrupt) while the run executes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the failure record short
        raise Terminated(f"terminated by {signal.Signals(signum).name}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _env(name: str, value: str | None):
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _new_version(study_dir: Path, name: str) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    folder = study_dir / VERSIONS / name / f"{stamp}-{os.getpid()}-{secrets.token_hex(3)}"
    folder.mkdir(parents=True)
    return folder


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux ``renameat2(..., RENAME_EXCHANGE)``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(f"renameat2 is not available here: cannot replace the plain folder {b} atomically; "
                      "move it away (or run under another name)")
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def _point(link: Path, target: Path) -> None:
    """Make ``link`` a symlink to ``target`` (relative) in one atomic step."""
    tmp = link.with_name(f".{link.name}.link-{os.getpid()}-{secrets.token_hex(3)}")
    _hook("before-link")
    os.symlink(os.path.relpath(target, link.parent), tmp)
    try:
        _hook("link-created")
        if link.is_dir() and not link.is_symlink():  # a plain folder: exchange, then retire the old one
            _exchange(tmp, link)
            retired = target.parent / f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S}-replaced-{os.getpid()}"
            os.rename(tmp, retired)
        else:
            os.replace(tmp, link)
        ncio._fsync_dir(link.parent)
        _hook("replaced")
    finally:
        if tmp.is_symlink():
            tmp.unlink()


def _target(link: Path) -> Path | None:
    return link.resolve() if link.is_symlink() else None


def _drop_stale_versions(study_dir: Path, name: str) -> None:
    """Remove the versions of ``name`` that neither ``<name>`` nor ``<name>.failed`` points at."""
    keep = {_target(study_dir / name), _target(study_dir / f"{name}.failed")}
    for version in sorted((study_dir / VERSIONS / name).glob("*")):
        if version.resolve() not in keep:
            shutil.rmtree(version, ignore_errors=True)


def _failure(version: Path, final: Path, record: dict, exc: BaseException) -> Path:
    """Record a failed run; each step may fail on a full disk, the earlier record then stays."""
    record.update(status="interrupted" if isinstance(exc, KeyboardInterrupt) else "failed",
                  error=f"{type(exc).__name__}: {exc}", finished=_now())
    with contextlib.suppress(OSError):
        ncio.write_record(version, record)
    with contextlib.suppress(OSError):
        (version / "FAILED").write_text(record["error"] + "\n\n" + traceback.format_exc())
    failed = final.with_name(final.name + ".failed")
    with contextlib.suppress(OSError):
        if failed.is_dir() and not failed.is_symlink():
            shutil.rmtree(failed)  # a failure record of the layout before versioned folders
        old = _target(failed)
        _point(failed, version)
        if old is not None and old != version.resolve() and old != _target(final):
            shutil.rmtree(old, ignore_errors=True)
    return failed


def kernel_pythonpath() -> str:
    """``PYTHONPATH`` for a notebook kernel: the folder holding this ``attnum`` first (the kernel imports
    the code that checked the parameters, installed or not), then this process's entries made absolute
    (the kernel starts in ``notebooks/``, where a relative entry such as ``lib`` would point elsewhere);
    packages installed through ``PYTHONPATH`` (e.g. ``/tmp/site``) reach the kernel as they reach the runner."""
    entries = [str(Path(__file__).resolve().parents[1])]
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry:
            entry = os.path.abspath(entry)
            if entry not in entries:
                entries.append(entry)
    return os.pathsep.join(entries)


def run(study: str, param_set: str = "default", overrides: dict | None = None, *,
        outputs: str | os.PathLike | None = None, sweep_dims=(), progress: bool | str = True,
        name: str | None = None, timeout: int | None = None, allow_large: bool = False,
        wait: bool = False) -> Path:
    """Execute one study notebook; returns the finished run folder ``<outputs>/<study>/<name>``.

    Everything is checked before anything is written. ``allow_large`` runs past the memory
    estimate; ``wait`` queues behind a running run of the same name instead of failing.
    ``progress``: ``True`` shows papermill's bar over the cells and the notebook's own progress
    lines (``attnum.progress``, on this process's terminal); ``"lines"`` only the notebook's lines;
    ``False`` neither (the kernel runs with ``ATTNUM_PROGRESS=off``, whatever the environment says).

    The kernel is stopped at once when the notebook has finished (``shutdown_kernel="immediate"``):
    every output has arrived by then, and the results are read back and checked afterwards.
    """
    from . import progress as _progress

    papermill = import_papermill()
    overrides = dict(overrides or {})
    values = resolve_parameters(study, param_set, overrides, allow_large=allow_large)
    nb_path = notebook_path(study)
    name = _folder_name(param_set, overrides, sweep_dims, name)
    base = Path(outputs).resolve() if outputs else outputs_root()
    study_dir = base / study
    final = study_dir / name
    with run_lock(study_dir, name, wait=wait):
        version = _new_version(study_dir, name)
        record = {"study": study, "name": name, "param_set": param_set, "overrides": overrides,
                  "parameters": values, "sweep_dims": list(sweep_dims), "notebook": nb_path.name,
                  "output_dir": f"{study}/{name}", "status": "running", "pid": os.getpid(),
                  "host": socket.gethostname(), "started": _now()}
        try:
            ncio.write_record(version, record)  # small, first: even a full disk later leaves this
            injected = dict(values, output_dir=str(version), sweep_dims=list(sweep_dims))
            with _sigterm_as_interrupt(), _env(ALLOW_LARGE_ENV, "1" if allow_large else None), \
                    _env(_progress.ENV, None if progress else "off"), _env("PYTHONPATH", kernel_pythonpath()):
                papermill.execute_notebook(str(nb_path), str(version / "notebook.ipynb"), parameters=injected,
                                           progress_bar=progress is True, cwd=str(nb_path.parent),
                                           kernel_name="python3", execution_timeout=timeout, report_mode=False,
                                           engine_name=_register_engine(papermill), shutdown_kernel="immediate")
                results = version / "results.nc"
                if not results.exists():
                    raise RunError(f"notebook {nb_path.name} finished without writing results.nc")
                ncio.open_results(results)  # reads every value: the Fletcher-32 checksums hold
                record.update(status="ok", finished=_now(), results_sha256=ncio.file_sha256(results),
                              notebook_sha256=ncio.file_sha256(version / "notebook.ipynb"))
                ncio.write_record(version, record)
        except BaseException as exc:  # KeyboardInterrupt and SIGTERM too: mark the run, keep earlier results
            failed = _failure(version, final, record, exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise RunError(f"study {study!r} run {name!r} failed; see {failed}: {record['error']}") from exc
        try:
            _point(final, version)
        except OSError as exc:
            raise RunError(f"study {study!r} run {name!r} finished, but could not be swapped in ({exc}); "
                           f"its complete results are in {version}") from exc
        failed = final.with_name(final.name + ".failed")
        if failed.is_symlink():
            failed.unlink()
        elif failed.is_dir():
            shutil.rmtree(failed)
        _hook("failure-cleared")
        _drop_stale_versions(study_dir, name)
        _hook("cleaned")
    return final


# -- JupyterLab and papermill alike: the notebooks' set-up --

def _lab_folder(study: str) -> Path:
    base = outputs_root() / study
    base.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for i in range(1000):
        folder = base / (f"lab-{stamp}" + (f"-{i}" if i else ""))
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise RunError(f"cannot make a new lab folder under {base}")


PAPERMILL_MARK = "# Parameters"  # the first line of the cell papermill injects (its Python translator)


def injected_parameter_names(namespace: dict) -> list[str]:
    """The names papermill's injected-parameters cell assigned in this kernel, in order ([] if none).

    papermill puts the values it is given (``-p``, ``-y``, ``parameters=``) in a cell of its own,
    ``# Parameters`` then one assignment per name, right after the notebook's ``parameters`` cell;
    unknown names are injected too (it only warns). IPython's input history (``In`` / ``_ih`` of the
    namespace) holds the sources of executed cells; the latest such cell is the injected one.
    """
    history = namespace.get("In") or namespace.get("_ih") or []
    for source in reversed(list(history) if isinstance(history, (list, tuple)) else []):
        if not isinstance(source, str) or not source.lstrip().startswith(PAPERMILL_MARK):
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return []
        names = []
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            names += [t.id for t in targets if isinstance(t, ast.Name) and t.id not in names]
        return names
    return []


def _progress_to_terminal(study: str, out: Path) -> None:
    """A run of the runner: progress bars go to the terminal that started the kernel, not the notebook."""
    from . import progress

    os.environ.setdefault(progress.ENV, "terminal")  # an explicit ATTNUM_PROGRESS (e.g. off) wins
    try:
        name = ncio.read_record(out).get("name") or out.name
    except (ncio.DamagedRunError, OSError, ValueError):
        name = out.name
    os.environ[progress.LABEL_ENV] = f"{study}/{name}"


def start(study: str, namespace: dict) -> tuple[dict, Path]:
    """The set-up of every study notebook: ``PARAMS, OUT = runner.start(STUDY, globals())``.

    Checks the parameters (the runner's checks and messages), the device and the
    memory estimate, and returns the parameters and the output folder: the one the
    runner chose, or for a JupyterLab run (``output_dir`` empty) a new folder
    ``outputs/<study>/lab-<timestamp>/`` with its own ``RUN.json``, never another run's.

    Raw papermill refuses what the runner refuses: a name papermill injected that the
    notebook does not declare (``-p n_sed 3``) raises the runner's "unknown parameter"
    error here, before any work. In a run of the runner (``output_dir`` set) progress bars
    are sent to the terminal (``attnum.progress``); in JupyterLab they are widgets.
    """
    names = parameter_names(study)
    missing = [n for n in names if n not in namespace]
    if missing:
        raise ParameterError(f"the notebook of {study!r} does not define parameter(s) {missing}")
    injected = injected_parameter_names(namespace)
    undeclared = {n: namespace.get(n) for n in injected if n not in names}
    if undeclared:
        check_parameters(study, undeclared)  # raises "unknown parameter ..., allowed parameters: [...]"
    params = {n: namespace[n] for n in names}
    check_parameters(study, params)
    check_machine(study, {k: v for k, v in params.items() if k not in RUNNER_SET})
    if params.get("output_dir"):
        out = Path(params["output_dir"])
        _progress_to_terminal(study, out)
    else:
        out = _lab_folder(study)
        ncio.write_record(out, {"study": study, "name": out.name, "param_set": "lab", "overrides": {},
                                "parameters": {k: v for k, v in params.items() if k not in RUNNER_SET},
                                "sweep_dims": list(params.get("sweep_dims") or []), "status": "lab",
                                "pid": os.getpid(), "host": socket.gethostname(), "started": _now()})
    params["output_dir"] = ncio.logical_run_path(out)
    return params, out


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
        seen = set()
        for v in vals:
            marker = json.dumps(v, sort_keys=True, default=str)
            if marker in seen:
                raise ParameterError(f"grid parameter {key!r} repeats the value {v!r}")
            seen.add(marker)
    return grid


def grid_points(grid: dict[str, list]) -> list[dict]:
    keys = sorted(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def plan_sweep(study: str, grid: dict[str, list], param_set: str = "default",
               overrides: dict | None = None) -> list[dict]:
    """Every point of ``grid``, checked before any runs: ``[{name, overrides, sweep_dims, parameters}]``.

    Raises ``ParameterError`` for a list parameter in the grid, any invalid point, or two points
    that would write the same folder; nothing is written.
    """
    declared = declared_parameters(study)
    for key in grid:
        if key in declared and declared[key]["type"] == "list":
            raise ParameterError(f"grid parameter {key!r} is a list; sweeps take scalar parameters "
                                 "(a list parameter is already swept inside one run)")
    plan, names = [], set()
    for point in grid_points(grid):
        merged = {**(overrides or {}), **point}
        values = resolve_parameters(study, param_set, merged)
        name = sweep_point_name(param_set, overrides, point)  # <set and fixed overrides>@<point>
        if name in names:
            raise ParameterError(f"grid point {point} repeats run {name!r}; remove the repeated value")
        names.add(name)
        plan.append({"name": name, "overrides": merged, "sweep_dims": sorted(point), "parameters": values})
    return plan


def sweep(study: str, grid: dict[str, list], param_set: str = "default", overrides: dict | None = None, *,
          outputs=None, progress: bool = True, **batch_options) -> list[Path]:
    """Run every point of ``grid`` as one batch (``attnum.batch``: Dask; ``workers=1``: in this process).

    One folder per point, swept keys recorded as length-1 dims. Every point runs even if some fail;
    then ``RunError`` names the failed ones. Returns the run folders in grid order.
    """
    from . import batch

    tasks = batch.plan_sweep(study, grid, param_set, overrides)
    results = batch.run_batch(tasks, outputs=outputs, progress=progress, **batch_options)
    failed = [r for r in results if not r.ok]
    if failed:
        raise RunError(f"{len(failed)} of {len(results)} sweep point(s) failed: "
                       + "; ".join(f"{r.task.name}: {r.error}" for r in failed))
    return [Path(r.folder) for r in results]


# -- clean: leftovers only, never a live run, never results --

def _record_of(folder: Path) -> dict:
    try:
        record = json.loads((folder / ncio.RECORD).read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _live_version(study_dir: Path, name: str, version: Path) -> bool:
    if _lock_held(study_dir, name):
        return True  # a run of this name is in progress: its version may be about to be swapped in
    record = _record_of(version)
    return record.get("status") == "running" and _pid_alive(record.get("pid"), record.get("host"))


def _recover_legacy(study_dir: Path, removed: list[str]) -> None:
    """Folders of the layout before versioned runs: ``.<run>.running-<pid>-<t>`` and ``.<run>.old-<pid>``.

    A run killed between the two renames of the old swap left no ``<run>``: its complete
    new results (``.running-``, RUN.json status ok) or else the old copy (``.old-``) go back.
    """
    pattern = re.compile(r"^\.(?P<name>.+)\.(?P<kind>running|old)-(?P<pid>\d+)(-\d+)?$")
    leftovers = []
    for p in study_dir.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            leftovers.append((m["name"], m["kind"], int(m["pid"]), p))
    # complete new results first, newest first; then old copies
    leftovers.sort(key=lambda t: (t[1] != "running", -t[3].stat().st_mtime))
    for name, kind, pid, path in leftovers:
        if _pid_alive(pid):
            continue
        final = study_dir / name
        complete = kind == "old" or _record_of(path).get("status") == "ok"
        if complete and not final.exists() and not final.is_symlink() and (path / "results.nc").exists():
            target = study_dir / VERSIONS / name / f"recovered-{path.name.lstrip('.')}"
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, target)
            _point(final, target)
            removed.append(f"recovered {final} from {path.name}")
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))


def clean(outputs: str | os.PathLike | None = None) -> list[str]:
    """Remove leftovers under the outputs root; returns what was removed or recovered.

    Leftovers: versions of a run that no pointer names and that no live process owns
    (lock held, or RUN.json "running" with a live pid), temporary links, the rendered
    site and its build folders (unless a publish holds its lock), folders of the
    layout before versioned runs (recovering a run a killed swap left without a folder).
    Results a pointer names are never touched.
    """
    base = Path(outputs).resolve() if outputs else outputs_root()
    removed: list[str] = []
    if not base.is_dir():
        return removed
    from .publish import publish_lock_held, SITE

    if not publish_lock_held(base):
        for p in [base / SITE, *base.glob(f".{SITE}.building*")]:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(str(p))
    for study_dir in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")
                            and p.name != SITE):
        for link in study_dir.glob(".*.link-*"):
            m = re.search(r"\.link-(\d+)-", link.name)
            if link.is_symlink() and not (m and _pid_alive(int(m[1]))):
                link.unlink()
                removed.append(str(link))
        _recover_legacy(study_dir, removed)
        versions = study_dir / VERSIONS
        if not versions.is_dir():
            continue
        for name_dir in sorted(p for p in versions.iterdir() if p.is_dir()):
            name = name_dir.name
            keep = {_target(study_dir / name), _target(study_dir / f"{name}.failed")}
            for version in sorted(p for p in name_dir.iterdir()):
                if version.resolve() in keep or _live_version(study_dir, name, version):
                    continue
                shutil.rmtree(version, ignore_errors=True)
                removed.append(str(version))
            with contextlib.suppress(OSError):
                name_dir.rmdir()  # only if empty
        for link in [*study_dir.iterdir()]:  # pointers whose folder is gone
            if link.is_symlink() and not link.exists():
                link.unlink()
                removed.append(str(link))
    return removed


def live_runs(outputs: str | os.PathLike | None = None) -> list[str]:
    """``<study>/<run>`` of every run in progress under the outputs root (its lock is held)."""
    base = Path(outputs).resolve() if outputs else outputs_root()
    out = []
    for locks in sorted(base.glob(f"*/{LOCKS}")) if base.is_dir() else []:
        for lock in sorted(locks.glob("*.lock")):
            if _lock_held(locks.parent, lock.name[:-len(".lock")]):
                out.append(f"{locks.parent.name}/{lock.name[:-len('.lock')]}")
    return out


def main(argv=None) -> int:
    """``python -m attnum.runner {clean,idle} [--outputs DIR]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m attnum.runner", description="runner maintenance")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_clean = sub.add_parser("clean", help="remove leftovers of interrupted runs and the rendered site; "
                                           "never results, never a live run")
    p_clean.add_argument("--outputs", default=None)
    p_idle = sub.add_parser("idle", help="exit 1 naming the runs in progress, 0 when none is")
    p_idle.add_argument("--outputs", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "idle":
        live = live_runs(args.outputs)
        if live:
            print(f"error: run(s) in progress: {', '.join(live)}; wait for them to finish", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "clean":
        for line in clean(args.outputs):
            print(f"removed {line}" if not line.startswith("recovered") else line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
