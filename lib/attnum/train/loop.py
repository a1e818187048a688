"""The one trainer: ``train(cfg, ...)`` trains ``attnum.model.GPT`` with AdamW on the data source
``TrainConfig.data`` names, a synthetic ``Task`` ("task": the tiny CPU models of studies 03-05) or
the byte corpus ("corpus": the GPU-scale language model, one record file per command).

One config (``TrainConfig``; the dataclass defaults are the synthetic runs', ``TrainConfig.byte_lm``
the corpus runs' preset), one loop, one step: per optimiser step and per member (one model, or a
lockstep pair on the same batches) the forward (autocast as ``autocast`` says), the backward through
a ``GradScaler`` (active for fp16 only: dynamic loss scaling), unscaling, the global gradient norm
(``clip_grad_norm_`` at ``grad_clip``, infinite when 0: the norm is then measured and the gradients
multiplied by exactly 1), the optional callback, the update. What a run records depends on its data
source; both go to the one schema of ``attnum.train.record``:

* task runs record every ``record_every`` steps the step's own batch (loss, accuracy, gradient norms
  per block, the attention statistics of the training forward) and keep the weights at
  ``checkpoint_steps`` (returned in ``TrainResult``); they run to ``steps``.
* corpus runs log every ``log_every`` steps the mean training loss since the previous row and, on a
  fixed diagnostic batch, the per-layer statistics and FP32-recompute errors; the validation loss
  every ``eval_every``; weight sketches (and a pair's exact drift) every ``snapshot_every``; the
  record is written at every evaluation and at the end, so a run stopped by its wall-clock budget
  (``budget_s``, counted from the process start), by a non-finite loss, or killed leaves a record of
  what it reached.

Learning rate (``lr_at``): linear warm-up over ``warmup_steps`` (lr (s+1)/W at step s < W), then
``constant``, or ``cosine`` from lr to lr * min_lr_ratio at the last step (s = steps - 1). A budget
stop truncates the schedule where it is, so the budget-stopped corpus runs use ``constant``.

Optimiser: AdamW (eps 1e-8; fused on CUDA, one tensor at a time on the CPU), betas ``beta1``,
``beta2``; weight decay on every matrix (embeddings included, GPT-2 practice), none on biases and
LayerNorm gains. Logged gradient norms are before clipping.

Non-finite loss: the loss is read on the host at every step of a task run and at every logged row of
a corpus run (one device sync per row); a member whose read loss is non-finite stops there (its
update skipped); the run stops when every member has.

Determinism: the initial weights come from ``seed`` alone (``attnum.model.init_weights``, on the CPU),
the data from the task's ``data_seed`` and the step (or the corpus sampler's ``data_seed``), and
nothing draws from torch's global generator, so two CPU runs with the same configuration are bitwise
identical (``tests/train/test_training.py``); task runs fix the CPU threads (``threads``) so that the
reduction order is the same everywhere. On CUDA some backward kernels (the embedding's) accumulate
with atomics: no bitwise identity is claimed there. Runs that differ in one thing (a layer's
attention, ``init_perturbation``) share everything else.

Step convention: the checkpoint of step s holds the weights after s updates; the record of step s
is the forward and backward computed with those weights (task rows), or the state after s updates
(corpus rows).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch
import xarray as xr

from .. import ncio
from ..kernels import as_kernel
from ..model import GPT, IGNORE, AttentionChoice, GPTConfig, grad_norms, perturb_weights
from ..precision import FORMATS
from ..progress import tqdm
from ..timing import Timer
from . import diag, dist
from .data import PARTS, BatchSampler, Corpus, Task
from .diag import recompute_backward_fp32
from .record import LAYER_RECORDS, STEP_RECORDS, records_dataset

AUTOCAST = {"off": None, "bf16": FORMATS["bf16"], "fp16": FORMATS["fp16"]}
"""``TrainConfig.autocast``: the low format of torch.autocast ("off": none; "none" is read as "off")."""
DATA = ("task", "corpus")
SCHEDULES = ("cosine", "constant")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: str = "task"               # "task": a synthetic Task given to train(); "corpus": the byte corpus
    # -- optimisation (every run) --
    steps: int = 500                 # planned steps (the schedule's length); a corpus run's budget may stop sooner
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    schedule: str = "cosine"         # "cosine" (to lr * min_lr_ratio at the last step) or "constant"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0        # AdamW decoupled decay on matrices (not biases or LayerNorm gains)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 0.0           # global gradient-norm clipping threshold; 0 turns clipping off
    seed: int = 0                    # initial weights (member a)
    init_perturbation: float = 0.0   # add this * N(0, 1) to every initial weight
    perturbation_seed: int = 1
    autocast: str = "off"            # "bf16" or "fp16" (with loss scaling): the model's forward under torch.autocast
    threads: int = 1                 # torch CPU threads while training (0: leave as is); small models gain nothing
    #                                  from more, and a fixed count keeps the reduction order, hence the bits
    device: str = "cpu"
    # -- task runs: records and checkpoints --
    checkpoint_steps: tuple = ()     # keep the weights after these many updates (0 = initial weights)
    record_every: int = 1
    # -- corpus runs: the model (a task run's is the GPTConfig given to train) --
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    context: int = 1024
    qk_norm: bool = False            # qk-layernorm (Wortsman et al. 2023's mitigation of attention-logit growth)
    kernel: str = "sdpa:flash"       # attention choice of member a, '<registry name>[@dtype]' (AttentionChoice)
    pair: bool = False               # train a second model b in lockstep on the same batches
    pair_kernel: str | None = None   # member b's kernel, autocast and seed (None: a's)
    pair_autocast: str | None = None
    pair_seed: int | None = None
    # -- corpus runs: data --
    data_seed: int = 0               # the data order (same seed: same batches in the same order)
    corpus: str = "stdlib"           # comma-separated parts of data.PARTS
    val_fraction: float = 0.05
    corpus_max_bytes: int = 0        # > 0: truncate the corpus (tests)
    val_windows: int = 64            # fixed validation windows (the diagnostic batch is the first diag_batch)
    # -- corpus runs: logging --
    log_every: int = 100             # per-layer diagnostics, gradient norms, throughput
    eval_every: int = 500            # validation loss and a record written (a multiple of log_every)
    snapshot_every: int = 1000       # weight sketches and pair drift (a multiple of log_every)
    snapshot_early: int = 0          # > 0: also a snapshot every this many steps before the first regular one
    sketch_size: int = 256
    diag_batch: int = 4
    time_attention: bool = True
    budget_s: float = 0.0            # wall clock from process start (0: none); the run stops cleanly before it
    tag: str = ""                    # free text kept in the record (e.g. the campaign's name for the run)

    @classmethod
    def byte_lm(cls, **overrides) -> "TrainConfig":
        """The corpus runs' preset: GPT-2 small's geometry on bytes, bf16 autocast, Qiu & Yao's unstable
        setting (lr 1e-3, constant after 500 warm-up steps, clip 1.0, no weight decay), 540 s on one GPU."""
        preset = dict(data="corpus", steps=20000, batch_size=16, lr=1e-3, warmup_steps=500, schedule="constant",
                      grad_clip=1.0, autocast="bf16", threads=0, device="cuda", budget_s=540.0)
        return cls(**{**preset, **overrides})

    def __post_init__(self) -> None:
        for key in ("autocast", "pair_autocast"):
            if getattr(self, key) == "none":
                object.__setattr__(self, key, "off")
        if isinstance(self.checkpoint_steps, (tuple, list)):
            object.__setattr__(self, "checkpoint_steps",
                               tuple(sorted(set(int(s) for s in self.checkpoint_steps))))
        self.check()

    def members(self) -> list[dict]:
        """The models a corpus run trains: a, and b of a pair."""
        a = {"member": "a", "kernel": self.kernel, "amp": self.autocast, "seed": self.seed}
        if not self.pair:
            return [a]
        b = {"member": "b", "kernel": self.pair_kernel or self.kernel, "amp": self.pair_autocast or self.autocast,
             "seed": self.seed if self.pair_seed is None else self.pair_seed}
        return [a, b]

    def check(self) -> None:
        """Every parameter error at once, before any work."""
        errors = []

        def positive_int(key):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                errors.append(f"{key} must be a positive integer, got {value!r}")

        if self.data not in DATA:
            raise ValueError(f"data must be one of {list(DATA)}, got {self.data!r}")
        for key in ("steps", "batch_size", "record_every"):
            positive_int(key)
        if self.autocast not in AUTOCAST:
            errors.append(f"autocast must be one of {list(AUTOCAST)}, got {self.autocast!r}")
        if self.schedule not in SCHEDULES:
            errors.append(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            errors.append(f"lr must be positive, got {self.lr!r}")
        for key in ("min_lr_ratio", "weight_decay", "grad_clip", "warmup_steps", "budget_s", "threads"):
            if not (isinstance(getattr(self, key), (int, float)) and getattr(self, key) >= 0):
                errors.append(f"{key} must be >= 0, got {getattr(self, key)!r}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                errors.append(f"{key} must be in [0, 1), got {getattr(self, key)!r}")
        bad = [s for s in self.checkpoint_steps if not 0 <= s <= self.steps] \
            if isinstance(self.steps, int) else []
        if bad:
            errors.append(f"checkpoint steps {bad} are outside 0..{self.steps}")
        if self.data == "corpus":
            self._check_corpus(errors, positive_int)
        if errors:
            raise ValueError("bad training parameters:\n  " + "\n  ".join(errors))

    def _check_corpus(self, errors: list, positive_int) -> None:
        for key in ("n_layer", "n_head", "d_model", "context", "log_every", "eval_every", "snapshot_every",
                    "sketch_size", "diag_batch", "val_windows"):
            positive_int(key)
        if not errors and self.d_model % self.n_head:
            errors.append(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if not (isinstance(self.snapshot_early, int) and 0 <= self.snapshot_early
                and (not isinstance(self.snapshot_every, int) or self.snapshot_early < self.snapshot_every)):
            errors.append(f"snapshot_early must be an integer >= 0 and below snapshot_every ({self.snapshot_every}), "
                          f"got {self.snapshot_early!r}")
        for key in ("eval_every", "snapshot_every"):
            if isinstance(getattr(self, key), int) and isinstance(self.log_every, int) and self.log_every > 0 \
                    and getattr(self, key) % self.log_every:
                errors.append(f"{key} ({getattr(self, key)}) must be a multiple of log_every ({self.log_every})")
        if not (isinstance(self.diag_batch, int) and isinstance(self.val_windows, int)) or \
                self.diag_batch > self.val_windows:
            errors.append(f"diag_batch ({self.diag_batch}) must be at most val_windows ({self.val_windows})")
        parts = [p for p in str(self.corpus).split(",") if p]
        if not parts or any(p not in PARTS for p in parts):
            errors.append(f"corpus must name parts among {list(PARTS)} (comma-separated), got {self.corpus!r}")
        if not 0 < self.val_fraction < 0.5:
            errors.append(f"val_fraction must be in (0, 0.5), got {self.val_fraction!r}")
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            errors.append(f"device {self.device!r}: torch sees no CUDA device (use --device cpu)")
        for m in self.members():
            if m["member"] == "b" and m["amp"] not in AUTOCAST:  # a's autocast is named above
                errors.append(f"member b: pair_autocast must be one of {list(AUTOCAST)}, got {m['amp']!r}")
            try:
                choice = AttentionChoice.parse(m["kernel"], _attention_default(m["amp"]))
                reason = choice.unavailable_reason(self.device)
                if reason:
                    errors.append(f"member {m['member']}: kernel {m['kernel']!r} cannot run on {self.device}: {reason}")
            except ValueError as exc:
                errors.append(f"member {m['member']}: {exc}")

    def lr_at(self, step: int) -> float:
        """The rate of optimiser step ``step`` (0-based), see the module docstring."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        span = max(1, self.steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def params(self) -> dict:
        return dataclasses.asdict(self)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    return cfg.lr_at(step)


