"""Study 05's sentences written from the data (to be replaced by values glued into the notebook)."""
from __future__ import annotations

import math

import numpy as np
import xarray as xr

from .readings import *  # noqa: F403
from .readings import STEP_NO_ATTENTION, SEED004_DQ_ERR_BEFORE, SEED004_DQ_ERR_AFTER, SEED004_GPROJ_STEP_COST, \
    SEED004_FP32_STEP_COST, emulation_device, has_real, has_step_timings, has_timings, regime_offset, trusted_offset


def emulator_timing_summary(ds: xr.Dataset) -> str:
    """One computed sentence: the emulator's forward + backward time of each fix relative to the base
    on this run's device, the slowest fix and two-pass GProj's (an emulation, not a kernel timing)."""
    emul = ds["emul_forward_seconds"] + ds["emul_backward_seconds"]
    rel = (emul / emul.sel(fix="none")).to_series()
    slow = rel.drop("none").idxmax()
    text = (f"**Measured on this run** (the emulator on the {emulation_device(ds)}, N = {ds.attrs.get('timing_seq_len')}, "
            f"d = {ds.attrs.get('timing_head_dim')}; an emulation, not a kernel): the slowest fix is `{slow}` at "
            f"{rel[slow]:.2f}x the base forward + backward")
    if "gproj_dq_dk" in rel.index and slow != "gproj_dq_dk":
        text += f"; two-pass GProj {rel['gproj_dq_dk']:.2f}x"
    return text + f"; the fixes span {rel.min():.2f}-{rel.max():.2f}x."





def _nearest_before_after(err_none: xr.DataArray, err_fix: xr.DataArray, mu_max: float = math.inf):
    """The (sharpness, |mu|) with |mu| <= ``mu_max`` where ``err_none`` is nearest 219% in log, and
    both errors there."""
    err_none = err_none.where(err_none["mu_norm"] <= mu_max)
    dist = np.abs(np.log(err_none / SEED004_DQ_ERR_BEFORE))
    idx = np.unravel_index(int(np.nanargmin(dist.values)), dist.shape)
    point = {dim: float(err_none[dim].values[i]) for dim, i in zip(err_none.dims, idx)}
    return point, float(err_none.sel(point)), float(err_fix.sel(point))


def _before_after_verdict(before: float, after: float) -> str:
    reached = 0.5 <= before / SEED004_DQ_ERR_BEFORE <= 2
    fixed = after <= 3 * SEED004_DQ_ERR_AFTER
    if reached and fixed:
        return "yes: same order before and after"
    if not reached:
        return (f"partly: the unfixed error does not come within 2x of 219% (nearest {before:.3g}); "
                f"after GProj {after:.3g}" + (" (same order as 0.34%)" if fixed else ""))
    return f"no: the unfixed error reaches {before:.3g}, but after GProj it is {after:.3g}, above 3x 0.34%"


def _before_after_row(claim: str, err_none: xr.DataArray, err_fix: xr.DataArray, trusted: float, where: str) -> dict:
    """Seed 004's 219% -> 0.34% against ours: first at the trusted offsets only (the exact problem of
    |mu| = 0), then, if the nearest point over all offsets lies beyond them, that point too, marked as
    a changed problem."""
    point, before, after = _nearest_before_after(err_none, err_fix, trusted)
    ours = f"{before:.3g} -> {after:.3g} (|mu| <= {trusted:g}, trusted)"
    verdict = _before_after_verdict(before, after) + f" at the trusted offsets (|mu| <= {trusted:g})"
    basis = f"nearest 219% at |mu| <= {trusted:g}: sharpness {point['sharpness']:g}, |mu| {point['mu_norm']:g}"
    far, f_before, f_after = _nearest_before_after(err_none, err_fix)
    if far["mu_norm"] > trusted:
        ours += f"; {f_before:.3g} -> {f_after:.3g} at |mu| {far['mu_norm']:g} (changed problem)"
        verdict += ("; beyond them (a changed exact problem): "
                    + _before_after_verdict(f_before, f_after).split(":")[0])
        basis += f"; over all offsets: sharpness {far['sharpness']:g}, |mu| {far['mu_norm']:g}"
    return {"claim": claim, "seed 004 (theirs)": "219% -> 0.34%", "ours": ours, "reproduced?": verdict,
            "basis": basis + f"; {where}"}


