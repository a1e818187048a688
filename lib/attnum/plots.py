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
    """Save ``fig`` as ``<output_dir>/<name>.png`` next to the results and return the path.

    In a notebook, a figure left open is shown at the end of the cell; it is then shown as the
    file just saved (``_show_saved``) instead of being drawn a second time.
    """
    path = Path(output_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    _show_saved(fig, path)
    return path


_SAVED = "_attnum_saved_png"  # attribute of a figure: (PNG bytes as saved, the dpi they were saved at)


def _png_size(data: bytes) -> tuple[int, int] | None:
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _saved_png_printer(original):
    """The notebook's PNG printer of figures: a figure unchanged since ``save_figure`` is shown as the
    saved file (at the size the inline backend would draw it), any other figure as ``original`` draws it."""
    from binascii import b2a_base64

    def printer(fig):
        saved = getattr(fig, _SAVED, None)
        if saved is None or fig.stale:  # never saved, or changed since: draw it as before
            return original(fig)
        data, dpi = saved
        size = _png_size(data)
        if size is None or not dpi:
            return original(fig)
        scale = float(fig.dpi) / float(dpi)
        # the width alone: a page that caps the width (the site's theme) then scales the height with it,
        # where a fixed height attribute would squash the figure
        return (b2a_base64(data, newline=False).decode("ascii"), {"width": max(1, round(size[0] * scale))})

    printer._attnum_saved_png_printer = True
    return printer


def _show_saved(fig, path: Path) -> None:
    """In an IPython kernel with figures shown as PNG: remember the saved file on ``fig`` and make the
    PNG printer show it, so the inline backend does not draw the figure again at the end of the cell.
    A change to the figure after saving marks it stale, and it is drawn as before."""
    import sys

    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython
    from matplotlib.figure import Figure

    shell = get_ipython()
    formatters = getattr(getattr(shell, "display_formatter", None), "formatters", None) or {}
    png = formatters.get("image/png")
    if png is None:
        return
    try:
        original = png.lookup_by_type(Figure)
    except KeyError:
        return  # figures are not shown as PNG here
    if getattr(getattr(original, "func", None), "__name__", "") == "retina_figure":
        return  # figures shown at twice their resolution: draw them as configured
    if not getattr(original, "_attnum_saved_png_printer", False):
        png.for_type(Figure, _saved_png_printer(original))
    dpi = plt.rcParams["savefig.dpi"]
    setattr(fig, _SAVED, (path.read_bytes(), fig.dpi if dpi == "figure" else dpi))
    fig.stale = False  # saving drew it; any later change to an artist sets this again


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
