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


def gpu_training_table(ds: xr.Dataset | None):
    """One row per run and trained member: what it reached (``record.summary``) and its setting."""
    import json

    import pandas as pd

    if not _have(ds):
        return pd.DataFrame(index=pd.MultiIndex.from_arrays([[], []], names=["run", "member"]))
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


def gpu_layer_growth(ds: xr.Dataset | None):
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
    steps = ds["step"].values if _have(ds) else []
    for run in (ds["run"].values if _have(ds) else []):
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


def gpu_equal_step_table(ds: xr.Dataset | None):
    """The runs of one setting (``GPU_SETTING``: same learning rate, clipping, weight decay, seeds) at
    the largest logged step every one of their trained members reached (runs with one budget stop at
    different steps): training loss of that row, the last validation loss at or before it, the mean
    over layers of key_mean_norm, max_prob and dq_rel_err, and the model's gradient norm. Settings
    with a single run are left out."""
    import pandas as pd

    steps = ds["step"].values if _have(ds) else []
    rows = []
    for setting, members in (_settings(ds).items() if _have(ds) else []):
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


REPEAT_CONFIDENCE = 0.95
"""The confidence of the Clopper-Pearson interval ``repeat_growth`` gives."""


def clopper_pearson(k: int, n: int, confidence: float = REPEAT_CONFIDENCE) -> tuple[float, float]:
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


def repeat_growth(ds: xr.Dataset | None, level: float = GPU_DQ_PASS):
    """Per setting and attention kernel with a layer whose dQ error passed ``level``: how many trained
    runs of that setting and kernel there are (repeats of one plan: same initial weights, batches and
    kernel), in how many a layer passed, the largest dQ error of any of them, and the 95% Clopper-Pearson
    interval for the probability that one run of the setting passes (what the repeats can say)."""
    import pandas as pd

    rows = []
    for setting, members in (_settings(ds).items() if _have(ds) else []):
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



def layer_passes(ds: xr.Dataset | None, level: float = GPU_DQ_PASS):
    """One row per trained member and layer whose dQ error (``GPU_DQ_METRIC``) passed ``level``: the first
    logged step it did (``pass_step``) and, there, the layer's common key offset, score shift and the
    training loss; the step of its largest dQ error (``top_step``) and, there, the median row error, dK and
    dV errors, key offset, offset over spread, score shift and the gradient-norm ratio (kernel over FP32
    recompute); the largest dQ error of the member's other layers; the losses at the end, the validation
    minimum and its step; the member's last logged step."""
    import pandas as pd

    rows = []
    for setting, members in (_settings(ds).items() if _have(ds) else []):
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


# -- section 10's answers as values and tables (each None-safe: no records, empty tables and NaN) ---------------

def _have(ds) -> bool:
    return ds is not None and GPU_DQ_METRIC in ds


MODEL_FIELDS = ("n_layer", "d_model", "n_head", "context")
"""The model geometry the prose states of the records (``attnum.train.TrainConfig`` fields)."""


def records_model(ds: xr.Dataset | None) -> dict:
    """The records' model: each of ``MODEL_FIELDS`` where every run's parameters agree on it (None where they
    differ or there are no records), and the largest training corpus in MB (10^6 bytes, the records'
    provenance)."""
    import json

    out = {k: None for k in MODEL_FIELDS} | {"corpus_mb": None}
    if not _have(ds):
        return out
    params = [json.loads(str(p)) for p in np.atleast_1d(ds["run_parameters"].values)]
    for key in MODEL_FIELDS:
        values = {p.get(key) for p in params}
        out[key] = values.pop() if len(values) == 1 else None
    if "prov_corpus_bytes" in ds.coords:
        out["corpus_mb"] = float(np.nanmax(np.asarray(ds["prov_corpus_bytes"].values, dtype=float))) / 1e6
    return out


