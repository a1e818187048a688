"""The measurements of study 03 (Golden et al., arXiv 2405.02803, Sec. V): the runs of every pair trained
on the CPU (``drift_experiment``), Golden et al.'s per-attention-call comparison on their checkpoints
(``per_call_deviation``), and the GPU training records of the ``gpu_training`` tier gathered
(``gpu_training_dataset``).

This is the one module of the study that imports the trainer, the model and the GPU record format
(``attnum.model``, ``attnum.train``, ``attnum.train.record``).

The pairs (``pair_runs``):

    repeat             the same configuration trained twice: must be 0 at every step
    flash              flash emulator vs reference attention, both under ``kernel_policy``
                       (the kernel's effect; the rest of the model in fp32)
    flash_fp32         the same with both kernels in fp32
    flash_bf16         the same with both kernels under fa2_bf16 (whatever ``kernel_policy`` is): the
                       precision-matched partner of bf16_training
    flash_fp16         the same under fa2_fp16: the precision-matched partner of fp16_training
    init_seed          two initialisation seeds (the noise floor)
    init_perturbation  the same seed, every initial weight plus ``perturbation`` * N(0, 1)
                       (a chaos baseline: how fast a tiny deviation grows)
    bf16_training      torch.autocast bf16 and reference attention under fa2_bf16, vs fp32
    fp16_training      the same in fp16 (with a gradient scaler), vs fp32

Runs shared between pairs are trained once per seed: the fp32 reference run is side a of
``repeat``, ``flash_fp32``, ``init_seed``, ``init_perturbation`` and both training pairs.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch
import xarray as xr

from ... import drift
from ...kernels import get as get_kernel
from ...kernels import model_kernel
from ...train import record
from ...model import GPTConfig
from ...progress import tqdm
from ...train import Task
from ...train import ATTRS as TRAIN_ATTRS
from ...train import TrainConfig, load_checkpoint, train
from . import (FLASH_PAIRS, GPU_COMPARISONS, GPU_DESCRIPTIONS, GPU_LOW_PRECISION, GPU_METRICS, GPU_PATTERN,
               GPU_PREFIX, PAIRS)
from .aggregates import (_interpolated_within, _interval, _paired_ratio, attention_correlations, drift_ratios,
                         gpu_comparison, summarize)
ATTRS = {
    "pair_run_a": ("1", "the pair's reference run (side a)"),
    "pair_run_b": ("1", "the pair's changed run (side b)"),
    "pair_description": ("1", "what the two runs of the pair differ in"),
    "run_attention": ("1", "attention kernel of every layer of the run (registry name)"),
    "run_autocast": ("1", "torch.autocast format of everything but the attention kernel (none: fp32)"),
    "run_seed_offset": ("1", "offset added to the initialisation seed"),
    "run_perturbation": ("1", "standard deviation of the perturbation added to every initial weight"),
    "drift_ratio": ("1", "geometric mean over seeds of the model-level drift ratio numerator pair / denominator pair"),
    "drift_ratio_low": ("1", "lower end of the confidence interval of the drift ratio (t interval on log ratios over seeds)"),
    "drift_ratio_high": ("1", "upper end of the confidence interval of the drift ratio (t interval on log ratios over seeds)"),
    "drift_ratio_per_seed": ("1", "model-level drift ratio numerator pair / denominator pair of one seed"),
    "corr_layer_rank": ("1", "mean over (seed, step) of the Spearman correlation across layers between the "
                             "pair's per-layer drift and the run's attention statistic"),
    "corr_pooled": ("1", "Spearman correlation over every (seed, step > 0, layer) between the pair's per-layer "
                         "drift and the run's attention statistic"),
    "call_max_abs": ("1", "max |O_flash - O_reference| of one layer's attention call in the flash-trained model "
                          "at a checkpoint (its own q, k, v on that step's batch; both kernels under the pair's policy)"),
    "call_rel_l2": ("1", "||O_flash - O_reference|| / ||O_reference|| of that attention call"),
    "call_flash_err": ("1", "max |O_flash - O_fp64| of that attention call (fp64 golden value on the same q, k, v)"),
    "call_reference_err": ("1", "max |O_reference - O_fp64| of that attention call"),
    "call_run": ("1", "the flash-trained run whose attention calls are compared (side b of the flash pair)"),
}
for _metric, (_units, _long) in drift.ATTRS.items():
    ATTRS[f"kind_{_metric}"] = (_units, _long + ", aggregated per kind of tensor")
    ATTRS[f"layer_{_metric}"] = (_units, _long + ", aggregated over the tensors of a transformer block")
    ATTRS[f"model_{_metric}"] = (_units, _long + ", aggregated over every tensor of the model")
    ATTRS[f"model_{_metric}_rate"] = ("1/step", f"rate of change per optimizer step of model-level {_metric} "
                                                "since the previous checkpoint")


GPU_ATTRS = {
    "gpu_comparison_of_run": ("1", "what the pair record's two members differ in (GPU_DESCRIPTIONS)"),
    "gpu_model_wasserstein": ("1", "exact Wasserstein-1 drift b vs a, element-weighted mean over every tensor"),
    "gpu_model_wasserstein_rel": ("1", "model-level W1 drift over the RMS of member a's weights"),
    "gpu_model_rel_l2": ("1", "model-level ||b - a|| / ||a|| over every tensor"),
    "gpu_model_max_abs": ("1", "largest |b - a| over every weight"),
    "gpu_kind_wasserstein": ("1", "exact W1 drift b vs a, element-weighted mean over the tensors of a kind"),
    "gpu_kind_wasserstein_rel": ("1", "W1 drift of a kind of tensor over the RMS of member a's weights of that kind"),
    "gpu_layer_wasserstein": ("1", "exact W1 drift b vs a, element-weighted mean over a block's tensors"),
    "gpu_layer_wasserstein_rel": ("1", "W1 drift of a block over the RMS of member a's weights of that block"),
    "gpu_drift": ("1", "model-level drift of the comparison: geometric mean over its records (seeds)"),
    "gpu_drift_low": ("1", "lower end of the t interval (on logs) over seeds of the model-level drift (NaN: < 2 seeds)"),
    "gpu_drift_high": ("1", "upper end of the t interval (on logs) over seeds of the model-level drift"),
    "gpu_n_seeds": ("1", "records (seeds) of the comparison with a drift at the snapshot"),
    "gpu_ratio": ("1", "low-precision training drift / flash_vs_fp32 drift (geometric mean over seeds; the flash "
                       "drift interpolated linearly in step to the low-precision snapshots)"),
    "gpu_ratio_low": ("1", "lower end of the t interval over seeds of the ratio (NaN: < 2 seeds)"),
    "gpu_ratio_high": ("1", "upper end of the t interval over seeds of the ratio"),
    "gpu_ratio_n_seeds": ("1", "low-precision seeds with a drift at the snapshot (the ratio's sample)"),
    "gpu_ratio_paired": ("1", "low-precision training drift / the drift of the flash_vs_fp32 record with the same init "
                              "and data seeds, geometric mean over those seed pairs"),
    "gpu_ratio_paired_low": ("1", "lower end of the t interval over seed pairs of the paired ratio (NaN: < 2 pairs)"),
    "gpu_ratio_paired_high": ("1", "upper end of the t interval over seed pairs of the paired ratio"),
    "gpu_ratio_paired_n_seeds": ("1", "seed pairs (a low-precision record and its flash partner) at the snapshot"),
    "campaign_gpu_s": ("s", "GPU time of the gathered records: the sum of their wall_s (whole command from "
                            "process start)"),
    "campaign_all_gpu_s": ("s", "GPU time of every record in the folder (both studies' runs and the pilot): the sum "
                                "of their wall_s"),
}



@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training configuration, relative to the experiment's common settings."""

    attention: str = "reference:fp32"
    autocast: str = "none"
    seed_offset: int = 0
    perturbation: float = 0.0
    repeat: int = 0  # a second copy of an otherwise identical run (trained again, not reused)


