"""Running the studies: checked parameters, notebooks executed by papermill, atomic run folders, batches.

``params``     parameter sets, the schema, every check before anything runs (``resolve_parameters``)
``plan``       run names, grids, plans of batches (``PlannedRun``)
``store``      versioned run folders, the atomic swap, locks, records, ``clean``, ``live_runs``
``execute``    the papermill engine, ``run``, and the notebooks' set-up ``start``
``batch``      batches on ``dask.distributed`` (``run_batch``, ``sweep``); imported on first use

``attnum.runs`` never imports the publisher (``attnum.site``) or a study's experiments; it imports a
study's light package ``attnum.studies.<study>`` only for its ``rules`` and ``memory_estimate``.
"""
from __future__ import annotations

from .execute import Terminated, injected_parameter_names, kernel_pythonpath, run, start
from .params import (COMMON_PARAMETERS, RUNNER_SET, TYPES, ParameterError, check_machine, check_parameters,
                     declared_parameters, kernel_availability, load_param_set, machine_memory, memory_estimate,
                     normalize_param_set, notebook_defaults, notebook_path, param_sets, parameter_names, parse_value,
                     requested_kernels, resolve_parameters, resolve_study, schema, studies)
from .plan import (SWEEP_MARK, PlannedRun, grid_points, parse_grid, plan_run_all, plan_sweep, run_name,
                   sweep_point_name)
from .store import RunError, RunLocked, clean, flock_held, live_runs

__all__ = ["COMMON_PARAMETERS", "RUNNER_SET", "SWEEP_MARK", "TYPES", "ParameterError", "PlannedRun", "RunError",
           "RunLocked", "Terminated", "check_machine", "check_parameters", "clean", "declared_parameters",
           "flock_held", "grid_points", "injected_parameter_names", "kernel_availability", "kernel_pythonpath",
           "live_runs", "load_param_set", "machine_memory", "memory_estimate", "normalize_param_set",
           "notebook_defaults", "notebook_path", "param_sets", "parameter_names", "parse_grid", "parse_value",
           "plan_run_all", "plan_sweep", "requested_kernels", "resolve_parameters", "resolve_study", "run", "run_name",
           "schema", "start", "studies", "sweep", "sweep_point_name"]


def sweep(*args, **kwargs):
    """``attnum.runs.batch.sweep``: every grid point as one batch (imports Dask on first use)."""
    from .batch import sweep as _sweep

    return _sweep(*args, **kwargs)
