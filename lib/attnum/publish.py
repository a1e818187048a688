"""Publish executed study notebooks as a static site under ``outputs/site/``.

Every finished run folder ``outputs/<study>/<run>/`` (holding ``notebook.ipynb``,
``results.nc``, figures and ``RUN.json``) becomes ``site/<study>/<run>/`` with
the notebook rendered to HTML by nbconvert and copies of its NetCDF file and
figures; ``site/index.html`` lists every run with its title, parameters,
provenance, headline figure and links. Failed runs are listed as failed.
"""
from __future__ import annotations

import html
import json
import shutil
from pathlib import Path

import nbformat

from .ncio import ENGINE
from .paths import outputs_root

SITE = "site"


def _title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "untitled"


def _provenance(results: Path) -> dict:
    import xarray as xr

    with xr.open_dataset(results, engine=ENGINE) as ds:
        keep = ("git_commit", "git_dirty", "created", "device", "package_versions", "headline_figure")
        return {k: ds.attrs.get(k, "") for k in keep}


def _run_folders(base: Path):
    for study_dir in sorted(p for p in base.iterdir() if p.is_dir() and p.name != SITE and not p.name.startswith(".")):
        for run_dir in sorted(p for p in study_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if (run_dir / "RUN.json").exists():
                yield study_dir.name, run_dir


def publish(outputs: str | Path | None = None) -> Path:
    """Render every run and write ``site/index.html``; returns the index path."""
    from nbconvert import HTMLExporter

    base = Path(outputs) if outputs else outputs_root()
    site = base / SITE
    tmp_site = base / f".{SITE}.building"
    if tmp_site.exists():
        shutil.rmtree(tmp_site)
    tmp_site.mkdir(parents=True)
    exporter = HTMLExporter()
    rows = []
    for study, run_dir in _run_folders(base) if base.exists() else []:
        record = json.loads((run_dir / "RUN.json").read_text())
        entry = {"study": study, "run": run_dir.name, "record": record, "failed": (run_dir / "FAILED").exists()}
        dest = tmp_site / study / run_dir.name
        dest.mkdir(parents=True)
        nb_file = run_dir / "notebook.ipynb"
        if nb_file.exists():
            nb = nbformat.read(nb_file, as_version=4)
            entry["title"] = _title(nb)
            body, _ = exporter.from_notebook_node(nb)
            (dest / "notebook.html").write_text(body)
        if not entry["failed"] and (run_dir / "results.nc").exists():
            shutil.copy2(run_dir / "results.nc", dest / "results.nc")
            entry["provenance"] = _provenance(run_dir / "results.nc")
            for fig in sorted(run_dir.glob("*.png")):
                shutil.copy2(fig, dest / fig.name)
            figs = sorted(p.name for p in run_dir.glob("*.png"))
            headline = entry["provenance"].get("headline_figure") or (figs[0] if figs else "")
            entry["headline"] = headline if headline in figs else (figs[0] if figs else "")
        rows.append(entry)
    (tmp_site / "index.html").write_text(_index_html(rows))
    if site.exists():
        shutil.rmtree(site)
    tmp_site.rename(site)
    return site / "index.html"


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
        if r["failed"]:
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