def pair_runs(*, kernel_policy: str, perturbation: float, noise_seed_offset: int) -> dict[str, tuple[str, str, str]]:
    """Pair name -> (run a, run b, description) and the runs themselves (``run_specs``)."""
    kp = kernel_policy
    return {
        "repeat": ("reference_fp32", "reference_fp32_repeat", "the same configuration trained twice"),
        "flash": (f"reference_{kp}", f"flash_{kp}", f"flash emulator vs reference attention, both {kp}"),
        "flash_fp32": ("reference_fp32", "flash_fp32", "flash emulator vs reference attention, both fp32"),
        "flash_bf16": ("reference_fa2_bf16", "flash_fa2_bf16", "flash emulator vs reference attention, both fa2_bf16"),
        "flash_fp16": ("reference_fa2_fp16", "flash_fa2_fp16", "flash emulator vs reference attention, both fa2_fp16"),
        "init_seed": ("reference_fp32", "reference_fp32_other_seed",
                      f"initialisation seed s vs s + {noise_seed_offset} (noise floor)"),
        "init_perturbation": ("reference_fp32", "reference_fp32_perturbed",
                              f"initial weights plus {perturbation:g} * N(0, 1) (chaos baseline)"),
        "bf16_training": ("reference_fp32", "bf16_training", "autocast bf16 + attention fa2_bf16 vs fp32"),
        "fp16_training": ("reference_fp32", "fp16_training", "autocast fp16 + attention fa2_fp16 vs fp32"),
    }