def _fastest_fp32(t: xr.DataArray, base: float):
    """(name, extra over ``base``) of the kernel with the shortest fp32-input time in ``t`` (one
    forward + backward time per timing kernel and dtype), or (None, nan) when none was timed."""
    fp32 = t.sel(timing_dtype="fp32")
    times = {str(k): float(fp32.sel(timing_kernel=k)) for k in fp32["timing_kernel"].values}
    times = {k: v for k, v in times.items() if np.isfinite(v)}
    if not times:
        return None, math.nan
    name = min(times, key=times.get)
    return name, times[name] / base - 1


def seed004_claims(ds: xr.Dataset, timing_head_dim: int | None = None, timing_causal: int | None = None):
    """Seed 004's claims that study 05 can measure, one row each: the source's number, ours from
    this dataset (NaN/'not measured here' when the data is absent) and whether ours reproduces it,
    with the basis of the comparison. Timings at ``timing_head_dim`` (default the largest timed d)
    and ``timing_causal`` (default the first timed mask)."""
    import pandas as pd

    rows = []
    trusted = trusted_offset(ds)
    # 1. dQ error before -> after GProj: the emulator, and our kernel when it ran
    sub = ds["grid_dq_err"].isel(seq_len=-1, head_dim=0).median("seed")
    gproj = next((f for f in ("gproj_dq", "gproj_dq_dk") if f in ds["fix"].values), None)
    if gproj is not None:
        rows.append(_before_after_row(f"median dQ error 219% -> 0.34% with GProj (emulator, {gproj})",
                                      sub.sel(fix="none"), sub.sel(fix=gproj), trusted,
                                      f"N {int(ds['seq_len'][-1])}, d {int(ds['head_dim'][0])}"))
    names = ds["real_kernel"].values.tolist() if has_real(ds) else []
    at = dict(seq_len=int(ds["seq_len"][-1]), head_dim=int(ds["head_dim"][-1]))
    ok = {"triton:fa2", "triton:fa2:gproj_dq"} <= set(names) and all(
        str(ds["real_status"].sel(real_kernel=k, **at).item()) == "ok" for k in ("triton:fa2", "triton:fa2:gproj_dq"))
    if ok:
        real = ds["real_dq_err"].sel(**at).median("seed")
        rows.append(_before_after_row("median dQ error 219% -> 0.34% with GProj (our Triton kernel, GProj dq)",
                                      real.sel(real_kernel="triton:fa2"), real.sel(real_kernel="triton:fa2:gproj_dq"),
                                      trusted, f"N {at['seq_len']}, d {at['head_dim']}"))
    else:
        rows.append({"claim": "median dQ error 219% -> 0.34% with GProj (our Triton kernel)",
                     "seed 004 (theirs)": "219% -> 0.34%", "ours": "not measured here",
                     "reproduced?": "not measured (our kernel runs on CUDA only: the gpu tier)", "basis": ""})
    # 2, 3. costs: our kernel's attention forward + backward
    stepped = has_step_timings(ds)
    if has_timings(ds):
        d = int(ds["timing_head_dim"][-1]) if timing_head_dim is None else timing_head_dim
        c = int(ds["timing_causal"][0]) if timing_causal is None else timing_causal
        t = ds["timing_fwd_bwd_ms"].sel(timing_head_dim=d, timing_causal=c)
        base = float(t.sel(timing_kernel="triton:fa2", timing_dtype="bf16"))
        extra = lambda k, dt="bf16": (float(t.sel(timing_kernel=k, timing_dtype=dt)) / base - 1
                                      if k in t["timing_kernel"].values else math.nan)
        g, fb, fa = extra("triton:fa2:gproj_dq"), extra("triton:fa2:fp32_bwd"), extra("triton:fa2", "fp32")
        fast_name, fast = _fastest_fp32(t, base)
        shape = (f"N {ds.attrs['real_timing_seq_len']}, {ds.attrs['real_timing_heads']} heads, d {d}, "
                 f"{'causal' if c else 'no mask'}, {ds.attrs.get('timing_gpu', '')}")
        if not np.isfinite(g):
            verdict = "not measured (GProj dq gave no time: see timing_status)"
        elif g <= SEED004_GPROJ_STEP_COST:
            verdict = f"yes: attention alone costs +{g:.1%}, so a step costs at most that"
        else:
            verdict = ("not at the step level " + ("(a step of our model: the row below)" if stepped else "(not measured)")
                       + f"; attention alone costs +{g:.1%}, consistent with "
                       f"+4.7% of a step only if attention is at most {SEED004_GPROJ_STEP_COST / g:.0%} of the step")
        rows.append({"claim": "GProj costs +4.7% of a training step", "seed 004 (theirs)": "+4.7% (step)",
                     "ours": f"+{g:.1%} of attention fwd+bwd (GProj dq, measured)", "reproduced?": verdict,
                     "basis": shape})
        ratio = fast / g if g > 0 else math.nan
        theirs = SEED004_FP32_STEP_COST / SEED004_GPROJ_STEP_COST
        ours = f"+{fa:.0%} of attention fwd+bwd (our kernel fed fp32)"
        if fast_name is not None and fast_name != "triton:fa2":
            ours += f", +{fast:.0%} ({fast_name} fed fp32, the fastest FP32 attention timed)"
        rows.append({"claim": "FP32 attention costs +33.4% of a training step", "seed 004 (theirs)":
                     f"+33.4% (step); {theirs:.1f}x GProj's extra",
                     "ours": ours + f", +{fb:.0%} (FP32 backward only); {ratio:.1f}x GProj's extra",
                     "reproduced?": ("not measured (no FP32-attention or GProj time: see timing_status)"
                                     if not np.isfinite(ratio) or ratio <= 0 else
                                     f"no: the ratio of FP32 attention's extra to GProj's is {ratio / theirs:.1f}x theirs"
                                     if abs(math.log(ratio / theirs)) > math.log(2)
                                     else "the ratio of FP32 attention's extra to GProj's is theirs within 2x"),
                     "basis": shape + "; FP32 attention: the fastest kernel timed with fp32 inputs; a step's extra is "
                                      "attention's times attention's share of the step, so the ratio of two extras "
                                      "does not depend on the share"})
    else:
        for claim, theirs in (("GProj costs +4.7% of a training step", "+4.7% (step)"),
                              ("FP32 attention costs +33.4% of a training step", "+33.4% (step)")):
            rows.append({"claim": claim, "seed 004 (theirs)": theirs, "ours": "not measured here",
                         "reproduced?": "not measured (GPU timings: the gpu tier)", "basis": ""})
    # 2b, 3b. costs: a whole training step of our small GPT
    if stepped:
        step = ds["step_ms"]
        base = float(step.sel(step_kernel="triton:fa2", step_dtype="bf16"))
        rest = float(step.sel(step_kernel=STEP_NO_ATTENTION, step_dtype="bf16"))
        share = (base - rest) / base
        model = (f"{ds.attrs['step_n_layer']} layers, width {ds.attrs['step_d_model']}, {ds.attrs['step_n_head']} heads, "
                 f"context {ds.attrs['step_context']}, batch {ds.attrs['step_batch_size']}, bf16 autocast; attention "
                 f"{share:.0%} of the step with our kernel; {ds.attrs.get('timing_gpu', '')}")
        ok = ds["step_status"] == "ok"
        extra = lambda name, dtype: (float(step.sel(step_kernel=name, step_dtype=dtype)) / base - 1
                                     if name in step["step_kernel"].values
                                     and bool(ok.sel(step_kernel=name, step_dtype=dtype)) else math.nan)
        # GProj: our kernel's dq mode
        g = extra("triton:fa2:gproj_dq", "bf16")
        if np.isfinite(g):
            same = g > 0 and abs(math.log(g / SEED004_GPROJ_STEP_COST)) <= math.log(2)
            rows.append({"claim": "GProj costs +4.7% of a training step (a step of our model)",
                         "seed 004 (theirs)": "+4.7% (step)", "ours": f"{g:+.1%} of a step (GProj dq)",
                         "reproduced?": ("yes: within 2x of theirs" if same else
                                         f"no: {g / SEED004_GPROJ_STEP_COST:.2g}x theirs")
                                        + " (the share of attention in a step depends on the model)",
                         "basis": model})
        else:
            rows.append({"claim": "GProj costs +4.7% of a training step (a step of our model)",
                         "seed 004 (theirs)": "+4.7% (step)", "ours": "not measured",
                         "reproduced?": "not measured (see step_status)", "basis": model})
        # FP32 attention: the fastest kernel fed fp32 decides; ours fed fp32 and the FP32 backward beside it
        fp32 = {str(k): extra(str(k), "fp32") for k in step["step_kernel"].values}
        fp32 = {k: v for k, v in fp32.items() if np.isfinite(v)}
        if fp32:
            fast_name = min(fp32, key=fp32.get)
            fast = fp32[fast_name]
            label = "our kernel fed fp32" if fast_name == "triton:fa2" else f"{fast_name} fed fp32"
            ours = f"{fast:+.1%} of a step ({label}" + (", the fastest FP32 attention timed)" if len(fp32) > 1 else ")")
            if fast_name != "triton:fa2" and "triton:fa2" in fp32:
                ours += f"; our kernel fed fp32 {fp32['triton:fa2']:+.1%}"
            fb = extra("triton:fa2:fp32_bwd", "bf16")
            if np.isfinite(fb):
                ours += f"; FP32 backward only {fb:+.1%}"
            same = fast > 0 and abs(math.log(fast / SEED004_FP32_STEP_COST)) <= math.log(2)
            rows.append({"claim": "FP32 attention costs +33.4% of a training step (a step of our model)",
                         "seed 004 (theirs)": "+33.4% (step)", "ours": ours,
                         "reproduced?": ("yes: within 2x of theirs" if same else
                                         f"no: {fast / SEED004_FP32_STEP_COST:.2g}x theirs")
                                        + " (the share of attention in a step depends on the model)",
                         "basis": model})
        else:
            rows.append({"claim": "FP32 attention costs +33.4% of a training step (a step of our model)",
                         "seed 004 (theirs)": "+33.4% (step)", "ours": "not measured",
                         "reproduced?": "not measured (see step_status)", "basis": model})
    # 4-6. training
    if "train_loss" in ds:
        final = ds["train_loss"].isel(step=slice(-10, None)).mean("step")
        gap = lambda run: float(final.sel(run=run) - final.sel(run="fp32")) if run in final["run"].values else math.nan
        gps = [r for r in ("gproj_dq", "gproj_dq_dk") if r in final["run"].values]
        if gps:
            worst = max(abs(gap(r)) for r in gps)
            rows.append({"claim": "GProj trains to the loss of FP32 attention", "seed 004 (theirs)": "same loss",
                         "ours": f"GProj within {worst:.2g} nat of FP32; the unfixed kernel {gap('none'):+.2g} nat",
                         "reproduced?": ("yes, but not discriminating: the unfixed kernel is as close"
                                         if abs(gap("none")) <= 2 * worst + 1e-3 else "yes"),
                         "basis": f"final loss, mean of the last 10 records, {int(ds['step'][-1])} steps, same start"})
        steps = ds["step"].values
        late = steps >= steps[0] + 0.5 * (steps[-1] - steps[0])
        ratio = (ds["train_grad_norm_total"] / ds["train_grad_norm_total"].sel(run="fp32")).isel(step=late).median("step")
        if "forward_fix" in ratio["run"].values and "none" in ratio["run"].values:
            r_none, r_ff = float(ratio.sel(run="none")), float(ratio.sel(run="forward_fix"))
            rows.append({"claim": "the forward fix stops the gradient-norm growth",
                         "seed 004 (theirs)": "unfixed: ~1000x growth; forward fix: growth stops",
                         "ours": f"late grad norm / FP32's: unfixed {r_none:.3g}, forward fix {r_ff:.3g}",
                         "reproduced?": ("untested: the unfixed kernel shows no growth to stop"
                                         if r_none < 2 else "the unfixed kernel grows; see the ratio of the forward fix"),
                         "basis": "median over the second half of training"})
        if "train_key_mean_norm" in ds:
            top_mu = regime_offset(ds)
            key = ds["train_key_mean_norm"].max(["step", "layer"])
            logit = ds["train_max_logit"].max(["step", "layer"]) if "train_max_logit" in ds else None
            runs = [r for r in ("mean_key", "forward_fix") if r in key["run"].values]
            if runs:
                ours = "; ".join(f"{r}: key-mean norm {float(key.sel(run=r)):.3g}"
                                 + (f", max logit {float(logit.sel(run=r)):.3g}" if logit is not None else "")
                                 for r in runs + ["fp32"])
                entered = [r for r in key["run"].values if float(key.sel(run=r)) >= top_mu]
                rows.append({"claim": "mean-key subtraction and the forward fix do not keep layers out of the "
                                      "large-score regime",
                             "seed 004 (theirs)": "layers still entered it",
                             "ours": ours,
                             "reproduced?": (f"untested: no run's layers reach it (largest key-mean norm "
                                             f"{float(key.max()):.3g} < {top_mu:g})" if not entered
                                             else f"runs reaching it: {entered}"),
                             "basis": f"regime: key-mean norm >= {top_mu:g}, the smallest grid |mu| where the unfixed "
                                      f"kernel's median dQ error exceeds 10% (any sharpness)"})
    # 7. P at the row max
    frac = ds["grid_p_max_not_one"]
    rows.append({"claim": "fused scale-max: P at the row max is not exactly 1",
                 "seed 004 (theirs)": "'not always exactly 0' in the exponent; the notes' numpy check: 42% of samples",
                 "ours": f"{float(frac.min()):.0%}-{float(frac.max()):.0%} of rows over the grid (fused emulator); "
                         "0 with the max subtracted first (forward fix; our Triton kernel, by construction: exp(0) = 1)",
                 "reproduced?": "yes, the effect occurs" if float(frac.max()) > 0 else "no",
                 "basis": "exponent at each row's maximum, fp32 FMA as FlashAttention-3 computes it"})
    return pd.DataFrame(rows).set_index("claim")



