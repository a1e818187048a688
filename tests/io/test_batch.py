"""Batches on Dask (attnum.batch): serial and LocalCluster sweeps agree, an external scheduler works,
a failed point is reported without stopping the others, bad grids are refused before anything runs."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xarray as xr

from attnum import ncio, runs
from attnum.runs import batch
from attnum.cli import main

STUDY = "length_scaling"
# the smoke set made smaller still: each run takes seconds (mostly the kernel starting)
TINY = {"seq_lens": [16, 32, 64], "dtypes": ["bf16"], "seeds": [0], "block_configs": ["16x16"],
        "attribution_seq_lens": [32]}
GRID = {"head_dim": [16, 32]}
GRID_TEXT = "head_dim=16,32"
VOLATILE = ("timestamp", "host", "hostname", "created", "history")


def _cli_overrides():
    out = []
    for key, value in TINY.items():
        out += ["-p", key, str(value).replace("'", "")]
    return out


def _merged(root) -> xr.Dataset:
    ds = ncio.open_study(STUDY, root).load()
    for name in VOLATILE:
        ds.attrs.pop(name, None)
    return ds


def _summary_rows(text: str) -> dict[str, tuple[str, str]]:
    """run label -> (state, worker) from the printed batch summary."""
    rows = {}
    for m in re.finditer(r"^\s+(ok|failed|not run)\s+\S+ s\s+(\S+)\s+\[([^\]@]+)", text, re.M):
        rows[m.group(2)] = (m.group(1), m.group(3))
    return rows


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """The sweep run the plain way: one runs.run after another in this process."""
    root = tmp_path_factory.mktemp("serial") / "outputs"
    tasks = batch.plan_sweep(STUDY, GRID, "smoke", TINY)
    results = batch.run_batch(tasks, outputs=root, workers=1, progress=False)
    assert [r.state for r in results] == ["ok", "ok"], [r.error for r in results]
    assert {r.worker for r in results} == {"in-process"}
    return _merged(root)


def test_the_plan_checks_every_point_and_names_resources():
    tasks = batch.plan_sweep(STUDY, GRID, "smoke", TINY)
    assert len(tasks) == 2 and len({t.label for t in tasks}) == 2
    assert [t.overrides["head_dim"] for t in tasks] == [16, 32]
    assert all(t.sweep_dims == ("head_dim",) and t.resources == {} for t in tasks)
    cuda = batch.PlannedRun(STUDY, "smoke", {"device": "cuda"}, "x", device="cuda")
    assert cuda.resources == {"GPU": 1}
    (one,) = batch.plan_run_all("smoke", {"head_dim": 16}, studies=[STUDY])
    assert (one.label, one.sweep_dims) == (f"{STUDY}/smoke__head_dim=16", ())


@pytest.mark.slow
def test_local_cluster_sweep_equals_serial_sweep(outputs, serial, capsys):
    rc = main(["sweep", STUDY, "--params", "smoke", *_cli_overrides(), "--grid", GRID_TEXT, "--workers", "2",
               "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "LocalCluster of 2 worker process(es)" in out
    rows = _summary_rows(out)
    assert len(rows) == 2 and all(state == "ok" for state, _ in rows.values()), out
    assert all(worker != "in-process" for _, worker in rows.values()), out  # ran on the cluster's workers
    parallel = _merged(outputs)
    xr.testing.assert_equal(parallel, serial)
    assert parallel.attrs == serial.attrs
    # one thread per run reached the notebook kernel (ncio records torch's thread count)
    assert re.search(r"torch threads 1\b", parallel.attrs["device"]), parallel.attrs["device"]


@pytest.fixture
def external_cluster(tmp_path):
    """`dask scheduler` and two `dask worker` processes on 127.0.0.1 (free ports, no dashboard); always stopped."""
    sched_file = tmp_path / "scheduler.json"
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []

    def spawn(name, *args):
        log = open(logs / f"{name}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "dask", *args], stdout=log, stderr=subprocess.STDOUT,
                                       env=dict(os.environ)), log))

    try:
        spawn("scheduler", "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
              "--scheduler-file", str(sched_file))
        deadline = time.monotonic() + 60
        while not sched_file.exists():
            assert procs[0][0].poll() is None, (logs / "scheduler.log").read_text()
            assert time.monotonic() < deadline, "the scheduler did not start within 60 s"
            time.sleep(0.2)
        for i in range(2):
            spawn(f"worker{i}", "worker", "--scheduler-file", str(sched_file), "--nthreads", "1", "--nworkers", "1",
                  "--name", f"ext-{i}", "--host", "127.0.0.1", "--no-dashboard")
        import json

        from distributed import Client

        address = json.loads(sched_file.read_text())["address"]
        with Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
        yield address
    finally:
        for proc, _ in reversed(procs):
            proc.terminate()
        for proc, log in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            log.close()


@pytest.mark.slow
def test_sweep_through_an_external_scheduler(outputs, serial, external_cluster, capsys):
    rc = main(["sweep", STUDY, "--params", "smoke", *_cli_overrides(), "--grid", GRID_TEXT,
               "--scheduler", external_cluster, "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"the cluster at {external_cluster}" in out
    rows = _summary_rows(out)
    assert len(rows) == 2 and {state for state, _ in rows.values()} == {"ok"}, out
    assert {worker for _, worker in rows.values()} <= {"ext-0", "ext-1"}, out
    xr.testing.assert_equal(_merged(outputs), serial)


def _fail_head_dim_16():
    """On a worker: make the runner's papermill call fail for the point head_dim=16 only."""
    import papermill

    real = getattr(papermill, "_attnum_real_execute", papermill.execute_notebook)
    papermill._attnum_real_execute = real

    def execute_notebook(input_path, output_path, parameters=None, **kwargs):
        if (parameters or {}).get("head_dim") == 16:
            Path(output_path).write_text("{}")
            raise RuntimeError("injected failure: kernel died in cell 3")
        return real(input_path, output_path, parameters=parameters, **kwargs)

    papermill.execute_notebook = execute_notebook


