"""Where runs live on disk: versioned folders, the atomic swap, locks, run records, and clean-up.

Runs are versioned: a run executes in a new folder
``outputs/<study>/.versions/<run>/<version>/`` (its ``RUN.json`` written first,
status "running", then updated) and, on success, the symlink
``outputs/<study>/<run>`` is pointed at it with one ``os.replace`` (rename(2): atomic), so
``outputs/<study>/<run>/results.nc`` is at every moment the old complete run or
the new complete run. A plain folder in the way (the committed
``outputs/length_scaling/gpu/``) is exchanged atomically with ``renameat2``'s
``RENAME_EXCHANGE``. One ``fcntl.flock`` lock per run name: a second run of the
same name fails at once with ``RunLocked`` (or queues with ``wait=True``). A
failed or interrupted run (SIGINT, SIGTERM) leaves the earlier results in
place; ``<run>.failed`` then points at its folder, which holds ``FAILED`` and
``RUN.json``. ``clean`` removes leftovers, never a live run, and never the site
while a publish holds its lock (``SITE``, ``PUBLISH_LOCK``: the publisher,
``attnum.site``, builds under the same names). ``clean_results`` deletes the results themselves while
holding ``RUNS_LOCK`` exclusively (every run holds it shared), so no run starts between its check and
its deletion.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import fcntl
import os
import re
import secrets
import socket
import traceback
from pathlib import Path

from .. import ncio
from ..paths import UnsafePathError, check_inside, make_dirs, open_own_file, outputs_root, pointer_target, remove_tree

VERSIONS = ".versions"
LOCKS = ".locks"
SITE = "site"  # outputs/site/: the rendered site (attnum.site)
PUBLISH_LOCK = ".publish.lock"  # outputs/.publish.lock: held while a publish builds the site
RUNS_LOCK = ".runs.lock"  # outputs/.runs.lock: shared by every run in progress, exclusive while clean_results deletes
SWAP_STEPS = ("before-link", "link-created", "replaced", "failure-cleared", "cleaned")
_SWAP_HOOK = None  # tests: a callable(step) run at each step of the swap
_CLEAN_RESULTS_HOOK = None  # tests: a callable() run by clean_results once it holds the locks, before deleting


class RunError(RuntimeError):
    """The notebook failed while running; its folder was marked failed."""


class RunLocked(RunError):
    """Another process is running the same run (same study and run name)."""


# -- the atomic swap, locks, records --

def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def swap_step(step: str) -> None:
    if _SWAP_HOOK is not None:
        _SWAP_HOOK(step)


@contextlib.contextmanager
def run_lock(study_dir: Path, name: str, *, wait: bool = False):
    """Hold the lock of one run name (``<study>/.locks/<name>.lock``, ``fcntl.flock``).

    First a shared lock on the outputs root's ``RUNS_LOCK``: ``clean_results`` takes it exclusively
    while it deletes, so a run starting meanwhile waits until the deletion is over (and then makes its
    folders afresh) instead of losing them to it."""
    with _shared_runs_lock(study_dir.parent):
        locks = study_dir / LOCKS
        make_dirs(study_dir.parent, locks)  # refuses a link planted as the study or its .locks folder
        with _name_lock(study_dir, locks, name, wait=wait):
            yield


@contextlib.contextmanager
def _shared_runs_lock(base: Path):
    base.mkdir(parents=True, exist_ok=True)
    with os.fdopen(open_own_file(base, base / RUNS_LOCK, os.O_RDWR | os.O_CREAT), "r") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)  # waits only while clean_results deletes
        yield


@contextlib.contextmanager
def _name_lock(study_dir: Path, locks: Path, name: str, *, wait: bool):
    # O_NOFOLLOW: a lock planted as a link to a file elsewhere is refused, never truncated and written
    fh = os.fdopen(open_own_file(study_dir.parent, locks / f"{name}.lock", os.O_RDWR | os.O_CREAT), "r+")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise RunLocked(f"run {study_dir.name}/{name} is already running ({holder}); wait for it to "
                            "finish (or pass wait=True to queue)") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {now()}\n")
        fh.flush()
        yield
    finally:
        fh.close()  # closing releases the lock


def flock_held(path: Path, base: Path | None = None) -> bool:
    """Whether another process holds the ``fcntl.flock`` of the lock file ``path`` now.

    ``UnsafePathError`` when the lock, or a folder below ``base`` on the way to it, is a link."""
    path = Path(path)
    if not os.path.lexists(path):
        return False
    with os.fdopen(open_own_file(base or path.parent, path, os.O_RDONLY), "r") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


def lock_held(study_dir: Path, name: str) -> bool:
    return flock_held(study_dir / LOCKS / f"{name}.lock", study_dir.parent)


def pid_alive(pid, host=None) -> bool:
    if host and host != socket.gethostname():
        return True  # cannot tell: assume alive
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def new_version(study_dir: Path, name: str) -> Path:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    folder = study_dir / VERSIONS / name / f"{stamp}-{os.getpid()}-{secrets.token_hex(3)}"
    make_dirs(study_dir.parent, folder.parent)  # a link planted as .versions/<name> is refused, not written into
    folder.mkdir()
    return folder


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (Linux ``renameat2(..., RENAME_EXCHANGE)``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(f"renameat2 is not available here: cannot replace the plain folder {b} atomically; "
                      "move it away (or run under another name)")
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def point_link(link: Path, target: Path) -> None:
    """Make ``link`` a symlink to ``target`` (relative) in one atomic step."""
    tmp = link.with_name(f".{link.name}.link-{os.getpid()}-{secrets.token_hex(3)}")
    swap_step("before-link")
    os.symlink(os.path.relpath(target, link.parent), tmp)
    try:
        swap_step("link-created")
        if link.is_dir() and not link.is_symlink():  # a plain folder: exchange, then retire the old one
            _exchange(tmp, link)
            retired = target.parent / f"{_dt.datetime.now(_dt.timezone.utc):%Y%m%dT%H%M%S}-replaced-{os.getpid()}"
            os.rename(tmp, retired)
        else:
            os.replace(tmp, link)
        ncio._fsync_dir(link.parent)
        swap_step("replaced")
    finally:
        if tmp.is_symlink():
            tmp.unlink()


def _target(link: Path) -> Path | None:
    """The run's own version folder a pointer names (``paths.pointer_target``); None for anything else."""
    return pointer_target(link.parent, link.name)


