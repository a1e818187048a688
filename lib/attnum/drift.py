"""Weight drift between two training runs: how far apart their weights are, tensor by tensor.

Golden et al. (arXiv 2405.02803, Sec. V) put a kernel's numerical deviation in context by
training a model twice from the same initialisation and data order, changing one thing, and
comparing the weights over training by their maximum difference and a Wasserstein distance
between the weight distributions. For two tensors ``a`` (the reference side of a pair) and
``b`` of the same shape this module measures

    wasserstein  W1 between the empirical distributions of the flattened values of a and b,
                 i.e. ``scipy.stats.wasserstein_distance(a.ravel(), b.ravel())``; for equal
                 sizes this is exactly mean_i |sort(a)_i - sort(b)_i| (the optimal coupling
                 of two equal-size samples on the line matches order statistics), which is
                 what ``wasserstein_distance`` computes here, in float64
    max_abs      max_i |a_i - b_i| (elementwise)
    rel_l2       ||a - b||_2 / ||a||_2 (elementwise, relative to the reference side)

W1 compares *distributions*: it is blind to which weight holds which value (a permutation of
a tensor is at distance 0), so it asks "do the two models have the same weight statistics",
while max_abs and rel_l2 ask "are they the same function of the same coordinates". The first
is Golden et al.'s metric; the other two say what it cannot.

Aggregation over a group of tensors (one layer, or one kind: ``KINDS``), computed from the
per-tensor values so that it can be redone from a results file (``aggregate``):

    wasserstein      numel-weighted mean of the per-tensor W1: the mean displacement per weight
                     of the per-tensor optimal couplings (an upper bound on the W1 of the pooled
                     values; pooling would mix LayerNorm gains near 1 with weights near 0.02)
    wasserstein_rel  that mean divided by the group's reference RMS sqrt(sum ||a||^2 / sum n):
                     scale-free, comparable across kinds
    max_abs          the largest over the group
    rel_l2           sqrt(sum ||a - b||^2) / sqrt(sum ||a||^2) over the group's tensors
"""
from __future__ import annotations

import numpy as np
import torch
import xarray as xr

KINDS = ("embedding", "attention", "mlp", "norm", "head")
METRICS = ("wasserstein", "max_abs", "rel_l2", "ref_l2_norm")

ATTRS = {
    "wasserstein": ("1", "Wasserstein-1 distance between the two runs' distributions of weight values"),
    "wasserstein_rel": ("1", "Wasserstein-1 distance of the weight values divided by the reference RMS weight"),
    "max_abs": ("1", "largest absolute difference between corresponding weights of the two runs"),
    "rel_l2": ("1", "relative L2 difference ||w_b - w_a|| / ||w_a|| of the two runs' weights"),
    "ref_l2_norm": ("1", "L2 norm of the weights of the pair's reference run (side a)"),
}


# -- which tensor is what -------------------------------------------------------------------------

def tensor_kind(name: str) -> str:
    """The kind of a parameter of ``attnum.model.GPT`` from its state-dict name."""
    if name.startswith(("tok_emb.", "pos_emb.")):
        return "embedding"
    if name.startswith("head."):
        return "head"
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    if ".ln" in name or name.startswith("ln_"):
        return "norm"
    raise ValueError(f"cannot tell the kind of tensor {name!r}; kinds: {list(KINDS)}")


def tensor_layer(name: str) -> int:
    """The block index of a parameter (``blocks.<i>.``), or -1 outside the blocks."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" else -1


# -- distances between two tensors ----------------------------------------------------------------

def _values(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64).ravel()


def wasserstein_distance(a, b) -> float:
    """W1 between the empirical distributions of the flattened values of ``a`` and ``b``.

    Equal sizes: mean |sort(a) - sort(b)| in float64 (exact). Unequal sizes: scipy's
    ``wasserstein_distance``, the same quantity through the two CDFs.
    """
    a, b = _values(a), _values(b)
    if a.size == 0 or b.size == 0:
        raise ValueError("the Wasserstein distance needs two non-empty tensors")
    if a.size != b.size:
        from scipy.stats import wasserstein_distance as scipy_w1

        return float(scipy_w1(a, b))
    return float(np.mean(np.abs(np.sort(a) - np.sort(b))))


def tensor_drift(a, b) -> dict[str, float]:
    """``wasserstein``, ``max_abs``, ``rel_l2`` (relative to ``a``) and ``ref_l2_norm`` = ||a||."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    x, y = _values(a), _values(b)
    diff = y - x
    ref = float(np.linalg.norm(x))
    dist = float(np.linalg.norm(diff))
    rel = dist / ref if ref > 0 else (0.0 if dist == 0 else np.inf)
    return {"wasserstein": wasserstein_distance(x, y), "max_abs": float(np.max(np.abs(diff))),
            "rel_l2": rel, "ref_l2_norm": ref}


