"""What the report states, read from its dataset: verdicts (short words chosen by rules), tables and the
values glued into its prose. No English sentences.

Verdict rules:

* **forward** (``forward_verdict``): ``within band`` when the kernel's relative L2 error against fp64 is at
  most ``attnum.testing.FACTOR`` times the emulator's (policy ``fa2_<dtype>``, the production rounding
  points, FA2 loop, key block 128) on the same inputs at every measured N, dtype, head dim, mask and seed;
  ``above band`` otherwise. The rule has the form of FlashAttention's reference-relative rule (at most 2x a
  reference's error), with the emulator of the production policy as the reference instead of plain
  attention in the low dtype: study 01 measured that this reference-relative rule accepts every correct
  kernel, but its reference is itself an all-low-precision kernel, so it accepts such kernels too
  (the report's ``acceptance`` section shows which kernels each rule accepts).
* **extremes** (``extreme_verdict``): ``as the emulator`` when, on every extreme input, the kernel gives
  masked keys weight, or NaN/inf where fp64 attention is finite, only where the correct emulator does too;
  ``departs`` otherwise (the inputs are listed).
* **backward** (``backward_verdict``): ``grows`` when the kernel's median row dQ error at the largest key
  offset is more than ``FACTOR`` times its own at offset 0, ``flat`` otherwise. Study 04's mechanism: a
  BF16 FlashAttention backward's rounded dS loses its zero row sum, so its dQ error grows with a common key
  offset (the emulated ``bf16`` variant beside it shows how much); a kernel that keeps dS in fp32, or
  restores the row sum (GProj), stays flat.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr

from ..testing import FACTOR
from .experiments import EMULATOR_EXTREMES

ABOVE, WITHIN = "above band", "within band"
DEPARTS, AS_EMULATOR = "departs", "as the emulator"
GROWS, FLAT = "grows", "flat"


def kernels_of(ds: xr.Dataset, under_test: bool | None = None) -> list[str]:
    names = [str(k) for k in ds["kernel"].values]
    if under_test is None:
        return names
    flags = ds["under_test"].values
    return [n for n, f in zip(names, flags) if bool(f) == under_test]


def forward_table(ds: xr.Dataset) -> pd.DataFrame:
    """Per kernel, dtype and N: its relative L2 error (median over head dims, masks, seeds), the emulator's,
    their ratio's median and maximum."""
    rows = []
    for kernel in kernels_of(ds):
        for fmt in ds["fwd_dtype"].values:
            for n in ds["fwd_seq_len"].values:
                sel = dict(kernel=kernel, fwd_dtype=fmt, fwd_seq_len=n)
                err = ds["fwd_rel_l2_err"].sel(sel).values
                emu = ds["fwd_emulator_rel_l2_err"].sel(fwd_fidelity_config="bk128", fwd_dtype=fmt, fwd_seq_len=n).values
                ratio = ds["fwd_ratio"].sel(sel).values
                ok = np.isfinite(ratio)
                rows.append({"kernel": kernel, "dtype": str(fmt), "N": int(n),
                             "error": float(np.median(err[ok])) if ok.any() else np.nan,
                             "emulator error": float(np.median(emu)),
                             "ratio median": float(np.median(ratio[ok])) if ok.any() else np.nan,
                             "ratio max": float(ratio[ok].max()) if ok.any() else np.nan})
    return pd.DataFrame(rows).set_index(["kernel", "dtype", "N"])


def forward_verdict(ds: xr.Dataset, kernel: str) -> dict:
    """``verdict``, the worst ratio and where (dtype, N), and the share of outputs measured."""
    r = ds["fwd_ratio"].sel(kernel=kernel)
    values = r.values
    ok = np.isfinite(values)
    if not ok.any():
        return {"verdict": "not measured", "ratio_max": None, "dtype": None, "n": None, "measured": 0.0}
    idx = np.unravel_index(np.nanargmax(np.where(ok, values, -np.inf)), values.shape)
    at = {d: r[d].values[i] for d, i in zip(r.dims, idx)}
    worst = float(values[idx])
    return {"verdict": WITHIN if worst <= FACTOR else ABOVE, "ratio_max": worst, "dtype": str(at["fwd_dtype"]),
            "n": int(at["fwd_seq_len"]), "measured": float(ok.mean())}


