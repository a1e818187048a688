"""Study 04's designed experiment: does the BF16 backward's dQ error matter when attention logits grow?

The experiment is a sweep file (``params/lm/lr_sweep.yaml``, run by ``python -m attnum.train sweep``): small
byte-level models trained at learning rates around the edge of stability (Wortsman et al. 2023, "Small-scale
proxies for large-scale Transformer training instabilities", arXiv 2309.14322: small models at high learning
rates reproduce the attention-logit growth of large runs; qk-layernorm removes it), the attention kernel the
other axis, every arm started from the same weights on the same batches per seed. Its records and the plan
copied beside them (``sweep.yaml``, with the analysis stated before the runs) are gathered here:

``sweep_dataset(folder)``
    one Dataset, dims ``dx_arm`` x ``dx_lr`` x ``dx_seed`` (and ``dx_step`` for the series), variables ``dx_*``;
    a run that is not in the folder is NaN (``dx_ran`` 0).

The readings (numbers and tables, no English; the notebook states them through ``attnum.glue``):

``endpoint``      the final validation loss; a run whose loss became non-finite counts as the loss at step 0
                  (Wortsman et al.'s min(loss, loss at initialisation))
``contrasts``     per contrast of the plan and design learning rate: the paired difference first - second over
                  the seeds that have both, its mean and two-sided t interval, and the reading of the interval
                  against the plan's margin (``READINGS``)
``turn_up``       per arm and seed: the smallest design learning rate whose endpoint exceeds that arm and seed's
                  best by more than the margin (where its curve turns up), and per arm against the reference:
                  in how many seeds it turns up lower, at the same rate, or higher
``regime``        per arm and learning rate: how many runs reached the regime (a layer's dQ error past the
                  plan's level), the median largest dQ error, the median in-situ signature
                  |cos(dQ error, (P K)_i)| at the logged steps past the level, the largest logit
``verdict``       the answers the analysis gives, as values
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr
from scipy import stats

from .trainer import lm_record, lm_sweep

PREFIX = "dx_"
READINGS = ("higher", "lower", "within margin", "cannot tell")  # of a paired interval (see ``read_interval``)
VALUE_KEYS = ('dx_log_every', 'dx_t_three', 'dx_spacing_min', 'dx_spacing_max', 'dx_n_layer', 'dx_d_model',
              'dx_n_head', 'dx_context', 'dx_batch_size', 'dx_steps', 'dx_warmup_steps', 'dx_grad_clip', 'dx_tokens',
              'dx_lrs', 'dx_range_lrs', 'dx_seeds_planned', 'dx_arms', 'dx_plan_sha256', 'dx_commits', 'dx_gpus',
              'dx_seeds_min', 'dx_seeds_max', 'dx_margin', 'dx_confidence', 'dx_level', 'dx_runs', 'dx_planned',
              'dx_design_runs', 'dx_gpu_s', 'dx_name', 'dx_dq_effect', 'dx_dq_effect_lrs', 'dx_dq_effect_widest',
              'dx_dq_effect_n_min', 'dx_dq_effect_n_max', 'dx_gproj_vs_fp32', 'dx_fp32_turn_up_seeds',
              'dx_fp32_curve_seeds', 'dx_fp32_unstable', 'dx_fp32_turn_up_lr', 'dx_triton_turn_seeds',
              'dx_triton_turn_lower', 'dx_triton_turn_same', 'dx_triton_turn_higher', 'dx_flash_turn_seeds',
              'dx_flash_turn_lower', 'dx_flash_turn_same', 'dx_flash_turn_higher', 'dx_gproj_turn_seeds',
              'dx_gproj_turn_lower', 'dx_gproj_turn_same', 'dx_gproj_turn_higher', 'dx_qkln_lr', 'dx_qkln_diff',
              'dx_qkln_lo', 'dx_qkln_hi', 'dx_qkln_n', 'dx_qkln_reading', 'dx_triton_regime_runs', 'dx_triton_max_dq',
              'dx_flash_regime_runs', 'dx_flash_max_dq', 'dx_gproj_regime_runs', 'dx_gproj_max_dq',
              'dx_fp32_regime_runs', 'dx_fp32_max_dq', 'dx_flash_qkln_regime_runs', 'dx_flash_qkln_max_dq',
              'dx_signature_median', 'dx_key_mean_ratio_top', 'dx_max_logit_top', 'dx_mechanism_seen',
              'dx_fp32_unstable_word', 'dx_mechanism_word', 'dx_triton_regime_lr', 'dx_gproj_regime_lr')  # what ``values`` returns
SERIES = ("loss", "max_logit", "dq_rel_err", "key_mean_ratio", "grad_norm_total")  # per logged step (layer max)

ATTRS = {
    "dx_final_val_loss": ("nat", "validation loss after the last step (NaN: the run is missing)"),
    "dx_init_val_loss": ("nat", "validation loss at step 0"),
    "dx_endpoint": ("nat", "the analysis' endpoint: final validation loss, or the loss at step 0 for a run whose "
                           "loss became non-finite"),
    "dx_diverged": ("1", "1 if the training loss became non-finite"),
    "dx_ran": ("1", "1 if the folder holds this run's record"),
    "dx_in_design": ("1", "1 if the run is in the design (0: the plan's range, shown, not analysed)"),
    "dx_max_logit": ("1", "largest scaled attention logit over logged steps and layers"),
    "dx_max_dq_rel_err": ("1", "largest global dQ relative error against the FP32 recompute over logged steps and layers"),
    "dx_max_dq_row_rel_err": ("1", "largest median-row dQ error against the FP32 recompute over logged steps and layers"),
    "dx_max_dk_rel_err": ("1", "largest global dK relative error against the FP32 recompute"),
    "dx_max_dv_rel_err": ("1", "largest global dV relative error against the FP32 recompute"),
    "dx_max_key_mean_ratio": ("1", "largest ||mean key|| / mean key norm over logged steps (after step 0) and layers"),
    "dx_signature": ("1", "median |cos(dQ error, (P K)_i)| over the (step, layer) points whose dQ error passed the "
                          "regime level (NaN: none did)"),
    "dx_max_grad_norm": ("1", "largest logged global gradient norm (before clipping)"),
    "dx_wall_s": ("s", "wall clock of the run's process"),
    "dx_loss": ("nat", "training loss over the logged interval"),
    "dx_max_logit_t": ("1", "largest scaled attention logit over layers at the logged step"),
    "dx_dq_rel_err_t": ("1", "largest global dQ relative error over layers at the logged step"),
    "dx_key_mean_ratio_t": ("1", "largest ||mean key|| / mean key norm over layers at the logged step"),
    "dx_grad_norm_total_t": ("1", "global gradient norm (before clipping) at the logged step"),
}


def plan(folder) -> dict:
    """The sweep plan the records were made under: the ``sweep.yaml`` copied beside them, checked as the
    sweep checks it (``attnum.train.sweep.load``); a clear error if the folder has none."""
    from ...paths import project_root

    folder = Path(folder).expanduser()
    folder = folder if folder.is_absolute() else project_root() / folder
    path = folder / lm_sweep().PLAN
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no sweep plan {lm_sweep().PLAN} beside the records (python -m attnum.train "
                                "sweep copies it there)")
    return lm_sweep().load(path)


def sweep_dataset(folder) -> xr.Dataset:
    """The sweep's records under ``folder`` as one Dataset (see the module docstring); attrs: the plan's
    text, sha256 and analysis (JSON), the records' commits and GPUs."""
    record, sweep = lm_record(), lm_sweep()
    spec = plan(folder)
    folder = Path(spec["_source"]).parent
    gathered = record.gather(folder, f"lm_{spec['name']}_*.nc")
    all_runs = sweep.runs(spec)
    arms = list(spec["arms"])
    lrs = sorted({r.lr for r in all_runs})
    seeds = sorted({r.seed for r in all_runs})
    steps = gathered["step"].values
    shape = (len(arms), len(lrs), len(seeds))
    scalars = {name: np.full(shape, np.nan) for name in ATTRS if not name.endswith("_t") and name != "dx_loss"}
    series = {name: np.full(shape + (len(steps),), np.nan) for name in ATTRS if name.endswith("_t") or name == "dx_loss"}
    design = np.zeros(shape)
    for r in all_runs:
        design[arms.index(r.arm), lrs.index(r.lr), seeds.index(r.seed)] = float(r.in_design)
    level = float(spec["analysis"].get("regime_dq_err", 0.1))
    by_name = {Path(r.record).stem: r for r in all_runs}
    commits, gpus = set(), set()
    for run in gathered["run"].values:
        if run not in by_name:
            continue
        r = by_name[run]
        i = (arms.index(r.arm), lrs.index(r.lr), seeds.index(r.seed))
        d = gathered.sel(run=run).isel(member=0)
        val = d["val_loss"].dropna("step")
        scalars["dx_ran"][i] = 1.0
        scalars["dx_final_val_loss"][i] = float(val[-1]) if val.size else math.nan
        scalars["dx_init_val_loss"][i] = float(d["val_loss"].sel(step=0)) if 0 in d["step"].values else math.nan
        diverged = int(d["nonfinite_step"]) >= 0
        scalars["dx_diverged"][i] = float(diverged)
        later = d.isel(step=slice(1, None))
        for name, var in (("dx_max_logit", "max_logit"), ("dx_max_dq_rel_err", "dq_rel_err"),
                          ("dx_max_dq_row_rel_err", "dq_row_rel_err"), ("dx_max_dk_rel_err", "dk_rel_err"),
                          ("dx_max_dv_rel_err", "dv_rel_err"), ("dx_max_key_mean_ratio", "key_mean_ratio"),
                          ("dx_max_grad_norm", "grad_norm_total")):
            values = later[var].values
            scalars[name][i] = float(np.nanmax(values)) if np.isfinite(values).any() or np.isinf(values).any() \
                else math.nan
        passed = later["dq_rel_err"] > level
        sig = later["dq_err_pk_cos"].where(passed).values if "dq_err_pk_cos" in later else np.array([np.nan])
        scalars["dx_signature"][i] = float(np.nanmedian(sig)) if np.isfinite(sig).any() else math.nan
        scalars["dx_wall_s"][i] = float(gathered["wall_s"].sel(run=run))
        series["dx_loss"][i] = d["loss"].values
        for name, var in (("dx_max_logit_t", "max_logit"), ("dx_dq_rel_err_t", "dq_rel_err"),
                          ("dx_key_mean_ratio_t", "key_mean_ratio")):
            values = d[var].values
            with np.errstate(invalid="ignore"):
                series[name][i] = np.where(np.isnan(values).all(-1), np.nan, np.nanmax(
                    np.where(np.isnan(values), -np.inf, values), axis=-1))
        series["dx_grad_norm_total_t"][i] = d["grad_norm_total"].values
        commits.add(str(gathered["run_git_commit"].sel(run=run).values))
        gpus.add(str(gathered["run_gpu"].sel(run=run).values))
    scalars["dx_in_design"] = design
    scalars["dx_endpoint"] = np.where(scalars["dx_diverged"] == 1, scalars["dx_init_val_loss"],
                                      scalars["dx_final_val_loss"])
    dims = ("dx_arm", "dx_lr", "dx_seed")
    out = xr.Dataset({name: (dims, values) for name, values in scalars.items()}
                     | {name: (dims + ("dx_step",), values) for name, values in series.items()},
                     coords={"dx_arm": arms, "dx_lr": lrs, "dx_seed": seeds, "dx_step": steps,
                             "dx_kernel": ("dx_arm", [spec["arms"][a].get("kernel", "sdpa:flash") for a in arms]),
                             "dx_qk_norm": ("dx_arm", [bool(spec["arms"][a].get("qk_norm", False)) for a in arms])})
    for name in out.data_vars:
        units, long_name = ATTRS[name]
        out[name].attrs.update(units=units, long_name=long_name)
    if not any(by_name.get(str(r)) for r in gathered["run"].values):
        raise FileNotFoundError(f"{folder}: none of the plan's records (lm_{spec['name']}_*.nc) is there")
    out.attrs.update(dx_plan=Path(folder, sweep.PLAN).read_text(), dx_plan_sha256=spec["_sha256"],
                     dx_analysis=json.dumps(spec["analysis"], sort_keys=True), dx_name=spec["name"],
                     dx_base=json.dumps(spec["base"], sort_keys=True),
                     dx_commits=json.dumps(sorted(commits)), dx_gpus=json.dumps(sorted(gpus)),
                     dx_design_lrs=json.dumps(sorted(float(x) for x in spec["lrs"])),
                     dx_design_seeds=json.dumps(sorted(int(x) for x in spec["seeds"])))
    return out


