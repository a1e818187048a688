"""Figures of study 03 (notebook ``notebooks/03_wasserstein_weight_drift.ipynb``): each ``plot_*`` reads the
study's results dataset (as written to ``results.nc``) and returns a matplotlib figure."""
from __future__ import annotations

import textwrap

import numpy as np
import xarray as xr
from . import GOLDEN_RATIO_RANGE, LOW_PRECISION_PAIRS
from .aggregates import layer_statistic
from .readings import group_table
from .readings_gpu import gpu_common_step, gpu_kind_table, gpu_lowprec_missing


PAIR_STYLE = {"repeat": ("#7f8c8d", ":"), "flash": ("#c0392b", "-"), "flash_fp32": ("#f1948a", "--"),
              "init_seed": ("#000000", "-"), "init_perturbation": ("#7d3c98", "--"),
              "bf16_training": ("#2874a6", "-"), "fp16_training": ("#1e8449", "-"),
              "flash_bf16": ("#e67e22", "-."), "flash_fp16": ("#a04000", "-.")}


def _or_blank(needs: str):
    """A figure function that draws an empty figure saying so for a run without ``needs`` among its
    variables (``ds`` None, or a tier that holds other data), so the notebook's cells run alike on every
    tier."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def wrapped(ds, *args, **kwargs):
            if ds is None or needs not in ds:
                import matplotlib.pyplot as plt

                fig, ax = plt.subplots(figsize=(6, 1.2))
                ax.text(0.5, 0.5, f"no data: this run holds no {needs}", ha="center", va="center",
                        transform=ax.transAxes)
                ax.set_axis_off()
                return fig
            return fn(ds, *args, **kwargs)
        return wrapped
    return wrap


METRIC_LABEL = {"wasserstein": "Wasserstein-1 of weight values", "wasserstein_rel": "W1 / RMS weight",
                "max_abs": "max |w_a - w_b|", "rel_l2": "||w_b - w_a|| / ||w_a||"}


def _log_y(ax) -> None:
    """Log y axis with major ticks only: minor ticks over many decades make saving slow."""
    import matplotlib.ticker as mticker

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(mticker.LogLocator(numticks=8))
    ax.yaxis.set_minor_locator(mticker.NullLocator())


def _band(ax, x, values, pair, label=None):
    """Median over seeds (last axis) with a min-max band, in the pair's style; zeros are not drawn."""
    color, style = PAIR_STYLE.get(pair, ("grey", "-"))
    values = np.where(values > 0, values, np.nan)
    with np.errstate(all="ignore"):
        ax.plot(x, np.nanmedian(values, -1), style, color=color, marker="o", ms=3, lw=1.2, label=label or pair)
        ax.fill_between(x, np.nanmin(values, -1), np.nanmax(values, -1), color=color, alpha=0.15, lw=0)


@_or_blank("model_wasserstein")
def plot_drift_over_training(ds: xr.Dataset, metrics=("wasserstein", "max_abs", "rel_l2")):
    """Model-level drift of every pair over training (Golden et al.'s Fig 7), one panel per metric:
    median over seeds, band from the smallest to the largest seed. Zero drift is not drawn."""
    from ...plots import subplots

    import warnings

    fig, axes = subplots(1, len(metrics), figsize=(4.6 * len(metrics) + 1.6, 3.8))
    x = ds["step"].values
    for ax, metric in zip(axes[0], metrics):
        for pair in ds["pair"].values:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                _band(ax, x, ds[f"model_{metric}"].sel(pair=pair).transpose("step", "seed").values, str(pair))
        _log_y(ax)
        ax.set_xlabel("optimizer step")
        ax.set_title(METRIC_LABEL[metric])
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