def campaign(ds: xr.Dataset | None) -> dict:
    """The records gathered: how many of this study, the GPUs they ran on, the first and last day they were
    made (their own ``created``), the GPU seconds of these records and of every record of the folder (sums
    of the records' ``wall_s``), and the campaign runs of this study without a record (their number and
    names)."""
    import json

    if not _have(ds):
        return {"runs": math.nan, "gpus": None, "first_day": None, "last_day": None, "gpu_s": math.nan,
                "all_gpu_s": math.nan, "records_in_folder": math.nan, "missing": math.nan, "missing_runs": None}
    missing = json.loads(ds.attrs.get("missing_runs", "[]"))
    days = sorted(str(c)[:10] for c in ds["prov_created"].values)
    return {"runs": int(ds.sizes["run"]), "gpus": ", ".join(sorted(set(str(g) for g in ds["prov_version_gpu"].values))),
            "first_day": days[0], "last_day": days[-1],
            "gpu_s": float(ds["campaign_gpu_s"]), "all_gpu_s": float(ds["campaign_all_gpu_s"]),
            "records_in_folder": int(ds.attrs.get("records_in_folder", 0)), "missing": len(missing),
            "missing_runs": ", ".join(missing) or None}


def throughput(ds: xr.Dataset | None):
    """One row per run: its attention kernel, median tokens per second, the attention share of its step
    (``record.VARIABLES``: attention timed alone on random operands of the training shape over the
    median step time; NaN: not timed), its steps and wall seconds, and its tokens per second over the
    slowest run's."""
    import pandas as pd

    columns = ["attention", "tokens/s", "attention share", "steps", "wall s", "over the slowest"]
    if not _have(ds):
        return pd.DataFrame(columns=columns)
    rows = {str(r): {"attention": _kernel_of(ds, r), "tokens/s": float(ds["sum_median_tokens_per_s"].sel(run=r)),
                     "attention share": float(ds["attention_share"].sel(run=r)),
                     "steps": int(ds["steps_done"].sel(run=r)), "wall s": float(ds["wall_s"].sel(run=r))}
            for r in ds["run"].values}
    table = pd.DataFrame.from_dict(rows, orient="index")
    rate = table["tokens/s"].where(table["tokens/s"] > 0)
    table["over the slowest"] = rate / rate.min()
    return table[columns]


def blowup_by_family(ds: xr.Dataset | None, loss_rise: float | None = None):
    """One row per attention family (``sdpa:flash``, FP32, GProj, ...): its trained members and how many
    blew up (loss non-finite, or a logged loss above ``loss_rise`` (``GPU_LOSS_RISE``) times its running
    minimum)."""
    import pandas as pd

    from .gpu_training import GPU_LOSS_RISE, _family

    loss_rise = GPU_LOSS_RISE if loss_rise is None else loss_rise
    if not _have(ds):
        return pd.DataFrame(columns=["members", "blew up"])
    table = gpu_training_table(ds)
    fam = table["attention"].map(_family)
    blew = (table["diverged"] == 1) | (table["loss rise"] > loss_rise)
    return pd.DataFrame({"members": fam.value_counts(), "blew up": blew.groupby(fam).sum()}).astype(int)


def late_growth(ds: xr.Dataset | None, growth: float | None = None) -> dict:
    """Over the trained members: how many have a layer-mean dQ growth (last fifth of the logged steps over
    the first), how many of them grew more than ``growth`` (``GPU_GROWTH``) and which."""
    from .gpu_training import GPU_GROWTH

    growth = GPU_GROWTH if growth is None else growth
    if not _have(ds):
        return {"with growth": math.nan, "grew": math.nan, "grew_runs": None, "level": growth}
    col = gpu_training_table(ds)[f"{GPU_DQ_METRIC} growth"]
    grew = col[col > growth]
    return {"with growth": int(np.isfinite(col).sum()), "grew": len(grew),
            "grew_runs": ", ".join(f"{r}/{m}" for r, m in grew.index) or None, "level": growth}


def grid_bound(ds: xr.Dataset | None) -> dict:
    """What the runs reached against the mechanism grid: the most tokens per model, the largest common key
    offset (``key_mean_norm``), offset over spread, score shift, median row dQ error and ``dq_rel_err`` of
    any run; the grid's |mu| and offset over spread at its level (``grid_level``) and its error without an
    offset; the grid's offset over spread over the runs' largest, and the grid's level over the runs'
    largest row error (NaN without the grid)."""
    if not _have(ds):
        keys = ("tokens", "key_mean_norm", "offset_spread", "offset_logit", "row_err", "dq_err", "grid_mu",
                "grid_offset_spread", "grid_level", "grid_err_no_offset", "spread_ratio", "err_ratio")
        return {k: math.nan for k in keys}
    table = gpu_training_table(ds)
    out = {"tokens": float(table["tokens"].max()), "key_mean_norm": float(table["max key_mean_norm"].max()),
           "offset_spread": float(table["max offset/spread"].max()), "offset_logit": float(table["max offset_logit"].max()),
           "row_err": float(table["max dq_row_rel_err"].max()), "dq_err": float(table[f"max {GPU_DQ_METRIC}"].max()),
           "grid_mu": float(ds["grid_mu_at_level"]), "grid_offset_spread": float(ds["grid_offset_spread_at_level"]),
           "grid_level": float(ds.attrs.get("grid_level", 0.1)), "grid_err_no_offset": float(ds["grid_dq_err_no_offset"])}
    out["spread_ratio"] = out["grid_offset_spread"] / out["offset_spread"]
    out["err_ratio"] = out["grid_level"] / out["row_err"] if out["row_err"] > 0 else math.nan
    return out


