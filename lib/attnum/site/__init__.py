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

The package, each module importing only those above it: ``common`` (names, paths, markdown escaping, the pins),
``story`` (a notebook's title, question, finding and conclusions), ``collect`` (the runs and reports, the
checked snapshots), ``provenance`` (a run's provenance and parameters as markdown), ``pages`` (run pages, the
landing page, "Other runs"), ``findings`` (the README's findings block) and ``build`` (Sphinx, the swap,
``publish``).
"""
from __future__ import annotations

from ..runs.store import publish_lock_held
from .build import CONF_PY, publish
from .common import LOCK, ROOT, SEARCH_NOTE, SERVE_COMMAND, PublishError, is_gpu_run, off_pins, pins
from .findings import (README, README_BEGIN, README_END, FindingError, ReadmeError, committed_runs, findings_block,
                       readme_findings, readme_with_findings, stated_finding, update_readme)
from .pages import GlueMissing
from .provenance import KIND_LABELS, short_label
from .story import render_finding

__all__ = ["CONF_PY", "KIND_LABELS", "LOCK", "README", "README_BEGIN", "README_END", "ROOT", "SEARCH_NOTE",
           "SERVE_COMMAND", "FindingError", "GlueMissing", "PublishError", "ReadmeError", "committed_runs",
           "findings_block", "is_gpu_run", "off_pins", "pins", "publish", "publish_lock_held", "readme_findings",
           "readme_with_findings", "render_finding", "short_label", "stated_finding", "update_readme"]
