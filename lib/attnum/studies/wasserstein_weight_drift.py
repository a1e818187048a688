"""Study 03: Wasserstein weight drift (Golden et al., arXiv 2405.02803, Sec. V).

Train the small GPT several times from the same initialisation and data order, changing
one thing per *pair* of runs, and measure how far apart the two runs' weights are at every
checkpoint (``attnum.drift``). The pairs (``pair_runs``):

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

``drift_experiment`` trains everything and returns one dataset: per-tensor drift (pair, seed,
step, tensor), its aggregates per kind, per layer and over the model, drift rates, the trainer's
records of every run, and ``drift_ratios``: ratios of one pair's drift to another's with a
confidence interval over seeds (the headline: low-precision training over flash; each training
pair over the flash pair of its own format, ``flash_bf16`` / ``flash_fp16``, as well).

``per_call_deviation`` (Golden et al.'s comparison at each attention call): at every checkpoint
of each flash pair's flash-trained run, the model's own attention inputs (q, k, v of every layer,
on the batch of that step) go through the flash kernel, the reference kernel of the same policy and
the fp64 golden value; the output deviation per layer is recorded beside the weight drift.

``gpu_training_dataset`` (the ``gpu_training`` tier, issue 13): trains nothing; gathers the GPU pair
records of ``attnum.lm`` (``lm_s03_*.nc``, params/lm/campaign.yaml's ``s03_*`` runs), classifies each
pair by its members (``gpu_comparison``), aggregates their exact per-tensor W1 per kind, layer and model,
gives geometric means and t intervals over seeds and the low-precision/flash ratio (``gpu_sentences``). Pairs
bounded by a time budget stop at different steps: they are compared at the snapshots every record of them
shares (``gpu_common_steps``), per kind at the last of those (``gpu_kind_table``), and the repeat pair over the
flash pair at every one (``gpu_ratio_series``, ``gpu_repeat_sentences``).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import xarray as xr
from scipy import stats as sps
from ..progress import tqdm

import torch

from .. import drift
from ..kernels import get as get_kernel
from ..kernels import model_kernel
from ..model import GPTConfig
from ..tasks import Task
from ..training import ATTRS as TRAIN_ATTRS
from ..training import TrainConfig, load_checkpoint, train

PAIRS = ("repeat", "flash", "flash_fp32", "flash_bf16", "flash_fp16", "init_seed", "init_perturbation",
         "bf16_training", "fp16_training")
FLASH_PAIRS = ("flash", "flash_fp32", "flash_bf16", "flash_fp16")
MATCHED = {"bf16_training": "flash_bf16", "fp16_training": "flash_fp16"}
"""Each low-precision training pair and the flash pair whose kernels run in the same format."""
LOW_PRECISION_PAIRS = ("bf16_training", "fp16_training")
DRIFT_METRICS = ("wasserstein", "max_abs", "rel_l2")
STATISTICS = ("max_logit", "entropy", "key_mean_ratio", "grad_norm_qk", "grad_norm")
CORR_METRICS = ("wasserstein_rel", "rel_l2")
GOLDEN_RATIO_RANGE = (2.0, 5.0)  # Golden et al.: flash causes ~2-5x less weight deviation than low precision

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


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training configuration, relative to the experiment's common settings."""

    attention: str = "reference:fp32"
    autocast: str = "none"
    seed_offset: int = 0
    perturbation: float = 0.0
    repeat: int = 0  # a second copy of an otherwise identical run (trained again, not reused)


def pair_runs(kernel_policy: str = "fa2_bf16", perturbation: float = 1e-6,
              noise_seed_offset: int = 1000) -> dict[str, tuple[str, str, str]]:
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


def run_specs(kernel_policy: str = "fa2_bf16", perturbation: float = 1e-6,
              noise_seed_offset: int = 1000) -> dict[str, RunSpec]:
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
                     kernel_policy: str = "fa2_bf16", perturbation: float = 1e-6,
                     noise_seed_offset: int = 1000, model_block: int = 16, confidence: float = 0.95,
                     device="cpu", progress: bool = True) -> xr.Dataset:
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
            res = train(cfg, task, _train_config(train_cfg, spec, seed), device=device, progress=False)
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
                       batch_size: int, *, model_block: int = 16, device="cpu") -> xr.Dataset:
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


def call_table(ds: xr.Dataset, metric: str = "call_max_abs"):
    """Per flash pair and checkpoint: the attention calls' deviation (mean over layers, median over
    seeds) beside the pair's model-level weight drift (max |dw|, median over seeds), and the flash
    kernel's deviation from fp64 over the reference kernel's (median over seeds and layers)."""
    import pandas as pd

    frames = {}
    for pair in ds["call_pair"].values:
        sub = ds.sel(call_pair=pair)
        cols = {f"{metric} (mean over layers)": sub[metric].mean("layer").median("seed").to_series()}
        if pair in ds["pair"].values:
            cols["weight max |dw|"] = ds["model_max_abs"].sel(pair=pair).median("seed").to_series()
            cols["weight rel. L2"] = ds["model_rel_l2"].sel(pair=pair).median("seed").to_series()
        ratio = (sub["call_flash_err"] / sub["call_reference_err"].where(sub["call_reference_err"] > 0))
        cols["flash / reference error vs fp64"] = ratio.median(["seed", "layer"]).to_series()
        frames[str(pair)] = pd.DataFrame(cols)
    return pd.concat(frames, names=["pair", "step"])


def call_statements(ds: xr.Dataset) -> list[str]:
    """Sentences computed from the per-call data: for each flash pair, the attention calls' max
    deviation between the kernels at the first and last checkpoint, whether it grows over training
    (median over seeds, mean over layers), the layer with the larger deviation at the end, and the
    flash kernel's error against fp64 relative to the reference kernel's (Golden et al.'s ~10x at bf16
    in an isolated forward pass)."""
    out, seen = [], {}
    for pair in ds["call_pair"].values:
        run = str(ds["call_run"].sel(call_pair=pair).values)
        if run in seen:
            out.append(f"`{pair}`: the same flash-trained run ({run}) as `{seen[run]}`, same numbers.")
            continue
        seen[run] = str(pair)
        sub = ds.sel(call_pair=pair)
        dev = sub["call_max_abs"].mean("layer").median("seed")
        rel = sub["call_rel_l2"].mean("layer").median("seed")
        first, last = float(dev.isel(step=0)), float(dev.isel(step=-1))
        grows = bool((dev.diff("step") >= 0).all())
        ratio = (sub["call_flash_err"] / sub["call_reference_err"].where(sub["call_reference_err"] > 0))
        r = ratio.median(["seed", "layer"])
        by_layer = sub["call_max_abs"].isel(step=-1).median("seed")
        text = (f"`{pair}` ({ds['call_run'].sel(call_pair=pair).item()}): per-call max |O_flash - O_ref| "
                f"{first:.2e} at step {int(dev['step'][0])} and {last:.2e} at step {int(dev['step'][-1])} (relative L2 "
                f"{float(rel.isel(step=0)):.2e} and {float(rel.isel(step=-1)):.2e}); "
                f"{'non-decreasing at every checkpoint' if grows else 'not monotone over the checkpoints'}; "
                f"largest at the last checkpoint in layer {int(np.argmax(by_layer.values))} "
                f"(layers: {', '.join(f'{v:.2e}' for v in by_layer.values)}); flash kernel's max error against "
                f"fp64 over the reference kernel's: {float(r.min()):.2g} to {float(r.max()):.2g} over checkpoints "
                f"(median over seeds and layers)")
        if pair in ds["pair"].values:
            w = ds["model_max_abs"].sel(pair=pair).median("seed")
            text += (f"; over the same checkpoints the weights' max |dw| went from {float(w.isel(step=0)):.2e} to "
                     f"{float(w.isel(step=-1)):.2e}")
        out.append(text + ".")
    return out


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


