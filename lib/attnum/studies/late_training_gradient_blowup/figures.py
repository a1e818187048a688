"""Figures of study late_training_gradient_blowup (notebook ``notebooks/*_late_training_gradient_blowup.ipynb``): each ``plot_*`` reads the
study's results dataset (as written to ``results.nc``) and returns a matplotlib figure."""
from __future__ import annotations

import numpy as np
import xarray as xr
from ...plots import offset_axis


def metric_label(var: str) -> str:
    """The axis label of a gradient-error variable, naming which of the two dQ metrics it is:
    ``*_row_rel_err`` / ``*_err`` of the grids is the median row relative error, ``*_rel_err`` of the
    diagnostic the global relative L2 error (all rows together). The two are never compared."""
    grad = next((g for g in ("dq", "dk", "dv") if f"{g}_" in var), "dq")
    name = f"d{grad[1].upper()}"
    if var.endswith("_row_rel_err") or (var.endswith("_err") and not var.endswith("_rel_err")):
        return f"median row rel. err. of {name}"
    return f"global rel. L2 err. of {name} (all rows)"


VARIANT_STYLE = {"fp32": ("#1e8449", "-"), "fp32_fused": ("#58d68d", "--"), "fp32_ds_bf16": ("#2874a6", "-"),
                 "bf16_bwd_fp32": ("#7d3c98", "-"), "bf16": ("#c0392b", "-"), "bf16_fused": ("#f1948a", "--"),
                 "reference_bf16": ("#7f8c8d", ":")}


def variant_label(ds: xr.Dataset, variant, coord: str = "variant") -> str:
    """A variant's legend entry: its study name and, where the run records it, the kernel's own name."""
    var = {"variant": "variant_kernel", "real_variant": "real_variant_kernel"}[coord]
    if var in ds and variant in ds[coord].values:
        return f"{variant} ({ds[var].sel({coord: variant}).item()})"
    return str(variant)


def plot_error_vs_offset(ds: xr.Dataset, var: str = "mech_dq_err"):
    """One panel per sharpness: median (over seeds) error vs |mu| for every variant, at the largest N
    and the first d."""
    from ...plots import subplots

    sub = ds[var].isel(seq_len=-1, head_dim=0).median("seed")
    sharp = ds["sharpness"].values
    fig, axes = subplots(1, len(sharp), sharey=True, figsize=(3.6 * len(sharp) + 1.8, 3.6))
    x = ds["mu_norm"].values
    for ax, s in zip(axes[0], sharp):
        for variant in ds["variant"].values:
            color, style = VARIANT_STYLE.get(str(variant), ("grey", "-"))
            ax.plot(x, sub.sel(sharpness=s, variant=variant).values, style, color=color, marker="o", ms=3,
                    label=variant_label(ds, variant))
        pmax = float(ds["mech_max_prob"].sel(sharpness=s).isel(seq_len=-1, head_dim=0).median())
        ax.set_title(f"sharpness {s:g} (median max P {pmax:.2f})")
        offset_axis(ax)
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[0][0].set_ylabel(ds[var].attrs.get("long_name", var).replace("median row relative L2 error", "median row rel. err."))
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"N = {int(ds['seq_len'][-1])}, d = {int(ds['head_dim'][0])}: k + mu rounded to bf16 "
                 "(the exact dQ changes at large |mu|: section 1b)", fontsize="medium")
    return fig


def plot_error_vs_size(ds: xr.Dataset, var: str = "mech_dq_err", variant: str = "bf16_fused"):
    """Error vs |mu| of one variant for every (N, d), at the first sharpness."""
    from ...plots import subplots

    fig, axes = subplots(1, 1, figsize=(5.6, 3.8))
    ax = axes[0][0]
    x = ds["mu_norm"].values
    sub = ds[var].sel(variant=variant).isel(sharpness=0).median("seed")
    for n in ds["seq_len"].values:
        for j, d in enumerate(ds["head_dim"].values):
            ax.plot(x, sub.sel(seq_len=n, head_dim=d).values, ["-", "--", ":", "-."][j % 4], marker="o", ms=3,
                    label=f"N = {n}, d = {d}")
    offset_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel("median row rel. err. of dQ")
    ax.set_title(f"{variant}, sharpness {float(ds['sharpness'][0]):g}")
    ax.legend(fontsize="x-small")
    return fig


