"""Publish the executed study notebooks as a Sphinx site (MyST-NB) under ``outputs/site/``.

``python -m attnum publish`` (``make publish``) builds the site the way the Jupyter ecosystem
publishes notebook collections: Sphinx with MyST-NB, ``nb_execution_mode = "off"`` (the executed
notebooks under ``outputs/`` are rendered, never re-executed), the sphinx-book-theme (its assets are
bundled: a page reads offline, no CDN).

* ``index.html``: results first: one headline figure (the first study's), then the studies' findings
  (one sentence each, written by the notebook's author in its metadata, ``metadata.attnum.finding``,
  with glue roles that the site fills with the linked run's glued values, escaped), then the five
  studies in order, each with its question (the title cell), headline figure (``results.nc``'s
  ``headline_figure``; full size on click), finding and runs (short labels; whether each used the
  pinned versions): CPU and GPU runs side by side (a run named ``gpu`` or whose ``device`` attribute
  names CUDA is a GPU run); then the kernel reports (``outputs/report/<name>/``, ``python -m attnum
  report``), each a page of the site.
* ``<study>/<run>/notebook.html``: the executed notebook of each run, opening with its headline figure
  and its conclusions (the markdown cell tagged ``summary``), then the run's provenance (git commit,
  versions, device, created, and the packages whose versions differ from ``requirements.txt`` /
  ``environment.yml``'s pins). Code hidden but openable (``hide-input``); the injected-parameters
  cell becomes the parameters that differ from the notebook's defaults, with the whole table folded;
  no stderr output; a table output whose every value is 0 or NaN folded; wide tables scroll inside
  the column. The page's table of contents is in the right sidebar. ``results.nc`` and the figures
  are copied beside it.
* ``README.md``'s opening block (``python -m attnum readme-findings [--check]``, ``readme_findings``): the
  landing page's headline figure and findings, read from the committed runs only (git-tracked ``RUN.json``),
  each finding ending with its run and commit; a finding whose run lacks a value it states is not stated but
  named with the keys it lacks (``stated_finding``).
* ``runs.html`` ("Other runs"): smoke runs, sweep points (``@`` in the name), JupyterLab runs
  (``lab-<time>``), failed runs (with their error) and damaged runs; none of them is mixed with
  the results.

Every run's files are first copied into the build folder (from the version folder its pointer names
at that moment) and the copy is checked and read: the page, ``results.nc`` and figures published
for a run are one run's, even when a run finishes during ``publish``.
Each run's copy is checked (``ncio.verify_run``: RUN.json present and unaltered, sha256 of
results.nc and notebook.ipynb, Fletcher-32 checksums while reading): a damaged run is named on
the landing page and on "Other runs", and the others are published; ``publish`` then raises
``PublishError`` (the command line exits non-zero) after writing the site. One publish at a time per
outputs folder (``fcntl.flock`` on ``.publish.lock``); each builds in its own temporary folder and
replaces ``site/`` only when Sphinx succeeded. A missing outputs folder is an error, not an empty site.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from . import glue, ncio
from .paths import UnsafePathError, open_own_file, outputs_root, pointer_target
from .runs import SWEEP_MARK, RunError, studies
from .runs.plan import MAX_LABEL
from .runs.store import PUBLISH_LOCK, SITE, publish_lock_held

LOCK = PUBLISH_LOCK
OTHER = "runs"  # the "Other runs" page
SOURCES = "sources"  # docs/sources.md: the source documents and papers the studies cite
KIND_TITLES = {"smoke": "Smoke runs", "sweep": "Sweep points", "lab": "JupyterLab runs",
               "failed": "Failed runs", "damaged": "Damaged runs (not published)"}
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
SAFE_NAME = re.compile(r"[A-Za-z0-9_.@=,+-]+")  # study, run and figure names that reach a page (paths, links)

CONF_PY = '''\
# Written by attnum.site for one build; edit lib/attnum/site.py instead.
project = "attnum"
author = "attnum"
extensions = ["myst_nb"]
nb_execution_mode = "off"          # render the executed notebooks as they are, never re-execute
nb_output_stderr = "remove"        # progress bars and warnings are not part of a page
nb_merge_streams = True
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type", "misc.highlighting_failure", "toc.not_included"]
html_theme = "sphinx_book_theme"
html_title = "Numerical deviation of attention kernels"
html_static_path = ["_static"]
templates_path = ["_templates"]   # search.html: the note that search needs a web server (SEARCH_NOTE)
html_css_files = ["attnum.css"]
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "show_navbar_depth": 1,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "secondary_sidebar_items": ["page-toc"],
}
'''

CSS = """\
.attnum-figs { display: flex; flex-wrap: wrap; gap: 1.5em; align-items: flex-start; }
.attnum-figs figure { flex: 1 1 22em; margin: 0; }
.attnum-figs img { max-width: 100%; height: auto; border: 1px solid #ddd; }
.attnum-damaged, .attnum-damaged p { color: #a00; }
.attnum-offpins, .attnum-offpins p { color: #8a4b00; }
/* a figure keeps its aspect ratio wherever the column caps its width */
.bd-article img { max-width: 100%; height: auto; }
/* pandas Styler and DataFrame tables: cell padding; a wide table scrolls inside the column */
.bd-article .cell_output .output, .bd-article .cell_output > div { max-width: 100%; overflow-x: auto; }
.bd-article .cell_output table td, .bd-article .cell_output table th { padding: 0.2em 0.6em; }
.bd-article table { max-width: 100%; }
.bd-article .pst-scrollable-table-container, .bd-article .table-wrapper { overflow-x: auto; max-width: 100%; }
/* a long run name in prose or a list (the provenance row states it whole) wraps instead of widening the page */
.bd-article p code, .bd-article li code { overflow-wrap: anywhere; }
details.attnum-fold { margin: 0.5em 0 1em 0; }
details.attnum-fold > summary { cursor: pointer; color: #555; }
"""
SERVE_COMMAND = "python -m http.server -d outputs/site"  # what a reader runs to search the site
# Sphinx's search page reads each result's page with the browser's fetch() to show an excerpt
# (sphinx/themes/basic/static/searchtools.js); browsers refuse fetch() for pages opened as files (file://).
SEARCH_NOTE = ("Search needs a web server: for pages opened as files (file://), browsers refuse the requests the "
               f"search page makes to read the pages it finds. From the project root, run {SERVE_COMMAND} "
               "and open http://localhost:8000/ (the other pages read fine as files).")
SEARCH_TEMPLATE = """{%- extends "!search.html" %}
{% block docs_body %}
<div class="admonition note attnum-search-note"><p class="admonition-title">Search and file://</p>
<p>""" + SEARCH_NOTE.replace(SERVE_COMMAND, f"<code>{SERVE_COMMAND}</code>") + """</p></div>
{{ super() }}
{% endblock docs_body %}
"""
SNAPSHOT_FILES = ("RUN.json", "FAILED", "results.nc", "notebook.ipynb")
REPORTS = "report"  # outputs/report/<name>/: the kernel reports of ``python -m attnum report``
REPORT_FILES = ("REPORT.json", "results.nc", "notebook.ipynb")
SUMMARY_TAG = "summary"  # the notebook's conclusions cell: the study page opens with it
ROOT = Path(__file__).resolve().parents[2]


class PublishError(RunError):
    """The site was written, but some runs could not be published (named), or nothing could be."""


# -- reading a notebook's story --

def _title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


def _short_title(title: str, study: str) -> str:
    """``01 · Length scaling`` from ``01 · Length scaling: how ...``."""
    return re.split(r"[:,]", title)[0].strip() if title else study


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def _question(nb) -> str:
    """The title cell's "**Question.**" paragraph (else its first paragraph after the title)."""
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if first is None:
        return ""
    paras = [p for p in _paragraphs(first.source) if not p.startswith("# ")]
    for p in paras:
        if p.startswith("**Question"):
            return p
    return paras[0] if paras else ""


_GLUE_ROLE = re.compile(r"\{glue(?::[a-z]+)?\}`([^`:]+)(?::([^`]*))?`")


def _glued_text(value, spec: str | None) -> str:
    """A glued value as plain Markdown text: numbers formatted by the role's spec, every string escaped."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and spec:
        with contextlib.suppress(ValueError, TypeError):
            return _text(format(value, spec))
    return _text(value)


def _finding_template(nb) -> str:
    """The study's one-sentence finding, written by its author in the notebook's metadata
    (``metadata.attnum.finding``: Markdown whose numbers are glue roles of the notebook's own keys)."""
    meta = (nb.metadata.get("attnum") or {}) if nb is not None else {}
    value = meta.get("finding", "") if isinstance(meta, dict) else ""
    return value if isinstance(value, str) else ""


def render_finding(template: str, values: dict) -> str | None:
    """``template`` with each glue role replaced by the run's glued value (escaped); ``None`` when the run
    glued none of the values the template states (a run made before they were glued)."""
    keys = _GLUE_ROLE.findall(template)
    if not template or (keys and not any(k in values for k, _ in keys)):
        return None
    return _cell(_GLUE_ROLE.sub(lambda m: _glued_text(values.get(m.group(1), glue.MISSING), m.group(2)), template))


def _summary_cell_index(nb) -> int | None:
    """The notebook's conclusions: the markdown cell tagged ``summary`` (else, in a notebook executed before
    the tag, the cell that opens with a ``Conclusions`` heading)."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and SUMMARY_TAG in cell.metadata.get("tags", []):
            return i
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("## Conclusions"):
            return i
    return None


def _error_summary(nb, record: dict) -> str:
    """What went wrong in a failed run: the notebook's error output (``Name: message``), not cell source."""
    if nb is not None:
        for cell in nb.cells:
            for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
                if out.get("output_type") == "error":
                    where = f" (cell [{cell.execution_count}])" if cell.get("execution_count") else ""
                    return _ANSI.sub("", f"{out.get('ename', 'Error')}: {out.get('evalue', '')}")[:400] + where
    text = _ANSI.sub("", str(record.get("error", "")))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt|Terminated|Exit)\b", line):
            return line[:400]
    return lines[0][:400] if lines else "failed (no error recorded)"


# -- runs --

def _run_folders(base: Path):
    """``(study, run folder, damage or None)`` of every run under ``base``: a folder that cannot be read,
    a link that is not a run pointer to a version of its own, or a name that is not plain text is damage."""
    for study_dir in sorted(p for p in base.iterdir() if p.name != SITE and not p.name.startswith(".")):
        if study_dir.is_symlink():
            yield study_dir.name, study_dir, f"study folder {study_dir} is a symbolic link; not followed"
            continue
        if not study_dir.is_dir():
            continue
        try:
            listing = sorted(p for p in study_dir.iterdir() if not p.name.startswith("."))
        except OSError as exc:
            yield study_dir.name, study_dir, f"study folder {study_dir} cannot be read ({exc})"
            continue
        for run_dir in listing:
            label = f"run {study_dir.name}/{run_dir.name}"
            if run_dir.is_symlink() and pointer_target(study_dir, run_dir.name) is None:
                yield study_dir.name, run_dir, f"{label} is a symbolic link to no version of its own; not followed"
                continue
            try:
                if not run_dir.is_dir() or not any(_present(run_dir / f) for f in
                                                   ("RUN.json", "results.nc", "notebook.ipynb", "FAILED")):
                    continue
            except OSError as exc:
                yield study_dir.name, run_dir, f"{label} cannot be read ({exc})"
                continue
            if not (SAFE_NAME.fullmatch(study_dir.name) and SAFE_NAME.fullmatch(run_dir.name)):
                yield study_dir.name, run_dir, (f"{label}: its name holds characters other than letters, digits "
                                                "and _ . @ = , + -")
                continue
            yield study_dir.name, run_dir, None


def _present(path: Path) -> bool:
    """Whether ``path`` exists; ``PermissionError`` where its folder cannot be read (``os.path.lexists``
    would answer False there, and the run would vanish from the site unnamed)."""
    try:
        os.lstat(path)
        return True
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _publish_lock(base: Path):
    with os.fdopen(open_own_file(base, base / LOCK, os.O_RDWR | os.O_CREAT), "r+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # a second publish waits for the first
        yield


# -- the snapshot a page is rendered from --

def _copy_plain(src: Path, dest: Path, name: str) -> bool:
    """Copy ``src/name`` to ``dest/name`` without following a link or blocking on a FIFO; False where absent.
    ``DamagedRunError`` for a link, a folder or a FIFO in a file's place."""
    try:
        fd = open_own_file(src, src / name)
    except FileNotFoundError:
        return False
    except UnsafePathError as exc:
        raise ncio.DamagedRunError(f"{name} is not a plain file ({exc})") from None
    with os.fdopen(fd, "rb") as fin, open(dest / name, "xb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    return True


def _copy_run(src: Path, dest: Path, names) -> None:
    dest.mkdir(parents=True)
    for name in names:
        _copy_plain(src, dest, name)
    for name in sorted(os.listdir(src)):
        if name.endswith(".png"):
            if not ncio.FIGURE_NAME.fullmatch(name):
                raise ncio.DamagedRunError(f"figure {name!r} holds characters other than letters, digits and _ . @ = , + -")
            _copy_plain(src, dest, name)


def _snapshot(study: str, run_dir: Path, dest: Path, names=SNAPSHOT_FILES) -> Path:
    """Copy one run's files (record, results, notebook, figures) into ``dest`` from the version folder its
    pointer names at this moment, then let the caller verify the copy: the page, ``results.nc`` and the
    figures published are then one version's, even when a run finishing meanwhile swaps the pointer (the
    version the pointer named when the copy began is published; a newer one, by the next ``publish``). A
    copy that loses a file to that swap (an old version removed while it is read) is made again, whole,
    from the new version, at most three times."""
    for attempt in range(3):
        source = pointer_target(run_dir.parent, run_dir.name) or run_dir
        if dest.exists():
            shutil.rmtree(dest)
        try:
            _copy_run(source, dest, names)
        except FileNotFoundError:
            if attempt < 2 and (pointer_target(run_dir.parent, run_dir.name) or run_dir) != source:
                continue
            raise
        except ncio.DamagedRunError as exc:
            raise ncio.DamagedRunError(f"run {study}/{run_dir.name}: {exc}") from None
        return source
    return source


def _snapshot_checked(study: str, run_dir: Path, dest: Path, check, names=SNAPSHOT_FILES):
    """``check(dest)`` on a fresh snapshot of ``run_dir``; a failure is read again once when the run's pointer
    moved meanwhile (a run that finished during the copy), and is named as the run's, not the copy's."""
    for attempt in range(2):
        source = _snapshot(study, run_dir, dest, names)
        try:
            return check(dest)
        except ncio.DamagedRunError as exc:
            if attempt == 0 and (pointer_target(run_dir.parent, run_dir.name) or run_dir) != source:
                continue
            text = str(exc).replace(ncio.logical_run_path(dest), f"{study}/{run_dir.name}")
            raise ncio.DamagedRunError(text) from None
    raise AssertionError("unreachable")


def is_gpu_run(name: str, device: str) -> bool:
    """A run named ``gpu`` or whose recorded device names CUDA."""
    return name == "gpu" or "cuda" in str(device).lower()


def _kind(entry: dict) -> str:
    name, record = entry["run"], entry["record"]
    if entry.get("damaged"):
        return "damaged"
    if entry["failed"]:
        return "failed"
    if name.startswith("lab-") or record.get("status") == "lab" or record.get("param_set") == "lab":
        return "lab"
    if SWEEP_MARK in name:
        return "sweep"
    if record.get("param_set") == "smoke" or re.split(r"[+,]", name)[0] == "smoke":
        return "smoke"
    return "gpu" if is_gpu_run(name, entry.get("provenance", {}).get("device", "")) else "result"


def _collect(study: str, run_dir: Path, snapshots: Path | None = None) -> dict:
    """Check one run and read what the site needs; raises ``DamagedRunError`` naming what is wrong.
    With ``snapshots``, the run's files are first copied to ``snapshots/<study>/<run>`` and the copy is
    checked and read (``entry["dir"]``): everything published of the run comes from that copy."""
    if snapshots is None:
        return _read_run(study, run_dir, run_dir)
    return _snapshot_checked(study, run_dir, snapshots / study / run_dir.name,
                             lambda folder: _read_run(study, run_dir, folder))


def _read_run(study: str, run_dir: Path, folder: Path) -> dict:
    failed = run_dir.name.endswith(".failed") or (folder / "FAILED").exists()
    record = ncio.verify_run(folder) if not failed else ncio.read_record(folder)
    entry = {"study": study, "run": run_dir.name, "dir": folder, "source": run_dir, "record": record, "nb": None,
             "failed": failed or record.get("status") in ("failed", "interrupted"), "figures": []}
    run_dir = folder
    nb_file = run_dir / "notebook.ipynb"
    if nb_file.exists():
        try:
            entry["nb"] = nbformat.read(nb_file, as_version=4)
        except Exception as exc:  # nbformat raises many kinds on a damaged file
            if not entry["failed"]:
                raise ncio.DamagedRunError(f"run {study}/{run_dir.name}: notebook.ipynb cannot be read "
                                           f"({type(exc).__name__}: {exc})") from None
    if entry["failed"]:
        entry["error"] = _error_summary(entry["nb"], record)
        return entry
    if record.get("status") == "lab" and not (run_dir / "results.nc").exists():
        entry["unfinished"] = True  # a JupyterLab run that has not written its results (yet)
        return entry
    if record.get("status") not in ncio.FINISHED:
        raise ncio.DamagedRunError(f"run {study}/{run_dir.name}: RUN.json says {record.get('status')!r}, "
                                   "not a finished run")
    ds = ncio.open_results(run_dir / "results.nc")  # Fletcher-32 checked while reading
    keep = ("git_commit", "git_dirty", "created", "device", "package_versions", "accelerator_versions",
            "real_kernel_backends", "headline_figure", "hostname")
    entry["provenance"] = {k: str(ds.attrs.get(k, "")) for k in keep}
    if record.get("figures_verified"):  # hashed in RUN.json and checked by verify_run
        figs = sorted(record["figures_sha256"])
    else:  # a record written before figure hashes: plain files of plain names only
        figs = sorted(p.name for p in run_dir.glob("*.png"))
        for name in figs:
            if not ncio.FIGURE_NAME.fullmatch(name) or not (run_dir / name).is_file() or (run_dir / name).is_symlink():
                raise ncio.DamagedRunError(f"run {study}/{run_dir.name}: figure {name!r} is not a plain file of a "
                                           "plain name")
    entry["figures"] = figs
    headline = entry["provenance"].get("headline_figure", "")
    entry["headline"] = headline if headline in figs else (figs[0] if figs else "")
    entry["verified"] = record.get("verified", False)
    entry["figures_verified"] = record.get("figures_verified", False)
    return entry


def _read_report(run_dir: Path, folder: Path) -> dict:
    """A kernel report (``outputs/report/<name>/``): its notebook and ``results.nc`` (Fletcher-32 checked while
    reading). ``REPORT.json`` is written last, so a folder without it is a report still being written."""
    entry = {"study": REPORTS, "run": run_dir.name, "dir": folder, "source": run_dir, "nb": None, "failed": False,
             "figures": [], "kind": "report", "verified": False}
    if not (folder / "REPORT.json").exists():
        entry.update(unfinished=True, record={})
        return entry
    try:
        meta = json.loads((folder / "REPORT.json").read_text())
        entry["nb"] = nbformat.read(folder / "notebook.ipynb", as_version=4)
    except Exception as exc:  # json and nbformat raise many kinds on a damaged file
        raise ncio.DamagedRunError(f"report {run_dir.name}: REPORT.json or notebook.ipynb cannot be read "
                                   f"({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict):
        raise ncio.DamagedRunError(f"report {run_dir.name}: REPORT.json is not a table")
    params = {k: meta[k] for k in ("kernel_names", "against", "device", "tier", "overrides") if k in meta}
    entry["record"] = {"parameters": params, "param_set": str(meta.get("tier", "?")), "status": "ok"}
    ds = ncio.open_results(folder / "results.nc")
    entry["provenance"] = {k: str(ds.attrs.get(k, "")) for k in
                           ("git_commit", "git_dirty", "created", "device", "package_versions", "accelerator_versions")}
    entry["headline"] = ""
    return entry


def _collect_report(run_dir: Path, snapshots: Path) -> dict:
    return _snapshot_checked(REPORTS, run_dir, snapshots / REPORTS / run_dir.name,
                             lambda folder: _read_report(run_dir, folder), REPORT_FILES)


# -- the pinned versions --

def pins() -> dict[str, str]:
    """``{package: version}`` pinned by ``requirements.txt`` (``name==version``) and Python's version from
    ``environment.yml`` (``python=X.Y``); names in lower case."""
    found = {}
    with contextlib.suppress(OSError):
        for line in (ROOT / "requirements.txt").read_text().splitlines():
            m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s#;]+)", line)
            if m:
                found[m.group(1).lower()] = m.group(2)
    with contextlib.suppress(OSError):
        m = re.search(r"^\s*-\s*python\s*=+\s*([0-9.]+)", (ROOT / "environment.yml").read_text(), re.M)
        if m:
            found["python"] = m.group(1)
    return found


def _matches_pin(ran: str, pinned: str) -> bool:
    """``2.13.0+cu130`` matches the pin ``2.13.0`` (a build of that release); ``3.11.7`` matches ``3.11``."""
    release = str(ran).split("+", 1)[0]
    return release == pinned or release.startswith(pinned + ".")


def off_pins(prov: dict, pinned: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """``(package, version the run used, pinned version)`` for every recorded package whose version is not
    the pin (``package_versions``; the accelerator's torch and triton builds too)."""
    pinned = pins() if pinned is None else pinned
    used = {k.lower(): str(v) for k, v in _json_attr(prov, "package_versions").items()}
    accel = _json_attr(prov, "accelerator_versions")
    for key in ("torch", "triton"):
        if accel.get(key) and accel[key] != "none":
            used.setdefault(key, str(accel[key]))
            if not _matches_pin(str(accel[key]), pinned.get(key, str(accel[key]))):
                used[key] = str(accel[key])
    return [(k, used[k], pinned[k]) for k in sorted(used) if k in pinned and not _matches_pin(used[k], pinned[k])]


# -- markdown helpers --

def _cell(markdown: str) -> str:
    """Markdown built by this module (data in it already escaped) on one line."""
    return str(markdown).replace("\r", " ").replace("\n", " ")


_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def _text(value) -> str:
    """A data-derived string as plain Markdown text: every ASCII punctuation character backslash-escaped
    (CommonMark escapes: no tag, link, role, emphasis or table cell can start), on one line. Safe in
    table cells and list items alike; the HTML writer then escapes ``<`` and ``&``."""
    text = str(value).replace("\r", " ").replace("\n", " ")
    return "".join("\\" + c if c in _PUNCTUATION else c for c in text)


def _code(value, table: bool = False) -> str:
    """A data-derived string as an inline code span: the fence is one backtick longer than the longest run
    of backticks inside, so no backtick in the data can close it (CommonMark code spans); in a table
    cell ``|`` is escaped (GFM tables split cells before inline parsing)."""
    text = str(value).replace("\r", " ").replace("\n", " ")
    fence = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    if table:
        text = text.replace("|", "\\|")
    if not text.strip() or text.startswith("`") or text.endswith("`"):
        text = f" {text} "
    return f"{fence}{text}{fence}"


def _json_attr(prov: dict, key: str) -> dict:
    """A JSON provenance attribute as a dict ({} where absent, as in files written before it, or unreadable)."""
    try:
        value = json.loads(prov.get(key) or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


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


# -- pages --

class GlueMissing(RuntimeError):
    """A run's notebook refers to glued values that the run did not glue."""


def _table_values(markup: str) -> list[str] | None:
    """The text of every ``<td>`` of an HTML output holding one table (``None`` if it holds no table)."""
    from html.parser import HTMLParser

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.cells, self.tables, self._in = [], 0, None

        def handle_starttag(self, tag, attrs):
            if tag == "table":
                self.tables += 1
            elif tag == "td":
                self._in = []

        def handle_endtag(self, tag):
            if tag == "td" and self._in is not None:
                self.cells.append("".join(self._in).strip())
                self._in = None

        def handle_data(self, data):
            if self._in is not None:
                self._in.append(data)

    parser = Cells()
    parser.feed(markup)
    return parser.cells if parser.tables == 1 else None


def _zero_or_nan(text: str) -> bool:
    text = text.strip().rstrip("%").strip()
    if text.lower() in ("", "nan", "<na>", "none", "n/a", "-"):
        return True
    try:
        value = float(text)
    except ValueError:
        return False
    return value == 0 or value != value


def _fold_empty_table(out) -> None:
    """An HTML table output whose every cell is 0 or NaN is folded (a closed ``<details>`` saying so)."""
    data = out.get("data", {})
    markup = data.get("text/html")
    if isinstance(markup, list):
        markup = "".join(markup)
    if not isinstance(markup, str) or "<table" not in markup:
        return
    cells = _table_values(markup)
    if not cells or not all(_zero_or_nan(c) for c in cells):
        return
    data["text/html"] = (f'<details class="attnum-fold attnum-empty"><summary>A table whose {len(cells)} values are '
                         "all 0 or NaN (folded; open to see it)</summary>\n" + markup + "\n</details>")


def _headline_cell(entry: dict):
    if not entry.get("headline"):
        return None
    return nbformat.v4.new_markdown_cell(_figure(entry["headline"], f"headline figure of {entry['study']}",
                                                 f"Headline figure: {_code(entry['headline'])}"))


def _page_notebook(entry: dict, nav: str):
    """The copy of an executed notebook that the site renders (the run's own file is never changed)."""
    nb = copy.deepcopy(entry["nb"])
    missing = glue.missing_keys(nb)
    if missing:  # the prose would state values the run never computed: no page, and the build fails
        raise GlueMissing(f"run outputs/{entry['study']}/{entry['run']}: its markdown refers to values the run "
                          f"did not glue: {', '.join(sorted(missing))}")
    glue.unformat_missing(nb)
    nb.metadata.pop("widgets", None)  # widget state would pull the widget manager from a CDN
    cells, params_cell, table_done = [], None, False
    staged = _staged_folders(nb, entry.get("source", entry["dir"]))
    shown = f"outputs/{entry['study']}/{entry['run']}"
    for cell in nb.cells:
        tags = list(cell.metadata.get("tags", []))
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.get("outputs", [])
                            if not (o.get("output_type") == "stream" and o.get("name") == "stderr")
                            and WIDGET_MIME not in o.get("data", {})]
            for out in cell.outputs:  # the staging folder a run executed in is named as the run
                _unstage(out, staged, shown)
                _fold_empty_table(out)
            if "parameters" in tags:
                params_cell = cell
                continue
            if "injected-parameters" in tags:
                cells.append(nbformat.v4.new_markdown_cell(_parameter_table(entry, params_cell)))
                table_done = True
                continue
            if not {"hide-input", "remove-input", "remove-cell"} & set(tags):
                tags.append("hide-input")
            cell.metadata["tags"] = tags
        cells.append(cell)
    if not table_done and (params_cell is not None or entry["record"].get("parameters")):
        at = next((i for i, c in enumerate(cells) if c.cell_type == "code"), len(cells))
        cells.insert(at, nbformat.v4.new_markdown_cell(_parameter_table(entry, params_cell)))
    title_at = next((i for i, c in enumerate(cells) if c.cell_type == "markdown" and c.source.startswith("# ")), None)
    if title_at is None:
        cells.insert(0, nbformat.v4.new_markdown_cell(f"# {_text(entry['study'])} · run {_code(entry['run'])}"))
        title_at = 0
    elif entry.get("page_suffix"):
        first, _, rest = cells[title_at].source.partition("\n")
        cells[title_at].source = f"{first} {entry['page_suffix']}\n{rest}"
    # results first: the headline figure and the conclusions right below the title, then the provenance
    summary_at = _summary_cell_index(nbformat.v4.new_notebook(cells=cells))
    first = [c for c in [_headline_cell(entry)] if c is not None]
    if summary_at is not None and summary_at > title_at:
        first.append(cells.pop(summary_at))
    cells[title_at + 1:title_at + 1] = first + [nbformat.v4.new_markdown_cell(_provenance_md(entry, nav))]
    nb.cells = cells
    return nb


def _staged_folders(nb, run_dir: Path) -> list[str]:
    """Where the run executed: the injected ``output_dir`` (a staging folder) and the folder itself."""
    found = {str(Path(run_dir).resolve())}
    for cell in nb.cells:
        if cell.cell_type == "code" and "injected-parameters" in cell.metadata.get("tags", []):
            with contextlib.suppress(SyntaxError, ValueError):
                for node in ast.parse(cell.source).body:
                    if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "output_dir" for t in node.targets):
                        value = ast.literal_eval(node.value)
                        if isinstance(value, str) and value:
                            found.add(value)
    return sorted(found, key=len, reverse=True)


def _unstage(out, staged: list[str], shown: str) -> None:
    def fix(text: str) -> str:
        for folder in staged:
            text = text.replace(folder, shown)
        return text

    if isinstance(out.get("text"), str):
        out["text"] = fix(out["text"])
    for mime, value in out.get("data", {}).items():
        if mime.startswith("text/") and isinstance(value, str):
            out["data"][mime] = fix(value)


def _params_cell(nb):
    """The committed notebook's ``parameters`` cell (its defaults and their meaning), if any."""
    if nb is None:
        return None
    return next((c for c in nb.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])), None)


def _lab_page(entry: dict, nav: str, params_cell=None) -> str:
    """A JupyterLab run keeps its notebook in notebooks/: its page shows its record and figures, its parameters
    beside the committed notebook's defaults and their meaning."""
    parts = [f"# {_text(entry['study'])} · JupyterLab run {_code(entry['run'])}\n", _provenance_md(entry, nav),
             _parameter_table(entry, params_cell)]
    if entry.get("unfinished"):
        parts.append("This JupyterLab run has not written `results.nc` (unfinished or still running).\n")
    for fig in entry.get("figures", []):
        parts.append(f"```{{figure}} {fig}\n:width: 100%\n\n{_code(fig)}\n```\n")
    return "\n".join(parts)


def _figure(path: str, alt: str, caption: str) -> str:
    return f":::{{figure}} {path}\n:width: 100%\n:alt: {alt}\n\n{caption}\n:::\n"


def _finding_md(study: str, main: dict | None, committed: dict) -> str | None:
    """The study's finding (its committed notebook's template, else the run's own) with the main run's values."""
    if main is None or main.get("nb") is None:
        return None
    template = _study_finding_template(study, main, committed)
    return render_finding(template, glue.read_glued(main["nb"])) if template else None


def _study_finding_template(study: str, main: dict, committed: dict) -> str:
    """The committed notebook's finding (what its author states today), else the one the run carries."""
    return _finding_template(committed.get(study)) or _finding_template(main["nb"])


# -- the README's findings block (``python -m attnum readme-findings``) --

README = ROOT / "README.md"
README_BEGIN = ("<!-- findings: generated by python -m attnum readme-findings from the committed runs; do not edit "
                "(python -m attnum readme-findings --check says whether it is stale) -->")
README_END = "<!-- /findings -->"


class FindingError(ValueError):
    """A finding that cannot be stated from its run: a value it states is one the run did not glue (named)."""


class ReadmeError(RunError):
    """README.md's findings block cannot be written or checked (named why)."""


def stated_finding(template: str, values: dict) -> str:
    """``render_finding`` (the landing page's rendering: data values escaped), refusing a finding whose run lacks
    a value it states: ``FindingError`` names every key the run did not glue, or glued as not measured
    (``glue.MISSING``); the landing page would read a blank (``n/a``) there, the README states no such sentence."""
    if not template:
        raise FindingError("its notebook states no finding (metadata.attnum.finding)")
    keys = list(dict.fromkeys(k for k, _ in _GLUE_ROLE.findall(template)))
    absent = [k for k in keys if k not in values]
    unmeasured = [k for k in keys if isinstance(values.get(k), str) and values[k] == glue.MISSING]
    why = ([f"the run glued no {', '.join(map(_code, absent))}"] if absent else []) + (
        [f"the run glued {', '.join(map(_code, unmeasured))} as not measured ({_code(glue.MISSING)})"] if unmeasured else [])
    if why:
        raise FindingError("; ".join(why))
    text = render_finding(template, values)
    if text is None:  # render_finding's None: no stated value glued, caught above; a guard for a changed rule
        raise FindingError("the run glued none of the values it states")
    return text


def committed_runs(root: Path = ROOT) -> tuple[list[tuple[str, Path]], set[str]]:
    """``([(study, run folder)], tracked paths)``: the runs of the studies whose ``RUN.json`` git tracks under
    ``root/outputs`` (the GPU runs; CPU runs of ``make reproduce`` are not committed), and every tracked path there."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", "outputs"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ReadmeError(f"cannot list the committed runs under {root}/outputs with git: {exc}") from None
    tracked = {p for p in out.split("\0") if p}
    known = studies()
    found = sorted({(parts[1], parts[2]) for parts in (p.split("/") for p in tracked)
                    if len(parts) == 4 and parts[3] == "RUN.json" and parts[1] in known})
    return [(study, root / "outputs" / study / run) for study, run in found], tracked


def readme_findings(root: Path = ROOT) -> str:
    """README.md's findings block, read from the committed runs (each checked: ``ncio.verify_run``)."""
    runs, tracked = committed_runs(root)
    entries = []
    for study, run_dir in runs:
        try:
            entry = _collect(study, run_dir)  # checked: RUN.json unaltered, the hashes of results and notebook
        except (ncio.DamagedRunError, OSError) as exc:
            raise ReadmeError(f"committed run {study}/{run_dir.name} cannot be read as recorded: {exc}") from None
        entry["kind"] = _kind(entry)
        prefix = f"outputs/{study}/{run_dir.name}/"
        entry["figures"] = [f for f in entry.get("figures", []) if prefix + f in tracked]  # a committed figure only
        if entry.get("headline") not in entry["figures"]:
            entry["headline"] = entry["figures"][0] if entry["figures"] else ""
        entries.append(entry)
    committed = {}
    for study, path in studies().items():
        with contextlib.suppress(Exception):
            committed[study] = nbformat.read(path, as_version=4)
    return findings_block(entries, committed)


def findings_block(entries: list[dict], committed: dict) -> str:
    """The block (markers included) from run entries (``_collect``'s, with their ``kind``): the landing page's
    headline figure and each study's finding from its main run (``_primary_runs``), each ending with its run;
    a finding its run cannot state (``stated_finding``'s refusal) is named with what the run lacks, not stated.
    Paths are relative to the project root: ``outputs/<study>/<run>/...``."""
    known = list(studies())
    order = known + sorted({e["study"] for e in entries} - set(known))
    by_study: dict[str, list] = {}
    for e in entries:
        if e.get("kind") in ("result", "gpu"):
            by_study.setdefault(e["study"], []).append(e)
    primary = _primary_runs(by_study)

    def title(study: str) -> str:
        return _short_title(_title(committed[study]) if study in committed else study, study)

    def folder(e: dict) -> str:
        if not (SAFE_NAME.fullmatch(e["study"]) and SAFE_NAME.fullmatch(e["run"])):
            raise ReadmeError(f"run {e['study']}/{e['run']}: its name holds characters other than letters, digits "
                              "and _ . @ = , + -")
        return f"outputs/{e['study']}/{e['run']}"

    def where(e: dict) -> str:
        return (f"study {_code(e['study'])}, run [{_code(short_label(e['run']))}]({folder(e)}/notebook.ipynb), "
                f"commit {_commit(e.get('provenance', {}))}")

    parts = [README_BEGIN]
    lead = next((primary[s] for s in order if s in primary and primary[s].get("headline")), None)
    if lead is not None:
        if not ncio.FIGURE_NAME.fullmatch(lead["headline"]):
            raise ReadmeError(f"run {lead['study']}/{lead['run']}: figure {lead['headline']!r} is not a plain name")
        alt = _text(f"headline figure of {title(lead['study'])}, run {lead['run']}")
        parts.append(f"![{alt}]({folder(lead)}/{lead['headline']})\n\n*Headline figure* "
                     f"({_text(title(lead['study']))}, {_code(lead['headline'])}; {where(lead)}).")
    stated, refused = [], []
    for study in order:
        main = primary.get(study)
        if main is None:
            refused.append(f"* **{_text(title(study))}**: no committed run")
            continue
        try:
            if main.get("nb") is None:
                raise FindingError("the run has no executed notebook")
            text = stated_finding(_study_finding_template(study, main, committed), glue.read_glued(main["nb"]))
        except FindingError as exc:
            refused.append(f"* **{_text(title(study))}** ({where(main)}): {exc}")
            continue
        stated.append(f"* **{_text(title(study))}**: {text} ({where(main)})")
    if stated:
        parts.append(f"**Findings** ({len(stated)} of {len(order)} studies): each study's one-sentence finding, "
                     "written by its author in the notebook, with the numbers glued from the committed run it ends "
                     "with.\n\n" + "\n".join(stated))
    if refused:
        parts.append(f"Not stated here ({len(refused)} of {len(order)} studies): the committed run each finding would "
                     "come from lacks a value the finding states (named); a finding is stated only with every one "
                     "of its numbers from its run.\n\n"
                     + "\n".join(refused))
    parts.append(README_END)
    return "\n\n".join(parts) + "\n"


def readme_with_findings(text: str, block: str) -> str:
    """``text`` (README.md) with its findings block replaced by ``block``; a README without one gets it right
    below its title (its first line, ``# ...``)."""
    begin, end = text.count(README_BEGIN), text.count(README_END)
    if begin == 0 and end == 0:
        head, sep, rest = text.partition("\n")
        if not head.startswith("# "):
            raise ReadmeError("README.md has no findings block and does not open with a title (# ...) to put one under")
        return f"{head}\n\n{block}\n{rest.lstrip(chr(10))}"
    if begin != 1 or end != 1 or text.index(README_BEGIN) > text.index(README_END):
        raise ReadmeError(f"README.md's findings markers are not one {README_BEGIN[:20]}... followed by one "
                          f"{README_END}; mend them by hand")
    start, stop = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    return text[:start] + block.rstrip("\n") + text[stop:]


def update_readme(readme: Path | None = None, *, check: bool = False, root: Path = ROOT) -> str:
    """Write the findings block into ``readme`` (README.md); with ``check``, write nothing. Returns a unified
    diff of the block as it is against the block as the committed runs make it ("" when it is current)."""
    import difflib

    readme = Path(readme) if readme is not None else README
    text = readme.read_text(encoding="utf-8")
    new = readme_with_findings(text, readme_findings(root))
    if new == text:
        return ""
    diff = "".join(difflib.unified_diff(text.splitlines(keepends=True), new.splitlines(keepends=True),
                                        f"{readme.name} (as it is)", f"{readme.name} (from the committed runs)"))
    if not check:
        readme.write_text(new, encoding="utf-8")
    return diff


def _primary_runs(by_study: dict) -> dict:
    """Each study's main run (its finding, its "Read the study" link): the CPU ``default`` run, else the newest
    other result run, else its first GPU run."""
    primary = {}
    for study, runs in by_study.items():
        cpu = [r for r in runs if r["kind"] == "result"]
        gpu = [r for r in runs if r["kind"] == "gpu"]
        pick = ([r for r in cpu if r["run"] == "default"] or sorted(cpu, key=lambda r: r["provenance"].get("created", ""),
                                                                      reverse=True) or gpu)
        if pick:
            primary[study] = pick[0]
    return primary


def _index_md(order: list[str], by_study: dict, primary: dict, committed: dict, damaged: list[dict],
              others: list[dict], reports: list[dict] | None = None) -> str:
    reports = reports or []
    parts = ["# Numerical deviation of FlashAttention-style attention kernels\n",
             "Five studies of how far attention kernels drift from the exact answer: how the error grows with "
             "sequence length, what extreme inputs do, and what the deviation does to training. Each study is "
             "an executed notebook; every number and figure on its page comes from that run's `results.nc`, "
             "whose attributes record the parameters, code version, library versions and machine. "
             "Figures open at full size on click.\n",
             SEARCH_NOTE.replace(SERVE_COMMAND, f"`{SERVE_COMMAND}`") + "\n"]
    lead = next((primary[s] for s in order if s in primary and primary[s].get("headline")), None)
    if lead is not None:
        title = _title(committed[lead["study"]]) if lead["study"] in committed else lead["study"]
        parts.append(_figure(f"{lead['study']}/{lead['run']}/{lead['headline']}",
                             f"headline figure of {lead['study']}, run {lead['run']}",
                             f"{_text(_short_title(title, lead['study']))}, {_text(_device_label(lead))} run "
                             f"{_code(short_label(lead['run']))}: {_code(lead['headline'])}"))
    findings = []
    for study in order:
        text = _finding_md(study, primary.get(study), committed)
        if text:
            main = primary[study]
            title = _short_title(_title(committed[study]) if study in committed else study, study)
            findings.append(f"* **{_text(title)}**: {text} ([{_text(_device_label(main).split(' ')[0])} run "
                            f"{_text(short_label(main['run']))}]({study}/{main['run']}/notebook.ipynb))")
    if findings:
        parts.append("## Findings\n\nOne sentence per study, written by its author, with the numbers of the run "
                     "it links to (glued from that run's data).\n\n" + "\n".join(findings) + "\n")
    if damaged:
        parts.append(":::{admonition} Damaged runs, not published\n:class: error attnum-damaged\n\n"
                     + "\n".join(f"* DAMAGED, not published: {_code(d['study'] + '/' + short_label(d['run'], 40))}: {_text(d['damaged'])}"
                                 for d in damaged) + "\n:::\n")
    toc_main, toc_more = [], []
    for study in order:
        nb_src = committed.get(study)
        runs = by_study.get(study, [])
        main = primary.get(study)
        source_nb = main["nb"] if main and main.get("nb") is not None else nb_src
        title = _title(source_nb) if source_nb is not None else study
        parts.append(f"## {title}\n")
        question = _question(source_nb) if source_nb is not None else ""
        if question:
            parts.append(question + "\n")
        results = [r for r in runs if r["kind"] in ("result", "gpu")]
        shown = [r for r in ([main] if main else []) + [r for r in results if r["kind"] == "gpu" and r is not main][:1]
                 if r.get("headline")]
        if shown:
            figs = [_figure(f"{study}/{r['run']}/{r['headline']}",
                            f"headline figure of {study}, run {r['run']}",
                            f"{_text(_device_label(r))} run {_code(short_label(r['run']))}: {_code(r['headline'])}") for r in shown]
            parts.append("::::{container} attnum-figs\n" + "\n".join(figs) + "::::\n")
        if main is not None:
            text = _finding_md(study, main, committed)
            if text:
                parts.append(f"**Finding** (run {_code(short_label(main['run']))}): {text}\n")
            parts.append(f"[Read the study →]({study}/{main['run']}/notebook.ipynb)\n")
        else:
            parts.append("*No result run of this study is published yet* (`make reproduce`, or "
                         f"`python -m attnum run {study}`).\n")
        if results:
            rows = ["| run | device | created | git commit | versions | page |", "|---|---|---|---|---|---|"]
            for r in results:
                prov = r.get("provenance", {})
                page = f"[page]({study}/{r['run']}/notebook.ipynb)" if r.get("nb") is not None else ""
                off = off_pins(prov)
                versions = (f"off the pins: {_text(', '.join(k for k, _, _ in off))}" if off else
                            "pinned" if _json_attr(prov, "package_versions") else "not recorded")
                rows.append(f"| {_code(short_label(r['run']), True)} | {_text(_device_label(r))} | "
                            f"{_text(prov.get('created', ''))} | {_commit(prov, True)} | {versions} | {page} |")
            parts.append("Result runs of this study:\n\n" + "\n".join(rows) + "\n")
        rest = [r for r in others if r["study"] == study]
        if rest:
            parts.append("Other runs of this study (not results; see [Other runs](runs.md)): "
                         + ", ".join(f"{_code(study + '/' + short_label(r['run'], 40))} ({KIND_LABELS[r['kind']]})" for r in rest) + "\n")
        for r in results:
            if r.get("nb") is None:
                continue
            label = _short_title(title, study) + ("" if r is main else f" · {short_label(r['run'])} ({_device_label(r).split(' ')[0]})")
            (toc_main if r is main else toc_more).append(f"{label} <{study}/{r['run']}/notebook>")
    parts.append("```{toctree}\n:hidden:\n:caption: Studies\n:maxdepth: 1\n\n" + "\n".join(toc_main) + "\n```\n")
    if toc_more:
        parts.append("```{toctree}\n:hidden:\n:caption: More result runs (GPU, other tiers)\n:maxdepth: 1\n\n"
                     + "\n".join(toc_more) + "\n```\n")
    if reports:
        rows = ["| report | kernels | device | created | page |", "|---|---|---|---|---|"]
        for r in reports:
            params = r["record"].get("parameters") or {}
            kernels = params.get("kernel_names") or []
            page = f"[page]({REPORTS}/{r['run']}/notebook.ipynb)" if r.get("doc") else "unfinished (no `REPORT.json` yet)"
            rows.append(f"| {_code(short_label(r['run']), True)} | "
                        f"{', '.join(_code(k, True) for k in kernels) if isinstance(kernels, list) else ''} | "
                        f"{_text(r.get('provenance', {}).get('device', ''))} | "
                        f"{_text(r.get('provenance', {}).get('created', ''))} | {page} |")
        parts.append("## Kernel reports\n\nReports of `python -m attnum report KERNEL`: is a kernel's error what a "
                     "correct kernel of its precision makes? (not one of the studies; each is its own run).\n\n"
                     + "\n".join(rows) + "\n")
        toc = [f"Report {short_label(r['run'])} <{REPORTS}/{r['run']}/notebook>" for r in reports if r.get("doc")]
        if toc:
            parts.append("```{toctree}\n:hidden:\n:caption: Kernel reports\n:maxdepth: 1\n\n" + "\n".join(toc) + "\n```\n")
    parts.append("```{toctree}\n:hidden:\n:caption: Not results\n:maxdepth: 1\n\nOther runs <runs>\n```\n")
    if (ROOT / "docs" / f"{SOURCES}.md").is_file():
        parts.append(f"The studies' sources (the source documents the pages call seed 000-004, and the papers) "
                     f"are on the [Sources]({SOURCES}.md) page.\n")
        parts.append(f"```{{toctree}}\n:hidden:\n:caption: About\n:maxdepth: 1\n\nSources <{SOURCES}>\n```\n")
    return "\n".join(parts)


def _runs_md(others: list[dict], damaged: list[dict], short: dict) -> str:
    parts = ["# Other runs\n",
             "Runs that are not the studies' results: smoke runs (the seconds-long tier the tests use), sweep points "
             f"(`{SWEEP_MARK}` in the folder name), JupyterLab runs (`lab-<time>`), failed and damaged runs. "
             "[Back to the studies](index.md).\n"]
    toc = []
    groups = [("damaged", damaged)] + [(k, [r for r in others if r["kind"] == k])
                                       for k in ("failed", "smoke", "sweep", "lab")]
    for kind, rows in groups:
        if not rows:
            continue
        parts.append(f"## {KIND_TITLES[kind]}\n")
        if kind == "damaged":
            parts.append("| study | run | what is wrong |\n|---|---|---|\n" + "\n".join(
                f"| {_text(short.get(d['study'], d['study']))} | {_code(short_label(d['run'], 40), True)} | DAMAGED, not published: "
                f"{_text(d['damaged'])} |"
                for d in rows) + "\n")
            continue
        table = ["| study | run | device | created | " + ("error |" if kind == "failed" else "page |"),
                 "|---|---|---|---|---|"]
        for r in rows:
            doc = f"{r['study']}/{r['run']}/notebook"
            page = f"[page]({doc}.{'ipynb' if r.get('nb') is not None else 'md'})" if r.get("doc") else ""
            when = r.get("provenance", {}).get("created") or r["record"].get("finished") or r["record"].get("started", "")
            last = (f"{_code(r.get('error', ''), True)} {page}" if kind == "failed" else page)
            table.append(f"| {_text(short.get(r['study'], r['study']))} | {_code(short_label(r['run'], 40), True)} | "
                         f"{_text(_device_label(r))} | {_text(when)} | {last} |")
            if r.get("doc"):
                toc.append(f"{r['study']} · {short_label(r['run'], 40)} <{doc}>")
        parts.append("\n".join(table) + "\n")
    if toc:
        parts.append("```{toctree}\n:hidden:\n:maxdepth: 1\n\n" + "\n".join(toc) + "\n```\n")
    if not others and not damaged:
        parts.append("None.\n")
    return "\n".join(parts)


def _nav(entry: dict, order: list[str], primary: dict, short: dict) -> str:
    up = "../../index.md"
    links = [f"[↑ All studies]({up})"]
    if entry["kind"] in ("result", "gpu"):
        i = order.index(entry["study"]) if entry["study"] in order else -1
        prev_ = next((s for s in reversed(order[:i]) if s in primary), None) if i >= 0 else None
        next_ = next((s for s in order[i + 1:] if s in primary), None) if i >= 0 else None
        if prev_:
            links.insert(0, f"[← {short[prev_]}](../../{prev_}/{primary[prev_]['run']}/notebook.ipynb)")
        if next_:
            links.append(f"[{short[next_]} →](../../{next_}/{primary[next_]['run']}/notebook.ipynb)")
        main = primary.get(entry["study"])
        if main is not None and main is not entry:
            links.append(f"[main run {_code(short_label(main['run']))}](../{main['run']}/notebook.ipynb)")
    else:
        links.append("[Other runs](../../runs.md)")
    return " · ".join(links)


def _build_sources(src: Path, entries: list[dict], damaged: list[dict]) -> None:
    (src / "_static").mkdir(parents=True)
    (src / "conf.py").write_text(CONF_PY)
    (src / "_static" / "attnum.css").write_text(CSS)
    (src / "_templates").mkdir()
    (src / "_templates" / "search.html").write_text(SEARCH_TEMPLATE)
    known = studies()
    order = list(known) + sorted({e["study"] for e in entries} - set(known))
    committed = {}
    for study, path in known.items():
        with contextlib.suppress(Exception):
            committed[study] = nbformat.read(path, as_version=4)
    reports = [e for e in entries if e.get("kind") == "report"]
    entries = [e for e in entries if e.get("kind") != "report"]
    order = [s for s in order if s != REPORTS or s in known]
    by_study: dict[str, list] = {}
    for e in entries:
        e["kind"] = _kind(e)
        by_study.setdefault(e["study"], []).append(e)
    primary = _primary_runs(by_study)
    short = {s: _short_title(_title(committed[s]) if s in committed else s, s) for s in order}
    for e in entries:
        dest = src / e["study"] / e["run"]
        dest.mkdir(parents=True)
        if e["kind"] in ("result", "gpu") and primary.get(e["study"]) is not e:
            e["page_suffix"] = f"(run {_code(short_label(e['run']))}, {_text(_device_label(e).split(' ')[0])})"
        elif e["kind"] not in ("result", "gpu"):
            e["page_suffix"] = f"({KIND_LABELS[e['kind']]} {_code(short_label(e['run'], 40))})"
        for name in e.get("figures", []) + (["results.nc"] if e.get("provenance") else []):
            shutil.copy2(e["dir"] / name, dest / name)
        nav = _nav(e, order, primary, short)
        if e.get("nb") is not None:
            nbformat.write(_page_notebook(e, nav), dest / "notebook.ipynb")
            e["doc"] = True
        elif e["kind"] == "lab":
            (dest / "notebook.md").write_text(_lab_page(e, nav, _params_cell(committed.get(e["study"]))))
            e["doc"] = True
    for e in reports:
        if e.get("nb") is None:
            continue
        dest = src / REPORTS / e["run"]
        dest.mkdir(parents=True)
        shutil.copy2(e["dir"] / "results.nc", dest / "results.nc")
        e["page_suffix"] = f"(report {_code(short_label(e['run']))})"
        nbformat.write(_page_notebook(e, "[↑ All studies](../../index.md)"), dest / "notebook.ipynb")
        e["doc"] = True
    others = [e for e in entries if e["kind"] not in ("result", "gpu")]
    (src / "index.md").write_text(_index_md(order, by_study, primary, committed, damaged, others, reports))
    (src / f"{OTHER}.md").write_text(_runs_md(others, damaged, short))
    # the project's own page (committed, not data): the sources every study page cites
    if (ROOT / "docs" / f"{SOURCES}.md").is_file():
        shutil.copy2(ROOT / "docs" / f"{SOURCES}.md", src / f"{SOURCES}.md")


def _sphinx(src: Path, out: Path, doctrees: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-E", "-d", str(doctrees),
                           str(src), str(out)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise PublishError(f"sphinx could not build the site (exit {proc.returncode}): "
                           + (proc.stderr.strip() or proc.stdout.strip())[-2000:])


_SWAP_HOOK = None  # tests: called with the step of the site swap ("exchanged", "old-moved-away")
_RENAME_EXCHANGE = 2  # linux/fs.h: renameat2 swaps two paths in one step


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: a filesystem or kernel without the exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(html: Path, site: Path, base: Path) -> None:
    """Put the built ``html`` in place of ``site``. With an existing site, both are exchanged in one step
    (renameat2), so that ``site`` is at every moment the old site or the new one, also for a publish killed
    there; the old one, then at ``html`` inside the build folder, is removed with it (or by ``clean``).
    Where the exchange is not supported, two renames: a kill between them leaves no ``site`` until the next
    publish, and ``.site.old-*``, which ``clean`` removes."""
    if not site.exists() and not site.is_symlink():
        os.rename(html, site)
        return
    if site.is_symlink() or not site.is_dir():
        raise UnsafePathError(f"{site} is not a folder of attnum's (a symbolic link or a file); not replaced")
    if _exchange(html, site):
        if _SWAP_HOOK:
            _SWAP_HOOK("exchanged")
        shutil.rmtree(html, ignore_errors=True)
        return
    old = base / f".{SITE}.old-{os.getpid()}-{secrets.token_hex(3)}"
    os.rename(site, old)
    if _SWAP_HOOK:
        _SWAP_HOOK("old-moved-away")
    os.rename(html, site)
    shutil.rmtree(old, ignore_errors=True)


def publish(outputs: str | Path | None = None, *, strict: bool = True) -> Path:
    """Build the site and return ``site/index.html``.

    Damaged runs are named and the rest published; then, with ``strict``, ``PublishError``
    names the damaged runs (the site is written by then).
    """
    base = Path(outputs) if outputs else outputs_root()
    if not base.is_dir():
        raise PublishError(f"outputs folder {base} does not exist; nothing to publish")
    with _publish_lock(base):
        site = base / SITE
        build = base / f".{SITE}.building-{os.getpid()}-{secrets.token_hex(3)}"
        build.mkdir()
        try:
            entries, damaged = [], []
            snapshots = build / "snapshot"  # each run's files, copied, then verified: what the site is made of
            for study, run_dir, damage in _run_folders(base):
                try:
                    if damage:
                        raise ncio.DamagedRunError(damage)
                    if study == REPORTS:
                        entries.append(_collect_report(run_dir, snapshots))
                    else:
                        entries.append(_collect(study, run_dir, snapshots))
                except (ncio.DamagedRunError, OSError) as exc:  # a folder, FIFO or link in a file's place too
                    damaged.append({"study": study, "run": run_dir.name, "damaged": str(exc)})
            src, html = build / "src", build / "html"
            _build_sources(src, entries, damaged)
            _sphinx(src, html, build / "doctrees")
            for e in entries:  # the run's data and figures (from its verified snapshot) beside its page
                if e.get("nb") is None and e.get("kind") == "report":
                    continue
                dest = html / e["study"] / e["run"]
                dest.mkdir(parents=True, exist_ok=True)
                for name in e.get("figures", []) + (["results.nc"] if e.get("provenance") else []):
                    shutil.copy2(e["dir"] / name, dest / name)
            (html / ".nojekyll").touch()
            _swap_in(html, site, base)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    index = site / "index.html"
    if damaged and strict:
        raise PublishError(f"wrote {index}, but {len(damaged)} run(s) are damaged and were not published: "
                           + "; ".join(d["damaged"] for d in damaged))
    return index
