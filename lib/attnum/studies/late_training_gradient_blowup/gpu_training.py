"""Study 04's ``gpu_training`` tier: gathers ``attnum.train``'s GPU training records (``lm_s04_*.nc``, the
``s04_*`` runs of params/lm/campaign.yaml), their per-layer series and ``record.summary``, the loss rise, the
records' provenance and GPU time, and where a mechanism grid run puts the blowup regime (``grid_regime``);
and the selectors of runs, settings and layers that the readings of those records share.
"""
from __future__ import annotations

import math

import numpy as np
import xarray as xr

from .readings import level_crossing
from .trainer import lm_record

GPU_PREFIX = "s04_"  # campaign runs of this study (params/lm/campaign.yaml); records lm_s04_*_s<seed>_d<seed>.nc
GPU_PATTERN = f"lm_{GPU_PREFIX}*.nc"
GPU_DQ_METRIC = "dq_rel_err"  # the main dQ metric of the records (attnum.train.record.VARIABLES says what it is)
GPU_SERIES = ("loss", "val_loss", "grad_norm_total", "grad_norm", "grad_norm_qk", "key_mean_norm", "key_norm",
              "key_mean_ratio", "offset_logit", "max_logit", "entropy", "max_prob", "dq_rel_err", "dq_row_rel_err",
              "dk_rel_err", "dv_rel_err", "grad_norm_ratio", "lr", "step_time_s", "tokens_per_s", "elapsed_s",
              "attn_fwd_s", "attn_fwd_bwd_s", "nonfinite_step", "attention_share", "steps_done", "tokens_done",
              "wall_s")
GPU_GROWTH = 2.0  # "the dQ error grew late": its last-fifth / first-fifth mean over layers above this
GPU_LOSS_RISE = 1.5  # "the loss blew up" without becoming non-finite: a logged loss above this x its running minimum
GPU_VAL_RISE = 0.05  # "memorising": the last validation loss above (1 + this) x its minimum, training loss still falling
GPU_SETTING = (("lr", "lr"), ("grad_clip", "clip"), ("weight_decay", "weight decay"), ("seed", "seed"),
               ("data_seed", "data seed"))  # runs compared at equal steps share these parameters
GPU_ATTRS = {
    "loss_rise": ("1", "largest ratio of a logged training loss to the lowest loss logged before it (above 1: the "
                       "loss rose)"),
    "blowup": ("1", "1 if the training loss became non-finite or rose above GPU_LOSS_RISE x its running minimum"),
    "max_key_mean_ratio": ("1", "largest norm of the mean key / mean key norm over steps and layers"),
    "max_offset_spread": ("1", "largest r / sqrt(1 - r^2) over steps and layers, r = key_mean_ratio: the common key "
                               "offset over the keys' spread about it (|mu| / sqrt(d) for the grid's keys)"),
    "campaign_gpu_s": ("s", "GPU time of the gathered records: the sum of their wall_s (whole command from "
                            "process start)"),
    "campaign_all_gpu_s": ("s", "GPU time of every record in the folder (both studies' runs and the pilot): the sum "
                                "of their wall_s"),
    "grid_mu_at_level": ("1", "|mu| at which the mechanism grid's median row dQ error (bf16 flash emulator) "
                              "reaches the level"),
    "grid_offset_spread_at_level": ("1", "the grid's |mu| / sqrt(d) at that |mu|: the key offset over the keys' "
                                         "spread about it (keys i.i.d. N(0, 1) plus mu)"),
    "grid_dq_err_no_offset": ("1", "the mechanism grid's median row dQ error at |mu| = 0 (same variant and point)"),
}


def check_gpu_records(folder):
    """The records folder, or a FileNotFoundError naming what is missing (before any work)."""
    record = lm_record()

    return record.require_records(folder, GPU_PATTERN, record.campaign_runs(GPU_PREFIX),
                                  "for study 04 (late_training_gradient_blowup)")


def _loss_rise(loss: np.ndarray) -> float:
    loss = np.asarray(loss, dtype=float)
    best, worst = math.inf, math.nan
    for value in loss:
        if not math.isfinite(value):
            continue
        if math.isfinite(best) and best > 0:
            worst = max(worst, value / best) if math.isfinite(worst) else value / best
        best = min(best, value)
    return worst


def grid_regime(mech: xr.Dataset | None, level: float, *, context: int = 1024) -> dict:
    """Where the mechanism grid (``mech_dq_err``, a run of this study's grid, e.g. the committed
    ``gpu`` run) puts the start of the blowup regime: the |mu| at which the bf16 flash emulator's
    median row dQ error reaches ``level`` at the first sharpness, the N nearest ``context`` and the
    grid's first d; NaNs without a grid."""
    nan = {"grid_mu_at_level": math.nan, "grid_offset_spread_at_level": math.nan, "grid_dq_err_no_offset": math.nan,
           "grid_point": "no mechanism grid"}
    if mech is None or "mech_dq_err" not in mech:
        return nan
    variant = "bf16_fused" if "bf16_fused" in mech["variant"].values else "bf16"
    n = mech["seq_len"].values
    seq = int(n[np.argmin(np.abs(np.log(n / context)))])
    sub = mech["mech_dq_err"].sel(variant=variant, seq_len=seq).isel(sharpness=0, head_dim=0).median("seed")
    d = int(mech["head_dim"].values[0])
    mu = float(level_crossing(sub.rename("mech_dq_err"), "mu_norm", level))
    no_offset = float(sub.sel(mu_norm=0.0)) if 0.0 in sub["mu_norm"].values else math.nan
    return {"grid_mu_at_level": mu, "grid_offset_spread_at_level": mu / math.sqrt(d), "grid_dq_err_no_offset": no_offset,
            "grid_point": f"{variant}, sharpness {float(mech['sharpness'][0]):g}, N = {seq}, d = {d}, "
                          f"{mech.attrs.get('device', '?')}, commit {str(mech.attrs.get('git_commit', '?'))[:12]}"}