def real_kernel_summary(ds: xr.Dataset) -> str:
    """Markdown bullets computed from the real-kernel grid (largest N and d, median over seeds): per
    real kernel that ran, its dQ error at |mu| = 0 and at the largest trusted |mu| over the
    sharpness values, its emulated equivalent's there, and their agreement."""
    at = dict(seq_len=int(ds["seq_len"][-1]), head_dim=int(ds["head_dim"][-1]))
    trusted = trusted_offset(ds)
    lines = []
    for name in ds["real_kernel"].values:
        status = str(ds["real_status"].sel(real_kernel=name, **at).item())
        if status != "ok":
            lines.append(f"* `{name}`: no gradients at N = {at['seq_len']}, d = {at['head_dim']} ({status[:160]})")
            continue
        err = ds["real_dq_err"].sel(real_kernel=name, **at).median("seed")
        emul = ds["real_emul_dq_err"].sel(real_kernel=name, **at).median("seed")
        zero, far = err.isel(mu_norm=0), err.sel(mu_norm=trusted)
        eq = str(ds["real_equivalent"].sel(real_kernel=name).item())
        text = (f"* `{name}`: median dQ error {float(zero.min()):.2g}-{float(zero.max()):.2g} at |mu| = 0 and "
                f"{float(far.min()):.2g}-{float(far.max()):.2g} at |mu| = {trusted:g} (over the sharpness values)")
        if eq:
            corr = ds["real_dq_err_corr"].sel(real_kernel=name)
            text += (f"; its emulated equivalent `{eq}` {float(emul.sel(mu_norm=trusted).min()):.2g}-"
                     f"{float(emul.sel(mu_norm=trusted).max()):.2g} there; dQ-error correlation "
                     f"{float(corr.min()):.2f}-{float(corr.max()):.2f} over the grid, "
                     f"{float(ds['real_dq_bitwise'].sel(real_kernel=name).median()):.0%} of dQ elements bitwise equal "
                     f"(median)")
        lines.append(text)
    return "\n".join(lines)