def acceptance_table(ds: xr.Dataset, verdicts: dict[str, str]) -> pd.DataFrame:
    """Per kernel and rule: the share of its outputs the rule accepted, and the outcome against the report's
    overall verdict (``verdicts``: kernel -> normal/abnormal): ``missed`` (accepted every output of an
    abnormal kernel), ``false alarm`` (rejected an output of a normal one), or ``agrees``."""
    rows = []
    for kernel in kernels_of(ds):
        for rule in ds["fwd_rule"].values:
            v = ds["fwd_passes"].sel(kernel=kernel, fwd_rule=rule).values
            v = v[np.isfinite(v)]
            if not v.size:
                continue
            share = float(v.mean())
            abnormal = verdicts.get(kernel) == "abnormal"
            outcome = ("missed" if abnormal and share == 1.0 else "false alarm" if not abnormal and share < 1.0
                       else "agrees")
            rows.append({"kernel": kernel, "rule": str(rule), "accepted": share, "outputs": int(v.size),
                         "outcome": outcome})
    return pd.DataFrame(rows).set_index(["kernel", "rule"])


_DEPARTURES = ("ext_rows_attend_masked", "ext_nonfinite_where_golden_finite")


def _departures(ds: xr.Dataset, kernel: str) -> set[tuple[str, str]]:
    out = set()
    for fmt in ds["ext_dtype"].values:
        for name in ds["ext_input"].values:
            for m in ds["ext_mask"].values:
                cell = {v: float(ds[v].sel(ext_kernel=kernel, ext_dtype=fmt, ext_input=name, ext_mask=m)) for v in _DEPARTURES}
                if any(np.isfinite(x) and x > 0 for x in cell.values()):
                    out.add((str(fmt), str(name)))
    return out


def extreme_verdict(ds: xr.Dataset, kernel: str) -> dict:
    """``verdict``, the (dtype, input) points where it departs and the emulator does not, and the masked-key
    rows it gave weight to over every input."""
    mine, emu = _departures(ds, kernel), _departures(ds, EMULATOR_EXTREMES)
    extra = sorted(mine - emu)
    masked = ds["ext_rows_attend_masked"].sel(ext_kernel=kernel).values
    return {"verdict": DEPARTS if extra else AS_EMULATOR, "inputs": ", ".join(f"{i} ({f})" for f, i in extra) or "none",
            "departures": len(extra), "masked_rows_given_weight": int(np.nansum(masked))}


def extreme_table(ds: xr.Dataset) -> pd.DataFrame:
    """Per input and dtype (down) and kernel (across): what it returned, in words chosen by code: ``ok``
    (rel. error), ``NaN x%``, ``masked keys weighted (rows)``, ``zero rows``, or the status."""
    rows = []
    for fmt in ds["ext_dtype"].values:
        for name in ds["ext_input"].values:
            row = {"dtype": str(fmt), "input": str(name)}
            for kernel in ds["ext_kernel"].values:
                texts = []
                for m in ds["ext_mask"].values:
                    c = ds.sel(ext_kernel=kernel, ext_dtype=fmt, ext_input=name, ext_mask=m)
                    status = str(c["ext_status"].values)
                    if status.startswith("not applicable"):
                        continue
                    if status != "ok":
                        texts.append(status.split(":")[0])
                        continue
                    parts = []
                    if float(c["ext_rows_attend_masked"]) > 0:
                        parts.append(f"masked keys weighted ({int(c['ext_rows_attend_masked'])} rows)")
                    if float(c["ext_nonfinite_where_golden_finite"]) > 0:
                        parts.append(f"NaN/inf where fp64 finite ({100 * float(c['ext_nonfinite_where_golden_finite']):.3g}%)")
                    if float(c["ext_zero_rows"]) > 0:
                        parts.append(f"{int(c['ext_zero_rows'])} zero rows")
                    if float(c["ext_masked_rows_nan"]) > 0:
                        parts.append(f"fully masked rows NaN ({int(c['ext_masked_rows_nan'])})")
                    parts.append(f"rel. err {float(c['ext_rel_l2_err']):.2g}")
                    texts.append("; ".join(parts))
                row[str(kernel)] = " | ".join(texts) or "-"
            rows.append(row)
    return pd.DataFrame(rows).set_index(["dtype", "input"])


