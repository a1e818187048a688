"""The command line: ``python -m attnum {list,kernels,run,run-all,sweep,publish,readme-findings,compare,bench,clean,idle,train}``.

One entry point for everything: runs (``attnum.runs``), the site and README.md's findings block
(``attnum.site``), benchmarks, run maintenance (``clean``, ``idle``: what ``make clean`` and
``make clean-results`` call), and the GPT trainer (``train ...``: its own options,
``python -m attnum train --help``).
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path
import time

from . import runs
from .paths import UnsafePathError
from .runs import batch, plan, store


def _overrides(pairs) -> dict:
    """``-p KEY VALUE`` pairs; the same key twice is refused (which one was meant cannot be told)."""
    out: dict = {}
    for key, value in pairs or []:
        if key in out:
            raise runs.ParameterError(f"-p {key} is given twice; give each parameter once")
        out[key] = runs.parse_value(value)
    return out


def _sweep_overrides(pairs, grid: dict) -> dict:
    """A key both swept (``--grid``) and fixed (``-p``) is refused: one of the two would be silently ignored."""
    overrides = _overrides(pairs)
    both = sorted(set(overrides) & set(grid))
    if both:
        raise runs.ParameterError(f"{', '.join(both)}: given both in --grid and with -p; give each in one place")
    return overrides


def _nonneg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _outputs_folder(text: str) -> str:
    """``--outputs``: a folder (or one to be made), never a file; a folder where this user cannot create a
    file is refused. The check creates (and deletes) a file there: ``os.access`` answers yes to root for
    a folder that refuses files all the same (``/proc``, a read-only mount seen through some layers)."""
    import tempfile

    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # a folder still to be made: its nearest existing parent must take it
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{text} cannot be made: {probe} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".attnum-write-check-"):
            pass
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        if exc.errno == errno.ENOENT:
            why = "it takes no new files"
        raise argparse.ArgumentTypeError(f"{text} is not writable by this user ({probe}: {why})") from None
    return text


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _label(text: str) -> str:
    """``--name``: a short name of one's own (``plan.check_label``), refused before anything is checked or run."""
    try:
        return plan.check_label(text)
    except runs.ParameterError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--name ")) from None