def _span(values, fmt: str) -> str:
    """'a' or 'a to b' for the finite values (formatted with ``fmt``), 'nan' if none."""
    values = [float(v) for v in np.ravel(values) if np.isfinite(v)]
    if not values:
        return "nan"
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo} to {hi}"


def sharp_floor_summary(ds: xr.Dataset, kernel: str = "triton:fa2:gproj_dq") -> str:
    """Markdown bullets computed from the real-kernel grid: does our kernel's GProj dQ error in the
    sharpest rows fall to the emulator's GProj floor (issue 15)? Per |mu| at the largest sharpness,
    over every N and d of the grid (median over seeds): our kernel's median dQ error, the ratio to
    the emulator's ``gproj_dq`` fix (the grid's tiles, fused scale-max) and to the kernel's emulated
    equivalent (its own tiles, max subtracted first), and the unfixed kernel's error there; then the
    fidelity of each Triton mode to its equivalent (bitwise-equal dQ elements, error correlation) at
    the trusted offsets and beyond. Empty when our kernel did not run."""
    if not has_real(ds) or kernel not in ds["real_kernel"].values:
        return ""
    ok = ds["real_status"].sel(real_kernel=kernel) == "ok"
    if not bool(ok.all()):
        return ""
    s = float(ds["sharpness"][-1])
    trusted = trusted_offset(ds)
    err = ds["real_dq_err"].sel(real_kernel=kernel, sharpness=s).median("seed")
    emul_fix = ds["grid_dq_err"].sel(fix="gproj_dq", sharpness=s).median("seed") if "gproj_dq" in ds["fix"].values \
        else None
    equiv = ds["real_emul_dq_err"].sel(real_kernel=kernel, sharpness=s).median("seed")
    unfixed = (ds["real_dq_err"].sel(real_kernel="triton:fa2", sharpness=s).median("seed")
               if "triton:fa2" in ds["real_kernel"].values else None)
    lines = [f"**Our kernel's GProj against the emulator's GProj floor** (sharpness {s:g}, every N and d of the grid; "
             f"`{kernel}` median dQ error, its ratio to the emulator's `gproj_dq` fix and to its emulated equivalent"
             + (", and our unfixed kernel's error" if unfixed is not None else "") + "):", ""]
    for mu in ds["mu_norm"].values:
        e = err.sel(mu_norm=mu)
        text = f"* |mu| = {mu:g}{'' if mu <= trusted else ' (changed problem)'}: {_span(e.values, '.2%')}"
        if emul_fix is not None:
            text += f"; {_span((e / emul_fix.sel(mu_norm=mu)).values, '.3f')}x the emulator's GProj"
        text += f"; {_span((e / equiv.sel(mu_norm=mu)).values, '.3f')}x its equivalent"
        if unfixed is not None:
            text += f"; unfixed kernel {_span(unfixed.sel(mu_norm=mu).values, '.1%')}"
        lines.append(text)
    near = (err / emul_fix) if emul_fix is not None else (err / equiv)
    in_trust = near.sel(mu_norm=near["mu_norm"] <= trusted)
    worst = float(np.nanmax(np.abs(np.log(in_trust.values))))
    lines += ["", f"So at the trusted offsets (|mu| <= {trusted:g}) our kernel's GProj dQ error in the sharpest rows is "
              f"the emulator's within {math.exp(worst) - 1:.1%}"
              + (" (it falls to the emulator's GProj floor)." if worst <= math.log(1.1) else
                 " (more than 10% apart: it does not fall to the emulator's GProj floor).")]
    fid = []
    for name in [k for k in ds["real_kernel"].values if str(k).startswith("triton:fa2")]:
        if not bool((ds["real_status"].sel(real_kernel=name) == "ok").all()):
            continue
        bit, corr = ds["real_dq_bitwise"].sel(real_kernel=name), ds["real_dq_err_corr"].sel(real_kernel=name)
        t_bit, t_corr = (x.sel(mu_norm=x["mu_norm"] <= trusted) for x in (bit, corr))
        f_bit, f_corr = (x.sel(mu_norm=x["mu_norm"] > trusted) for x in (bit, corr))
        text = (f"* `{name}` against `{str(ds['real_equivalent'].sel(real_kernel=name).item())}`: dQ elements bitwise "
                f"equal {_span(t_bit.values, '.1%')}, dQ-error correlation {_span(t_corr.values, '.3f')} at |mu| <= "
                f"{trusted:g}")
        if f_bit.size:
            text += f"; beyond: {_span(f_bit.values, '.1%')} and {_span(f_corr.values, '.3f')}"
        fid.append(text)
    if fid:
        lines += ["", "**Fidelity to the emulator** (same policy, tiles and GProj mode; every sharpness, N and d):", ""]
        lines += fid
    return "\n".join(lines)