# -- aggregates, rates, ratios --------------------------------------------------------------------

def summarize(ds: xr.Dataset) -> xr.Dataset:
    """Add per-kind, per-layer and model-level aggregates and model-level drift rates."""
    out = ds.copy()
    for by in ("kind", "layer", "model"):
        agg = drift.aggregate(ds, by)
        for name in agg.data_vars:
            out[f"{by}_{name}"] = agg[name].transpose("pair", "seed", "step", ...)
    for metric in DRIFT_METRICS:
        out[f"model_{metric}_rate"] = drift_rate(out[f"model_{metric}"])
    return out


def drift_rate(da: xr.DataArray) -> xr.DataArray:
    """Change per optimizer step since the previous checkpoint (NaN at the first)."""
    steps = da["step"].astype(float)
    rate = da.diff("step", label="upper") / steps.diff("step", label="upper")
    return rate.reindex(step=da["step"])


def ratio_interval(ratios: np.ndarray, confidence: float = 0.95) -> tuple[float, float, float]:
    """Geometric mean of positive ratios (last axis) and a t interval on their logs.

    Non-finite or non-positive entries are dropped; fewer than two left: the interval is NaN.
    """
    r = np.asarray(ratios, dtype=float)
    r = r[np.isfinite(r) & (r > 0)]
    if r.size == 0:
        return math.nan, math.nan, math.nan
    logs = np.log(r)
    centre = float(np.exp(logs.mean()))
    if r.size < 2:
        return centre, math.nan, math.nan
    half = sps.t.ppf(0.5 + confidence / 2, r.size - 1) * logs.std(ddof=1) / math.sqrt(r.size)
    return centre, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))


def comparisons(pairs) -> list[tuple[str, str]]:
    """(numerator, denominator) pairs of drift ratios that the present pairs allow."""
    out = []
    for flash in ("flash", "flash_fp32"):
        if flash not in pairs:
            continue
        out += [(low, flash) for low in LOW_PRECISION_PAIRS if low in pairs]
        out += [(flash, base) for base in ("init_seed", "init_perturbation") if base in pairs]
    out += [(low, flash) for low, flash in MATCHED.items() if low in pairs and flash in pairs]
    return out


def drift_ratios(ds: xr.Dataset, confidence: float = 0.95) -> xr.Dataset:
    """Model-level drift ratios numerator / denominator per seed, their geometric mean over seeds
    and its confidence interval, for every comparison the pairs allow (dims comparison, metric, step)."""
    comps = comparisons(list(ds["pair"].values))
    names = [f"{a}/{b}" for a, b in comps]
    shape = (len(comps), len(DRIFT_METRICS), ds.sizes["seed"], ds.sizes["step"])
    per_seed = np.full(shape, np.nan)
    for c, (num, den) in enumerate(comps):
        for m, metric in enumerate(DRIFT_METRICS):
            a = ds[f"model_{metric}"].sel(pair=num).transpose("seed", "step").values
            b = ds[f"model_{metric}"].sel(pair=den).transpose("seed", "step").values
            with np.errstate(divide="ignore", invalid="ignore"):
                per_seed[c, m] = np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)
    summary = np.apply_along_axis(lambda r: ratio_interval(r, confidence), 2, per_seed)  # (c, m, 3, step)
    coords = {"comparison": names, "metric": list(DRIFT_METRICS), "seed": ds["seed"].values, "step": ds["step"].values,
              "comparison_numerator": ("comparison", [a for a, _ in comps]),
              "comparison_denominator": ("comparison", [b for _, b in comps])}
    dims = ("comparison", "metric", "step")
    out = xr.Dataset({"drift_ratio": (dims, summary[:, :, 0]), "drift_ratio_low": (dims, summary[:, :, 1]),
                      "drift_ratio_high": (dims, summary[:, :, 2]),
                      "drift_ratio_per_seed": (("comparison", "metric", "seed", "step"), per_seed)}, coords=coords)
    out.attrs["confidence"] = confidence
    for name in ("drift_ratio_low", "drift_ratio_high"):
        out[name].attrs["confidence"] = confidence
    return out


def first_step_above(ds: xr.Dataset, comparison: str, metric: str = "wasserstein", rule: str = "ci") -> float:
    """The first checkpoint step from which the numerator pair's drift stays above the denominator's
    at every later step. ``rule="ci"``: the interval's lower end is above 1; ``"all_seeds"``: every
    seed's ratio is above 1. NaN when it never does (at the last step at least)."""
    sub = ds.sel(comparison=comparison, metric=metric)
    if rule == "ci":
        above = (sub["drift_ratio_low"] > 1).values
    elif rule == "all_seeds":
        above = (sub["drift_ratio_per_seed"] > 1).all("seed").values
    else:
        raise ValueError(f"rule must be 'ci' or 'all_seeds', not {rule!r}")
    steps = sub["step"].values
    if not above[-1]:
        return math.nan
    below = np.nonzero(~above)[0]
    return float(steps[below[-1] + 1] if below.size else steps[0])


def checks(ds: xr.Dataset) -> dict:
    """Statements the text relies on, computed from the results (True/False, or a number)."""
    later = ds["step"].values > 0
    out = {}
    pairs = [str(p) for p in ds["pair"].values]
    if "repeat" in pairs:
        out["repeat pair exactly 0 at every step, seed and tensor"] = bool(
            all((ds[m].sel(pair="repeat") == 0).all() for m in DRIFT_METRICS))
    moving = [p for p in pairs if p != "repeat"]
    for metric in DRIFT_METRICS:
        d = ds[f"model_{metric}"].isel(step=later)
        if "init_seed" in pairs and len(moving) > 1:
            rest = d.sel(pair=[p for p in moving if p != "init_seed"])
            out[f"{metric}: init_seed largest at every checkpoint and seed"] = bool(
                (d.sel(pair="init_seed") > rest.max("pair")).all())
        if "flash_fp32" in pairs and len(moving) > 1:
            rest = d.sel(pair=[p for p in moving if p != "flash_fp32"]).median("seed")
            out[f"{metric}: flash_fp32 smallest at every checkpoint (median over seeds)"] = bool(
                (d.sel(pair="flash_fp32").median("seed") < rest.min("pair")).all())
        if "flash" in pairs and "init_seed" in pairs:
            out[f"{metric}: flash below init_seed at every checkpoint and seed"] = bool(
                (d.sel(pair="flash") < d.sel(pair="init_seed")).all())
        out[f"{metric}: every pair's drift grows at every checkpoint (median over seeds)"] = bool(
            (d.sel(pair=moving).median("seed").diff("step") >= 0).all())
    last = ds.isel(step=-1)
    for metric in ("rel_l2", "wasserstein_rel"):
        kinds = last[f"kind_{metric}"].median("seed").sel(pair=moving)
        out[f"{metric}: norms the least-drifting kind of every pair at the last checkpoint"] = bool(
            (kinds.argmin("kind") == list(kinds["kind"].values).index("norm")).all())
    for comp in ds["comparison"].values:
        if str(ds["comparison_denominator"].sel(comparison=comp).values) != "flash":
            continue
        r = ds["drift_ratio"].sel(comparison=comp)
        for metric in DRIFT_METRICS:
            vals = r.sel(metric=metric).values[later]
            out[f"{comp} ({metric}): smallest and largest geometric mean over checkpoints"] = (
                f"{np.nanmin(vals):.2f} .. {np.nanmax(vals):.2f}")
    return out


