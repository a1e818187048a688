"""Every name study 04 takes from the training code (model, trainer, diagnostic, GPU records), imported
here and nowhere else in the study, so that a change of the training code is a change of this file."""
from __future__ import annotations

from ...train.diag import ATTRS as DIAG_ATTRS
from ...train.diag import recompute_backward_fp32
from ...model import GPT, GPTConfig, add_key_offset
from ...train import Task
from ...train import LiveDiagnostic, TrainConfig, load_checkpoint, record_variables, torch_threads, train_runs

__all__ = ["DIAG_ATTRS", "GPT", "GPTConfig", "LiveDiagnostic", "Task", "TrainConfig", "add_key_offset", "lm_record",
           "lm_sweep", "load_checkpoint", "record_variables", "recompute_backward_fp32", "torch_threads", "train_runs"]


def lm_record():
    """``attnum.train.record``, the GPU trainer's record format (imported on use: only the gpu_training tier
    reads records)."""
    from ...train import record

    return record


def lm_sweep():
    """``attnum.train.sweep``, the designed sweeps' plans (imported on use, as ``lm_record``)."""
    from ...train import sweep

    return sweep
