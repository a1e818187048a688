"""Study 01: how attention-kernel error grows with sequence length.

Every measurement compares a kernel's output with the fp64 golden value computed on the *same* rounded
inputs, so input rounding is not counted as kernel error. Kernels: ``reference`` (unblocked attention,
rounded per the policy) and ``flash`` (the tiled online-softmax emulator). Policies: the ``all_<dtype>``
family rounds every intermediate (Golden et al.'s microbenchmark), the ``fa2_<dtype>`` family is what
production kernels do.

Modules: ``experiments`` (the emulated measurements), ``real_kernels`` (registry kernels beside the
emulator), ``readings`` (numbers and tables the notebook states), ``figures``. This module stays light
(no torch): the runner reads ``STUDY``, ``VARIABLES``, ``rules`` and ``memory_estimate`` before a run.
"""
from __future__ import annotations

STUDY = "length_scaling"

VARIABLES = {
    "real_rel_l2_err": ("1", "relative L2 error of a real kernel's output against the fp64 golden value"),
    "real_max_abs_err": ("1", "max |real kernel output - fp64 golden value|"),
    "real_emulator_rel_l2_err": ("1", "relative L2 error of the emulator configuration on the same inputs"),
    "real_bitwise_equal": ("1", "fraction of output elements bitwise equal between the real kernel and the emulator configuration"),
    "real_error_corr": ("1", "correlation of the real kernel's and the emulator configuration's deviations from the golden value rounded to the dtype"),
    "real_passes": ("1", "1 if the acceptance rule accepts the real kernel's output"),
    "real_status": ("1", "ok, or why the real kernel gave no output here (unavailable, refused, out of memory)"),
    "real_causal": ("1", "True: causal mask (bottom-right aligned), False: none"),
    "tile_q": ("1", "query block (Br) of the tile configuration"),
    "tile_k": ("1", "key block (Bc) of the tile configuration"),
    "max_abs_err": ("1", "max |O - O_golden| over all elements"),
    "mean_abs_err": ("1", "mean |O - O_golden|"),
    "rel_l2_err": ("1", "relative L2 error ||O - O_golden|| / ||O_golden||"),
    "max_rel_err": ("1", "max elementwise relative error |O - O_golden| / |O_golden|"),
    "max_ulp_err": ("ulp", "max error in units in the last place of the output format"),
    "input_abs_max": ("1", "max |q|, |k|, |v| of the rounded inputs"),
    "dtype_floor": ("1", "FA test-suite floor 2 max|(g + 0.3 - 0.3) - g| in the output format"),
    "dynamic_threshold": ("1", "seed 000 dynamic threshold on the relative error"),
    "passes": ("1", "1 if the rule accepts the kernel output, else 0"),
    "pass_rate": ("1", "fraction of seeds whose output the rule accepts"),
    "flash_fp64_max_abs_err": ("1", "max |O_flash(fp64 policy) - O_golden| on the fp32 inputs"),
    "golden_self_max_abs_err": ("1", "max |golden(chunk a) - golden(chunk b)| on the fp32 inputs (N <= 2048)"),
    "flash_to_reference_ratio": ("1", "flash error / reference error (max abs), same policy"),
    "fit_intercept": ("1", "intercept of the growth fit of median error"),
    "fit_slope": ("1", "slope of the growth fit of median error"),
    "fit_r2": ("1", "coefficient of determination of the growth fit"),
    "block_max_abs_err": ("1", "max |O - O_golden| of the flash emulator at a block configuration"),
    "block_rel_l2_err": ("1", "relative L2 error of the flash emulator at a block configuration"),
    "strata_rel_l2_err": ("1", "mean per-row relative L2 error within a position stratum (causal)"),
    "strata_max_abs_err": ("1", "max |O - O_golden| within a position stratum (causal)"),
    "row_profile_rel_l2_err": ("1", "mean per-row relative L2 error in bins of query position (causal)"),
    "block_seq_len": ("1", "sequence length of the block-size experiment"),
    "attribution_rel_l2_err": ("1", "relative L2 error under a rounding variant (all stages low, one promoted, one alone)"),
    "p_below_min_normal_frac": ("1", "fraction of softmax probabilities below the format's smallest normal"),
    "attribution_query_rows": ("1", "query rows evaluated per input set in the attribution experiment"),
    "causal_seq_len": ("1", "sequence length of the causal position-stratified experiment"),
    "mean_rel_err": ("1", "seed 000's metric: mean elementwise |O - O_golden| / |O_golden| (zeros of the golden value skipped)"),
    "fp32_inside_rel_l2_err": ("1", "relative L2 error of unblocked attention with fp32 inside (inputs and output in the dtype; PyTorch's math backend)"),
    "fp32_inside_max_abs_err": ("1", "max |O - O_golden| of unblocked attention with fp32 inside"),
    "nomask_strata_rel_l2_err": ("1", "mean per-row relative L2 error within a position stratum, no mask"),
    "nomask_strata_max_abs_err": ("1", "max |O - O_golden| within a position stratum, no mask"),
    "nomask_row_profile_rel_l2_err": ("1", "mean per-row relative L2 error in bins of query position, no mask"),
    "nomask_seq_len": ("1", "sequence length of the unmasked position-stratified experiment"),
    "mac_rel_l2_err": ("1", "relative L2 error of the flash emulator with the score product accumulated term by term (fma or two roundings)"),
    "mac_query_rows": ("1", "query rows evaluated per input set in the multiply-add experiment"),
    "denominator_rel_l2_err": ("1", "relative L2 error of the flash emulator (fp32 inside) with the running row sum rounded to the dtype in a window of key blocks"),
    "denominator_tail_share": ("1", "error with the row sum rounded only in the last 10% of key blocks / error with it rounded in every block"),
    "denominator_query_rows": ("1", "query rows evaluated per input set in the denominator experiment"),
    "fp32_stage_rel_l2_err": ("1", "relative L2 error of the fp32 unblocked reference with one stage computed in fp64 (or the reductions split)"),
    "fp32_stage_query_rows": ("1", "query rows evaluated per input set in the fp32-reference stage experiment"),
    "fp32_stage_matmul_precision": ("1", "torch's float32 matmul settings when the fp32-reference stage experiment ran"),
}


def rules(p: dict) -> list[str]:
    """Cross-parameter checks of a parameter set (each violated rule as one message); the study has none
    beyond the per-parameter schema."""
    return []


def memory_estimate(p: dict) -> tuple[int, str] | None:
    """(bytes, note): the dominant term of the peak memory, the score matrices of the fp32 unblocked
    reference (``reference_chunk`` rows, 0: all N) and of the fp64 golden chunks, N the largest length,
    two temporaries each."""
    n_max = max(max(p["seq_lens"]), p["causal_seq_len"], p["block_seq_len"], max(p["real_seq_lens"]))
    reference_rows = p["reference_chunk"] or max(max(p["seq_lens"]), p["causal_seq_len"], max(p["real_seq_lens"]))
    need = p["batch"] * p["heads"] * n_max * (reference_rows * 4 + p["golden_chunk"] * 8) * 3
    return int(need), ("score matrices of the fp32 unblocked reference (reference_chunk rows, 0: all N) and of the "
                       "fp64 golden chunks, N = the largest length, two temporaries each")
