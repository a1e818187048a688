"""Figures of study length_scaling (notebook ``notebooks/*_length_scaling.ipynb``): each ``plot_*`` reads the
study's results dataset (as written to ``results.nc``) and returns a matplotlib figure."""
from __future__ import annotations

import numpy as np
import xarray as xr


def plot_stage_attribution(ds: xr.Dataset):
    """Heatmaps of log10 error per rounding variant (rows) and kernel x N (columns), one per dtype."""
    import seaborn as sns

    from ...plots import subplots

    da = ds["attribution_rel_l2_err"]
    dtypes = list(da["attribution_dtype"].values)
    fig, axes = subplots(1, len(dtypes), figsize=(5.2 * len(dtypes), 4.6))
    for ax, fmt in zip(axes[0], dtypes):
        table = np.log10(da.sel(attribution_dtype=fmt).median("attribution_seed")).to_dataframe()
        table = table["attribution_rel_l2_err"].unstack(["kernel", "attribution_seq_len"])
        table = table.loc[list(ds["variant"].values)]
        table.columns = [f"{k}\nN={n}" for k, n in table.columns]
        sns.heatmap(table, annot=True, fmt=".1f", cmap="magma_r", cbar=False, ax=ax, annot_kws={"fontsize": 7})
        ax.set_title(f"{fmt}: log10 relative L2 error")
        ax.set_ylabel("")
    return fig


CURVES = (("reference", "all", "-"), ("emulator", "all", "-"), ("reference", "fa2", "--"), ("emulator", "fa2", "--"))


