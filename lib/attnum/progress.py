"""Progress bars where people look: the runner's terminal during a run, a widget in JupyterLab.

The studies and the trainer write ``from attnum.progress import tqdm`` and use it as ``tqdm``
(iterable, ``total=``/``update()``, ``desc=``, ``disable=``, ``leave=``). What it does depends on
``$ATTNUM_PROGRESS``, read each time a bar is made:

* ``terminal``: ``runner.start`` sets it in the notebook kernel of every run of the runner
  (``python -m attnum run``, ``run-all``, ``sweep``, raw papermill with ``output_dir``). The bar
  writes nothing to the notebook: it writes plain lines (``[<study>/<run>] <bar>``, at most one per
  ``$ATTNUM_PROGRESS_INTERVAL`` seconds per bar, 10 by default, and the last state) to the kernel's
  original standard error, which is the terminal (or log) of the process that started the kernel.
  A bar that ends within the interval prints nothing (tqdm's ``delay``), so a sweep of short cells
  does not print a 0% and a 100% line per bar; a state is never printed twice in a row.
  The executed notebook, and so the published page, holds no progress output.
* ``off``: no bar at all; ``runner.run(progress=False)`` (``--no-progress``) starts the kernel with it,
  whatever the environment says.
* unset or anything else: ``tqdm.auto`` (a widget in JupyterLab, ipywidgets being installed;
  plain text elsewhere).
"""
from __future__ import annotations

import os
import re
import sys

ENV = "ATTNUM_PROGRESS"
LABEL_ENV = "ATTNUM_PROGRESS_LABEL"
INTERVAL_ENV = "ATTNUM_PROGRESS_INTERVAL"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def mode() -> str:
    """``terminal``, ``off`` or ``auto`` (see the module docstring)."""
    value = os.environ.get(ENV, "").strip().lower()
    return value if value in ("terminal", "off") else "auto"


def _terminal_fd() -> int:
    """The file descriptor of the terminal this process was started on, bypassing a notebook kernel.

    ipykernel points fd 2 at a pipe whose content goes into the notebook and keeps the original
    in ``_original_stdstream_copy``; without that capture fd 2 is still the original.
    """
    err = sys.stderr
    fd = getattr(err, "_original_stdstream_copy", None)
    if isinstance(fd, int):
        return fd
    stream = sys.__stderr__ if type(err).__module__.startswith("ipykernel") else err
    return stream.fileno()


class TerminalLines:
    """A file for tqdm: each bar state becomes one plain line, prefixed, on the terminal's fd."""

    encoding = "utf-8"

    def __init__(self, label: str = "", fd: int | None = None):
        self.prefix = f"[{label}] " if label else ""
        self.fd = fd
        self.last = None

    def write(self, text: str) -> int:
        for part in re.split(r"[\r\n]", _ANSI.sub("", text)):
            part = part.strip()
            if part and part != self.last:
                self.last = part
                try:
                    os.write(self.fd if self.fd is not None else _terminal_fd(),
                             f"{self.prefix}{part}\n".encode("utf-8", "replace"))
                except (OSError, ValueError, AttributeError):
                    return len(text)  # progress only: never fail a run for it
        return len(text)

    def flush(self) -> None:
        pass


def tqdm(*args, **kwargs):
    """A progress bar as ``tqdm.tqdm`` takes it, shown where ``$ATTNUM_PROGRESS`` says."""
    current = mode()
    if current == "off":
        kwargs["disable"] = True
    if current != "terminal":
        from tqdm.auto import tqdm as auto

        return auto(*args, **kwargs)
    from tqdm.std import tqdm as plain

    try:
        interval = float(os.environ.get(INTERVAL_ENV, "10"))
    except ValueError:
        interval = 10.0
    kwargs.update(file=TerminalLines(os.environ.get(LABEL_ENV, "")), mininterval=interval,
                  maxinterval=max(interval, 10.0), delay=max(interval, 0.0), ncols=100, ascii=True,
                  dynamic_ncols=False)
    kwargs.setdefault("miniters", 1)
    return plain(*args, **kwargs)
