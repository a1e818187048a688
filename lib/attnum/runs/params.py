"""A study's parameters: the parameter sets, their schema, and every check made before anything runs.

A study is a notebook ``notebooks/NN_<study>.ipynb`` whose first code cell is
tagged ``parameters``: that cell is the single statement of the **default**
tier (``load_param_set(study, "default")`` reads it with papermill's inspection;
there is no ``default.yaml``). ``params/<study>/`` holds the other named
parameter sets (``smoke.yaml``, ``full.yaml``, ...) and ``schema.yaml``, the
allowed values of every parameter the notebook declares.

Rules between parameters and the peak-memory estimate are plain Python functions of
the study package ``attnum.studies.<study>`` (light: it imports no torch), called
with every parameter of the run (the notebook's defaults updated with the set):
``rules(p) -> list[str]`` (one message per broken rule, naming its parameters) and
``memory_estimate(p) -> (bytes, note) | None`` (the dominant term of the run's peak
memory, compared with the machine's before anything runs). A study that defines
neither has no rules and no estimate.

Checks, all before anything is written: unknown key, wrong type, a non-finite
number, a value out of range or not allowed, a repeated item in a list marked
``unique``, an unknown kernel name (``kernel: true``), a broken rule, a device
that is not there, an estimated peak memory above the machine's (unless
``allow_large``); YAML files are read refusing repeated keys, and their errors
name the file and line. Each raises ``ParameterError`` naming the key.
"""
from __future__ import annotations

import ast
import copy
import difflib
import functools
import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import secrets
import sys
import types
from pathlib import Path

import yaml

from ..paths import notebooks_dir, params_dir, project_root

# Parameters every study notebook declares; the runner sets output_dir and sweep_dims itself.
COMMON_PARAMETERS = ("device", "output_dir", "sweep_dims")
RUNNER_SET = ("output_dir", "sweep_dims")
TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list": list}
RULE_KEYS = ("type", "min", "max", "choices", "pattern", "pattern_help", "power_of_two", "min_len", "max_len",
             "unique", "item", "kernel")
ALLOW_LARGE_ENV = "ATTNUM_ALLOW_LARGE"
PACKAGE = __package__.split(".")[0]  # "attnum"
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # lib/attnum


class ParameterError(ValueError):
    """A parameter set that must not run: names the key and what is allowed.

    In IPython (JupyterLab) it is shown as its one message: ``_render_traceback_`` is the hook IPython's
    ``showtraceback`` calls instead of formatting the frames (the library's frames say nothing more)."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


MAX_LIST_ITEMS = 4096  # entries of a list parameter whose schema sets no max_len (the committed sets hold <= 24)


def did_you_mean(name: str, known) -> str:
    """`` (did you mean 'x'?)`` when ``name`` is close to one of ``known`` (``difflib``), else ``""``."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


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


MAX_YAML_CHARS = 1 << 20  # a parameter value, set or grid file larger than this is refused unread
MAX_YAML_DEPTH = 32  # nesting of lists and mappings; the parameters nest two or three levels


def check_yaml_input(text: str, source: str) -> None:
    """Bounds checked before YAML is built: size, nesting, and no anchors or aliases (``&a``/``*a``: a few
    hundred bytes of aliases expand to gigabytes). Syntax errors are left to ``load_yaml`` to report."""
    if len(text) > MAX_YAML_CHARS:
        raise ParameterError(f"{source[:200]}: {len(text)} characters, more than the {MAX_YAML_CHARS} accepted")
    depth = 0
    starts = (yaml.FlowSequenceStartToken, yaml.FlowMappingStartToken, yaml.BlockSequenceStartToken,
              yaml.BlockMappingStartToken)
    ends = (yaml.FlowSequenceEndToken, yaml.FlowMappingEndToken, yaml.BlockEndToken)
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, (yaml.AnchorToken, yaml.AliasToken)):
                raise ParameterError(f"{source[:200]}, line {token.start_mark.line + 1}: YAML anchors and aliases "
                                     "(& and *) are not accepted; write the values out")
            depth += isinstance(token, starts) - isinstance(token, ends)
            if depth > MAX_YAML_DEPTH:
                raise ParameterError(f"{source[:200]}, line {token.start_mark.line + 1}: nested more than "
                                     f"{MAX_YAML_DEPTH} levels deep")
    except yaml.YAMLError:
        return


