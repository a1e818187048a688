"""Batches of study runs on ``dask.distributed``: ``run-all`` and ``sweep``.

A batch is planned first: every run (a study of ``run-all``, a grid point of ``sweep``) becomes a
``PlannedRun`` (``attnum.runs.plan``) whose parameters are checked before anything is submitted, so a bad value anywhere refuses
the whole batch and no run folder appears. Each task is then one ``attnum.runs.run(...)`` call on a Dask
worker: it executes in its staging folder and is swapped in as ``outputs/<study>/<run>/`` exactly as a
single ``python -m attnum run`` would. A failed run is reported in the task's result (never raised to
Dask), so it neither stops nor touches the others.

Where the tasks run:

* default: a ``LocalCluster`` started for the batch (worker processes with one thread each, so one
  run per worker at a time) and closed at the end; ``workers=1`` runs the tasks in this process,
  one after another, with the same task function (no cluster to start);
* ``gpus=N``: N workers, worker ``i`` with ``CUDA_VISIBLE_DEVICES=i`` and ``resources={"GPU": 1}``;
  tasks whose parameters say ``device: cuda`` ask for ``{"GPU": 1}``, so two runs never share a GPU;
* ``scheduler=ADDRESS`` (or ``$ATTNUM_DASK_SCHEDULER``): an existing cluster; its workers must import
  this checkout of ``attnum`` and see the outputs root at the same path (a shared filesystem).

Every task sets ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` (and friends) to ``threads`` (1 by default) in
its worker before calling ``attnum.runs.run``; the notebook kernel that papermill starts inherits them, and
torch takes its thread count from ``OMP_NUM_THREADS``. Two runs with two threads each on two cores
are slower than one after another; with one thread each they are not.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..paths import outputs_root
from . import execute as _execute
from .plan import PlannedRun, check_names_free, plan_run_all, plan_sweep
from .store import RunError

SCHEDULER_ENV = "ATTNUM_DASK_SCHEDULER"
WORKER_ENV = "ATTNUM_BATCH_WORKER"  # set for the notebook kernel: which worker ran it
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS")
# Set by Dask's nanny in every worker (``distributed.nanny.pre-spawn-environ``) and so inherited by the
# notebook kernels: MALLOC_TRIM_THRESHOLD_=65536 turns off glibc's adaptive mmap threshold, so every
# tensor above 128 KiB is a fresh mmap (page faults, zeroing): a torch loop of small matmuls and softmaxes
# ran 2.1x slower with it here (0.56 s -> 1.19 s). A run's kernel gets the value of the process that
# launched the batch instead (usually unset), as a plain run would.
NANNY_ENV = ("MALLOC_TRIM_THRESHOLD_",)
EVENT_TOPIC = "attnum-batch"
SCHEDULER_LOST_S = 60.0  # seconds a client may stay disconnected ("connecting") before the batch is failed
KEY_PREFIX = "attnum-run"  # one Dask task group: the scheduler queues the runs and hands them out by priority


class BatchError(RuntimeError):
    """The batch cannot be placed on the cluster (e.g. GPU runs and no GPU worker)."""


@dataclass
class Result:
    """What became of one task: state ``ok`` / ``failed`` / ``not run``, time, folder, where it ran."""

    task: PlannedRun
    state: str = "not run"
    seconds: float | None = None
    folder: str | None = None
    error: str | None = None
    worker: str | None = None
    host: str | None = None
    pid: int | None = None
    gpu: str | None = None
    threads: int | None = None
    started: float | None = None  # wall clock (epoch seconds) on the worker
    finished: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.state == "ok"


# -- planning (attnum.runs.plan) --

def describe_plan(tasks: list[PlannedRun], outputs=None) -> str:
    """The plan as text: one line per run, its folder and the resources it asks for."""
    base = _outputs(outputs)
    lines = [f"{len(tasks)} run(s) into {base}:"]
    for i, t in enumerate(tasks, 1):
        res = ",".join(f"{k}={v}" for k, v in t.resources.items()) or "-"
        over = json.dumps(t.overrides, sort_keys=True) if t.overrides else "{}"
        lines.append(f"  {i:3d}  {t.label}  device={t.device}  resources={res}  overrides={over}")
    return "\n".join(lines)


# -- the task that runs on a worker --

def _where() -> dict:
    info = {"host": socket.gethostname(), "pid": os.getpid(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "worker": "in-process"}
    try:
        from distributed import get_worker

        w = get_worker()
        info["worker"] = str(w.name) if w.name is not None and str(w.name) != w.address else w.address
        info["worker_address"] = w.address
    except (ImportError, ValueError):
        pass
    return info


def _announce(event: str, key: str | None, info: dict) -> None:
    if key is None:
        return
    try:
        from distributed import get_worker

        get_worker().log_event(EVENT_TOPIC, {"event": event, "key": key, **info})
    except Exception:  # progress only: never let it fail a run
        pass


def _error_text(exc: BaseException) -> str:
    """One line: what went wrong, from the root cause (a notebook's own error, not papermill's banner)."""
    cause = exc
    while cause is not None and not hasattr(cause, "ename"):
        cause = cause.__cause__
    if cause is not None:  # papermill.PapermillExecutionError
        where = f"cell {cause.exec_count}" if getattr(cause, "exec_count", None) is not None else "a cell"
        text = f"notebook failed in {where}: {cause.ename}: {cause.evalue}"
    elif exc.__cause__ is not None:  # RunError from ...: the run's folder is reported beside it
        text = f"{type(exc.__cause__).__name__}: {exc.__cause__}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def launcher_env() -> dict:
    """The ``NANNY_ENV`` variables of this process (the one launching the batch): None where unset."""
    return {var: os.environ.get(var) for var in NANNY_ENV}


def run_planned(task: PlannedRun, outputs: str, timeout: int | None = None, threads: int = 1,
            key: str | None = None, progress: bool = False, launcher: dict | None = None) -> dict:
    """Run one task with ``attnum.runs.run``; returns a plain dict (state, seconds, folder, error, where).

    ``progress``: the notebook's own progress lines on the worker's terminal (never papermill's bar
    over the cells); ``False``: none (``run(progress=False)``). ``launcher``: the ``NANNY_ENV``
    variables of the process that launched the batch (``launcher_env()``), given to the kernel instead
    of the worker's own."""
    info = _where()
    env = {var: str(threads) for var in THREAD_VARS}
    env[WORKER_ENV] = f"{info['worker']}@{info['host']}" + (f" gpu={info['gpu']}" if info["gpu"] else "")
    os.environ.update(env)  # inherited by the kernel papermill starts; torch reads OMP_NUM_THREADS
    for var, value in (launcher or {}).items():
        if var in NANNY_ENV:
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
    if "torch" in sys.modules:  # only if this process imported it (the in-process path)
        sys.modules["torch"].set_num_threads(threads)
    _announce("start", key, info)
    out = dict(info, threads=threads, state="failed", folder=None, error=None, started=time.time())
    t0 = time.perf_counter()
    try:
        folder = _execute.run(task.study, task.param_set, task.overrides, outputs=outputs,
                            sweep_dims=list(task.sweep_dims), progress="lines" if progress else False,
                            name=task.name, timeout=timeout, named=task.named)
        out.update(state="ok", folder=str(folder))
    except Exception as exc:  # RunError, ParameterError, or anything else: this run failed, the batch goes on
        out["error"] = _error_text(exc)
        failed = Path(outputs) / task.study / f"{task.name}.failed"
        if failed.exists():
            out["folder"] = str(failed)
    out["seconds"] = time.perf_counter() - t0
    out["finished"] = time.time()
    return out


