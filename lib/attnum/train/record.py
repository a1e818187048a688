"""One compact NetCDF record per training command, and ``gather`` for a folder of them.

A record (``lm_<tag or kernels>_s<seed>_d<data seed>.nc``, written by ``attnum.ncio.write_results``:
atomic, checksummed, with provenance) holds

    dims      member (a, or a and b of a pair), step (the logged steps, 0 first), layer,
              snapshot (steps of the weight sketches), tensor, sketch (run index of a sketch)
    (member, step)            loss (mean training loss since the previous row), val_loss (NaN where
                              not evaluated), grad_norm (whole model, before clipping)
    (step)                    lr, step_time_s (mean over the interval, every member's step included),
                              tokens_per_s, elapsed_s (wall clock since the process started)
    (member, step, layer)     grad_norm_layer, grad_norm_qk and every ``diag.LAYER_STATS`` and
                              ``diag.DIAG_ERRORS`` on the fixed diagnostic batch
    (member, snapshot, tensor, sketch)   weight_sketch (``diag.weight_sketches``)
    (member, snapshot, tensor)          weight_l2, each tensor's L2 norm
    (snapshot, tensor)        pair_w1, pair_max_abs, pair_rel_l2: exact drift b vs a (pairs only)
    (member)                  attn_fwd_s, attn_fwd_bwd_s (attention alone, median), nonfinite_step
    scalars                   attention_share (layers x attention fwd+bwd / median step time),
                              steps_done, tokens_done, wall_s
    attributes                the parameters (JSON, by the writer), corpus facts (``corpus_*``),
                              data_order_sha256, versions (torch, CUDA, cuDNN, Triton, GPU name), stop_reason,
                              resumed_at (JSON: the steps later commands continued from), dist_world_size and
                              dist_backend (data-parallel processes, "none" for one process)

``gather(folder)`` opens every record below a folder and concatenates them along a new ``run``
dimension (outer join on steps, snapshots and members), with each run's parameters, kernels,
corpus hash and stop reason as ``run`` coordinates: the input of a study's ``gpu_training`` tier.
``pair_drift(run)`` gives a pair's exact drift and ``sketch_drift(ds, a, b)`` the sketch lower bound
of the per-tensor W1 between any two runs' members at their common snapshots, both in
``attnum.drift``'s per-tensor layout, so that ``attnum.drift.aggregate`` groups them by kind, layer
or model. ``summary(ds)`` gives per run and member the tokens reached and the passes over the training
split they make, the losses (the lowest validation loss and its step), the largest key offset, sharpness and
dQ error, the dQ error's growth over training and whether the loss diverged.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import xarray as xr

from .. import ncio
from ..drift import tensor_kind, tensor_layer
from . import diag

# -- a synthetic-task run's records (attnum.train.train): the train_* variables of a study's results --

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


def record_variables() -> dict[str, tuple[str, str]]:
    """CF units and long_name of training records (``train_*``) and of the FP32-recompute
    diagnostic's records (``diag_*`` at checkpoints, ``live_*`` during training), for the writer."""
    table = {f"diag_{k}": v for k, v in diag.ATTRS.items()}
    table.update({f"live_{k}": (u, f"{name} (training batch, during training)") for k, (u, name) in diag.ATTRS.items()})
    table["live_grad_norm_total"] = ("1", "global gradient norm of the training step the diagnostic ran on")
    table["live_spike"] = ("1", "1 if the diagnostic ran because the gradient norm spiked, else 0 (periodic)")
    table.update({f"train_{k}": v for k, v in ATTRS.items()})
    table["run_attention"] = ("1", "attention kernel of every layer (registry name)")
    return table


# -- a corpus run's record (attnum.train.train_corpus) --

STUDY = "lm_training"