def _attention_default(amp: str) -> str:
    """The attention dtype of a choice named without one: the autocast dtype (bf16 when off)."""
    return amp if amp in ("bf16", "fp16") else "bf16"


@dataclasses.dataclass
class TrainResult:
    model: GPT                       # member a's model after training
    records: xr.Dataset              # task runs: the (step, layer) records; corpus runs: the record written
    checkpoints: dict                # step -> state_dict (cloned tensors); task runs
    diverged_at: int | None = None   # the step of the first non-finite loss read (member a), None if none
    path: Path | None = None         # corpus runs: the record file
    models: dict = dataclasses.field(default_factory=dict)  # member label -> model


def build_model(model_cfg: GPTConfig, cfg: TrainConfig, device="cpu") -> GPT:
    model = GPT(model_cfg, seed=cfg.seed)
    perturb_weights(model, cfg.init_perturbation, cfg.perturbation_seed)
    return model.to(device)


def load_checkpoint(model_cfg: GPTConfig, state: dict, device="cpu") -> GPT:
    model = GPT(model_cfg, seed=0)
    model.load_state_dict(state)
    return model.to(device)


def _optimizer(model: GPT, cfg: TrainConfig, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    cuda = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False if not cuda
                             else None, fused=cuda or None)


def accuracy(logits, targets) -> float:
    scored = targets != IGNORE
    return (logits.argmax(-1)[scored] == targets[scored]).float().mean().item()


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with ``n`` torch CPU threads (0: as they are), then restore the previous count."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def preserve_gradients(model: torch.nn.Module):
    """Restore every parameter's .grad after the block (for diagnostics run inside a training step)."""
    saved = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    try:
        yield
    finally:
        for p, g in zip(model.parameters(), saved):
            p.grad = g