def plot_row_sums(ds: xr.Dataset):
    """Row sums of dS as fed to the dQ matmul, and the alignment of the dQ error with mu."""
    from ...plots import subplots

    fig, axes = subplots(1, 2, figsize=(10.5, 3.8))
    x = ds["mu_norm"].values
    for variant in ds["variant"].values:
        color, style = VARIANT_STYLE.get(str(variant), ("grey", "-"))
        for ax, var in zip(axes[0], ("mech_ds_row_sum", "mech_dq_err_cos_mu")):
            vals = ds[var].sel(variant=variant).isel(sharpness=0, seq_len=-1, head_dim=0).median("seed").values
            if np.isfinite(vals).any():
                ax.plot(x, vals, style, color=color, marker="o", ms=3, label=variant_label(ds, variant))
    for ax in axes[0]:
        offset_axis(ax)
    axes[0][0].set_yscale("log")
    axes[0][0].set_ylabel("median |sum_j dS_ij| / sum_j |dS_ij|")
    axes[0][0].set_title("row sums of dS as the dQ matmul sees it")
    axes[0][1].set_ylabel("median |cos(dQ error, mu)|")
    axes[0][1].set_ylim(0, 1.05)
    axes[0][1].set_title("direction of the dQ error")
    axes[0][1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_training(ds: xr.Dataset, trained: str = "bf16", baseline: str = "fp32"):
    """Top: loss, global gradient norm, and their ratio, for both runs. Bottom, per layer of the
    trained run: key-mean norm and max logit, attention entropy, and the FP32 recompute
    diagnostic run during training (periodic and at gradient-norm spikes, dotted)."""
    from ...plots import subplots

    fig, axes = subplots(2, 3, figsize=(15, 7.2))
    steps = ds["step"].values
    for run in (trained, baseline):
        label = f"{run}: {str(ds['run_attention'].sel(run=run).values)}"
        axes[0][0].plot(steps, ds["train_loss"].sel(run=run).values, lw=1, label=label)
        axes[0][1].plot(steps, ds["train_grad_norm_total"].sel(run=run).values, lw=1, label=label)
    ratio = ds["train_grad_norm_total"].sel(run=trained) / ds["train_grad_norm_total"].sel(run=baseline)
    axes[0][2].plot(steps, ratio.values, lw=1, color="k")
    axes[0][2].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[0][0].set_ylabel("training loss (nat)")
    axes[0][0].legend(fontsize="x-small")
    axes[0][1].set_yscale("log")
    axes[0][1].set_ylabel("global gradient norm")
    axes[0][2].set_ylabel(f"gradient norm {trained} / {baseline}")
    for layer in ds["layer"].values:
        sel = dict(run=trained, layer=layer)
        line, = axes[1][0].plot(steps, ds["train_key_mean_norm"].sel(**sel).values, lw=1,
                                label=f"layer {layer}: ||mean k||")
        color = line.get_color()
        axes[1][0].plot(steps, ds["train_max_logit"].sel(**sel).values, lw=1, ls="--", color=color,
                        label=f"layer {layer}: max logit")
        axes[1][1].plot(steps, ds["train_entropy"].sel(**sel).values, lw=1, color=color, label=f"layer {layer}")
        live = ds.sel(layer=layer)
        axes[1][2].plot(live["diag_step"].values, live["live_dq_rel_err"].values, lw=1, color=color,
                        label=f"layer {layer}: dQ global rel. L2 err.")
        axes[1][2].plot(live["diag_step"].values, np.abs(live["live_grad_norm_ratio"].values - 1), lw=1, ls="--",
                        color=color, label=f"layer {layer}: |block grad-norm ratio - 1|")
    spikes = ds["diag_step"].values[ds["live_spike"].values == 1]
    for step in spikes:
        axes[1][2].axvline(step, color="k", lw=0.6, ls=":")
        axes[0][1].axvline(step, color="k", lw=0.6, ls=":")
    axes[1][0].set_yscale("log")
    axes[1][0].legend(fontsize="x-small")
    axes[1][1].set_ylabel("attention entropy (nat)")
    axes[1][1].legend(fontsize="x-small")
    axes[1][2].set_yscale("log")
    axes[1][2].set_title(f"FP32 backward recompute during {trained} (dotted: gradient spikes)", fontsize="small")
    axes[1][2].legend(fontsize="x-small")
    for ax in (*axes[0], *axes[1]):
        ax.set_xlabel("step")
    return fig


def plot_checkpoint_offsets(ds: xr.Dataset, var: str = "diag_dq_rel_err"):
    """Per layer: the diagnostic's error vs the common key offset, one line per checkpoint."""
    import matplotlib as mpl

    from ...plots import subplots

    layers = ds["layer"].values
    fig, axes = subplots(1, len(layers), sharey=True, figsize=(4.4 * len(layers) + 1.5, 3.6))
    steps = ds["checkpoint"].values
    cmap = mpl.colormaps["viridis"]
    x = ds["offset_norm"].values
    for ax, layer in zip(axes[0], layers):
        for i, step in enumerate(steps):
            ax.plot(x, ds[var].sel(layer=layer, checkpoint=step).values, marker="o", ms=3,
                    color=cmap(i / max(1, len(steps) - 1)), label=f"step {step}")
        ax.axhline(float(ds["diag_threshold"].max()), color="grey", lw=0.8, ls=":")
        offset_axis(ax, "common key offset |mu| per head")
        ax.set_yscale("log")
        ax.set_title(f"layer {layer}")
    axes[0][0].set_ylabel(f"{metric_label(var)} vs FP32 recompute")
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_tied_maxima(ds: xr.Dataset):
    """dQ error and output-error coherence per regime and variant (tiled)."""
    import seaborn as sns

    from ...plots import subplots

    fig, axes = subplots(1, 2, figsize=(12, 3.8))
    df = ds[["qy_dq_err", "qy_out_err_coherence"]].median("seed").to_dataframe().reset_index()
    for ax, var, label in zip(axes[0], ("qy_dq_err", "qy_out_err_coherence"),
                              ("median row rel. err. of dQ", "output-error coherence across rows")):
        sns.barplot(data=df[df["tiling"] == "tiled"], x="regime", y=var, hue="variant", ax=ax,
                    palette={v: VARIANT_STYLE.get(v, ("grey",))[0] for v in df["variant"].unique()})
        ax.set_ylabel(label)
        ax.set_xlabel("")
        ax.tick_params(axis="x", labelsize="x-small")
        ax.legend(fontsize="xx-small")
    axes[0][0].set_yscale("log")
    return fig


REAL_STYLE = {"sdpa:flash": "#d35400", "sdpa:math": "#17202a", "sdpa:efficient": "#b7950b", "sdpa:cudnn": "#76448a",
              "triton:fa2": "#1f618d", "triton:fa2:gproj_dq": "#48c9b0"}


def _real_color(name: str, i: int) -> str:
    import matplotlib as mpl

    return REAL_STYLE.get(name, mpl.colormaps["tab10"](i % 10))


def _ran(da: xr.DataArray) -> bool:
    return bool(np.isfinite(da.values).any())


def plot_real_vs_emulator(ds: xr.Dataset):
    """Rows: median row error of dQ, dK, dV; one column per sharpness: every real kernel that ran
    (solid) beside the emulator variants on the same operands (dashed), vs |mu|, at the largest N and
    the first d of the real-kernel grid, median over seeds."""
    from ...plots import subplots

    sharp = ds["sharpness"].values
    at = dict(real_seq_len=int(ds["real_seq_len"][-1]), real_head_dim=int(ds["real_head_dim"][0]))
    fig, axes = subplots(3, len(sharp), sharex=True, sharey="row", figsize=(3.6 * len(sharp) + 2.2, 8.4))
    x = ds["mu_norm"].values
    for row, grad in enumerate(("dq", "dk", "dv")):
        real = ds[f"real_mech_{grad}_err"].sel(**at).median("seed")
        emu = ds[f"real_mech_emulator_{grad}_err"].sel(**at).median("seed")
        for ax, s in zip(axes[row], sharp):
            for variant in ds["real_variant"].values:
                color, _ = VARIANT_STYLE.get(str(variant), ("grey", "-"))
                ax.plot(x, emu.sel(real_variant=variant, sharpness=s).values, "--", color=color, marker="s", ms=3,
                        label=f"emulator {variant_label(ds, variant, 'real_variant')}")
            for i, kernel in enumerate(ds["real_kernel"].values):
                vals = real.sel(real_kernel=kernel, sharpness=s)
                if _ran(vals):
                    ax.plot(x, vals.values, "-", color=_real_color(str(kernel), i), marker="o", ms=3, lw=1.4,
                            label=str(kernel))
            offset_axis(ax)
            ax.set_yscale("log")
            if row == 0:
                ax.set_title(f"sharpness {s:g}")
        axes[row][0].set_ylabel(f"median row rel. err. of d{grad[1].upper()}")
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    missing = [str(k) for k in ds["real_kernel"].values if not _ran(ds["real_mech_dq_err"].sel(real_kernel=k))]
    note = f"; no gradients here: {', '.join(missing)}" if missing else ""
    fig.suptitle(f"real kernels (solid) and the emulator (dashed) on the same bf16 operands, N = {at['real_seq_len']}, "
                 f"d = {at['real_head_dim']}{note}", fontsize="small")
    return fig


def plot_real_correlation(ds: xr.Dataset, variant: str | None = None):
    """Correlation over all elements of each real kernel's dQ error with the emulator variant's
    (default: the first of ``real_variant``) vs |mu|, one line per sharpness, at the largest N and
    first d; right: |cos(dQ error, mu)| of every real kernel."""
    import matplotlib as mpl

    from ...plots import subplots

    variant = str(ds["real_variant"].values[0]) if variant is None else variant
    at = dict(real_seq_len=int(ds["real_seq_len"][-1]), real_head_dim=int(ds["real_head_dim"][0]))
    ran = [str(k) for k in ds["real_kernel"].values if _ran(ds["real_mech_dq_err"].sel(real_kernel=k))]
    fig, axes = subplots(1, 2, figsize=(11.5, 3.8))
    x = ds["mu_norm"].values
    cmap = mpl.colormaps["viridis"]
    sharp = ds["sharpness"].values
    corr = ds["real_mech_dq_err_corr"].sel(real_variant=variant, **at).median("seed")
    cos = ds["real_mech_dq_err_cos_mu"].sel(**at).median("seed")
    styles = ["-", "--", ":", "-."]
    for i, kernel in enumerate(ran):
        for j, s in enumerate(sharp):
            color = cmap(j / max(1, len(sharp) - 1))
            label = f"{kernel}, sharpness {s:g}"
            axes[0][0].plot(x, corr.sel(real_kernel=kernel, sharpness=s).values, styles[i % 4], color=color,
                            marker="o", ms=3, label=label)
            axes[0][1].plot(x, cos.sel(real_kernel=kernel, sharpness=s).values, styles[i % 4], color=color,
                            marker="o", ms=3, label=label)
    for ax in axes[0]:
        offset_axis(ax)
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
    axes[0][0].set_ylim(-0.2, 1.05)
    axes[0][0].set_ylabel(f"corr(real dQ error, emulator {variant} dQ error)")
    axes[0][1].set_ylim(-0.05, 1.05)
    axes[0][1].set_ylabel("median |cos(real dQ error, mu)|")
    axes[0][1].legend(fontsize="xx-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"N = {at['real_seq_len']}, d = {at['real_head_dim']}", fontsize="small")
    return fig


def plot_real_diagnostics(ds: xr.Dataset, var: str = "dq_rel_err"):
    """Per layer: the FP32 recompute diagnostic's error vs the common key offset on the last
    checkpoint, with each real kernel as the model's attention, beside the trained (emulated) kernel."""
    from ...plots import subplots

    layers = ds["layer"].values
    step = int(ds["real_diag_checkpoint"])
    fig, axes = subplots(1, len(layers), sharey=True, figsize=(4.4 * len(layers) + 1.8, 3.6))
    x = ds["offset_norm"].values
    for ax, layer in zip(axes[0], layers):
        for i, kernel in enumerate(ds["real_kernel"].values):
            vals = ds[f"real_diag_{var}"].sel(real_kernel=kernel, layer=layer)
            if _ran(vals):
                ax.plot(x, vals.values, "-", color=_real_color(str(kernel), i), marker="o", ms=3,
                        label=f"{kernel} (fed bf16)")
        if f"diag_{var}" in ds and step in ds["checkpoint"].values:  # drawn last: it may lie on a real kernel's line
            trained = str(ds["run_attention"].sel(run="bf16").values) if "run_attention" in ds else ""
            ax.plot(x, ds[f"diag_{var}"].sel(layer=layer, checkpoint=step).values, "--", color="#c0392b", marker="s",
                    ms=6, mfc="none", label=f"trained kernel {trained}".strip())
        ax.axhline(float(ds["diag_threshold"].max()) if "diag_threshold" in ds else 0.1, color="grey", lw=0.8, ls=":")
        offset_axis(ax, "common key offset |mu| per head")
        ax.set_yscale("log")
        ax.set_title(f"layer {layer}, step {step}")
    axes[0][0].set_ylabel(f"{metric_label(var)} vs FP32 recompute")
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_exact_problem(ds: xr.Dataset):
    """Left: how far the exact (fp64) dQ of the rounded operands moves from its |mu| = 0 value, for the
    rounded-offset operands (solid) and the axis-offset operands (dashed), per sharpness; middle: distinct
    values per key component; right: the BF16 kernel's median row dQ error on both operand sets.
    Largest N, first d, median over seeds."""
    from ...plots import subplots

    at = dict(seq_len=int(ds["seq_len"][-1]), head_dim=int(ds["head_dim"][0]))
    fig, axes = subplots(1, 3, figsize=(14.5, 3.8))
    x = ds["mu_norm"].values
    variant = "bf16_fused" if "bf16_fused" in ds["variant"].values else str(ds["variant"].values[-1])
    for i, s in enumerate(ds["sharpness"].values):
        color = f"C{i}"
        for prefix, style, what in (("mech", "-", "k + mu rounded"), ("xo", "--", "axis offset")):
            if f"{prefix}_exact_dq_shift" not in ds:
                continue
            shift = ds[f"{prefix}_exact_dq_shift"].sel(sharpness=s, **at).median("seed").values
            axes[0][0].plot(x[1:], np.maximum(shift[1:], 1e-17), style, color=color, marker="o", ms=3,
                            label=f"sharpness {s:g}, {what}")
            axes[0][2].plot(x, ds[f"{prefix}_dq_err"].sel(variant=variant, sharpness=s, **at).median("seed").values,
                            style, color=color, marker="o", ms=3, label=f"sharpness {s:g}, {what}")
    axes[0][1].plot(x, ds["mech_distinct_key_values"].isel(sharpness=0).sel(**at).median("seed").values, "-o",
                    ms=3, label="k + mu rounded")
    if "xo_distinct_key_values" in ds:
        axes[0][1].plot(x, ds["xo_distinct_key_values"].isel(sharpness=0).sel(**at).median("seed").values, "--o",
                        ms=3, label="axis offset")
    axes[0][0].set_ylabel("median row ||dQ(|mu|) - dQ(0)|| / ||dQ(0)||, fp64")
    axes[0][0].set_title("how far the exact problem moved")
    axes[0][1].set_ylabel(f"distinct values per key component (of N = {at['seq_len']})")
    axes[0][1].set_title("what rounding leaves of the keys")
    axes[0][2].set_ylabel("median row rel. err. of dQ")
    axes[0][2].set_title(f"{variant} on both operand sets")
    for ax in axes[0]:
        offset_axis(ax)
        ax.set_yscale("log")
        ax.legend(fontsize="x-small")
    return fig


GPU_PANELS = (("loss", "loss (nats/byte): training, validation dashed"), ("grad_norm", "gradient norm of the block"),
              ("key_mean_norm", "common key offset |mean key|"), ("max_prob", "sharpness: mean row max of P"),
              ("dq_rel_err", "dq_rel_err: rel. L2 err. of dQ vs FP32 recompute"),
              ("tokens_per_s", "throughput (tokens/s)"))


def no_records_figure(what: str):
    """An empty panel that says ``what`` is absent (a run without the GPU training records)."""
    from ...plots import subplots

    fig, axes = subplots(1, 1, figsize=(6, 1.5))
    ax = axes[0][0]
    ax.axis("off")
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center")
    return fig


def plot_gpu_training(ds: xr.Dataset | None):
    """The gathered GPU training records (gpu_training tier): per run, over training, the mean over
    layers (line) and the range over layers (band) of each per-layer series; loss and throughput
    per run (validation loss dashed). ``no_records_figure`` without records."""
    from ...plots import subplots

    if ds is None or "dq_rel_err" not in ds:
        return no_records_figure("GPU training records")

    fig, axes = subplots(2, 3, figsize=(14, 7.5))
    runs = [str(r) for r in ds["run"].values]
    colors = {r: f"C{i % 10}" for i, r in enumerate(runs)}
    for ax, (var, label) in zip(axes.flat, GPU_PANELS):
        for run in runs:
            sub = ds[var].sel(run=run)
            if "member" in sub.dims:
                sub = sub.sel(member="a")
            steps = ds["step"].values
            ok = np.isfinite(sub.values if sub.ndim == 1 else sub.mean("layer").values)
            ok &= steps > 0
            if not ok.any():
                continue
            if "layer" in sub.dims:
                ax.plot(steps[ok], sub.mean("layer").values[ok], color=colors[run], label=run)
                ax.fill_between(steps[ok], sub.min("layer").values[ok], sub.max("layer").values[ok],
                                color=colors[run], alpha=0.15, lw=0)
            else:
                ax.plot(steps[ok], sub.values[ok], color=colors[run], label=run)
            if var == "loss":
                val = ds["val_loss"].sel(run=run, member="a")
                good = np.isfinite(val.values)
                ax.plot(steps[good], val.values[good], "--", color=colors[run], lw=1)
        ax.set_xlabel("optimiser step")
        ax.set_ylabel(label)
        if var in ("grad_norm", "key_mean_norm", "dq_rel_err"):
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("GPU training records (member a of each run): layer mean, band = range over layers")
    return fig


def plot_gpu_dq_by_layer(ds: xr.Dataset | None, var: str = "dq_rel_err", offset: str | None = "key_mean_norm",
                         per_row: int = 4):
    """``var`` per layer over training, one column per run (member a), layers coloured from first to last;
    with ``offset``, a second row gives that variable (the common key offset) per layer, so that a layer
    whose dQ error grows can be read against its keys. At most ``per_row`` runs side by side: more runs
    wrap into further blocks of rows, every panel of one variable on the same y axis. A run whose ``var``
    is 0 at every step (FP32 attention, which the diagnostic recomputes exactly) gets a note instead of an
    empty log axis."""
    import matplotlib.pyplot as plt

    from ...plots import subplots

    if ds is None or var not in ds:
        return no_records_figure("GPU training records")
    runs = [str(r) for r in ds["run"].values]
    shown = [v for v in (var, offset) if v is not None and v in ds]
    cols = max(1, min(per_row, len(runs)))
    blocks = -(-len(runs) // cols)
    fig, axes = subplots(blocks * len(shown), cols, figsize=(3.6 * cols + 0.6, 2.8 * len(shown) * blocks))
    layers = ds["layer"].values
    cmap = plt.get_cmap("viridis")
    steps = ds["step"].values
    for k in range(len(runs), blocks * cols):  # the last block's empty panels
        for row in range(len(shown)):
            axes[(blocks - 1) * len(shown) + row, k % cols].set_visible(False)
    for row, name in enumerate(shown):
        panels = [axes[(k // cols) * len(shown) + row, k % cols] for k in range(len(runs))]
        for ax, run in zip(panels, runs):
            if ax is not panels[0]:
                ax.sharey(panels[0])
            sub = ds[name].sel(run=run, member="a")
            drawn = False
            for i, layer in enumerate(layers):
                vals = sub.sel(layer=layer).values
                ok = np.isfinite(vals) & (steps > 0) & (vals > 0)
                if ok.any():
                    ax.plot(steps[ok], vals[ok], color=cmap(i / max(1, len(layers) - 1)), lw=1, label=f"layer {layer}")
                    drawn = True
            if drawn:
                ax.set_yscale("log")
            else:
                values = sub.values[np.isfinite(sub.values)]
                zero = values.size > 0 and bool(np.all(values == 0))
                ax.text(0.5, 0.5, f"{name} is 0 at every logged step" if zero else f"no {name} logged",
                        ha="center", va="center", transform=ax.transAxes, fontsize=8, wrap=True)
                ax.set_xticks([])
            if row == 0:
                ax.set_title(run, fontsize=8)
            if row == len(shown) - 1:
                ax.set_xlabel("optimiser step")
            if panels.index(ax) % cols == 0:
                ax.set_ylabel(name)
    axes[0, 0].legend(fontsize=6, ncol=2)
    return fig


DX_PANELS = (("dx_endpoint", "final validation loss (nat/byte)", False),
             ("dx_max_dq_rel_err", "largest dQ error vs FP32 recompute", True),
             ("dx_max_logit", "largest attention logit", True))


def plot_designed(ds: xr.Dataset | None):
    """The designed sweep (section 11): per arm against the learning rate, every run (dots; seeds side by
    side) and the median (line) of the endpoint, the largest dQ error (the regime level dotted) and the
    largest logit; the range's rates (outside the design) as open markers. ``no_records_figure`` without it."""
    from ...plots import subplots

    if ds is None or "dx_endpoint" not in ds:
        return no_records_figure("designed sweep")
    import json

    level = float(json.loads(ds.attrs["dx_analysis"]).get("regime_dq_err", 0.1))
    fig, axes = subplots(1, 3, figsize=(15, 4.3))
    arms = [str(a) for a in ds["dx_arm"].values]
    lrs = ds["dx_lr"].values.astype(float)
    n = len(arms)
    for ax, (var, label, log) in zip(axes.flat, DX_PANELS):
        for i, arm in enumerate(arms):
            color = f"C{i % 10}"
            sub = ds[var].sel(dx_arm=arm).where(ds["dx_ran"].sel(dx_arm=arm) == 1)
            design = ds["dx_in_design"].sel(dx_arm=arm).values == 1
            shift = 1.0 + 0.04 * (i - (n - 1) / 2)  # arms side by side on the log axis
            for j, lr in enumerate(lrs):
                y = sub.values[j]
                ok = np.isfinite(y) | np.isinf(y)
                y = np.where(np.isinf(y), np.nan, y)
                filled = design[j]
                ax.scatter(np.full(ok.sum(), lr * shift), y[ok], s=14, color=color,
                           facecolors=np.where(filled[ok], color, "none"), lw=0.8, alpha=0.8)
            med = sub.median("dx_seed")
            good = np.isfinite(med.values)
            ax.plot(lrs[good] * shift, med.values[good], "-", color=color, label=f"{arm} ({ds['dx_kernel'].sel(dx_arm=arm).item()}"
                    f"{', qk-LN' if bool(ds['dx_qk_norm'].sel(dx_arm=arm)) else ''})")
        ax.set_xscale("log")
        if log:
            ax.set_yscale("log")
        if var == "dx_max_dq_rel_err":
            ax.axhline(level, ls=":", color="0.4", lw=1)
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel(label)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("designed sweep: every run (dots; open: the range outside the design) and the median per arm (line)")
    return fig


def plot_designed_series(ds: xr.Dataset | None, lr: float | None = None, seed: int | None = None):
    """One seed at one learning rate (default: the design's second-highest rate and the first seed with every
    arm there): training loss, the largest dQ error and the largest key-mean ratio over layers, per arm."""
    from ...plots import subplots

    if ds is None or "dx_loss" not in ds:
        return no_records_figure("designed sweep")
    import json

    design = json.loads(ds.attrs["dx_design_lrs"])
    lr = design[-2] if lr is None and len(design) > 1 else (design[-1] if lr is None else lr)
    ran = ds["dx_ran"].sel(dx_lr=lr)
    if seed is None:
        full = [int(s) for s in ds["dx_seed"].values if float(ran.sel(dx_seed=s).sum()) == float(ran.sum("dx_seed").clip(max=1).sum())]
        seed = full[0] if full else int(ds["dx_seed"].values[0])
    fig, axes = subplots(1, 3, figsize=(15, 4))
    steps = ds["dx_step"].values
    for i, arm in enumerate(ds["dx_arm"].values):
        if float(ran.sel(dx_arm=arm, dx_seed=seed)) != 1:
            continue
        for ax, var, label, log in ((axes.flat[0], "dx_loss", "training loss (nat/byte)", False),
                                    (axes.flat[1], "dx_dq_rel_err_t", "largest dQ error over layers", True),
                                    (axes.flat[2], "dx_max_logit_t", "largest attention logit over layers", True)):
            y = ds[var].sel(dx_arm=arm, dx_lr=lr, dx_seed=seed).values
            ok = np.isfinite(y) & (steps > 0)
            ax.plot(steps[ok], y[ok], color=f"C{i % 10}", label=str(arm))
            ax.set_xlabel("optimiser step")
            ax.set_ylabel(label)
            if log:
                ax.set_yscale("log")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"designed sweep at learning rate {lr:g}, seed {seed}: every arm from the same weights on the same batches")
    return fig