# -- whole models and checkpoints -----------------------------------------------------------------

def tensor_coords(state: dict) -> dict:
    """Coordinates of the ``tensor`` dimension for a state dict: names, kind, layer, numel."""
    names = list(state)
    return {"tensor": names,
            "tensor_kind": ("tensor", [tensor_kind(n) for n in names]),
            "tensor_layer": ("tensor", np.array([tensor_layer(n) for n in names], dtype=np.int64)),
            "tensor_numel": ("tensor", np.array([state[n].numel() for n in names], dtype=np.int64))}


def state_drift(state_a: dict, state_b: dict) -> xr.Dataset:
    """Per-tensor drift between two state dicts with the same names and shapes (dim ``tensor``)."""
    if list(state_a) != list(state_b):
        raise ValueError("the two state dicts name different tensors")
    rows = [tensor_drift(state_a[n], state_b[n]) for n in state_a]
    ds = xr.Dataset({m: ("tensor", np.array([r[m] for r in rows])) for m in METRICS},
                    coords=tensor_coords(state_a))
    return with_attrs(ds)


def checkpoint_drift(checkpoints_a: dict, checkpoints_b: dict, steps=None) -> xr.Dataset:
    """Per-tensor drift at every checkpoint step both runs kept (dims ``step``, ``tensor``)."""
    steps = sorted(set(checkpoints_a) & set(checkpoints_b)) if steps is None else list(steps)
    if not steps:
        raise ValueError("the two runs share no checkpoint step")
    parts = [state_drift(checkpoints_a[s], checkpoints_b[s]) for s in steps]
    ds = xr.concat(parts, dim=xr.DataArray(steps, dims="step", name="step"), coords="minimal")
    ds["step"].attrs.update(long_name="optimizer updates before the checkpoint")
    return ds


def aggregate(ds: xr.Dataset, by: str) -> xr.Dataset:
    """Group drift over tensors: ``by="kind"`` (dim ``kind``), ``"layer"`` (dim ``layer``, blocks
    only) or ``"model"`` (every tensor, no new dim). Reads ``wasserstein``, ``max_abs``, ``rel_l2``,
    ``ref_l2_norm`` and the ``tensor_numel`` coordinate; see the module docstring."""
    if by == "kind":
        keys = [k for k in KINDS if (ds["tensor_kind"] == k).any()]
        masks = [ds["tensor_kind"].values == k for k in keys]
    elif by == "layer":
        layers = ds["tensor_layer"].values
        keys = sorted(int(i) for i in set(layers.tolist()) if i >= 0)
        masks = [layers == k for k in keys]
    elif by == "model":
        keys, masks = [None], [np.ones(ds.sizes["tensor"], dtype=bool)]
    else:
        raise ValueError(f"aggregate by 'kind', 'layer' or 'model', not {by!r}")
    parts = [_aggregate_group(ds.isel(tensor=np.nonzero(mask)[0])) for mask in masks]
    if by == "model":
        return parts[0]
    out = xr.concat(parts, dim=xr.DataArray(keys, dims=by, name=by), coords="minimal")
    if by == "layer":
        out["layer"].attrs.update(long_name="transformer block")
    return out


def _aggregate_group(sub: xr.Dataset) -> xr.Dataset:
    numel = sub["tensor_numel"].astype(float)
    ref_sq = (sub["ref_l2_norm"] ** 2).sum("tensor")
    diff_sq = ((sub["rel_l2"] * sub["ref_l2_norm"]) ** 2).sum("tensor")
    w1 = (sub["wasserstein"] * numel).sum("tensor") / numel.sum()
    rms = np.sqrt(ref_sq / numel.sum())
    out = xr.Dataset({
        "wasserstein": w1,
        "wasserstein_rel": w1 / rms.where(rms > 0),
        "max_abs": sub["max_abs"].max("tensor"),
        "rel_l2": np.sqrt(diff_sq) / np.sqrt(ref_sq).where(ref_sq > 0),
    })
    out = out.drop_vars([c for c in out.coords if c.startswith("tensor")], errors="ignore")
    return with_attrs(out)


def with_attrs(ds: xr.Dataset, prefix: str = "", what: str = "") -> xr.Dataset:
    """CF ``units`` and ``long_name`` on the drift variables (``prefix`` + metric name)."""
    for metric, (units, long_name) in ATTRS.items():
        name = prefix + metric
        if name in ds.data_vars:
            ds[name].attrs.update(units=units, long_name=long_name + what)
    return ds
