"""Train the small GPT on a synthetic task, recording what seed 004 says to watch.

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
on one machine's CPU (``tests/test_training.py``). On CUDA some backward kernels
(the embedding's, for one) accumulate with atomics, so bitwise identity is not
claimed there. Runs that differ in one thing (the
attention implementation of a layer, ``init_perturbation``) share everything else.

Step convention: the checkpoint of step s holds the weights after s updates; the
record of step s is the forward and backward computed with those weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
import xarray as xr
from .progress import tqdm

from .diagnostics import recompute_backward_fp32
from .kernels import as_kernel
from .precision import FORMATS
from .model import GPT, GPTConfig, grad_norms, perturb_weights
from .tasks import IGNORE, Task

AUTOCAST = {"none": None, "bf16": FORMATS["bf16"], "fp16": FORMATS["fp16"]}
"""``TrainConfig.autocast``: the low format of torch.autocast (the precision policy's formats)."""
LAYER_RECORDS = ("grad_norm", "grad_norm_qk", "max_logit", "entropy", "key_mean_norm", "key_norm",
                 "key_mean_ratio")
STEP_RECORDS = ("loss", "accuracy", "lr", "grad_norm_total")

ATTRS = {
    "loss": ("nat", "training cross-entropy on the scored positions"),
    "accuracy": ("1", "fraction of scored positions predicted correctly (argmax)"),
    "lr": ("1", "learning rate of the step"),
    "grad_norm_total": ("1", "global gradient norm before clipping"),
    "grad_norm": ("1", "gradient norm of every parameter of the block"),
    "grad_norm_qk": ("1", "gradient norm of the block's query and key projections (weights and biases)"),
    "max_logit": ("1", "largest scaled attention logit q.k/sqrt(d) over batch, heads and rows"),
    "entropy": ("nat", "mean attention entropy per row"),
    "key_mean_norm": ("1", "norm of the mean key ||mean_j k_j|| (mean over batch and heads)"),
    "key_norm": ("1", "mean key norm mean_j ||k_j|| (mean over batch and heads)"),
    "key_mean_ratio": ("1", "||mean_j k_j|| / mean_j ||k_j||"),
}


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


def records_dataset(steps, step_rec: dict, layer_rec: dict, n_layer: int) -> xr.Dataset:
    ds = xr.Dataset({name: ("step", values) for name, values in step_rec.items()},
                    coords={"step": np.asarray(steps), "layer": np.arange(n_layer)})
    for name, values in layer_rec.items():
        ds[name] = (("step", "layer"), values)
    for name in ds.data_vars:
        units, long_name = ATTRS[name]
        ds[name].attrs.update(units=units, long_name=long_name)
    ds["step"].attrs.update(long_name="optimizer updates before this step's forward and backward")
    return ds


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


def record_variables() -> dict[str, tuple[str, str]]:
    """CF units and long_name of training records (``train_*``) and of the FP32-recompute
    diagnostic's records (``diag_*`` at checkpoints, ``live_*`` during training), for the writer."""
    from .diagnostics import ATTRS as DIAG_ATTRS

    table = {f"diag_{k}": v for k, v in DIAG_ATTRS.items()}
    table.update({f"live_{k}": (u, f"{name} (training batch, during training)") for k, (u, name) in DIAG_ATTRS.items()})
    table["live_grad_norm_total"] = ("1", "global gradient norm of the training step the diagnostic ran on")
    table["live_spike"] = ("1", "1 if the diagnostic ran because the gradient norm spiked, else 0 (periodic)")
    table.update({f"train_{k}": v for k, v in ATTRS.items()})
    table["run_attention"] = ("1", "attention kernel of every layer (registry name)")
    return table