@_or_blank("model_wasserstein_rate")
def plot_drift_rates(ds: xr.Dataset, metric: str = "wasserstein"):
    """Left: rate of change of model-level drift per step since the previous checkpoint (Golden et
    al.'s Fig 8; negative rates are not drawn on the log axis). Right: its relative growth rate
    d log(drift) / d step (a chaos baseline grows at a steady positive rate)."""
    from ...plots import subplots

    import warnings

    fig, axes = subplots(1, 2, figsize=(11.5, 3.8))
    x = ds["step"].values
    da = ds[f"model_{metric}"]
    with np.errstate(all="ignore"):
        growth = np.log(da.where(da > 0)).diff("step", label="upper") / ds["step"].astype(float).diff(
            "step", label="upper")
    for pair in ds["pair"].values:
        if str(pair) == "repeat":
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            _band(axes[0][0], x, ds[f"model_{metric}_rate"].sel(pair=pair).transpose("step", "seed").values,
                  str(pair))
        color, style = PAIR_STYLE.get(str(pair), ("grey", "-"))
        g = growth.sel(pair=pair).median("seed")
        axes[0][1].plot(g["step"].values, g.values, style, color=color, marker="o", ms=3, lw=1.2, label=str(pair))
    _log_y(axes[0][0])
    axes[0][0].set_ylabel(f"d({metric}) / d step")
    axes[0][1].axhline(0.0, color="grey", lw=0.8, ls=":")
    axes[0][1].set_ylabel(f"d log({metric}) / d step (median over seeds)")
    for ax in axes[0]:
        ax.set_xlabel("optimizer step")
    axes[0][1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


@_or_blank("drift_ratio")
def plot_drift_ratios(ds: xr.Dataset, claim=GOLDEN_RATIO_RANGE):
    """Top: low-precision training drift over flash drift, per metric, geometric mean over seeds with
    its confidence interval (dotted: over the flash pair of the same format); Golden et al.'s 2-5x shaded. Bottom: flash drift over the noise floor
    (different seeds) and over the chaos baseline; above 1 means above that baseline."""
    from ...plots import subplots

    metrics = list(ds["metric"].values)
    fig, axes = subplots(2, len(metrics), figsize=(4.6 * len(metrics) + 2.2, 7.0), sharex=True)
    x = ds["step"].values
    conf = ds["drift_ratio_low"].attrs.get("confidence", ds.attrs.get("confidence", 0.95))
    for col, metric in enumerate(metrics):
        drawn = []
        for comp in ds["comparison"].values:
            num = str(ds["comparison_numerator"].sel(comparison=comp).values)
            den = str(ds["comparison_denominator"].sel(comparison=comp).values)
            row = 0 if num in LOW_PRECISION_PAIRS else 1
            if row == 0 and den not in ("flash", "flash_bf16", "flash_fp16"):
                continue  # over the fp32 kernel's drift the ratios are off this scale; see the table
            values = ds["drift_ratio"].sel(comparison=comp, metric=metric).values
            if any(np.array_equal(values, seen, equal_nan=True) for seen in drawn):
                continue  # the matched flash pair is the flash pair itself (kernel_policy of that format)
            drawn.append(values)
            ax = axes[row][col]
            color, _ = PAIR_STYLE.get(num if row == 0 else den, ("grey", "-"))
            style = ("-" if den == "flash" or (row == 1 and num == "flash")
                     else ":" if den in ("flash_bf16", "flash_fp16") else "--")
            sel = dict(comparison=comp, metric=metric)
            ax.plot(x, ds["drift_ratio"].sel(**sel).values, style, color=color, marker="o", ms=3, lw=1.2,
                    label=str(comp))
            ax.fill_between(x, ds["drift_ratio_low"].sel(**sel).values, ds["drift_ratio_high"].sel(**sel).values,
                            color=color, alpha=0.12, lw=0)
        axes[0][col].axhspan(*claim, color="#f4d03f", alpha=0.25, lw=0, label=f"Golden et al. {claim[0]:g}-{claim[1]:g}x")
        for row in (0, 1):
            axes[row][col].axhline(1.0, color="grey", lw=0.8, ls=":")
            _log_y(axes[row][col])
        low, high = axes[0][col].get_ylim()
        low, high = min(low, 0.5), max(high, 1.5 * claim[1])  # the claimed band in full
        axes[0][col].set_ylim(low, high)
        ticks = [t for t in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if low <= t <= high]
        axes[0][col].set_yticks(ticks, [f"{t:g}" for t in ticks])
        axes[0][col].set_title(METRIC_LABEL[metric])
        axes[1][col].set_xlabel("optimizer step")
    axes[0][0].set_ylabel(f"low precision / flash ({conf:.0%} interval)")
    axes[1][0].set_ylabel("flash / baseline pair")
    for row in (0, 1):
        axes[row][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


@_or_blank("kind_wasserstein_rel")
def plot_drift_by_group(ds: xr.Dataset, metric: str = "wasserstein_rel", step: int | None = None):
    """Heatmaps at one checkpoint (default the last), median over seeds: drift per kind of tensor
    and per transformer block, one row per pair (log colour scale; blank: exactly zero)."""
    import matplotlib.colors as mcolors

    from ...plots import subplots

    step = int(ds["step"][-1]) if step is None else step
    kind = group_table(ds, "kind", metric, step)
    layer = group_table(ds, "layer", metric, step)
    values = np.concatenate([kind.values.ravel(), layer.values.ravel()])
    positive = values[np.isfinite(values) & (values > 0)]
    norm = mcolors.LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
    fig, axes = subplots(1, 2, figsize=(12, 0.45 * len(kind) + 1.8),
                         gridspec_kw={"width_ratios": [kind.shape[1], max(2, layer.shape[1])]})
    for ax, table, title in ((axes[0][0], kind, "per kind of tensor"), (axes[0][1], layer, "per transformer block")):
        shown = np.where(table.values > 0, table.values, np.nan)
        image = ax.imshow(shown, norm=norm, cmap="viridis", aspect="auto")
        for (i, j), value in np.ndenumerate(shown):
            if np.isfinite(value):
                light = norm is not None and norm(value) > 0.6
                ax.text(j, i, f"{value:.1e}", ha="center", va="center", fontsize="x-small",
                        color="black" if light else "white")
        ax.set_xticks(range(table.shape[1]), [str(c) for c in table.columns])
        ax.set_yticks(range(table.shape[0]), [str(r) for r in table.index])
        ax.set_xlabel(table.columns.name)
        ax.grid(False)
        ax.set_title(f"{METRIC_LABEL.get(metric, metric)} {title}, step {step}", fontsize="small")
    fig.colorbar(image, ax=axes[0][1])
    return fig


@_or_blank("layer_rel_l2")
def plot_drift_vs_attention(ds: xr.Dataset, pairs=("flash", "init_perturbation"), statistics=("max_logit", "entropy"),
                            metric: str = "rel_l2"):
    """Per-layer drift of a pair against the attention statistic its reference run recorded at the
    same step: one panel per (pair, statistic), colour = layer, later steps darker."""
    from ...plots import subplots

    pairs = [p for p in pairs if p in ds["pair"].values]
    fig, axes = subplots(len(pairs), len(statistics), figsize=(4.4 * len(statistics) + 1.4, 3.4 * len(pairs)))
    palette = ["#c0392b", "#2874a6", "#1e8449", "#7d3c98", "#d35400", "#17a589"]
    later = ds["step"].values > 0
    alpha = np.linspace(0.25, 1.0, int(later.sum()))
    for i, pair in enumerate(pairs):
        run = str(ds["pair_run_a"].sel(pair=pair).values)
        drift_layer = ds[f"layer_{metric}"].sel(pair=pair).isel(step=later)
        for j, stat in enumerate(statistics):
            ax = axes[i][j]
            stat_layer = layer_statistic(ds, run, stat).isel(step=later)
            for layer in ds["layer"].values:
                for seed in ds["seed"].values:
                    x = stat_layer.sel(layer=layer, seed=seed).values
                    y = drift_layer.sel(layer=layer, seed=seed).values
                    ax.scatter(x, np.where(y > 0, y, np.nan), s=12, color=palette[int(layer) % len(palette)],
                               alpha=alpha, label=f"layer {layer}" if seed == ds["seed"].values[0] else None)
            rho = float(ds["corr_layer_rank"].sel(pair=pair, statistic=stat, corr_metric=metric))
            ax.set_title(f"{pair}: rank corr. across layers {rho:+.2f}", fontsize="small")
            ax.set_xlabel(f"{stat} of run {run}")
            _log_y(ax)
            ax.set_ylabel(f"per-layer {METRIC_LABEL.get(metric, metric)}")
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


@_or_blank("train_loss")
def plot_training_loss(ds: xr.Dataset):
    """Training loss of every run (median over seeds): the pairs' runs learn alike."""
    from ...plots import subplots

    fig, axes = subplots(1, 1, figsize=(7.5, 3.6))
    ax = axes[0][0]
    x = ds["train_step"].values
    for run in ds["run"].values:
        loss = ds["train_loss"].sel(run=run).median("seed")
        ax.plot(x, loss.values, lw=1, label=f"{run} ({ds['run_attention'].sel(run=run).values}, "
                                            f"autocast {ds['run_autocast'].sel(run=run).values})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nat)")
    ax.legend(fontsize="xx-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


@_or_blank("call_max_abs")
def plot_per_call(ds: xr.Dataset):
    """Left: max |O_flash - O_reference| of each layer's attention call in the flash-trained model at
    every checkpoint (median over seeds; one line style per layer, one colour per flash pair). Right:
    the same pairs' model-level weight drift max |w_a - w_b| (median over seeds, band over seeds)."""
    from ...plots import subplots

    import warnings

    fig, axes = subplots(1, 2, figsize=(11.5, 3.8), sharex=True)
    x = ds["step"].values
    styles = ["-", "--", ":", "-."]
    runs = []
    for pair in ds["call_pair"].values:
        run = str(ds["call_run"].sel(call_pair=pair).values) if "call_run" in ds else str(pair)
        if run in runs:
            continue  # the same flash-trained run as a pair already drawn
        runs.append(run)
        color, _ = PAIR_STYLE.get(str(pair), ("grey", "-"))
        dev = ds["call_max_abs"].sel(call_pair=pair).median("seed")
        for layer in ds["layer"].values:
            axes[0][0].plot(x, dev.sel(layer=layer).values, styles[int(layer) % 4], color=color, marker="o", ms=2.5,
                            lw=1.1, label=f"{pair}, layer {int(layer)}")
        if pair in ds["pair"].values:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # zero drift at step 0 is not drawn (log axis)
                _band(axes[0][1], x, ds["model_max_abs"].sel(pair=pair).transpose("step", "seed").values, str(pair))
    axes[0][0].set_ylabel("max |O_flash - O_ref| per attention call")
    axes[0][1].set_ylabel(METRIC_LABEL["max_abs"] + " (weights)")
    for ax in axes[0]:
        _log_y(ax)
        ax.set_xlabel("optimizer step (checkpoint)")
    axes[0][0].legend(fontsize="xx-small", ncol=2)
    axes[0][1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


GPU_COLORS = {"flash_vs_fp32": "#c0392b", "noise_floor": "#2874a6", "gpu_repeat": "#7f8c8d",
              "bf16_training": "#7d3c98", "fp16_training": "#d35400"}


@_or_blank("gpu_drift")
def plot_gpu_drift(ds: xr.Dataset):
    """The GPU pair records (gpu_training tier): model-level W1 over training per record (thin) and
    the geometric mean over seeds (thick); the relative W1 per kind of tensor at the last snapshot every
    pair record shares (``gpu_common_step``); the low-precision/flash ratio over training beside Golden
    et al.'s 2-5x (their claim), or, without a low-precision pair, a note saying so."""
    from ...plots import subplots

    fig, axes = subplots(1, 3, figsize=(15, 4.2))
    snaps = ds["snapshot"].values
    ax = axes[0, 0]
    for run in ds["run"].values:
        comp = str(ds["gpu_comparison_of_run"].sel(run=run).values)
        y = ds["gpu_model_wasserstein"].sel(run=run).values
        ok = np.isfinite(y) & (snaps > 0) & (y > 0)
        ax.plot(snaps[ok], y[ok], color=GPU_COLORS.get(comp, "grey"), lw=0.8, alpha=0.6)
    for comp in ds["gpu_comparison"].values:
        y = ds["gpu_drift"].sel(gpu_comparison=comp, gpu_metric="wasserstein").values
        ok = np.isfinite(y) & (snaps > 0) & (y > 0)
        ax.plot(snaps[ok], y[ok], color=GPU_COLORS.get(str(comp), "grey"), lw=2.2, marker="o", ms=3, label=str(comp))
    ax.set_yscale("log")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("model-level W1 drift (b vs a)")
    # like for like: every pair at the last snapshot all of them share (pairs bounded by a time budget
    # stop at different steps); only without one, each pair at its own last snapshot, the step in the legend
    common = gpu_common_step(ds)
    if common is not None:
        ax.axvline(common, color="grey", lw=0.8, ls=":", label=f"step {common}: middle panel")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    comps = [str(c) for c in ds["gpu_comparison"].values]
    width = 0.8 / max(1, len(comps))
    kinds = [str(k) for k in ds["kind"].values]
    for i, comp in enumerate(comps):
        step = common if common is not None else gpu_common_step(ds, [comp])
        if step is None:
            continue
        vals = gpu_kind_table(ds, step).loc[comp]
        label = comp if common is not None else f"{comp} (step {step})"
        ax.bar(np.arange(len(kinds)) + i * width, np.where(vals.values > 0, vals.values, np.nan), width,
               color=GPU_COLORS.get(comp, "grey"), label=label)
    ax.set_xticks(np.arange(len(kinds)) + 0.4 - width / 2, kinds, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("W1 / RMS weight of the kind (median over seeds)")
    ax.set_title(f"per kind at step {common}, the last snapshot every pair shares" if common is not None
                 else "per kind, each pair at its own last snapshot (no snapshot shared by all)", fontsize=9)
    ax.legend(fontsize=6)
    ax = axes[0, 2]
    absent = gpu_lowprec_missing(ds)
    if absent:
        note = (f"no record of {absent}: no low-precision / flash_vs_fp32 ratio to draw (Golden et al. claim "
                f"{GOLDEN_RATIO_RANGE[0]:g}-{GOLDEN_RATIO_RANGE[1]:g}x; their claim, not tested here).")
        ax.text(0.5, 0.5, textwrap.fill(note, 38), ha="center", va="center", fontsize=8, transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.grid(False)
        ax.set_title("low-precision / flash_vs_fp32 W1", fontsize=9)
        return fig
    for comp in ds["gpu_lowprec"].values:
        sub = ds.sel(gpu_lowprec=comp, gpu_metric="wasserstein")
        y, lo, hi = (sub[v].values for v in ("gpu_ratio", "gpu_ratio_low", "gpu_ratio_high"))
        ok = np.isfinite(y)
        ax.plot(snaps[ok], y[ok], marker="o", color=GPU_COLORS.get(str(comp), "grey"), label=str(comp))
        band = ok & np.isfinite(lo) & np.isfinite(hi)
        if band.any():
            ax.fill_between(snaps[band], lo[band], hi[band], color=GPU_COLORS.get(str(comp), "grey"), alpha=0.2)
        if "gpu_ratio_paired_low" in sub:  # the interval paired by seed, which carries the flash pairs' spread too
            plo, phi = sub["gpu_ratio_paired_low"].values, sub["gpu_ratio_paired_high"].values
            paired = np.isfinite(plo) & np.isfinite(phi)
            if paired.any():
                for k, edge in enumerate((plo, phi)):
                    ax.plot(snaps[paired], edge[paired], ls="--", lw=0.9, color=GPU_COLORS.get(str(comp), "grey"),
                            label=f"{comp}: interval paired by seed" if k == 0 else None)
    ax.axhspan(*GOLDEN_RATIO_RANGE, color="#f9e79f", alpha=0.5,
               label=f"Golden et al.'s {GOLDEN_RATIO_RANGE[0]:g}-{GOLDEN_RATIO_RANGE[1]:g}x (their claim)")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("low-precision W1 / flash_vs_fp32 W1")
    ax.legend(fontsize=7)
    return fig


@_or_blank("gpu_layer_wasserstein")
def plot_gpu_drift_by_layer(ds: xr.Dataset):
    """Relative W1 drift per transformer block over training, one panel per comparison (median over seeds)."""
    import matplotlib.pyplot as plt

    from ...plots import subplots

    comps = [str(c) for c in ds["gpu_comparison"].values]
    fig, axes = subplots(1, len(comps), figsize=(3.6 * len(comps) + 0.6, 3.2), sharey=True)
    snaps = ds["snapshot"].values
    layers = ds["layer"].values
    cmap = plt.get_cmap("viridis")
    for ax, comp in zip(axes[0], comps):
        runs = ds["run"].values[ds["gpu_comparison_of_run"].values == comp]
        sub = ds["gpu_layer_wasserstein_rel"].sel(run=runs).median("run")
        for i, layer in enumerate(layers):
            y = sub.sel(layer=layer).values
            ok = np.isfinite(y) & (y > 0) & (snaps > 0)
            ax.plot(snaps[ok], y[ok], color=cmap(i / max(1, len(layers) - 1)), lw=1, label=f"block {layer}")
        ax.set_yscale("log")
        ax.set_title(comp, fontsize=9)
        ax.set_xlabel("optimiser step")
    axes[0, 0].set_ylabel("W1 / RMS weight of the block")
    axes[0, 0].legend(fontsize=6, ncol=2)
    return fig
