"""``python -m attnum.train train|bench|gather|corpus|plan``: see ``attnum.train``'s docstring."""
from __future__ import annotations

import time

_T_IMPORT = time.monotonic()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402


def process_start() -> float:
    """``time.monotonic()`` at the moment this process started (Linux: from /proc), so that a
    budget counts the interpreter's and torch's start-up too; else the import time of this module."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
        now = time.monotonic()
        return now - age if 0 <= age < 3600 else _T_IMPORT
    except (OSError, ValueError, IndexError):
        return _T_IMPORT


CAMPAIGN = "params/lm/campaign.yaml"


def strip_nproc(argv: list) -> list:
    """``argv`` without its ``--nproc-per-node N`` (or ``--nproc-per-node=N``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def torchrun(nproc: int, argv: list) -> int:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m attnum.train ARGV``, NVLink
    multicast off in its environment (``dist.MULTICAST_OFF``); its exit status."""
    import subprocess

    from .dist import multicast_off

    env = multicast_off(dict(os.environ))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "attnum.train", *argv]
    return subprocess.call(cmd, env=env)


def load_plan(name: str, path: str | None = None) -> dict:
    """The named run of the campaign file (relative to the project root, else to the working
    folder), with ``tag`` set to its name; a clear error for an unknown name or field."""
    import yaml

    from .loop import TrainConfig

    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [path] if path else [os.path.join(here, "..", "..", "..", CAMPAIGN), CAMPAIGN]
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            with open(candidate) as fh:
                plans = yaml.safe_load(fh) or {}
            break
    else:
        raise ValueError(f"no campaign file at {candidates}")
    if name not in plans:
        raise ValueError(f"no run {name!r} in {candidate}; runs: {sorted(plans)}")
    fields = set(corpus_defaults())
    unknown = sorted(set(plans[name]) - fields)
    if unknown:
        raise ValueError(f"run {name!r} of {candidate} sets unknown fields {unknown}")
    return {"tag": name, **plans[name]}


TASK_ONLY = ("data", "checkpoint_steps", "record_every")  # a task run's fields: no flags (train is a corpus run)


def corpus_defaults() -> dict:
    """Every flag of ``train`` and its default: the fields of ``TrainConfig.byte_lm()`` but the task runs' own."""
    from .loop import TrainConfig

    preset = TrainConfig.byte_lm(device="cpu")
    defaults = {f.name: getattr(preset, f.name) for f in dataclasses.fields(TrainConfig) if f.name not in TASK_ONLY}
    defaults["device"] = "cuda"
    return defaults


def _train_parser(sub):
    p = sub.add_parser("train", help="one training run (or a lockstep pair) within a wall-clock budget")
    p.add_argument("--out", required=True, help="folder for the record")
    p.add_argument("--plan", default=None, help=f"a run of the campaign file ({CAMPAIGN}); flags override it")
    p.add_argument("--campaign", default=None, help=f"another campaign file than {CAMPAIGN}")
    p.add_argument("--nproc-per-node", type=int, default=0,
                   help="data parallel: start torchrun with this many processes (one GPU each; gloo on the CPU)")
    p.add_argument("--checkpoint-dir", default=None, help="folder of the run's checkpoint (written at its stop)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also a checkpoint every this many steps")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    p.add_argument("--stop-at", type=int, default=None, help="stop this command after this many steps done")
    for name, default in corpus_defaults().items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif default is None:
            kind = int if name == "pair_seed" else str
            p.add_argument(flag, type=kind, default=None)
        else:
            p.add_argument(flag, type=type(default), default=default)
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnum.train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    b = sub.add_parser("bench", help="training-step cost of each attention choice")
    b.add_argument("--kernels", default=None, help="comma-separated attention choices (default: bench.DEFAULT_KERNELS)")
    b.add_argument("--n-layer", type=int, default=12)
    b.add_argument("--n-head", type=int, default=12)
    b.add_argument("--d-model", type=int, default=768)
    b.add_argument("--contexts", default="1024,4096")
    b.add_argument("--tokens-per-step", type=int, default=8192)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--steps", type=int, default=8, help="timed steps per round")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--device", default="cuda")
    b.add_argument("--out", required=True, help="JSON file to write")
    g = sub.add_parser("gather", help="every record under a folder into one NetCDF file")
    g.add_argument("folder")
    g.add_argument("--out", required=True)
    c = sub.add_parser("corpus", help="the corpus' facts (size, files, sha256) on this machine")
    c.add_argument("--parts", default="stdlib")
    sw = sub.add_parser("sweep", help="a designed sweep of small runs (a sweep file), several processes at once")
    sw.add_argument("file", help="the sweep file, e.g. params/lm/lr_sweep.yaml")
    sw.add_argument("--out", required=False, help="folder for the records (runs already done there are kept)")
    sw.add_argument("--jobs", type=int, default=8, help="runs at a time (processes sharing the GPU)")
    sw.add_argument("--budget-s", type=float, default=0.0, help="wall clock of this command from process start")
    sw.add_argument("--first-estimate-s", type=float, default=120.0,
                    help="a run's wall time assumed until one has finished")
    sw.add_argument("--list", action="store_true", help="list the runs in order and stop")
    sw.add_argument("--lrs", default=None, help="comma-separated: this command runs only the plan's runs at these rates")
    sw.add_argument("--arms", default=None, help="comma-separated: this command runs only these arms' runs")
    pl = sub.add_parser("plan", help="the campaign's runs and their settings")
    pl.add_argument("--campaign", default=None)
    args, _ = parser.parse_known_args(argv)
    if args.command == "train" and args.plan:
        try:
            plan = load_plan(args.plan, args.campaign)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        sub.choices["train"].set_defaults(**plan)
    args = parser.parse_args(argv)

    if args.command == "train":
        from .loop import TrainConfig, train

        from . import dist

        fields = set(corpus_defaults())
        try:
            cfg = TrainConfig.byte_lm(**{k: v for k, v in vars(args).items() if k in fields})
            if args.nproc_per_node and dist.launched_by_torchrun():
                raise ValueError("--nproc-per-node in a process torchrun started: give one or the other")
            if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
                raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")
            if args.resume and not os.path.isfile(os.path.join(args.checkpoint_dir, dist.CHECKPOINT)):
                raise ValueError(f"--resume: no checkpoint {dist.CHECKPOINT} in {args.checkpoint_dir}")
            world_size = args.nproc_per_node or int(os.environ.get("WORLD_SIZE", "1"))
            dist.check_world_size(cfg.batch_size, world_size)  # before any work
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        if args.nproc_per_node:
            return torchrun(args.nproc_per_node, strip_nproc(sys.argv[1:] if argv is None else list(argv)))
        dist.multicast_off()
        train(cfg, out_dir=args.out, t_start=process_start(), progress=lambda s: print(s, flush=True),
              checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
              stop_at=args.stop_at)
        return 0
    if args.command == "bench":
        from . import bench

        kernels = tuple(k for k in args.kernels.split(",") if k) if args.kernels else bench.DEFAULT_KERNELS
        contexts = tuple(int(n) for n in args.contexts.split(",") if n)
        try:
            result = bench.bench(kernels, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                                 contexts=contexts, tokens_per_step=args.tokens_per_step, warmup=args.warmup,
                                 steps=args.steps, rounds=args.rounds, device=args.device,
                                 progress=lambda s: print(s, flush=True))
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(f"[bench] wrote {bench.write(result, args.out)} ({result['wall_s']:.0f} s)")
        return 0
    if args.command == "gather":
        from .. import ncio
        from .record import gather

        ds = gather(args.folder)
        ds.to_netcdf(args.out, engine=ncio.ENGINE)
        print(f"gathered {ds.sizes['run']} runs into {args.out}")
        return 0
    if args.command == "sweep":
        from . import sweep

        try:
            spec = sweep.load(args.file, check_device=not args.list)
            if args.jobs < 1:
                raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
            if not args.list and not args.out:
                raise ValueError("--out is required unless --list")
            only_lrs = None if args.lrs is None else [float(x) for x in args.lrs.split(",") if x]
            only_arms = None if args.arms is None else [x for x in args.arms.split(",") if x]
            bad = sorted(set(only_arms or []) - set(spec["arms"])) + \
                [x for x in (only_lrs or []) if x not in spec["lrs"] + (spec.get("range") or {}).get("lrs", [])]
            if bad:
                raise ValueError(f"--lrs/--arms name what the plan does not have: {bad}")
        except (ValueError, OSError) as exc:
            print(exc, file=sys.stderr)
            return 2
        if args.list:
            for r in sweep.runs(spec):
                print(f"{r.record}: " + " ".join(sweep.flags(r.fields)))
            return 0
        status = sweep.run_sweep(spec, args.out, jobs=args.jobs, budget_s=args.budget_s,
                                 first_estimate_s=args.first_estimate_s, t_start=process_start(),
                                 say=lambda s: print(s, flush=True), lrs=only_lrs, arms=only_arms)
        failed = [k for k, v in status["runs"].items() if str(v.get("state", "")).startswith("failed")]
        return 1 if failed else 0
    if args.command == "plan":
        import yaml

        path = args.campaign or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", CAMPAIGN)
        for name, settings in (yaml.safe_load(open(path)) or {}).items():
            print(f"{name}: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items()))
        return 0
    if args.command == "corpus":
        from .data import Corpus

        print(json.dumps(Corpus.build(tuple(args.parts.split(","))).facts, indent=1))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