def verdict(low: float, high: float, claim=GOLDEN_RATIO_RANGE) -> str:
    """Where an interval [low, high] lies against a claimed range."""
    lo, hi = claim
    if not (np.isfinite(low) and np.isfinite(high)):
        return "undetermined (too few seeds for an interval)"
    if high < lo:
        return f"below the claimed {lo:g}-{hi:g}x"
    if low > hi:
        return f"above the claimed {lo:g}-{hi:g}x"
    if lo <= low and high <= hi:
        return f"inside the claimed {lo:g}-{hi:g}x"
    return f"overlaps the claimed {lo:g}-{hi:g}x"


# -- drift against the trainer's attention statistics ---------------------------------------------

def _spearman(x, y) -> float:
    """Spearman rank correlation of the finite pairs (two points: the sign agreement, +-1); NaN
    with fewer than two points or a constant side."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 2 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
        return math.nan
    return float(np.corrcoef(sps.rankdata(x[ok]), sps.rankdata(y[ok]))[0, 1])


def layer_statistic(ds: xr.Dataset, run: str, statistic: str) -> xr.DataArray:
    """A run's per-layer training record at the checkpoint steps (the nearest record at or before)."""
    rec = ds[f"train_{statistic}"].sel(run=run)
    return rec.sel(train_step=ds["step"].values, method="pad").rename(train_step="step").assign_coords(
        step=ds["step"].values)


def attention_correlations(ds: xr.Dataset) -> xr.Dataset:
    """Per pair, statistic and drift metric: Spearman correlations between the pair's per-layer drift
    and the statistic recorded by its reference run; within each (seed, step) across layers
    (``corr_layer_rank``, free of the common trend over training) and pooled (``corr_pooled``)."""
    pairs = ds["pair"].values
    rank = np.full((len(pairs), len(STATISTICS), len(CORR_METRICS)), np.nan)
    pooled = np.full_like(rank, np.nan)
    for p, pair in enumerate(pairs):
        run = str(ds["pair_run_a"].sel(pair=pair).values)
        for s, stat in enumerate(STATISTICS):
            x_all = layer_statistic(ds, run, stat).transpose("seed", "step", "layer").values
            for m, metric in enumerate(CORR_METRICS):
                y_all = ds[f"layer_{metric}"].sel(pair=pair).transpose("seed", "step", "layer").values
                later = ds["step"].values > 0
                x, y = x_all[:, later], y_all[:, later]
                pooled[p, s, m] = _spearman(x.ravel(), y.ravel())
                within = [_spearman(x[i, j], y[i, j]) for i in range(x.shape[0]) for j in range(x.shape[1])]
                within = [w for w in within if np.isfinite(w)]
                rank[p, s, m] = float(np.mean(within)) if within else math.nan
    dims = ("pair", "statistic", "corr_metric")
    coords = {"pair": pairs, "statistic": list(STATISTICS), "corr_metric": list(CORR_METRICS)}
    return xr.Dataset({"corr_layer_rank": (dims, rank), "corr_pooled": (dims, pooled)}, coords=coords)


# -- tables ---------------------------------------------------------------------------------------

def final_drift_table(ds: xr.Dataset, step: int | None = None):
    """Model-level drift of every pair at one checkpoint (default the last): median over seeds,
    and the smallest and largest seed."""
    import pandas as pd

    step = int(ds["step"][-1]) if step is None else step
    cols = {}
    for metric in ("wasserstein", "wasserstein_rel", "max_abs", "rel_l2"):
        da = ds[f"model_{metric}"].sel(step=step)
        cols[(metric, "median")] = da.median("seed").values
        cols[(metric, "min")] = da.min("seed").values
        cols[(metric, "max")] = da.max("seed").values
    return pd.DataFrame(cols, index=pd.Index(ds["pair"].values, name=f"pair (step {step})"))


def ratio_table(ds: xr.Dataset, step: int | None = None, claim=GOLDEN_RATIO_RANGE):
    """Every drift ratio at one checkpoint: geometric mean over seeds, its interval, and where the
    interval lies against Golden et al.'s 2-5x (low-precision over flash comparisons only)."""
    import pandas as pd

    step = int(ds["step"][-1]) if step is None else step
    rows = []
    for comp in ds["comparison"].values:
        for metric in ds["metric"].values:
            sel = dict(comparison=comp, metric=metric, step=step)
            low, high = float(ds["drift_ratio_low"].sel(**sel)), float(ds["drift_ratio_high"].sel(**sel))
            lowp = str(ds["comparison_numerator"].sel(comparison=comp).values) in LOW_PRECISION_PAIRS
            rows.append({"comparison": comp, "metric": metric, "ratio": float(ds["drift_ratio"].sel(**sel)),
                         "ci low": low, "ci high": high,
                         "against Golden et al.": verdict(low, high, claim) if lowp else ""})
    return pd.DataFrame(rows).set_index(["comparison", "metric"])


def floor_table(ds: xr.Dataset):
    """For every comparison of a flash pair with a baseline pair: from which checkpoint step on its
    drift stays above the baseline's (interval above 1; every seed above 1), per metric."""
    import pandas as pd

    rows = []
    for comp in ds["comparison"].values:
        if str(ds["comparison_numerator"].sel(comparison=comp).values) in LOW_PRECISION_PAIRS:
            continue
        for metric in ds["metric"].values:
            last = dict(comparison=comp, metric=metric, step=ds["step"][-1])
            rows.append({"comparison": comp, "metric": metric,
                         "ratio at last step": float(ds["drift_ratio"].sel(**last)),
                         "above from step (interval)": first_step_above(ds, comp, metric, "ci"),
                         "above from step (every seed)": first_step_above(ds, comp, metric, "all_seeds")})
    return pd.DataFrame(rows).set_index(["comparison", "metric"])


def correlation_table(ds: xr.Dataset, metric: str = "rel_l2"):
    """Within-step and pooled Spearman correlations of per-layer drift with each statistic."""
    import pandas as pd

    return pd.concat({"across layers, within (seed, step)": ds["corr_layer_rank"].sel(corr_metric=metric).to_pandas(),
                      "pooled over seeds, steps, layers": ds["corr_pooled"].sel(corr_metric=metric).to_pandas()},
                     axis=1)


# -- figures --------------------------------------------------------------------------------------


def group_table(ds: xr.Dataset, by: str = "kind", metric: str = "wasserstein_rel", step: int | None = None):
    """Drift per kind of tensor (or per layer) and pair at one checkpoint, median over seeds."""
    step = int(ds["step"][-1]) if step is None else step
    return ds[f"{by}_{metric}"].sel(step=step).median("seed").to_pandas()


def matched_table(ds: xr.Dataset, step: int | None = None):
    """Low-precision training over the flash pair: against the study's ``flash`` pair (kernels under
    ``kernel_policy``) and against the precision-matched flash pair (``MATCHED``), per metric at one
    checkpoint (default the last): geometric mean over seeds, interval, verdict against 2-5x."""
    import pandas as pd

    table = ratio_table(ds, step)
    keep = [c for c in ds["comparison"].values
            if str(ds["comparison_numerator"].sel(comparison=c).values) in LOW_PRECISION_PAIRS
            and str(ds["comparison_denominator"].sel(comparison=c).values) in ("flash", "flash_bf16", "flash_fp16")]
    return table.loc[pd.IndexSlice[keep, :], :] if keep else table.iloc[:0]


