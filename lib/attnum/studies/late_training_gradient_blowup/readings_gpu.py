"""Readings of the ``gpu_training`` tier's Dataset (``gpu_training.gpu_training_dataset``): each run's
throughput and attention share, the runs of one setting at the largest step they all reached
(budget-stopped runs end at different steps), where each run starts to memorise its small corpus, the
layers whose dQ error passed a level and the same layer of the other runs of its setting.
"""
from __future__ import annotations

import math

import numpy as np
import xarray as xr

from .gpu_training import (GPU_DQ_METRIC, GPU_DQ_PASS, _common_logged_steps, _kernel_of, _offset_over_spread, _passes,
                           _setting_of, _settings, _step_or_nan)
from .trainer import lm_record


def gpu_training_table(ds: xr.Dataset):
    """One row per run and trained member: what it reached (``record.summary``) and its setting."""
    import json

    import pandas as pd

    rows = []
    for run in ds["run"].values:
        params = lm_record().convert_parameters(json.loads(str(ds["run_parameters"].sel(run=run).values)))
        for member in ds["member"].values:
            if not np.isfinite(float(ds["sum_tokens_done"].sel(run=run))) or \
                    not np.isfinite(float(ds["sum_final_loss"].sel(run=run, member=member))):
                continue
            s = lambda k: float(ds[f"sum_{k}"].sel(run=run, **({"member": member} if "member" in ds[f"sum_{k}"].dims
                                                                 else {})))
            rows.append({"run": str(run), "member": str(member), "attention": _kernel_of(ds, run, member),
                         "lr": float(params["lr"]), "clip": float(params["grad_clip"]),
                         "weight decay": float(params["weight_decay"]), "tokens": s("tokens_done"),
                         "final loss": s("final_loss"), "min val loss": s("min_val_loss"),
                         "min val loss step": _step_or_nan(s("min_val_loss_step")),
                         "final val loss": s("final_val_loss"),
                         "passes": s("train_passes"),
                         "loss rise": s("loss_rise"), "diverged": s("diverged"),
                         f"{GPU_DQ_METRIC} growth": s("dq_err_growth"), f"max {GPU_DQ_METRIC}": s("max_dq_rel_err"),
                         "max dq_row_rel_err": s("max_dq_row_rel_err"), "max key_mean_norm": s("max_key_mean_norm"),
                         "max key_mean_ratio": s("max_key_mean_ratio"), "max offset/spread": s("max_offset_spread"),
                         "max offset_logit": s("max_offset_logit"),
                         "max max_prob": s("max_max_prob"), "max grad norm": s("max_grad_norm"),
                         "tokens/s": float(ds["sum_median_tokens_per_s"].sel(run=run)),
                         "attention share": float(ds["attention_share"].sel(run=run)),
                         "wall s": float(ds["wall_s"].sel(run=run))})
    return pd.DataFrame(rows).set_index(["run", "member"])


