"""Study 04: late-training gradient blowup of a BF16 FlashAttention backward.

Seed 004 (the report on late-training gradient blowup in BF16 FlashAttention-3, and GProj: an unpublished
source document, described in docs/sources.md with the sources of seeds 000 and 003) reports a BF16
FlashAttention-3 run whose gradient norm grew about 1000x late in training and names two causes: the forward's fused scale-max (the backward reads an inexactly stored output) and dS
rounded to BF16 before dQ = dS K, whose rows then no longer sum to zero, so the residual multiplies the
mean key. The modules of this package:

``experiments``
    the emulator's measurements: the mechanism grid (q, k, v, dO i.i.d. N(0, 1), q scaled by a
    sharpness, a common vector mu added to every key; rounded-offset and axis-offset operands), Qiu &
    Yao's tied-maximum regime (arXiv 2510.04212), the sources' gradient checks (seeds 000 and 003) and
    the FP32 backward-recompute diagnostic at the trained model's checkpoints.
``real_kernels``
    registry kernels (PyTorch SDPA backends, our Triton FlashAttention-2, FlashAttention-4, ...) on the
    mechanism grid's operands and as the trained model's attention in the diagnostic; a forward-only
    kernel is recorded as not applicable.
``trainer``
    every name this study takes from the training code, in one place.
``gpu_training``
    the ``gpu_training`` tier: the GPU training campaign's records gathered into one Dataset.
``measure``
    one tier's measurements in one call: the experiments at the tier's sizes, or the GPU records gathered.
``readings``, ``readings_gpu``
    numbers and tables read from a run's Dataset (CPU tiers and committed ``gpu`` run; GPU records), and the
    sources' own numbers (constants marked ``[src]``), no English: the notebook's markdown states them
    through ``attnum.glue``.
``figures``
    the notebook's figures.

This module stays light (no torch): the runner reads ``STUDY``, ``rules`` and ``memory_estimate``
before anything runs; ``VARIABLES`` is loaded from ``experiments`` on first use.
"""
from __future__ import annotations

STUDY = "late_training_gradient_blowup"


def rules(p: dict) -> list[str]:
    """The cross-parameter checks of the study, one message per rule ``p`` breaks (empty: all hold)."""
    broken = []
    if max(p["checkpoint_steps"]) > p["steps"]:
        broken.append(f"checkpoint_steps must not go past the last step (max(checkpoint_steps) = "
                      f"{max(p['checkpoint_steps'])} > steps = {p['steps']})")
    if p.get("sweep_records") and not p.get("gpu_records"):
        broken.append("sweep_records is read on the gpu_training tier only: set gpu_records too (or leave "
                      "sweep_records empty)")
    if p["d_model"] % p["n_head"] != 0:
        broken.append(f"d_model must be a multiple of n_head (d_model = {p['d_model']}, n_head = {p['n_head']})")
    return broken


def memory_estimate(p: dict) -> tuple[int, str]:
    """(bytes, note) of the dominant term of the peak memory: the N x N fp64 matrices of the golden
    gradients and the backward emulators (about eight; the largest N of any grid) and the attention maps
    kept for training."""
    n = max(max(p["seq_lens"]), max(p["real_seq_lens"]), p["tie_seq_len"], p["src_seq_len"])
    attention_maps = p["batch_size"] * p["n_head"] * p["context"] ** 2 * 4 * p["n_layer"] * 16
    return (int(n ** 2 * 8 * 8 + attention_maps),
            "N x N fp64 matrices of the golden gradients and the backward emulators (about eight; the real-kernel "
            "grid's and the source checks' N included), plus the attention maps kept for training")


def __getattr__(name: str):
    if name == "VARIABLES":  # CF units and long names; needs the training code's record tables (torch)
        from .experiments import VARIABLES

        return VARIABLES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
