"""Publish executed study notebooks as a static site under ``outputs/site/``.

Every finished run folder ``outputs/<study>/<run>/`` (holding ``notebook.ipynb``,
``results.nc``, figures and ``RUN.json``) becomes ``site/<study>/<run>/`` with
the notebook rendered to HTML by nbconvert and copies of its NetCDF file and
figures; ``site/index.html`` lists every run with its title, parameters,
provenance, headline figure and links. Failed runs are listed as failed.

Each run is checked first (``ncio.verify_run``: RUN.json present and unaltered,
sha256 of results.nc and notebook.ipynb, Fletcher-32 checksums while reading):
a damaged run is listed as damaged, naming the file and what is wrong, and the
others are published; ``publish`` then raises ``PublishError`` (the command
line exits non-zero) after writing the site. One publish at a time per outputs
folder (``fcntl.flock`` on ``.publish.lock``); each builds in its own temporary
folder. A missing outputs folder is an error, not an empty site.
"""
from __future__ import annotations

import contextlib
import fcntl
import html
import json
import os
import secrets
import shutil
from pathlib import Path

import nbformat

from . import ncio
from .paths import outputs_root
from .runner import RunError

SITE = "site"
LOCK = ".publish.lock"


class PublishError(RunError):
    """The site was written, but some runs could not be published (named), or nothing could be."""


def _title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "untitled"


def _provenance(ds) -> dict:
    keep = ("git_commit", "git_dirty", "created", "device", "package_versions", "headline_figure")
    return {k: ds.attrs.get(k, "") for k in keep}