# -- the cluster --

def default_workers(n_tasks: int | None = None, threads: int = 1) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    n = max(1, cores // max(1, threads))
    return max(1, min(n, n_tasks)) if n_tasks else n


def has_bokeh() -> bool:
    return importlib.util.find_spec("bokeh") is not None


def _outputs(outputs) -> Path:
    return Path(outputs).resolve() if outputs else outputs_root()


def start_local_cluster(workers: int = 0, gpus: int = 0, *, dashboard: bool | None = None):
    """A LocalCluster of one-thread worker processes: ``workers`` plain ones plus ``gpus`` pinned ones."""
    import dask
    from distributed import LocalCluster, Nanny

    if dashboard is None:
        dashboard = has_bokeh()
    # One run per worker at a time, and the next queued run only when a worker is free: the longest
    # runs (highest priority) start first instead of being promised to a worker early.
    with dask.config.set({"distributed.scheduler.worker-saturation": 1.0}):
        # the scheduler's HTTP server (health, metrics; the dashboard pages need bokeh) on a free port
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                               dashboard_address="127.0.0.1:0", scheduler_kwargs={"dashboard": dashboard},
                               memory_limit=0, silence_logs=logging.ERROR)
    if gpus:
        for i in range(gpus):
            cluster.worker_spec[f"gpu{i}"] = {
                "cls": Nanny,
                "options": {"nthreads": 1, "memory_limit": 0, "host": "127.0.0.1",
                            "env": {"CUDA_VISIBLE_DEVICES": str(i)}, "resources": {"GPU": 1}}}
        cluster.scale(len(cluster.worker_spec))  # starts the added specs
    return cluster