def backward_table(ds: xr.Dataset) -> pd.DataFrame:
    """Median row dQ, dK, dV errors per kernel (and emulated variant) and key offset |mu| (worst over
    sharpness, median over seeds)."""
    rows = []

    def add(name, pick):
        for mu in ds["bwd_mu_norm"].values:
            row = {"kernel": name, "|mu|": float(mu)}
            for g in ("dq", "dk", "dv"):
                row[f"{g} error"] = float(pick(g).sel(bwd_mu_norm=mu).median("bwd_seed").max("bwd_sharpness"))
            rows.append(row)

    for kernel in kernels_of(ds):
        add(kernel, lambda g: ds[f"bwd_mech_{g}_err"].sel(kernel=kernel))
    for variant in ds["bwd_variant"].values:
        add(f"emulated {variant}", lambda g: ds[f"bwd_mech_emulator_{g}_err"].sel(bwd_variant=variant))
    return pd.DataFrame(rows).set_index(["kernel", "|mu|"])


def _growth(err: xr.DataArray) -> float:
    e = err.median("bwd_seed").max("bwd_sharpness")
    mus = e["bwd_mu_norm"].values
    return float(e.sel(bwd_mu_norm=mus.max()) / e.sel(bwd_mu_norm=mus.min()))


def backward_verdict(ds: xr.Dataset, kernel: str) -> dict:
    """``verdict``, the kernel's dQ growth from the smallest to the largest |mu|, the FP32 and BF16 emulators'."""
    mine = _growth(ds["bwd_mech_dq_err"].sel(kernel=kernel))
    fp32 = _growth(ds["bwd_mech_emulator_dq_err"].sel(bwd_variant="fp32"))
    bf16 = _growth(ds["bwd_mech_emulator_dq_err"].sel(bwd_variant="bf16"))
    top = float(ds["bwd_mu_norm"].max())
    dq_top = float(ds["bwd_mech_dq_err"].sel(kernel=kernel, bwd_mu_norm=top).median("bwd_seed").max("bwd_sharpness"))
    verdict = "not measured" if not np.isfinite(mine) else GROWS if mine > FACTOR else FLAT
    return {"verdict": verdict, "growth": mine, "fp32_growth": fp32, "bf16_growth": bf16, "dq_err_top": dq_top,
            "mu_top": top}


def speed_table(ds: xr.Dataset) -> pd.DataFrame:
    t = pd.DataFrame({"forward ms": ds["speed_forward_ms"].values, "forward+backward ms": ds["speed_forward_backward_ms"].values,
                      "status": ds["speed_status"].values}, index=pd.Index(kernels_of(ds), name="kernel"))
    return t


def summary_table(ds: xr.Dataset) -> pd.DataFrame:
    """One row per kernel: the overall verdict (``normal`` when the forward is within the band and the extreme
    inputs give what the emulator gives, else ``abnormal``) and each section's verdict with its number."""
    rows = []
    for kernel in kernels_of(ds):
        f, e, b = forward_verdict(ds, kernel), extreme_verdict(ds, kernel), backward_verdict(ds, kernel)
        overall = "normal" if f["verdict"] == WITHIN and e["verdict"] == AS_EMULATOR else "abnormal"
        rows.append({"kernel": kernel, "under test": bool(ds["under_test"].sel(kernel=kernel)), "verdict": overall,
                     "forward": f["verdict"], "worst error ratio": f["ratio_max"],
                     "at": f"{f['dtype']} N={f['n']}" if f["n"] else None,
                     "extremes": e["verdict"], "departs on": e["inputs"],
                     "backward dQ": b["verdict"], "dQ growth": b["growth"], "dQ error at max |mu|": b["dq_err_top"],
                     "forward ms": float(ds["speed_forward_ms"].sel(kernel=kernel))})
    return pd.DataFrame(rows).set_index("kernel")


def overall_verdicts(ds: xr.Dataset) -> dict[str, str]:
    return summary_table(ds)["verdict"].to_dict()


