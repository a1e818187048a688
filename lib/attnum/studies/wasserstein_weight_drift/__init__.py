"""Study 03: Wasserstein weight drift (Golden et al., arXiv 2405.02803, Sec. V).

Train the small GPT several times from the same initialisation and data order, changing one thing per
*pair* of runs, and measure how far apart the two runs' weights are at every checkpoint
(``attnum.drift``); on the ``gpu_training`` tier, gather the same pairs trained at GPU scale from their
records instead. The modules:

    experiments   the measurements: ``drift_experiment`` (CPU training of every pair),
                  ``per_call_deviation`` (Golden et al.'s comparison at each attention call),
                  ``gpu_training_dataset`` (the GPU pair records gathered); the one module that imports
                  the trainer, the model and the record format
    aggregates    per kind / layer / model aggregates, drift ratios with t intervals over seeds,
                  correlations with attention statistics
    readings      numbers, booleans and tables of the CPU tiers for the notebook's prose
    readings_gpu  the same for the gathered GPU records
    figures       the notebook's figures

This module stays light (no torch): the study's names, its parameter rules and its memory estimate.
"""
from __future__ import annotations

STUDY = "wasserstein_weight_drift"

PAIRS = ("repeat", "flash", "flash_fp32", "flash_bf16", "flash_fp16", "init_seed", "init_perturbation",
         "bf16_training", "fp16_training")
FLASH_PAIRS = ("flash", "flash_fp32", "flash_bf16", "flash_fp16")
MATCHED = {"bf16_training": "flash_bf16", "fp16_training": "flash_fp16"}
"""Each low-precision training pair and the flash pair whose kernels run in the same format."""
LOW_PRECISION_PAIRS = ("bf16_training", "fp16_training")
DRIFT_METRICS = ("wasserstein", "max_abs", "rel_l2")
STATISTICS = ("max_logit", "entropy", "key_mean_ratio", "grad_norm_qk", "grad_norm")
CORR_METRICS = ("wasserstein_rel", "rel_l2")
GOLDEN_RATIO_RANGE = (2.0, 5.0)
"""[src] Golden et al. ("Is Flash Attention Stable?", 2024, arXiv 2405.02803): flash attention causes about this
many times less weight deviation than low-precision training (their headline)."""
GOLDEN_FLASH_OVER_BASELINE = 10.0
"""[src] Golden et al.: at BF16 flash attention deviates from the FP64 golden value about this many times more than
baseline attention in an isolated forward pass (their abstract, Fig 4)."""

GPU_PREFIX = "s03_"  # campaign runs of this study (params/lm/campaign.yaml); records lm_s03_*_s<seed>_d<seed>.nc
GPU_PATTERN = f"lm_{GPU_PREFIX}*.nc"
GPU_COMPARISONS = ("flash_vs_fp32", "noise_floor", "gpu_repeat", "bf16_training", "fp16_training")
GPU_LOW_PRECISION = ("bf16_training", "fp16_training")
GPU_METRICS = ("wasserstein", "rel_l2")
GPU_DESCRIPTIONS = {
    "flash_vs_fp32": "member a sdpa:flash (bf16), member b FP32 attention, same init and batches (bf16 autocast)",
    "noise_floor": "the same kernel, a different init seed (the noise floor)",
    "gpu_repeat": "the same everything twice: GPU training's own non-determinism",
    "bf16_training": "member a fp32 training (no autocast, FP32 attention), member b bf16 training",
    "fp16_training": "member a fp32 training, member b fp16 training (loss scaling)",
}


def rules(p: dict) -> list[str]:
    """The cross-parameter checks of the study (one message per violated rule; empty when all hold)."""
    out = []
    if p["d_model"] % p["n_head"] != 0:
        out.append(f"d_model must be a multiple of n_head (d_model={p['d_model']}, n_head={p['n_head']})")
    return out


def memory_estimate(p: dict) -> tuple[int, str] | None:
    """(bytes, note): the dominant terms of the peak memory, the attention maps kept for training
    (batch x heads x context^2 fp32, 16 per layer) and every checkpoint's fp32 weights of every run
    (12 d^2 per block and the embeddings and head, per checkpoint, side, pair and seed)."""
    attention = p["batch_size"] * p["n_head"] * p["context"] ** 2 * 4 * p["n_layer"] * 16
    weights = (len(p["seeds"]) * len(p["pairs"]) * 2 * (p["steps"] // p["checkpoint_every"] + 2)
               * (12 * p["n_layer"] * p["d_model"] ** 2 + 2 * (p["n_symbols"] + 4) * p["d_model"]) * 4)
    return int(attention + weights), "attention maps kept for training, and every checkpoint's weights of every run (fp32)"


def __getattr__(name):
    # VARIABLES names the trainer's record variables too, so it is built (with torch) on first use only
    if name == "VARIABLES":
        from .experiments import VARIABLES

        return VARIABLES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
