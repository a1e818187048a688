"""One seaborn theme and a few figure helpers shared by every study notebook."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns

from .metrics import growth_lines

FORMAT_COLORS = {"bf16": "#c0392b", "fp16": "#2874a6", "fp32": "#1e8449", "fp64": "#7d3c98"}


def set_theme() -> None:
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind",
                  rc={"figure.dpi": 100, "savefig.dpi": 130, "figure.figsize": (7.0, 4.2),
                      "axes.titlesize": "medium"})


def save_figure(fig, output_dir, name: str) -> Path:
    """Save ``fig`` as ``<output_dir>/<name>.png`` next to the results and return the path."""
    path = Path(output_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


def add_growth_lines(ax, n, fmt: str, anchor: float | None = None) -> None:
    """Draw sqrt(N)*u and N*u lines for ``fmt``; ``anchor`` rescales both to pass through it at n[0]."""
    lines = growth_lines(n, fmt)
    for key, style, label in (("sqrt_n_u", ":", r"$\sqrt{N}\,u$"), ("n_u", "--", r"$N\,u$")):
        y = lines[key]
        if anchor is not None:
            y = y * (anchor / y[0])
        ax.plot(n, y, style, color=FORMAT_COLORS.get(fmt, "grey"), alpha=0.6, lw=1,
                label=f"{label} ({fmt})")


def loglog_axes(ax, xlabel: str = "sequence length N", ylabel: str = "error") -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def errorbar_over_seeds(ax, x, values: np.ndarray, label: str, **kw) -> None:
    """Median over the last axis (seeds) with a min-max band."""
    values = np.asarray(values, dtype=float)
    med = np.nanmedian(values, axis=-1)
    ax.plot(x, med, marker="o", ms=3, label=label, **kw)
    ax.fill_between(x, np.nanmin(values, axis=-1), np.nanmax(values, axis=-1), alpha=0.15,
                    color=ax.lines[-1].get_color())


def subplots(nrows: int = 1, ncols: int = 1, **kw):
    kw.setdefault("figsize", (4.2 * ncols, 3.4 * nrows))
    kw.setdefault("constrained_layout", True)
    return plt.subplots(nrows, ncols, squeeze=False, **kw)


def save_and_show(fig, output_dir, name: str):
    """Save ``fig`` with ``plots.save_figure`` and return the saved PNG for display, closing the
    figure (the notebook shows the file that was written, and renders each figure once)."""
    from IPython.display import Image

    path = save_figure(fig, output_dir, name)
    plt.close(fig)
    return Image(filename=str(path))


def offset_axis(ax, label: str = "|mu| added to every key") -> None:
    """x axis of an offset sweep that starts at 0: linear below 1, logarithmic above."""
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(left=0)
    ax.set_xlabel(label)
