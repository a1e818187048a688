"""attnum: numerical deviation of FlashAttention-style attention kernels.

Packages and modules: ``kernels`` (every attention implementation behind one interface and
registry: the emulators, reference and golden attention, PyTorch SDPA backends), ``precision``
(the precision policy), ``metrics`` and ``acceptance`` (errors and acceptance rules), ``inputs``
and ``operands`` (seeded generators), ``model``, ``tasks``, ``training``, ``drift`` and
``diagnostics`` (training and what is measured on it), ``cost`` (analytic kernel cost),
``ncio`` (the NetCDF writer and reader), ``plots``, ``runner`` (papermill runner), ``publish``
(the site), ``studies`` (the experiments behind each notebook).

Importing ``attnum`` itself imports nothing heavy (the command line starts fast); the names
below load their module on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "PRESETS": "precision", "PrecisionPolicy": "precision", "get_policy": "precision", "policy_for": "precision",
    "round_to": "precision", "unit_roundoff": "precision",
    "flash_attention": "kernels", "golden_attention": "kernels", "reference_attention": "kernels",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'attnum' has no attribute {name!r}")