def gpu_layer_growth(ds: xr.Dataset):
    """Per run, trained member and layer: how the dQ error, the common key offset and the sharpness moved
    late in training. Windows over the logged steps (step 0 left out, steps where every layer has a dQ
    error): *mid* is the fifth of them that ends at the middle, *end* the last fifth; each growth is the
    mean over *end* over the mean over *mid*. ``late_corr`` is the correlation over the second half of the
    logged steps of log dq_rel_err with log key_mean_norm in that layer (the mechanism: dQ error in
    proportion to the mean key). Members whose dQ error is 0 throughout (FP32 attention) and members with
    fewer than ten such steps are left out. Columns also give the *end* window's key_mean_norm,
    key_mean_ratio and dq_rel_err, and the window bounds."""
    import pandas as pd

    rows = []
    steps = ds["step"].values
    for run in ds["run"].values:
        for member in ds["member"].values:
            at = dict(run=run, member=member)
            err = ds["dq_rel_err"].sel(**at).transpose("step", "layer").values
            key = ds["key_mean_norm"].sel(**at).transpose("step", "layer").values
            ratio = ds["key_mean_ratio"].sel(**at).transpose("step", "layer").values
            sharp = ds["max_prob"].sel(**at).transpose("step", "layer").values
            ok = (steps > 0) & np.isfinite(err).all(1) & np.isfinite(key).all(1)
            if ok.sum() < 10 or not (err[ok] > 0).any():
                continue
            err, key, ratio, sharp, st = err[ok], key[ok], ratio[ok], sharp[ok], steps[ok]
            n = len(st)
            k = max(1, n // 5)
            mid, end, half = slice(n // 2 - k, n // 2), slice(n - k, n), slice(n // 2, n)
            grow = lambda a: a[end].mean(0) / a[mid].mean(0)  # noqa: E731
            g_err, g_key, g_sharp = grow(err), grow(key), grow(sharp)
            for layer in range(err.shape[1]):
                e, kk = err[half, layer], key[half, layer]
                good = (e > 0) & (kk > 0)
                corr = (float(np.corrcoef(np.log(e[good]), np.log(kk[good]))[0, 1])
                        if good.sum() >= 3 and np.std(np.log(e[good])) > 0 and np.std(np.log(kk[good])) > 0
                        else math.nan)
                rows.append({"run": str(run), "member": str(member), "layer": layer,
                             "attention": _kernel_of(ds, run, member),
                             "dq growth": float(g_err[layer]), "key offset growth": float(g_key[layer]),
                             "max_prob growth": float(g_sharp[layer]), "late_corr": corr,
                             "end key_mean_norm": float(key[end, layer].mean()),
                             "end key_mean_ratio": float(ratio[end, layer].mean()),
                             "end dq_rel_err": float(err[end, layer].mean()),
                             "mid steps": f"{int(st[mid][0])}-{int(st[mid][-1])}",
                             "end steps": f"{int(st[end][0])}-{int(st[end][-1])}"})
    columns = ["run", "member", "layer", "attention", "dq growth", "key offset growth", "max_prob growth",
               "late_corr", "end key_mean_norm", "end key_mean_ratio", "end dq_rel_err", "mid steps", "end steps"]
    return pd.DataFrame(rows, columns=columns).set_index(["run", "member", "layer"])


def gpu_equal_step_table(ds: xr.Dataset):
    """The runs of one setting (``GPU_SETTING``: same learning rate, clipping, weight decay, seeds) at
    the largest logged step every one of their trained members reached (runs with one budget stop at
    different steps): training loss of that row, the last validation loss at or before it, the mean
    over layers of key_mean_norm, max_prob and dq_rel_err, and the model's gradient norm. Settings
    with a single run are left out."""
    import pandas as pd

    steps = ds["step"].values
    rows = []
    for setting, members in _settings(ds).items():
        if len({r for r, _ in members}) < 2:
            continue
        logged = _common_logged_steps(ds, members)
        if not len(logged):
            continue
        common = int(logged[-1])
        for run, member in members:
            one = ds.sel(run=run, member=member)
            val = one["val_loss"].sel(step=slice(None, common)).dropna("step")
            layer_mean = lambda k: float(one[k].sel(step=common).mean("layer"))
            rows.append({"run": run, "member": member, "setting": setting, "attention": _kernel_of(ds, run, member),
                         "common step": common, "last step": int(steps[np.isfinite(one["loss"].values)][-1]),
                         "train loss": float(one["loss"].sel(step=common)),
                         "val loss": float(val[-1]) if val.size else math.nan,
                         "val step": int(val["step"][-1]) if val.size else -1,
                         "key_mean_norm": layer_mean("key_mean_norm"), "max_prob": layer_mean("max_prob"),
                         GPU_DQ_METRIC: layer_mean(GPU_DQ_METRIC),
                         "grad norm": float(one["grad_norm_total"].sel(step=common))})
    columns = ["setting", "attention", "common step", "last step", "train loss", "val loss", "val step",
               "key_mean_norm", "max_prob", GPU_DQ_METRIC, "grad norm"]
    if not rows:
        return pd.DataFrame(columns=columns, index=pd.MultiIndex.from_arrays([[], []], names=["run", "member"]))
    return pd.DataFrame(rows).set_index(["run", "member"])[columns]


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper & Pearson 1934) two-sided interval for a binomial probability from ``k``
    successes in ``n`` trials: the beta quantiles ``B(a/2; k, n-k+1)`` and ``B(1-a/2; k+1, n-k)``,
    with 0 and 1 at the ends (``k = 0``, ``k = n``)."""
    from scipy.stats import beta

    if n <= 0 or not 0 <= k <= n:
        return math.nan, math.nan
    alpha = 1 - confidence
    low = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return low, high


def repeat_growth(ds: xr.Dataset, level: float = GPU_DQ_PASS):
    """Per setting and attention kernel with a layer whose dQ error passed ``level``: how many trained
    runs of that setting and kernel there are (repeats of one plan: same initial weights, batches and
    kernel), in how many a layer passed, the largest dQ error of any of them, and the 95% Clopper-Pearson
    interval for the probability that one run of the setting passes (what the repeats can say)."""
    import pandas as pd

    rows = []
    for setting, members in _settings(ds).items():
        by_kernel: dict[str, list[tuple[str, str]]] = {}
        for run, member in members:
            by_kernel.setdefault(_kernel_of(ds, run, member), []).append((run, member))
        for kernel, runs in by_kernel.items():
            grown = [(r, m) for r, m in runs if _passes(ds, r, m, level)]
            if not grown:
                continue
            low, high = clopper_pearson(len(grown), len(runs))
            top = max(float(ds[GPU_DQ_METRIC].sel(run=r, member=m).sel(step=ds["step"] > 0).max()) for r, m in grown)
            rows.append({"setting": setting, "attention": kernel, "runs": len(runs), "grown": len(grown),
                         "grown_runs": ", ".join(r for r, _ in grown), "largest dq_rel_err": top,
                         "p low (95%)": low, "p high (95%)": high})
    columns = ["setting", "attention", "runs", "grown", "grown_runs", "largest dq_rel_err", "p low (95%)", "p high (95%)"]
    return pd.DataFrame(rows, columns=columns)


def strongest_repeat_growth(ds: xr.Dataset | None, level: float = GPU_DQ_PASS) -> dict:
    """The row of ``repeat_growth`` with the largest dQ error, as a dict (NaN values without records or
    without any layer past ``level``)."""
    empty = {"runs": math.nan, "grown": math.nan, "largest dq_rel_err": math.nan, "p low (95%)": math.nan,
             "p high (95%)": math.nan, "attention": None, "setting": None, "grown_runs": None}
    if ds is None or GPU_DQ_METRIC not in ds:
        return empty
    table = repeat_growth(ds, level)
    if not len(table):
        return empty
    return table.loc[table["largest dq_rel_err"].idxmax()].to_dict()



def layer_passes(ds: xr.Dataset, level: float = GPU_DQ_PASS):
    """One row per trained member and layer whose dQ error (``GPU_DQ_METRIC``) passed ``level``: the first
    logged step it did (``pass_step``) and, there, the layer's common key offset, score shift and the
    training loss; the step of its largest dQ error (``top_step``) and, there, the median row error, dK and
    dV errors, key offset, offset over spread, score shift and the gradient-norm ratio (kernel over FP32
    recompute); the largest dQ error of the member's other layers; the losses at the end, the validation
    minimum and its step; the member's last logged step."""
    import pandas as pd

    rows = []
    for setting, members in _settings(ds).items():
        for run, member in members:
            one = ds.sel(run=run, member=member)
            dq = one[GPU_DQ_METRIC].sel(step=one["step"] > 0)
            for layer, first in _passes(ds, run, member, level):
                d = dq.sel(layer=layer).dropna("step")
                top = int(d["step"][int(np.nanargmax(d.values))])
                at = lambda var, st: float(one[var].sel(layer=layer, step=st))
                loss, val = one["loss"].dropna("step"), one["val_loss"].dropna("step")
                others = dq.sel(layer=[x for x in dq["layer"].values if int(x) != layer])
                rows.append({
                    "run": run, "member": member, "attention": _kernel_of(ds, run, member), "setting": setting,
                    "layer": int(layer), "pass_step": first, "top_step": top, "last_step": int(loss["step"][-1]),
                    "pass_key_mean_norm": at("key_mean_norm", first), "pass_offset_logit": at("offset_logit", first),
                    "top_dq_rel_err": float(d.max()), "top_dq_row_rel_err": at("dq_row_rel_err", top),
                    "top_dk_rel_err": at("dk_rel_err", top), "top_dv_rel_err": at("dv_rel_err", top),
                    "top_key_mean_norm": at("key_mean_norm", top), "top_offset_logit": at("offset_logit", top),
                    "top_offset_over_spread": float(_offset_over_spread(at("key_mean_ratio", top))),
                    "top_grad_norm_ratio": at("grad_norm_ratio", top),
                    "other_layers_max_dq": float(others.max()) if others.size else math.nan,
                    "loss_at_pass": float(loss.sel(step=first, method="nearest")), "loss_end": float(loss[-1]),
                    "val_end": float(val[-1]) if val.size else math.nan,
                    "val_min": float(val.min()) if val.size else math.nan,
                    "val_min_step": int(val["step"][int(np.nanargmin(val.values))]) if val.size else -1})
    return pd.DataFrame(rows)


def same_layer_elsewhere(ds: xr.Dataset, run: str, layer: int, step: int):
    """The same ``layer`` in the other trained members of ``run``'s setting, one row each: its attention,
    the step it is read at (``step``, or its last logged step if it stopped before), its dQ error and
    common key offset there, its largest dQ error and key offset over the whole run, the largest dQ error
    of any of its layers, its last logged step and its training and validation loss at the step read."""
    import pandas as pd

    setting = _setting_of(ds, run)
    rows = []
    for r, m in _settings(ds).get(setting, []):
        if r == run:
            continue
        one = ds.sel(run=r, member=m)
        d = one[GPU_DQ_METRIC].sel(layer=layer).dropna("step")
        d = d.sel(step=d["step"] > 0)
        if not d.size:
            continue
        last = int(d["step"][-1])
        st = min(step, last)
        km = one["key_mean_norm"].sel(layer=layer).dropna("step")
        loss, val = one["loss"].dropna("step"), one["val_loss"].dropna("step")
        rows.append({"run": r, "attention": _kernel_of(ds, r, m), "read_at": st, "stopped_before": last < step,
                     "dq_rel_err": float(d.sel(step=st)), "key_mean_norm": float(km.sel(step=st)),
                     "max_dq_rel_err": float(d.max()), "max_key_mean_norm": float(km.max()),
                     "max_dq_any_layer": float(one[GPU_DQ_METRIC].sel(step=one["step"] > 0).max()), "last_step": last,
                     "loss_at": float(loss.sel(step=st, method="nearest")),
                     "val_at": float(val.sel(step=val["step"] <= st)[-1]) if val.size else math.nan})
    return pd.DataFrame(rows)


GROWTH_KEYS = ("run", "layer", "pass_step", "top_step", "pass_key_mean_norm", "top_key_mean_norm", "pass_offset_logit",
               "top_offset_logit", "top_dq_rel_err", "top_dq_row_rel_err", "top_dv_rel_err", "top_dk_rel_err",
               "top_grad_norm_ratio", "other_layers_max_dq", "top_offset_over_spread", "loss_at_pass", "loss_end",
               "val_end", "val_min_step")
BESIDE_KEYS = ("run", "read_at", "dq_rel_err", "key_mean_norm", "max_dq_rel_err", "max_key_mean_norm",
               "max_dq_any_layer", "last_step", "loss_at", "val_at")


def growth_reading(ds: xr.Dataset | None, level: float = GPU_DQ_PASS) -> dict:
    """The values section 10's reading states, flat (NaN where the records lack them): ``growth_*``, the
    layer with the largest dQ error of all that passed ``level`` (``layer_passes``); ``repeat_*``, the same
    layer in the run of its setting with the same kernel (its repeat); ``gproj_*``, in the setting's GProj
    run; ``second_*``, the one other layer that passed (the largest of the rest), with ``second_beside_*``
    the same layer in the setting's other runs by attention (``flash``, ``triton``, ``gproj``); and
    ``fp32_last_step``, where the FP32-attention run of the second's setting stopped."""
    nan = {f"growth_{k}": math.nan for k in GROWTH_KEYS}
    nan.update({f"{who}_{k}": math.nan for who in ("repeat", "gproj") for k in BESIDE_KEYS})
    nan.update({f"second_{k}": math.nan for k in ("run", "layer", "top_dq_rel_err", "top_key_mean_norm",
                                                   "top_offset_over_spread", "top_dq_row_rel_err")})
    nan.update({f"second_beside_{k}": math.nan for k in ("flash", "triton", "gproj")})
    nan["fp32_last_step"] = math.nan
    out = dict(nan)
    if ds is None or GPU_DQ_METRIC not in ds:
        return out
    passes = layer_passes(ds, level)
    if not len(passes):
        return out
    passes = passes.sort_values("top_dq_rel_err", ascending=False)
    growth = passes.iloc[0]
    out.update({f"growth_{k}": growth[k] for k in GROWTH_KEYS})
    beside = same_layer_elsewhere(ds, growth["run"], int(growth["layer"]), int(growth["pass_step"]))
    for who, pick in (("repeat", beside["attention"] == growth["attention"] if len(beside) else None),
                      ("gproj", beside["attention"].str.contains("gproj") if len(beside) else None)):
        if pick is not None and pick.any():
            row = beside[pick].iloc[0]
            out.update({f"{who}_{k}": row[k] for k in BESIDE_KEYS})
    if len(passes) > 1:
        second = passes.iloc[1]
        out.update({f"second_{k}": second[k] for k in ("run", "layer", "top_dq_rel_err", "top_key_mean_norm",
                                                         "top_offset_over_spread", "top_dq_row_rel_err")})
        others = same_layer_elsewhere(ds, second["run"], int(second["layer"]), int(second["pass_step"]))
        for who, needle in (("flash", "sdpa:flash"), ("triton", "triton:fa2@"), ("gproj", "gproj")):
            pick = others["attention"].str.contains(needle, regex=False) if len(others) else None
            if pick is not None and pick.any():
                out[f"second_beside_{who}"] = float(others[pick]["max_dq_rel_err"].max())
        fp32 = others[others["attention"].str.endswith("@fp32")] if len(others) else others
        if len(fp32):
            out["fp32_last_step"] = int(fp32["last_step"].iloc[0])
    return out