def layers_across(ds: xr.Dataset | None, growth: float | None = None):
    """Per trained member with a by-layer growth (``gpu_layer_growth``): the layer whose dQ error grew most
    from mid-run to the end, that growth, how many of the layers grew more than ``growth``, and the
    correlation across layers of the logs of the dQ error's and the key offset's late growth (NaN with
    fewer than three layers or no spread)."""
    import pandas as pd

    from .gpu_training import GPU_GROWTH

    growth = GPU_GROWTH if growth is None else growth
    columns = ["attention", "top layer", "top dq growth", "layers grown", "layers", "across-layer corr (logs)"]
    table = gpu_layer_growth(ds) if _have(ds) else []
    if not len(table):
        return pd.DataFrame(columns=columns)
    rows = {}
    for key, sub in table.groupby(level=["run", "member"], sort=False):
        sub = sub.droplevel(["run", "member"])
        lg_err, lg_key = np.log(sub["dq growth"].values), np.log(sub["key offset growth"].values)
        across = (float(np.corrcoef(lg_err, lg_key)[0, 1]) if len(sub) >= 3 and np.std(lg_err) > 0
                  and np.std(lg_key) > 0 else math.nan)
        top = int(sub["dq growth"].idxmax())
        rows[key] = {"attention": sub["attention"].iloc[0], "top layer": top, "top dq growth": float(sub.loc[top, "dq growth"]),
                     "layers grown": int((sub["dq growth"] > growth).sum()), "layers": len(sub),
                     "across-layer corr (logs)": across}
    return pd.DataFrame.from_dict(rows, orient="index")[columns]


def offset_order(ds: xr.Dataset | None):
    """Per setting with an FP32-attention run and another run, over every logged step > 0 that all its
    trained members reached, one row per member: its attention family, the mean layer-mean ``dq_rel_err``
    and ``key_mean_norm``, its rank by each (1: smallest), at how many of those steps its layer-mean key
    offset is above the FP32 run's (of how many) and the last step it was below (NaN: never), and per
    setting whether the two orders agree (``same order``)."""
    import pandas as pd

    from .gpu_training import _family

    columns = ["attention", "family", "steps", "first step", "last step", "mean dq_rel_err", "mean key_mean_norm",
               "rank by dq_rel_err", "rank by key_mean_norm", "steps above FP32", "last below FP32", "same order"]
    rows = []
    for setting, members in (_settings(ds).items() if _have(ds) else []):
        fams = {key: _family(_kernel_of(ds, *key)) for key in members}
        ref = [key for key, fam in fams.items() if fam == "FP32"]
        at = _common_logged_steps(ds, members) if ref and len(members) >= 2 else []
        if len(at) < 2:
            continue
        offset = {k: ds["key_mean_norm"].sel(run=k[0], member=k[1], step=at).mean("layer").values for k in members}
        dq = {k: float(ds[GPU_DQ_METRIC].sel(run=k[0], member=k[1], step=at).mean("layer").mean()) for k in members}
        mean_offset = {k: float(np.mean(v)) for k, v in offset.items()}
        by_dq, by_offset = sorted(members, key=lambda k: dq[k]), sorted(members, key=lambda k: mean_offset[k])
        for key in members:
            above = offset[key] > offset[ref[0]]
            below = np.asarray(at)[~above]
            rows.append({"setting": setting, "run": key[0], "member": key[1], "attention": _kernel_of(ds, *key),
                         "family": fams[key], "steps": len(at), "first step": int(at[0]), "last step": int(at[-1]),
                         "mean dq_rel_err": dq[key], "mean key_mean_norm": mean_offset[key],
                         "rank by dq_rel_err": by_dq.index(key) + 1, "rank by key_mean_norm": by_offset.index(key) + 1,
                         "steps above FP32": math.nan if key == ref[0] else int(above.sum()),
                         "last below FP32": math.nan if key == ref[0] or not len(below) else int(below[-1]),
                         "same order": by_dq == by_offset})
    if not rows:
        return pd.DataFrame(columns=columns, index=pd.MultiIndex.from_arrays([[], [], []],
                                                                             names=["setting", "run", "member"]))
    return pd.DataFrame(rows).set_index(["setting", "run", "member"])[columns]


