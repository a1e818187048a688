"""Figures of study extreme_inputs (notebook ``notebooks/*_extreme_inputs.ipynb``): each ``plot_*`` reads the
study's results dataset (as written to ``results.nc``) and returns a matplotlib figure."""
from __future__ import annotations

import numpy as np
import pandas as pd
import xarray as xr


def _heatmap(ax, table: pd.DataFrame, *, cmap, vmin=None, vmax=None, annot=None, fmt="{:.2g}", mask=None,
             fontsize=6, colorbar_label=None, xrotation=0):
    """An annotated heatmap of a DataFrame (rows top to bottom), NaN or masked cells left blank.

    seaborn's heatmap redraws the whole figure once per call to check tick-label overlap;
    figures with several panels drew many times over, so the few lines are written out here.
    """
    import matplotlib.pyplot as plt

    values = table.to_numpy(dtype=float)
    hidden = ~np.isfinite(values) if mask is None else (mask | ~np.isfinite(values))
    cm = plt.get_cmap(cmap).copy()
    cm.set_bad(alpha=0.0)
    mesh = ax.pcolormesh(np.ma.masked_array(values, hidden), cmap=cm, vmin=vmin, vmax=vmax)
    ax.set_xlim(0, values.shape[1])
    ax.set_ylim(values.shape[0], 0)
    ax.set_xticks(np.arange(values.shape[1]) + 0.5, [str(c) for c in table.columns], rotation=xrotation,
                  ha="right" if xrotation else "center", rotation_mode="anchor")
    ax.set_yticks(np.arange(values.shape[0]) + 0.5, [str(i) for i in table.index])
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    texts = annot.to_numpy() if annot is not None else None
    norm = mesh.norm
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            if hidden[i, j]:
                continue
            text = texts[i, j] if texts is not None else fmt.format(values[i, j])
            shade = cm(norm(values[i, j]))
            light = 0.299 * shade[0] + 0.587 * shade[1] + 0.114 * shade[2] > 0.5
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=fontsize,
                    color="black" if light else "white")
    if colorbar_label:
        ax.figure.colorbar(mesh, ax=ax, label=colorbar_label)
    return mesh


def plot_sentinels(ds: xr.Dataset, policy: str):
    """Mask handlings x cases, one policy: rows zeroed and masked-key influence (the rest is in tables)."""
    from ...plots import subplots

    sub = ds.sel(sentinel_policy=policy).max("seed")
    panels = (("sentinel_zero_row_fraction", "fraction of rows zeroed where golden is not", "Reds", 1),
              ("sentinel_masked_key_influence", "masked-key influence max|dO| (V shifted by 100)", "Oranges", 100))
    fig, axes = subplots(1, 2, figsize=(11.5, 4.2))
    for ax, (var, title, cmap, vmax) in zip(axes.ravel(), panels):
        table = sub[var].to_dataframe()[var].unstack("case")[list(ds["case"].values)]
        _heatmap(ax, table, cmap=cmap, vmin=0, vmax=vmax, xrotation=50)
        ax.set_title(title, fontsize="small")
        ax.tick_params(axis="x", labelsize=6.5)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("")
        ax.set_ylabel("")
    fig.suptitle(f"mask handling, {policy}, N = {int(ds['sentinel_seq_len'])} (max over seeds; blank: not "
                 "applicable)", fontsize="medium")
    return fig