def has_sweep(ds: xr.Dataset | None) -> bool:
    return ds is not None and "dx_endpoint" in ds and "dx_analysis" in ds.attrs


def designed_run(ds: xr.Dataset, committed: xr.Dataset | None) -> xr.Dataset | None:
    """The sweep section 11 reads: ``ds`` when it gathered one (the ``gpu_training`` tier), else the committed
    ``gpu_training`` run's, else None."""
    for run in (ds, committed):
        if has_sweep(run):
            return run
    return None


def values(ds: xr.Dataset | None) -> dict:
    """``design_values`` and ``verdict`` together; every key None (glued as n/a) without a sweep."""
    if not has_sweep(ds):
        return dict.fromkeys(VALUE_KEYS)
    merged = {**design_values(ds), **verdict(ds)}
    return {key: merged.get(key) for key in VALUE_KEYS}


def tables(ds: xr.Dataset | None) -> dict[str, pd.DataFrame]:
    """The section's tables (empty without a sweep): endpoint, contrasts, turn-up (per seed and counts), regime."""
    if not has_sweep(ds):
        return {k: pd.DataFrame() for k in ("endpoint", "contrasts", "turn_up", "turn_up_counts", "regime")}
    per, counts = turn_up(ds)
    return {"endpoint": endpoint_table(ds), "contrasts": contrasts(ds), "turn_up": per, "turn_up_counts": counts,
            "regime": regime(ds)}


