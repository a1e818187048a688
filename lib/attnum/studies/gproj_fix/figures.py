"""Figures of study gproj_fix (notebook ``notebooks/*_gproj_fix.ipynb``): each ``plot_*`` reads the
study's results dataset (as written to ``results.nc``) and returns a matplotlib figure."""
from __future__ import annotations

import numpy as np
import xarray as xr
from ...plots import offset_axis
from .readings import SEED004_DQ_ERR_AFTER, SEED004_DQ_ERR_BEFORE


FIX_STYLE = {"none": ("#c0392b", "-"), "forward_fix": ("#f1948a", "--"), "mean_key": ("#d68910", "-"),
             "stable_max": ("#7d3c98", "-."), "fp32_backward": ("#2874a6", "-"), "gproj_dq": ("#17a589", "--"),
             "gproj_dq_dk": ("#117a65", "-"), "fp32_attention": ("#000000", ":")}
BASELINE_STYLE = ("#000000", ":")  # the FP32-attention training run, whatever its kernel


def _style(fix) -> tuple[str, str]:
    return FIX_STYLE.get(str(fix), ("grey", "-"))


def plot_error_vs_offset(ds: xr.Dataset, var: str = "grid_dq_err"):
    """One panel per sharpness: median (over seeds) error vs |mu| of every fix, at the largest N and
    the first d, with seed 004's before/after numbers as horizontal marks (theirs)."""
    from ...plots import subplots

    sub = ds[var].isel(seq_len=-1, head_dim=0).median("seed")
    sharp = ds["sharpness"].values
    fig, axes = subplots(1, len(sharp), sharey=True, figsize=(3.6 * len(sharp) + 1.8, 3.6))
    x = ds["mu_norm"].values
    for ax, s in zip(axes[0], sharp):
        for fix in ds["fix"].values:
            color, style = _style(fix)
            ax.plot(x, sub.sel(sharpness=s, fix=fix).values, style, color=color, marker="o", ms=3, label=str(fix))
        if var == "grid_dq_err":
            for level, text in ((SEED004_DQ_ERR_BEFORE, "seed 004 before (theirs)"),
                                (SEED004_DQ_ERR_AFTER, "seed 004 after GProj (theirs)")):
                ax.axhline(level, color="k", lw=0.7, ls=(0, (1, 3)))
                ax.annotate(text, (0.02, level), xycoords=("axes fraction", "data"), fontsize="xx-small",
                            va="bottom")
        ax.set_title(f"sharpness {s:g}")
        offset_axis(ax)
        ax.set_yscale("log")
    axes[0][0].set_ylabel(ds[var].attrs.get("long_name", var).replace("median row relative L2 error",
                                                                      "median row rel. err."), fontsize="small")
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"N = {int(ds['seq_len'][-1])}, d = {int(ds['head_dim'][0])}: exact attention ignores mu, but the "
                 f"keys are k + mu rounded to bf16 (section 1b)", fontsize="medium")
    return fig


