"""Study 02: extreme inputs, mask sentinels, and which acceptance rules catch real kernel bugs.

Five experiments, each measured against the fp64 golden value computed on the inputs the kernel
actually read (rounded to its input format):

* ``experiments``: input families through the unblocked and the tiled emulator, seed 003's fp16
  overflow at 65504, mask sentinels (FlashInfer's -5e4) and where their zero output starts;
* ``detection``: injected faults (``attnum.kernels.faults``) against the acceptance rules
  (``attnum.acceptance``), and a fixed 0.1% tolerance against an error in one row (seed 000's claim);
* ``real_kernels``: the real kernels of the registry on the same inputs and mask deliveries;
* ``readings`` / ``readings_gpu``: values and tables read from the results; ``figures``: the plots.

This module is light (no torch): the study's name, its variables, and the runner's checks on its
parameters (``rules``, ``memory_estimate``).
"""
from __future__ import annotations

STUDY = "extreme_inputs"

VARIABLES = {
    # family sweep
    "nan_where_golden_finite": ("1", "output entries that are NaN where the golden output is finite"),
    "inf_where_golden_finite": ("1", "output entries that are +-inf where the golden output is finite"),
    "finite_where_golden_nonfinite": ("1", "output entries that are finite where the golden output is not"),
    "golden_nonfinite": ("1", "golden output entries that are inf or NaN"),
    "input_overflow": ("1", "input entries finite in fp64 that became inf when rounded to the input format"),
    "output_size": ("1", "number of output entries"),
    "finite_max_abs_err": ("1", "max |O - O_golden| over entries finite in both"),
    "finite_rel_l2_err": ("1", "relative L2 error over entries finite in both"),
    "finite_max_ulp_err": ("ulp", "max error in output-format ULPs over entries finite in both"),
    "zero_rows": ("1", "rows of the output that are all zero where the golden row is not"),
    "nonzero_rows": ("1", "rows of the output that are not all zero where the golden row is all zero"),
    "masked_key_influence": ("1", "max |O(v') - O(v)| when V of masked keys is shifted by 100 (0: no weight; NaN: output not finite or no masked key)"),
    "kernel_exception": ("1", "1 if the kernel raised an exception (message in attrs kernel_exceptions)"),
    "family_false_alarm": ("1", "1 if the rule rejects the correct flash kernel (fa2 policy); NaN: golden not finite"),
    "kernel_name": ("1", "registry name (attnum.kernels) of each (kernel, policy, dtype) of the family sweep"),
    "amplification": ("1", "median rel. L2 error over seeds / the same for N(0, 1) inputs (same kernel, policy, dtype, N)"),
    # overflow
    "overflow_nan_fraction": ("1", "fraction of output entries that are NaN (q = k = v = 65504)"),
    "overflow_inf_fraction": ("1", "fraction of output entries that are +-inf (q = k = v = 65504)"),
    "overflow_max_abs_err": ("1", "max |O - O_golden| over finite entries (golden output is 65504)"),
    "overflow_golden_value": ("1", "max |golden output| of the 65504 case"),
    "overflow_head_dim": ("1", "head dimension of the overflow experiment"),
    "overflow_seq_len": ("1", "sequence length of the overflow experiment"),
    # sentinels
    "sentinel_zero_row_fraction": ("1", "fraction of rows output all zero where the golden row is not"),
    "sentinel_nonzero_row_fraction": ("1", "fraction of rows not all zero where the golden row is (fully masked rows)"),
    "sentinel_nan_fraction": ("1", "fraction of output entries that are NaN"),
    "sentinel_rel_l2_err": ("1", "relative L2 error over entries finite in both"),
    "sentinel_masked_key_influence": ("1", "max |O(v') - O(v)| when V of masked keys is shifted by 100"),
    "sentinel_lse_max_abs_err": ("1", "max |lse - lse_golden| over rows with finite golden lse (NaN: no lse)"),
    "sentinel_exception": ("1", "1 if the kernel raised an exception"),
    "sentinel_seq_len": ("1", "sequence length of the sentinel experiment"),
    "onset_row_max_logit": ("1", "largest valid raw score q.k of the row (fp64, on the rounded inputs)"),
    "onset_row_zero": ("1", "1 if the -5e4-sentinel kernel output the row as all zero"),
    "onset_rel_l2_err": ("1", "relative L2 error of the -5e4-sentinel kernel at a target logit"),
    "onset_predicted_logit": ("1", "predicted onset: sentinel + ln(smallest positive P / 2) / scale, raw score units"),
    "onset_fill": ("1", "the finite mask sentinel of the onset scan (raw score units)"),
    # detection
    "det_detected": ("1", "1 if the rule rejects the faulty kernel's output"),
    "det_false_alarm": ("1", "1 if the rule rejects the correct kernel's output"),
    "det_fault_changed": ("1", "1 if the fault changed the output or the LSE at all (bitwise)"),
    "det_fault_exception": ("1", "1 if the faulty kernel raised an exception (counts as detected)"),
    "det_fault_rel_l2_err": ("1", "relative L2 error of the faulty kernel's output (inf: non-finite entries)"),
    "det_fault_worst_row_err": ("1", "largest per-row relative L2 error of the faulty kernel's output"),
    "det_fault_lse_max_abs_err": ("1", "max |lse - lse_golden| of the faulty kernel"),
    "det_fault_kappa": ("1", "max output error of the faulty kernel in units of u (P|V|)"),
    "det_correct_rel_l2_err": ("1", "relative L2 error of the correct kernel's output"),
    "det_correct_worst_row_err": ("1", "largest per-row relative L2 error of the correct kernel's output"),
    "det_correct_kappa": ("1", "max output error of the correct kernel in units of u (P|V|)"),
    "det_reference_kappa": ("1", "max output error of the same-policy unblocked reference in units of u (P|V|)"),
    "det_plain_reference_max_abs_err": ("1", "max abs error of plain attention in the low dtype (FA rule's reference)"),
    "det_input_abs_max": ("1", "max |q|, |k|, |v| of the rounded inputs (seed 000's x_max)"),
    "severity": ("1", "severity value of a fault level (meaning per fault: attrs severity_meaning)"),
    "default_level": ("1", "severity level of the fault's default severity"),
    "det_detection_rate": ("1", "fraction of (family, seed) points, among those where the fault changed the output, where the rule rejects it"),
    "det_false_alarm_rate": ("1", "fraction of families and seeds where the rule rejects the correct kernel"),
    "det_miss_rate": ("1", "fraction of faulty outputs in a worst-row error bin that the rule accepts"),
    "det_error_bin_count": ("1", "number of faulty outputs (that changed) in a worst-row error bin"),
    "det_fault_mean_rel_err": ("1", "seed 000's mean relative error of the faulty kernel's output (elementwise, zeros of the golden skipped; inf: non-finite entries)"),
    "det_correct_mean_rel_err": ("1", "seed 000's mean relative error of the correct kernel's output"),
    # one faulty row and a fixed tolerance
    "dil_correct_err": ("1", "error of the correct flash emulator's output (fa2_<dtype>, N(0, 1) inputs) by the metric dil_metric"),
    "dil_fault_err": ("1", "error of the output whose last dil_faulty_rows rows are scaled by 1 + dil_row_error, by the metric dil_metric"),
    "dil_fault_worst_row_err": ("1", "largest per-row relative L2 error of that faulty output"),
    "dil_fault_accepted": ("1", "1 if a fixed 0.1% tolerance on the metric accepts the faulty output"),
    "dil_correct_accepted": ("1", "1 if a fixed 0.1% tolerance on the metric accepts the correct output"),
    "dil_largest_accepted": ("1", "largest row error e (faulty rows scaled by 1 + e) that a fixed 0.1% tolerance on the metric accepts (NaN: it rejects the correct output)"),
    "dil_rows": ("1", "rows the tolerance averages over: batch * heads * N"),
    # real kernels on the same inputs
    "real_kernel": ("1", "real kernel (registry name)"),
    "real_other_kernel": ("1", "the second real kernel of a pair (registry name)"),
    "real_dtype": ("1", "input format the real kernel ran in"),
    "real_input": ("1", "input: a family of attnum.inputs or one of the study's REAL_EXTRA_INPUTS"),
    "real_mask": ("1", "how the input's mask reached the kernel: none (no mask), bool (the kernel's boolean mask input: SDPA's attn_mask, FlashInfer's custom_mask), additive -inf, -5e4 or finfo(dtype).min"),
    "real_status": ("1", "ok, or why the kernel gave no output here (unavailable, refused, out of memory, not applicable)"),
    "real_nan_fraction": ("1", "fraction of the real kernel's output entries that are NaN"),
    "real_inf_fraction": ("1", "fraction of the real kernel's output entries that are +-inf"),
    "real_nonfinite_where_golden_finite": ("1", "fraction of output entries NaN or inf where the golden output is finite"),
    "real_finite_where_golden_nonfinite": ("1", "fraction of output entries finite where the golden output is NaN or inf"),
    "real_zero_rows": ("1", "output rows all zero where the golden row is not"),
    "real_nonzero_rows": ("1", "output rows not all zero where the golden row is all zero (fully masked rows)"),
    "real_masked_rows_zero": ("1", "fully masked rows (no visible key) that the kernel output as all zero"),
    "real_masked_rows_nan": ("1", "fully masked rows (no visible key) with a NaN in the kernel's output"),
    "real_rows_attend_masked": ("1", "rows that gave weight to a masked key (output moved when V of keys masked for every query was shifted by 100, or a fully masked row came out finite and not 0)"),
    "real_max_abs_err": ("1", "max |O - O_golden| over entries finite in both"),
    "real_rel_l2_err": ("1", "relative L2 error over entries finite in both"),
    "real_pair_max_abs_diff": ("1", "max |O_a - O_b| between two real kernels over entries finite in both (NaN: none, or one did not run)"),
    "real_pair_nonfinite_mismatch": ("1", "fraction of output entries NaN (or inf) in one kernel of the pair and not in the other"),
    "real_pair_zero_row_mismatch": ("1", "output rows all zero in one kernel of the pair and not in the other"),
    "real_golden_nonfinite": ("1", "fraction of golden output entries that are NaN or inf (real-kernel inputs)"),
    "real_masked_rows": ("1", "fully masked rows (no visible key) of the real-kernel input"),
    "real_rows": ("1", "output rows of each real-kernel input (batch * heads * N)"),
    "real_seq_len": ("1", "sequence length N of the real-kernel experiment"),
    "real_head_dim": ("1", "head dimension d of the real-kernel experiment"),
}


def rules(p: dict) -> list[str]:
    """The cross-parameter checks of the study, one message per violated rule (empty when all hold)."""
    broken = []
    if not p["onset_logit_min"] < p["onset_logit_max"]:
        broken.append(f"onset_logit_min ({p['onset_logit_min']}) must be below onset_logit_max "
                      f"({p['onset_logit_max']})")
    return broken


def memory_estimate(p: dict) -> tuple[int, str]:
    """(bytes, note): the dominant term of the peak memory. The unblocked reference holds full N x N fp32
    score matrices and the fp64 golden value N x golden_chunk chunks, two temporaries beside each,
    N the largest length of any experiment."""
    n = max(max(p["seq_lens"]), max(p["det_seq_lens"]), p["sentinel_seq_len"], p["overflow_seq_len"],
            p["real_seq_len"])
    return (p["batch"] * p["heads"] * n * (n * 4 + p["golden_chunk"] * 8) * 3,
            "full N x N fp32 score matrices of the unblocked reference and the fp64 golden chunks, "
            "N = the largest length, two temporaries each")