def memorisation(ds: xr.Dataset | None, val_rise: float | None = None, dq_rise: float | None = None):
    """One row per trained member: its lowest validation loss and its step, the training loss there, its
    last validation loss and step and how far above the minimum, its final training loss, the passes
    over its training split; ``memorises`` when the last validation loss is more than ``val_rise``
    (``GPU_VAL_RISE``) above the minimum while the training loss ends below its value there; for a
    memorising member with a dQ error, the layer-mean ``dq_rel_err`` at the last logged step at or before
    the minimum and at the end, and whether it grew by more than ``dq_rise`` (``GPU_DQ_LATE_RISE``)."""
    import pandas as pd

    from .gpu_training import GPU_DQ_LATE_RISE, GPU_VAL_RISE

    val_rise = GPU_VAL_RISE if val_rise is None else val_rise
    dq_rise = GPU_DQ_LATE_RISE if dq_rise is None else dq_rise
    columns = ["attention", "min val loss", "min val step", "train loss at min", "last val loss", "last val step",
               "val rise", "final loss", "passes", "memorises", "dq at min", "dq at end", "dq grew after min"]
    if not _have(ds):
        return pd.DataFrame(columns=columns)
    rows = {}
    for (run, member), row in gpu_training_table(ds).iterrows():
        one = ds.sel(run=run, member=member)
        val = one["val_loss"].dropna("step")
        low, low_step = row["min val loss"], row["min val loss step"]
        train_at_low = float(one["loss"].sel(step=low_step)) if math.isfinite(low_step) else math.nan
        rise = row["final val loss"] / low - 1 if low > 0 else math.nan
        memorises = bool(rise > val_rise and row["final loss"] < train_at_low)
        out = {"attention": row["attention"], "min val loss": low, "min val step": low_step,
               "train loss at min": train_at_low, "last val loss": row["final val loss"],
               "last val step": int(val["step"][-1]) if val.size else math.nan, "val rise": rise,
               "final loss": row["final loss"], "passes": row["passes"], "memorises": memorises,
               "dq at min": math.nan, "dq at end": math.nan, "dq grew after min": None}
        dq = one[GPU_DQ_METRIC].mean("layer").dropna("step")
        dq = dq.sel(step=dq["step"] > 0)
        before = dq.sel(step=dq["step"] <= low_step) if math.isfinite(low_step) else dq[:0]
        if memorises and before.size and float(dq[-1]) != 0:
            a, b = float(before[-1]), float(dq[-1])
            out.update({"dq at min": a, "dq at end": b, "dq grew after min": bool(b > (1 + dq_rise) * a)})
        rows[(run, member)] = out
    return pd.DataFrame.from_dict(rows, orient="index")[columns]


def records_run(ds: xr.Dataset, committed: xr.Dataset | None) -> xr.Dataset | None:
    """The records section 10 reads: ``ds`` when it gathered them (the ``gpu_training`` tier), else the
    committed ``gpu_training`` run (``committed``) when it holds records, else None (every table empty,
    every glued value n/a). A run gathered before the one record schema is read in it
    (``attnum.train.record.convert``: its whole-model ``grad_norm`` becomes ``grad_norm_total``, its
    per-block ``grad_norm_layer`` becomes ``grad_norm``)."""
    from ...train import record

    for run in (ds, committed):
        if _have(run):
            return record.convert(run)
    return None


def setting_of(ds: xr.Dataset | None, run) -> str | None:
    """The setting (``GPU_SETTING``: learning rate, clipping, weight decay, seeds) of ``run``; None without
    records or without such a run."""
    if not _have(ds) or not isinstance(run, str) or run not in ds["run"].values:
        return None
    return _setting_of(ds, run)