def load_yaml(text: str, source: str):
    """YAML as the project reads it: a repeated key is an error; errors name ``source`` and the line."""
    check_yaml_input(text, source)
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
    except UnicodeDecodeError as exc:
        raise ParameterError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
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


def resolve_study(text: str) -> str:
    """The study that ``text`` names: a study (``length_scaling``), its notebook's file stem
    (``01_length_scaling``) or the path of that notebook (``notebooks/01_length_scaling.ipynb``, relative to
    the working folder or to the project root). A path must be the project's own notebook: the runner runs
    ``notebooks/NN_<study>.ipynb``, never a copy elsewhere. Raises ``ParameterError`` otherwise."""
    known = studies()
    text = str(text)
    if text in known:
        return text
    path = Path(text)
    by_stem = {nb.stem: study for study, nb in known.items()}
    stem = path.stem if path.suffix == ".ipynb" else path.name
    study = by_stem.get(stem)
    if study is None:
        raise ParameterError(f"unknown study {text!r}{did_you_mean(stem, [*known, *by_stem])}; studies: "
                             f"{sorted(known)} (or their notebooks: {sorted(nb.name for nb in known.values())})")
    if path.suffix != ".ipynb" and len(path.parts) == 1:
        return study  # the notebook's file stem
    own = known[study].resolve()
    candidates = [c for c in (path, project_root() / path) if c.exists()]
    if any(c.resolve() == own for c in candidates):
        return study
    if candidates:
        raise ParameterError(f"{text} is not the project's notebook of study {study!r} ({own}); the runner runs "
                             "the project's notebooks only: edit that one, or run it in JupyterLab")
    raise ParameterError(f"no notebook {text}; the notebook of study {study!r} is {own}")


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
    placeholder = types.ModuleType(name, f"placeholder: {name} is imported on first use (attnum.runs.params)")

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
    """The allowed values of every parameter: ``schema.yaml``, one entry per parameter the notebook declares."""
    return _schema_file(study)


def parameter_names(study: str) -> list[str]:
    """The parameters a study declares (its schema's keys, kept equal to the notebook's by a test)."""
    return list(schema(study))


def param_sets(study: str) -> list[str]:
    """``default`` (the notebook's parameters cell) and every ``params/<study>/<name>.yaml``."""
    files = {p.stem for p in (params_dir() / study).glob("*.yaml") if p.stem != "schema"}
    return sorted(files | {"default"})


def is_param_file(name) -> bool:
    """Whether ``--params`` names a file (a path, or a name ending in ``.yaml``/``.yml``) rather than a set."""
    return isinstance(name, str) and (name.endswith((".yaml", ".yml")) or "/" in name or os.sep in name)


def normalize_param_set(study: str, name: str) -> str:
    """``--params`` as the runner records it: a named set as it is; a file of ``params/<study>/``
    (``params/length_scaling/smoke.yaml``, or ``smoke.yaml`` where no such file is in the working
    folder) as that set's name; any other file as its absolute path. Raises ``ParameterError`` for a
    file that does not exist, or for ``schema.yaml`` (the allowed values, not a parameter set)."""
    if not is_param_file(name):
        return name
    path = Path(name)
    own = params_dir() / study
    if not path.exists() and len(path.parts) == 1 and (own / path).is_file():
        path = own / path
    if not path.is_file():
        raise ParameterError(f"parameter file {name!r} does not exist (a YAML file of parameter: value "
                             f"lines); study {study!r} has the sets {param_sets(study)}")
    path = path.resolve()
    if path.parent == own.resolve() and path.suffix == ".yaml":
        if path.stem == "schema":
            raise ParameterError(f"{name} is study {study!r}'s schema (the allowed values), not a parameter set; "
                                 f"sets: {param_sets(study)}")
        return path.stem
    return str(path)


def set_label(name: str) -> str:
    """The parameter set's part of a run's folder name: the set's name, or a file's own name (``mine.yaml``)."""
    return Path(name).name if is_param_file(name) else name