def _worker_threads(client) -> tuple[int, int]:
    """Threads of the connected workers: (all, those of workers offering a GPU); at least (1, 0)."""
    try:
        info = client.scheduler_info(n_workers=-1) if _accepts_n_workers(client) else client.scheduler_info()
        workers = info.get("workers", {}).values()
        total = sum(int(w.get("nthreads", 1)) for w in workers)
        gpu = sum(int(w.get("nthreads", 1)) for w in workers if (w.get("resources") or {}).get("GPU", 0) >= 1)
        return max(1, total), gpu
    except Exception:
        return 1, 0


def _gpu_workers(client) -> int:
    info = client.scheduler_info(n_workers=-1) if _accepts_n_workers(client) else client.scheduler_info()
    return sum(1 for w in info.get("workers", {}).values() if (w.get("resources") or {}).get("GPU", 0) >= 1)


def _accepts_n_workers(client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters


def dashboard_line(client, local: bool) -> str:
    """The dashboard address, or why there is none (its pages need bokeh where the scheduler runs)."""
    if local:
        bokeh = has_bokeh()
    else:
        try:
            bokeh = client.run_on_scheduler(has_bokeh)
        except Exception:
            bokeh = None
    if bokeh is False:
        return "no dashboard (bokeh not installed" + ("" if local else " where the scheduler runs") + ")"
    link = None
    try:
        if "dashboard" in (client.scheduler_info().get("services") or {}):
            link = client.dashboard_link
    except Exception:
        pass
    return f"dashboard: {link}" if link else "no dashboard (the scheduler runs none)"


# Seconds a study's default tier took as a one-thread run on the 2-core CPU this project is developed on
# (README: "Measured run times"; rounded), used only to start the longest runs first when no earlier run
# of the same folder left its RUN.json (a fresh clone). Only the order matters, not the values.
TYPICAL_SECONDS = {("length_scaling", "default"): 92, ("late_training_gradient_blowup", "default"): 56,
                   ("gproj_fix", "default"): 47, ("extreme_inputs", "default"): 34,
                   ("wasserstein_weight_drift", "default"): 33}


def _priorities(tasks: list[PlannedRun], base: Path) -> list[float]:
    """Longest first: the duration of the previous run of the same folder (RUN.json), else the study's
    ``TYPICAL_SECONDS`` for a plain default run (no overrides), else 0."""
    import datetime as dt

    out = []
    for t in tasks:
        seconds = 0.0 if t.overrides else float(TYPICAL_SECONDS.get((t.study, t.param_set), 0))
        try:
            rec = json.loads((base / t.study / t.name / "RUN.json").read_text())
            seconds = (dt.datetime.fromisoformat(rec["finished"]) - dt.datetime.fromisoformat(rec["started"])
                       ).total_seconds()
        except Exception:
            pass
        out.append(seconds)
    return out


def submission_order(tasks: list[PlannedRun], base: Path) -> list[int]:
    """Indices of ``tasks``, longest expected first (``_priorities``), plan order among equals."""
    prio = _priorities(tasks, base)
    return sorted(range(len(tasks)), key=lambda i: (-prio[i], i))


# -- running a batch --

class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.ok = self.failed = 0
        self.running: set = set()
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="run", desc="batch", file=sys.stderr, dynamic_ncols=True)
            self._show()

    def _show(self):
        if self.bar is not None:
            self.bar.set_postfix_str(f"done {self.ok}, failed {self.failed}, running {len(self.running)}",
                                     refresh=True)

    def start(self, key):
        self.running.add(key)
        self._show()

    def finish(self, key, ok: bool, label: str):
        self.running.discard(key)
        if ok:
            self.ok += 1
        else:
            self.failed += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"done {self.ok}, failed {self.failed}, running {len(self.running)}",
                                     refresh=False)
            self.bar.update(1)
            if not ok:
                self.bar.write(f"failed: {label}")

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _fill(result: Result, out: dict) -> Result:
    for k in ("state", "seconds", "folder", "error", "worker", "host", "pid", "gpu", "threads", "started",
              "finished"):
        if k in out:
            setattr(result, k, out[k])
    return result


