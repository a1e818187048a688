"""Reading a notebook's story: its title, question, finding template (glue roles filled from a run's glued
values) and conclusions cell.
"""
from __future__ import annotations

import contextlib
import re

from .. import glue
from .common import _ANSI, _cell, _text


SUMMARY_TAG = "summary"  # the notebook's conclusions cell: the study page opens with it


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
