"""One training run per command: a byte-level LM on the stdlib corpus, within a wall-clock budget.

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

import dataclasses
import math
import time
from pathlib import Path

import torch

from .. import ncio
from ..timing import Timer
from . import diag
from .corpus import PARTS, BatchSampler, Corpus
from .gpt import LM, AttentionChoice, LMConfig

SCHEDULES = ("constant", "cosine")
AMPS = ("bf16", "fp16", "off")


@dataclasses.dataclass
class TrainConfig:
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


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """The rate of optimiser step ``step`` (0-based): linear warm-up, then constant or cosine."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


class Member:
    """One model of the run, its optimiser and its logged series."""

    def __init__(self, spec: dict, cfg: TrainConfig, lm_cfg: LMConfig, device):
        self.label, self.spec = spec["member"], spec
        self.choice = AttentionChoice.parse(spec["kernel"], _attention_default(spec["amp"]))
        self.model = LM(lm_cfg, self.choice, seed=spec["seed"], amp=spec["amp"]).to(device)
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
def evaluate(model, sampler: BatchSampler, batch_size: int) -> float:
    total, count = 0.0, 0
    for x, y in sampler.val_batches(batch_size):
        _, loss = model(x, y)
        total += loss.item() * x.shape[0]
        count += x.shape[0]
    return total / count


def train(cfg: TrainConfig, out_dir, *, t_start: float | None = None, progress=print) -> Path:
    """Run; returns the record's path (``<out_dir>/<record name>.nc``)."""
    from . import record

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
    lm_cfg = LMConfig(cfg.n_layer, cfg.n_head, cfg.d_model, cfg.context)
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
            row.setdefault("val_loss", []).append(evaluate(m.model, sampler, cfg.batch_size)
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
                state.member_rows[m.label]["val_loss"][-1] = evaluate(m.model, sampler, cfg.batch_size)
    if state.snapshot_steps[-1] != state.steps[-1]:
        snapshot(state.steps[-1])
    state.stop_reason = stop_reason
    state.wall_s = time.monotonic() - t_start
    path = record.write(state, out_path)
    progress(f"[lm] stopped ({stop_reason}) at step {state.steps[-1]} after {state.wall_s:.0f} s; record {path} "
             f"({path.stat().st_size / 2 ** 20:.2f} MiB)")
    return path
