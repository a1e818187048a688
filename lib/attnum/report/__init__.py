"""``python -m attnum report KERNEL [KERNEL ...]``: is a kernel's error what a correct kernel of its
precision makes, and where does it break? One executed notebook (``notebooks/report.ipynb``), its
``results.nc`` and a standalone HTML page under ``<outputs>/report/<name>/``.

``experiments`` (the studies' kernel-facing experiments called as they are), ``rates`` (false alarms
and misses of ``attnum.testing.assert_attention_close``), ``readings`` (verdicts, tables, glued values).
Tiers: ``params/report/<tier>.yaml`` (``quick``: minutes on a CPU; ``full``).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

TIERS = ("quick", "full")
NOTEBOOK = "report.ipynb"


class ReportError(ValueError):
    """Bad input to the report (a kernel that cannot run, an unknown tier): the message says what."""


def _root() -> Path:
    return Path(__file__).resolve().parents[3]


def load_tier(tier: str) -> dict:
    """The sizes of a tier (``params/report/<tier>.yaml``)."""
    import yaml

    if tier not in TIERS:
        raise ReportError(f"unknown tier {tier!r}; tiers: {list(TIERS)}")
    return yaml.safe_load((_root() / "params" / "report" / f"{tier}.yaml").read_text())


def default_against(device: str) -> list[str]:
    """Registry kernels set beside the kernels under test: SDPA's backends that run on ``device``."""
    return ["sdpa:math"] if device == "cpu" else ["sdpa:flash", "sdpa:efficient", "sdpa:cudnn", "sdpa:math"]


def check_kernels(names, device: str, head_dim: int = 64) -> None:
    """Every name builds a kernel that runs forward and backward on a tiny bf16 input of ``head_dim`` (the
    head dim the tier measures at) on ``device`` (``kernels.check_runs``), else a ``ReportError`` naming each
    problem, before any measurement."""
    import torch

    from .. import kernels

    if not names:
        raise ReportError("name at least one kernel (a registry name or package.module:function)")
    problems = []
    for name in names:
        try:
            kernel = kernels.get(name)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        dtype = torch.bfloat16
        reason = kernels.check_runs(kernel, device, dtype=dtype, head_dim=head_dim)
        if reason:
            problems.append(f"kernel {name!r} cannot be measured on {device}: {reason}")
    if problems:
        raise ReportError("; ".join(problems))


def defer_unused_imports() -> None:
    """In the notebook kernel, before gluing: defer what nothing here uses, as the runner does for study
    notebooks (``attnum.runs.params.DEFERRED_IMPORTS``). MyST-NB's ``glue`` imports nbformat, whose
    jsonschema imports ``rfc3987_syntax``, which builds its grammar on import: about 2.5 s of the quick
    tier's CPU time here, for IRI checks that nothing in the report makes (loaded on first use if one is)."""
    from ..runs import params

    for module, functions in params.DEFERRED_IMPORTS.items():
        params._defer_import(module, functions)


def report_name(names) -> str:
    """A folder name from the kernels: their names with ':' and '.' as '-', at most 80 characters."""
    text = "+".join("".join(c if c.isalnum() or c in "_-" else "-" for c in n) for n in names)
    return text[:80] or "report"