def design_values(ds: xr.Dataset) -> dict:
    """The design as the plan states it (glue values): the model, the steps and tokens, the rates, seeds and arms."""
    base = json.loads(ds.attrs["dx_base"])
    arms = {str(a): str(k) + (" + qk-layernorm" if q else "") for a, k, q in
            zip(ds["dx_arm"].values, ds["dx_kernel"].values, ds["dx_qk_norm"].values)}
    seeds = json.loads(ds.attrs["dx_design_seeds"])
    lrs = design_lrs(ds)
    ratios = [b / a for a, b in zip(lrs, lrs[1:])]
    conf = float(analysis(ds)["confidence"])
    return {"dx_log_every": base.get("log_every"), "dx_t_three": float(stats.t.ppf(0.5 + conf / 2, 2)),
            "dx_spacing_min": min(ratios) if ratios else None, "dx_spacing_max": max(ratios) if ratios else None,
            "dx_n_layer": base.get("n_layer"), "dx_d_model": base.get("d_model"), "dx_n_head": base.get("n_head"),
            "dx_context": base.get("context"), "dx_batch_size": base.get("batch_size"), "dx_steps": base.get("steps"),
            "dx_warmup_steps": base.get("warmup_steps"), "dx_grad_clip": base.get("grad_clip"),
            "dx_tokens": int(base.get("steps", 0)) * int(base.get("batch_size", 0)) * int(base.get("context", 0)),
            "dx_lrs": ", ".join(f"{x:g}" for x in design_lrs(ds)),
            "dx_range_lrs": ", ".join(f"{float(x):g}" for x in ds["dx_lr"].values if float(x) not in design_lrs(ds))
            or "none",
            "dx_seeds_planned": len(seeds), "dx_arms": "; ".join(f"{a}: {k}" for a, k in arms.items()),
            "dx_plan_sha256": ds.attrs["dx_plan_sha256"][:12], "dx_commits": ", ".join(
                c[:7] for c in json.loads(ds.attrs["dx_commits"])), "dx_gpus": ", ".join(json.loads(ds.attrs["dx_gpus"])),
            "dx_seeds_min": int((ds["dx_ran"] * ds["dx_in_design"]).sum("dx_seed").where(
                ds["dx_in_design"].max("dx_seed") == 1).min()),
            "dx_seeds_max": int((ds["dx_ran"] * ds["dx_in_design"]).sum("dx_seed").max())}