def load_param_set(study: str, name: str) -> dict:
    """The values of a parameter set: ``default`` (the notebook's parameters cell), a named set
    (``params/<study>/<name>.yaml``) or a YAML file given by its path (``normalize_param_set``); a file is
    read as a named set is (no repeated keys, size and nesting bounds), and its values are then checked by
    the same schema and rules."""
    if is_param_file(name):
        name = normalize_param_set(study, name)
        if is_param_file(name):
            values = load_yaml_file(Path(name)) or {}
            if not isinstance(values, dict):
                raise ParameterError(f"{name} must hold a mapping of parameter names to values")
            return values
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
    root = PACKAGE_DIR
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


def _kernel_problem(name, device: str | None = "cpu") -> str | None:
    """None if ``name`` names a kernel of the registry (``attnum.kernels.get``); otherwise why not.
    A kernel of your own (``package.module:function``) must also run a tiny input on ``device``
    (None: a device not on this machine, where it is imported only).

    Checking a name imports torch and the kernels (about 1 s of a short run's start). A registry name
    that this exact code (``_code_key``: attnum's sources, torch's and Python's versions) accepted
    before is accepted again without the import; kernels of your own, and families registered at run
    time by other code, are checked every time.
    """
    if not isinstance(name, str):
        return f"a kernel name is a string, got {type(name).__name__}"
    if name in _known_registry_names():
        return None
    from .. import kernels

    try:
        kernel = kernels.get(name)
    except ValueError as exc:
        return str(exc)
    family = kernels.families().get(name.split(":")[0])
    if isinstance(kernel, kernels.CallableKernel) or family is None:
        return None if device is None else kernels.check_runs(kernel, device)
    if getattr(family.build, "__module__", "").startswith(PACKAGE + "."):  # a family of attnum's own code
        _remember_registry_name(name)
    return None


def _check_scalar(key: str, value, rule: dict, what: str = "", device: str | None = "cpu") -> None:
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
        problem = _kernel_problem(value, device)
        if problem:
            raise ParameterError(f"{where}: {value!r} is not a known kernel: {problem}")


def _check_value(study: str, key: str, value, type_name: str, rule: dict, device: str | None = "cpu") -> None:
    if type_name not in TYPES:
        raise ParameterError(f"parameter {key!r} has no checkable type ({type_name!r}); "
                             "annotate it in the notebook and in schema.yaml")
    if not _type_ok(value, type_name):
        raise ParameterError(f"parameter {key!r} must be of type {type_name}, "
                             f"got {type(value).__name__} {value!r}")
    if type_name != "list":
        _check_scalar(key, value, rule, device=device)
        return
    if "min_len" in rule and len(value) < rule["min_len"]:
        raise ParameterError(f"parameter {key!r} needs at least {rule['min_len']} entries, got {value!r}")
    if len(value) > rule.get("max_len", MAX_LIST_ITEMS):
        limit = (f"{rule['max_len']} entries (its schema's max_len)" if "max_len" in rule else
                 f"{MAX_LIST_ITEMS} entries (attnum's limit for a list parameter)")
        raise ParameterError(f"parameter {key!r} takes at most {limit}, got {len(value)}")
    item_rule = rule.get("item", {})
    for i, item in enumerate(value):
        item_type = item_rule.get("type")
        if item_type and not _type_ok(item, item_type):
            raise ParameterError(f"parameter {key!r}[{i}] must be of type {item_type}, "
                                 f"got {type(item).__name__} {item!r}")
        _check_scalar(key, item, item_rule, f"[{i}]", device)
    if rule.get("unique"):
        seen = {}
        for i, item in enumerate(value):
            marker = json.dumps(item, sort_keys=True)
            if marker in seen:
                raise ParameterError(f"parameter {key!r}: {item!r} appears twice (entries {seen[marker]} and {i}); "
                                     "its entries must be distinct")
            seen[marker] = i


