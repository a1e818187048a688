"""A batch on an external Dask scheduler (ATTNUM_DASK_SCHEDULER) when one worker is killed mid-run.

The test starts a ``distributed.LocalCluster`` of two one-thread worker processes, points the batch at its
scheduler through ``$ATTNUM_DASK_SCHEDULER`` (as ``make reproduce`` would be), and SIGKILLs the worker
process that runs the first run to start (its pid is in the run's staging ``RUN.json``) while that run's
notebook executes. What the batch then does is checked, not assumed: every run ends in a state with a
record of what happened to it, the other run is unaffected, and no run is left reported as live."""
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from attnum import ncio, runs
from attnum.runs import batch

STUDY = "length_scaling"
TINY = {"seq_lens": [16, 32, 64], "dtypes": ["bf16"], "seeds": [0], "block_configs": ["16x16"],
        "attribution_seq_lens": [32]}


def _kill_first_running(study_dir: Path, killed: dict, stop: threading.Event) -> None:
    """Wait for a run's staging RUN.json (status running), then SIGKILL the worker process that wrote it."""
    while not stop.is_set():
        for record_path in sorted(study_dir.glob(".versions/*/*/RUN.json")):
            try:
                record = json.loads(record_path.read_text())
            except (OSError, ValueError):
                continue
            if record.get("status") == "running" and (record_path.parent / "notebook.ipynb").exists():
                time.sleep(1.0)  # the notebook is executing in the kernel the worker started
                killed.update(name=record["name"], pid=record["pid"], version=record_path.parent.name)
                os.kill(record["pid"], signal.SIGKILL)
                return
        time.sleep(0.1)


@pytest.mark.slow
def test_a_batch_survives_the_kill_of_a_worker_mid_run_or_reports_that_run_failed(outputs, monkeypatch):
    from distributed import LocalCluster

    tasks = batch.plan_sweep(STUDY, {"head_dim": [16, 32]}, "smoke", TINY)
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                           dashboard_address=None, memory_limit=0, silence_logs=logging.ERROR)
    killed: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_first_running, args=(outputs / STUDY, killed, stop), daemon=True)
    try:
        monkeypatch.setenv(batch.SCHEDULER_ENV, cluster.scheduler_address)
        killer.start()
        t0 = time.monotonic()
        results = batch.run_batch(tasks, outputs=outputs, progress=False, log=lambda line: None)
        wall = time.monotonic() - t0
    finally:
        stop.set()
        killer.join(timeout=10)
        cluster.close()
    assert killed, "no run was seen executing, so no worker was killed"
    print(f"killed worker pid {killed['pid']} running {killed['name']}; states: "
          f"{[(r.task.name, r.state, r.error, r.pid) for r in results]}; {wall:.1f} s")
    workers = {r.pid for r in results if r.pid is not None}
    assert killed["pid"] not in workers  # the result of the killed run did not come from the killed worker
    by_name = {r.task.name: r for r in results}
    victim = by_name[killed["name"]]
    other = next(r for r in results if r is not victim)
    assert other.state == "ok", other.error
    assert ncio.verify_run(outputs / STUDY / other.task.name)["status"] == "ok"
    if victim.state == "ok":  # Dask ran the lost task again on a live worker: a complete, verified run
        record = ncio.verify_run(outputs / STUDY / victim.task.name)
        assert record["status"] == "ok" and record["pid"] != killed["pid"]
        assert Path(victim.folder) == outputs / STUDY / victim.task.name
        assert victim.seconds is not None and victim.seconds < wall
    else:  # or it gave up on the task: the batch names it failed and says why
        assert victim.state == "failed" and victim.error and ("KilledWorker" in victim.error or "worker" in victim.error)
        assert batch.summary(results).count("failed") >= 1
    # the killed attempt left a staging folder whose writer is dead: never reported as a live run, and
    # `clean` removes it (what `make clean` does)
    assert runs.live_runs(outputs) == []
    stale = outputs / STUDY / ".versions" / killed["name"] / killed["version"]
    cleaned = runs.clean(outputs)
    assert not stale.exists(), cleaned
    if victim.state == "ok":
        assert ncio.verify_run(outputs / STUDY / victim.task.name)["status"] == "ok"  # clean left the result