def plot_delta_path(ds: xr.Dataset):
    """dQ error vs sharpness for every fix, as run (solid) and with D formed from the exact output
    (dashed), at |mu| = 0 and at the largest |mu| (largest N, first d)."""
    from ...plots import subplots

    mus = [float(ds["mu_norm"][0]), float(ds["mu_norm"][-1])]
    fig, axes = subplots(1, 2, sharey=True, figsize=(11, 3.8))
    x = ds["sharpness"].values
    for ax, mu in zip(axes[0], mus):
        for fix in ds["fix"].values:
            color, _ = _style(fix)
            sel = dict(fix=fix, mu_norm=mu)
            ax.plot(x, ds["grid_dq_err"].sel(**sel).isel(seq_len=-1, head_dim=0).median("seed").values, "-",
                    color=color, marker="o", ms=3, label=f"{fix}")
            ax.plot(x, ds["grid_dq_err_exact_delta"].sel(**sel).isel(seq_len=-1, head_dim=0).median("seed").values,
                    "--", color=color, marker="x", ms=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sharpness (factor on q)")
        ax.set_title(f"|mu| = {mu:g}; dashed: D from the exact output")
    axes[0][0].set_ylabel("median row rel. err. of dQ")
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_dk_dv(ds: xr.Dataset):
    """dK and dV median (solid) and 99th-percentile (dotted) errors vs |mu| at the largest sharpness
    (largest N, first d)."""
    from ...plots import subplots

    s = float(ds["sharpness"][-1])
    fig, axes = subplots(1, 2, sharey=True, figsize=(11, 3.8))
    x = ds["mu_norm"].values
    for ax, grad in zip(axes[0], ("dk", "dv")):
        names = [f"grid_{grad}_err", f"grid_{grad}_err_p99"]
        sub = ds[names].sel(sharpness=s).isel(seq_len=-1, head_dim=0).median("seed")
        for fix in ds["fix"].values:
            color, style = _style(fix)
            ax.plot(x, sub[names[0]].sel(fix=fix).values, style, color=color, marker="o", ms=3, label=str(fix))
            ax.plot(x, sub[names[1]].sel(fix=fix).values, ":", color=color, lw=0.9)
        offset_axis(ax)
        ax.set_yscale("log")
        ax.set_title(f"{'dK' if grad == 'dk' else 'dV'}, sharpness {s:g} (dotted: 99th percentile)", fontsize="small")
    axes[0][0].set_ylabel("row rel. err.")
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_regimes(ds: xr.Dataset):
    """dQ error, and the coherence across rows of the forward-output error (1: every row errs alike),
    of every fix in each regime (median over seeds)."""
    from ...plots import subplots

    fig, axes = subplots(1, 2, figsize=(12, 3.9))
    regimes = ds["regime"].values
    fixes = ds["fix"].values
    width = 0.8 / len(fixes)
    for ax, var, label in zip(axes[0], ("regime_dq_err", "regime_out_err_coherence"),
                              ("median row rel. err. of dQ", "output-error coherence across rows")):
        vals = ds[var].median("seed")
        for i, fix in enumerate(fixes):
            ax.bar(np.arange(len(regimes)) + (i - len(fixes) / 2 + 0.5) * width, vals.sel(fix=fix).values, width,
                   color=_style(fix)[0], label=str(fix))
        ax.set_xticks(np.arange(len(regimes)), [str(r).replace("tied_max_", "tied max, ").replace("_", " ")
                                                for r in regimes], fontsize="x-small")
        ax.set_ylabel(label)
    axes[0][0].set_yscale("log")
    axes[0][-1].legend(fontsize="xx-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_costs(ds: xr.Dataset):
    """Left: analytic extras of each fix over the base kernel (forward + backward, per head).
    Right: the emulator's measured time on the run's device relative to the base (an emulation, not a kernel)."""
    from ...plots import subplots

    fig, axes = subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    fixes = [str(f) for f in ds["fix"].values]
    y = np.arange(len(fixes))
    bars = (("cost_extra_compute_vs_attention", "arithmetic time at H100 peaks"),
            ("cost_extra_traffic_vs_attention", "memory traffic"))
    for i, (var, label) in enumerate(bars):
        axes[0][0].barh(y + (i - 0.5) * 0.4, 100 * ds[var].values, 0.4, label=label,
                        color=["#2874a6", "#d68910"][i])
    axes[0][0].set_yticks(y, fixes)
    axes[0][0].set_xscale("symlog", linthresh=10)
    axes[0][0].set_xlabel("extra over the base kernel, % of its forward + backward (analytic)")
    axes[0][0].set_title(f"real kernel, counted: N = {ds.attrs.get('cost_seq_len')}, "
                         f"d = {ds.attrs.get('cost_head_dim')}, causal = {bool(ds.attrs.get('cost_causal'))}",
                         fontsize="small")
    axes[0][0].legend(fontsize="x-small")
    emul = ds["emul_forward_seconds"] + ds["emul_backward_seconds"]
    axes[0][1].barh(y, (emul / emul.sel(fix="none")).values, 0.6, color="grey")
    axes[0][1].axvline(1.0, color="k", lw=0.8)
    axes[0][1].set_yticks(y, fixes)
    axes[0][1].set_xlabel("fwd + bwd time / base")
    where = "GPU" if str(ds.attrs.get("device", "cpu")).startswith("cuda") else "CPU"
    axes[0][1].set_title(f"{where} EMULATION, measured: N = {ds.attrs.get('timing_seq_len')}, "
                         f"d = {ds.attrs.get('timing_head_dim')}", fontsize="small")
    return fig


def plot_fix_training(ds: xr.Dataset, baseline: str | None = None, window: int = 5):
    """Top: loss (running mean over ``window`` records), its difference from the baseline, and the
    global gradient norm ratio to the baseline. Bottom: each layer's gradient norm, and the key-mean
    norm of every layer (solid: layer 0, then dashed, dotted). ``baseline``: the FP32-attention run
    (default ``readings.baseline_run``)."""
    from ...plots import subplots
    from .readings import baseline_run

    baseline = baseline_run(ds) if baseline is None else baseline
    layers = ds["layer"].values
    ncols = max(3, len(layers) + 1)
    fig, axes = subplots(2, ncols, figsize=(4.6 * ncols, 7.2))
    steps = ds["step"].values
    smooth = lambda da: da.rolling(step=window, center=True, min_periods=1).mean()
    base_loss = smooth(ds["train_loss"].sel(run=baseline))
    for run in ds["run"].values:
        color, style = BASELINE_STYLE if run == baseline else _style(run)
        attention = str(ds["run_attention"].sel(run=run).values)
        label = f"{run} (FP32 attention)" if run == baseline else f"{run}: {attention}"
        loss = smooth(ds["train_loss"].sel(run=run))
        axes[0][0].plot(steps, loss.values, style, color=color, lw=1, label=label)
        axes[0][1].plot(steps, (loss - base_loss).values, style, color=color, lw=1)
        ratio = ds["train_grad_norm_total"].sel(run=run) / ds["train_grad_norm_total"].sel(run=baseline)
        axes[0][2].plot(steps, smooth(ratio).values, style, color=color, lw=1)
        for i, layer in enumerate(layers):
            axes[1][i].plot(steps, smooth(ds["train_grad_norm"].sel(run=run, layer=layer)).values, style,
                            color=color, lw=1)
            axes[1][len(layers)].plot(steps, ds["train_key_mean_norm"].sel(run=run, layer=layer).values,
                                      ["-", "--", ":", "-."][i % 4], color=color, lw=1)
    axes[0][0].set_ylabel("training loss (nat)")
    axes[0][0].legend(fontsize="xx-small")
    axes[0][1].axhline(0, color="grey", lw=0.8)
    axes[0][1].set_ylabel(f"loss - loss of {baseline} (nat)")
    axes[0][2].axhline(1, color="grey", lw=0.8)
    axes[0][2].set_ylabel(f"global grad norm / {baseline}'s")
    for i, layer in enumerate(layers):
        axes[1][i].set_yscale("log")
        axes[1][i].set_ylabel(f"layer {layer}: gradient norm")
    axes[1][len(layers)].set_ylabel("key-mean norm ||mean_j k_j||")
    for row in axes:
        for ax in row:
            ax.set_xlabel("step")
    for ax in list(axes[0][3:]) + list(axes[1][len(layers) + 1:]):
        ax.set_visible(False)
    return fig


REAL_COLORS = {"triton:fa2": "#c0392b", "triton:fa2:gproj_dq": "#17a589", "triton:fa2:gproj_dq_dk": "#117a65",
               "triton:fa2:fp32_bwd": "#2874a6", "sdpa:flash": "#d68910", "sdpa:efficient": "#7d3c98",
               "sdpa:cudnn": "#f1948a", "sdpa:math": "#000000", "fa4": "#34495e"}


def plot_real_kernels(ds: xr.Dataset, var: str = "real_dq_err"):
    """One panel per sharpness: each real kernel's median row dQ error vs |mu| (solid) beside its
    emulated equivalent's on the same operands (dashed), at the largest N and d of the grid; the
    shaded band marks offsets beyond the trusted one (the rounded keys changed the exact problem)."""
    from ...plots import subplots
    from .readings import trusted_offset

    at = dict(seq_len=int(ds["seq_len"][-1]), head_dim=int(ds["head_dim"][-1]))
    sharp = ds["sharpness"].values
    fig, axes = subplots(1, len(sharp), sharey=True, figsize=(3.6 * len(sharp) + 2.2, 3.6))
    x = ds["mu_norm"].values
    trusted = trusted_offset(ds)
    for ax, s in zip(axes[0], sharp):
        for name in ds["real_kernel"].values:
            if str(ds["real_status"].sel(real_kernel=name, **at).item()) != "ok":
                continue
            color = REAL_COLORS.get(str(name), "grey")
            sel = dict(real_kernel=name, sharpness=s, **at)
            ax.plot(x, ds[var].sel(sel).median("seed").values, "-", color=color, marker="o", ms=3, label=str(name))
            emul = ds[var.replace("real_", "real_emul_")].sel(sel).median("seed").values
            if np.isfinite(emul).any():
                ax.plot(x, emul, "--", color=color, lw=0.9)
        if trusted < x[-1]:
            ax.axvspan(trusted, x[-1], color="0.9", zorder=0)
        ax.set_title(f"sharpness {s:g}")
        offset_axis(ax)
        ax.set_yscale("log")
    axes[0][0].set_ylabel("median row rel. err. of dQ")
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"real kernels (solid) and their emulated equivalents (dashed), N = {at['seq_len']}, "
                 f"d = {at['head_dim']}; shaded: |mu| beyond {trusted:g} (exact problem changed)", fontsize="medium")
    return fig


def plot_exact_problem(ds: xr.Dataset):
    """Left: the relative perturbation rounding puts on the keys and the distinct values per key
    component / N vs |mu| (both independent of the sharpness); right: the exact dQ's relative change
    from |mu| = 0 (solid, one colour per sharpness; the dotted line is the trusted limit) and its
    median row norm relative to |mu| = 0 (dashed). Largest N, first d, median over seeds; zero values
    (|mu| = 0 against itself) are left out of the logarithmic axes."""
    from ...plots import subplots
    from .readings import EXACT_CHANGE_LIMIT

    sub = ds[["grid_key_perturbation", "grid_distinct_key_values", "grid_exact_dq_change", "grid_exact_dq_norm"]]
    sub = sub.isel(seq_len=-1, head_dim=0).median("seed")
    fig, axes = subplots(1, 2, figsize=(11, 3.8))
    x = ds["mu_norm"].values
    pos = lambda values: np.where(values > 0, values, np.nan)
    first = sub.isel(sharpness=0)
    axes[0][0].plot(x, pos(first["grid_key_perturbation"].values), "-o", ms=3, color="k",
                    label="||rounded k + mu - mu - k|| / ||k||")
    axes[0][0].plot(x, first["grid_distinct_key_values"].values, "--x", ms=3, color="k",
                    label="distinct values per key component / N")
    for i, s in enumerate(ds["sharpness"].values):
        color = f"C{i}"
        axes[0][1].plot(x, pos(sub["grid_exact_dq_change"].sel(sharpness=s).values), "-o", ms=3,
                        color=color, label=f"sharpness {s:g}")
        norm = sub["grid_exact_dq_norm"].sel(sharpness=s)
        axes[0][1].plot(x, (norm / norm.isel(mu_norm=0)).values, "--x", ms=3, color=color)
    axes[0][1].axhline(EXACT_CHANGE_LIMIT, color="k", lw=0.7, ls=":")
    axes[0][0].set_title("the keys", fontsize="small")
    axes[0][1].set_title("exact dQ: relative change (solid), row norm / at |mu| = 0 (dashed)", fontsize="small")
    for ax in axes[0]:
        offset_axis(ax)
        ax.set_yscale("log")
        ax.legend(fontsize="x-small")
    fig.suptitle(f"what rounding k + mu to bf16 does to the exact problem (N = {int(ds['seq_len'][-1])}, "
                 f"d = {int(ds['head_dim'][0])})", fontsize="medium", y=1.02)
    return fig