def check_parameters(study: str, values: dict, *, machine: bool = True) -> None:
    """Raise ``ParameterError`` unless every key is declared, well typed, in range and the rules hold.

    The rules (``check_rules``) are checked on the notebook's defaults updated with ``values``.
    A kernel of your own is test-run on the run's ``device``; a device that is not there is refused
    first (``check_device``), with its own message. ``machine=False`` (checking a set meant for another
    machine) refuses no device; a kernel of your own is then test-run only if the device is here.
    """
    declared = declared_parameters(study)
    rules = schema(study)
    for key in values:
        if key not in declared:
            raise ParameterError(f"unknown parameter {key!r} for study {study!r}{did_you_mean(key, declared)}; "
                                 f"allowed parameters: {sorted(declared)}")
    device = "cpu"
    if "device" in declared:
        rule = rules.get("device", {})
        if "device" in values:
            _check_value(study, "device", values["device"], rule.get("type", declared["device"]["type"]), rule)
        device = str({**notebook_defaults(study), **values}.get("device", "cpu"))
        if machine:
            check_device(device)
        else:
            try:
                check_device(device)
            except ParameterError:
                device = None  # not on this machine: own kernels are imported, not run
    for key, value in values.items():
        if key == "device":
            continue
        rule = rules.get(key, {})
        _check_value(study, key, value, rule.get("type", declared[key]["type"]), rule, device)
    check_rules(study, {**notebook_defaults(study), **values})


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
    check_parameters(study, values, machine=machine)
    if machine:
        check_machine(study, values, allow_large=allow_large)
    return values


def requested_kernels(study: str, values: dict) -> list[str]:
    """The kernels a run of ``values`` (a set's values, over the notebook's defaults) asks for: every value of a
    parameter whose schema, or whose list items' schema, marks it ``kernel``, each name once, in the order of
    the parameters."""
    rules = schema(study)
    names: list[str] = []
    for key, value in {**notebook_defaults(study), **values}.items():
        rule = rules.get(key, {})
        if rule.get("kernel"):
            items = [value]
        elif rule.get("item", {}).get("kernel") and isinstance(value, list):
            items = value
        else:
            continue
        names += [name for name in items if isinstance(name, str) and name not in names]
    return names


def kernel_availability(study: str, param_set: str = "default", overrides: dict | None = None) -> tuple[str, dict]:
    """``(device, {kernel: reason or None})`` for the kernels a run of this set asks for (``requested_kernels``):
    None where the kernel runs on the set's device here, else why not (``Kernel.unavailable_reason``). A run
    records a kernel that cannot run as unavailable, with the reason, and goes on without it; a run meant to be
    committed checks this first. The set is checked (``resolve_parameters``, without the machine checks) before
    any kernel is asked."""
    from .. import kernels

    values = resolve_parameters(study, param_set, overrides, machine=False)
    device = str({**notebook_defaults(study), **values}.get("device", "cpu"))
    return device, {name: kernels.get(name).unavailable_reason(device) for name in requested_kernels(study, values)}


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


def check_machine(study: str, values: dict, *, allow_large: bool = False) -> None:
    """Refuse a device that is not there and a run whose estimated peak memory exceeds the machine's."""
    device = str({**notebook_defaults(study), **values}.get("device", "cpu"))
    check_device(device)
    if allow_large or os.environ.get(ALLOW_LARGE_ENV, "") not in ("", "0"):
        return
    check_address_space()
    estimate = memory_estimate(study, values)
    if estimate is None:
        return
    need, note = estimate
    have = machine_memory(device)
    if need > have:
        raise ParameterError(f"estimated peak memory {need / 2**30:.1f} GiB ({note}) exceeds the "
                             f"{have / 2**30:.1f} GiB of this machine's {device}; reduce the sizes, or pass "
                             f"allow_large=True ({ALLOW_LARGE_ENV}=1 on the command line) to run anyway")