def _remove(study_dir: Path, path: Path, refused: list[str] | None = None) -> bool:
    """Delete a folder of the study's own (never through a link); a refusal is noted in ``refused``."""
    try:
        remove_tree(study_dir, path)
        return True
    except UnsafePathError as exc:
        if refused is not None:
            refused.append(f"refused {path}: {exc}")
    except OSError:
        pass
    return False


def drop_stale_versions(study_dir: Path, name: str) -> None:
    """Remove the versions of ``name`` that neither ``<name>`` nor ``<name>.failed`` points at."""
    keep = {_target(study_dir / name), _target(study_dir / f"{name}.failed")}
    name_dir = check_inside(study_dir, study_dir / VERSIONS / name)
    for version in sorted(name_dir.iterdir()):
        if version not in keep:
            _remove(study_dir, version)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def describe_error(exc: BaseException) -> str:
    """One line saying why a run failed: the kernel's own error where there is one.

    papermill's ``PapermillExecutionError`` carries the kernel's ``ename``/``evalue`` and traceback
    (its ``str`` starts with a line of dashes, so its first line says nothing); nbclient's
    ``DeadKernelError`` means the kernel process ended (killed, a crash in native code, a memory
    limit such as ``ulimit -v``). An error without a name or message is named as such.
    """
    if hasattr(exc, "ename") and hasattr(exc, "evalue"):
        ename, evalue = str(exc.ename or "").strip(), str(exc.evalue or "").strip()
        where = f" (notebook cell In [{exc.exec_count}])" if getattr(exc, "exec_count", None) is not None else ""
        if evalue:
            return f"{ename or 'error'}: {evalue}{where}"
        lines = [_ANSI.sub("", line).strip() for line in "\n".join(getattr(exc, "traceback", None) or []).splitlines()]
        lines = [line for line in lines if line and not set(line) <= {"-"}]
        if lines:
            return f"{lines[-1]}{where}"
        # measured under ulimit -v 1900000: ename "CellExecutionError", no message, no traceback
        return (f"the kernel reported {ename or 'an error'} with no message or traceback{where}; "
                "it may have run out of memory")
    if type(exc).__name__ == "DeadKernelError":
        return (f"the kernel died: {exc or 'its process ended'} (killed, a crash in native code, or a memory limit "
                "such as ulimit -v or the container's)")
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (no message)"


def record_failure(version: Path, final: Path, record: dict, exc: BaseException) -> Path:
    """Record a failed run; each step may fail on a full disk, the earlier record then stays."""
    record.update(status="interrupted" if isinstance(exc, KeyboardInterrupt) else "failed",
                  error=describe_error(exc), finished=now())
    with contextlib.suppress(OSError):
        ncio.write_record(version, record)
    with contextlib.suppress(OSError):
        (version / "FAILED").write_text(record["error"] + "\n\n" + traceback.format_exc())
    failed = final.with_name(final.name + ".failed")
    with contextlib.suppress(OSError):
        if failed.is_dir() and not failed.is_symlink():
            remove_tree(final.parent, failed)  # a failure record of the layout before versioned folders
        old = _target(failed)  # only a version folder of this run's own, never a link's target elsewhere
        point_link(failed, version)
        if old is not None and old != version and old != _target(final):
            _remove(final.parent, old)
    return failed


