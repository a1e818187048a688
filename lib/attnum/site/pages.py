"""The site's pages: each run's notebook page (headline figure and conclusions first, code folded), the landing
page (findings, the five studies, the kernel reports) and "Other runs".
"""
from __future__ import annotations

import ast
import contextlib
import copy
from pathlib import Path

import nbformat

from .. import glue
from ..runs import SWEEP_MARK
from .common import REPORTS, ROOT, SEARCH_NOTE, SERVE_COMMAND, SOURCES, _code, _json_attr, _text, off_pins
from .story import _finding_template, _question, _short_title, _summary_cell_index, _title, render_finding
from .provenance import KIND_LABELS, _commit, _device_label, _parameter_table, _provenance_md, short_label


KIND_TITLES = {"smoke": "Smoke runs", "sweep": "Sweep points", "lab": "JupyterLab runs",
               "failed": "Failed runs", "damaged": "Damaged runs (not published)"}
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


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