# The address-space floor, measured (not chosen): `ulimit -v N` (KiB) in a subshell, then
# `ATTNUM_ALLOW_LARGE=1 python -m attnum run length_scaling --params smoke --timeout T` (the check itself
# off), on this 2-core CPU machine (torch 2.13 CPU, Python 3.11), one run per limit:
#   1,500,000 KiB (1.43 GiB): the kernel hangs in the cell that imports torch until --timeout (60 s) ends it
#   1,900,000 KiB (1.81 GiB): the cell fails with no error name or message ("CellExecutionError", empty)
#   2,050,000 KiB (1.96 GiB), 2,200,000, 2,350,000 (also with OMP_NUM_THREADS=16), 2,500,000, 3,000,000,
#   8,000,000 KiB: the run succeeds
# So a smoke run needs about 2 GiB of address space; the refusal is at 3 GiB, a margin of 1.5x for larger
# parameter sets, more threads and other machines' libraries (the data themselves are bounded separately,
# by memory_estimate against the machine's memory).
MIN_ADDRESS_SPACE = 3 << 30  # bytes of virtual memory below which a study kernel is not started


def check_address_space() -> None:
    """Refuse to start a kernel under an address-space limit (``ulimit -v``) below ``MIN_ADDRESS_SPACE``.

    Under such a limit the kernel's imports fail inside native extension code, where the kernel can hang
    in a cell until it is killed (measured: 1.43 GiB), or its errors arrive without name or message
    (1.81 GiB); a smoke run succeeded from 1.96 GiB (see ``MIN_ADDRESS_SPACE``). The limit is inherited by
    the kernel, so it is checked here, before anything runs.
    """
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft < MIN_ADDRESS_SPACE:
        raise ParameterError(f"this process's address-space limit (ulimit -v) is {soft / 2**30:.2f} GiB, below the "
                             f"{MIN_ADDRESS_SPACE / 2**30:.0f} GiB a study kernel needs to import torch and "
                             "matplotlib (under less it can hang or fail without a message); raise it "
                             f"(ulimit -v unlimited), or pass allow_large=True ({ALLOW_LARGE_ENV}=1) to run anyway")


def check_device(device: str) -> None:
    """Refuse a CUDA device that this machine does not have (a CPU device is always there)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ParameterError(f"parameter 'device': {device!r} was asked for but torch sees no CUDA device "
                                 "on this machine")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise ParameterError(f"parameter 'device': {device!r} was asked for but this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s)")



# -- the study's own rules and memory estimate (attnum.studies.<study>) --

def study_module(study: str):
    """The study package ``attnum.studies.<study>`` if it exists (imported: it is light), else None."""
    name = f"{PACKAGE}.studies.{study}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.submodule_search_locations is None:
        return None
    return importlib.import_module(name)


def _study_function(study: str, name: str):
    function = getattr(study_module(study), name, None)
    return function if callable(function) else None


def _named_in(message: str, full: dict) -> str:
    """``name=value`` of every parameter that ``message`` names (as a whole word)."""
    named = sorted(n for n in full if re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message))
    return ", ".join(f"{n}={full[n]!r}" for n in named)


def check_rules(study: str, full: dict) -> None:
    """Raise ``ParameterError`` for the first rule between parameters that ``full`` (every value) breaks:
    the study's ``rules(p)``, with the values of the parameters its message names."""
    rules = _study_function(study, "rules")
    if rules is None:
        return
    try:
        messages = list(rules(copy.deepcopy(full)) or [])
    except (ValueError, TypeError, ArithmeticError, KeyError, IndexError) as exc:
        raise ParameterError(f"the rules of study {study!r} cannot be checked ({type(exc).__name__}: {exc})"
                             ) from None
    for message in messages:
        got = _named_in(message, full)
        raise ParameterError(f"parameters break a rule of study {study!r}: {message}" + (f" (got {got})" if got else ""))


def memory_estimate(study: str, values: dict) -> tuple[int, str] | None:
    """(bytes, note) of the study's peak-memory estimate (its ``memory_estimate(p)`` on the notebook's
    defaults updated with ``values``), or None when it declares none."""
    estimator = _study_function(study, "memory_estimate")
    if estimator is None:
        return None
    full = {**notebook_defaults(study), **values}
    try:
        estimate = estimator(copy.deepcopy(full))
    except (ValueError, TypeError, ArithmeticError, KeyError, IndexError) as exc:
        raise ParameterError(f"the memory estimate of study {study!r} cannot be computed "
                             f"({type(exc).__name__}: {exc})") from None
    if estimate is None:
        return None
    need, note = estimate
    return int(need), str(note or "")
