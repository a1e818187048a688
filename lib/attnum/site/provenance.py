"""A run's provenance as markdown: commit, versions, device, the packages off the pins, and the parameters
that differ from the notebook's defaults.
"""
from __future__ import annotations

import ast
import json
import re

from ..runs.plan import MAX_LABEL
from .common import _cell, _code, _json_attr, _text, is_gpu_run, off_pins


def _versions(prov: dict) -> str:
    versions = _json_attr(prov, "package_versions")
    keep = [k for k in ("python", "torch", "numpy", "xarray") if k in versions]
    text = ", ".join(f"{k} {versions[k]}" for k in keep) or "not recorded"
    accel = _json_attr(prov, "accelerator_versions")  # a run on a GPU: what decides its kernels
    if accel.get("gpu", "none") != "none":
        text += "; " + ", ".join(f"{k} {accel[k]}" for k in ("torch", "cuda", "cudnn", "triton", "driver") if k in accel)
    return text


def _device_label(entry: dict) -> str:
    device = entry.get("provenance", {}).get("device", "") or entry["record"].get("parameters", {}).get("device", "")
    if (entry["record"].get("parameters") or {}).get("gpu_records"):  # a gpu_training tier: GPU records, read on `device`
        return f"GPU training records, gathered on {device or 'this machine'}"
    kind = "GPU" if is_gpu_run(entry["run"], device) else "CPU"
    return f"{kind} ({device})" if device else kind


def _commit(prov: dict, table: bool = False) -> str:
    commit = prov.get("git_commit", "")
    if not commit:
        return "not recorded"
    return _code(commit[:12], table) + (" (uncommitted changes)" if prov.get("git_dirty") == "true" else "")


def _pins_md(prov: dict) -> str:
    """Whether the run used the pinned versions (``requirements.txt``, ``environment.yml``), with each difference."""
    off = off_pins(prov)
    if not off:
        return "the pinned versions (`requirements.txt`, `environment.yml`)"
    return ("**made off the pins**: " + ", ".join(f"{_text(k)} {_code(ran)} (pinned {_code(pin)})" for k, ran, pin in off)
            + "; its numbers may differ from a run on the pinned versions")


def short_label(name: str, limit: int = MAX_LABEL) -> str:
    """A run's name as a table, caption or link shows it: as it is up to ``limit`` characters (``MAX_LABEL``:
    every name of one's own, ``--name``), else its parameter set and the hash the runner appends to long names
    (``gpu…h5172af6ac6``), or its head and tail. The run's own page states the whole name once (provenance)."""
    name = str(name)
    if len(name) <= limit:
        return name
    head = re.split(r"__|@", name, maxsplit=1)[0][:limit // 2]
    m = re.search(r"-(h[0-9a-f]{6,})$", name)
    return f"{head}…{m.group(1) if m else name[-(limit // 2):]}"


def _provenance_md(entry: dict, nav: str) -> str:
    prov, record = entry.get("provenance", {}), entry["record"]
    overrides = record.get("overrides") or {}
    if not isinstance(overrides, dict):
        overrides = {"?": overrides}
    rows = [("run", f"{_code(entry['study'] + '/' + entry['run'])} ({_text(KIND_LABELS.get(entry['kind'], entry['kind']))})"),
            ("parameter set", _code(record.get("param_set", "?"))
             + (", overrides " + ", ".join(_code(f"{k}={json.dumps(v)}") for k, v in overrides.items()) if overrides else "")),
            ("device", _text(_device_label(entry))),
            ("created", _text(prov.get("created") or record.get("finished") or record.get("started", ""))),
            ("git commit", _commit(prov)),
            ("versions", _text(_versions(prov)))]
    if _json_attr(prov, "package_versions"):
        rows.append(("pinned versions", _pins_md(prov)))
    backends = _json_attr(prov, "real_kernel_backends")
    if backends:
        rows.append(("real kernels ran as", "; ".join(f"{_code(k)}: {_text(v)}" for k, v in backends.items())))
    if entry.get("figures") is not None and (entry["dir"] / "results.nc").exists() and not entry["failed"]:
        unverified = (" (a kernel report records no checksum: Fletcher-32 checked while reading)"
                      if entry.get("kind") == "report" else " (no checksum recorded)")
        rows.append(("data", "[results.nc](results.nc)" + ("" if entry.get("verified") else unverified)
                     + (" (figures not hashed: recorded before figure hashes)"
                        if entry.get("figures") and not entry.get("figures_verified") else "")))
    if entry["failed"]:
        rows.append(("error", _code(entry.get("error", ""))))
    items = "\n".join(f"* **{k}**: {_cell(v)}" for k, v in rows)
    return f"{nav}\n\n:::{{admonition}} Provenance of this run\n:class: note\n\n{items}\n:::\n"


KIND_LABELS = {"result": "CPU result", "gpu": "GPU result", "smoke": "smoke run", "sweep": "sweep point",
               "lab": "JupyterLab run", "failed": "failed run", "damaged": "damaged", "report": "kernel report"}


def _same_value(value, default, shown: str) -> bool:
    """Whether a run's value is the notebook's default (source text of a Python literal): compared as values,
    so ``[false, true]`` from RUN.json equals the default ``[False, True]``."""
    try:
        return ast.literal_eval(str(default)) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return shown.replace("'", '"') == str(default).replace("'", '"')


def _parameter_table(entry: dict, params_cell) -> str:
    """The run's parameters (RUN.json) with the notebook's defaults and help, changed values in bold."""
    values = dict(entry["record"].get("parameters") or {})
    info = {}
    if params_cell is not None:
        try:
            from papermill.translators import PythonTranslator

            info = {p.name: p for p in PythonTranslator.inspect(params_cell)}
        except Exception:  # a parameters cell papermill cannot read: the values alone
            info = {}
    for name, p in info.items():
        if name not in values and name not in ("output_dir", "sweep_dims"):
            values[name] = p.default
    lines = ["| parameter | this run | notebook default | meaning |", "|---|---|---|---|"]
    differs = []
    for name, value in values.items():
        shown = json.dumps(value) if not isinstance(value, str) or name not in info else repr(value)
        default = info[name].default if name in info else ""
        changed = name in info and not _same_value(value, default, shown)
        cell = f"**{_code(shown, True)}**" if changed else _code(shown, True)
        if changed:
            differs.append(f"{_code(name)} = {_code(shown)} (default {_code(default)})")
        lines.append(f"| {_code(name, True)} | {cell} | {_code(default, True) if str(default) else ''} | "
                     f"{_text(info[name].help if name in info else '')} |")
    sweep = entry["record"].get("sweep_dims") or []
    note = f" Swept here: {', '.join(_code(d) for d in sweep)}." if sweep else ""
    if not info:
        head = "The notebook's parameters cell was not read: the values of this run alone."
    elif differs:
        head = "**Differs from the notebook's defaults**: " + "; ".join(differs) + "."
    else:
        head = "Every parameter has the notebook's default."
    return (f"## Parameters of this run\n\n{head}{note}\n\n"
            f'<details class="attnum-fold attnum-params"><summary>All {len(values)} parameters: this run\'s values '
            "(from <code>RUN.json</code>), the notebook's defaults, their meaning</summary>\n\n"
            "**Bold**: differs from the notebook's default.\n\n" + "\n".join(lines) + "\n\n</details>\n")