@pytest.mark.slow
def test_a_failed_point_is_reported_and_the_others_finish(outputs, capsys):
    import cloudpickle
    from distributed import Client

    cluster = batch.start_local_cluster(2)
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            client.run(_fail_head_dim_16)
            rc = main(["sweep", STUDY, "--params", "smoke", *_cli_overrides(), "--grid", GRID_TEXT,
                       "--scheduler", cluster.scheduler_address, "--no-progress"])
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        cluster.close()
    out = capsys.readouterr().out
    assert rc == 1, out
    rows = _summary_rows(out)
    states = {label.split("head_dim=")[-1]: state for label, (state, _) in rows.items()}
    assert states == {"16": "failed", "32": "ok"}, out
    assert "injected failure: kernel died in cell 3" in out
    assert "batch summary: 1/2 ok" in out
    study_dir = outputs / STUDY
    done = [p for p in study_dir.iterdir() if p.name.endswith("head_dim=32")]
    assert len(done) == 1 and (done[0] / "results.nc").exists()
    failed = [p for p in study_dir.iterdir() if p.name.endswith("head_dim=16.failed")]
    assert len(failed) == 1 and "injected failure" in (failed[0] / "FAILED").read_text()
    assert not [p for p in study_dir.iterdir() if p.name.endswith("head_dim=16")]  # no results for it