def measured_cost_summary(ds: xr.Dataset, label: str = "this run") -> str:
    """Markdown bullets computed from this dataset's timings (issue 15's targets), per timed head dim
    and mask: GProj dq's extra forward + backward time over our kernel without it, measured and
    analytic, against the 5% target; our kernel's time relative to PyTorch's FlashAttention-2
    (target at most 1x) and cuDNN (the ceiling); the FP32 variants; and, with step timings, a
    training step with our kernel and with GProj against ``sdpa:flash``'s. Empty without GPU timings."""
    if not has_timings(ds):
        return ""
    t = ds["timing_fwd_bwd_ms"]
    a = ds["timing_analytic_fwd_bwd_ms"]
    names = set(t["timing_kernel"].values.tolist())
    lines = [f"**Measured on {label}** ({ds.attrs.get('timing_gpu', '')}, N = {ds.attrs['real_timing_seq_len']}, "
             f"{ds.attrs['real_timing_heads']} heads, bf16; forward + backward):", ""]
    for d in ds["timing_head_dim"].values:
        for c in ds["timing_causal"].values:
            at = dict(timing_head_dim=d, timing_causal=c, timing_dtype="bf16")
            base = float(t.sel(timing_kernel="triton:fa2", **at))
            if not np.isfinite(base):
                continue
            get = lambda k, dt="bf16": (float(t.sel(timing_kernel=k, timing_head_dim=d, timing_causal=c,
                                                    timing_dtype=dt)) if k in names else math.nan)
            parts = []
            g = get("triton:fa2:gproj_dq") / base - 1
            if np.isfinite(g):
                ga = float(a.sel(timing_kernel="triton:fa2:gproj_dq", **at)) / float(a.sel(timing_kernel="triton:fa2",
                                                                                          **at)) - 1
                parts.append(f"GProj dq {g:+.1%} (analytic count of the kernel's structure {ga:+.1%}; target at most "
                             f"+5%: {'met' if g <= 0.05 else 'missed'})")
            gk = get("triton:fa2:gproj_dq_dk") / base - 1
            if np.isfinite(gk):
                parts.append(f"GProj dq_dk {gk:+.1%}")
            for ref, label in (("sdpa:flash", "PyTorch's FlashAttention-2 (target at most 1x"),
                               ("sdpa:cudnn", "cuDNN (the ceiling")):
                r = base / get(ref)
                if np.isfinite(r):
                    tail = (f": {'met' if r <= 1 else 'missed'})" if ref == "sdpa:flash" else ")")
                    parts.append(f"{r:.2f}x {label}{tail}")
            fb, fa = get("triton:fa2:fp32_bwd") / base - 1, get("triton:fa2", "fp32") / base - 1
            if np.isfinite(fb):
                parts.append(f"FP32 backward {fb:+.0%}")
            if np.isfinite(fa):
                fa_tf = (4.0 * 3.5 * float(ds.attrs["real_timing_seq_len"]) ** 2 * int(d) * ds.attrs["real_timing_heads"]
                         * (0.5 if c else 1.0) / (get("triton:fa2", "fp32") * 1e-3) / 1e12)
                text = f"our kernel fed fp32 {fa:+.0%} ({fa_tf:.0f} TFLOP/s)"
                others = {k: get(k, "fp32") for k in names - {"triton:fa2"}}
                others = {k: v for k, v in others.items() if np.isfinite(v)}
                if others:
                    best = min(others, key=others.get)
                    text += f"; the fastest other kernel fed fp32, {best}, {others[best] / base - 1:+.0%}"
                parts.append(text)
            lines.append(f"* d = {int(d)}, {'causal' if c else 'no mask'}: " + "; ".join(parts) + ".")
    if has_step_timings(ds):
        step = ds["step_ms"]
        ok = ds["step_status"] == "ok"
        get = lambda k, dt="bf16": (float(step.sel(step_kernel=k, step_dtype=dt)) if k in step["step_kernel"].values
                                    and bool(ok.sel(step_kernel=k, step_dtype=dt)) else math.nan)
        ours, flash, gq = get("triton:fa2"), get("sdpa:flash"), get("triton:fa2:gproj_dq")
        if np.isfinite(flash):
            lines.append(f"* A training step ({ds.attrs['step_n_layer']} layers, width {ds.attrs['step_d_model']}, "
                         f"context {ds.attrs['step_context']}): with our kernel {ours / flash - 1:+.1%} over the same step "
                         f"with `sdpa:flash`, with our kernel's GProj dq {gq / flash - 1:+.1%} (against {gq / ours - 1:+.1%} "
                         "over our own kernel without GProj)"
                         + (": using the fix today means leaving PyTorch's faster kernel." if ours > flash else "."))
    return "\n".join(lines)