def plot_error_vs_length(ds: xr.Dataset, var: str = "rel_l2_err"):
    """One panel per dtype: median error over seeds vs N (band: min-max), with growth slopes."""
    from ...plots import add_growth_lines, errorbar_over_seeds, loglog_axes, subplots

    da = ds[var]
    dtypes = list(da["dtype"].values)
    fig, axes = subplots(1, len(dtypes), sharey=False, figsize=(4.6 * len(dtypes) + 1.6, 3.8))
    n = da["seq_len"].values
    for ax, fmt in zip(axes[0], dtypes):
        for kernel, family, style in CURVES:
            vals = da.sel(kernel=kernel, policy=family, dtype=fmt).transpose("seq_len", "seed").values
            errorbar_over_seeds(ax, n, vals, f"{kernel}, {family}_*", linestyle=style)
        anchor = float(np.nanmedian(da.sel(kernel="emulator", policy="all", dtype=fmt).isel(seq_len=0)))
        add_growth_lines(ax, n, fmt, anchor=anchor)
        loglog_axes(ax, ylabel=da.attrs.get("long_name", var).split(" ||")[0] if ax is axes[0][0] else "")
        ax.set_title(fmt)
    fig.suptitle("error vs N against the fp64 golden value (growth lines drawn through the first point)",
                 fontsize="medium")
    axes[0][-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_block_effects(ds: xr.Dataset):
    """Flash-emulator error by block configuration and loop order (Golden et al. Fig 6)."""
    import seaborn as sns

    from ...plots import subplots

    df = ds["block_rel_l2_err"].to_dataframe().reset_index()
    dtypes = list(ds["block_dtype"].values)
    fig, axes = subplots(1, len(dtypes) * 2)
    i = 0
    for fmt in dtypes:
        for family in ds["policy"].values:
            sub = df[(df["block_dtype"] == fmt) & (df["policy"] == family)]
            sns.pointplot(data=sub, x="block_config", y="block_rel_l2_err", hue="loop_order", ax=axes[0][i],
                          errorbar=("pi", 100), dodge=0.3 if ds.sizes["loop_order"] > 1 else False,
                          markersize=4, linewidth=1)
            axes[0][i].set_title(f"{family}_{fmt}, N = {int(ds['block_seq_len'])}")
            axes[0][i].set_xlabel("block_q x block_k")
            axes[0][i].set_ylabel("relative L2 error" if i == 0 else "")
            axes[0][i].tick_params(axis="x", rotation=45)
            i += 1
    return fig


def plot_causal_profile(ds: xr.Dataset, dtype: str = "bf16"):
    """Per-row error along the query position under causal masking, strata boundaries marked."""
    from ...plots import subplots

    fig, axes = subplots(1, 1, figsize=(7, 3.6))
    ax = axes[0][0]
    x = ds["position_bin_center"].values
    for kernel, family, style in CURVES:
        vals = ds["row_profile_rel_l2_err"].sel(kernel=kernel, policy=family, dtype=dtype)
        ax.plot(x, vals.median("seed").values, style, marker="o", ms=2, label=f"{kernel}, {family}_{dtype}")
    n = int(ds["causal_seq_len"])
    for frac in (0.1, 0.9):
        ax.axvline(frac * n, color="grey", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("query position (causal: row i attends to keys 0..i)")
    ax.set_ylabel("mean row relative L2 error")
    ax.set_title(f"causal attention, N = {n}, {dtype}")
    ax.legend(fontsize="x-small")
    return fig


def plot_pass_rates(ds: xr.Dataset):
    """Pass rate of each acceptance rule on correct kernels, by (kernel, policy, dtype) and N."""
    import seaborn as sns

    from ...plots import subplots

    rules = list(ds["rule"].values)
    fig, axes = subplots(1, len(rules), figsize=(4.4 * len(rules), 4.2))
    for ax, rule in zip(axes[0], rules):
        table = ds["pass_rate"].sel(rule=rule).to_dataframe()["pass_rate"].unstack("seq_len")
        table.index = [f"{k}/{p}_{d}" for k, p, d in table.index]
        sns.heatmap(table, vmin=0, vmax=1, cmap="RdYlGn", annot=True, fmt=".1f", cbar=False, ax=ax,
                    annot_kws={"fontsize": 6})
        ax.set_title(rule)
        ax.set_xlabel("N")
        if ax is not axes[0][0]:
            ax.set_yticklabels([])
    return fig


def plot_real_kernels(ds: xr.Dataset):
    """Median relative L2 error of each real kernel against N, one panel per (mask, dtype); line
    style by head dim; the emulator's first fidelity configuration in grey for reference."""
    from ...plots import loglog_axes, subplots

    causal, dtypes = list(ds["real_causal"].values), list(ds["real_dtype"].values)
    fig, axes = subplots(len(causal), len(dtypes), sharex=True, sharey=True)
    styles = ("-", "--", ":", "-.")
    n = ds["real_seq_len"].values
    for r, c in enumerate(causal):
        for col, fmt in enumerate(dtypes):
            ax = axes[r][col]
            for h, d in enumerate(ds["real_head_dim"].values):
                sel = dict(real_causal=c, real_dtype=fmt, real_head_dim=d)
                emu = ds["real_emulator_rel_l2_err"].sel(sel).isel(fidelity_config=0).median("real_seed")
                ax.plot(n, emu, styles[h % 4], color="grey", lw=1, label=f"emulator {ds['fidelity_config'].values[0]}, d={d}")
                for kernel in ds["real_kernel"].values:
                    y = ds["real_rel_l2_err"].sel(sel).sel(real_kernel=kernel).median("real_seed")
                    if np.isfinite(y.values).any():
                        ax.plot(n, y, styles[h % 4], marker="o", ms=3, label=f"{kernel}, d={d}")
            loglog_axes(ax, ylabel="rel. L2 error vs fp64")
            ax.set_title(f"{fmt}, {'causal' if c else 'no mask'}")
    axes[0][-1].legend(fontsize="x-small", loc="best")
    return fig


def plot_fp32_stages(ds: xr.Dataset):
    """The fp32 reference's relative error against N with one stage in fp64 (or a reduction split),
    median over seeds: the variant whose line is flat names the step that makes the error grow."""
    from ...plots import loglog_axes, subplots

    da = ds["fp32_stage_rel_l2_err"].median("fp32_stage_seed")
    fig, axes = subplots(1, 1, figsize=(6.4, 4.0))
    ax = axes[0][0]
    n = da["fp32_stage_seq_len"].values
    for variant in da["fp32_stage_variant"].values:
        style = "-" if variant.startswith("fp64_") else "--" if variant.endswith("_split") else ":"
        ax.plot(n, da.sel(fp32_stage_variant=variant).values, style, marker="o", ms=3, label=str(variant))
    loglog_axes(ax, ylabel="rel. L2 error vs fp64")
    ax.set_title(f"fp32 reference, one stage in fp64 ({ds.attrs.get('device', '')[:40]})", fontsize="small")
    ax.legend(fontsize="x-small", ncol=2)
    return fig