@pytest.mark.parametrize("argv,message", [
    (["sweep", STUDY, "--params", "smoke", "--grid", "head_dim=32,100000"], r"parameter 'head_dim'.*out of range"),
    (["sweep", STUDY, "--params", "smoke", "--grid", "seeds=[0],[1]"], r"'seeds' is a list"),
    (["sweep", STUDY, "--params", "smoke", "--grid", "heads=1;head_dim=32,64,100000"], r"parameter 'head_dim'"),
    (["run-all", "--params", "smoke", "-p", "device", "tpu"], r"parameter 'device'.*'tpu' is not allowed"),
])
def test_invalid_grids_are_refused_before_anything_is_submitted(outputs, capsys, argv, message):
    # an address where no scheduler listens: the batch must fail on the parameters, before connecting
    rc = main([*argv, "--scheduler", "tcp://127.0.0.1:9", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.search(message, err), err
    assert not outputs.exists()


def test_dry_run_prints_the_plan_and_runs_nothing(outputs, capsys):
    rc = main(["sweep", STUDY, "--params", "smoke", "--grid", "head_dim=16,32;block_k=16", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "2 run(s) into" in out and out.count("resources=-") == 2
    assert "head_dim=16" in out and "head_dim=32" in out
    assert not outputs.exists()


def test_gpu_workers_are_pinned_one_gpu_each_and_gpu_runs_need_one():
    """--gpus N: worker i sees only GPU i and offers resources GPU=1; a GPU run never goes to a CPU-only cluster."""
    from distributed import Client

    cluster = batch.start_local_cluster(0, gpus=2)
    try:
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
            info = client.scheduler_info(n_workers=-1)["workers"]
            assert sorted(seen.values()) == ["0", "1"]
            assert all(w["resources"] == {"GPU": 1} and w["nthreads"] == 1 for w in info.values())
            assert sorted(str(w["name"]) for w in info.values()) == ["gpu0", "gpu1"]
    finally:
        cluster.close()
    cpu_only = batch.start_local_cluster(1)
    try:
        with Client(cpu_only) as client:
            gpu_task = batch.PlannedRun(STUDY, "smoke", {"device": "cuda"}, "smoke__device=cuda", device="cuda")
            with pytest.raises(batch.BatchError, match="ask for a GPU.*--gpus"):
                batch.run_batch([gpu_task], client=client, progress=False)
            assert client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)) == 0  # nothing submitted
    finally:
        cpu_only.close()


def test_longest_runs_are_submitted_first(tmp_path):
    """A fresh clone has no earlier RUN.json: the typical seconds of each study's default run order the
    batch; an earlier run of the same folder wins; overridden runs have no typical time."""
    tasks = batch.plan_run_all("default", studies=list(runs.studies()))
    order = [tasks[i].study for i in batch.submission_order(tasks, tmp_path)]
    typical = {study: s for (study, pset), s in batch.TYPICAL_SECONDS.items() if pset == "default"}
    assert set(typical) == set(runs.studies()), "every study needs a typical time"
    assert [typical[s] for s in order] == sorted(typical.values(), reverse=True)
    last = tasks[[t.study for t in tasks].index(order[-1])]
    folder = tmp_path / last.study / last.name
    folder.mkdir(parents=True)
    (folder / "RUN.json").write_text(json.dumps({"started": "2026-01-01T00:00:00+00:00",
                                                 "finished": "2026-01-01T01:00:00+00:00"}))
    assert tasks[batch.submission_order(tasks, tmp_path)[0]].study == last.study  # an hour: now first
    small = batch.PlannedRun(STUDY, "default", {"head_dim": 16}, "default__head_dim=16")
    assert batch._priorities([small], tmp_path) == [0.0]


def test_the_summary_says_whether_two_gpu_runs_shared_a_gpu():
    def result(name, gpu, start, stop, host="h"):
        task = batch.PlannedRun(STUDY, "gpu", {"head_dim": name}, f"gpu@head_dim={name}", ("head_dim",), "cuda")
        return batch.Result(task, state="ok", seconds=stop - start, worker=f"gpu{gpu}", host=host, gpu=str(gpu),
                            started=start, finished=stop)

    apart = [result(1, 0, 0, 10), result(2, 1, 0, 12), result(3, 0, 10, 20)]
    line = batch.gpu_sharing(apart)
    assert line == "GPU runs per device (0@h: 2, 1@h: 1): no two runs overlapped on one GPU"
    assert line in batch.summary(apart) and "gpu=1" in batch.summary(apart)
    shared = apart + [result(4, 1, 11, 13)]
    assert "1 overlap(s): length_scaling/gpu@head_dim=2 and length_scaling/gpu@head_dim=4 on gpu 1@h" \
        in batch.gpu_sharing(shared)
    cpu = batch.Result(batch.PlannedRun(STUDY, "smoke", {}, "smoke"), state="ok", gpu="0", started=0, finished=1)
    assert batch.gpu_sharing([cpu]) is None  # a CPU run on a GPU worker uses no GPU


@pytest.mark.slow
def test_gpu_pinned_workers_run_a_sweep_with_a_relative_pythonpath(outputs, serial, tmp_path, monkeypatch, capsys):
    """--gpus 2 (here with CPU runs): each point runs on its own pinned worker, the summary names the GPU,
    and packages reached through a relative PYTHONPATH entry (dask installed into a folder) reach the
    workers and, made absolute, the notebook kernels (which start in notebooks/)."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["site", os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    from distributed import Client

    cluster = batch.start_local_cluster(0, gpus=2)
    try:
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            paths = client.run(runs.kernel_pythonpath)
            assert all(p.split(os.pathsep)[:2] == [str(Path(runs.__file__).resolve().parents[2]), str(site)]
                       for p in paths.values()), paths
            tasks = batch.plan_sweep(STUDY, GRID, "smoke", TINY)
            results = batch.run_batch(tasks, outputs=outputs, client=client, progress=False)
    finally:
        cluster.close()
    assert [r.state for r in results] == ["ok", "ok"], [r.error for r in results]
    assert sorted((r.worker, r.gpu) for r in results) in ([("gpu0", "0"), ("gpu1", "1")],
                                                         [("gpu0", "0"), ("gpu0", "0")],
                                                         [("gpu1", "1"), ("gpu1", "1")])
    text = batch.summary(results)
    assert all(f"gpu={r.gpu}]" in text for r in results), text
    xr.testing.assert_equal(_merged(outputs), serial)


@pytest.mark.slow
def test_a_run_goes_to_the_first_worker_that_is_free_longest_first(outputs):
    """Three runs, two workers: the two expected longest start first; the third starts on the worker that
    finished first, never queued early behind a run still going on the other worker."""
    from distributed import Client

    tasks = batch.plan_sweep(STUDY, {"head_dim": [16, 32, 64]}, "smoke", TINY)
    longest = tasks[2]  # an earlier run of its folder took an hour: it starts first
    folder = outputs / longest.study / longest.name
    folder.mkdir(parents=True)
    (folder / "RUN.json").write_text(json.dumps({"started": "2026-01-01T00:00:00+00:00",
                                                 "finished": "2026-01-01T01:00:00+00:00"}))
    assert batch.submission_order(tasks, outputs)[0] == 2
    cluster = batch.start_local_cluster(2)
    try:
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
            results = batch.run_batch(tasks, outputs=outputs, client=client, progress=False)
    finally:
        cluster.close()
    assert [r.state for r in results] == ["ok"] * 3, [r.error for r in results]
    first, second = sorted(results, key=lambda r: r.started)[:2]
    third = max(results, key=lambda r: r.started)
    assert results[2] in (first, second)
    done_first = min((first, second), key=lambda r: r.finished)
    assert third.started >= done_first.finished - 0.5, "the third run started before a worker was free"
    before = next(r for r in (first, second) if r.worker == third.worker)
    assert third.started >= before.finished - 0.5, "the third run waited behind a run on a busy worker"


def test_the_kernel_does_not_inherit_the_nannys_malloc_setting(monkeypatch, tmp_path):
    """Dask's nanny sets MALLOC_TRIM_THRESHOLD_ in every worker; a run's kernel gets the launcher's value."""
    import dask
    import distributed  # noqa: F401 (loads its configuration)

    assert "MALLOC_TRIM_THRESHOLD_" in dask.config.get("distributed.nanny.pre-spawn-environ")
    seen = {}

    def fake_run(*args, **kwargs):
        seen["env"] = os.environ.get("MALLOC_TRIM_THRESHOLD_")
        return tmp_path

    monkeypatch.setattr(runs.execute, "run", fake_run)
    for var in (*batch.THREAD_VARS, batch.WORKER_ENV):  # execute sets them: restored after the test
        monkeypatch.delenv(var, raising=False)
    task = batch.PlannedRun(STUDY, "smoke", {}, "smoke")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")  # as in a worker
    out = batch.run_planned(task, str(tmp_path), launcher={"MALLOC_TRIM_THRESHOLD_": None})
    assert out["state"] == "ok" and seen["env"] is None
    batch.run_planned(task, str(tmp_path), launcher={"MALLOC_TRIM_THRESHOLD_": "1048576"})
    assert seen["env"] == "1048576"  # a value the launcher set on purpose is kept
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    assert batch.launcher_env() == {"MALLOC_TRIM_THRESHOLD_": None}


def test_the_launchers_malloc_value_is_read_before_a_local_cluster_starts(monkeypatch):
    """A LocalCluster's nannies run in the launching process and put their pre-spawn environment into its
    os.environ; the value handed to the kernels must be read before that (it was read after, and the kernels
    of make reproduce ran with MALLOC_TRIM_THRESHOLD_=65536: mostly system time)."""
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    cluster = batch.start_local_cluster(1, 0)
    try:  # the premise, with the real LocalCluster
        assert os.environ.get("MALLOC_TRIM_THRESHOLD_") == "65536"
    finally:
        cluster.close()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    read = []
    real_launcher_env = batch.launcher_env

    def recording_launcher_env():
        read.append(os.environ.get("MALLOC_TRIM_THRESHOLD_"))
        return real_launcher_env()

    class Started(Exception):
        pass

    def fake_cluster(workers, gpus):
        os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"  # what the real one does
        raise Started

    monkeypatch.setattr(batch, "launcher_env", recording_launcher_env)
    monkeypatch.setattr(batch, "start_local_cluster", fake_cluster)
    with pytest.raises(Started):
        batch._run_on_dask([batch.PlannedRun(STUDY, "smoke", {}, "smoke")], {}, ".", None, None, 2, 0, 1, None,
                           False, print)
    assert read == [None]
