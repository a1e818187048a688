"""English sentences about a study-04 run, still written by code (the notebook displays them); each is
to become a reading that returns values (``readings``) with the wording in the notebook's markdown."""
from __future__ import annotations

import json
import math

import numpy as np
import xarray as xr

from .readings import TRAINING_PARAMS



def real_kernel_sentences(summary, *, emulator: str = "bf16") -> list[str]:
    """One sentence per real kernel built from ``real_kernel_summary``: does it show the dQ growth the
    emulator predicts, how its dQ error correlates with the emulator's, and what the diagnostic finds."""
    out = []
    cols = list(summary.columns)
    low_col = next(c for c in cols if c.startswith("dQ err at") and c.endswith("min"))
    top_col = next(c for c in cols if c.startswith("dQ err at") and c.endswith("max"))
    top_mu = top_col.split("=")[1].split(",")[0]
    for kernel, r in summary.iterrows():
        if not (np.isfinite(r["growth min"]) and np.isfinite(r["growth max"])):
            out.append(f"`{kernel}` gave no gradients at the largest N and first d of the grid"
                       + (f": {r['status']}." if r["status"] != "ok" else " at some sharpness (NaN error)."))
            continue
        verdict = "shows" if r["grows"] else "does not show"
        text = (f"`{kernel}` {verdict} the dQ growth: its median row dQ error goes from {r[low_col]:.2g} (smallest "
                f"over sharpness) at |mu| = 0 to {r[top_col]:.3g} (largest) at |mu| = {top_mu}, a growth of "
                f"{r['growth min']:.3g}x to {r['growth max']:.3g}x over sharpness (emulator `{emulator}`: "
                f"{r[f'emulator {emulator} growth min']:.3g}x to {r[f'emulator {emulator} growth max']:.3g}x); its dQ "
                f"error correlates with the emulator's at a median {r[f'corr with {emulator}, median']:.2f} "
                f"(range {r[f'corr with {emulator}, min']:.2f} to {r[f'corr with {emulator}, max']:.2f}, |mu| > 0).")
        if "diag status" in r and r["diag status"] == "ok":
            off_col = next(c for c in cols if c.startswith("diag global rel. L2 dQ err, offset"))
            text += (f" As the model's attention, the diagnostic finds a global relative L2 dQ error of "
                     f"{r['diag global rel. L2 dQ err, no offset (max layer)']:.3g} without an offset "
                     f"({int(r['diag layers flagged, no offset'])} layer(s) flagged; query/key gradient-norm ratio "
                     f"up to {r['diag q/k grad-norm ratio, no offset (max layer)']:.3g}) and "
                     f"{r[off_col]:.3g} at the largest offset.")
        elif "diag status" in r:
            text += f" The diagnostic could not run with it: {r['diag status']}."
        out.append(text)
    return out


def _span(lo: float, hi: float) -> str:
    return f"{lo:.3g}x" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}x to {hi:.3g}x"


def real_kernel_detail_sentences(details, *, emulator: str = "bf16") -> list[str]:
    """One sentence per real kernel from ``real_kernel_details`` (kernels without any gradients skipped):
    its dQ error beside the emulator's point by point, the growth up to the same-problem limit, the
    correlation per head dimension, dK and dV, and the diagnostic's median row dQ error and flagging."""
    out = []
    cols = list(details.columns)
    dk_growth = next(c for c in cols if c.startswith("dK err growth"))
    dv_growth = next(c for c in cols if c.startswith("dV err growth"))
    corr_cols = [c for c in cols if c.startswith(f"corr with {emulator}, median at d=")]
    for kernel, r in details.iterrows():
        lo, hi = r[f"dQ err / emulator {emulator}'s, min"], r[f"dQ err / emulator {emulator}'s, max"]
        if not (np.isfinite(lo) and np.isfinite(hi)):
            continue
        text = (f"`{kernel}`: median row dQ error {lo:.3g} to {hi:.3g} times the emulator `{emulator}`'s at the same "
                f"point, over the whole real-kernel grid")
        if np.isfinite(r["same-problem growth, min"]):
            text += (f"; from |mu| = 0 to the largest |mu| at which the exact dQ has not moved (section 1b's limit) "
                     f"it grows {_span(r['same-problem growth, min'], r['same-problem growth, max'])} over sharpness "
                     f"(emulator: {_span(r[f'emulator {emulator} same-problem growth, min'], r[f'emulator {emulator} same-problem growth, max'])})")
        text += (f"; at the largest |mu| the median over rows of |cos(row dQ error, mu)| is at least "
                 f"{r['dQ err |cos| with mu at the largest |mu|, min']:.3f} at every grid point (1: along mu)"
                 "; its dQ error correlates with the emulator's at a median "
                 + ", ".join(f"{r[c]:.2f} at {c.split('at ')[-1].replace('=', ' = ')}" for c in corr_cols)
                 + f" (|mu| > 0); its median row dK and dV errors stay at most {r['dK err, max']:.2g} and "
                   f"{r['dV err, max']:.2g} (at most {r[dk_growth]:.3g}x and {r[dv_growth]:.3g}x their value at "
                   f"|mu| = 0).")
        row_err = r.get("diag median row dQ err, no offset (max layer)", math.nan)
        if np.isfinite(row_err):
            first = r["diag smallest offset flagged"]
            flag = (f"a layer is first flagged (its global relative L2 error of dQ, dK or dV past the threshold) "
                    f"at a common key offset of {first:g}" if np.isfinite(first) else "no layer flagged at any offset")
            text += (f" In the diagnostic: median row dQ error {row_err:.3g} without an offset (largest over layers); "
                     f"{flag}; query/key gradient-norm ratio {r['diag q/k grad-norm ratio, min']:.3g} to "
                     f"{r['diag q/k grad-norm ratio, max']:.3g} over offsets and layers, the model's within "
                     f"{r['diag model grad-norm ratio, largest |ratio - 1|']:.2g} of 1; forward "
                     + ("bitwise identical in both passes at every offset."
                        if r["diag forward identical at every offset"] == 1 else "NOT identical in both passes."))
        out.append(text)
    return out


