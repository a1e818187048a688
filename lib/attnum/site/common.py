"""What every part of the publisher shares: the site's fixed names and paths, the markdown escaping that keeps
every data value text (never markup), and the pinned versions a run is checked against.
"""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

from ..runs import RunError
from ..runs.store import PUBLISH_LOCK


LOCK = PUBLISH_LOCK
OTHER = "runs"  # the "Other runs" page
SOURCES = "sources"  # docs/sources.md: the source documents and papers the studies cite
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
SAFE_NAME = re.compile(r"[A-Za-z0-9_.@=,+-]+")  # study, run and figure names that reach a page (paths, links)
SERVE_COMMAND = "python -m http.server -d outputs/site"  # what a reader runs to search the site

# Sphinx's search page reads each result's page with the browser's fetch() to show an excerpt
# (sphinx/themes/basic/static/searchtools.js); browsers refuse fetch() for pages opened as files (file://).
SEARCH_NOTE = ("Search needs a web server: for pages opened as files (file://), browsers refuse the requests the "
               f"search page makes to read the pages it finds. From the project root, run {SERVE_COMMAND} "
               "and open http://localhost:8000/ (the other pages read fine as files).")

REPORTS = "report"  # outputs/report/<name>/: the kernel reports of ``python -m attnum report``
ROOT = Path(__file__).resolve().parents[3]  # the project root (this file is lib/attnum/site/common.py)


class PublishError(RunError):
    """The site was written, but some runs could not be published (named), or nothing could be."""


def is_gpu_run(name: str, device: str) -> bool:
    """A run named ``gpu`` or whose recorded device names CUDA."""
    return name == "gpu" or "cuda" in str(device).lower()


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