def gpu_training_dataset(folder, mech: xr.Dataset | None, level: float) -> xr.Dataset:
    """This study's GPU training records under ``folder`` gathered (``attnum.train.record.gather``: one
    ``run`` per record, outer join on steps), the per-layer series kept (no weight sketches),
    ``record.summary``'s numbers as ``sum_*`` per run and member, the loss rise and blowup flag, the
    records' own provenance as ``prov_*`` coordinates, the campaign's GPU time and, from ``mech``
    (a run with the mechanism grid), where the grid puts the blowup regime (``grid_*``)."""
    import json

    record = lm_record()

    folder = check_gpu_records(folder)
    gathered = record.gather(folder, GPU_PATTERN)
    out = gathered[[v for v in GPU_SERIES if v in gathered]]
    out = out.drop_dims([d for d in ("tensor", "sketch", "snapshot") if d in out.dims], errors="ignore")
    table = record.summary(gathered)
    for name in table.data_vars:
        out[f"sum_{name}"] = table[name]
    rise = xr.apply_ufunc(_loss_rise, gathered["loss"], input_core_dims=[["step"]], vectorize=True)
    out["sum_loss_rise"] = rise
    out["sum_blowup"] = ((table["diverged"] == 1) | (rise > GPU_LOSS_RISE)).astype(float).where(
        table["diverged"].notnull())
    ratio = gathered["key_mean_ratio"].isel(step=slice(1, None))
    out["sum_max_key_mean_ratio"] = ratio.max(("step", "layer"))
    out["sum_max_offset_spread"] = _offset_over_spread(ratio).max(("step", "layer"))
    out["campaign_gpu_s"] = float(gathered["wall_s"].sum())
    out["campaign_all_gpu_s"], out.attrs["records_in_folder"] = record.total_wall_s(folder)
    regime = grid_regime(mech, level)
    for key in ("grid_mu_at_level", "grid_offset_spread_at_level", "grid_dq_err_no_offset"):
        out[key] = regime[key]
    out.attrs["grid_point"] = regime["grid_point"]
    out.attrs["grid_level"] = level
    out = out.assign_coords(record.provenance(folder, GPU_PATTERN).coords)
    out.attrs["records_folder"] = str(folder)
    out.attrs["records"] = json.dumps(sorted(str(r) for r in out["run"].values))
    out.attrs["missing_runs"] = json.dumps(record.missing_runs(folder, record.campaign_runs(GPU_PREFIX)))
    for name, (units, long_name) in GPU_ATTRS.items():
        for var in (name, f"sum_{name}"):
            if var in out:
                out[var].attrs.update(units=units, long_name=long_name)
    return out


def _offset_over_spread(ratio):
    """The common key offset over the keys' spread about it, r / sqrt(1 - r^2) for r = key_mean_ratio (the mean
    key's norm over the mean key norm), the measure the mechanism grid's |mu| / sqrt(d) is set against."""
    return ratio / np.sqrt(np.clip(1 - ratio ** 2, 1e-300, None))


def _kernel_of(ds: xr.Dataset, run: str, member: str = "a") -> str:
    return str(ds["member_attention"].sel(run=run, member=member).values)


def _step_or_nan(step: float):
    return int(step) if math.isfinite(step) else math.nan


def _family(attention: str) -> str:
    if "gproj" in attention:
        return "GProj"
    if attention.startswith("sdpa:math") and attention.endswith("@fp32"):
        return "FP32"
    if attention.startswith("sdpa:flash"):
        return "sdpa:flash"
    return attention


def _setting_of(ds: xr.Dataset, run) -> str:
    import json

    params = lm_record().convert_parameters(json.loads(str(ds["run_parameters"].sel(run=run).values)))
    return ", ".join(f"{label} {params.get(key)!s}" for key, label in GPU_SETTING)


def _trained_members(ds: xr.Dataset, run) -> list[str]:
    return [str(m) for m in ds["member"].values
            if np.isfinite(ds["loss"].sel(run=run, member=m).values[1:]).any()]


def _settings(ds: xr.Dataset) -> dict[str, list[tuple[str, str]]]:
    """The trained (run, member) pairs grouped by setting (``GPU_SETTING``), in record order."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for run in ds["run"].values:
        for member in _trained_members(ds, run):
            groups.setdefault(_setting_of(ds, run), []).append((str(run), member))
    return groups


def _common_logged_steps(ds: xr.Dataset, members) -> np.ndarray:
    """The logged steps > 0 at which every one of ``members`` ((run, member) pairs) has a training loss."""
    steps = ds["step"].values
    logged = np.all([np.isfinite(ds["loss"].sel(run=r, member=m).values) for r, m in members], axis=0)
    return steps[logged & (steps > 0)]


GPU_DQ_LATE_RISE = 0.1  # the dQ error "grew after the validation minimum" by more than this fraction


GPU_DQ_PASS = 0.1  # "the dQ error passed" this relative error in a layer: ten times a bf16 kernel's usual ~1%


def _passes(ds: xr.Dataset, run: str, member: str, level: float) -> list[tuple[int, int]]:
    """(layer, first logged step > 0 at which its dQ error passed ``level``) for one trained member."""
    dq = ds[GPU_DQ_METRIC].sel(run=run, member=member)
    dq = dq.sel(step=dq["step"] > 0)
    out = []
    for layer in dq["layer"].values:
        d = dq.sel(layer=layer).dropna("step")
        if d.size and float(d.max()) > level:
            out.append((int(layer), int(d["step"][int(np.argmax(d.values > level))])))
    return out
