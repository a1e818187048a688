"""Compatibility re-exports of ``attnum.runs`` for the notebooks' ``runner.start`` and older callers.

TEMPORARY: kept only until the notebooks and the remaining tests import ``attnum.runs`` (the integrator
rewrites them); then delete this module. Nothing in ``lib`` imports it.
"""
from attnum.runs import ParameterError  # noqa: F401
from attnum.runs import RunError  # noqa: F401
from attnum.runs import RunLocked  # noqa: F401
from attnum.runs import load_param_set  # noqa: F401
from attnum.runs import run  # noqa: F401
from attnum.runs import start  # noqa: F401
from attnum.runs import studies  # noqa: F401
from attnum.runs import sweep  # noqa: F401
from attnum.runs.expressions import evaluate  # noqa: F401