def plot_onset(ds: xr.Dataset):
    """Fraction of rows zeroed by the -5e4 sentinel against the row's largest valid logit."""
    from ...plots import subplots

    fig, axes = subplots(1, 1, figsize=(7, 3.6))
    ax = axes[0][0]
    styles = ("-", "--", "-.", ":")
    for i, policy in enumerate(ds["sentinel_policy"].values):
        logit = ds["onset_row_max_logit"].sel(sentinel_policy=policy).values.ravel()
        zero = ds["onset_row_zero"].sel(sentinel_policy=policy).values.ravel()
        order = np.argsort(logit)
        bins = np.linspace(logit.min(), logit.max(), 40)
        which = np.digitize(logit[order], bins)
        centers = [logit[order][which == b].mean() for b in np.unique(which)]
        rate = [zero[order][which == b].mean() for b in np.unique(which)]
        line, = ax.plot(centers, rate, marker="os^D"[i % 4], ms=3, ls=styles[i % 4], alpha=0.85, label=emulator_name(ds, str(policy)))
        ax.axvline(float(ds["onset_predicted_logit"].sel(sentinel_policy=policy)), color=line.get_color(),
                   ls=":", lw=1)
    ax.axvline(float(ds["onset_fill"]), color="k", lw=0.8, ls="--", label="sentinel")
    ax.set_xlabel("largest valid raw logit of the row (q.k, unscaled)")
    ax.set_ylabel("fraction of rows output as zero")
    ax.set_title("finite -5e4 sentinel: where the zero output starts (dotted: predicted)", fontsize="small")
    ax.legend(fontsize="x-small")
    return fig


def plot_detection(ds: xr.Dataset):
    """Headline: detection rate of each fault at its default severity, and false alarms on the
    correct kernel (top row, reversed colours), by rule and N, one panel per dtype."""
    from ...plots import subplots

    dtypes = list(ds["det_dtype"].values)
    rules = list(ds["rule"].values)
    lens = [int(n) for n in ds["det_seq_len"].values]
    n_cols = len(rules) * len(lens)
    fig, axes = subplots(len(dtypes), 1, figsize=(3.2 + 0.42 * n_cols, (1.4 + 0.3 * (ds.sizes["fault"] + 1))
                                                  * len(dtypes)))
    for ax, fmt in zip(axes[:, 0], dtypes):
        fa = ds["det_false_alarm_rate"].sel(det_dtype=fmt)
        rows = {"correct kernel: false alarms": [float(fa.sel(rule=r, det_seq_len=n)) for r in rules for n in lens]}
        for fault in ds["fault"].values:
            lev = int(ds["default_level"].sel(fault=fault))
            rate = ds["det_detection_rate"].sel(det_dtype=fmt, fault=fault, severity_level=lev)
            sev = ds["severity"].sel(fault=fault, severity_level=lev).item()
            rows[f"{fault} ({sev:g})"] = [float(rate.sel(rule=r, det_seq_len=n)) for r in rules for n in lens]
        table = pd.DataFrame(rows, index=[f"N={n}" for r in rules for n in lens]).T
        top = np.zeros(table.shape, dtype=bool)
        top[0] = True
        _heatmap(ax, table, cmap="RdYlGn", vmin=0, vmax=1, fmt="{:.1f}", mask=top)
        _heatmap(ax, table, cmap="RdYlGn_r", vmin=0, vmax=1, fmt="{:.1f}", mask=~top)
        for i, rule in enumerate(rules):
            ax.text((i + 0.5) * len(lens), -0.25, rule, ha="center", va="bottom", fontsize=7)
            if i:
                ax.axvline(i * len(lens), color="k", lw=1)
        ax.axhline(1, color="k", lw=1.5)
        ax.tick_params(axis="x", labelsize=6.5, rotation=0)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(f"fa2_{fmt}: share of (family, seed) points where the rule rejects the output; blank: "
                     "the fault changed nothing", fontsize="small", pad=22)
    return fig