VARIABLES = {
    **ATTRS,  # the names both data sources record: one meaning, one unit
    "val_loss": ("nat", "validation cross-entropy on the fixed validation windows (nats per byte)"),
    "step_time_s": ("s", "mean wall time of one optimiser step over the interval (all members)"),
    "tokens_per_s": ("1/s", "bytes (tokens) trained per second over the interval, all members"),
    "elapsed_s": ("s", "wall clock since the process started"),
    "offset_logit": ("1", "mean |q_i . mean key| * scale: the score shift of the common key offset"),
    "max_prob": ("1", "mean over rows of the largest attention probability"),
    "dq_rel_err": ("1", "relative L2 error of the kernel's dQ against the FP32 recompute on the same operands"),
    "dq_row_rel_err": ("1", "median row relative error of the kernel's dQ against the FP32 recompute"),
    "dk_rel_err": ("1", "relative L2 error of the kernel's dK against the FP32 recompute"),
    "dk_row_rel_err": ("1", "median row relative error of the kernel's dK against the FP32 recompute"),
    "dv_rel_err": ("1", "relative L2 error of the kernel's dV against the FP32 recompute"),
    "dv_row_rel_err": ("1", "median row relative error of the kernel's dV against the FP32 recompute"),
    "grad_norm_ratio": ("1", "norm of the kernel's (dQ, dK, dV) / norm of the FP32 recompute's"),
    "dq_err_pk_cos": ("1", "median over rows of |cos| between the dQ error (kernel - FP32 recompute) and (P K)_i: "
                           "near 1 when the error is the common-key-offset mechanism's, ~d^-1/2 for spread noise"),
    "weight_sketch": ("1", "means of equal runs of the tensor's sorted values (NaN: padding)"),
    "weight_l2": ("1", "L2 norm of the tensor's values"),
    "pair_w1": ("1", "exact Wasserstein-1 distance between member b's and member a's values of the tensor"),
    "pair_max_abs": ("1", "largest |b - a| over the tensor's elements"),
    "pair_rel_l2": ("1", "||b - a|| / ||a|| over the tensor's elements"),
    "attn_fwd_s": ("s", "median time of one attention forward alone at the training shape"),
    "attn_fwd_bwd_s": ("s", "median time of one attention forward and backward alone at the training shape"),
    "nonfinite_step": ("1", "first logged step with a non-finite training loss (-1: none)"),
    "attention_share": ("1", "estimated share of the step in attention: layers x attention fwd+bwd / median step time"),
    "steps_done": ("1", "optimiser steps done"),
    "tokens_done": ("1", "bytes (tokens) trained per member"),
    "wall_s": ("s", "wall clock of the whole command from process start (of a continued run: its commands' sum)"),
    "step": ("1", "optimiser steps done (corpus records: loss is the mean over the steps since the previous "
                  "row, grad_norm* are the logged step's before clipping, the attention statistics are the "
                  "fixed diagnostic batch's)"),
    "snapshot": ("1", "optimiser steps done at the weight snapshot"),
}


@dataclasses.dataclass
class RunState:
    """What a run has logged so far (``train`` fills it; ``to_dataset`` turns it into a record)."""

    cfg: object
    lm_cfg: object
    corpus_facts: dict
    order_sha256: str
    members: list
    tensor_names: list
    tensor_numel: list
    versions: dict
    steps: list = dataclasses.field(default_factory=list)
    elapsed_s: list = dataclasses.field(default_factory=list)
    lr: list = dataclasses.field(default_factory=list)
    step_time_s: list = dataclasses.field(default_factory=list)
    grad_norms: list = dataclasses.field(default_factory=list)  # per row: {member: (per layer, per layer qk, total)}
    member_rows: dict = dataclasses.field(default_factory=dict)  # member -> {loss: [...], val_loss: [...]}
    member_layers: dict = dataclasses.field(default_factory=dict)  # member -> {stat: [[per layer] per row]}
    nonfinite_step: dict = dataclasses.field(default_factory=dict)
    attention_timing: dict = dataclasses.field(default_factory=dict)
    snapshot_steps: list = dataclasses.field(default_factory=list)
    sketches: list = dataclasses.field(default_factory=list)  # per snapshot: [per member (tensor, K)]
    weight_l2: list = dataclasses.field(default_factory=list)  # per snapshot: [per member (tensor,)]
    pair_drift: list = dataclasses.field(default_factory=list)  # per snapshot: {w1, max_abs, rel_l2}
    stop_reason: str = "running"
    wall_s: float = math.nan
    resumed_at: list = dataclasses.field(default_factory=list)  # steps a later command continued from
    world: dict = dataclasses.field(default_factory=dict)  # dist.World.facts(): processes, backend


def record_name(cfg) -> str:
    tag = cfg.tag or "_".join(m["kernel"] for m in cfg.members())
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", tag).strip("-")
    return f"lm_{tag}_s{cfg.seed}_d{cfg.data_seed}.nc"


