"""Study 05: the GProj fix of seed 004, against every other fix.

Every fix is one change of a base kernel, the emulated BF16 FlashAttention-3 of seed 004
(``fa2_bf16`` with the fused scale-max), named in ``attnum.kernels.fixes.FIXES`` and applied by
``with_fix``. Four experiments, each a function returning an xarray Dataset with CF attributes:

``fix_grid``
    study 04's mechanism grid (its operands and fp64 golden values, from
    ``attnum.operands``): q scaled by a sharpness factor, a vector mu of norm
    |mu| added to every key. In exact arithmetic the output and dQ would not depend on mu, but
    k + mu is rounded to bf16 before use, so at large |mu| the keys collapse onto few distinct
    vectors and the exact problem itself changes: the grid records how (``grid_exact_*``,
    ``grid_distinct_keys``) against the exact values at |mu| = 0. Per fix: dQ, dK, dV
    median and 99th-percentile row relative errors against fp64; the forward error; the row sums
    of dS before and after its rounding and as the dQ matmul effectively multiplies it; the dQ
    error when D is formed from the exact output instead of the stored one (what is left when the
    D path is removed); the fraction of rows whose output collapsed to zero. Per point, the
    fraction of rows where the fused scale-max forward's P at the row max is not exactly 1
    (seed 004's cause 1). With ``real_kernels``: every real kernel of the registry (our Triton
    kernel with GProj off / dq / dq_dk and its FP32 backward, PyTorch's SDPA backends, FlashAttention-4)
    on the same operands, beside its emulated equivalent (``emulator_equivalent``); a kernel that cannot run
    or refuses an input keeps its row, with the reason in ``real_status``.

``regime_comparison``
    study 04's regimes (``attnum.operands.regime_operands``): seed 004's key offset beside
    Qiu & Yao's tied maxima with negative-mean or zero-mean values.

``fix_costs``
    the analytic count of ``attnum.cost`` for a real kernel, and the emulator's measured time
    (a CPU emulation, not a kernel timing).

``real_timings``
    measured forward, backward and forward + backward times of the real kernels (CUDA events
    after warm-up, median of repeats; on a CPU wall-clock time, labelled so) beside the analytic
    arithmetic time of our Triton kernel's own structure (``attnum.cost.triton_fa2_seconds``).

``fix_training``
    the small GPT trained from the same initialisation and data order with FP32 attention, the
    BF16 flash emulator and each fix (``attnum.train.train_runs``).

Modules: ``experiments`` (the emulated measurements), ``real_kernels`` (registry kernels on the grid,
their measured times and a training step's), ``readings`` (numbers and tables of the grid, the exact
problem, the real kernels' errors and training), ``readings_costs`` (measured costs: attention calls,
training steps, the committed benchmark), ``readings_claims`` (seed 004's claims: one table with a
boolean verdict per claim, and the values the prose glues), ``figures``. This module stays light (no torch): the runner reads ``STUDY``, ``VARIABLES``, ``rules``
and ``memory_estimate`` before a run.
"""
from __future__ import annotations

STUDY = "gproj_fix"

STEP_NO_ATTENTION = "no_attention"
"""The step-timing row whose attention is skipped (its output is v): the rest of the step. Runs made before
this name wrote "none (output = v)" (``LEGACY_STEP_NO_ATTENTION``), which ``readings.current_form`` renames."""
LEGACY_STEP_NO_ATTENTION = "none (output = v)"
LEGACY_TRAIN_BASELINE = "fp32"
"""The name runs made before used for the FP32-attention training run; now it is the baseline kernel's registry
name (``run_attention``), which ``readings.current_form`` puts in its place."""
BOOLEAN_COORDINATES = ("timing_causal",)
"""Yes/no coordinates: written as booleans (a CF flag, ``ncio``); older runs hold 0/1 integers."""

GRAD_ERROR_METRICS = ("dq_err", "dk_err", "dv_err", "dq_err_p99", "dk_err_p99", "dv_err_p99", "dq_err_exact_delta",
           "out_err", "out_err_coherence", "zero_rows", "ds_exact_row_sum", "ds_rounded_row_sum", "ds_row_sum")