def trained_model_sentence(ds: xr.Dataset) -> str:
    """What the run's own training reached, as the real-kernel diagnostic's model: at the last checkpoint,
    without an offset, each layer's global relative L2 and median row dQ errors (the diagnostic of the
    trained emulated kernel), the checkpoints at which any layer is flagged without an offset, and each
    layer's largest attention logit at the last recorded step of the trained run."""
    last = int(ds["checkpoint"].values.max())
    no = ds.sel(offset_norm=0.0)
    glob = no["diag_dq_rel_err"].sel(checkpoint=last).values
    row = no["diag_dq_row_rel_err"].sel(checkpoint=last).values
    flagged = no["diag_flagged"].max("layer")
    at = [int(c) for c, f in zip(ds["checkpoint"].values, flagged.values) if f > 0]
    offsets = ds["offset_norm"].values
    first = offsets[ds["diag_flagged"].sel(checkpoint=last).max("layer").values > 0]
    top = ds["diag_dq_rel_err"].sel(checkpoint=last, offset_norm=offsets.max()).values
    logit = ds["train_max_logit"].sel(run="bf16").isel(step=-1).values
    fmt = lambda xs: ", ".join(f"{x:.3g}" for x in xs)
    return (f"the model this run trained, step {last} (layers {fmt(ds['layer'].values)}), with its trained emulated "
            f"kernel: without an offset a global relative L2 dQ error of {fmt(glob)} and a median row dQ error of "
            f"{fmt(row)}; a layer first flagged (global relative L2 error of dQ, dK or dV) at a common key offset of "
            + (f"{first.min():g}" if first.size else "none of the offsets")
            + f"; global relative L2 dQ error {fmt(top)} at the largest offset ({offsets.max():g}). A layer flagged "
              "without an offset at " + (f"checkpoints {at}" if at else f"none of the {ds['checkpoint'].size} "
                                                                         "checkpoints")
            + f"; largest attention logit at the last recorded step {fmt(logit)}")


def same_training_sentence(ds: xr.Dataset, other: xr.Dataset) -> str | None:
    """When ``ds`` and ``other`` (two runs of this study, e.g. a CPU tier and the committed GPU run) trained the
    same model the same way (``TRAINING_PARAMS`` equal), how their BF16 runs compare: the largest relative
    difference of the loss over the first recorded steps, and each run's final loss; None otherwise."""
    import json

    p, q = (json.loads(x.attrs["parameters"]) if isinstance(x.attrs.get("parameters"), str)
            else dict(x.attrs.get("parameters", {})) for x in (ds, other))
    if not p or not q or any(p.get(k) != q.get(k) for k in TRAINING_PARAMS):
        return None
    a, b = (x["train_loss"].sel(run="bf16") for x in (ds, other))
    n = min(4, a.sizes["step"], b.sizes["step"])
    first = float(abs(a.isel(step=slice(0, n)).values / b.isel(step=slice(0, n)).values - 1).max())
    return (f"this run and the GPU run trained the same model the same way (same parameters, initial weights and "
            f"batches): their BF16 runs' losses over the first {n} recorded steps differ by at most {first:.1e} "
            f"(relative), their final losses are {float(a.isel(step=-1)):.4g} here and {float(b.isel(step=-1)):.4g} "
            f"on the GPU")