# -- clean: leftovers only, never a live run, never results --

def _record_of(folder: Path) -> dict:
    try:
        return ncio.read_record(folder)  # a FIFO or link as RUN.json is refused there, never waited on
    except (ncio.DamagedRunError, OSError, ValueError):
        return {}


def _live_version(study_dir: Path, name: str, version: Path) -> bool:
    if lock_held(study_dir, name):
        return True  # a run of this name is in progress: its version may be about to be swapped in
    record = _record_of(version)
    return record.get("status") == "running" and pid_alive(record.get("pid"), record.get("host"))


def _recover_legacy(study_dir: Path, removed: list[str]) -> None:
    """Folders of the layout before versioned runs: ``.<run>.running-<pid>-<t>`` and ``.<run>.old-<pid>``.

    A run killed between the two renames of the old swap left no ``<run>``: its complete
    new results (``.running-``) or else the old copy (``.old-``) go back, each only when it passes
    ``ncio.verify_run`` with its hashes recorded (a planted folder with a bare ``{"status": "ok"}`` is
    no result: it is removed as a leftover).
    """
    pattern = re.compile(r"^\.(?P<name>.+)\.(?P<kind>running|old)-(?P<pid>\d+)(-\d+)?$")
    leftovers = []
    for p in study_dir.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            leftovers.append((m["name"], m["kind"], int(m["pid"]), p))
    # complete new results first, newest first; then old copies
    leftovers.sort(key=lambda t: (t[1] != "running", -t[3].stat().st_mtime))
    for name, kind, pid, path in leftovers:
        if pid_alive(pid):
            continue
        final = study_dir / name
        try:
            complete = ncio.verify_run(path).get("status") == "ok"
        except (ncio.DamagedRunError, OSError):
            complete = False
        if complete and not final.exists() and not final.is_symlink() and (path / "results.nc").exists():
            target = study_dir / VERSIONS / name / f"recovered-{path.name.lstrip('.')}"
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(path, target)
            point_link(final, target)
            removed.append(f"recovered {final} from {path.name}")
            continue
        if _remove(study_dir, path, removed):
            removed.append(str(path))


def clean(outputs: str | os.PathLike | None = None) -> list[str]:
    """Remove leftovers under the outputs root; returns what was removed or recovered.

    Leftovers: versions of a run that no pointer names and that no live process owns
    (lock held, or RUN.json "running" with a live pid), temporary links, the rendered
    site, its build folders and a replaced site a killed publish left (``.site.old-*``; unless a
    publish holds its lock), folders of the
    layout before versioned runs (recovering a run a killed swap left without a folder).
    Results a pointer names are never touched. A symbolic link where a folder of the project's own
    is expected (a study folder, ``.versions``, ``.versions/<run>``, a version, a lock) is never
    followed: it is reported as ``refused <path>: ...``. So is a folder that cannot be read.
    """
    base = Path(outputs).resolve() if outputs else outputs_root()
    removed: list[str] = []
    if not base.is_dir():
        return removed
    try:
        site_busy = publish_lock_held(base)
    except UnsafePathError as exc:
        removed.append(f"refused {base / PUBLISH_LOCK}: {exc}")
        site_busy = True
    if not site_busy:
        # a publish killed between its two renames leaves .site.old-*: the site is rebuilt by publish
        for p in [base / SITE, *base.glob(f".{SITE}.building*"), *base.glob(f".{SITE}.old-*")]:
            if p.is_dir() and not p.is_symlink() and _remove(base, p, removed):
                removed.append(str(p))
    for study_dir in sorted(p for p in base.iterdir() if not p.name.startswith(".") and p.name != SITE):
        if study_dir.is_symlink():
            removed.append(f"refused {study_dir}: a symbolic link where attnum expects a study folder; not followed")
            continue
        if not study_dir.is_dir():
            continue
        try:
            _clean_study(study_dir, removed)
        except PermissionError as exc:
            removed.append(f"refused {study_dir}: cannot be read ({exc})")
    return removed