def run_batch(tasks: list[PlannedRun], *, outputs=None, workers: int | None = None, scheduler: str | None = None,
              gpus: int = 0, threads: int = 1, timeout: int | None = None, progress: bool = True,
              client=None, log=print) -> list[Result]:
    """Run every task; returns one ``Result`` per task, in plan order. Never raises for a failed run.

    ``client``: a ``distributed.Client`` of the caller's, used as it is and left open; else
    ``scheduler`` (or ``$ATTNUM_DASK_SCHEDULER``): connect to that cluster; else a LocalCluster of
    ``workers`` processes plus ``gpus`` GPU-pinned ones, closed at the end; ``workers=1`` (and no
    GPUs): in this process, one run after another.
    """
    base = _outputs(outputs)
    results = [Result(t) for t in tasks]
    if not tasks:
        return results
    scheduler = scheduler or os.environ.get(SCHEDULER_ENV) or None
    if workers is None:
        workers = 0 if gpus else default_workers(len(tasks), threads)
    if client is None and scheduler is None and gpus == 0 and workers <= 1:
        return _run_in_process(tasks, results, base, timeout, threads, progress, log)
    return _run_on_dask(tasks, results, base, client, scheduler, workers, gpus, threads, timeout, progress, log)


def _run_in_process(tasks, results, base, timeout, threads, progress, log):
    log(f"batch: {len(tasks)} run(s) in this process, one after another, {threads} thread(s) each")
    saved = {var: os.environ.get(var) for var in (*THREAD_VARS, WORKER_ENV)}
    torch_threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    bar = _Progress(len(tasks), progress)
    try:
        for i, (task, result) in enumerate(zip(tasks, results)):
            bar.start(i)
            _fill(result, run_planned(task, str(base), timeout, threads, progress=progress, launcher=launcher_env()))
            bar.finish(i, result.ok, task.label)
    finally:
        bar.close()
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        if torch_threads is not None:
            sys.modules["torch"].set_num_threads(torch_threads)
    return results