ATTRS = {
    "dq_err": ("1", "median row relative L2 error of dQ against fp64"),
    "dk_err": ("1", "median row relative L2 error of dK against fp64"),
    "dv_err": ("1", "median row relative L2 error of dV against fp64"),
    "dq_err_p99": ("1", "99th percentile of the row relative L2 error of dQ against fp64"),
    "dk_err_p99": ("1", "99th percentile of the row relative L2 error of dK against fp64"),
    "dv_err_p99": ("1", "99th percentile of the row relative L2 error of dV against fp64"),
    "dq_err_exact_delta": ("1", "median row relative L2 error of dQ when the backward forms D from the exact "
                                "output instead of the stored one (the D path removed)"),
    "out_err": ("1", "relative L2 error of the forward output against fp64"),
    "out_err_coherence": ("1", "mean over columns of |mean_i e_ic| / rms_i e_ic of the output error e "
                               "(1: every row errs alike; ~N^-1/2: independent)"),
    "zero_rows": ("1", "fraction of rows whose output is 0 and log-sum-exp -inf (every probability underflowed)"),
    "ds_exact_row_sum": ("1", "median over rows of |sum_j dS_ij| / sum_j |dS~_ij| before the ds rounding"),
    "ds_rounded_row_sum": ("1", "median over rows of |sum_j dS~_ij| / sum_j |dS~_ij| after the ds rounding"),
    "ds_row_sum": ("1", "median over rows of |sum_j dS_ij| / sum_j |dS~_ij|, dS as the dQ matmul effectively "
                        "multiplies it (after GProj's projection)"),
    "max_prob": ("1", "median over rows of the largest attention probability (fp64)"),
    "fix_description": ("1", "what the fix changes in the base kernel"),
    "emul_forward_seconds": ("s", "CPU emulator: fastest wall time of the forward (an emulation, not a kernel)"),
    "emul_backward_seconds": ("s", "CPU emulator: fastest wall time of the backward (an emulation, not a kernel)"),
}


GRID_ATTRS = {
    "exact_dq_norm": ("1", "median over rows of the norm of the exact (fp64) dQ of the rounded operands"),
    "exact_dq_change": ("1", "relative L2 distance of the exact dQ from the exact dQ at |mu| = 0 (same q, v, dO, "
                             "seed): how far rounding k + mu to bf16 moved the problem"),
    "exact_out_change": ("1", "relative L2 distance of the exact output from the exact output at |mu| = 0"),
    "distinct_keys": ("1", "number of distinct bf16 key vectors (k + mu rounded) / N"),
    "distinct_key_values": ("1", "mean over key components of the number of distinct bf16 values of k + mu / N"),
    "key_perturbation": ("1", "||(k + mu rounded to bf16) - mu - k|| / ||k||: what rounding did to the keys"),
    "p_max_not_one": ("1", "fraction of rows where the fused scale-max forward (fp32 FMA) gives the row's maximum "
                           "score a probability other than exactly 1 (seed 004, cause 1)"),
}
REAL_ATTRS = {
    "dq_err": ("1", "median row relative L2 error of the real kernel's dQ against fp64"),
    "dk_err": ("1", "median row relative L2 error of the real kernel's dK against fp64"),
    "dv_err": ("1", "median row relative L2 error of the real kernel's dV against fp64"),
    "dq_err_p99": ("1", "99th percentile of the row relative L2 error of the real kernel's dQ against fp64"),
    "out_err": ("1", "relative L2 error of the real kernel's forward output against fp64"),
    "emul_dq_err": ("1", "median row relative L2 error of dQ of the real kernel's emulated equivalent"),
    "emul_dk_err": ("1", "median row relative L2 error of dK of the real kernel's emulated equivalent"),
    "emul_dv_err": ("1", "median row relative L2 error of dV of the real kernel's emulated equivalent"),
    "dq_err_corr": ("1", "correlation over all elements of the real kernel's and its emulated equivalent's dQ error"),
    "dq_bitwise": ("1", "fraction of dQ elements bitwise equal to the emulated equivalent's"),
    "status": ("1", "ok, or why the real kernel gave no gradients at this (N, d) (unavailable, refused, out of memory)"),
    "equivalent": ("1", "the emulated configuration that models the real kernel (registry name; empty: none)"),
}
TIMING_ATTRS = {
    **{f"timing_{p}_ms": ("ms", f"measured {label} time of the real kernel (median of repeats after warm-up)")
       for p, label in (("fwd", "forward"), ("bwd", "backward"), ("fwd_bwd", "forward + backward"))},
    **{f"timing_analytic_{p}_ms": ("ms", f"{label} arithmetic time of our Triton kernel's structure at H200 datasheet "
                                         f"peaks (attnum.cost.triton_fa2_seconds; analytic, not measured)")
       for p, label in (("fwd", "forward"), ("bwd", "backward"), ("fwd_bwd", "forward + backward"))},
    "timing_status": ("1", "ok, not requested, or why the kernel gave no time"),
    "step_ms": ("ms", "measured time of one training step of the small GPT (forward, backward, AdamW) with this "
                      "attention in every layer, the rest under bf16 autocast (median of repeats after warm-up)"),
    "step_status": ("1", "ok, not requested, or why the step gave no time"),
}


