"""The build: the Sphinx sources of one publish, the Sphinx run, and the swap that replaces ``site/`` only when
the build succeeded (``publish``).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from .. import ncio
from ..paths import UnsafePathError, outputs_root
from ..runs import studies
from ..runs.store import SITE
from .common import OTHER, PublishError, REPORTS, ROOT, SEARCH_NOTE, SERVE_COMMAND, SOURCES, _code, _text
from .story import _short_title, _title
from .collect import _collect, _collect_report, _kind, _publish_lock, _run_folders
from .provenance import KIND_LABELS, _device_label, short_label
from .pages import _index_md, _lab_page, _nav, _page_notebook, _params_cell, _primary_runs, _runs_md


CONF_PY = '''\
# Written by attnum.site for one build; edit lib/attnum/site/build.py instead.
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

SEARCH_TEMPLATE = """{%- extends "!search.html" %}
{% block docs_body %}
<div class="admonition note attnum-search-note"><p class="admonition-title">Search and file://</p>
<p>""" + SEARCH_NOTE.replace(SERVE_COMMAND, f"<code>{SERVE_COMMAND}</code>") + """</p></div>
{{ super() }}
{% endblock docs_body %}
"""


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