class Member:
    """One model of the run, its optimiser, its loss scaler and its running loss."""

    def __init__(self, label: str, model: GPT, cfg: TrainConfig, device, choice: AttentionChoice | None = None,
                 spec: dict | None = None):
        self.label, self.model, self.choice, self.spec = label, model, choice, spec or {}
        self.opt = _optimizer(model, cfg, device)
        # fp16: dynamic loss scaling; disabled (scale 1, steps plain) otherwise; logged norms are unscaled
        self.scaler = torch.amp.GradScaler(torch.device(device).type, enabled=model.cfg.amp == "fp16")
        self.loss_sum = torch.zeros((), device=device)
        self.loss_count = 0
        self.stopped_at: int | None = None   # step whose loss was read non-finite
        self.nonfinite_step = -1             # corpus: first logged step with a non-finite mean loss
        self.read_every_step = False         # task runs read the loss at every step
        self.timing = {}
        self.forward = model                 # what the step trains through: the model, or its DDP wrapper

    def step(self, cfg: TrainConfig, step: int, batch, *, before_clip=None, callback=None):
        """One optimiser step on ``batch``: forward, (scaled) backward, unscaling, ``before_clip(member)``
        if given, the global norm and clipping, then, unless the loss is read non-finite, ``callback`` and
        the update. Returns ``(logits, loss)``; the clipped gradients stay in ``.grad``."""
        model, opt, scaler = self.model, self.opt, self.scaler
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        logits, loss = self.forward(*batch)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if before_clip is not None:
            before_clip(self)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        self.total_norm = total
        if self.read_every_step and not math.isfinite(loss.item()):
            self.stopped_at = step  # keep what was recorded; the weights would turn to NaN
            return logits, loss
        if callback is not None:
            callback(step, model, batch, total.item())
        scaler.step(opt)  # skipped when the unscaled gradients hold inf/NaN (fp16)
        scaler.update()
        self.loss_sum += loss.detach()
        self.loss_count += 1
        return logits, loss