def analysis(ds: xr.Dataset) -> dict:
    return json.loads(ds.attrs["dx_analysis"])


def design_lrs(ds: xr.Dataset) -> list[float]:
    return json.loads(ds.attrs["dx_design_lrs"])


def _design_endpoint(ds: xr.Dataset) -> xr.DataArray:
    return ds["dx_endpoint"].where(ds["dx_in_design"] == 1).sel(dx_lr=design_lrs(ds))


def read_interval(lo: float, hi: float, margin: float) -> str:
    """The reading of a paired interval [lo, hi] of first - second: "higher" (lo > 0), "lower" (hi < 0),
    "within margin" (inside (-margin, margin), zero included) or "cannot tell" (zero inside, the interval
    wider than the margin); "cannot tell" without an interval."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "cannot tell"
    if lo > 0:
        return "higher"
    if hi < 0:
        return "lower"
    if -margin < lo and hi < margin:
        return "within margin"
    return "cannot tell"


def t_interval(values, confidence: float) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n) of the two-sided Student t interval of the mean; NaN bounds below two values."""
    x = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    n = len(x)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = float(x.mean())
    if n < 2:
        return mean, math.nan, math.nan, n
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return mean, mean - half, mean + half, n


def contrasts(ds: xr.Dataset) -> pd.DataFrame:
    """Per contrast (first, second) of the plan and design learning rate: n (seeds with both), the mean paired
    difference of the endpoint, its t interval at the plan's confidence, the reading against the margin."""
    a = analysis(ds)
    end = _design_endpoint(ds)
    rows = []
    for first, second in a["contrasts"]:
        for lr in design_lrs(ds):
            diff = (end.sel(dx_arm=first, dx_lr=lr) - end.sel(dx_arm=second, dx_lr=lr)).values
            mean, lo, hi, n = t_interval(diff, a["confidence"])
            rows.append({"first": first, "second": second, "lr": lr, "n": n, "mean": mean, "lo": lo, "hi": hi,
                         "reading": read_interval(lo, hi, a["margin_nat"])})
    return pd.DataFrame(rows)