def to_dataset(state: RunState) -> xr.Dataset:
    cfg = state.cfg
    labels = [m["member"] for m in state.members]
    n_rows = len(state.steps)
    ds = xr.Dataset(coords={
        "member": labels, "step": np.array(state.steps, dtype=np.int64), "layer": np.arange(cfg.n_layer),
        "snapshot": np.array(state.snapshot_steps, dtype=np.int64),
        "tensor": list(state.tensor_names), "sketch": np.arange(cfg.sketch_size),
        "member_attention": ("member", [m["attention"] for m in state.members]),
        "member_amp": ("member", [m["amp"] for m in state.members]),
        "member_seed": ("member", np.array([m["seed"] for m in state.members], dtype=np.int64)),
        "tensor_kind": ("tensor", [tensor_kind(n) for n in state.tensor_names]),
        "tensor_layer": ("tensor", np.array([tensor_layer(n) for n in state.tensor_names], dtype=np.int64)),
        "tensor_numel": ("tensor", np.array(state.tensor_numel, dtype=np.int64)),
    })
    ds["lr"] = ("step", np.array(state.lr, dtype=np.float64))
    ds["step_time_s"] = ("step", np.array(state.step_time_s, dtype=np.float64))
    tokens = cfg.batch_size * cfg.context * len(labels)
    ds["tokens_per_s"] = tokens / ds["step_time_s"]
    ds["elapsed_s"] = ("step", np.array(state.elapsed_s, dtype=np.float64))
    for key in ("loss", "val_loss"):
        ds[key] = (("member", "step"), np.array([state.member_rows[m][key][:n_rows] for m in labels], dtype=np.float64))
    ds["grad_norm_total"] = (("member", "step"), np.array([[row[m][2] for row in state.grad_norms[:n_rows]]
                                                            for m in labels], dtype=np.float64))
    ds["grad_norm"] = (("member", "step", "layer"), np.array(
        [[row[m][0] for row in state.grad_norms[:n_rows]] for m in labels], dtype=np.float64))
    ds["grad_norm_qk"] = (("member", "step", "layer"), np.array(
        [[row[m][1] for row in state.grad_norms[:n_rows]] for m in labels], dtype=np.float64))
    for key in diag.LAYER_STATS + diag.DIAG_ERRORS:
        ds[key] = (("member", "step", "layer"),
                   np.array([state.member_layers[m][key][:n_rows] for m in labels], dtype=np.float64))
    ds["weight_sketch"] = (("member", "snapshot", "tensor", "sketch"),
                           np.stack([np.stack(snap, axis=0) for snap in state.sketches], axis=1).astype(np.float32))
    ds["weight_l2"] = (("member", "snapshot", "tensor"),
                       np.stack([np.stack(snap, axis=0) for snap in state.weight_l2], axis=1).astype(np.float64))
    if len(labels) == 2:
        for key in ("w1", "max_abs", "rel_l2"):
            ds[f"pair_{key}"] = (("snapshot", "tensor"), np.array([d[key] for d in state.pair_drift], dtype=np.float64))
    timing = [state.attention_timing.get(m, {}) for m in labels]
    ds["attn_fwd_s"] = ("member", np.array([t.get("fwd_s", math.nan) for t in timing], dtype=np.float64))
    ds["attn_fwd_bwd_s"] = ("member", np.array([t.get("fwd_bwd_s", math.nan) for t in timing], dtype=np.float64))
    ds["nonfinite_step"] = ("member", np.array([state.nonfinite_step.get(m, -1) for m in labels], dtype=np.int64))
    step_times = np.array(state.step_time_s[1:], dtype=np.float64)
    step_times = step_times[np.isfinite(step_times)]
    median_step = float(np.median(step_times)) if step_times.size else math.nan
    ds["attention_share"] = float(cfg.n_layer * np.nansum(ds["attn_fwd_bwd_s"].values) / median_step) \
        if math.isfinite(median_step) and np.isfinite(ds["attn_fwd_bwd_s"].values).any() else math.nan
    ds["steps_done"] = np.int64(state.steps[-1] if state.steps else 0)
    ds["tokens_done"] = np.int64(ds["steps_done"].item() * cfg.batch_size * cfg.context)
    ds["wall_s"] = float(state.wall_s)
    ds.attrs.update({key: (json.dumps(value) if not isinstance(value, (str, int, float)) else value)
                     for key, value in state.corpus_facts.items()})
    ds.attrs["data_order_sha256"] = state.order_sha256
    ds.attrs["attention_timing"] = json.dumps(state.attention_timing, sort_keys=True)
    for key, value in state.versions.items():
        ds.attrs[f"version_{key}"] = value
    ds.attrs["stop_reason"] = state.stop_reason
    ds.attrs["n_params"] = int(state.lm_cfg.n_params())
    ds.attrs["resumed_at"] = json.dumps([int(s) for s in state.resumed_at])
    for key, value in state.world.items():
        ds.attrs[key] = value
    return ds


