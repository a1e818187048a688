"""Command line: ``python -m attnum {list,run,run-all,sweep,publish,bench} ...``."""
from __future__ import annotations

import argparse
import sys

from . import runner


def _overrides(pairs) -> dict:
    return {key: runner.parse_value(value) for key, value in (pairs or [])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attnum", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    sub.add_parser("list", help="studies, their parameter sets and parameters")

    p_run = sub.add_parser("run", help="run one study notebook")
    p_run.add_argument("study")
    p_all = sub.add_parser("run-all", help="run every study at one parameter set")
    p_sweep = sub.add_parser("sweep", help="run a grid of parameter values, one folder per point")
    p_sweep.add_argument("study")
    p_sweep.add_argument("--grid", required=True, help="'key=v1,v2;key2=v3' or a YAML file of key: [values]")
    for p in (p_run, p_all, p_sweep):
        p.add_argument("--params", default="default", help="parameter set (params/<study>/<name>.yaml)")
        p.add_argument("-p", nargs=2, action="append", metavar=("KEY", "VALUE"), help="override (YAML value)")
        p.add_argument("--outputs", default=None, help="outputs root (default: outputs/ or $ATTNUM_OUTPUTS)")
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--timeout", type=int, default=None, help="per-cell timeout in seconds")

    p_pub = sub.add_parser("publish", help="render executed notebooks and write outputs/site/index.html")
    p_pub.add_argument("--outputs", default=None)
    p_bench = sub.add_parser("bench", help="speed and memory benchmarks")
    p_bench.add_argument("--quick", action="store_true", help="smaller sizes, for trying the harness")
    p_bench.add_argument("--outputs", default=None)

    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            for study in runner.studies():
                print(f"{study}: sets {runner.param_sets(study)}")
                for name, info in runner.declared_parameters(study).items():
                    print(f"    {name}: {info['type']} = {info['default']}  # {info['help']}")
        elif args.cmd == "run":
            path = runner.run(args.study, args.params, _overrides(args.p), outputs=args.outputs,
                              progress=not args.no_progress, timeout=args.timeout)
            print(f"wrote {path}")
        elif args.cmd == "run-all":
            overrides = _overrides(args.p)
            for study in runner.studies():  # check all before running any
                runner.resolve_parameters(study, args.params, overrides)
            for study in runner.studies():
                print(f"== {study} ({args.params})", flush=True)
                print("wrote", runner.run(study, args.params, overrides, outputs=args.outputs,
                                          progress=not args.no_progress, timeout=args.timeout))
        elif args.cmd == "sweep":
            paths = runner.sweep(args.study, runner.parse_grid(args.grid), args.params, _overrides(args.p),
                                 outputs=args.outputs, progress=not args.no_progress)
            print("\n".join(f"wrote {p}" for p in paths))
        elif args.cmd == "publish":
            from .publish import publish

            print(f"wrote {publish(args.outputs)}")
        elif args.cmd == "bench":
            from .bench import main as bench_main

            return bench_main(quick=args.quick, outputs=args.outputs)
    except runner.ParameterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except runner.RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