def bench_targets_summary(bench) -> str:
    """Markdown computed from ``bench_summary``'s table: issue 15's cost targets over the benchmark's
    shapes (GProj dq at most +5%; our kernel at most 1x ``sdpa:flash`` at N >= 4096; within 1.2x of
    compiled FlexAttention; cuDNN the ceiling), what was reached, and where the gap to
    ``sdpa:flash`` lies (forward or backward, per head dim)."""
    if bench is None or len(bench) == 0:
        return ""
    b = bench
    big = b[b.index.get_level_values("N") >= 4096]
    met = b[b["GProj dq extra"] <= 0.05]
    n_ok = len(met)
    named = ("" if not 0 < n_ok <= 3 else ": " + "; ".join(f"N {n}, d {d}, {'causal' if c else 'no mask'}"
                                                          for n, d, c in met.index))
    text = (f"**From the benchmark file:** GProj dq costs {b['GProj dq extra'].min():+.0%} to "
            f"{b['GProj dq extra'].max():+.0%} of forward + backward over the same kernel (the issue's target, at most "
            f"+5%, is met at {n_ok} of {len(b)} shapes{named}); two-pass GProj {b['GProj dq_dk extra'].min():+.0%} to "
            f"{b['GProj dq_dk extra'].max():+.0%}; the FP32 backward {b['FP32 backward extra'].min():+.0%} to "
            f"{b['FP32 backward extra'].max():+.0%}. Without GProj our kernel takes "
            f"{b['/ sdpa:flash'].min():.2f}-{b['/ sdpa:flash'].max():.2f}x PyTorch's FlashAttention-2 time "
            f"(target: at most 1x at N >= 4096; met at {int((big['/ sdpa:flash'] <= 1).sum())} of {len(big)} shapes), "
            f"{b['/ flex (compiled)'].min():.2f}-{b['/ flex (compiled)'].max():.2f}x compiled FlexAttention's (target: "
            f"within 1.2x; met at {int((b['/ flex (compiled)'] <= 1.2).sum())} of {len(b)}) and "
            f"{b['/ sdpa:cudnn'].min():.2f}-{b['/ sdpa:cudnn'].max():.2f}x cuDNN's (the ceiling).")
    where = []
    for d in sorted(set(big.index.get_level_values("d"))):
        sub = big.xs(d, level="d")
        if "fwd / sdpa:flash" in sub and np.isfinite(sub["fwd / sdpa:flash"]).any():
            where.append(f"d = {d}: forward {sub['fwd / sdpa:flash'].min():.2f}-{sub['fwd / sdpa:flash'].max():.2f}x, "
                         f"backward {sub['bwd / sdpa:flash'].min():.2f}-{sub['bwd / sdpa:flash'].max():.2f}x, "
                         f"forward + backward {sub['/ sdpa:flash'].min():.2f}-{sub['/ sdpa:flash'].max():.2f}x")
    if where:
        text += " Against `sdpa:flash` at N >= 4096, pass by pass: " + "; ".join(where) + "."
    return text


