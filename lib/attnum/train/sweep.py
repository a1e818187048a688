"""A designed sweep of small corpus runs, several at once on one GPU (``python -m attnum.train sweep``).

A sweep file (YAML, e.g. ``params/lm/lr_sweep.yaml``) names the runs of one experiment and the analysis
stated before any run:

    name      record prefix (``lm_<name>_<arm>_lr<lr>_s<seed>_d<seed>.nc``)
    base      ``TrainConfig`` fields common to every run (the corpus preset ``TrainConfig.byte_lm`` fills the rest)
    lrs       the learning rates (peak, of the schedule)
    seeds     the seeds: a run's ``seed`` (initial weights) and ``data_seed`` (batch order) are both this
              seed, so the arms of one seed and learning rate start from the same weights on the same batches
    arms      name -> ``TrainConfig`` fields of that arm (``kernel``, ``qk_norm``, ...) and optionally its own
              ``seeds`` or ``lrs`` (a subset)
    range     optional ``{seeds: [...], lrs: [...]}``: runs of every arm (of those seeds) at learning rates
              beyond the design's, to show the whole curve; outside the analysis (``Run.in_design`` False)
    analysis  what the reading computes (free-form for this module; study 04's ``designed`` reads it)

Runs go in seed-major order (every arm and learning rate of the first seed, then the next seed), so a
sweep cut short by its budget leaves complete paired sets for its first seeds. A run whose record says it
finished (``stop_reason`` "steps" or "nonfinite") is not run again; a partial record (a run stopped by its
budget) is deleted and its run started again from step 0 by the next command, so every record of a sweep
covers the same steps. The file is copied next to the records (``sweep.yaml``) with its sha256 in the
status file (``sweep_status.json``: every run, its state and wall time), so the analysis read later is the
one written before the runs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SWEEP_KEYS = ("name", "base", "lrs", "seeds", "arms", "range", "analysis")
ARM_ONLY = ("seeds", "lrs")
DONE = ("steps", "nonfinite")  # a record's stop_reason of a finished run
STATUS = "sweep_status.json"
PLAN = "sweep.yaml"


@dataclasses.dataclass(frozen=True)
class Run:
    tag: str
    arm: str
    lr: float
    seed: int
    fields: dict  # TrainConfig fields (overrides of the corpus preset)
    in_design: bool = True  # False: a run of the sweep's ``range``

    @property
    def record(self) -> str:
        from types import SimpleNamespace

        from .record import record_name

        return record_name(SimpleNamespace(tag=self.tag, seed=self.seed, data_seed=self.seed, members=list))


def _name_ok(text) -> bool:
    return isinstance(text, str) and bool(text) and all(c.isalnum() or c in "_-" for c in text) and len(text) <= 40


def load(path, *, check_device: bool = False) -> dict:
    """The sweep file, checked (every error at once, before any run): known keys, a safe name and arm names,
    positive learning rates, non-negative integer seeds, every field a ``TrainConfig`` field with a value the
    config accepts (``check_device``: also that each arm's kernel runs on the configured device here)."""
    import yaml

    from .loop import TrainConfig

    text = Path(path).read_text()
    spec = yaml.safe_load(text)
    errors = []
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a sweep file is a mapping with keys {list(SWEEP_KEYS)}")
    unknown = sorted(set(spec) - set(SWEEP_KEYS))
    if unknown:
        errors.append(f"unknown keys {unknown} (allowed: {list(SWEEP_KEYS)})")
    if not _name_ok(spec.get("name")):
        errors.append(f"name must be 1-40 letters, digits, '_' or '-', got {spec.get('name')!r}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"tag", "lr", "seed", "data_seed", "data"}

    def check_lrs(lrs, where):
        if not isinstance(lrs, list) or not lrs or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in lrs):
            errors.append(f"{where} must be a non-empty list of positive numbers, got {lrs!r}")

    def check_seeds(seeds, where):
        if not isinstance(seeds, list) or not seeds or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds) or len(set(seeds)) != len(seeds):
            errors.append(f"{where} must be a non-empty list of distinct non-negative integers, got {seeds!r}")

    def check_fields(d, where):
        if not isinstance(d, dict):
            errors.append(f"{where} must be a mapping of TrainConfig fields, got {type(d).__name__}")
            return
        bad = sorted(set(d) - fields)
        if bad:
            errors.append(f"{where} sets unknown or reserved fields {bad}")

    check_lrs(spec.get("lrs"), "lrs")
    check_seeds(spec.get("seeds"), "seeds")
    check_fields(spec.get("base", {}), "base")
    rng = spec.get("range")
    if rng is not None:
        if not isinstance(rng, dict) or set(rng) != {"seeds", "lrs"}:
            errors.append(f"range must be a mapping with keys seeds and lrs, got {rng!r}")
        else:
            check_seeds(rng["seeds"], "range seeds")
            check_lrs(rng["lrs"], "range lrs")
    arms = spec.get("arms")
    if not isinstance(arms, dict) or not arms:
        errors.append("arms must be a non-empty mapping of arm name -> fields")
        arms = {}
    for arm, d in arms.items():
        if not _name_ok(arm):
            errors.append(f"arm name {arm!r} must be 1-40 letters, digits, '_' or '-'")
        if not isinstance(d, dict):
            errors.append(f"arm {arm!r} must be a mapping")
            continue
        check_fields({k: v for k, v in d.items() if k not in ARM_ONLY}, f"arm {arm!r}")
        if "seeds" in d:
            check_seeds(d["seeds"], f"arm {arm!r} seeds")
        if "lrs" in d:
            check_lrs(d["lrs"], f"arm {arm!r} lrs")
    if errors:
        raise ValueError(f"{path}: " + "; ".join(errors))
    spec.setdefault("base", {})
    spec.setdefault("analysis", {})
    from ..model import AttentionChoice

    seen = set()
    for run in runs(spec):  # every arm's config as TrainConfig checks it, before any run
        if run.arm in seen:
            continue
        seen.add(run.arm)
        fields = dict(run.fields)
        try:
            AttentionChoice.parse(fields.get("kernel", "sdpa:flash"))  # a registry name, on any machine
            if not check_device:  # the values alone; the kernel's availability where the sweep runs
                fields.update(kernel="sdpa:math", device="cpu", pair=False)
            TrainConfig.byte_lm(**{"device": "cuda", **fields})
        except (ValueError, TypeError) as exc:
            errors.append(f"arm {run.arm}: {exc}")
    if errors:
        raise ValueError(f"{path}: " + "; ".join(errors))
    spec["_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    spec["_source"] = str(path)
    return spec


def runs(spec: dict) -> list[Run]:
    """Every run of the sweep, seed-major (see the module docstring)."""
    out = []
    rng = spec.get("range") or {"seeds": [], "lrs": []}
    seeds = list(spec["seeds"]) + [s for s in rng["seeds"] if s not in spec["seeds"]]
    for seed in seeds:
        lrs = sorted(set(spec["lrs"]) | (set(rng["lrs"]) if seed in rng["seeds"] else set()))
        for lr in lrs:
            for arm, d in spec["arms"].items():
                arm_seeds = d.get("seeds", spec["seeds"])
                in_design = seed in arm_seeds and lr in d.get("lrs", spec["lrs"])
                in_range = seed in rng["seeds"] and lr in rng["lrs"] and seed in arm_seeds
                if not (in_design or in_range):
                    continue
                fields = {**spec["base"], **{k: v for k, v in d.items() if k not in ARM_ONLY}}
                tag = f"{spec['name']}_{arm}_lr{lr:g}"
                fields.update(tag=tag, lr=float(lr), seed=int(seed), data_seed=int(seed))
                out.append(Run(tag=tag, arm=arm, lr=float(lr), seed=int(seed), fields=fields, in_design=in_design))
    return out


def record_state(path: Path) -> str:
    """'missing', 'done' (its stop_reason says it finished) or 'partial'."""
    if not path.exists():
        return "missing"
    import xarray as xr

    from .. import ncio

    try:
        with xr.open_dataset(path, engine=ncio.ENGINE) as ds:
            reason = str(ds.attrs.get("stop_reason", ""))
    except (OSError, ValueError):
        return "partial"
    return "done" if reason in DONE else "partial"


def flags(fields: dict) -> list[str]:
    """``python -m attnum.train train`` flags for ``fields``."""
    out = []
    for key, value in fields.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out


def run_sweep(spec: dict, out_dir, *, jobs: int, budget_s: float = 0.0, first_estimate_s: float = 120.0,
              python: str = sys.executable, say=print, t_start: float | None = None, lrs=None, arms=None) -> dict:
    """Run the sweep's unfinished runs, ``jobs`` processes at a time, within ``budget_s`` seconds from
    ``t_start`` (0: none): no run is started that would not finish in the budget at the slowest finished
    run's wall time (``first_estimate_s`` before any), and each run is given the rest of the budget as its
    own ``budget_s`` (the estimate counts only runs of this command: how many run at once changes it).
    ``lrs``/``arms``: this command runs only the plan's runs at those rates / of those arms (the rest stay
    to do). Returns (and writes) the status."""
    t_start = time.monotonic() if t_start is None else t_start
    out = Path(out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if "_source" in spec:
        shutil.copyfile(spec["_source"], out / PLAN)
    status_path = out / STATUS
    status = json.loads(status_path.read_text()) if status_path.exists() else {}
    status.update(sweep=spec["name"], plan_sha256=spec["_sha256"])
    status.setdefault("runs", {})
    todo = []
    for r in runs(spec):
        if (lrs is not None and r.lr not in lrs) or (arms is not None and r.arm not in arms):
            continue
        path = out / r.record
        state = record_state(path)
        if state == "partial":
            path.unlink()
        if state != "done":
            todo.append(r)
        else:
            status["runs"].setdefault(r.record, {"state": "done"})
    walls = []
    estimate = first_estimate_s
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    running: dict = {}  # Popen -> (run, start, log)
    say(f"[sweep] {spec['name']}: {len(todo)} of {len(runs(spec))} runs to do, {jobs} at a time")

    def left() -> float:
        return budget_s - (time.monotonic() - t_start) if budget_s else math.inf

    while todo or running:
        while todo and len(running) < jobs and left() > estimate:
            r = todo.pop(0)
            fields = dict(r.fields)
            if budget_s:
                fields["budget_s"] = round(left() - 5.0, 1)
            log = open(out / "logs" / (Path(r.record).stem + ".log"), "w")
            cmd = [python, "-m", "attnum.train", "train", "--out", str(out), *flags(fields)]
            running[subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)] = (r, time.monotonic(), log)
        if not running:
            break
        time.sleep(0.5)
        for proc in [p for p in running if p.poll() is not None]:
            r, started, log = running.pop(proc)
            log.close()
            wall = time.monotonic() - started
            state = record_state(out / r.record)
            status["runs"][r.record] = {"state": state if proc.returncode == 0 else f"failed ({proc.returncode})",
                                        "wall_s": round(wall, 1)}
            if state == "done" and proc.returncode == 0:
                estimate = max(estimate if walls else 0.0, wall)
                walls.append(wall)
            say(f"[sweep] {r.record}: {status['runs'][r.record]['state']} in {wall:.0f} s "
                f"({len(todo)} to start, {len(running)} running)")
            status_path.write_text(json.dumps(status, indent=1, sort_keys=True))
    for r in todo:
        status["runs"].setdefault(r.record, {"state": "not started (budget)"})
    status["done"] = sum(1 for r in runs(spec) if record_state(out / r.record) == "done")
    for r in runs(spec):
        if record_state(out / r.record) != "done":
            status["runs"].setdefault(r.record, {"state": "not run"})
    status["total"] = len(runs(spec))
    status_path.write_text(json.dumps(status, indent=1, sort_keys=True))
    say(f"[sweep] {status['done']} of {status['total']} runs done")
    return status