def train(cfg: TrainConfig, task: Task | None = None, model_cfg: GPTConfig | None = None, *, out_dir=None,
          device=None, progress=True, checkpoint_dir: str | Path | None = None, desc: str = "train",
          callback=None, t_start: float | None = None, world=None, resume: bool = False,
          stop_at: int | None = None, checkpoint_every: int = 0) -> TrainResult:
    """Train as ``cfg`` says (see the module docstring).

    Task runs (``cfg.data == "task"``) need ``task`` and ``model_cfg`` (the model; ``cfg.autocast``
    sets its ``amp`` unless it has one) and return the model, the records and the checkpoints
    (written to ``checkpoint_dir`` too, if given). Corpus runs build corpus and model(s) from ``cfg``,
    write their record into ``out_dir`` and return it (``TrainResult.path``). ``device`` overrides
    ``cfg.device``. ``progress``: a bar (task) or printed lines (corpus) when true, a callable for the
    lines, nothing when false. ``callback(step, model, batch, grad_norm_total)``, if given, runs after
    each backward (gradients unscaled and clipped) and before the update; it must leave weights and
    gradients as it found them (``preserve_gradients``), so that a run with a callback is bitwise the
    run without one.

    Corpus runs only: data-parallel under torchrun (``world``: a ``dist.World``; None: from the
    environment, one process without torchrun's; see ``attnum.train.dist``); ``checkpoint_dir`` gets the
    run's checkpoint at its stop (and every ``checkpoint_every`` steps, a multiple of ``log_every``, if
    > 0), from which ``resume=True`` continues; ``stop_at`` stops the command after that many steps
    done, as a budget would (the checkpoint's step).
    """
    if device is not None and str(device) != cfg.device:
        cfg = dataclasses.replace(cfg, device=str(device))
    if cfg.data == "task":
        if task is None or model_cfg is None:
            raise ValueError("a task run (data='task') needs the task and the model's GPTConfig")
        with torch_threads(cfg.threads):
            return _train_task(cfg, task, model_cfg, progress=progress, checkpoint_dir=checkpoint_dir, desc=desc,
                               callback=callback)
    if out_dir is None:
        raise ValueError("a corpus run (data='corpus') needs out_dir, the folder of its record")
    if checkpoint_every and (checkpoint_every < 0 or checkpoint_every % cfg.log_every):
        raise ValueError(f"checkpoint_every ({checkpoint_every}) must be a multiple of log_every ({cfg.log_every})")
    if (resume or checkpoint_every) and checkpoint_dir is None:
        raise ValueError("resume and checkpoint_every need checkpoint_dir, the folder of the run's checkpoint")
    if stop_at is not None and not (isinstance(stop_at, int) and 0 < stop_at <= cfg.steps):
        raise ValueError(f"stop_at must be a step in 1..{cfg.steps}, got {stop_at!r}")
    world = dist.World.from_env(cfg) if world is None else world
    say = progress if callable(progress) else (print if progress else (lambda s: None))
    if not world.is_main:
        say = lambda s: None  # noqa: E731  (rank 0 speaks for the run)
    with torch_threads(cfg.threads):
        return _train_corpus(cfg, out_dir, t_start=time.monotonic() if t_start is None else t_start, say=say,
                             callback=callback, world=world, checkpoint_dir=checkpoint_dir, resume=resume,
                             stop_at=stop_at, checkpoint_every=checkpoint_every)