def run_specs(*, kernel_policy: str, perturbation: float, noise_seed_offset: int) -> dict[str, RunSpec]:
    """Run name -> configuration, for every run any pair names."""
    return {
        "reference_fp32": RunSpec("reference:fp32"),
        "reference_fp32_repeat": RunSpec("reference:fp32", repeat=1),
        f"reference_{kernel_policy}": RunSpec(f"reference:{kernel_policy}"),
        f"flash_{kernel_policy}": RunSpec(f"emulator:{kernel_policy}"),
        "flash_fp32": RunSpec("emulator:fp32"),
        "reference_fa2_bf16": RunSpec("reference:fa2_bf16"),
        "flash_fa2_bf16": RunSpec("emulator:fa2_bf16"),
        "reference_fa2_fp16": RunSpec("reference:fa2_fp16"),
        "flash_fa2_fp16": RunSpec("emulator:fa2_fp16"),
        "reference_fp32_other_seed": RunSpec("reference:fp32", seed_offset=noise_seed_offset),
        "reference_fp32_perturbed": RunSpec("reference:fp32", perturbation=perturbation),
        "bf16_training": RunSpec("reference:fa2_bf16", autocast="bf16"),
        "fp16_training": RunSpec("reference:fa2_fp16", autocast="fp16"),
    }


def runs_needed(pairs, **kw) -> list[str]:
    """The distinct runs the pairs need per seed, in a fixed order (shared runs once)."""
    table = pair_runs(**kw)
    unknown = [p for p in pairs if p not in table]
    if unknown:
        raise ValueError(f"unknown pair(s) {unknown}; allowed: {list(PAIRS)}")
    names = []
    for p in pairs:
        for run in table[p][:2]:
            if run not in names:
                names.append(run)
    return names


def _train_config(base: TrainConfig, spec: RunSpec, seed: int) -> TrainConfig:
    return dataclasses.replace(base, seed=seed + spec.seed_offset, init_perturbation=spec.perturbation,
                               perturbation_seed=seed + 1_000_003, autocast=spec.autocast)