def matched_statements(ds: xr.Dataset) -> list[str]:
    """For each low-precision training pair with its precision-matched flash pair present: the drift
    ratio over the matched pair beside the ratio over the ``flash`` pair, per metric, at the last
    checkpoint (geometric mean over seeds, interval) and its range over the later checkpoints."""
    out = []
    comps = [str(c) for c in ds["comparison"].values]
    later = ds["step"].values > 0
    flash_attn = ""
    if "flash" in ds["pair"].values:
        flash_attn = str(ds["run_attention"].sel(run=str(ds["pair_run_b"].sel(pair="flash").values)).values)
    for low, matched in MATCHED.items():
        new, old = f"{low}/{matched}", f"{low}/flash"
        if new not in comps:
            continue
        if old in comps and np.array_equal(ds["drift_ratio"].sel(comparison=new).values,
                                           ds["drift_ratio"].sel(comparison=old).values, equal_nan=True):
            old = new  # the matched flash pair is the `flash` pair itself (kernel_policy of that format)
            if f"{low}/flash" != new:
                out.append(f"`{low}`: `{matched}` is the `flash` pair itself here (same runs), so the matched "
                           f"ratio is the ratio over `flash` of section 3.")
                continue
        parts = []
        for metric in DRIFT_METRICS:
            def text(comp):
                r = ds.sel(comparison=comp, metric=metric)
                last = r.isel(step=-1)
                vals = r["drift_ratio"].values[later]
                return (f"{float(last['drift_ratio']):.2f} [{float(last['drift_ratio_low']):.2f}, "
                        f"{float(last['drift_ratio_high']):.2f}] at the last step, {np.nanmin(vals):.2f} to "
                        f"{np.nanmax(vals):.2f} over the checkpoints")
            piece = f"{metric}: over `{matched}` {text(new)}"
            if old in comps and old != new:
                piece += f"; over `flash` ({flash_attn}) {text(old)}"
            parts.append(piece)
        out.append(f"`{low}`: " + "; ".join(parts) + ".")
    return out


def conclusion_lines(ds: xr.Dataset) -> list[str]:
    """Short computed lines for the conclusions: the low-precision / flash ratio over the matched and
    the `flash` pair at the last step (geometric means over seeds) per metric, and for each distinct
    flash-trained run the per-call deviation at the first and last checkpoint beside the weights'
    max |dw| at the last."""
    out = []
    comps = [str(c) for c in ds["comparison"].values]
    for low, matched in MATCHED.items():
        new, old = f"{low}/{matched}", f"{low}/flash"
        if new not in comps:
            continue
        last = ds["drift_ratio"].sel(comparison=new).isel(step=-1)
        text = f"`{new}` at the last step: " + ", ".join(
            f"{m} {float(last.sel(metric=m)):.2f}" for m in DRIFT_METRICS)
        if old in comps and not np.array_equal(ds["drift_ratio"].sel(comparison=new).values,
                                               ds["drift_ratio"].sel(comparison=old).values, equal_nan=True):
            prev = ds["drift_ratio"].sel(comparison=old).isel(step=-1)
            text += " (over `flash`: " + ", ".join(f"{m} {float(prev.sel(metric=m)):.2f}" for m in DRIFT_METRICS) + ")"
        out.append(text + ".")
    if "call_max_abs" in ds:
        seen = set()
        for pair in ds["call_pair"].values:
            run = str(ds["call_run"].sel(call_pair=pair).values)
            if run in seen:
                continue
            seen.add(run)
            dev = ds["call_max_abs"].sel(call_pair=pair).mean("layer").median("seed")
            text = (f"`{pair}`: per-call max |O_flash - O_ref| {float(dev.isel(step=0)):.1e} (step "
                    f"{int(dev['step'][0])}) and {float(dev.isel(step=-1)):.1e} (step {int(dev['step'][-1])})")
            if pair in ds["pair"].values:
                w = ds["model_max_abs"].sel(pair=pair).median("seed").isel(step=-1)
                text += f"; weights' max |dw| at the last step {float(w):.1e}"
            out.append(text + ".")
    return out


def precision_contrast(ds: xr.Dataset, base: str = "flash") -> list[str]:
    """How the weight drift follows the per-call deviation across the flash pairs: for every other
    flash pair with a different run, the ratio of ``base``'s per-call relative L2 deviation to its
    (median over seeds, layers and checkpoints) beside the ratio of their model-level weight drift at
    the last checkpoint (median over seeds), per drift metric."""
    if "call_rel_l2" not in ds or base not in ds["call_pair"].values:
        return []
    out = []
    base_run = str(ds["call_run"].sel(call_pair=base).values)
    dev = ds["call_rel_l2"].median(["seed", "layer", "step"])
    for pair in ds["call_pair"].values:
        if str(ds["call_run"].sel(call_pair=pair).values) == base_run or pair not in ds["pair"].values:
            continue
        ratio = float(dev.sel(call_pair=base) / dev.sel(call_pair=pair))
        drifts = ", ".join(
            f"{m} {float(ds[f'model_{m}'].sel(pair=base).isel(step=-1).median('seed') / ds[f'model_{m}'].sel(pair=pair).isel(step=-1).median('seed')):.2g}x"
            for m in DRIFT_METRICS)
        out.append(f"`{base}` over `{pair}`: per-call deviation (relative L2) {ratio:.3g}x; weight drift at the "
                   f"last checkpoint {drifts}.")
    return out


# -- gpu_training tier (issue 13): the GPU training campaign's pair records ------------------------

GPU_PREFIX = "s03_"  # campaign runs of this study (params/lm/campaign.yaml); records lm_s03_*_s<seed>_d<seed>.nc
GPU_PATTERN = f"lm_{GPU_PREFIX}*.nc"
GPU_COMPARISONS = ("flash_vs_fp32", "noise_floor", "gpu_repeat", "bf16_training", "fp16_training")
GPU_LOW_PRECISION = ("bf16_training", "fp16_training")
GPU_METRICS = ("wasserstein", "rel_l2")
GPU_DESCRIPTIONS = {
    "flash_vs_fp32": "member a sdpa:flash (bf16), member b FP32 attention, same init and batches (bf16 autocast)",
    "noise_floor": "the same kernel, a different init seed (the noise floor)",
    "gpu_repeat": "the same everything twice: GPU training's own non-determinism",
    "bf16_training": "member a fp32 training (no autocast, FP32 attention), member b bf16 training",
    "fp16_training": "member a fp32 training, member b fp16 training (loss scaling)",
}
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


def check_gpu_records(folder):
    """The records folder, or a FileNotFoundError naming what is missing (before any work)."""
    from ..lm import record

    return record.require_records(folder, GPU_PATTERN, record.campaign_runs(GPU_PREFIX),
                                  "for study 03 (wasserstein_weight_drift)")


def gpu_comparison(run: xr.Dataset) -> str:
    """What a pair record's members differ in, from its members' attention, autocast and seed."""
    att, amp, seed = (list(map(str, run[c].values)) for c in ("member_attention", "member_amp", "member_seed"))
    if len(att) != 2:
        raise ValueError("not a pair record: it has one member")
    if seed[0] != seed[1]:
        return "noise_floor"
    if amp[0] != amp[1]:
        low = amp[1] if amp[0] == "off" else amp[0]
        return f"{low}_training"
    if att[0] != att[1]:
        if "sdpa:flash" in {a.split("@")[0] for a in att} and "sdpa:math@fp32" in att:
            return "flash_vs_fp32"
        return f"attention_{att[0]}_vs_{att[1]}"  # another attention pair: kept, named by its members
    return "gpu_repeat"


def _interval(values, confidence: float) -> tuple[float, float, float, int]:
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size and (v == 0).all():  # bitwise identical members (a repeat pair on a deterministic device)
        return 0.0, math.nan, math.nan, int(v.size)
    v = v[v > 0]
    centre, low, high = ratio_interval(v, confidence)
    return centre, low, high, int(v.size)