def plot_miss_rates(ds: xr.Dataset):
    """Share of faulty outputs each rule accepts, by the size of the worst row's error and by N."""
    from ...plots import subplots

    dtypes = list(ds["det_dtype"].values)
    bins = list(ds["error_bin"].values)[-2:]  # the smallest bin overlaps bf16's own rounding error
    fig, axes = subplots(len(dtypes), len(bins), sharey=True, sharex=True,
                         figsize=(3.3 * len(bins) + 1.5, 2.6 * len(dtypes)))
    n = ds["det_seq_len"].values
    for row, fmt in zip(axes, dtypes):
        for ax, b in zip(row, bins):
            for rule in ds["rule"].values:
                ax.plot(n, ds["det_miss_rate"].sel(rule=rule, det_dtype=fmt, error_bin=b).values, marker="o", ms=3,
                        label=str(rule))
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.03, 1.03)
            counts = ds["det_error_bin_count"].sel(det_dtype=fmt, error_bin=b).values.astype(int)
            ax.set_title(f"fa2_{fmt}, worst row off by {b}\n(cases per N: {', '.join(map(str, counts))})",
                         fontsize="x-small")
        row[0].set_ylabel("accepted (missed)")
    for ax in axes[-1]:
        ax.set_xlabel("sequence length N")
    axes[0][-1].legend(fontsize="xx-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_real_kernels(ds: xr.Dataset):
    """What each real kernel returned on every input and mask delivery, one panel per input format:
    green agrees with the golden value's finite-ness, zero rows and masking (text: relative error),
    red departs (text: how), grey gave no output (text: why); blank: not applicable."""
    from ...plots import subplots
    from .real_kernels import real_outcome_table

    dtypes = [str(d) for d in ds["real_dtype"].values]
    tables = [real_outcome_table(ds, fmt) for fmt in dtypes]
    n_rows = max((len(codes) for codes, _ in tables), default=1)
    n_cols = ds.sizes["real_kernel"]
    fig, axes = subplots(1, len(dtypes), figsize=(len(dtypes) * (2.6 + 1.45 * n_cols) + 1.0, 1.2 + 0.24 * n_rows))
    for ax, fmt, (codes, labels) in zip(axes[0], dtypes, tables):
        grey = codes == 0.5
        _heatmap(ax, codes, cmap="RdYlGn_r", vmin=0, vmax=1, annot=labels, mask=grey.to_numpy(), fontsize=5.5)
        _heatmap(ax, codes.where(grey), cmap="Greys", vmin=0, vmax=2.5, annot=labels, fontsize=5.5)
        ax.tick_params(axis="y", labelsize=6)
        ax.tick_params(axis="x", labelsize=7)
        ax.xaxis.tick_top()
        ax.set_title(f"{fmt} inputs, N = {int(ds['real_seq_len'])}, d = {int(ds['real_head_dim'])}",
                     fontsize="small", pad=14)
    fig.suptitle("real kernels on extreme inputs and masks: green agrees with fp64 (relative error), red departs, "
                 "grey no output", fontsize="small")
    return fig


def plot_dilution(ds: xr.Dataset):
    """The largest error confined to a few rows that a fixed 0.1% tolerance still accepts, against
    the number of rows it averages over, per metric (panels) and dtype and number of faulty rows
    (lines; smallest over seeds; missing where the tolerance rejects the correct output); the
    dotted line is seed 000's missed 12%."""
    from ...plots import subplots

    metrics = list(ds["dil_metric"].values)
    names = {"rel_l2": "relative L2", "mean_rel": "mean relative error (seed 000)"}
    fig, axes = subplots(1, len(metrics), sharey=True, figsize=(4.2 * len(metrics) + 1.5, 3.2))
    rows_seen = ds["dil_rows"].values
    colours = {"bf16": "C0", "fp16": "C1", "fp32": "C2"}
    styles = ["-", "--", ":", "-."]
    for ax, metric in zip(axes[0], metrics):
        for fmt in ds["dil_dtype"].values:
            for k, r in enumerate(ds["dil_faulty_rows"].values):
                big = ds["dil_largest_accepted"].sel(dil_metric=metric, dil_dtype=fmt, dil_faulty_rows=r).min(
                    "dil_seed", skipna=False).values
                ax.plot(rows_seen, big, marker="o", ms=3, color=colours.get(str(fmt)), ls=styles[k % len(styles)],
                        label=f"{emulator_name(ds, f'fa2_{fmt}')}, {int(r)} faulty row{'s' if r > 1 else ''}")
        ax.axhline(0.12, color="k", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"0.1% on the {names.get(str(metric), str(metric))}", fontsize="small")
        ax.set_xlabel("rows averaged over (batch x heads x N)", fontsize="small")
    axes[0][0].set_ylabel("largest row error accepted")
    axes[0][-1].legend(fontsize="xx-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def emulator_name(ds: xr.Dataset, policy: str) -> str:
    """The registry name of the emulator under ``policy`` with the run's tiles (``emulator:fa2_bf16:bk128``):
    the name a legend gives it; the policy alone where the run's parameters are not in ``ds.attrs``."""
    import json

    from ... import kernels

    params = json.loads(ds.attrs.get("parameters", "{}") or "{}")
    if "block_q" not in params or "block_k" not in params:
        return policy
    return kernels.emulator(policy, block_q=int(params["block_q"]), block_k=int(params["block_k"])).name


def plot_flashinfer_sentinel(probes: dict, tol: float | None = None):
    """FlashInfer's error against the logit level -L of the probe's rows, per kernel (panels) and version
    (colour), no mask (solid) and causal (dashed); the prefill kernel's masked-key weight in a third panel.
    Marked: the finite sentinel of the older version (vertical, dashed), the emulator's predicted onset for it
    (dotted) and the onset tolerance (horizontal). ``probes``: ``readings_flashinfer.load_flashinfer_probes``."""
    import math

    from ...plots import subplots
    from .readings_flashinfer import (FLASHINFER_KERNELS, ONSET_TOLERANCE, emulated_onset, sentinel_levels,
                                      sentinel_value)

    tol = ONSET_TOLERANCE if tol is None else tol
    fig, axes = subplots(1, 3, figsize=(12, 3.6))
    axes = axes[0]
    colours = ("C3", "C0", "C2", "C1")
    finite = [sentinel_value(r) for r in probes.values() if r is not None and math.isfinite(sentinel_value(r))]
    for i, (version, record) in enumerate(probes.items()):
        if record is None:
            continue
        s = sentinel_value(record)
        label = f"{version} (sentinel {record.get('flashinfer_mask_sentinel')})"
        for kernel in FLASHINFER_KERNELS:  # the prefill kernel left; both decode kernels (square: paged) middle
            if kernel not in record["kernels"]:
                continue
            ax, paged = axes[0 if kernel.endswith("prefill") else 1], kernel.endswith("paged")
            lv = sentinel_levels(record, kernel)
            for case, ls in (("nomask", "-"), ("causal", "--")):
                if f"{case}_err" in lv:
                    ax.plot(lv["level"], lv[f"{case}_err"], ls=ls, marker="s" if paged else "o", ms=3,
                            color=colours[i % 4], label=f"{label}, {case}" + (", paged" if paged else ""))
            if not paged:
                ax.set_title(kernel, fontsize="small")
            ax.set_ylabel("relative L2 error")
            ax.set_yscale("log")
        lv = sentinel_levels(record, FLASHINFER_KERNELS[0]) if FLASHINFER_KERNELS[0] in record["kernels"] else None
        if lv is not None and "masked_err" in lv:
            axes[2].plot(lv["level"], lv["masked_err"], marker="o", ms=3, color=colours[i % 4], label=label)
    axes[2].set_title(f"{FLASHINFER_KERNELS[0]}, half the keys masked", fontsize="small")
    axes[2].set_ylabel("largest weight on masked keys")
    for ax, case in zip(axes, ("nomask", "nomask", "masked")):
        ax.set_xscale("log")
        ax.set_xlabel("L (valid scaled logits of every row at -L)")
        ax.axhline(tol, color="grey", lw=0.8, ls="-.", label="onset tolerance")
        for s in finite:
            ax.axvline(s, color="k", lw=0.8, ls="--", label="finite sentinel")
            ax.axvline(emulated_onset(s, case, tol=tol), color="k", lw=0.8, ls=":", label="emulator's onset")
    for ax in axes:
        ax.legend(fontsize="xx-small")
    fig.suptitle("FlashInfer before and after its sentinel fix (committed H200 probe)", fontsize="medium")
    return fig