def write(state: RunState, path) -> Path:
    device = str(state.cfg.device)
    return ncio.write_results(to_dataset(state), path, study=STUDY, params=state.cfg.params(), device=device,
                              title="attnum byte-level LM training run", variables=VARIABLES)


# the corpus records written before the one schema: their names and parameters, and today's
OLD_NAMES = {"grad_norm": "grad_norm_total", "grad_norm_layer": "grad_norm"}
OLD_PARAMETERS = {"clip": "grad_clip", "warmup": "warmup_steps", "amp": "autocast", "pair_amp": "pair_autocast"}


def convert_parameters(params: dict) -> dict:
    """A training run's parameters in today's names (``OLD_PARAMETERS``; ``data`` = "corpus" added and
    ``min_lr`` dropped for an old corpus run: only the constant schedule ran with it, where it does
    nothing). Today's parameters come back unchanged."""
    if "data" in params:
        return dict(params)
    params = {OLD_PARAMETERS.get(k, k): v for k, v in params.items() if k != "min_lr"}
    return {"data": "corpus", **params}


def convert(ds: xr.Dataset) -> xr.Dataset:
    """A record, or a dataset gathered from records (a study's ``gpu_training`` results), in the one
    schema: the old corpus layout's ``grad_norm_layer`` (per block) and ``grad_norm`` (whole model)
    become ``grad_norm`` and ``grad_norm_total``, its parameters (a record's ``parameters`` attribute,
    a gathered dataset's ``run_parameters``) today's names (``convert_parameters``), and
    ``record_converted_from`` says so. Anything already in today's schema is returned unchanged;
    values are never touched."""
    # the old layout: grad_norm_layer, or a grad_norm without a layer dimension (the whole model's)
    old_total = "grad_norm" in ds.variables and "layer" not in ds["grad_norm"].dims
    if "grad_norm_layer" not in ds.variables and not old_total:
        return ds
    names = {"grad_norm": "grad_norm_total"} if old_total else {}
    if "grad_norm_layer" in ds.variables:
        names["grad_norm_layer"] = "grad_norm"
    ds = ds.rename({old: f"_{old}" for old in names}).rename({f"_{old}": new for old, new in names.items()})
    for name in names.values():
        units, long_name = VARIABLES[name]
        ds[name].attrs.update(units=units, long_name=long_name)
    if ds.attrs.get("study") == STUDY and "parameters" in ds.attrs:  # a record's own parameters
        ds.attrs["parameters"] = json.dumps(convert_parameters(json.loads(ds.attrs["parameters"])), sort_keys=True)
    if "run_parameters" in ds.variables:
        values = [json.dumps(convert_parameters(json.loads(str(v))), sort_keys=True)
                  for v in ds["run_parameters"].values]
        new = xr.DataArray(np.array(values, dtype=object), dims=ds["run_parameters"].dims,
                           attrs=ds["run_parameters"].attrs)
        ds = ds.assign_coords(run_parameters=new) if "run_parameters" in ds.coords else ds.assign(run_parameters=new)
    ds.attrs["record_converted_from"] = "corpus record (old layout)"
    return ds


def open_record(path) -> xr.Dataset:
    """One record file, in the one schema (``convert``: older layouts are renamed on load)."""
    with xr.open_dataset(path, engine=ncio.ENGINE) as ds:
        return convert(ds.load())