_VERDICT_WORDS = {"yes": "reproduced", "partly": "partly reproduced", "no": "not reproduced",
                  "not measured": "not measured", "untested": "untested"}


def seed004_headline(claims, ds: xr.Dataset) -> str:
    """Seed 004's three numbers (219% -> 0.34%, +4.7%, +33.4%) in plain words, from the claims
    table of ``seed004_claims(ds)``: for each, the row that measures it most directly (our Triton
    kernel's dQ errors; a whole training step of our model, else the attention call), its verdict
    and our numbers; the run named by its commit and device."""
    prefer = {"219% -> 0.34% (median dQ error before -> after GProj)":
                  ("median dQ error 219% -> 0.34% with GProj (our Triton kernel, GProj dq)",
                   "median dQ error 219% -> 0.34% with GProj (our Triton kernel)",
                   "median dQ error 219% -> 0.34% with GProj (emulator, gproj_dq)"),
              "+4.7% of a training step for GProj":
                  ("GProj costs +4.7% of a training step (a step of our model)", "GProj costs +4.7% of a training step"),
              "+33.4% of a training step for FP32 attention":
                  ("FP32 attention costs +33.4% of a training step (a step of our model)",
                   "FP32 attention costs +33.4% of a training step")}
    commit = str(ds.attrs.get("git_commit", ""))[:7] or "unknown"
    lines = [f"**Plainly** (the run of commit {commit}, {ds.attrs.get('device', '')}):", ""]
    for claim, rows in prefer.items():
        row = next((r for r in rows if r in claims.index and claims.loc[r, "ours"] not in ("not measured",
                                                                                        "not measured here")), None)
        if row is None:
            lines.append(f"* seed 004's **{claim}**: not measured on this run.")
            continue
        verdict = str(claims.loc[row, "reproduced?"])
        word = next((w for k, w in _VERDICT_WORDS.items() if verdict.startswith(k)), verdict.split(":")[0])
        why = verdict.split(":", 1)[1].strip() if ":" in verdict else ""
        where = ("our Triton kernel" if "Triton" in row else "the emulator" if "emulator" in row
                 else "a training step of our model" if "a step of our model" in row else "the attention call")
        lines.append(f"* seed 004's **{claim}**: **{word}** on {where}: ours {claims.loc[row, 'ours']}"
                     + (f"; {why}." if why else "."))
    return "\n".join(lines)