def helper_rates_table(rates: xr.Dataset) -> pd.DataFrame:
    """False alarms per correct kernel and misses per fault (over the outputs the fault changed)."""
    rows = []
    for kernel in rates["helper_kernel"].values:
        v = rates["helper_false_alarm"].sel(helper_kernel=kernel).values
        v = v[np.isfinite(v)]
        rows.append({"case": str(kernel), "kind": "correct kernel", "rate": float(v.mean()) if v.size else np.nan,
                     "outputs": int(v.size)})
    for fault in rates["helper_fault"].values:
        v = rates["helper_missed"].sel(helper_fault=fault).values
        v = v[np.isfinite(v)]
        rows.append({"case": str(fault), "kind": "injected fault", "rate": float(v.mean()) if v.size else np.nan,
                     "outputs": int(v.size)})
    return pd.DataFrame(rows).set_index(["kind", "case"])


STUDY01_RULES = {"fixed_0.1pct": "fixed", "dynamic_threshold": "dynamic", "reference_relative": "refrel"}


def study01_alarms(run: xr.Dataset | None, min_len: int) -> dict:
    """What the report states of study 01's committed GPU run: each rule's false-alarm rate over every real
    kernel's outputs at N >= ``min_len`` per dtype (``alarms_<rule>_<dtype>``, the keys of
    ``length_scaling.real_kernels.real_kernel_values``, from the same ``real_false_alarms_by_dtype``) and the
    run's commit; None values without the run. Only this table: ``real_kernel_values`` also builds the
    fidelity and growth tables, which the report does not state (about 2 s here)."""
    from ..studies.length_scaling.real_kernels import real_false_alarms_by_dtype

    out = {"commit": None}
    out.update({f"alarms_{name}_{fmt}": None for name in STUDY01_RULES.values() for fmt in ("bf16", "fp16")})
    if run is None or "real_passes" not in run:
        return out
    out["commit"] = str(run.attrs.get("git_commit", ""))[:7] or None
    table = real_false_alarms_by_dtype(run, min_len)
    for rule, name in STUDY01_RULES.items():
        for fmt in ("bf16", "fp16"):
            if rule in table.index and fmt in table.columns and np.isfinite(table.loc[rule, fmt]):
                out[f"alarms_{name}_{fmt}"] = float(table.loc[rule, fmt])
    return out


def values(ds: xr.Dataset, rates: xr.Dataset | None, band: dict, study01: dict) -> dict:
    """The values the report's prose states (keys ``rp_*``): the rule's factor, the band of real kernels over
    the emulator (``band``: ``attnum.testing.band_spread``), study 01's false alarms of the fixed and the
    reference-relative rules (``study01``: ``study01_alarms`` of its GPU run),
    the kernels and their verdicts counted, the helper's false-alarm and miss rates, the sizes measured."""
    summary = summary_table(ds)
    tested = summary[summary["under test"]]
    out = {"rp_factor": FACTOR, "rp_kernels": len(tested), "rp_against": int((~summary["under test"]).sum()),
           "rp_normal": int((tested["verdict"] == "normal").sum()), "rp_abnormal": int((tested["verdict"] == "abnormal").sum()),
           "rp_n_min": int(ds["fwd_seq_len"].min()), "rp_n_max": int(ds["fwd_seq_len"].max()),
           "rp_dtypes": ", ".join(str(x) for x in ds["fwd_dtype"].values),
           "rp_ext_n": int(ds["ext_seq_len"]), "rp_ext_inputs": int(ds.sizes["ext_input"]),
           "rp_bwd_mu_max": float(ds["bwd_mu_norm"].max()), "rp_speed_n": int(ds["speed_seq_len"])}
    out.update({f"rp_band_{k}": band.get(k) for k in ("ratio_min", "ratio_median", "ratio_max", "outputs", "commit")})
    for key in ("alarms_fixed_bf16", "alarms_refrel_bf16", "alarms_refrel_fp16", "alarms_dynamic_bf16"):
        out[f"rp_s01_{key}"] = study01.get(key)
    out["rp_s01_commit"] = study01.get("commit")
    missed = acceptance_table(ds, overall_verdicts(ds))
    out["rp_rules_missing"] = int((missed["outcome"] == "missed").sum()) if len(missed) else 0
    if rates is not None:
        alarm = rates["helper_false_alarm"].values
        miss = rates["helper_missed"].values
        out.update(rp_helper_alarm=float(np.nanmean(alarm)), rp_helper_alarm_outputs=int(np.isfinite(alarm).sum()),
                   rp_helper_miss=float(np.nanmean(miss)), rp_helper_miss_outputs=int(np.isfinite(miss).sum()))
    return out