def gather(folder, pattern: str = "lm_*.nc") -> xr.Dataset:
    """Every record under ``folder`` (recursively) along a new ``run`` dimension, named by file stem.

    ``run`` coordinates: ``run_kernels`` (member attentions, '|'-joined), ``run_lr``, ``run_seed``,
    ``run_data_seed``, ``run_pair``, ``run_stop_reason``, ``run_corpus_sha256``,
    ``run_corpus_train_bytes`` (bytes of the corpus's training split; NaN if not recorded), ``run_gpu``,
    ``run_parameters`` (JSON) and ``run_git_commit``.
    """
    paths = sorted(Path(folder).rglob(pattern))
    if not paths:
        raise FileNotFoundError(f"no training records ({pattern}) under {folder}")
    runs, names = [], []
    for path in paths:
        ds = open_record(path)
        params = json.loads(ds.attrs["parameters"])
        coords = {"run_kernels": "|".join(str(a) for a in ds["member_attention"].values),
                  "run_lr": float(params["lr"]), "run_seed": int(params["seed"]),
                  "run_data_seed": int(params["data_seed"]), "run_pair": int(bool(params.get("pair"))),
                  "run_stop_reason": ds.attrs.get("stop_reason", ""),
                  "run_corpus_sha256": ds.attrs.get("corpus_sha256", ""),
                  "run_corpus_train_bytes": float(ds.attrs.get("corpus_train_bytes", math.nan)),
                  "run_gpu": ds.attrs.get("version_gpu", ""), "run_parameters": ds.attrs["parameters"],
                  "run_git_commit": ds.attrs.get("git_commit", "unknown")}
        ds.attrs = {}
        runs.append(ds.expand_dims(run=[path.stem]).assign_coords({k: ("run", [v]) for k, v in coords.items()}))
        names.append(path.stem)
    if len(set(names)) != len(names):
        raise ValueError(f"two records share a file name under {folder}: {sorted(names)}")
    tensors = {tuple(ds["tensor"].values) for ds in runs}
    if len(tensors) > 1:
        # different model sizes: keep what every run has (the series), drop the per-tensor variables
        runs = [ds.drop_dims(["tensor", "sketch"], errors="ignore") for ds in runs]
    out = xr.concat(runs, dim="run", join="outer", coords="different", compat="equals",
                    data_vars="all", fill_value=np.nan)
    for var in out.variables.values():
        var.encoding = {}  # the records' integer encodings do not hold the outer join's NaN padding
    out.attrs["gathered_from"] = json.dumps([str(p) for p in paths])
    return out


def _drift_layout(ds: xr.Dataset, values: dict) -> xr.Dataset:
    """``attnum.drift``'s per-tensor layout (wasserstein, max_abs, rel_l2, ref_l2_norm and the
    tensor coordinates) so that ``attnum.drift.aggregate`` groups it by kind, layer or model."""
    from ..drift import with_attrs

    coords = {name: ds[name] for name in ("tensor_kind", "tensor_layer", "tensor_numel")}
    out = xr.Dataset(values).assign_coords(coords)
    out = out.drop_vars([c for c in out.coords if c not in ("snapshot", "tensor", *coords)], errors="ignore")
    return with_attrs(out)


def pair_drift(run: xr.Dataset) -> xr.Dataset:
    """A pair record's exact drift b vs a (dims snapshot, tensor) in ``attnum.drift``'s layout;
    ``run`` is one record (``open_record``) or one run of a gathered dataset."""
    if "pair_w1" not in run or run["pair_w1"].isnull().all():
        raise ValueError("not a pair record: it has no pair_w1")
    ok = run["pair_w1"].notnull().any("tensor")
    run = run.isel(snapshot=np.nonzero(ok.values)[0])
    return _drift_layout(run, {"wasserstein": run["pair_w1"], "max_abs": run["pair_max_abs"],
                               "rel_l2": run["pair_rel_l2"], "ref_l2_norm": run["weight_l2"].sel(member="a")})


def sketch_drift(ds: xr.Dataset, a: tuple, b: tuple) -> xr.Dataset:
    """Drift between ``a = (run, member)`` and ``b = (run, member)`` of a gathered dataset at their
    common snapshots, from the sketches: ``wasserstein`` is the sketch lower bound of the per-tensor
    W1 (``diag.sketch_wasserstein``); ``max_abs`` and ``rel_l2`` need both runs' weights and are
    NaN; ``ref_l2_norm`` is a's. ``attnum.drift.aggregate`` groups it (its W1 stays a lower bound)."""
    sa = ds["weight_sketch"].sel(run=a[0], member=a[1])
    sb = ds["weight_sketch"].sel(run=b[0], member=b[1])
    common = np.intersect1d(sa["snapshot"].values[np.isfinite(sa.isel(tensor=0, sketch=0).values)],
                            sb["snapshot"].values[np.isfinite(sb.isel(tensor=0, sketch=0).values)])
    sa, sb = sa.sel(snapshot=common), sb.sel(snapshot=common)
    w1 = xr.DataArray(diag.sketch_wasserstein(sa.values, sb.values), dims=("snapshot", "tensor"),
                      coords={"snapshot": common, "tensor": sa["tensor"]})
    nan = xr.full_like(w1, np.nan)
    ref = ds["weight_l2"].sel(run=a[0], member=a[1], snapshot=common)
    out = _drift_layout(ds, {"wasserstein": w1, "max_abs": nan, "rel_l2": nan, "ref_l2_norm": ref})
    out["wasserstein"].attrs["long_name"] = ("lower bound of the per-tensor Wasserstein-1 distance "
                                             "from the weight sketches")
    return out


