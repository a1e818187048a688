"""attnum: numerical deviation of FlashAttention-style attention kernels.

Packages and modules: ``kernels`` (every attention implementation behind one interface and
registry: the emulators, reference and golden attention, PyTorch SDPA backends), ``precision``
(the precision policy), ``metrics`` and ``acceptance`` (errors and acceptance rules), ``inputs``
and ``operands`` (seeded generators), ``model`` (one GPT for every scale), ``train`` (one trainer:
loop, data, the FP32-recompute diagnostic, records), ``drift``, ``cost`` (analytic kernel cost),
``ncio`` (the NetCDF writer and reader), ``glue`` (values for the notebooks' prose), ``plots``,
``runs`` (parameters, plans, the run store, papermill execution, Dask batches), ``site`` (the
publisher), ``cli`` (the one command line), ``studies`` (one package per notebook).

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