def _run_on_dask(tasks, results, base, client, scheduler, workers, gpus, threads, timeout, progress, log):
    from distributed import Client

    cluster, own_client = None, client is None
    # read before a LocalCluster starts: its nannies live in this process and set their pre-spawn environment
    # (MALLOC_TRIM_THRESHOLD_=65536) in this process's os.environ, which the old read after the start returned
    launcher = launcher_env()
    if client is not None:
        where = f"the cluster of the given client ({client.scheduler.address})"
    elif scheduler:
        client = Client(scheduler, timeout=60)
        where = f"the cluster at {scheduler}"
    else:
        cluster = start_local_cluster(workers, gpus)
        client = Client(cluster)
        where = (f"a LocalCluster of {workers + gpus} worker process(es)"
                 + (f", {gpus} of them pinned to one GPU each" if gpus else "") + ", one thread each")
    try:
        # all of ours; at least one of an existing cluster's (it may still be scaling up)
        want = workers + gpus if cluster is not None else 1
        try:
            client.wait_for_workers(want, timeout=120)
        except Exception as exc:
            raise BatchError(f"no {want} worker(s) connected to {where} within 120 s ({exc})") from exc
        n_workers = len(client.nthreads())
        log(f"batch: {len(tasks)} run(s) on {where} ({n_workers} worker(s) connected), {threads} thread(s) per run")
        log(dashboard_line(client, cluster is not None))
        need_gpu = [t.label for t in tasks if t.resources]
        if need_gpu and _gpu_workers(client) == 0:
            raise BatchError(f"{len(need_gpu)} run(s) ask for a GPU (device: cuda), e.g. {need_gpu[0]}, but no "
                             "worker offers one: pass --gpus N, or start workers with --resources GPU=1")
        bar = _Progress(len(tasks), progress)
        keys, finished = {}, set()

        def on_event(event):  # (timestamp, msg) from run_planned(): a run started on a worker
            msg = event[1] if isinstance(event, tuple) else event
            if isinstance(msg, dict) and msg.get("event") == "start" and msg.get("key") in keys \
                    and msg["key"] not in finished:
                bar.start(msg["key"])

        client.subscribe_topic(EVENT_TOPIC, on_event)
        prio = _priorities(tasks, base)
        queue = submission_order(tasks, base)  # longest expected first
        pending: list = []

        def submit_ready() -> None:
            """Submit queued runs, longest first, while a worker thread that can take them is free."""
            total, gpu = _worker_threads(client)
            while queue:
                busy_gpu = sum(1 for f in pending if tasks[keys[f.key]].resources)
                if len(pending) >= total:
                    return
                fits = [i for i in queue if not tasks[i].resources or busy_gpu < gpu]
                if not fits:
                    return
                i = fits[0]
                rank = len(tasks) - len(queue)
                queue.remove(i)
                key = f"{KEY_PREFIX}-{uuid.uuid4().hex}"
                keys[key] = i
                pending.append(client.submit(run_planned, tasks[i], str(base), timeout, threads, key, progress,
                                             launcher, key=key, pure=False, resources=tasks[i].resources or None,
                                             retries=0, priority=int(prio[i]) * 1000 - rank))

        lost_since = None
        try:
            # A run is handed to Dask only when a worker thread that can take it is free, longest first:
            # Dask binds each task of a small batch to a worker when it is submitted (it queues tasks on the
            # scheduler, in priority order, only for groups larger than twice the cluster's threads), so a
            # run submitted early could wait behind a long one while another worker idles.
            while queue or pending:
                status = str(getattr(client, "status", "running"))
                if status in ("closing", "closed", "failed") or (
                        status == "connecting" and time.monotonic() - (lost_since or time.monotonic()) > SCHEDULER_LOST_S):
                    # the scheduler is gone (killed, unreachable): its futures never finish; fail the batch
                    for fut in pending:
                        results[keys[fut.key]].state = "failed"
                        results[keys[fut.key]].error = (f"lost the Dask scheduler ({where}, client {status}); the run's "
                                                        "folder, if it started, is left to `make clean`")
                    for i in queue:
                        results[i].error = "not started: the Dask scheduler was lost"
                    bar.close()
                    log(summary(results))
                    raise BatchError(f"lost the Dask scheduler of {where} (client {status}) with "
                                     f"{len(pending)} run(s) in progress and {len(queue)} not started")
                lost_since = (lost_since or time.monotonic()) if status == "connecting" else None
                submit_ready()
                still = []
                for fut in pending:
                    if not fut.done():
                        still.append(fut)
                        continue
                    i = keys[fut.key]
                    try:
                        _fill(results[i], fut.result())
                    except Exception as exc:  # the task itself never raises: the worker died or was lost
                        results[i].state = "failed"
                        results[i].error = f"{type(exc).__name__}: {exc}"
                    finished.add(fut.key)
                    bar.finish(fut.key, results[i].ok, tasks[i].label)
                pending[:] = still
                if pending:
                    time.sleep(0.2)
        except KeyboardInterrupt:
            try:
                client.cancel(pending)
            except Exception:  # a closed client (the scheduler is gone): the summary still comes
                pass
            for fut in pending:
                results[keys[fut.key]].error = "interrupted (a run in progress leaves its folder to `make clean`)"
            for i in queue:
                results[i].error = "interrupted before it started"
            bar.close()
            log(summary(results))
            raise
        finally:
            bar.close()
            try:
                client.unsubscribe_topic(EVENT_TOPIC)
            except Exception:
                pass
    finally:
        if own_client:
            client.close()
        if cluster is not None:
            cluster.close()
    return results