SUMMARY = {
    "tokens_done": ("1", "bytes (tokens) trained per member"),
    "final_loss": ("1", "training loss of the last logged interval"),
    "final_val_loss": ("1", "last validation loss"),
    "min_val_loss": ("1", "lowest validation loss"),
    "min_val_loss_step": ("1", "logged step of the lowest validation loss"),
    "train_passes": ("1", "bytes (tokens) trained per member / bytes of the corpus's training split: passes over "
                          "the training data (NaN: the record does not give the split's size)"),
    "max_key_mean_norm": ("1", "largest common key offset over steps and layers"),
    "max_offset_logit": ("1", "largest score shift of the common key offset over steps and layers"),
    "max_max_prob": ("1", "largest mean row maximum of P over steps and layers"),
    "max_dq_rel_err": ("1", "largest dQ relative L2 error against the FP32 recompute over steps and layers"),
    "max_dq_row_rel_err": ("1", "largest median-row dQ error against the FP32 recompute over steps and layers"),
    "dq_err_growth": ("1", "dQ relative error, mean over layers and the last fifth of the logged steps / "
                           "the first fifth (step 0 excluded): above 1 the error grew during training; NaN with fewer "
                           "than five logged steps or a first-fifth error of 0 (FP32 attention, which the "
                           "diagnostic recomputes exactly)"),
    "max_grad_norm": ("1", "largest logged gradient norm of the whole model (before clipping)"),
    "diverged": ("1", "1 if the training loss became non-finite, 0 if not (NaN: no such member)"),
    "median_tokens_per_s": ("1/s", "median throughput over the logged intervals, all members"),
}