def _run_folders(base: Path):
    for study_dir in sorted(p for p in base.iterdir() if p.is_dir() and p.name != SITE and not p.name.startswith(".")):
        for run_dir in sorted(p for p in study_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if any((run_dir / f).exists() for f in ("RUN.json", "results.nc", "notebook.ipynb", "FAILED")):
                yield study_dir.name, run_dir


@contextlib.contextmanager
def _publish_lock(base: Path):
    with open(base / LOCK, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # a second publish waits for the first
        yield


def publish_lock_held(base: Path) -> bool:
    """Whether a publish is running on ``base`` now."""
    path = Path(base) / LOCK
    if not path.exists():
        return False
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def _publish_run(exporter, study: str, run_dir: Path, dest: Path) -> dict:
    """Copy and render one run into ``dest``; raises ``DamagedRunError`` naming what is wrong."""
    failed = run_dir.name.endswith(".failed") or (run_dir / "FAILED").exists()
    record = ncio.verify_run(run_dir) if not failed else ncio.read_record(run_dir)
    entry = {"study": study, "run": run_dir.name, "record": record,
             "failed": failed or record.get("status") in ("failed", "interrupted")}
    dest.mkdir(parents=True)
    nb_file = run_dir / "notebook.ipynb"
    if nb_file.exists():
        try:
            nb = nbformat.read(nb_file, as_version=4)
            body, _ = exporter.from_notebook_node(nb)
        except Exception as exc:  # nbformat and nbconvert raise many kinds on a damaged file
            if entry["failed"]:
                nb, body = None, None
            else:
                raise ncio.DamagedRunError(f"run {study}/{run_dir.name}: notebook.ipynb cannot be read "
                                           f"({type(exc).__name__}: {exc})") from None
        if nb is not None:
            entry["title"] = _title(nb)
            (dest / "notebook.html").write_text(body)
    if entry["failed"]:
        return entry
    if record.get("status") not in ncio.FINISHED:
        raise ncio.DamagedRunError(f"run {study}/{run_dir.name}: RUN.json says {record.get('status')!r}, "
                                   "not a finished run")
    ds = ncio.open_results(run_dir / "results.nc")  # Fletcher-32 checked while reading
    shutil.copy2(run_dir / "results.nc", dest / "results.nc")
    entry["provenance"] = _provenance(ds)
    figs = sorted(p.name for p in run_dir.glob("*.png"))
    for fig in figs:
        shutil.copy2(run_dir / fig, dest / fig)
    headline = entry["provenance"].get("headline_figure") or (figs[0] if figs else "")
    entry["headline"] = headline if headline in figs else (figs[0] if figs else "")
    entry["verified"] = record.get("verified", False)
    return entry


def publish(outputs: str | Path | None = None, *, strict: bool = True) -> Path:
    """Render every run and write ``site/index.html``; returns the index path.

    Damaged runs are listed as damaged and the rest published; then, with ``strict``,
    ``PublishError`` names the damaged runs (the site is written by then).
    """
    from nbconvert import HTMLExporter

    base = Path(outputs) if outputs else outputs_root()
    if not base.is_dir():
        raise PublishError(f"outputs folder {base} does not exist; nothing to publish")
    exporter = HTMLExporter()
    with _publish_lock(base):
        site = base / SITE
        tmp_site = base / f".{SITE}.building-{os.getpid()}-{secrets.token_hex(3)}"
        tmp_site.mkdir()
        try:
            rows, damaged = [], []
            for study, run_dir in _run_folders(base):
                dest = tmp_site / study / run_dir.name
                try:
                    rows.append(_publish_run(exporter, study, run_dir, dest))
                except ncio.DamagedRunError as exc:
                    shutil.rmtree(dest, ignore_errors=True)
                    damaged.append(str(exc))
                    rows.append({"study": study, "run": run_dir.name, "record": {}, "failed": True,
                                 "damaged": str(exc)})
            (tmp_site / "index.html").write_text(_index_html(rows))
            if site.exists():
                old = base / f".{SITE}.old-{os.getpid()}-{secrets.token_hex(3)}"
                os.rename(site, old)
                os.rename(tmp_site, site)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp_site, site)
        finally:
            if tmp_site.exists():
                shutil.rmtree(tmp_site, ignore_errors=True)
    index = site / "index.html"
    if damaged and strict:
        raise PublishError(f"wrote {index}, but {len(damaged)} run(s) are damaged and were not published: "
                           + "; ".join(damaged))
    return index


def _index_html(rows) -> str:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>attnum studies</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;width:100%}td,th{border-top:1px solid #ddd;padding:.6em;"
             "vertical-align:top;text-align:left}code{font-size:85%}.failed{color:#a00}"
             "img{max-width:320px}</style></head><body>",
             "<h1>Numerical deviation of FlashAttention-style kernels</h1>",
             f"<p>{len(rows)} run(s). Every figure and number traces to the run's NetCDF file, whose "
             "global attributes record parameters, code version, library versions and machine.</p>",
             "<table><tr><th>study / run</th><th>parameters</th><th>provenance</th><th>headline figure</th></tr>"]
    for r in rows:
        link = f"{e(r['study'])}/{e(r['run'])}"
        title = e(r.get("title", r["study"]))
        values = r["record"].get("parameters", {})
        params = (f"<details><summary>{e(r['record'].get('param_set', ''))} "
                  f"({len(values)} parameters)</summary>"
                  + "<br>".join(f"{e(k)} = {e(json.dumps(v))}" for k, v in sorted(values.items()))
                  + "</details>")
        cell = [f"<b>{title}</b><br><code>{link}</code><br>"]
        if (r.get("title")):
            cell.append(f"<a href='{link}/notebook.html'>notebook</a> ")
        if r.get("damaged"):
            cell.append(f"<span class='failed'>DAMAGED, not published: {e(r['damaged'])}</span>")
            prov, fig = "", ""
        elif r["failed"]:
            cell.append(f"<span class='failed'>FAILED: {e(r['record'].get('error', ''))}</span>")
            prov, fig = "", ""
        else:
            cell.append(f"<a href='{link}/results.nc'>results.nc</a>")
            p = r.get("provenance", {})
            versions = json.loads(p.get("package_versions") or "{}")
            prov = (f"commit <code>{e(str(p.get('git_commit', ''))[:12])}</code>"
                    f"{' (dirty)' if p.get('git_dirty') == 'true' else ''}<br>{e(str(p.get('created', '')))}<br>"
                    f"{e(str(p.get('device', '')))}<br>torch {e(versions.get('torch', '?'))}, "
                    f"python {e(versions.get('python', '?'))}")
            fig = f"<img src='{link}/{e(r['headline'])}' alt='headline figure'>" if r.get("headline") else ""
        parts.append(f"<tr><td>{''.join(cell)}</td><td><code>{params}</code></td><td>{prov}</td><td>{fig}</td></tr>")
    parts.append("</table></body></html>")
    return "\n".join(parts)
