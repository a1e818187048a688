"""Helpers of the robustness tests: a stand-in for papermill that writes a real run in milliseconds.

``fake_execute`` has papermill's signature: it writes ``notebook.ipynb`` and a real
``results.nc`` (through ``ncio.write_results``, as a notebook does) into the injected
``output_dir``; the value of ``rel_l2_err`` is ``head_dim / 1000`` (so each run is
recognisable). Environment variables steer it in subprocesses: ``FAKE_STARTED`` (a file
it creates when it starts), ``FAKE_RELEASE`` (a file it waits for before writing),
``FAKE_VALUE`` (the value written).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import xarray as xr

from attnum import ncio


def dataset(value: float) -> xr.Dataset:
    ds = xr.Dataset({"rel_l2_err": (("seq_len", "seed"), np.full((3, 2), value)),
                     "max_ulp_err": (("seq_len", "seed"), np.full((3, 2), 2.0))},
                    coords={"seq_len": np.array([128, 256, 512], dtype=np.int64), "seed": [0, 1]})
    return ds


TABLE = {"rel_l2_err": ("1", "relative L2 error"), "max_ulp_err": ("ulp", "max error in units in the last place"),
         "seq_len": ("1", "sequence length N")}


def wait_for(path: Path, proc=None, limit=120.0):
    """Wait until ``path`` exists (not a timing assertion: a guard against hanging forever); fail if ``proc``
    ends first."""
    t0 = time.monotonic()
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()}")
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.05)


def sigterm_run(outputs: Path, tmp_path: Path, **env):
    """Start a run of this module (``fake_execute`` standing in for papermill) in a subprocess, wait until its
    notebook has started, stop it with SIGTERM and return the finished process; ``env`` adds variables."""
    import signal
    import subprocess

    started, never = tmp_path / "started", tmp_path / "never"
    proc = subprocess.Popen([sys.executable, __file__, str(outputs), "{}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, FAKE_STARTED=str(started), FAKE_RELEASE=str(never), **env))
    try:
        wait_for(started, proc)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc


def fake_execute(input_path, output_path, parameters=None, **kwargs):
    out = Path(parameters["output_dir"])
    if os.environ.get("FAKE_STARTED"):
        Path(os.environ["FAKE_STARTED"]).write_text(str(os.getpid()))
    if os.environ.get("FAKE_RELEASE"):
        while not Path(os.environ["FAKE_RELEASE"]).exists():
            time.sleep(0.05)
    Path(output_path).write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    value = float(os.environ.get("FAKE_VALUE", parameters.get("head_dim", 1) / 1000))
    params = dict(parameters)
    ncio.write_results(dataset(value), out / "results.nc", study="length_scaling", params=params,
                       sweep_dims=params.get("sweep_dims") or (), variables=TABLE, title="fake run")


def main(argv):
    """``python robust_helpers.py OUTPUTS NAME_OVERRIDES_JSON``: one run with the fake papermill."""
    import papermill

    from attnum import runs

    papermill.execute_notebook = fake_execute
    outputs, overrides = argv[0], json.loads(argv[1])
    try:
        print(runs.run("length_scaling", "smoke", overrides, outputs=outputs, progress=False))
    except runs.RunLocked as exc:
        print(f"LOCKED: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