def summary(ds: xr.Dataset) -> xr.Dataset:
    """Per run and member of a gathered dataset: how far training went and what it reached (the
    numbers that bound a phenomenon that did not appear; ``SUMMARY`` says what each is)."""
    logged = ds.isel(step=slice(1, None))  # step 0: the initial model, no training loss
    out = xr.Dataset()
    out["tokens_done"] = ds["tokens_done"]
    valid = logged["loss"].notnull()
    last = valid.cumsum("step").argmax("step")  # index of the last logged loss
    out["final_loss"] = logged["loss"].isel(step=last)
    val_ok = ds["val_loss"].notnull()
    out["final_val_loss"] = ds["val_loss"].isel(step=val_ok.cumsum("step").argmax("step"))
    out["min_val_loss"] = ds["val_loss"].min("step")
    at_min = ds["step"].isel(step=ds["val_loss"].fillna(np.inf).argmin("step")).drop_vars("step", errors="ignore")
    out["min_val_loss_step"] = at_min.astype(float).where(ds["val_loss"].notnull().any("step"))
    if "run_corpus_train_bytes" in ds.coords:
        out["train_passes"] = ds["tokens_done"] / ds["run_corpus_train_bytes"].where(ds["run_corpus_train_bytes"] > 0)
    else:
        out["train_passes"] = ds["tokens_done"] * np.nan
    for key in ("key_mean_norm", "offset_logit", "max_prob", "dq_rel_err", "dq_row_rel_err"):
        out[f"max_{key}"] = logged[key].max(("step", "layer"))
    err = logged["dq_rel_err"].mean("layer")

    def growth(row):
        row = row[np.isfinite(row)]
        if row.size < 5:
            return np.nan
        k = max(1, row.size // 5)
        early = float(np.mean(row[:k]))
        # FP32 attention is what the diagnostic recomputes: its error is 0 throughout, no growth to speak of
        return float(np.mean(row[-k:]) / early) if early > 0 else np.nan

    out["dq_err_growth"] = xr.apply_ufunc(growth, err, input_core_dims=[["step"]], vectorize=True)
    out["max_grad_norm"] = logged["grad_norm_total"].max("step")
    out["diverged"] = (ds["nonfinite_step"] >= 0).astype(float).where(ds["nonfinite_step"].notnull())
    out["median_tokens_per_s"] = ds["tokens_per_s"].median("step")
    for name, (units, long_name) in SUMMARY.items():
        out[name].attrs.update(units=units, long_name=long_name)
    return out


# -- for the studies' gpu_training tiers ---------------------------------------------------------

PROVENANCE = ("git_commit", "git_dirty", "created", "device", "version_torch", "version_cuda", "version_cudnn",
              "version_triton", "version_gpu", "version_tf32_matmul", "corpus_parts", "corpus_python",
              "corpus_files", "corpus_bytes", "corpus_sha256", "data_order_sha256", "stop_reason", "n_params")


def campaign_runs(prefix: str = "") -> list[str]:
    """The run names of ``params/lm/campaign.yaml`` that start with ``prefix`` (in the file's order)."""
    import yaml

    from ..paths import params_dir

    path = params_dir() / "lm" / "campaign.yaml"
    plans = yaml.safe_load(path.read_text()) if path.exists() else {}
    return [name for name in (plans or {}) if str(name).startswith(prefix)]


def require_records(folder, pattern: str, expected=(), what: str = "") -> Path:
    """The folder (a relative path is read from the project root) if it holds at least one record
    matching ``pattern``; otherwise a ``FileNotFoundError`` naming the folder, the pattern, the
    expected runs (``expected``: campaign names) and what the folder does hold. Reads no record."""
    from ..paths import project_root

    path = Path(folder).expanduser()
    if not path.is_absolute():
        path = project_root() / path
    expected = list(expected)
    runs = f"; the campaign's runs for it: {', '.join(expected)}" if expected else ""
    hint = (" (train them with `python -m attnum.train train --plan NAME --out DIR` and commit the records "
            "there)")
    if not path.is_dir():
        raise FileNotFoundError(f"GPU training records folder {str(folder)!r} ({path}) does not exist: "
                                f"no records {pattern} {what}{runs}{hint}")
    if not sorted(path.rglob(pattern)):
        present = sorted(p.name for p in path.rglob("*.nc"))
        have = f"; it holds {', '.join(present[:20])}" if present else "; it holds no .nc file"
        raise FileNotFoundError(f"GPU training records folder {str(folder)!r} ({path}) has no records {pattern} "
                                f"{what}{runs}{have}{hint}")
    return path


def missing_runs(folder, expected) -> list[str]:
    """The campaign runs of ``expected`` with no record under ``folder`` (records are named
    ``lm_<run>_s<seed>_d<data seed>.nc``)."""
    stems = [p.stem for p in Path(folder).rglob("lm_*.nc")]
    return [name for name in expected if not any(re.fullmatch(rf"lm_{re.escape(name)}_s\d+_d\d+", s) for s in stems)]


def provenance(folder, pattern: str = "lm_*.nc") -> xr.Dataset:
    """Each record's own provenance attributes (``PROVENANCE``; GPU, versions, corpus, commit) as
    string coordinates ``prov_<attribute>`` along ``run`` (named as ``gather`` names them)."""
    paths = sorted(Path(folder).rglob(pattern))
    rows = {}
    for path in paths:
        with xr.open_dataset(path, engine=ncio.ENGINE) as ds:
            rows[path.stem] = {key: str(ds.attrs.get(key, "")) for key in PROVENANCE}
    out = xr.Dataset(coords={"run": list(rows)})
    for key in PROVENANCE:
        out.coords[f"prov_{key}"] = ("run", np.array([rows[r][key] for r in rows], dtype=object))
        out[f"prov_{key}"].attrs["long_name"] = f"the record's own provenance attribute {key}"
    return out


def total_wall_s(folder, pattern: str = "lm_*.nc") -> tuple[float, int]:
    """(sum of ``wall_s``, number of records) over every record under ``folder``: the GPU time of
    the whole campaign there (each record's command from process start to its last write)."""
    total, count = 0.0, 0
    for path in sorted(Path(folder).rglob(pattern)):
        with xr.open_dataset(path, engine=ncio.ENGINE) as ds:
            if "wall_s" in ds and np.isfinite(float(ds["wall_s"])):
                total += float(ds["wall_s"])
                count += 1
    return total, count