def _clean_study(study_dir: Path, removed: list[str]) -> None:
    """One study folder of ``clean``."""
    for link in study_dir.glob(".*.link-*"):
        m = re.search(r"\.link-(\d+)-", link.name)
        if link.is_symlink() and not (m and pid_alive(int(m[1]))):
            link.unlink()
            removed.append(str(link))
    _recover_legacy(study_dir, removed)
    versions = study_dir / VERSIONS
    if versions.is_symlink():
        removed.append(f"refused {versions}: a symbolic link where attnum expects its own folder; not followed")
    elif versions.is_dir():
        for name_dir in sorted(versions.iterdir()):
            if name_dir.is_symlink():
                removed.append(f"refused {name_dir}: a symbolic link where attnum expects its own folder; "
                               "not followed")
                continue
            if not name_dir.is_dir():
                continue
            name = name_dir.name
            keep = {_target(study_dir / name), _target(study_dir / f"{name}.failed")}
            for version in sorted(name_dir.iterdir()):
                try:
                    if version in keep or _live_version(study_dir, name, version):
                        continue
                except UnsafePathError as exc:  # e.g. its lock is a link: cannot tell, so keep it
                    removed.append(f"refused {version}: {exc}")
                    continue
                if version.is_symlink():
                    removed.append(f"refused {version}: a symbolic link where attnum expects a version "
                                   "folder; not followed")
                    continue
                if _remove(study_dir, version, removed):
                    removed.append(str(version))
            with contextlib.suppress(OSError):
                name_dir.rmdir()  # only if empty
    for link in [*study_dir.iterdir()]:  # pointers whose folder is gone
        if link.is_symlink() and not link.exists():
            link.unlink()
            removed.append(str(link))


def live_runs(outputs: str | os.PathLike | None = None) -> list[str]:
    """``<study>/<run>`` of every run in progress under the outputs root (its lock is held)."""
    base = Path(outputs).resolve() if outputs else outputs_root()
    out = []
    for locks in sorted(base.glob(f"*/{LOCKS}")) if base.is_dir() else []:
        check_inside(base, locks)  # a study or .locks folder planted as a link: UnsafePathError, named
        for lock in sorted(locks.glob("*.lock")):
            if lock_held(locks.parent, lock.name[:-len(".lock")]):
                out.append(f"{locks.parent.name}/{lock.name[:-len('.lock')]}")
    return out


def _results_entries(base: Path) -> list[Path]:
    """What ``clean_results`` deletes: in a git work tree the entries git ignores under ``base`` (the
    committed runs stay, as ``git clean -X`` kept them), elsewhere everything in ``base``; never ``RUNS_LOCK``."""
    import subprocess

    try:
        proc = subprocess.run(["git", "-C", str(base), "ls-files", "-z", "--others", "--ignored",
                               "--exclude-standard", "--directory", "--", "."],
                              capture_output=True, check=False, timeout=120)
        listed = proc.stdout.decode(errors="surrogateescape").split("\0") if proc.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        listed = None
    if listed is None:
        entries = sorted(base.iterdir())
    else:
        entries = []
        for rel in filter(None, listed):
            path = base / rel.rstrip("/")
            entries += sorted(path.iterdir()) if path == base else [path]  # nothing of base is kept
    return [p for p in entries if p != base / RUNS_LOCK]


def clean_results(outputs: str | os.PathLike | None = None) -> list[str]:
    """Delete the results under the outputs root (``make clean-results``), holding the run locks throughout.

    Refuses (``RunLocked``, naming them) while runs are in progress. It takes ``RUNS_LOCK`` exclusively
    before it looks and keeps it until the last file is gone, so no run can start between the check and
    the deletion: one that starts meanwhile waits and then begins in an empty outputs root. In a git work
    tree only what git ignores is deleted (committed runs stay). Links are removed as links, never followed.
    Returns the paths removed.
    """
    base = Path(outputs).resolve() if outputs else outputs_root()
    if not base.is_dir():
        return []
    removed: list[str] = []
    with os.fdopen(open_own_file(base, base / RUNS_LOCK, os.O_RDWR | os.O_CREAT), "r") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLocked(f"run(s) in progress under {base}: {', '.join(live_runs(base)) or 'starting'}; "
                            "wait for them to finish") from None
        live = live_runs(base)  # a name lock held without the shared lock (attnum from before RUNS_LOCK)
        if live:
            raise RunLocked(f"run(s) in progress under {base}: {', '.join(live)}; wait for them to finish")
        if _CLEAN_RESULTS_HOOK is not None:
            _CLEAN_RESULTS_HOOK()
        for path in _results_entries(base):
            check_inside(base, path)
            if path.is_dir() and not path.is_symlink():
                remove_tree(base, path)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            removed.append(str(path))
    return removed


def publish_lock_held(base: Path) -> bool:
    """Whether a publish is building the site of the outputs root ``base`` now."""
    return flock_held(Path(base) / PUBLISH_LOCK, Path(base))