def _train_task(cfg, task, model_cfg, *, progress, checkpoint_dir, desc, callback) -> TrainResult:
    if model_cfg.vocab_size != task.vocab_size or model_cfg.context < task.context:
        raise ValueError(f"model (vocab {model_cfg.vocab_size}, context {model_cfg.context}) does not fit "
                         f"task {task.name} (vocab {task.vocab_size}, context {task.context})")
    refused = [f"layer {i}: kernel {k.name!r} cannot run on {cfg.device}: {reason}"
               for i, k in enumerate(model_cfg.attention) if (reason := k.unavailable_reason(cfg.device))]
    if refused:  # before any work, not at the first forward
        raise ValueError("bad training parameters:\n  " + "\n  ".join(refused))
    if cfg.autocast != "off":
        if model_cfg.amp not in ("off", cfg.autocast):
            raise ValueError(f"autocast {cfg.autocast!r} and the model's amp {model_cfg.amp!r} disagree")
        model_cfg = dataclasses.replace(model_cfg, amp=cfg.autocast)
    device = cfg.device
    member = Member("a", build_model(model_cfg, cfg, device), cfg, device)
    member.read_every_step = True
    model = member.model
    attns = model.attention_modules()
    rec_steps = [s for s in range(cfg.steps) if s % cfg.record_every == 0 or s == cfg.steps - 1]
    rec_index = {s: i for i, s in enumerate(rec_steps)}
    step_rec = {name: np.full(len(rec_steps), np.nan) for name in STEP_RECORDS}
    layer_rec = {name: np.full((len(rec_steps), len(attns)), np.nan) for name in LAYER_RECORDS}
    checkpoints = {}

    def keep(step):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        checkpoints[step] = state
        if checkpoint_dir is not None:
            Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(checkpoint_dir) / f"step{step:07d}.pt")

    bar = tqdm(range(cfg.steps + 1), desc=desc, disable=not progress, leave=False)
    for step in bar:
        if step in cfg.checkpoint_steps:
            keep(step)
        if step == cfg.steps or member.stopped_at is not None:
            continue
        i = rec_index.get(step)
        for attn in attns:
            attn.record_stats = i is not None
        batch = task.batch(step, cfg.batch_size, device)
        logits, loss = member.step(cfg, step, batch, callback=callback)
        if i is not None:
            step_rec["loss"][i], step_rec["lr"][i] = loss.item(), cfg.lr_at(step)
            step_rec["accuracy"][i] = accuracy(logits, batch[1])
            step_rec["grad_norm_total"][i] = member.total_norm.item()
            for layer, attn in enumerate(attns):
                values = {**grad_norms(model, layer), **attn.stats}
                for name in LAYER_RECORDS:
                    layer_rec[name][i, layer] = values[name]
            if progress:
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    for attn in attns:
        attn.record_stats = False
    records = records_dataset(rec_steps, step_rec, layer_rec, len(attns))
    return TrainResult(model=model, records=records, checkpoints=checkpoints, diverged_at=member.stopped_at,
                       models={"a": model})


def _versions(device) -> dict:
    out = ncio.accelerator_versions(str(device))
    out["tf32_matmul"] = str(torch.backends.cuda.matmul.allow_tf32)
    return out


def _diagnose(member: Member, batch, log: dict) -> None:
    """The per-layer statistics and FP32-recompute errors on the diagnostic batch (grads left zeroed)."""
    model = member.model
    attns = model.attention_modules()
    for attn in attns:
        attn.capture = {}
    model.zero_grad(set_to_none=True)
    try:
        _, loss = model(*batch)
        # fp16: the loss scaled as in training, so that dO does not underflow (relative errors do not change)
        (loss * member.scaler.get_scale() if member.scaler.is_enabled() else loss).backward()
        captured = [attn.capture for attn in attns]
    finally:
        for attn in attns:
            attn.capture = None
        model.zero_grad(set_to_none=True)
    rows = {}
    for attn, cap in zip(attns, captured):
        row = diag.attention_stats(cap["q"], cap["k"])
        row.update(diag.recompute_errors(cap, attn.kernel))
        for key, value in row.items():
            rows.setdefault(key, []).append(value)
    for key, values in rows.items():
        log.setdefault(key, []).append(values)


@torch.no_grad()
def validation_loss(model, sampler: BatchSampler, batch_size: int) -> float:
    total, count = 0.0, 0
    for x, y in sampler.val_batches(batch_size):
        _, loss = model(x, y)
        total += loss.item() * x.shape[0]
        count += x.shape[0]
    return total / count


