"""Numbers for a notebook's prose, glued from the run's data (MyST-NB ``glue``).

A study's ``readings`` return values (numbers, booleans, short words chosen by code, commit ids from the
run's attributes); a notebook cell passes them to :func:`glue_values`, and the markdown states them with
MyST's roles, e.g. ``{glue:text}`ls_bf16_growth:.2f``` (MyST-NB's ``glue`` documentation: a key glued
in the notebook, a Python format spec after the colon). The site (``nb_execution_mode = "off"``) reads
the glued values from the executed notebook; a reader in JupyterLab sees the same values in the cell's
output table. Nothing is typed into the markdown by hand.

Values are converted to plain Python before gluing: MyST-NB formats the ``text/plain`` form through
``ast.literal_eval``, which a NumPy scalar's repr (``np.float64(0.1)``) would defeat.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

import numpy as np

KEY = re.compile(r"[a-z][a-z0-9_]*")
MISSING = "n/a"  # what a value that the run could not measure reads as in the prose
# a markdown reference to a glued key: {glue}`key`, {glue:text}`key:.2f`, {glue:md}`key`
REFERENCE = re.compile(r"\{glue(?::[a-z]+)?\}`([^`:]+)(?::[^`]*)?`")


class GlueError(ValueError):
    pass


def plain(value):
    """``value`` as a plain Python scalar or string (what ``{glue:text}`` can format)."""
    if isinstance(value, (np.generic, np.ndarray)):
        array = np.asarray(value)
        if array.ndim != 0:
            raise GlueError(f"only scalars are glued into prose, got an array of shape {array.shape}")
        value = array.item()
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # 0-d torch tensors, xarray values
        try:
            value = value.item()
        except (TypeError, ValueError, AttributeError):
            pass
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return MISSING if math.isnan(value) else float(value)
    if isinstance(value, str):
        return value
    raise GlueError(f"cannot glue a {type(value).__name__} into prose: give a number, a boolean or a string")


def glue_values(values: Mapping[str, object], *, show: bool = True):
    """Glue every ``key: value`` for the markdown (hidden outputs that MyST-NB reads) and, when ``show``,
    return a one-column table of them, which the cell displays for a reader in JupyterLab.

    Keys are lower-case identifiers (``[a-z][a-z0-9_]*``) and unique within a notebook (MyST-NB warns
    on a duplicate, and the site build treats its warnings as errors)."""
    from myst_nb import glue

    converted = {}
    for key, value in values.items():
        if not isinstance(key, str) or not KEY.fullmatch(key):
            raise GlueError(f"glue key {key!r} must be a lower-case identifier ([a-z][a-z0-9_]*)")
        converted[key] = plain(value)
    for key, value in converted.items():
        glue(key, value, display=False)
    if show:
        import pandas as pd

        return pd.DataFrame({"value": [_shown(v) for v in converted.values()]},
                            index=pd.Index(list(converted), name="glued"))
    return None


def _shown(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def glued_keys(notebook: dict) -> set[str]:
    """The keys an executed notebook (nbformat dict) glued: its outputs' ``scrapbook`` names."""
    keys = set()
    for cell in notebook.get("cells", []):
        for output in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            name = (output.get("metadata") or {}).get("scrapbook", {}).get("name")
            if name:
                keys.add(name)
    return keys


def referenced_keys(notebook: dict) -> set[str]:
    """The glue keys a notebook's markdown cells refer to."""
    keys = set()
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            keys.update(REFERENCE.findall(source))
    return keys


def missing_keys(executed: dict) -> set[str]:
    """Keys the markdown refers to that the run did not glue (the site build fails on any)."""
    return referenced_keys(executed) - glued_keys(executed)


def read_glued(executed: dict) -> dict[str, object]:
    """``{key: value}`` of an executed notebook's glued values, parsed back from ``text/plain``
    (for tests: the prose's numbers, compared with the run's ``results.nc``)."""
    import ast

    values = {}
    for cell in executed.get("cells", []):
        for output in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            meta = (output.get("metadata") or {}).get("scrapbook")
            if not meta:
                continue
            text = output["data"].get(meta.get("mime_prefix", "") + "text/plain")
            text = "".join(text) if isinstance(text, list) else text
            try:
                values[meta["name"]] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                values[meta["name"]] = text
    return values


def dumps(values: Mapping[str, object]) -> str:
    """The glued values as JSON (a test's or a summary's view)."""
    return json.dumps({k: plain(v) for k, v in values.items()}, sort_keys=True)


def unformat_missing(notebook: dict) -> dict:
    """``notebook`` with the format spec dropped from every markdown reference to a value glued as
    ``MISSING`` (``{glue:text}`k:.2f``` -> ``{glue:text}`k```): a number format cannot format the word,
    and MyST-NB would drop the reference with a warning. The site renders this copy."""
    missing = {k for k, v in read_glued(notebook).items() if v == MISSING}
    if not missing:
        return notebook

    def strip(match):
        return match.group(0) if match.group(2) not in missing else f"{match.group(1)}`{match.group(2)}`"

    pattern = re.compile(r"(\{glue(?::[a-z]+)?\})`([^`:]+)(?::[^`]*)?`")
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            cell["source"] = pattern.sub(strip, source)
    return notebook