_OWN_VARIABLES = {**ATTRS, **{f"grid_{k}": v for k, v in GRID_ATTRS.items()},
                  **{f"real_{k}": v for k, v in REAL_ATTRS.items()}, **TIMING_ATTRS,
                  "real_kernel": ("1", "real kernel (registry name)"),
                  "timing_kernel": ("1", "timed kernel (registry name)"),
                  "timing_dtype": ("1", "format of q, k, v, dO fed to the timed kernel"),
                  "timing_head_dim": ("1", "head dimension d of the timed shapes"),
                  "timing_causal": ("1", "True: causal mask, False: none"),
                  "step_kernel": ("1", "attention of every layer in the timed training step (registry name; no_attention: "
                                         "attention skipped, its output is v: the rest of the step)"),
                  "run": ("1", "training run: the baseline FP32 attention under its kernel's registry name "
                               "(baseline_attention, fed fp32), or the fix of attnum.kernels.FIXES applied to the "
                               "base BF16 kernel (none: the BF16 flash emulator as it is)"),
                  "step_dtype": ("1", "format the attention kernel is fed in the timed training step"),
                  **{f"{prefix}{name}": entry for prefix in ("grid_", "regime_") for name, entry in ATTRS.items()},
                  "sharpness": ("1", "factor multiplying q (attention sharpness)"),
                  "mu_norm": ("1", "norm of the vector mu added to every key")}


def __getattr__(name: str):
    """``VARIABLES``: CF units and long_name of every variable the study writes (applied by
    ``ncio.write_results``): the training records' (built by the trainer, which imports torch, so
    only when asked for) and the study's own."""
    if name == "VARIABLES":
        from .experiments import record_variables

        return {**record_variables(), **_OWN_VARIABLES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def rules(p: dict) -> list[str]:
    """The cross-parameter checks of a parameter set ``p`` (every parameter of the notebook): one
    message per violated rule, naming the parameters; empty when all hold."""
    broken = []
    if "none" not in p["fixes"]:
        broken.append("fixes must include 'none', the kernel every fix is compared with")
    if p["d_model"] % p["n_head"] != 0:
        broken.append("d_model must be a multiple of n_head")
    if p["step_d_model"] % p["step_n_head"] != 0:
        broken.append("step_d_model must be a multiple of step_n_head")
    if p["real_timing_tokens"] < p["real_timing_seq_len"]:
        broken.append("real_timing_tokens (heads x N of a timed shape) must be at least real_timing_seq_len")
    return broken


def memory_estimate(p: dict) -> tuple[int, str] | None:
    """(bytes, note): the dominant term of the peak memory of a run with parameters ``p``."""
    n = max(max(p["seq_lens"]), p["regime_seq_len"], p["timing_seq_len"])
    maps = p["batch_size"] * p["n_head"] * p["context"] ** 2 * 4 * p["n_layer"] * 16
    return (int(n ** 2 * 8 * 8 + maps),
            "N x N fp64 matrices of the golden gradients and the backward emulators (about eight), plus the "
            "attention maps kept for training")