def _corpus_members(cfg: TrainConfig, device) -> list[Member]:
    out = []
    for spec in cfg.members():
        choice = AttentionChoice.parse(spec["kernel"], _attention_default(spec["amp"]))
        model_cfg = GPTConfig.byte_lm(choice, n_layer=cfg.n_layer, n_head=cfg.n_head, d_model=cfg.d_model,
                                      context=cfg.context, amp=spec["amp"], qk_norm=cfg.qk_norm)
        model = build_model(model_cfg, dataclasses.replace(cfg, seed=spec["seed"]), device)
        out.append(Member(spec["member"], model, cfg, device, choice=choice, spec=spec))
    return out


def _train_corpus(cfg: TrainConfig, out_dir, *, t_start: float, say, callback, world, checkpoint_dir=None,
                  resume=False, stop_at=None, checkpoint_every=0) -> TrainResult:
    from . import record

    dist.check_world_size(cfg.batch_size, world.size)
    main = world.is_main
    device = torch.device(world.device(cfg.device))
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 attention is fp32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    corpus = Corpus.build(tuple(p for p in cfg.corpus.split(",") if p), cfg.val_fraction, cfg.corpus_max_bytes)
    sampler = BatchSampler(corpus, context=cfg.context, batch_size=cfg.batch_size, steps=cfg.steps,
                           data_seed=cfg.data_seed, device=device, val_windows=cfg.val_windows)
    members = _corpus_members(cfg, device)
    payload = dist.load_checkpoint(checkpoint_dir, cfg) if resume else None
    if payload is not None:
        dist.restore_members(payload, members)
        dist.set_rng_state(payload["rng"])
    for m in members:
        m.forward = world.wrap(m.model)  # DDP broadcasts rank 0's weights: they are every rank's already
    lm_cfg = members[0].model.cfg
    diag_batch = next(sampler.val_batches(cfg.diag_batch))
    say(f"[lm] corpus {corpus.facts['corpus_bytes'] / 1e6:.1f} MB ({corpus.facts['corpus_files']} files, "
        f"sha256 {corpus.facts['corpus_sha256'][:12]}), model {lm_cfg.n_params() / 1e6:.1f} M parameters, "
        f"members {[m.choice.label for m in members]}, {world.size} process(es) ({world.backend or 'none'}), "
        f"start-up {time.monotonic() - t_start:.1f} s")

    state = record.RunState(cfg=cfg, lm_cfg=lm_cfg, corpus_facts=corpus.facts, order_sha256=sampler.order_sha256,
                            members=[m.spec | {"attention": m.choice.label} for m in members],
                            tensor_names=diag.tensor_names(members[0].model),
                            tensor_numel=[p.numel() for p in members[0].model.parameters()],
                            versions=_versions(device), world=world.facts())
    offset = 0.0
    if payload is not None:
        dist.restore_run_state(payload, state)
        offset = dist.elapsed_offset(payload)
        state.resumed_at = list(state.resumed_at) + [payload["done"]]
    if cfg.time_attention and main:
        shape = (cfg.batch_size // world.size, cfg.n_head, cfg.context, lm_cfg.head_dim)  # one rank's shard
        for m in members:
            m.timing = diag.time_attention(m.choice, shape, device)
            state.attention_timing[m.label] = m.timing
    out_path = out_dir / record.record_name(cfg)

    def snapshot(step):
        if not main:
            return
        state.snapshot_steps.append(step)
        state.sketches.append([diag.weight_sketches(m.model, cfg.sketch_size) for m in members])
        state.weight_l2.append([diag.weight_l2(m.model) for m in members])
        if len(members) == 2:
            state.pair_drift.append(diag.exact_drift(members[0].model, members[1].model))

    def log_row(step, interval_s, interval_steps, do_eval, stop_vote=False):
        """The row of ``step`` (rank 0 records it); returns whether any rank voted stop."""
        sums, stop = world.reduce_row([m.loss_sum for m in members], stop_vote)
        if main:
            state.steps.append(step)
            state.elapsed_s.append(offset + time.monotonic() - t_start)
            state.lr.append(cfg.lr_at(max(step - 1, 0)))
            state.step_time_s.append(interval_s / interval_steps if interval_steps else math.nan)
        for m, loss_sum in zip(members, sums):
            row = state.member_rows.setdefault(m.label, {})
            mean_loss = (loss_sum / m.loss_count).item() if m.loss_count else math.nan
            logged = m.loss_count
            m.loss_sum.zero_()
            m.loss_count = 0
            row.setdefault("loss", []).append(mean_loss)
            if logged and not math.isfinite(mean_loss) and m.nonfinite_step < 0:
                m.nonfinite_step = step
                m.stopped_at = step
            state.nonfinite_step[m.label] = m.nonfinite_step
            if not main:
                continue
            layers = state.member_layers.setdefault(m.label, {})
            if m.nonfinite_step < 0:
                _diagnose(m, diag_batch, layers)
            else:  # a model with non-finite weights: nothing to diagnose
                for key in diag.LAYER_STATS + diag.DIAG_ERRORS:
                    layers.setdefault(key, []).append([math.nan] * cfg.n_layer)
            row.setdefault("val_loss", []).append(validation_loss(m.model, sampler, cfg.batch_size)
                                                  if do_eval and m.nonfinite_step < 0 else math.nan)
        return stop

    def write_record():
        return record.write(state, out_path) if main else None

    written = []  # the steps of the checkpoints written

    def write_checkpoint(done):
        if main and checkpoint_dir is not None and done not in written:
            written.append(done)
            dist.save_checkpoint(checkpoint_dir, cfg=cfg, members=members, done=done, run_state=state,
                                 final_cost=final_cost, wall_s=offset + time.monotonic() - t_start)

    nan_norms = ([math.nan] * cfg.n_layer, [math.nan] * cfg.n_layer, math.nan)
    if payload is None:
        # -- step 0: the initial model --
        state.grad_norms.append({m.label: nan_norms for m in members})
        t_final = time.monotonic()
        log_row(0, math.nan, 0, True)
        snapshot(0)
        write_record()
        # what the end costs (a last row with diagnostics and evaluation, a snapshot, the record), with a margin
        final_cost = 1.5 * (time.monotonic() - t_final) + 5.0
        if checkpoint_dir is not None:  # and a checkpoint, measured by writing the initial one
            t_ckpt = time.monotonic()
            write_checkpoint(0)
            final_cost += 1.5 * (time.monotonic() - t_ckpt)
        start = 0
    else:
        final_cost, start = payload["final_cost"], payload["done"]
        say(f"[lm] continuing from the checkpoint at step {start} in {checkpoint_dir}")
    if world.group:  # every rank's final cost is rank 0's (the others' are 0 in the sum)
        own = torch.tensor(final_cost if main else 0.0, device=device)
        final_cost = float(world.reduce_row([own], False)[0][0]) * world.size

    timer = Timer(device)
    interval_start, interval_steps, step_s, done = timer.mark(), 0, math.nan, start
    stop_reason = "steps"
    for step in range(start, cfg.steps):
        if stop_at is not None and step >= stop_at:
            stop_reason = "stop_at"
            break
        elapsed = time.monotonic() - t_start
        if cfg.budget_s and not world.group and \
                elapsed + final_cost + 2 * (step_s if math.isfinite(step_s) else 0) > cfg.budget_s:
            stop_reason = "budget"
            break
        batch = world.shard(sampler.batch(step))
        is_log = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps
        norms = {}
        for m in members:
            if m.nonfinite_step >= 0:
                continue
            m.step(cfg, step, batch, callback=callback,
                   before_clip=(lambda m: norms.__setitem__(m.label, diag.layer_grad_norms(m.model)))
                   if is_log and main else None)
            m.opt.zero_grad(set_to_none=True)
        interval_steps += 1
        done = step + 1
        early = cfg.snapshot_early and done < cfg.snapshot_every and done % cfg.snapshot_early == 0
        if not is_log:
            if early:
                snapshot(done)
            continue
        interval_s = timer.seconds(interval_start, timer.mark())
        step_s = interval_s / interval_steps
        if main:
            state.grad_norms.append({m.label: norms.get(m.label, nan_norms) for m in members})
        do_eval = done % cfg.eval_every == 0
        # data parallel: vote stop when the next log_every steps would pass the budget at this interval's speed
        vote = bool(world.group and cfg.budget_s and time.monotonic() - t_start + final_cost
                    + (cfg.log_every + 2) * step_s > cfg.budget_s)
        budget_stop = log_row(done, interval_s, interval_steps, do_eval, vote)
        if done % cfg.snapshot_every == 0 or early:
            snapshot(done)
        tok_s = interval_steps * cfg.batch_size * cfg.context * len(members) / interval_s
        losses = ", ".join(f"{m.label} {state.member_rows[m.label]['loss'][-1]:.4f}" for m in members)
        say(f"[lm] step {done}: loss {losses}; {step_s * 1e3:.1f} ms/step, {tok_s / 1e3:.0f} k tok/s, "
            f"elapsed {time.monotonic() - t_start:.0f} s")
        interval_start, interval_steps = timer.mark(), 0
        if do_eval:
            write_record()
        if checkpoint_every and done % checkpoint_every == 0 and done < cfg.steps:
            write_checkpoint(done)
        if all(m.nonfinite_step >= 0 for m in members):
            stop_reason = "nonfinite"
            break
        if budget_stop:
            stop_reason = "budget"
            break

    # -- the end: a last row for the steps since the last one, and a final evaluation --
    if interval_steps:
        interval_s = timer.seconds(interval_start, timer.mark())
        if main:
            state.grad_norms.append({m.label: nan_norms for m in members})
        log_row(done, interval_s, interval_steps, True)
    elif main:
        for m in members:
            if m.nonfinite_step < 0 and not math.isfinite(state.member_rows[m.label]["val_loss"][-1]):
                state.member_rows[m.label]["val_loss"][-1] = validation_loss(m.model, sampler, cfg.batch_size)
    if main and state.snapshot_steps[-1] != state.steps[-1]:
        snapshot(state.steps[-1])
    state.stop_reason = stop_reason
    state.wall_s = offset + time.monotonic() - t_start
    path = write_record()
    if done < cfg.steps and stop_reason in ("budget", "stop_at"):
        write_checkpoint(done)  # the next command continues from here
    world.barrier()  # the other ranks leave when rank 0's files are written
    a = members[0]
    if not main:
        return TrainResult(model=a.model, records=None, checkpoints={},
                           diverged_at=a.nonfinite_step if a.nonfinite_step >= 0 else None, path=None,
                           models={m.label: m.model for m in members})
    say(f"[lm] stopped ({stop_reason}) at step {state.steps[-1]} after {state.wall_s:.0f} s; record {path} "
        f"({path.stat().st_size / 2 ** 20:.2f} MiB)")
    return TrainResult(model=a.model, records=record.open_record(path), checkpoints={},
                       diverged_at=a.nonfinite_step if a.nonfinite_step >= 0 else None, path=path,
                       models={m.label: m.model for m in members})


# -- runs compared from one start, with the live FP32-recompute diagnostic (studies 04, 05) --

class LiveDiagnostic:
    """Training callback: the FP32 backward-recompute diagnostic on the step's own batch, every
    ``every`` steps and whenever the global gradient norm exceeds ``spike_factor`` times the median
    of the previous ``window`` steps (seed 004's test, applied when a spike happens)."""

    def __init__(self, every: int = 50, spike_factor: float = 3.0, window: int = 50,
                 threshold: float = 0.1):
        self.every, self.spike_factor, self.window, self.threshold = every, spike_factor, window, threshold
        self.history: list[float] = []
        self.parts: list[xr.Dataset] = []

    def __call__(self, step: int, model, batch, grad_norm: float) -> None:
        recent = self.history[-self.window:]
        spike = bool(self.spike_factor > 0 and len(recent) >= 10
                     and grad_norm > self.spike_factor * float(np.median(recent)))
        self.history.append(grad_norm)
        if not spike and step > 0 and not (self.every > 0 and step % self.every == 0):
            return  # step 0 always runs, so the record is never empty
        attns = model.attention_modules()
        recording = [attn.record_stats for attn in attns]
        for attn in attns:
            attn.record_stats = False
        with preserve_gradients(model):
            diag = recompute_backward_fp32(model, batch, threshold=self.threshold)
        for attn, flag in zip(attns, recording):
            attn.record_stats = flag
        diag["grad_norm_total"] = grad_norm
        diag["spike"] = np.int8(spike)
        self.parts.append(diag.drop_vars("threshold").expand_dims(diag_step=[step]))

    def spikes(self) -> list[int]:
        return [int(part["diag_step"][0]) for part in self.parts if int(part["spike"][0])]

    def dataset(self) -> xr.Dataset:
        ds = xr.concat(self.parts, dim="diag_step")
        ds = ds.rename({name: f"live_{name}" for name in ds.data_vars})
        ds["diag_step"].attrs.update(long_name="training step the diagnostic ran on")
        return ds


def train_runs(task: Task, model_cfg: GPTConfig, train_cfg: TrainConfig, runs: dict, *, device="cpu",
               progress: bool = True, callbacks: dict | None = None):
    """Train one model per entry of ``runs`` (name -> attention kernel of every layer) from the
    same initialisation and data order. Returns (records with a ``run`` dim, {name: TrainResult});
    ``callbacks`` maps run names to a training callback (e.g. a ``LiveDiagnostic``)."""
    results, records = {}, []
    for name, impl in runs.items():
        cfg = GPTConfig(**{**model_cfg.__dict__, "attention": (impl,)})
        results[name] = train(train_cfg, task, cfg, device=device, progress=progress, desc=f"train {name}",
                              callback=(callbacks or {}).get(name))
        records.append(results[name].records.expand_dims(run=[name]))
    ds = xr.concat(records, dim="run", join="outer")
    ds = ds.rename({name: f"train_{name}" for name in ds.data_vars})
    ds["run_attention"] = ("run", [as_kernel(kernel).name for kernel in runs.values()])
    return ds, results