def drift_experiment(task: Task, model_cfg: GPTConfig, train_cfg: TrainConfig, pairs, seeds, *,
                     kernel_policy: str, perturbation: float, noise_seed_offset: int, model_block: int,
                     confidence: float, device: str, progress: bool = True) -> xr.Dataset:
    """Train every run each seed needs, measure every pair's drift at the checkpoints, aggregate."""
    kw = dict(kernel_policy=kernel_policy, perturbation=perturbation, noise_seed_offset=noise_seed_offset)
    table, specs = pair_runs(**kw), run_specs(**kw)
    runs = runs_needed(pairs, **kw)
    steps = list(train_cfg.checkpoint_steps)
    per_seed, records, calls = [], [], []
    bar = tqdm(total=len(seeds) * len(runs), desc="training runs", disable=not progress)
    for seed in seeds:
        results = {}
        for name in runs:
            spec = specs[name]
            impl = model_kernel(spec.attention, block=model_block)
            cfg = GPTConfig(**{**model_cfg.__dict__, "attention": (impl,)})
            res = train(_train_config(train_cfg, spec, seed), task, cfg, device=device, progress=False)
            if res.diverged_at is not None:
                raise RuntimeError(f"run {name} (seed {seed}) diverged at step {res.diverged_at}")
            results[name] = res
            records.append(res.records.expand_dims(run=[name], seed=[seed]))
            bar.update()
        per_seed.append(xr.concat([drift.checkpoint_drift(results[table[p][0]].checkpoints,
                                                          results[table[p][1]].checkpoints, steps)
                                   for p in pairs], dim=xr.DataArray(list(pairs), dims="pair", name="pair"),
                                  coords="minimal").expand_dims(seed=[seed]))
        flash_pairs = [p for p in pairs if p in FLASH_PAIRS]
        if flash_pairs:
            by_run = {}  # pairs sharing a flash-trained run (flash and flash_bf16 under fa2_bf16) share its calls
            for p in flash_pairs:
                if table[p][1] not in by_run:
                    by_run[table[p][1]] = per_call_deviation(
                        model_cfg, results[table[p][1]].checkpoints, specs[table[p][1]].attention,
                        specs[table[p][0]].attention, task, train_cfg.batch_size, model_block=model_block,
                        device=device)
            calls.append(xr.concat([by_run[table[p][1]] for p in flash_pairs],
                                   dim=xr.DataArray(flash_pairs, dims="call_pair", name="call_pair"),
                                   coords="minimal").expand_dims(seed=[seed]))
        del results  # checkpoints of one seed at a time
    bar.close()
    ds = xr.concat(per_seed, dim="seed", coords="minimal").transpose("pair", "seed", "step", "tensor")
    ds = summarize(ds)
    ds = xr.merge([ds, training_records(records), drift_ratios(ds, confidence=confidence)], compat="no_conflicts")
    ds["pair_run_a"] = ("pair", [table[p][0] for p in pairs])
    ds["pair_run_b"] = ("pair", [table[p][1] for p in pairs])
    ds["pair_description"] = ("pair", [table[p][2] for p in pairs])
    ds["run_attention"] = ("run", [model_kernel(specs[r].attention, block=model_block).name for r in ds["run"].values])
    ds["run_autocast"] = ("run", [specs[r].autocast for r in ds["run"].values])
    ds["run_seed_offset"] = ("run", [specs[r].seed_offset for r in ds["run"].values])
    ds["run_perturbation"] = ("run", [specs[r].perturbation for r in ds["run"].values])
    ds = xr.merge([ds, attention_correlations(ds)], compat="no_conflicts")
    if calls:
        call_ds = xr.concat(calls, dim="seed", coords="minimal").transpose("call_pair", "seed", "step", "layer")
        call_ds["call_run"] = ("call_pair", [table[str(p)][1] for p in call_ds["call_pair"].values])
        ds = xr.merge([ds, call_ds], compat="no_conflicts")
    return ds


def per_call_deviation(model_cfg: GPTConfig, checkpoints: dict, flash: str, reference: str, task: Task,
                       batch_size: int, *, model_block: int, device: str) -> xr.Dataset:
    """Golden et al.'s comparison at each attention call, at every checkpoint of a flash-trained run.

    The model with the checkpoint's weights and ``flash`` attention runs the batch of that step (the
    batch training would read next) without gradients; every layer's attention call stores its q, k,
    v and output. The output is compared with the ``reference`` kernel and the fp64 golden value on
    the same q, k, v (causal, the model's scale): dims (step, layer). The comparison changes nothing
    in training: it reads stored checkpoints.
    """
    flash_k = model_kernel(flash, block=model_block)
    ref_k = model_kernel(reference, block=model_block)
    gold_k = get_kernel("golden")
    cfg = GPTConfig(**{**model_cfg.__dict__, "attention": (flash_k,)})
    steps = sorted(checkpoints)
    names = ("call_max_abs", "call_rel_l2", "call_flash_err", "call_reference_err")
    values = {name: np.full((len(steps), model_cfg.n_layer), np.nan) for name in names}
    for i, step in enumerate(steps):
        model = load_checkpoint(cfg, checkpoints[step], device)
        attns = [attn.attention for attn in model.attention_modules()]
        for attn in attns:
            attn.capture = {}
        inputs, _ = task.batch(step, batch_size, device)
        with torch.no_grad():
            model(inputs)
            for layer, attn in enumerate(attns):
                cap = attn.capture
                q, k, v, out = cap["q"], cap["k"], cap["v"], cap["out"].double()
                kw = dict(causal=cap["causal"], scale=cap["scale"])
                ref = ref_k.forward(q, k, v, **kw)[0].double()
                gold = gold_k.forward(q, k, v, **kw)[0].double()
                diff = out - ref
                values["call_max_abs"][i, layer] = diff.abs().max().item()
                values["call_rel_l2"][i, layer] = (torch.linalg.vector_norm(diff)
                                                   / torch.linalg.vector_norm(ref).clamp_min(1e-300)).item()
                values["call_flash_err"][i, layer] = (out - gold).abs().max().item()
                values["call_reference_err"][i, layer] = (ref - gold).abs().max().item()
        for attn in attns:
            attn.capture = None
    return xr.Dataset({name: (("step", "layer"), vals) for name, vals in values.items()},
                      coords={"step": steps, "layer": np.arange(model_cfg.n_layer)})