def turn_up(ds: xr.Dataset) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per arm and seed: the turn-up learning rate, NaN if the curve never rises past the margin or the seed
    has fewer than two design rates; per arm: seeds with both its turn-up and the reference's, and in how many
    it turns up at a lower, the same or a higher rate than the reference)."""
    a = analysis(ds)
    end = _design_endpoint(ds)
    lrs = np.array(design_lrs(ds))
    per = {}
    for arm in end["dx_arm"].values:
        for seed in end["dx_seed"].values:
            y = end.sel(dx_arm=arm, dx_seed=seed).values
            ok = np.isfinite(y)
            if ok.sum() < 2:
                per[(arm, int(seed))] = math.nan
                continue
            best = np.nanmin(y)
            up = [lr for lr, v in zip(lrs, y) if np.isfinite(v) and v > best + a["margin_nat"]]
            per[(arm, int(seed))] = float(min(up)) if up else math.inf
    table = pd.Series(per).unstack()
    ref = a["reference"]
    rows = []
    for arm in table.index:
        if arm == ref:
            continue
        both = [s for s in table.columns if np.isfinite(table.loc[arm, s]) or np.isinf(table.loc[arm, s])]
        both = [s for s in both if not np.isnan(table.loc[ref, s])]
        x, r = table.loc[arm, both].astype(float), table.loc[ref, both].astype(float)
        rows.append({"arm": arm, "seeds": len(both), "lower": int((x < r).sum()), "same": int((x == r).sum()),
                     "higher": int((x > r).sum())})
    return table, pd.DataFrame(rows).set_index("arm") if rows else pd.DataFrame()


def regime(ds: xr.Dataset) -> pd.DataFrame:
    """Per arm and learning rate (design and range): runs, runs in the regime, median largest dQ error,
    median signature, median largest logit, median largest key-mean ratio, median endpoint."""
    level = float(analysis(ds).get("regime_dq_err", 0.1))
    rows = []
    for arm in ds["dx_arm"].values:
        for lr in ds["dx_lr"].values:
            sub = ds.sel(dx_arm=arm, dx_lr=lr)
            ran = sub["dx_ran"].values == 1
            if not ran.any():
                continue
            dq = sub["dx_max_dq_rel_err"].values[ran]
            rows.append({"arm": arm, "lr": float(lr), "runs": int(ran.sum()),
                         "in regime": int((dq > level).sum()),
                         "max dQ error (median)": float(np.median(dq)),
                         "signature (median)": float(np.nanmedian(sub["dx_signature"].values[ran]))
                         if np.isfinite(sub["dx_signature"].values[ran]).any() else math.nan,
                         "max logit (median)": float(np.median(sub["dx_max_logit"].values[ran])),
                         "key-mean ratio (median)": float(np.median(sub["dx_max_key_mean_ratio"].values[ran])),
                         "endpoint (median)": float(np.median(sub["dx_endpoint"].values[ran])),
                         "diverged": int(np.nansum(sub["dx_diverged"].values[ran]))})
    return pd.DataFrame(rows)


def endpoint_table(ds: xr.Dataset) -> pd.DataFrame:
    """Endpoint per arm (rows) and learning rate (columns): "median [min, max] (n)" as numbers in columns."""
    end = ds["dx_endpoint"].where(ds["dx_ran"] == 1)
    rows = []
    for arm in end["dx_arm"].values:
        for lr in end["dx_lr"].values:
            v = end.sel(dx_arm=arm, dx_lr=lr).values
            v = v[np.isfinite(v)]
            if v.size:
                rows.append({"arm": arm, "lr": float(lr), "n": int(v.size), "median": float(np.median(v)),
                             "min": float(v.min()), "max": float(v.max())})
    return pd.DataFrame(rows)


def _contrast(table: pd.DataFrame, first: str, second: str) -> pd.DataFrame:
    return table[(table["first"] == first) & (table["second"] == second)]


def verdict(ds: xr.Dataset) -> dict:
    """The analysis' answers as values (the notebook's glue): for each question the reading and the numbers it
    rests on. ``dq_effect``: triton - gproj (same forward; only dQ's rounding differs) at the design rates where
    the Triton arm's runs reached the regime: "higher" if any interval lies above 0, "within margin" if every one
    lies inside the margin, else "cannot tell"; "not reached" if no such rate. ``gproj_vs_fp32``: the same
    reading of gproj - fp32 over every design rate. ``fp32_unstable``: the reference arm's curve turns up in
    every seed that has one. ``qk_norm_removes``: flash - flash_qkln lies above 0 at the highest design rate with
    an interval."""
    a = analysis(ds)
    table = contrasts(ds)
    reg = regime(ds)
    level = float(a.get("regime_dq_err", 0.1))
    out = {"dx_margin": float(a["margin_nat"]), "dx_confidence": float(a["confidence"]), "dx_level": level,
           "dx_runs": int(ds["dx_ran"].sum()), "dx_planned": int(ds["dx_in_design"].sum()),
           "dx_design_runs": int(((ds["dx_ran"] == 1) & (ds["dx_in_design"] == 1)).sum()),
           "dx_gpu_s": float(ds["dx_wall_s"].sum()), "dx_name": ds.attrs["dx_name"]}

    def reading(rows: pd.DataFrame) -> str:
        if rows.empty:
            return "not reached"
        if (rows["reading"] == "higher").any():
            return "higher"
        if (rows["reading"] == "within margin").all():
            return "within margin"
        if (rows["reading"] == "lower").any() and not (rows["reading"] == "higher").any() and \
                (rows["reading"].isin(["lower", "within margin"])).all():
            return "lower"
        return "cannot tell"

    triton_in = reg[(reg["arm"] == "triton") & (reg["in regime"] > 0)]["lr"].tolist() if len(reg) else []
    design = design_lrs(ds)
    rows = _contrast(table, "triton", "gproj")
    rows = rows[rows["lr"].isin([x for x in triton_in if x in design])]
    out["dx_dq_effect"] = reading(rows)
    out["dx_dq_effect_lrs"] = ", ".join(f"{x:g}" for x in rows["lr"]) or "none"
    out["dx_dq_effect_widest"] = float((rows["hi"] - rows["lo"]).max()) if len(rows) else math.nan
    out["dx_dq_effect_n_min"] = int(rows["n"].min()) if len(rows) else 0
    out["dx_dq_effect_n_max"] = int(rows["n"].max()) if len(rows) else 0
    g = _contrast(table, "gproj", "fp32")
    out["dx_gproj_vs_fp32"] = reading(g[g["n"] >= 2])
    ups, counts = turn_up(ds)
    ref = a["reference"]
    fp = ups.loc[ref] if ref in ups.index else pd.Series(dtype=float)
    fp = fp[~fp.isna()]
    out["dx_fp32_turn_up_seeds"] = int(np.isfinite(fp.astype(float)).sum())
    out["dx_fp32_curve_seeds"] = int(len(fp))
    out["dx_fp32_unstable"] = bool(len(fp) and np.isfinite(fp.astype(float)).all())
    finite = fp.astype(float)[np.isfinite(fp.astype(float))]
    out["dx_fp32_turn_up_lr"] = ", ".join(f"{x:g}" for x in sorted(set(finite))) or "none"
    for arm in ("triton", "flash", "gproj"):
        if arm in counts.index:
            c = counts.loc[arm]
            out.update({f"dx_{arm}_turn_seeds": int(c["seeds"]), f"dx_{arm}_turn_lower": int(c["lower"]),
                        f"dx_{arm}_turn_same": int(c["same"]), f"dx_{arm}_turn_higher": int(c["higher"])})
    q = _contrast(table, "flash", "flash_qkln")
    q = q[q["n"] >= 2]
    if len(q):
        top = q.iloc[int(np.argmax(q["lr"].values))]
        out.update(dx_qkln_lr=float(top["lr"]), dx_qkln_diff=float(top["mean"]), dx_qkln_lo=float(top["lo"]),
                   dx_qkln_hi=float(top["hi"]), dx_qkln_n=int(top["n"]), dx_qkln_reading=str(top["reading"]))
    else:
        out.update(dx_qkln_lr=math.nan, dx_qkln_diff=math.nan, dx_qkln_lo=math.nan, dx_qkln_hi=math.nan,
                   dx_qkln_n=0, dx_qkln_reading="cannot tell")
    for arm in ("triton", "flash", "gproj", "fp32", "flash_qkln"):
        sub = reg[reg["arm"] == arm] if len(reg) else reg
        out[f"dx_{arm}_regime_runs"] = int(sub["in regime"].sum()) if len(sub) else 0
        out[f"dx_{arm}_max_dq"] = float(np.nanmax(ds["dx_max_dq_rel_err"].sel(dx_arm=arm).where(
            np.isfinite(ds["dx_max_dq_rel_err"].sel(dx_arm=arm))).values)) if arm in ds["dx_arm"].values and \
            np.isfinite(ds["dx_max_dq_rel_err"].sel(dx_arm=arm).values).any() else math.nan
    sig = ds["dx_signature"].sel(dx_arm=[x for x in ("triton", "flash") if x in ds["dx_arm"].values]).values
    out["dx_signature_median"] = float(np.nanmedian(sig)) if np.isfinite(sig).any() else math.nan
    out["dx_key_mean_ratio_top"] = float(np.nanmax(ds["dx_max_key_mean_ratio"].values))
    out["dx_max_logit_top"] = float(np.nanmax(ds["dx_max_logit"].values))
    out["dx_mechanism_seen"] = bool(np.isfinite(out["dx_triton_max_dq"]) and out["dx_triton_max_dq"] > 1
                                    and np.isfinite(out["dx_signature_median"]) and out["dx_signature_median"] > 0.9)
    out["dx_fp32_unstable_word"] = "every" if out["dx_fp32_unstable"] else "not every"
    out["dx_mechanism_word"] = "reached" if out["dx_mechanism_seen"] else "not reached"
    out["dx_triton_regime_lr"] = regime_lr_of(reg, "triton")
    out["dx_gproj_regime_lr"] = regime_lr_of(reg, "gproj")
    return out


def regime_lr_of(reg: pd.DataFrame, arm: str) -> float:
    """The lowest learning rate at which some run of ``arm`` reached the regime (NaN: none), from ``regime``."""
    if not len(reg):
        return math.nan
    sub = reg[(reg["arm"] == arm) & (reg["in regime"] > 0)]
    return float(sub["lr"].min()) if len(sub) else math.nan