# -- reporting --

def summary(results: list[Result], wall: float | None = None) -> str:
    """Every run with its state, time, where it ran and its folder (or error)."""
    n_ok = sum(r.ok for r in results)
    head = f"batch summary: {n_ok}/{len(results)} ok, {len(results) - n_ok} failed or not run"
    if wall is not None:
        head += f", {wall:.1f} s wall"
    lines = [head]
    for r in results:
        secs = f"{r.seconds:7.1f} s" if r.seconds is not None else "      - "
        where = r.worker or "-"
        if r.host:
            where += f"@{r.host}"
        if r.gpu:
            where += f" gpu={r.gpu}"
        lines.append(f"  {r.state:7s} {secs}  {r.task.label}  [{where}]")
        if r.folder:
            lines.append(f"          folder: {r.folder}")
        if r.error:
            lines.append(f"          error: {r.error.splitlines()[0][:500]}")
    gpu_line = gpu_sharing(results)
    if gpu_line:
        lines.append(gpu_line)
    return "\n".join(lines)


def gpu_sharing(results: list[Result]) -> str | None:
    """One line on the runs that asked for a GPU (``device: cuda``): how many ran on which GPU (their worker's
    ``CUDA_VISIBLE_DEVICES``) of which host, and whether any two overlapped in time on one of them (two
    runs on one GPU at once). None if no run asked for a GPU."""
    on_gpu = [r for r in results if r.task.resources and r.started is not None and r.finished is not None]
    if not on_gpu:
        return None
    by_device: dict = {}
    for r in on_gpu:
        by_device.setdefault((r.host, r.gpu), []).append(r)
    shared = []
    for (host, gpu), runs in sorted(by_device.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        runs.sort(key=lambda r: r.started)
        for a, b in zip(runs, runs[1:]):
            if b.started < a.finished:
                shared.append(f"{a.task.label} and {b.task.label} on gpu {gpu}@{host}")
    devices = ", ".join(f"{gpu or 'unpinned'}@{host}: {len(runs)}" for (host, gpu), runs in sorted(
        by_device.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))))
    head = f"GPU runs per device ({devices})"
    return head + (": no two runs overlapped on one GPU" if not shared else
                   f": {len(shared)} overlap(s): " + "; ".join(shared))


def results_json(results: list[Result]) -> list[dict]:
    out = []
    for r in results:
        d = asdict(r)
        d["task"] = dict(asdict(r.task), label=r.task.label, resources=r.task.resources)
        out.append(d)
    return out


def sweep(study: str, grid: dict[str, list], param_set: str = "default", overrides: dict | None = None, *,
          outputs=None, progress: bool = True, prefix: str | None = None, **batch_options) -> list[Path]:
    """Run every point of ``grid`` as one batch (Dask; ``workers=1``: in this process).

    One folder per point, swept keys recorded as length-1 dims. Every point runs even if some fail;
    then ``RunError`` names the failed ones. Returns the run folders in grid order. ``prefix``: the
    points' names start with it (``<prefix>@<point>``; refused if another sweep's points have it).
    """
    planned = plan_sweep(study, grid, param_set, overrides, prefix=prefix)
    check_names_free(planned, outputs)
    results = run_batch(planned, outputs=outputs, progress=progress, **batch_options)
    failed = [r for r in results if not r.ok]
    if failed:
        raise RunError(f"{len(failed)} of {len(results)} sweep point(s) failed: "
                       + "; ".join(f"{r.task.name}: {r.error}" for r in failed))
    return [Path(r.folder) for r in results]