def training_records(records: list[xr.Dataset]) -> xr.Dataset:
    """The trainer's records of every run and seed (dims run, seed, train_step[, layer])."""
    ds = xr.combine_by_coords(records, combine_attrs="drop_conflicts").rename(step="train_step")
    ds = ds.rename({name: f"train_{name}" for name in ds.data_vars})
    return ds


VARIABLES = {**ATTRS, **drift.ATTRS, **{f"train_{k}": v for k, v in TRAIN_ATTRS.items()},
             "seed": ("1", "initialisation seed of the pair's reference run"),
             "call_pair": ("1", "flash pair whose flash-trained run's attention calls are compared"),
             "train_step": ("1", "optimizer updates before the recorded forward and backward")}
"""CF units and long_name of every variable the study writes (applied by ``ncio.write_results``)."""


def check_gpu_records(folder):
    """The records folder, or a FileNotFoundError naming what is missing (before any work)."""
    return record.require_records(folder, GPU_PATTERN, record.campaign_runs(GPU_PREFIX),
                                  "for study 03 (wasserstein_weight_drift)")


def gpu_training_dataset(folder, *, confidence: float) -> xr.Dataset:
    """This study's GPU pair records under ``folder`` gathered (``attnum.train.record.gather``), each
    pair's exact drift per tensor (``pair_w1``...), per kind, per layer and over the model at its
    snapshots (``record.pair_drift`` and ``attnum.drift.aggregate``); per comparison the drift's
    geometric mean over seeds with a t interval (``gpu_drift*``); the low-precision/flash ratio
    (``gpu_ratio*``); the records' provenance (``prov_*``) and the campaign's GPU time."""
    folder = check_gpu_records(folder)
    gathered = record.gather(folder, GPU_PATTERN)
    pairs = [str(r) for r in gathered["run"].values if int(gathered["run_pair"].sel(run=r)) == 1]
    if not pairs:
        raise FileNotFoundError(f"the records {GPU_PATTERN} under {folder} hold no pair (two-member) record")
    gathered = gathered.sel(run=pairs)
    keep = ["loss", "val_loss", "grad_norm_total", "key_mean_ratio", "max_logit", "dq_rel_err", "pair_w1", "pair_max_abs",
            "pair_rel_l2", "weight_l2", "tokens_per_s", "tokens_done", "steps_done", "wall_s", "attention_share"]
    out = gathered[[k for k in keep if k in gathered]]
    out = out.drop_dims([d for d in ("sketch",) if d in out.dims], errors="ignore")
    snaps = gathered["snapshot"].values
    comps = [gpu_comparison(gathered.sel(run=r)) for r in pairs]
    out = out.assign_coords(gpu_comparison_of_run=("run", comps))
    parts = {"model": [], "kind": [], "layer": []}
    for run in pairs:
        exact = record.pair_drift(gathered.sel(run=run))
        for by in parts:
            agg = drift.aggregate(exact, by).reindex(snapshot=snaps)
            parts[by].append(agg)
    for by, items in parts.items():
        agg = xr.concat(items, dim="run").assign_coords(run=pairs)
        for metric in (("wasserstein", "wasserstein_rel", "rel_l2", "max_abs") if by == "model"
                       else ("wasserstein", "wasserstein_rel")):
            out[f"gpu_{by}_{metric}"] = agg[metric]
    present = [c for c in GPU_COMPARISONS if c in comps] + sorted(set(comps) - set(GPU_COMPARISONS))
    shape = (len(present), len(GPU_METRICS), len(snaps))
    centre, low, high, count = (np.full(shape, np.nan) for _ in range(4))
    for i, comp in enumerate(present):
        runs = [r for r, c in zip(pairs, comps) if c == comp]
        for j, metric in enumerate(GPU_METRICS):
            vals = out[f"gpu_model_{metric}"].sel(run=runs).values
            for k in range(len(snaps)):
                centre[i, j, k], low[i, j, k], high[i, j, k], count[i, j, k] = _interval(vals[:, k], confidence)
    dims = ("gpu_comparison", "gpu_metric", "snapshot")
    coords = {"gpu_comparison": present, "gpu_metric": list(GPU_METRICS)}
    for name, arr in (("gpu_drift", centre), ("gpu_drift_low", low), ("gpu_drift_high", high),
                      ("gpu_n_seeds", count)):
        out[name] = xr.DataArray(arr, dims=dims, coords=coords)
    out["gpu_comparison_description"] = ("gpu_comparison", [GPU_DESCRIPTIONS.get(c, c) for c in present])
    out["gpu_comparison_description"].attrs.update(units="1", long_name="what the comparison's two members differ in")
    lows = [c for c in GPU_LOW_PRECISION if c in present]
    flash_runs = [r for r, c in zip(pairs, comps) if c == "flash_vs_fp32"]
    if lows and flash_runs:
        shape = (len(lows), len(GPU_METRICS), len(snaps))
        ratio, rlow, rhigh, rcount = (np.full(shape, np.nan) for _ in range(4))
        for j, metric in enumerate(GPU_METRICS):
            # the flash drift's geometric mean over seeds at its own snapshots, interpolated in step
            flash = np.array([_interval(out[f"gpu_model_{metric}"].sel(run=flash_runs).values[:, k], confidence)[0]
                              for k in range(len(snaps))])
            denom = _interpolated_within(snaps, flash)
            for i, comp in enumerate(lows):
                runs = [r for r, c in zip(pairs, comps) if c == comp]
                vals = out[f"gpu_model_{metric}"].sel(run=runs).values
                for k in np.nonzero(np.isfinite(denom))[0]:
                    ratio[i, j, k], rlow[i, j, k], rhigh[i, j, k], rcount[i, j, k] = _interval(vals[:, k] / denom[k],
                                                                                               confidence)
        paired = _paired_ratio(out, gathered, lows, flash_runs, pairs, comps, confidence)
        coords = {"gpu_lowprec": lows, "gpu_metric": list(GPU_METRICS)}
        for name, arr in (("gpu_ratio", ratio), ("gpu_ratio_low", rlow), ("gpu_ratio_high", rhigh),
                          ("gpu_ratio_n_seeds", rcount), *zip(("gpu_ratio_paired", "gpu_ratio_paired_low",
                                                               "gpu_ratio_paired_high", "gpu_ratio_paired_n_seeds"),
                                                              paired)):
            out[name] = xr.DataArray(arr, dims=("gpu_lowprec", "gpu_metric", "snapshot"), coords=coords)
    out["campaign_gpu_s"] = float(gathered["wall_s"].sum())
    out["campaign_all_gpu_s"], out.attrs["records_in_folder"] = record.total_wall_s(folder)
    out = out.assign_coords(record.provenance(folder, GPU_PATTERN).sel(run=pairs).coords)
    out.attrs["records_folder"] = str(folder)
    out.attrs["records"] = json.dumps(pairs)
    out.attrs["missing_runs"] = json.dumps(record.missing_runs(folder, record.campaign_runs(GPU_PREFIX)))
    out.attrs["confidence"] = confidence
    for name, (units, long_name) in GPU_ATTRS.items():
        if name in out:
            out[name].attrs.update(units=units, long_name=long_name)
    return out



def measure(task: Task, model_cfg: GPTConfig, train_cfg: TrainConfig, pairs, seeds, *, gpu_records: str,
            confidence: float, **training) -> xr.Dataset:
    """The run's dataset, from where its tier takes it: with ``gpu_records`` set (the ``gpu_training``
    tier) the GPU pair records of that folder gathered (``gpu_training_dataset``; nothing is trained),
    otherwise every pair trained here (``drift_experiment``, ``training`` its keyword arguments). The
    dataset's ``headline_figure`` attribute names the figure that shows its data."""
    if gpu_records:
        ds = gpu_training_dataset(gpu_records, confidence=confidence)
        ds.attrs["headline_figure"] = "gpu_drift.png"
    else:
        ds = drift_experiment(task, model_cfg, train_cfg, pairs, seeds, confidence=confidence, **training)
        ds.attrs["headline_figure"] = "drift_over_training.png"
    return ds
