"""The runs and kernel reports under an outputs folder, and the checked snapshot each page is rendered from
(one run's files, copied and verified before they are read).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from pathlib import Path

import nbformat

from .. import ncio
from ..paths import UnsafePathError, open_own_file, pointer_target
from ..runs import SWEEP_MARK
from ..runs.store import SITE
from .common import LOCK, REPORTS, SAFE_NAME, is_gpu_run
from .story import _error_summary


SNAPSHOT_FILES = ("RUN.json", "FAILED", "results.nc", "notebook.ipynb")
REPORT_FILES = ("REPORT.json", "results.nc", "notebook.ipynb")


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