def run_report(names, *, device: str = "cpu", tier: str = "quick", against=None, outputs=None,
               overrides: dict | None = None, name: str | None = None, html: bool = True,
               progress: bool = True) -> Path:
    """Check the kernels, execute the report notebook with papermill into ``<outputs>/report/<name>/``
    (``notebook.ipynb``, ``results.nc``), then render ``report.html`` (nbconvert). Returns the folder."""
    from ..paths import outputs_root
    from ..runs import execute
    from ..runs.params import import_papermill

    names = list(dict.fromkeys(names))
    against = default_against(device) if against is None else list(against)
    params = load_tier(tier)
    unknown = sorted(set(overrides or {}) - set(params))
    if unknown:
        raise ReportError(f"unknown report parameter(s) {unknown}; parameters: {sorted(params)}")
    merged = {**params, **(overrides or {})}
    check_kernels(names + [a for a in against if a not in names], device, head_dim=int(merged["backward_head_dim"]))
    folder = (Path(outputs).resolve() if outputs else outputs_root()) / "report" / (name or report_name(names))
    folder.mkdir(parents=True, exist_ok=True)
    papermill = import_papermill()
    nb = _root() / "notebooks" / NOTEBOOK
    injected = {"kernel_names": names, "against": against, "device": device, "tier": tier,
                "overrides": dict(overrides or {}), "output_dir": str(folder)}
    start = time.perf_counter()
    # as the runner runs a study (attnum.runs.execute.run): the kernel on IPC sockets of this user's own
    # (no "Kernel is running over TCP" warning), the notebook written at most once a second while cells
    # run, and the kernel stopped at once when the last cell has finished (every output has arrived)
    with execute._env("PYTHONPATH", _pythonpath(names)), execute._env("ATTNUM_PROGRESS", None if progress else "off"), \
            execute.kernel_transport() as transport:
        papermill.execute_notebook(str(nb), str(folder / "notebook.ipynb"), parameters=injected,
                                   progress_bar=False, cwd=str(nb.parent), kernel_name="python3",
                                   engine_name=execute._register_engine(papermill), shutdown_kernel="immediate",
                                   **transport)
    if not (folder / "results.nc").exists():
        raise ReportError(f"the report notebook finished without writing {folder / 'results.nc'}")
    if html:
        write_html(folder / "notebook.ipynb", folder / "report.html")
    (folder / "REPORT.json").write_text(json.dumps({**injected, "seconds": time.perf_counter() - start}, indent=2))
    return folder


def _module_roots(names) -> list[str]:
    """The folders this process imported the kernels of one's own (``package.module:function``) from."""
    import sys

    roots = []
    for name in names:
        top = name.split(":", 1)[0].split(".")[0]
        module = sys.modules.get(top)
        path = getattr(module, "__file__", None)
        if path:
            path = Path(path).resolve()
            roots.append(str(path.parent.parent if path.name == "__init__.py" else path.parent))
    return roots


def _pythonpath(names=()) -> str:
    """The notebook kernel's PYTHONPATH: this attnum first, then this process's entries, its working
    directory and the folders the kernels of one's own were imported from, made absolute."""
    from ..runs import execute

    entries = execute.kernel_pythonpath().split(os.pathsep)
    for extra in [os.getcwd()] + _module_roots(names):
        if extra not in entries:
            entries.append(extra)
    return os.pathsep.join(entries)


_GLUE_ROLE = re.compile(r"\{glue(?::[a-z]+)?\}`([^`:]+)(?::([^`]*))?`")
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_{}\[\]<>()#+!|~-])")


def _glued_text(value, spec: str | None) -> str:
    """A glued value as the markdown's text: formatted by the role's spec (numbers), every markdown
    character of a string escaped (a value is data, never markup)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and spec:
        text = format(value, spec)
    else:
        text = str(value)
    return _MARKDOWN_SPECIALS.sub(r"\\\1", text)


def substitute_glue(nb) -> object:
    """A copy of an executed notebook whose markdown states the glued values in place of MyST's glue roles
    (nbconvert renders no MyST roles; the site's MyST-NB does). A role whose key was not glued raises."""
    import copy

    from ..glue import read_glued

    values = read_glued(nb)
    out = copy.deepcopy(nb)

    def replace(match):
        key, spec = match.group(1), match.group(2)
        if key not in values:
            raise ReportError(f"the report's markdown refers to {key!r}, which the run did not glue")
        return _glued_text(values[key], spec)

    for cell in out.cells:
        if cell.cell_type == "markdown":
            cell.source = _GLUE_ROLE.sub(replace, cell.source)
    return out


def _glue_record(output) -> bool:
    """An output that only records a glued value (MyST-NB's ``application/papermill.record/...``
    mimetypes), which nbconvert cannot show (it warns "is not able to be represented")."""
    data = output.get("data") or {}
    return bool(data) and all(key.startswith("application/papermill.record/") for key in data)


def write_html(notebook: Path, target: Path) -> Path:
    """The executed notebook as one standalone HTML file, glued values in its prose, code cells hidden
    (nbconvert's HTML exporter)."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = substitute_glue(nbformat.read(str(notebook), as_version=4))
    for cell in nb.cells:  # the glued values' hidden outputs: stated in the prose now, and no HTML has them
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not _glue_record(o)]
    exporter = HTMLExporter()
    exporter.exclude_input = True
    body, _ = exporter.from_notebook_node(nb)
    target.write_text(body)
    return target
