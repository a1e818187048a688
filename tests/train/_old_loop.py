"""The trainer: ``train`` (a model on a synthetic ``Task``, on the CPU, bitwise reproducible) and
``train_corpus`` (the byte-level language model on the stdlib corpus, on a GPU, within a wall-clock
budget, one record per command). Both train ``attnum.model.GPT`` with AdamW.

-- On a synthetic task: what seed 004 says to watch --


AdamW with linear warmup and cosine decay, optional global gradient clipping,
checkpoints (weights) at chosen steps, a tqdm bar, and per-step records: loss,
accuracy on the scored positions, learning rate, total gradient norm, and per
layer the gradient norm of the block and of its query/key projections, the
largest attention logit, the attention entropy, the norm of the mean key and its
ratio to the mean key norm. ``records_dataset`` turns the records into an
xarray Dataset with CF attributes for ``attnum.ncio.write_results``.

Determinism: the initial weights come from ``TrainConfig.seed`` alone, the data
from the task's ``data_seed`` and the step alone, and nothing draws from torch's
global generator, so two runs with the same configuration are bitwise identical
on one machine's CPU (``tests/train/test_training.py``). On CUDA some backward kernels
(the embedding's, for one) accumulate with atomics, so bitwise identity is not
claimed there. Runs that differ in one thing (the
attention implementation of a layer, ``init_perturbation``) share everything else.

Step convention: the checkpoint of step s holds the weights after s updates; the
record of step s is the forward and backward computed with those weights.

-- On the byte corpus: one command, one record --

One training run per command: a byte-level LM on the stdlib corpus, within a wall-clock budget.

``TrainConfig`` holds every parameter (nanoGPT style: plain fields with their defaults, all
recorded). ``train(config, out_dir)`` builds the corpus and the model(s), trains, and writes one
record (``record.write``) at every evaluation and at the end, so that a run stopped by its
budget, by a non-finite loss, or even killed, leaves a record of what it reached.

One member or a pair. A pair trains two models in lockstep on the same batches (the same data
order by construction): member ``a`` with ``kernel``/``seed``/``amp`` and member ``b`` with
``pair_kernel``/``pair_seed``/``pair_amp`` (each defaulting to a's). Study 03's pairs are then one
command each: flash vs fp32 attention (``--kernel sdpa:flash --pair-kernel sdpa:math``), the noise
floor (``--pair-seed 1``), the GPU repeat pair (``--pair`` with nothing changed: GPU training is
not bitwise deterministic), low-precision training as the upper bound (``--amp off --kernel
sdpa:math --pair-amp bf16 --pair-kernel sdpa:flash``, or ``--pair-amp fp16`` for fp16 training
with dynamic loss scaling, its attention fp16 unless named otherwise). The pair's exact
per-tensor drift is measured at every snapshot, beside each member's weight sketches.

Optimiser: AdamW (fused on CUDA), betas and weight decay configurable; weight decay applies to
matrices only (GPT-2 practice), 0 by default (Qiu & Yao's unstable setting); gradient clipping
at ``clip`` (0: off), logged gradient norms are before clipping. Learning rate: linear warm-up over
``warmup`` steps, then ``constant`` or ``cosine`` to ``min_lr`` at ``steps``. A budget stop
truncates the schedule where it is: with ``cosine`` the late, low-lr part may never run, so the
instability runs use ``constant`` by default.
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
from attnum import ncio
from attnum.kernels import as_kernel
from attnum.model import GPT, IGNORE, AttentionChoice, GPTConfig, grad_norms, perturb_weights
from attnum.precision import FORMATS
from attnum.progress import tqdm
from attnum.timing import Timer
from attnum.train import diag
from attnum.train.data import PARTS, BatchSampler, Corpus, Task
from attnum.train.diag import recompute_backward_fp32
from _old_record import ATTRS, LAYER_RECORDS, STEP_RECORDS, records_dataset

AUTOCAST = {"none": None, "bf16": FORMATS["bf16"], "fp16": FORMATS["fp16"]}
"""``TrainConfig.autocast``: the low format of torch.autocast (the precision policy's formats)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 500
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay from lr to lr * min_lr_ratio at the last step
    weight_decay: float = 0.0  # AdamW decoupled decay on matrices (not biases, norms, embeddings)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 0.0  # global gradient-norm clipping threshold; 0 turns clipping off
    seed: int = 0  # initial weights
    init_perturbation: float = 0.0  # add this * N(0, 1) to every initial weight
    perturbation_seed: int = 1
    checkpoint_steps: tuple = ()  # keep the weights after these many updates (0 = initial weights)
    record_every: int = 1
    autocast: str = "none"  # "bf16" or "fp16": everything but the attention kernel under torch.autocast
    threads: int = 1  # torch CPU threads while training: small models gain nothing from more, and a
    #                   fixed count keeps the reduction order, hence the bits, the same everywhere

    def __post_init__(self) -> None:
        if self.autocast not in AUTOCAST:
            raise ValueError(f"autocast must be one of {list(AUTOCAST)}, got {self.autocast!r}")
        bad = [s for s in self.checkpoint_steps if not 0 <= s <= self.steps]
        if bad:
            raise ValueError(f"checkpoint steps {bad} are outside 0..{self.steps}")
        object.__setattr__(self, "checkpoint_steps", tuple(sorted(set(int(s) for s in self.checkpoint_steps))))

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclasses.dataclass
class TrainResult:
    model: GPT
    records: xr.Dataset
    checkpoints: dict  # step -> state_dict (cloned tensors)
    diverged_at: int | None = None


def build_model(model_cfg: GPTConfig, cfg: TrainConfig, device="cpu") -> GPT:
    model = GPT(model_cfg, seed=cfg.seed)
    perturb_weights(model, cfg.init_perturbation, cfg.perturbation_seed)
    return model.to(device)


def load_checkpoint(model_cfg: GPTConfig, state: dict, device="cpu") -> GPT:
    model = GPT(model_cfg, seed=0)
    model.load_state_dict(state)
    return model.to(device)


def _optimizer(model: GPT, cfg: TrainConfig):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "emb" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False)


