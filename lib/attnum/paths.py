"""Where the project lives: its root, its notebooks, parameters and outputs."""
from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    """``$ATTNUM_ROOT``, else the checkout holding this package (``lib/attnum`` -> root)."""
    env = os.environ.get("ATTNUM_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parents[2]
    if (here / "pyproject.toml").exists() and (here / "notebooks").is_dir():
        return here
    raise RuntimeError("cannot locate the project root: install attnum in editable mode "
                       "(make setup) or set ATTNUM_ROOT")


def outputs_root() -> Path:
    """``$ATTNUM_OUTPUTS``, else ``<root>/outputs``."""
    env = os.environ.get("ATTNUM_OUTPUTS")
    return Path(env).resolve() if env else project_root() / "outputs"


def notebooks_dir() -> Path:
    return project_root() / "notebooks"


def params_dir() -> Path:
    return project_root() / "params"