def gpu_training_dataset(folder, confidence: float = 0.95) -> xr.Dataset:
    """This study's GPU pair records under ``folder`` gathered (``attnum.lm.record.gather``), each
    pair's exact drift per tensor (``pair_w1``...), per kind, per layer and over the model at its
    snapshots (``record.pair_drift`` and ``attnum.drift.aggregate``); per comparison the drift's
    geometric mean over seeds with a t interval (``gpu_drift*``); the low-precision/flash ratio
    (``gpu_ratio*``); the records' provenance (``prov_*``) and the campaign's GPU time."""
    import json

    from ..lm import record

    folder = check_gpu_records(folder)
    gathered = record.gather(folder, GPU_PATTERN)
    pairs = [str(r) for r in gathered["run"].values if int(gathered["run_pair"].sel(run=r)) == 1]
    if not pairs:
        raise FileNotFoundError(f"the records {GPU_PATTERN} under {folder} hold no pair (two-member) record")
    gathered = gathered.sel(run=pairs)
    keep = ["loss", "val_loss", "grad_norm", "key_mean_ratio", "max_logit", "dq_rel_err", "pair_w1", "pair_max_abs",
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


def _interpolated_within(snaps: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``values`` (one per snapshot step of ``snaps``) interpolated linearly in step to every snapshot > 0
    between the first and last steps where they are finite and > 0; NaN outside (and where there is none)."""
    ok = np.isfinite(values) & (snaps > 0) & (values > 0)
    out = np.full(len(snaps), np.nan)
    if ok.any():
        inside = (snaps > 0) & (snaps >= snaps[ok].min()) & (snaps <= snaps[ok].max())
        out[inside] = np.interp(snaps[inside], snaps[ok], values[ok])
    return out


def _paired_ratio(out: xr.Dataset, gathered: xr.Dataset, lows, flash_runs, pairs, comps, confidence: float):
    """Each low-precision record's drift over the drift of the flash_vs_fp32 record with its own init and
    data seeds (interpolated linearly in step to the low-precision snapshots, within the flash record's
    own snapshots), then the geometric mean and t interval over those per-seed ratios: the seeds are
    paired, so the interval carries both pairs' spread. Records without a flash partner are left out.
    Returns the centre, low, high and count arrays (low precision x metric x snapshot)."""
    snaps = out["snapshot"].values
    shape = (len(lows), len(GPU_METRICS), len(snaps))
    centre, low, high, count = (np.full(shape, np.nan) for _ in range(4))
    seeds_of = lambda run: (int(gathered["run_seed"].sel(run=run)), int(gathered["run_data_seed"].sel(run=run)))
    partner = {seeds_of(r): r for r in flash_runs}
    for j, metric in enumerate(GPU_METRICS):
        model = out[f"gpu_model_{metric}"]
        for i, comp in enumerate(lows):
            rows = []
            for run in (r for r, c in zip(pairs, comps) if c == comp):
                flash_run = partner.get(seeds_of(run))
                if flash_run is not None:
                    rows.append(model.sel(run=run).values
                                / _interpolated_within(snaps, model.sel(run=flash_run).values))
            if rows:
                rows = np.array(rows)
                for k in range(len(snaps)):
                    centre[i, j, k], low[i, j, k], high[i, j, k], count[i, j, k] = _interval(rows[:, k], confidence)
    return centre, low, high, count


def gpu_drift_table(ds: xr.Dataset, metric: str = "wasserstein"):
    """Per comparison at its last snapshot: the drift (geometric mean over seeds), its interval and seeds."""
    import pandas as pd

    rows = []
    for comp in ds["gpu_comparison"].values:
        sub = ds.sel(gpu_comparison=comp, gpu_metric=metric)
        ok = np.nonzero(np.isfinite(sub["gpu_drift"].values) & (ds["snapshot"].values > 0))[0]
        if not len(ok):
            continue
        k = ok[-1]
        rows.append({"comparison": str(comp), "last snapshot (step)": int(ds["snapshot"][k]),
                     f"model {metric}": float(sub["gpu_drift"][k]), "ci low": float(sub["gpu_drift_low"][k]),
                     "ci high": float(sub["gpu_drift_high"][k]), "seeds": int(sub["gpu_n_seeds"][k])})
    return pd.DataFrame(rows).set_index("comparison")


def _runs_of(ds: xr.Dataset, comp: str) -> np.ndarray:
    return ds["run"].values[ds["gpu_comparison_of_run"].values == comp]


def gpu_common_steps(ds: xr.Dataset, comps=None) -> np.ndarray:
    """Snapshot steps > 0 at which every record of each comparison in ``comps`` (default: every one
    present) has its drift, model-level and per kind: the steps at which those pairs compare like for
    like (pairs bounded by a time budget stop at different steps)."""
    comps = [str(c) for c in ds["gpu_comparison"].values] if comps is None else list(comps)
    ok = ds["snapshot"].values > 0
    for comp in comps:
        runs = _runs_of(ds, comp)
        if not len(runs):
            return np.array([], dtype=int)
        ok &= np.isfinite(ds["gpu_model_wasserstein"].sel(run=runs).transpose("run", "snapshot").values).all(0)
        if "gpu_kind_wasserstein_rel" in ds:
            kind = ds["gpu_kind_wasserstein_rel"].sel(run=runs).transpose("run", "kind", "snapshot").values
            ok &= np.isfinite(kind).all(axis=(0, 1))
    return ds["snapshot"].values[ok].astype(int)


def gpu_common_step(ds: xr.Dataset, comps=None) -> int | None:
    """The last snapshot step > 0 that every record of the comparisons shares (None: there is none)."""
    steps = gpu_common_steps(ds, comps)
    return int(steps[-1]) if len(steps) else None


def gpu_kind_table(ds: xr.Dataset, step: int, metric: str = "wasserstein_rel"):
    """Per comparison (rows) and kind of tensor (columns): the drift at ``step``, median over the
    comparison's records (seeds); NaN where a record has no snapshot at that step."""
    import pandas as pd

    rows = {}
    for comp in ds["gpu_comparison"].values:
        sub = ds[f"gpu_kind_{metric}"].sel(run=_runs_of(ds, str(comp)), snapshot=step)
        rows[str(comp)] = sub.median("run", skipna=False).to_pandas()
    table = pd.DataFrame(rows).T
    table.columns.name, table.index.name = "kind", "comparison"
    return table


def gpu_ratio_series(ds: xr.Dataset, a: str, b: str, metric: str = "wasserstein"):
    """a's model-level drift / b's (geometric means over seeds) at every snapshot step > 0 that every
    record of both comparisons has (``gpu_common_steps``); empty when one is absent or b's drift is 0."""
    import pandas as pd

    present = set(map(str, ds["gpu_comparison"].values))
    if a not in present or b not in present:
        return pd.Series(dtype=float, name=f"{a} / {b}")
    steps = gpu_common_steps(ds, [a, b])
    x, y = (ds["gpu_drift"].sel(gpu_comparison=c, gpu_metric=metric, snapshot=steps).values for c in (a, b))
    keep = y > 0
    return pd.Series(x[keep] / y[keep], index=pd.Index(steps[keep], name="step"), name=f"{a} / {b}")


def _steps(steps) -> str:
    steps = [int(s) for s in steps]
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def gpu_repeat_sentences(ds: xr.Dataset) -> list[str]:
    """The repeat pair over the flash-vs-FP32 pair at every snapshot both share, and what it means: how
    much of the flash pair's drift GPU non-determinism alone (two identical runs) reaches."""
    rep = gpu_ratio_series(ds, "gpu_repeat", "flash_vs_fp32")
    if not len(rep):
        return []
    steps, last, r = rep.index.values, int(rep.index[-1]), float(rep.iloc[-1])
    if (rep.values == 0).all():
        return [f"**GPU repeat:** the two identical runs are bitwise identical at every snapshot they share with the "
                f"flash-vs-FP32 pair ({_steps(steps)}): none of the flash pair's drift is run-to-run non-determinism."]
    above = steps[rep.values >= 1]
    out = [f"**GPU repeat:** two identical GPU runs drift {rep.min():.3g}x to {rep.max():.3g}x as far as the "
           f"flash-vs-FP32 pair (model-level W1, repeat / flash) over the {len(rep)} snapshots both pairs have "
           f"({_steps(steps)}), and {r:.3g}x at step {last}, the last of them; the repeat pair drifts at least as far "
           f"as the flash pair at {len(above)} of them" + (f" (step {', '.join(map(str, above))})" if len(above) else "")
           + "."]
    if r >= 1:
        out.append(f"So at step {last} GPU non-determinism alone (two identical runs) moves the weights as far as "
                   "changing the attention kernel from flash (bf16) to FP32, or farther: by weight drift the kernel's "
                   "effect cannot be told apart from run-to-run noise.")
    else:
        out.append(f"So at step {last} GPU non-determinism alone (two identical runs, no change of kernel) reaches "
                   f"{r:.0%} of the flash-vs-FP32 pair's drift: changing the attention kernel from flash (bf16) to "
                   f"FP32 moves the weights only {1 / r:.3g}x as far as changing nothing (and the flash pair's own "
                   "drift carries the same non-determinism).")
    return out


def gpu_kind_sentence(ds: xr.Dataset) -> str | None:
    """The per-kind drift of the flash pair beside the repeat pair's and the noise floor's, at the last
    snapshot every pair record shares (the middle panel of ``plot_gpu_drift``)."""
    if "gpu_kind_wasserstein_rel" not in ds or "flash_vs_fp32" not in ds["gpu_comparison"].values:
        return None
    step = gpu_common_step(ds)
    where = "the last snapshot every pair record shares"
    if step is None:
        step, where = gpu_common_step(ds, ["flash_vs_fp32"]), "the flash pair's own last snapshot: no snapshot is shared by every pair record"
        if step is None:
            return None
    table = gpu_kind_table(ds, step)
    flash = table.loc["flash_vs_fp32"]
    others = [c for c in ("gpu_repeat", "noise_floor") if c in table.index and table.loc[c].notna().all()]
    names = {"gpu_repeat": "repeat", "noise_floor": "noise floor"}
    parts = []
    for kind, value in flash.items():
        text = f"{kind} " + " / ".join(f"{v:.3g}" for v in [value] + [table.loc[c, kind] for c in others])
        if "gpu_repeat" in others:
            rep = table.loc["gpu_repeat", kind]
            text += f" ({value / rep:.3g}x)" if rep > 0 else " (repeat exactly 0)"
        parts.append(text)
    header = " / ".join(["flash"] + [names[c] for c in others]) + (" (flash over repeat)" if "gpu_repeat" in others else "")
    out = (f"**Where the drift sits:** at step {step}, {where} (relative W1 per kind of tensor, median over "
           f"seeds), the flash-vs-FP32 drift is largest for `{flash.idxmax()}`; per kind, {header}: "
           + "; ".join(parts) + ".")
    if "gpu_repeat" in others:
        rep = table.loc["gpu_repeat"]
        more = [str(k) for k in flash.index if flash[k] > rep[k]]
        less = [str(k) for k in flash.index if flash[k] <= rep[k]]
        out += (f" The flash pair drifts more than the repeat pair in {len(more)} of {len(flash)} kinds"
                + (f" ({', '.join(more)})" if more else "") + (f", as far or less in {', '.join(less)}" if less else "")
                + ".")
    return out


GPU_CHANGE = {"gpu_repeat": "no change", "flash_vs_fp32": "the attention kernel", "noise_floor": "the initial weights",
              "bf16_training": "every matmul's precision, bf16", "fp16_training": "every matmul's precision, fp16"}
MERGED_FACTOR = 2.0  # drifts within this factor of each other are called alike by gpu_spread_sentence


def _side_by_side(ds: xr.Dataset) -> list[str] | None:
    """The comparisons set side by side (repeat, flash, low precision) present in ``ds``; None without the
    flash pair or a second one."""
    present = set(map(str, ds["gpu_comparison"].values))
    comps = [c for c in ("gpu_repeat", "flash_vs_fp32", *GPU_LOW_PRECISION) if c in present]
    return comps if "flash_vs_fp32" in comps and len(comps) >= 2 else None


def _drifts_at(ds: xr.Dataset, comps, step) -> tuple[dict, float]:
    """Each comparison's model-level W1 drift at ``step`` and the largest over the smallest of those > 0
    (NaN with fewer than two)."""
    drift = {c: float(ds["gpu_drift"].sel(gpu_comparison=c, gpu_metric="wasserstein", snapshot=step)) for c in comps}
    positive = [v for v in drift.values() if v > 0]
    return drift, (max(positive) / min(positive) if len(positive) >= 2 else math.nan)


def gpu_spread_sentence(ds: xr.Dataset, merged: float = MERGED_FACTOR) -> str | None:
    """The repeat pair, the flash pair and the low-precision pairs (changes from nothing to every
    matmul's precision) side by side at the last snapshot they all share, and at the first when
    they share more than one: how far apart their drifts are, and what it means when they are alike
    (None: no shared snapshot, or fewer than two of them with a drift > 0 there)."""
    comps = _side_by_side(ds)
    if comps is None:
        return None
    steps = gpu_common_steps(ds, comps)
    if not len(steps):
        return None

    def at(step):
        drift, factor = _drifts_at(ds, comps, step)
        return drift, factor, any(v <= 0 for v in drift.values())

    first, last = int(steps[0]), int(steps[-1])
    drift, factor, zero = at(last)
    if not math.isfinite(factor):
        return None
    listed = lambda d: ", ".join(f"{v:.3g} for `{c}` ({GPU_CHANGE[c]})" for c, v in d.items())
    out = (f"**Changes of different size side by side:** at step {last}, the last snapshot these pairs share, the "
           f"model-level W1 drift is {listed(drift)}: the largest is {factor:.3g}x the smallest"
           + (" (the repeat pair is exactly 0 and left out of that factor)" if zero else "") + ".")
    factor0 = factor
    if first != last:
        drift0, factor0, _ = at(first)
        out += (f" At step {first}, the first they share: {listed(drift0)}"
                + (f", {factor0:.3g}x apart." if math.isfinite(factor0) else "."))
    if factor >= merged:
        return out + f" The drifts differ by more than {merged:g}x, so at step {last} they rank the changes by size."
    out += (f" Changes this different in size drifting within {merged:g}x of each other means that by step {last} "
            "the weight drift measures how training amplifies any small difference, not the size of the change "
            "that started it: a ratio of such drifts cannot rank the changes, and a ratio near 1 is what it gives.")
    if first != last and math.isfinite(factor0) and factor0 >= merged:
        return out + (f" At step {first} they were still {factor0:.3g}x apart: the drifts merge between steps "
                      f"{first} and {last}, and only before that can a ratio of drifts rank the changes.")
    earlier = ("the next sentence looks there, with the records that have early snapshots"
               if gpu_early_sentence(ds, merged) else
               "no snapshot before it is in a record of every one of these comparisons")
    return out + (f" They are alike at every snapshot all their records share (from step {first}); whether they "
                  f"differ earlier needs earlier snapshots (the campaign's `snapshot_early`): {earlier}.")


def gpu_early_sentence(ds: xr.Dataset, merged: float = MERGED_FACTOR) -> str | None:
    """The side-by-side comparison before the first snapshot all records share, at the snapshots where
    every comparison (repeat, flash, low precision) has at least one record with a drift (records made
    with ``snapshot_early``): each comparison's drift there (geometric mean over the records that have
    it, their number given) and how far apart they are. None when there is no such snapshot."""
    comps = _side_by_side(ds)
    if comps is None:
        return None
    common = gpu_common_steps(ds, comps)
    drift = ds["gpu_drift"].sel(gpu_comparison=comps, gpu_metric="wasserstein")
    count = ds["gpu_n_seeds"].sel(gpu_comparison=comps, gpu_metric="wasserstein")
    snaps = ds["snapshot"].values
    early = [int(s) for i, s in enumerate(snaps) if s > 0 and (not len(common) or s < common[0])
             and np.isfinite(drift.values[:, i]).all()]
    if not early:
        return None

    def listed(step):
        vals, factor = _drifts_at(ds, comps, step)
        n = {c: int(count.sel(gpu_comparison=c, snapshot=step)) for c in comps}
        return (", ".join(f"{v:.3g} for `{c}` ({n[c]} record{'s' if n[c] != 1 else ''})" for c, v in vals.items())
                + (f", {factor:.3g}x apart" if math.isfinite(factor) else ""))

    first, last = early[0], early[-1]
    out = (f"**Earlier, with the records that have early snapshots:** before step "
           f"{int(common[0]) if len(common) else '(none shared)'}, every comparison has a drift at "
           f"{_steps(early)} in at least one record (not all: a comparison's drift there is the geometric mean of "
           f"the records it has). At step {first}: {listed(first)}"
           + (f"; at step {last}: {listed(last)}." if last != first else "."))
    factors = [_drifts_at(ds, comps, s)[1] for s in early]
    apart = [s for s, f in zip(early, factors) if math.isfinite(f) and f >= merged]
    if apart:
        out += (f" They are more than {merged:g}x apart at {len(apart)} of these {len(early)} snapshots (up to step "
                f"{apart[-1]}): there, a ratio of drifts still reflects the size of the change.")
    else:
        out += (f" They are within {merged:g}x of each other already at step {first}: the drifts are alike from the "
                "first snapshot measured, so at no measured step does a ratio of drifts rank the changes by size.")
    return out


def gpu_seed_sentences(ds: xr.Dataset) -> list[str]:
    """For each comparison with two seeds or more: its records' drifts at the last snapshot every one
    of them has, their geometric mean and interval."""
    conf = float(ds.attrs.get("confidence", 0.95))
    out = []
    for comp in map(str, ds["gpu_comparison"].values):
        runs = _runs_of(ds, comp)
        if len(runs) < 2:
            continue
        step = gpu_common_step(ds, [comp])
        if step is None:
            continue
        each = ds["gpu_model_wasserstein"].sel(run=runs, snapshot=step).values
        sub = ds.sel(gpu_comparison=comp, gpu_metric="wasserstein", snapshot=step)
        if (each == 0).any():  # a deterministic device: identical members give a drift of exactly 0
            out.append(f"`{comp}` over its {len(runs)} seeds at step {step}, the last snapshot all have: "
                       + ", ".join(f"{v:.3g}" for v in each) + f" ({int((each == 0).sum())} exactly 0: bitwise "
                       "identical members, so no geometric mean or interval).")
            continue
        out.append(f"`{comp}` over its {len(runs)} seeds at step {step}, the last snapshot all have: "
                   + ", ".join(f"{v:.3g}" for v in each) + f" (geometric mean {float(sub['gpu_drift']):.3g}, "
                   f"{conf:.0%} interval {float(sub['gpu_drift_low']):.3g} to {float(sub['gpu_drift_high']):.3g}); "
                   f"the seeds differ by {each.max() / each.min():.3g}x.")
    return out


def gpu_lowprec_absence(ds: xr.Dataset) -> str | None:
    """Why there is no low-precision/flash ratio to show (None: there is one at some snapshot)."""
    present = set(map(str, ds["gpu_comparison"].values))
    if not present & set(GPU_LOW_PRECISION):
        return f"No low-precision pair record ({' or '.join(GPU_LOW_PRECISION)}) among the gathered records"
    if "flash_vs_fp32" not in present:
        return "No flash_vs_fp32 pair record among the gathered records"
    if "gpu_ratio" not in ds or not np.isfinite(ds["gpu_ratio"].sel(gpu_metric="wasserstein").values).any():
        return "No low-precision snapshot lies within the flash pair's snapshots"
    return None


def gpu_conclusion_lines(ds: xr.Dataset) -> list[str]:
    """What the GPU pair records say on the questions of the CPU conclusions 1-4 (every number computed)."""
    out = []
    rep = gpu_ratio_series(ds, "gpu_repeat", "flash_vs_fp32")
    if "gpu_repeat" not in ds["gpu_comparison"].values:
        out.append("Determinism (conclusion 1): no `gpu_repeat` record, so the GPU drifts have no run-to-run "
                   "yardstick here.")
    else:
        steps = gpu_common_steps(ds, ["gpu_repeat"])
        drift = ds["gpu_drift"].sel(gpu_comparison="gpu_repeat", gpu_metric="wasserstein", snapshot=steps).values
        if len(steps) and (drift == 0).all():
            out.append(f"Determinism (conclusion 1): GPU training was bitwise deterministic here (`gpu_repeat` is 0 at "
                       f"every snapshot, {_steps(steps)}).")
        elif len(steps):
            zero = np.nonzero(drift == 0)[0]
            since = (f"from step {int(steps[zero[-1] + 1])} on" if len(zero) and zero[-1] + 1 < len(steps)
                     else f"at {int((drift > 0).sum())} of {len(steps)} snapshots" if len(zero) else
                     f"from step {int(steps[0])} on")
            out.append(f"Determinism (conclusion 1): GPU training is not bitwise deterministic: two identical runs "
                       f"(`gpu_repeat`) drift apart {since} (model-level W1 {drift[-1]:.3g} at step "
                       f"{int(steps[-1])}), so every GPU drift is read against that pair, not against 0"
                       + (f"; its drift is {rep.min():.3g}x to {rep.max():.3g}x the flash-vs-FP32 pair's "
                          f"({_steps(rep.index)})" if len(rep) else "") + ".")
    absent = gpu_lowprec_absence(ds)
    if absent:
        out.append(f"Golden et al.'s headline (conclusion 2): not tested by these records. {absent}.")
    else:
        for comp in ds["gpu_lowprec"].values:
            ratio = ds["gpu_ratio"].sel(gpu_lowprec=comp, gpu_metric="wasserstein")
            ok = np.nonzero(np.isfinite(ratio.values))[0]
            if len(ok):
                out.append(f"Golden et al.'s headline (conclusion 2): `{comp}` / `flash_vs_fp32` model-level W1 is "
                           f"{np.nanmin(ratio.values):.3g}x to {np.nanmax(ratio.values):.3g}x "
                           f"({_steps(ds['snapshot'].values[ok])}) against their claimed "
                           f"{GOLDEN_RATIO_RANGE[0]:g}-{GOLDEN_RATIO_RANGE[1]:g}x.")
    floor = gpu_ratio_series(ds, "flash_vs_fp32", "noise_floor")
    if len(floor):
        below = int((floor.values < 1).sum())
        out.append(f"Noise floor (conclusion 3): the flash-vs-FP32 drift is below the drift of two init seeds at "
                   f"{below} of {len(floor)} common snapshots ({_steps(floor.index)}; {floor.min():.3g}x to "
                   f"{floor.max():.3g}x).")
    if len(rep) > 1 and (rep.values > 0).all():
        out.append(f"Ratios over time (conclusion 4): the repeat/flash ratio moves from {rep.iloc[0]:.3g}x at step "
                   f"{int(rep.index[0])} to {rep.iloc[-1]:.3g}x at step {int(rep.index[-1])}.")
    seeds = {str(c): int(len(_runs_of(ds, str(c)))) for c in ds["gpu_comparison"].values}
    out.append("Seeds: " + ", ".join(f"`{c}` {n}" for c, n in seeds.items())
               + (" (one seed each: no intervals)." if max(seeds.values()) == 1 else "."))
    return out


def gpu_sentences(ds: xr.Dataset, claim=GOLDEN_RATIO_RANGE) -> list[str]:
    """Issue 13 section 4's questions answered from the gathered pair records (every number computed)."""
    import json

    out = []
    gpus = sorted(set(str(g) for g in ds["prov_version_gpu"].values))
    missing = json.loads(ds.attrs.get("missing_runs", "[]"))
    out.append(f"**Campaign.** {ds.sizes['run']} pair record(s) ({', '.join(map(str, ds['run'].values))}) on "
               f"{', '.join(gpus)}; GPU time {float(ds['campaign_gpu_s']):.0f} s for these records and "
               f"{float(ds['campaign_all_gpu_s']):.0f} s for all {int(ds.attrs.get('records_in_folder', 0))} records "
               "of the folder, the whole campaign (sums of the records' "
               "wall_s, each the whole training command from process start)"
               + (f"; campaign runs without a record here: {', '.join(missing)}." if missing else
                  "; every campaign run of this study has a record."))
    table = gpu_drift_table(ds)
    conf = float(ds.attrs.get("confidence", 0.95))
    for comp, row in table.iterrows():
        row = {**row, "seeds": int(row["seeds"]), "last snapshot (step)": int(row["last snapshot (step)"])}
        ci = (f" ({conf:.0%} interval over {row['seeds']} seeds {row['ci low']:.3g} to {row['ci high']:.3g})"
              if row["seeds"] >= 2 else " (one seed: no interval)")
        out.append(f"`{comp}`: model-level W1 drift {row['model wasserstein']:.3g} at step "
                   f"{row['last snapshot (step)']}{ci}.")
    floor = gpu_ratio_series(ds, "flash_vs_fp32", "noise_floor")
    if len(floor):
        last, r = int(floor.index[-1]), float(floor.iloc[-1])
        out.append(f"**Flash against the noise floor:** at step {last}, the last snapshot both pairs have, the "
                   f"flash-vs-FP32 drift is {r:.3g}x the drift between two init seeds ("
                   + ("below" if r < 1 else "above") + f" the floor); {floor.min():.3g}x to {floor.max():.3g}x over "
                   f"their {len(floor)} common snapshots ({_steps(floor.index)}).")
    out += gpu_repeat_sentences(ds)
    if "gpu_ratio" in ds:
        for comp in ds["gpu_lowprec"].values:
            sub = ds.sel(gpu_lowprec=comp, gpu_metric="wasserstein")
            ok = np.nonzero(np.isfinite(sub["gpu_ratio"].values))[0]
            if not len(ok):
                continue
            n = sub["gpu_ratio_n_seeds"].values
            k = _most_seeds_snapshot(n, ok)
            r, lo, hi = (float(sub[v][k]) for v in ("gpu_ratio", "gpu_ratio_low", "gpu_ratio_high"))
            seeds = int(n[k])
            where = (f"{conf:.0%} interval over the {seeds} `{comp}` seeds (each over the flash pair's geometric mean "
                     f"over its seeds) {lo:.3g} to {hi:.3g}: {verdict(lo, hi, claim)}") if np.isfinite(lo) else (
                "one seed, so no interval; the point value lies " +
                ("inside" if claim[0] <= r <= claim[1] else "below" if r < claim[0] else "above") +
                f" the claimed {claim[0]:g}-{claim[1]:g}x")
            text = (f"**Golden et al.'s 2-5x** (their claim: flash causes 2-5x less weight deviation than "
                    f"low-precision training): `{comp}` / `flash_vs_fp32` model-level W1 at step "
                    f"{int(ds['snapshot'][k])} is {r:.3g}: {where}.")
            if k != ok[-1]:
                later = [j for j in ok if j > k]
                text += (" At the later snapshots, which fewer seeds reached, it is "
                         + ", ".join(f"{float(sub['gpu_ratio'][j]):.3g} (step {int(ds['snapshot'][j])}, "
                                     f"{int(n[j])} seed{'s' if n[j] != 1 else ''})" for j in later) + ".")
            out.append(text + _paired_ratio_sentence(ds, sub, comp, conf, claim))
    absent = gpu_lowprec_absence(ds)
    if absent:
        out.append(f"{absent}: the 2-5x ratio cannot be computed.")
    spread = gpu_spread_sentence(ds)
    if spread:
        out.append(spread)
    early = gpu_early_sentence(ds)
    if early:
        out.append(early)
    out += gpu_seed_sentences(ds)
    kind = gpu_kind_sentence(ds)
    if kind:
        out.append(kind)
    return out


def _most_seeds_snapshot(n: np.ndarray, ok) -> int:
    """Of the snapshot indices ``ok``, the last with the most seeds ``n`` among those with two or more (an
    interval needs two), else the last one: a later snapshot that fewer seeds reached gives a wider
    interval over a smaller sample."""
    with_ci = [k for k in ok if n[k] >= 2]
    return [j for j in with_ci if n[j] == max(n[with_ci])][-1] if with_ci else ok[-1]


def _paired_ratio_sentence(ds: xr.Dataset, sub: xr.Dataset, comp: str, conf: float, claim) -> str:
    """The ratio paired by seed (``gpu_ratio_paired``) at the last snapshot with the most seed pairs, set
    beside the unpaired one: empty when no low-precision record has a flash partner of its seeds."""
    if "gpu_ratio_paired" not in sub:
        return ""
    paired = sub["gpu_ratio_paired"].values
    ok = np.nonzero(np.isfinite(paired))[0]
    if not len(ok):
        return ""
    n = sub["gpu_ratio_paired_n_seeds"].values
    k = _most_seeds_snapshot(n, ok)
    lo, hi = float(sub["gpu_ratio_paired_low"][k]), float(sub["gpu_ratio_paired_high"][k])
    seeds = int(n[k])
    spread = (f"{conf:.0%} interval over the {seeds} seed pairs {lo:.3g} to {hi:.3g}: {verdict(lo, hi, claim)}"
              if np.isfinite(lo) else "one seed pair, so no interval")
    return (f" Paired by seed (each `{comp}` record over the `flash_vs_fp32` record of its own init and data seeds, "
            f"so the interval carries the flash pairs' spread as well): {float(paired[k]):.3g} at step "
            f"{int(ds['snapshot'][k])}, {spread}.")


def cpu_tier_run(name: str = "default") -> xr.Dataset | None:
    """This checkout's run ``outputs/wasserstein_weight_drift/<name>/results.nc`` of a CPU tier (None
    when absent or without drift ratios): the CPU drift the gpu_training tier is set beside."""
    from ..ncio import open_results
    from ..paths import outputs_root

    path = outputs_root() / "wasserstein_weight_drift" / name / "results.nc"
    if not path.exists():
        return None
    ds = open_results(path, squeeze_sweep_dims=True)
    return ds if "drift_ratio" in ds else None