def _batch(args, tasks) -> int:
    """Run a planned batch (or print it for --dry-run); 0 only if every run succeeded."""
    plan.check_names_free(tasks, args.outputs)  # a --name already used by other runs: refused, nothing submitted
    if args.dry_run:
        print(batch.describe_plan(tasks, args.outputs))
        return 0
    t0 = time.perf_counter()
    results = batch.run_batch(tasks, outputs=args.outputs, workers=args.workers, scheduler=args.scheduler,
                              gpus=args.gpus, threads=args.threads, timeout=args.timeout,
                              progress=not args.no_progress)
    print(batch.summary(results, time.perf_counter() - t0), flush=True)
    return 0 if all(r.ok for r in results) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attnum", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    sub.add_parser("list", help="studies, their parameter sets and parameters")
    p_kernels = sub.add_parser("kernels", help="the kernel registry: families, example names, and where each can run")
    p_kernels.add_argument("--device", default="cpu", help="device to check availability on (default cpu)")
    p_kernels.add_argument("--study", default=None,
                           help="instead: the kernels a run of this study asks for, checked on its set's device; "
                                "exit 1 naming those that cannot run here (a run would record them as unavailable)")
    p_kernels.add_argument("--params", default="default", help="with --study: the parameter set (default: default)")

    p_run = sub.add_parser("run", help="run one study notebook")
    p_run.add_argument("study", help="a study (length_scaling), its notebook's name (01_length_scaling) or path "
                                     "(notebooks/01_length_scaling.ipynb)")
    p_run.add_argument("--name", type=_label, default=None,
                       help=f"the run's folder name instead of one made from the set and overrides (letters, "
                            f"digits, _ . + -; at most {plan.MAX_LABEL} characters); refused if a run of other "
                            "parameters already has it")
    p_all = sub.add_parser("run-all", help="run every study at one parameter set")
    p_sweep = sub.add_parser("sweep", help="run a grid of parameter values, one folder per point")
    p_sweep.add_argument("study", help="a study, its notebook's name or path (as for run)")
    p_sweep.add_argument("--grid", required=True, help="'key=v1,v2;key2=v3' or a YAML file of key: [values]")
    p_sweep.add_argument("--name", type=_label, default=None,
                         help="the points' folder names start with this (NAME@key=value,...) instead of the set "
                              "and fixed overrides; refused if points of another sweep already have it")
    for p in (p_run, p_all, p_sweep):
        p.add_argument("--params", default="default",
                       help="parameter set: a name (params/<study>/<name>.yaml; default: the notebook's "
                            "parameters cell) or the path of a YAML file of parameter: value lines")
        p.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override (YAML value)")
        p.add_argument("--outputs", type=_outputs_folder, default=None,
                       help="outputs root (default: outputs/ or $ATTNUM_OUTPUTS)")
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--timeout", type=_positive, default=None, help="per-cell timeout in seconds (>= 1)")
    for p in (p_all, p_sweep):  # batches: one Dask task per run (attnum.runs.batch)
        p.add_argument("--workers", type=_nonneg, default=None,
                       help="worker processes of the LocalCluster started for the batch (default: the cores "
                            "available, at most one per run; 1: in this process, one run after another)")
        p.add_argument("--gpus", type=_nonneg, default=0,
                       help="start N more workers, worker i with CUDA_VISIBLE_DEVICES=i and resources GPU=1; "
                            "runs with device: cuda ask for one GPU each")
        p.add_argument("--scheduler", default=None,
                       help=f"address of an existing Dask scheduler (default: ${batch.SCHEDULER_ENV}); "
                            "its workers must see the outputs root at the same path")
        p.add_argument("--threads", type=_positive, default=1,
                       help="threads per run (OMP_NUM_THREADS, MKL_NUM_THREADS, torch), default 1")
        p.add_argument("--dry-run", action="store_true", help="check and print the plan, run nothing")

    p_pub = sub.add_parser("publish", help="render executed notebooks and write outputs/site/index.html")
    p_pub.add_argument("--outputs", type=_outputs_folder, default=None)
    p_readme = sub.add_parser("readme-findings", help="write README.md's findings block (headline figure, findings) "
                                                      "from the committed runs")
    p_readme.add_argument("--check", action="store_true", help="write nothing; exit 1 showing what differs when "
                                                               "the block is stale")
    p_cmp = sub.add_parser("compare", help="two results.nc files variable by variable (what two runs share)")
    p_cmp.add_argument("a")
    p_cmp.add_argument("b")
    p_cmp.add_argument("--all", action="store_true", help="list equal variables too")
    p_bench = sub.add_parser("bench", help="speed and memory benchmarks")
    p_bench.add_argument("--quick", action="store_true", help="smaller sizes, for trying the harness")
    p_bench.add_argument("--outputs", default=None)
    p_bench.add_argument("--kernel", action="append", default=None, metavar="NAME",
                         help="time this kernel (a registry name or package.module:function) instead; repeatable")
    p_bench.add_argument("--device", default="cpu", help="device of the --kernel timings (default cpu)")
    p_clean = sub.add_parser("clean", help="remove leftovers of interrupted runs and the rendered site; "
                                           "never results, never a live run")
    p_clean.add_argument("--outputs", type=_outputs_folder, default=None)
    p_results = sub.add_parser("clean-results", help="delete the results under the outputs root (what git ignores "
                                                     "there), holding the run locks; refused while a run is live")
    p_results.add_argument("--outputs", type=_outputs_folder, default=None)
    p_results.add_argument("--yes", action="store_true", help="required: the results are deleted for good")
    p_idle = sub.add_parser("idle", help="exit 1 naming the runs in progress, 0 when none is")
    p_idle.add_argument("--outputs", default=None)
    sub.add_parser("train", help="train a GPT (the trainer's own command line: train --help)", add_help=False)

    # -- report: a kernel's numerical report card (attnum.report) --
    p_report = sub.add_parser("report", help="one kernel report: forward error beside the band of correct kernels, "
                                             "acceptance rules, extreme inputs, backward, speed")
    p_report.add_argument("kernel", nargs="+", help="registry names or package.module:function")
    p_report.add_argument("--device", default="cpu")
    p_report.add_argument("--tier", default="quick", choices=("quick", "full"))
    p_report.add_argument("--against", default=None,
                          help="comma-separated registry kernels set beside them (default: SDPA's backends of the device)")
    p_report.add_argument("--outputs", default=None)
    p_report.add_argument("--name", default=None, help="report folder name (default: from the kernel names)")

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # the trainer parses its own options; imported only when asked for
        from .train.__main__ import main as train_main

        return train_main(argv[1:])
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            for study in runs.studies():
                print(f"{study}: sets {runs.param_sets(study)}")
                for name, info in runs.declared_parameters(study).items():
                    print(f"    {name}: {info['type']} = {info['default']}  # {info['help']}")
        elif args.cmd == "kernels" and args.study is not None:
            study = runs.resolve_study(args.study)
            device, reasons = runs.kernel_availability(study, args.params)
            missing = {name: reason for name, reason in reasons.items() if reason}
            for name, reason in reasons.items():
                print(f"    {name:42s} {'runs on ' + device if not reason else 'cannot run: ' + reason}")
            if missing:
                print(f"error: {len(missing)} of the {len(reasons)} kernels that {study} ({args.params}) asks for "
                      f"cannot run on {device} here: {', '.join(missing)}; a run would record them as unavailable",
                      file=sys.stderr)
                return 1
            print(f"{study} ({args.params}): all {len(reasons)} kernels it asks for run on {device}")
        elif args.cmd == "kernels":
            from . import kernels

            for family in kernels.families().values():
                print(f"{family.name}: {family.doc.strip().splitlines()[0].strip()}")
                for name in family.examples:
                    reason = kernels.get(name).unavailable_reason(args.device)
                    print(f"    {name:42s} {'runs on ' + args.device if not reason else 'cannot run: ' + reason}")
            print("your own: package.module:function (a Kernel, or f(q, k, v, is_causal=, attn_mask=, scale=))")
        elif args.cmd == "run":
            path = runs.run(runs.resolve_study(args.study), args.params, _overrides(args.p), outputs=args.outputs,
                            progress=not args.no_progress, timeout=args.timeout, name=args.name,
                            named=args.name is not None)
            print(f"wrote {path}")
        elif args.cmd == "run-all":  # every study's parameters checked before anything is submitted
            return _batch(args, batch.plan_run_all(args.params, _overrides(args.p)))
        elif args.cmd == "sweep":  # every grid point checked before anything is submitted
            grid = runs.parse_grid(args.grid)
            return _batch(args, batch.plan_sweep(runs.resolve_study(args.study), grid, args.params,
                                                 _sweep_overrides(args.p, grid), prefix=args.name))
        elif args.cmd == "publish":
            from .site import publish

            print(f"wrote {publish(args.outputs)}")
        elif args.cmd == "readme-findings":
            from .site import README, update_readme

            diff = update_readme(README, check=args.check)
            if args.check and diff:
                print(f"error: the findings block of {README} is stale (run python -m attnum readme-findings):\n"
                      + diff, file=sys.stderr)
                return 1
            print(f"{README}: findings block {'current' if not diff else 'written'}")
        elif args.cmd == "compare":
            from .ncio import compare_results

            for path in (args.a, args.b):
                if not (Path(path).is_file() or (Path(path) / "results.nc").is_file()):
                    print(f"error: no results file {path} (a results.nc, or a run folder holding one)", file=sys.stderr)
                    return 2
            rows = compare_results(args.a, args.b)
            equal = sum(r["status"] == "equal" for r in rows)
            print(f"{len(rows)} variables: {equal} equal, {len(rows) - equal} not")
            for r in rows:
                if args.all or r["status"] != "equal":
                    extra = (f", {100 * r['differing']:.3g}% of elements differ" if "differing" in r else "") + (
                        f", max relative difference {r['max_rel_diff']:.3g}" if "max_rel_diff" in r else "") + (
                        f", {100 * r['nan_in_one']:.3g}% NaN in one file only" if r.get("nan_in_one") else "")
                    print(f"  {r['variable']}: {r['status']}{extra}")
            unshared = [r["variable"] for r in rows if r["status"] == "nothing shared"]
            if not rows or unshared:  # an empty comparison is no evidence of equality
                print(f"error: nothing compared for {len(unshared) or 'any'} variable(s): the two runs share no "
                      "coordinate value there (e.g. two sweep points)", file=sys.stderr)
                return 1
        elif args.cmd == "bench":
            from .bench import main as bench_main

            if args.kernel:
                from .bench import kernel_main

                return kernel_main(args.kernel, quick=args.quick, outputs=args.outputs, device=args.device)
            return bench_main(quick=args.quick, outputs=args.outputs)
        elif args.cmd == "report":
            from .report import ReportError, run_report

            against = None if args.against is None else [a for a in args.against.split(",") if a]
            try:
                folder = run_report(args.kernel, device=args.device, tier=args.tier, against=against,
                                    outputs=args.outputs, name=args.name)
            except ReportError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            print(f"wrote {folder} (notebook.ipynb, results.nc, report.html)")
        elif args.cmd == "idle":
            live = runs.live_runs(args.outputs)
            if live:
                print(f"error: run(s) in progress: {', '.join(live)}; wait for them to finish", file=sys.stderr)
                return 1
        elif args.cmd == "clean-results":
            if not args.yes:
                print("error: clean-results deletes every result under the outputs root; pass --yes", file=sys.stderr)
                return 2
            removed = store.clean_results(args.outputs)
            print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} under "
                  f"{args.outputs or runs.store.outputs_root()}")
        elif args.cmd == "clean":
            for line in runs.clean(args.outputs):
                print(line if line.startswith(("recovered", "refused")) else f"removed {line}")
    except runs.ParameterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (runs.RunError, batch.BatchError, UnsafePathError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a folder that refuses writes, a full disk: named, not a traceback
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: cannot write {exc.filename or 'the outputs'}: {os.strerror(exc.errno)}", file=sys.stderr)
        return 1
    return 0
