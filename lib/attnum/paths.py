"""Where the project lives: its root, its notebooks, parameters and outputs, and the commit it is at."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path


def project_root() -> Path:
    """``$ATTNUM_ROOT``, else the checkout holding this package (``lib/attnum`` -> root)."""
    env = os.environ.get("ATTNUM_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parents[2]
    if (here / "pyproject.toml").exists() and (here / "notebooks").is_dir():
        return here
    raise RuntimeError("cannot locate the project root: install attnum in editable mode "
                       "(make setup) or set ATTNUM_ROOT")


def outputs_root() -> Path:
    """``$ATTNUM_OUTPUTS``, else ``<root>/outputs``."""
    env = os.environ.get("ATTNUM_OUTPUTS")
    return Path(env).resolve() if env else project_root() / "outputs"


def notebooks_dir() -> Path:
    return project_root() / "notebooks"


def params_dir() -> Path:
    return project_root() / "params"


# -- the project's own folders and files: never through a link planted in outputs/ --

class UnsafePathError(OSError):
    """A path where attnum expects its own folder or file is a symbolic link (or not what it should be)."""


def _lstat(path: Path):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def check_inside(base: str | os.PathLike, path: str | os.PathLike) -> Path:
    """``path``, after checking that no component of it below ``base`` is a symbolic link.

    ``base`` itself may be a link (an outputs root placed elsewhere on purpose); what lies under it is
    the project's own and is never followed. Raises ``UnsafePathError`` naming the refused path, and
    also when ``path`` is not under ``base`` at all.
    """
    import stat

    base, path = Path(base), Path(path)
    try:
        rel = path.relative_to(base)
    except ValueError:
        raise UnsafePathError(f"{path} is not inside {base}; refusing to touch it") from None
    here = base
    for part in rel.parts:
        if part in ("..", ""):
            raise UnsafePathError(f"{path}: '..' below {base}; refusing to touch it")
        here = here / part
        st = _lstat(here)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(f"{here} is a symbolic link where attnum expects its own folder or file; "
                                  "refusing to follow it (remove the link)")
    return path


def make_dirs(base: str | os.PathLike, path: str | os.PathLike) -> Path:
    """``mkdir -p path`` below ``base``, one component at a time, refusing any symbolic link on the way."""
    import stat

    base, path = Path(base), Path(path)
    check_inside(base, path)
    base.mkdir(parents=True, exist_ok=True)  # the root itself is the user's choice, a link there is fine
    here = base
    for part in path.relative_to(base).parts:
        here = here / part
        try:
            os.mkdir(here)
        except FileExistsError:
            st = os.lstat(here)
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError(f"{here} is a symbolic link where attnum expects its own folder; "
                                      "refusing to follow it (remove the link)") from None
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafePathError(f"{here} is not a folder (attnum expects its own folder there)") from None
    return path


def remove_tree(base: str | os.PathLike, path: str | os.PathLike, *, missing_ok: bool = True) -> None:
    """Delete the folder ``path`` below ``base``; refuses (``UnsafePathError``, naming it) a symbolic link
    at ``path`` or on the way to it, and anything that is not a folder. Inside the folder, links are
    removed as links, never followed (``shutil.rmtree`` works on file descriptors here)."""
    import shutil
    import stat

    path = check_inside(base, path)
    st = _lstat(path)
    if st is None:
        if missing_ok:
            return
        raise FileNotFoundError(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} is not a folder; refusing to delete it as one")
    shutil.rmtree(path)


def open_own_file(base: str | os.PathLike, path: str | os.PathLike, flags: int = os.O_RDONLY, mode: int = 0o644,
                  *, max_bytes: int | None = None) -> int:
    """Open one of the project's own files without following a link and without blocking on a FIFO;
    returns the descriptor. ``UnsafePathError`` (naming the path) for a link, a FIFO, a folder or
    anything that is not a regular file, or (``max_bytes``) a file larger than that."""
    import stat

    check_inside(base, path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        import errno

        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link where attnum expects its own file; "
                                  "refusing to follow it (remove the link)") from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):
            raise UnsafePathError(f"{path} is not a regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path} is not a regular file (a FIFO, device or folder); refusing to read it")
    if max_bytes is not None and st.st_size > max_bytes:
        os.close(fd)
        raise UnsafePathError(f"{path} is {st.st_size} bytes, more than the {max_bytes} such a file may hold")
    os.set_blocking(fd, True)
    return fd


def pointer_target(study_dir: str | os.PathLike, name: str) -> Path | None:
    """The version folder the run pointer ``<study>/<name>`` (a symbolic link) names, when it is one of this
    run's own: ``<study>/.versions/<name>/<version>``, with no link on the way. ``None`` when ``name`` is not
    a link, or is a link anywhere else (a link planted there is never followed)."""
    study_dir = Path(study_dir)
    link = study_dir / name
    if not link.is_symlink():
        return None
    target = Path(os.path.normpath(link.parent / os.readlink(link)))
    base = name[:-len(".failed")] if name.endswith(".failed") else name
    if target.parent != study_dir / ".versions" / base:
        return None
    try:
        check_inside(study_dir, target)
    except UnsafePathError:
        return None
    return target


def git_state(root: Path | None = None) -> dict[str, str]:
    """Commit hash and dirty flag of the project checkout ("unknown" outside git).

    ``$ATTNUM_GIT_COMMIT`` (and ``$ATTNUM_GIT_DIRTY``) stand in where the code runs
    from a copy of the tree without its git history, e.g. on a lent GPU machine.
    """
    if os.environ.get("ATTNUM_GIT_COMMIT"):
        return {"git_commit": os.environ["ATTNUM_GIT_COMMIT"],
                "git_dirty": os.environ.get("ATTNUM_GIT_DIRTY", "unknown")}
    try:
        root = root or project_root()
    except RuntimeError:
        return {"git_commit": "unknown", "git_dirty": "unknown"}

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"git_commit": "unknown", "git_dirty": "unknown"}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"git_commit": head.stdout.strip(), "git_dirty": str(bool(dirty.stdout.strip())).lower()}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "git_dirty": "unknown"}
