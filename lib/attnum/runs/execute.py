"""Executing a study notebook: the papermill engine, ``run``, and the notebooks' own set-up ``start``.

``run`` checks everything first (``attnum.runs.params``), then executes the notebook with papermill
in a new version folder and swaps it in atomically (``attnum.runs.store``). ``start`` is the first
code cell of every study notebook (``PARAMS, OUT = start(STUDY, globals())``): the same checks, in
JupyterLab and in papermill alike.
"""
from __future__ import annotations

import ast
import contextlib
import datetime as _dt
import os
import signal
import socket
import threading
import time
from pathlib import Path

from .. import ncio
from ..paths import outputs_root, remove_tree
from .params import (ALLOW_LARGE_ENV, RUNNER_SET, ParameterError, check_machine, check_parameters, did_you_mean,
                     import_papermill, normalize_param_set, notebook_path, parameter_names, resolve_parameters,
                     resolve_study)
from .plan import SWEEP_MARK, check_label, folder_name, name_conflict
from .store import (RunError, drop_stale_versions, new_version, now, point_link, record_failure, run_lock,
                    swap_step)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the runner like Ctrl-C so that the run is marked and cleaned up."""


ENGINE = "attnum"  # papermill engine name of the runner's runs (``_register_engine``)
SAVE_EVERY = 1.0  # seconds: the executing notebook is written at most this often while cells run


def _register_engine(papermill) -> str:
    """papermill's nbclient engine, writing the executing notebook at most every ``SAVE_EVERY`` seconds.

    papermill writes the whole notebook (JSON, schema-validated) when each cell starts and ends:
    about 100 writes of a notebook that grows to 1-2 MB in a 50-cell smoke run, each one between
    two cells. Here a write less than ``SAVE_EVERY`` s after the previous one is skipped while the
    cells run; the final write (papermill's, when execution ends, ends in an error or is
    interrupted) always happens, so the notebook on disk is complete at the end and at most
    ``SAVE_EVERY`` s behind while the run executes.
    """
    from papermill.engines import NBClientEngine, papermill_engines

    if ENGINE in papermill_engines._engines:
        return ENGINE

    class ThrottledSaves(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
            write = type(nb_man).save.__get__(nb_man)
            last = [float("-inf")]

            def save(**save_kwargs):
                now = time.monotonic()
                if now - last[0] >= SAVE_EVERY:
                    write(**save_kwargs)
                    last[0] = time.monotonic()

            nb_man.save = save
            try:
                return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)
            finally:
                del nb_man.save  # the final write (notebook_complete) goes through

    papermill_engines.register(ENGINE, ThrottledSaves)
    return ENGINE


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """In the main thread: SIGTERM raises ``Terminated`` (a KeyboardInterrupt) while the run executes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the failure record short
        raise Terminated(f"terminated by {signal.Signals(signum).name}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _env(name: str, value: str | None):
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


MAX_SOCKET_PATH = 90  # bytes of an IPC socket's path (<folder>/k-<port>); AF_UNIX allows 107 on Linux, 103 on macOS


@contextlib.contextmanager
def kernel_transport():
    """papermill options that start the notebook kernel on IPC (Unix domain sockets) instead of TCP.

    Over TCP, ipykernel (``IPKernelApp.init_sockets``) warns at every start "Kernel is running over TCP
    without encryption", on the runner's stderr: the kernel's five channels listen on loopback ports
    that any local user can reach (messages are signed, not encrypted). IPC sockets are files in a
    folder of this user's own (``mkdtemp``: mode 0700), so nobody else can connect, and the kernel
    has nothing to warn about. The folder is removed when the run ends. Where Unix sockets are not
    available (Windows) or the temporary folder's path is too long for one, the kernel keeps TCP.
    Yields the keyword arguments for ``papermill.execute_notebook`` (nbclient's traitlets ``config``)."""
    import shutil
    import tempfile

    if os.name == "nt":
        yield {}
        return
    folder = tempfile.mkdtemp(prefix="attnum-kernel-")
    try:
        if len(os.path.join(folder, "k-65535")) > MAX_SOCKET_PATH:
            yield {}
            return
        from traitlets.config import Config

        config = Config()
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = os.path.join(folder, "k")  # sockets k-<port>, removed with the folder
        yield {"config": config}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def kernel_pythonpath() -> str:
    """``PYTHONPATH`` for a notebook kernel: the folder holding this ``attnum`` first (the kernel imports
    the code that checked the parameters, installed or not), then this process's entries made absolute
    (the kernel starts in ``notebooks/``, where a relative entry such as ``lib`` would point elsewhere);
    packages installed through ``PYTHONPATH`` (e.g. ``/tmp/site``) reach the kernel as they reach the runner."""
    entries = [str(Path(__file__).resolve().parents[2])]
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry:
            entry = os.path.abspath(entry)
            if entry not in entries:
                entries.append(entry)
    return os.pathsep.join(entries)


def run(study: str, param_set: str = "default", overrides: dict | None = None, *,
        outputs: str | os.PathLike | None = None, sweep_dims=(), progress: bool | str = True,
        name: str | None = None, timeout: int | None = None, allow_large: bool = False,
        wait: bool = False, named: bool = False) -> Path:
    """Execute one study notebook; returns the finished run folder ``<outputs>/<study>/<name>``.

    Everything is checked before anything is written. ``study``: a study, its notebook's file stem or
    the notebook's path (``resolve_study``); ``param_set``: a set's name or a YAML file's path
    (``normalize_param_set``). ``name``: the run's folder (default: from the set and overrides);
    ``named``: ``name`` is one of one's own (``--name``; for a sweep point, its part before ``@``): it is
    checked (``plan.check_label``) and refused if a run of other parameters holds it (``plan.name_conflict``).
    ``allow_large`` runs past the memory estimate; ``wait`` queues behind a running run of the same name
    instead of failing.
    ``progress``: ``True`` shows papermill's bar over the cells and the notebook's own progress
    lines (``attnum.progress``, on this process's terminal); ``"lines"`` only the notebook's lines;
    ``False`` neither (the kernel runs with ``ATTNUM_PROGRESS=off``, whatever the environment says).

    The kernel is stopped at once when the notebook has finished (``shutdown_kernel="immediate"``):
    every output has arrived by then, and the results are read back and checked afterwards.
    """
    from .. import progress as _progress

    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1):
        raise ParameterError(f"timeout must be a whole number of seconds >= 1 (or None: no limit), got {timeout!r}")
    if named:
        check_label(name.split(SWEEP_MARK, 1)[0] if sweep_dims and isinstance(name, str) else name)
    papermill = import_papermill()
    study = resolve_study(study)
    param_set = normalize_param_set(study, param_set)
    overrides = dict(overrides or {})
    values = resolve_parameters(study, param_set, overrides, allow_large=allow_large)
    nb_path = notebook_path(study)
    name = folder_name(param_set, overrides, sweep_dims, name)
    base = Path(outputs).resolve() if outputs else outputs_root()
    study_dir = base / study
    final = study_dir / name
    with run_lock(study_dir, name, wait=wait):
        problem = name_conflict(study_dir, name, param_set, overrides, sweep_dims) if named else None
        if problem:
            raise ParameterError(problem)
        version = new_version(study_dir, name)
        record = {"study": study, "name": name, "param_set": param_set, "overrides": overrides,
                  "parameters": values, "sweep_dims": list(sweep_dims), "notebook": nb_path.name,
                  "output_dir": f"{study}/{name}", "status": "running", "pid": os.getpid(),
                  "host": socket.gethostname(), "started": now()}
        try:
            ncio.write_record(version, record)  # small, first: even a full disk later leaves this
            injected = dict(values, output_dir=str(version), sweep_dims=list(sweep_dims))
            with _sigterm_as_interrupt(), _env(ALLOW_LARGE_ENV, "1" if allow_large else None), \
                    _env(_progress.ENV, None if progress else "off"), _env("PYTHONPATH", kernel_pythonpath()), \
                    kernel_transport() as transport:
                papermill.execute_notebook(str(nb_path), str(version / "notebook.ipynb"), parameters=injected,
                                           progress_bar=progress is True, cwd=str(nb_path.parent),
                                           kernel_name="python3", execution_timeout=timeout, report_mode=False,
                                           engine_name=_register_engine(papermill), shutdown_kernel="immediate",
                                           **transport)
                results = version / "results.nc"
                if not results.exists():
                    raise RunError(f"notebook {nb_path.name} finished without writing results.nc")
                ncio.open_results(results)  # reads every value: the Fletcher-32 checksums hold
                record.update(status="ok", finished=now(), results_sha256=ncio.file_sha256(results),
                              notebook_sha256=ncio.file_sha256(version / "notebook.ipynb"),
                              figures_sha256=ncio.figure_hashes(version))
                ncio.write_record(version, record)
        except BaseException as exc:  # KeyboardInterrupt and SIGTERM too: mark the run, keep earlier results
            failed = record_failure(version, final, record, exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise RunError(f"study {study!r} run {name!r} failed; see {failed}: {record['error']}") from exc
        try:
            point_link(final, version)
        except OSError as exc:
            raise RunError(f"study {study!r} run {name!r} finished, but could not be swapped in ({exc}); "
                           f"its complete results are in {version}") from exc
        failed = final.with_name(final.name + ".failed")
        if failed.is_symlink():
            failed.unlink()
        elif failed.is_dir():
            remove_tree(study_dir, failed)  # a plain folder of the layout before versioned folders
        swap_step("failure-cleared")
        drop_stale_versions(study_dir, name)
        swap_step("cleaned")
    return final


# -- JupyterLab and papermill alike: the notebooks' set-up --

def _lab_folder(study: str) -> Path:
    base = outputs_root() / study
    base.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for i in range(1000):
        folder = base / (f"lab-{stamp}" + (f"-{i}" if i else ""))
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise RunError(f"cannot make a new lab folder under {base}")


PAPERMILL_MARK = "# Parameters"  # the first line of the cell papermill injects (its Python translator)


def _history(namespace: dict) -> list:
    history = namespace.get("In") or namespace.get("_ih") or []
    return list(history) if isinstance(history, (list, tuple)) else []


def _assigned_names(source: str) -> list[str] | None:
    """Names a cell assigns at its top level (``x = ...``, ``x: int = ...``), in order; None if it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            names += [t.id for t in elements if isinstance(t, ast.Name) and t.id not in names]
    return names


def parameters_cell_names(namespace: dict, declared) -> list[str]:
    """The names the notebook's ``parameters`` cell assigned in this kernel, as last executed ([] if not found).

    In JupyterLab the kernel is not told which cell is tagged ``parameters``; IPython's input history
    (``In``) holds every executed cell, and the parameters cell is the latest one that assigns most of
    the study's declared parameters (no other cell assigns more than a few of them). papermill's
    injected cell (``# Parameters``) is not it.
    """
    declared = set(declared)
    for source in reversed(_history(namespace)):
        if not isinstance(source, str) or source.lstrip().startswith(PAPERMILL_MARK):
            continue
        names = _assigned_names(source)
        if names and 2 * len(declared.intersection(names)) >= len(declared):
            return names
    return []


def injected_parameter_names(namespace: dict) -> list[str]:
    """The names papermill's injected-parameters cell assigned in this kernel, in order ([] if none).

    papermill puts the values it is given (``-p``, ``-y``, ``parameters=``) in a cell of its own,
    ``# Parameters`` then one assignment per name, right after the notebook's ``parameters`` cell;
    unknown names are injected too (it only warns). IPython's input history (``In`` / ``_ih`` of the
    namespace) holds the sources of executed cells; the latest such cell is the injected one.
    """
    for source in reversed(_history(namespace)):
        if not isinstance(source, str) or not source.lstrip().startswith(PAPERMILL_MARK):
            continue
        return _assigned_names(source) or []
    return []


def _progress_to_terminal(study: str, out: Path) -> None:
    """A run of the runner: progress bars go to the terminal that started the kernel, not the notebook."""
    from .. import progress

    os.environ.setdefault(progress.ENV, "terminal")  # an explicit ATTNUM_PROGRESS (e.g. off) wins
    try:
        name = ncio.read_record(out).get("name") or out.name
    except (ncio.DamagedRunError, OSError, ValueError):
        name = out.name
    os.environ[progress.LABEL_ENV] = f"{study}/{name}"


def start(study: str, namespace: dict) -> tuple[dict, Path]:
    """The set-up of every study notebook: ``PARAMS, OUT = runner.start(STUDY, globals())``.

    Checks the parameters (the runner's checks and messages), the device and the
    memory estimate, and returns the parameters and the output folder: the one the
    runner chose, or for a JupyterLab run (``output_dir`` empty) a new folder
    ``outputs/<study>/lab-<timestamp>/`` with its own ``RUN.json``, never another run's.

    Raw papermill refuses what the runner refuses: a name papermill injected that the
    notebook does not declare (``-p n_sed 3``) raises the runner's "unknown parameter"
    error here, before any work; so does, in JupyterLab, a name the parameters cell assigns
    that the study does not declare (``n_layers = 4``: "did you mean 'n_layer'?"). In a run of the runner (``output_dir`` set) progress bars
    are sent to the terminal (``attnum.progress``); in JupyterLab they are widgets.
    """
    names = parameter_names(study)
    stray = [n for n in parameters_cell_names(namespace, names) if n not in names]
    if stray:  # a misspelled name in the parameters cell (JupyterLab) would otherwise be ignored silently
        raise ParameterError("the parameters cell assigns " + ", ".join(
            f"{n!r}{did_you_mean(n, names)}" for n in stray) + f", not a parameter of study {study!r}; "
            f"allowed parameters: {sorted(names)}")
    missing = [n for n in names if n not in namespace]
    if missing:
        raise ParameterError(f"the notebook of {study!r} does not define parameter(s) {missing}")
    injected = injected_parameter_names(namespace)
    undeclared = {n: namespace.get(n) for n in injected if n not in names}
    if undeclared:
        check_parameters(study, undeclared)  # raises "unknown parameter ..., allowed parameters: [...]"
    params = {n: namespace[n] for n in names}
    check_parameters(study, params)
    check_machine(study, {k: v for k, v in params.items() if k not in RUNNER_SET})
    if params.get("output_dir"):
        out = Path(params["output_dir"])
        _progress_to_terminal(study, out)
    else:
        out = _lab_folder(study)
        ncio.write_record(out, {"study": study, "name": out.name, "param_set": "lab", "overrides": {},
                                "parameters": {k: v for k, v in params.items() if k not in RUNNER_SET},
                                "sweep_dims": list(params.get("sweep_dims") or []), "status": "lab",
                                "pid": os.getpid(), "host": socket.gethostname(), "started": now()})
    params["output_dir"] = ncio.logical_run_path(out)
    return params, out