def accuracy(logits, targets) -> float:
    scored = targets != IGNORE
    return (logits.argmax(-1)[scored] == targets[scored]).float().mean().item()


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with ``n`` torch CPU threads, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(model_cfg: GPTConfig, task: Task, cfg: TrainConfig, *, device="cpu", progress: bool = True,
          checkpoint_dir: str | Path | None = None, desc: str = "train", callback=None) -> TrainResult:
    """Train from ``cfg.seed`` on ``task``; returns the model, the records and the checkpoints.

    ``callback(step, model, batch, grad_norm_total)``, if given, runs after each backward
    (gradients unscaled and clipped) and before the optimizer step. It must leave the
    weights and gradients as it found them (``preserve_gradients`` helps), so that a run
    with a callback is bitwise the run without one.
    """
    with torch_threads(cfg.threads):
        return _train(model_cfg, task, cfg, device=device, progress=progress, checkpoint_dir=checkpoint_dir,
                      desc=desc, callback=callback)


@contextlib.contextmanager
def preserve_gradients(model: torch.nn.Module):
    """Restore every parameter's .grad after the block (for diagnostics run inside a training step)."""
    saved = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    try:
        yield
    finally:
        for p, g in zip(model.parameters(), saved):
            p.grad = g


def _train(model_cfg, task, cfg, *, device, progress, checkpoint_dir, desc, callback=None) -> TrainResult:
    if model_cfg.vocab_size != task.vocab_size or model_cfg.context < task.context:
        raise ValueError(f"model (vocab {model_cfg.vocab_size}, context {model_cfg.context}) does not fit "
                         f"task {task.name} (vocab {task.vocab_size}, context {task.context})")
    model = build_model(model_cfg, cfg, device)
    opt = _optimizer(model, cfg)
    amp_dtype = AUTOCAST[cfg.autocast]
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=amp_dtype is torch.float16)
    attns = model.attention_modules()
    rec_steps = [s for s in range(cfg.steps) if s % cfg.record_every == 0 or s == cfg.steps - 1]
    rec_index = {s: i for i, s in enumerate(rec_steps)}
    step_rec = {name: np.full(len(rec_steps), np.nan) for name in STEP_RECORDS}
    layer_rec = {name: np.full((len(rec_steps), len(attns)), np.nan) for name in LAYER_RECORDS}
    checkpoints, diverged_at = {}, None
    bar = tqdm(range(cfg.steps + 1), desc=desc, disable=not progress, leave=False)
    for step in bar:
        if step in cfg.checkpoint_steps:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            checkpoints[step] = state
            if checkpoint_dir is not None:
                Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
                torch.save(state, Path(checkpoint_dir) / f"step{step:07d}.pt")
        if step == cfg.steps or diverged_at is not None:
            continue
        i = rec_index.get(step)
        for attn in attns:
            attn.record_stats = i is not None
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        inputs, targets = task.batch(step, cfg.batch_size, device)
        ctx = torch.autocast(torch.device(device).type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        with ctx:
            logits, loss = model(inputs, targets)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        if i is not None:
            step_rec["loss"][i], step_rec["lr"][i] = loss.item(), cfg.lr_at(step)
            step_rec["accuracy"][i], step_rec["grad_norm_total"][i] = accuracy(logits, targets), total.item()
            for layer, attn in enumerate(attns):
                values = {**grad_norms(model, layer), **attn.stats}
                for name in LAYER_RECORDS:
                    layer_rec[name][i, layer] = values[name]
        if not math.isfinite(loss.item()):
            diverged_at = step  # keep the records up to here; weights would turn to NaN
            continue
        if callback is not None:
            callback(step, model, (inputs, targets), total.item())
        scaler.step(opt)
        scaler.update()
        if i is not None and progress:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    for attn in attns:
        attn.record_stats = False
    records = records_dataset(rec_steps, step_rec, layer_rec, len(attns))
    return TrainResult(model=model, records=records, checkpoints=checkpoints, diverged_at=diverged_at)


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
        results[name] = train(cfg, task, train_cfg, device=device, progress=progress, desc=f"train {name}",
                              callback=(callbacks or {}).get(name))
        records.append(results[name].records.expand_dims(run=[name]))
    ds = xr.concat(records, dim="run", join="outer")
    ds = ds.rename({name: f"train_{name}" for name in ds.data_vars})
    ds["run_attention"] = ("run", [as_kernel(kernel).name for kernel in runs.values()])
    return ds, results


# -- the byte-level language model on the corpus, within a wall-clock budget --
SCHEDULES = ("constant", "cosine")
AMPS = ("bf16", "fp16", "off")


@dataclasses.dataclass
class CorpusConfig:
    # model
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    context: int = 1024
    # attention and precision of member a (and b, where the pair_* are None)
    kernel: str = "sdpa:flash"       # attention choice, '<registry name>[@dtype]' (gpt.AttentionChoice)
    amp: str = "bf16"                # autocast dtype of the matmuls: bf16, fp16 (with loss scaling), or off (fp32)
    seed: int = 0                    # init seed
    pair: bool = False               # train a second model b in lockstep on the same batches
    pair_kernel: str | None = None
    pair_amp: str | None = None
    pair_seed: int | None = None
    # data
    batch_size: int = 16
    data_seed: int = 0               # the data order (same seed: same batches in the same order)
    corpus: str = "stdlib"           # comma-separated parts of corpus.PARTS
    val_fraction: float = 0.05
    corpus_max_bytes: int = 0        # > 0: truncate the corpus (tests)
    val_windows: int = 64            # fixed validation windows (and the diagnostic batch is the first diag_batch)
    # optimiser
    steps: int = 20000               # planned steps (the schedule's length); the budget usually stops sooner
    lr: float = 1e-3
    min_lr: float = 1e-5
    warmup: int = 500
    schedule: str = "constant"
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0
    # logging
    log_every: int = 100             # per-layer diagnostics, gradient norms, throughput
    eval_every: int = 500            # validation loss and a record written (a multiple of log_every)
    snapshot_every: int = 1000       # weight sketches and pair drift (a multiple of log_every)
    snapshot_early: int = 0          # > 0: also a snapshot every this many steps before the first regular one
                                     # (a pair's drift in its first steps; need not be a multiple of log_every)
    sketch_size: int = 256
    diag_batch: int = 4
    time_attention: bool = True
    # run
    budget_s: float = 540.0          # wall clock from process start; the run stops cleanly before it
    device: str = "cuda"
    tag: str = ""                    # free text kept in the record (e.g. the campaign's name for the run)

    def members(self) -> list[dict]:
        a = {"member": "a", "kernel": self.kernel, "amp": self.amp, "seed": self.seed}
        if not self.pair:
            return [a]
        b = {"member": "b", "kernel": self.pair_kernel or self.kernel, "amp": self.pair_amp or self.amp,
             "seed": self.seed if self.pair_seed is None else self.pair_seed}
        return [a, b]

    def check(self) -> None:
        """Every parameter error at once, before any work."""
        errors = []
        ints = ("n_layer", "n_head", "d_model", "context", "batch_size", "steps", "log_every", "eval_every",
                "snapshot_every", "sketch_size", "diag_batch", "val_windows")
        for key in ints:
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                errors.append(f"{key} must be a positive integer, got {getattr(self, key)!r}")
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
        for key in ("lr", "budget_s"):
            if not (isinstance(getattr(self, key), (int, float)) and getattr(self, key) > 0):
                errors.append(f"{key} must be positive, got {getattr(self, key)!r}")
        for key in ("min_lr", "weight_decay", "clip", "warmup"):
            if not (isinstance(getattr(self, key), (int, float)) and getattr(self, key) >= 0):
                errors.append(f"{key} must be >= 0, got {getattr(self, key)!r}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                errors.append(f"{key} must be in [0, 1), got {getattr(self, key)!r}")
        if self.schedule not in SCHEDULES:
            errors.append(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        parts = [p for p in str(self.corpus).split(",") if p]
        if not parts or any(p not in PARTS for p in parts):
            errors.append(f"corpus must name parts among {list(PARTS)} (comma-separated), got {self.corpus!r}")
        if not 0 < self.val_fraction < 0.5:
            errors.append(f"val_fraction must be in (0, 0.5), got {self.val_fraction!r}")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            errors.append(f"device {self.device!r}: torch sees no CUDA device (use --device cpu)")
        for m in self.members():
            if m["amp"] not in AMPS:
                errors.append(f"member {m['member']}: amp must be one of {list(AMPS)}, got {m['amp']!r}")
            try:
                choice = AttentionChoice.parse(m["kernel"], _attention_default(m["amp"]))
                reason = choice.unavailable_reason(self.device)
                if reason:
                    errors.append(f"member {m['member']}: kernel {m['kernel']!r} cannot run on {self.device}: {reason}")
            except ValueError as exc:
                errors.append(f"member {m['member']}: {exc}")
        if errors:
            raise ValueError("bad training parameters:\n  " + "\n  ".join(errors))

    def params(self) -> dict:
        return dataclasses.asdict(self)


def _attention_default(amp: str) -> str:
    """The attention dtype of a choice named without one: the autocast dtype (bf16 when off)."""
    return amp if amp in ("bf16", "fp16") else "bf16"


def learning_rate(cfg: CorpusConfig, step: int) -> float:
    """The rate of optimiser step ``step`` (0-based): linear warm-up, then constant or cosine."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


class Member:
    """One model of the run, its optimiser and its logged series."""

    def __init__(self, spec: dict, cfg: CorpusConfig, lm_cfg: GPTConfig, device):
        self.label, self.spec = spec["member"], spec
        self.choice = AttentionChoice.parse(spec["kernel"], _attention_default(spec["amp"]))
        model_cfg = dataclasses.replace(lm_cfg, attention=(self.choice.kernel_name,), amp=spec["amp"],
                                        attention_dtype=self.choice.dtype)
        self.model = GPT(model_cfg, seed=spec["seed"]).to(device)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     fused=torch.device(device).type == "cuda")
        # fp16 training: dynamic loss scaling (GradScaler); logged gradient norms are unscaled
        self.scaler = torch.amp.GradScaler(torch.device(device).type) if spec["amp"] == "fp16" else None
        self.loss_sum = torch.zeros((), device=device)
        self.loss_count = 0
        self.nonfinite_step = -1
        self.timing = {}


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
        (loss if member.scaler is None else loss * member.scaler.get_scale()).backward()
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


def train_corpus(cfg: CorpusConfig, out_dir, *, t_start: float | None = None, progress=print) -> Path:
    """Run; returns the record's path (``<out_dir>/<record name>.nc``)."""
    import _old_record as record

    t_start = time.monotonic() if t_start is None else t_start
    cfg.check()
    device = torch.device(cfg.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 attention is fp32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    corpus = Corpus.build(tuple(p for p in cfg.corpus.split(",") if p), cfg.val_fraction, cfg.corpus_max_bytes)
    sampler = BatchSampler(corpus, context=cfg.context, batch_size=cfg.batch_size, steps=cfg.steps,
                           data_seed=cfg.data_seed, device=device, val_windows=cfg.val_windows)
    lm_cfg = GPTConfig(vocab_size=256, context=cfg.context, n_layer=cfg.n_layer, n_head=cfg.n_head,
                       d_model=cfg.d_model, attention=("sdpa:math",))
    members = [Member(spec, cfg, lm_cfg, device) for spec in cfg.members()]
    diag_batch = next(sampler.val_batches(cfg.diag_batch))
    progress(f"[lm] corpus {corpus.facts['corpus_bytes'] / 1e6:.1f} MB ({corpus.facts['corpus_files']} files, "
             f"sha256 {corpus.facts['corpus_sha256'][:12]}), model {lm_cfg.n_params() / 1e6:.1f} M parameters, "
             f"members {[m.choice.label for m in members]}, start-up {time.monotonic() - t_start:.1f} s")

    state = record.RunState(cfg=cfg, lm_cfg=lm_cfg, corpus_facts=corpus.facts, order_sha256=sampler.order_sha256,
                            members=[m.spec | {"attention": m.choice.label} for m in members],
                            tensor_names=diag.tensor_names(members[0].model),
                            tensor_numel=[p.numel() for p in members[0].model.parameters()],
                            versions=_versions(device))
    if cfg.time_attention:
        shape = (cfg.batch_size, cfg.n_head, cfg.context, lm_cfg.head_dim)
        for m in members:
            m.timing = diag.time_attention(m.choice, shape, device)
            state.attention_timing[m.label] = m.timing
    out_path = out_dir / record.record_name(cfg)

    def snapshot(step):
        state.snapshot_steps.append(step)
        state.sketches.append([diag.weight_sketches(m.model, cfg.sketch_size) for m in members])
        state.weight_l2.append([diag.weight_l2(m.model) for m in members])
        if len(members) == 2:
            state.pair_drift.append(diag.exact_drift(members[0].model, members[1].model))

    def log_row(step, interval_s, interval_steps, do_eval):
        state.steps.append(step)
        state.elapsed_s.append(time.monotonic() - t_start)
        state.lr.append(learning_rate(cfg, max(step - 1, 0)))
        state.step_time_s.append(interval_s / interval_steps if interval_steps else math.nan)
        for m in members:
            row = state.member_rows.setdefault(m.label, {})
            mean_loss = (m.loss_sum / m.loss_count).item() if m.loss_count else math.nan
            m.loss_count_logged = m.loss_count
            m.loss_sum.zero_()
            m.loss_count = 0
            row.setdefault("loss", []).append(mean_loss)
            if m.loss_count_logged and not math.isfinite(mean_loss) and m.nonfinite_step < 0:
                m.nonfinite_step = step
            state.nonfinite_step[m.label] = m.nonfinite_step
            layers = state.member_layers.setdefault(m.label, {})
            if m.nonfinite_step < 0:
                _diagnose(m, diag_batch, layers)
            else:  # a model with non-finite weights: nothing to diagnose
                for key in diag.LAYER_STATS + diag.DIAG_ERRORS:
                    layers.setdefault(key, []).append([math.nan] * cfg.n_layer)
            row.setdefault("val_loss", []).append(validation_loss(m.model, sampler, cfg.batch_size)
                                                  if do_eval and m.nonfinite_step < 0 else math.nan)

    # -- step 0: the initial model --
    nan_norms = ([math.nan] * cfg.n_layer, [math.nan] * cfg.n_layer, math.nan)
    state.grad_norms.append({m.label: nan_norms for m in members})
    t_final = time.monotonic()
    log_row(0, math.nan, 0, True)
    snapshot(0)
    record.write(state, out_path)
    # what the end costs (a last row with diagnostics and evaluation, a snapshot, the record), with a margin
    final_cost = 1.5 * (time.monotonic() - t_final) + 5.0

    timer = Timer(device)
    interval_start, interval_steps, step_s, done = timer.mark(), 0, math.nan, 0
    stop_reason = "steps"
    for step in range(cfg.steps):
        elapsed = time.monotonic() - t_start
        if elapsed + final_cost + 2 * (step_s if math.isfinite(step_s) else 0) > cfg.budget_s:
            stop_reason = "budget"
            break
        lr = learning_rate(cfg, step)
        x, y = sampler.batch(step)
        is_log = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps
        norms = {}
        for m in members:
            if m.nonfinite_step >= 0:
                continue
            for group in m.opt.param_groups:
                group["lr"] = lr
            _, loss = m.model(x, y)
            if m.scaler is None:
                loss.backward()
            else:
                m.scaler.scale(loss).backward()
                m.scaler.unscale_(m.opt)
            if is_log:
                norms[m.label] = diag.layer_grad_norms(m.model)
            if cfg.clip:
                torch.nn.utils.clip_grad_norm_(m.model.parameters(), cfg.clip)
            if m.scaler is None:
                m.opt.step()
            else:
                m.scaler.step(m.opt)  # skipped when the unscaled gradients hold inf/NaN
                m.scaler.update()
            m.opt.zero_grad(set_to_none=True)
            m.loss_sum += loss.detach()
            m.loss_count += 1
        interval_steps += 1
        done = step + 1
        early = cfg.snapshot_early and done < cfg.snapshot_every and done % cfg.snapshot_early == 0
        if not is_log:
            if early:
                snapshot(done)
            continue
        interval_s = timer.seconds(interval_start, timer.mark())
        step_s = interval_s / interval_steps
        state.grad_norms.append({m.label: norms.get(m.label, nan_norms) for m in members})
        do_eval = done % cfg.eval_every == 0
        log_row(done, interval_s, interval_steps, do_eval)
        if done % cfg.snapshot_every == 0 or early:
            snapshot(done)
        tok_s = interval_steps * cfg.batch_size * cfg.context * len(members) / interval_s
        losses = ", ".join(f"{m.label} {state.member_rows[m.label]['loss'][-1]:.4f}" for m in members)
        progress(f"[lm] step {done}: loss {losses}; {step_s * 1e3:.1f} ms/step, {tok_s / 1e3:.0f} k tok/s, "
                 f"elapsed {time.monotonic() - t_start:.0f} s")
        interval_start, interval_steps = timer.mark(), 0
        if do_eval:
            record.write(state, out_path)
        if all(m.nonfinite_step >= 0 for m in members):
            stop_reason = "nonfinite"
            break

    # -- the end: a last row for the steps since the last one, and a final evaluation --
    if interval_steps:
        interval_s = timer.seconds(interval_start, timer.mark())
        state.grad_norms.append({m.label: nan_norms for m in members})
        log_row(done, interval_s, interval_steps, True)
    else:
        for m in members:
            if m.nonfinite_step < 0 and not math.isfinite(state.member_rows[m.label]["val_loss"][-1]):
                state.member_rows[m.label]["val_loss"][-1] = validation_loss(m.model, sampler, cfg.batch_size)
    if state.snapshot_steps[-1] != state.steps[-1]:
        snapshot(state.steps[-1])
    state.stop_reason = stop_reason
    state.wall_s = time.monotonic() - t_start
    path = record.write(state, out_path)
    progress(f"[lm] stopped ({stop_reason}) at step {state.steps[-1]} after {state.wall_s:.0f} s; record {path} "
             f"({path.stat().st_size / 2 ** 20:.2f} MiB)")
    return path
