"""Measure what single-bit flips in a run's results.nc do: ``python measure_corruption.py RUN_DIR [FLIPS]``.

For each of FLIPS seeded random bit positions: flip the bit in a copy of the run, then ask
(1) ``ncio.verify_run`` (sha256 in RUN.json) and (2) ``ncio.open_results`` alone (Fletcher-32,
no record). Prints a JSON line: flips, sha256_detected, fletcher_detected (read refused),
silent_value_changes (read succeeded with different values), silent_metadata_changes
(values equal, attributes differ), harmless (nothing changed). Each read runs in this
process; HDF5 has not crashed on these files, but run it in a subprocess to be safe.
"""
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from attnum import ncio


def main(run_dir: str, flips: int = 300, seed: int = 0) -> dict:
    run = Path(run_dir)
    original = ncio.open_results(run / "results.nc")
    data = (run / "results.nc").read_bytes()
    rng = random.Random(seed)
    counts = dict(flips=flips, sha256_detected=0, fletcher_detected=0, silent_value_changes=0,
                  silent_metadata_changes=0, harmless=0)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / run.name
        shutil.copytree(run, copy)
        for _ in range(flips):
            pos, bit = rng.randrange(len(data)), rng.randrange(8)
            damaged = bytearray(data)
            damaged[pos] ^= 1 << bit
            (copy / "results.nc").write_bytes(bytes(damaged))
            try:
                ncio.verify_run(copy)
            except ncio.DamagedRunError:
                counts["sha256_detected"] += 1
            try:
                back = ncio.open_results(copy / "results.nc")
            except (ncio.DamagedRunError, OSError):
                counts["fletcher_detected"] += 1
                continue
            same_values = all(name in back.variables and np.array_equal(
                np.asarray(back[name].values), np.asarray(var.values),
                equal_nan=var.dtype.kind == "f") for name, var in original.variables.items())
            if not same_values:
                counts["silent_value_changes"] += 1
            elif back.attrs != original.attrs or any(back[n].attrs != v.attrs for n, v in original.variables.items()):
                counts["silent_metadata_changes"] += 1
            else:
                counts["harmless"] += 1
    return counts


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300)))
