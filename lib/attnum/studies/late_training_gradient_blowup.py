"""Study 04: late-training gradient blowup of a BF16 FlashAttention backward (seed 004).

The experiments, each a function returning an xarray Dataset with CF attributes:

``mechanism_grid``
    q, k, v, dO i.i.d. N(0, 1); q multiplied by a *sharpness* factor; a vector mu
    of norm ``mu_norm`` added to every key. The operands are rounded to bf16 (what
    the kernels read) and every variant's dQ, dK, dV is compared with the fp64
    gradients on those same operands. Adding mu to every key shifts each row's
    scores by the constant q_i . mu, so on unrounded keys the exact output and dQ
    would not depend on mu. The kernels read k + mu rounded to bf16, though, whose
    offset-free part is resolved only to bf16's spacing at |mu_c|: at large |mu| the
    exact problem changes too. The grid measures by how much (``mech_exact_dq_shift``:
    the fp64 dQ at |mu| against the fp64 dQ at |mu| = 0, same q, v, dO;
    ``mech_distinct_*``: what is left of the keys), so that claims can be restricted to
    the offsets where the problem is still the same. Every error is against the fp64
    gradients of the operands the kernel read, so it is kernel error at every |mu|.
    Variants (``KERNEL_VARIANTS``) switch seed 004's two causes on and off separately.
    Besides the median row errors, the grid records the measures of the sources'
    acceptance checks: the global cosine of dQ with the exact dQ (seed 000: cosine > 0.99
    and angle < 5 degrees) and the largest absolute errors of dQ, dK, dV (seed 003).

``source_checks``
    seed 003's setting (fp16, N = 1024, d = 64 in the source): the FA2-order emulator in
    bf16 and fp16, with and without the causal mask, on the mechanism operands (each
    against its own fp64 gradients), for seed 003's gradient thresholds and its claim
    that the causal backward is an order of magnitude more stable.

``train_runs`` and ``checkpoint_diagnostics``
    the small GPT trained with the BF16 flash emulator and, from the same
    initialisation and data order, with FP32 attention; at checkpoints the FP32
    backward-recompute diagnostic, with and without a common key offset added to
    every layer's keys (forward unchanged in exact arithmetic).

``tied_maxima_comparison``
    Qiu & Yao's regime (arXiv 2510.04212): rows whose maximum score is repeated
    (P = 1 exactly at several keys) and a value matrix with a negative mean, beside
    seed 004's key-offset regime, with and without tiling.

``real_mechanism_grid`` and ``real_kernel_diagnostics``
    real kernels of the registry (PyTorch SDPA pinned to one backend, our Triton
    FlashAttention-2, a kernel of your own) on the mechanism grid's operands, fed to
    them as bf16 tensors, beside the emulator variants on the same operands: median
    row dQ, dK, dV errors against fp64 and the correlation of the real kernel's dQ
    error with the emulator's; and the FP32 backward-recompute diagnostic on the
    trained checkpoint with a real kernel as every layer's attention (``InFormat``:
    q, k, v and dO handed to it in bf16, as the emulator rounds them). A kernel that
    cannot run here, refuses the inputs or runs out of memory is recorded with the
    reason, never replaced by another.

``gpu_training_dataset`` (the ``gpu_training`` tier, issue 13)
    trains nothing: gathers ``attnum.lm``'s GPU training records (``lm_s04_*.nc``, the ``s04_*`` runs
    of params/lm/campaign.yaml), their per-layer series and ``record.summary``, the loss rise, the
    records' provenance and GPU time, and where a mechanism grid run puts the blowup regime
    (``grid_regime``); ``gpu_training_sentences`` answers issue 13 section 3 from them, with each run's
    throughput and attention share, the runs of one setting at the largest step they all reached
    (``gpu_equal_step_table``: budget-stopped runs end at different steps) and where each run starts to
    memorise its small corpus.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import xarray as xr
from ..progress import tqdm

from .. import kernels
from ..diagnostics import ATTRS as DIAG_ATTRS
from ..diagnostics import recompute_backward_fp32
from ..inputs import generator
from ..kernels import AttentionImpl
from ..metrics import ds_row_sums, gradient_errors, output_errors, row_rel_l2
from ..model import GPTConfig, add_key_offset
from ..operands import (REGIMES, axis_offset_operands, golden_values, key_resolution, mechanism_operands, mechanism_operands_in,
                        regime_operands, unit_vector)
from ..precision import FORMATS, get_policy, round_to
from ..training import load_checkpoint, record_variables, torch_threads

FA2_BF16 = get_policy("fa2_bf16")
FP32 = get_policy("fp32")

# name -> (family, policy, fused_scale_max, what it isolates)
KERNEL_VARIANTS = {
    "fp32": ("emulator", FP32, False, "FP32 attention, forward and backward (the baseline)"),
    "fp32_fused": ("emulator", FP32, True, "FP32 attention with FA3's fused scale-max: cause 1 alone"),
    "fp32_ds_bf16": ("emulator", FP32.replace(name="fp32+ds=bf16", ds="bf16"), False,
                     "FP32 attention with dS rounded to bf16: cause 2 alone"),
    "bf16_bwd_fp32": ("emulator", FA2_BF16.with_backward("fp32"), False,
                      "BF16 forward (stored O in bf16), every backward stage in fp32"),
    "bf16": ("emulator", FA2_BF16, False, "BF16 FlashAttention-2 forward and backward, subtract-then-scale"),
    "bf16_fused": ("emulator", FA2_BF16, True, "BF16 FlashAttention-3: fused scale-max and rounded dS (both causes)"),
    "reference_bf16": ("reference", FA2_BF16, False, "unblocked attention under fa2_bf16, autograd backward"),
}
TILINGS = ("tiled", "one_block")
AXIS_OFFSET_VARS = ("dq_err", "dk_err", "dv_err", "dq_rel_err", "dq_err_cos_mu", "exact_dq_shift", "dq_norm",
                    "distinct_key_values", "max_prob")
"""The mechanism grid's variables also measured on the axis-offset operands (named ``xo_*``)."""

ATTRS = {
    "mech_dq_err": ("1", "median row relative L2 error of dQ against fp64"),
    "mech_dk_err": ("1", "median row relative L2 error of dK against fp64"),
    "mech_dv_err": ("1", "median row relative L2 error of dV against fp64"),
    "mech_dq_err_p90": ("1", "90th percentile of the row relative L2 error of dQ"),
    "mech_out_err": ("1", "relative L2 error of the forward output against fp64"),
    "mech_ds_row_sum": ("1", "median over rows of |sum_j dS_ij| / sum_j |dS_ij|, dS as fed to the dQ matmul"),
    "mech_ds_exact_row_sum": ("1", "median over rows of |sum_j dS_ij| / sum_j |dS_ij| before rounding dS"),
    "mech_dq_err_cos_mu": ("1", "median over rows of |cos(dQ error, mu)|"),
    "mech_max_prob": ("1", "median over rows of the largest attention probability (fp64)"),
    "mech_dq_norm": ("1", "median over rows of ||dQ_i|| (fp64)"),
    "mech_dq_rel_err": ("1", "global relative L2 error of dQ against fp64 (all rows together; not the median row error)"),
    "mech_dq_cos": ("1", "cosine between dQ and the fp64 dQ over all elements (seed 000's gradient check)"),
    "mech_dq_max_abs_err": ("1", "largest absolute error of an element of dQ against fp64 (seed 003's measure)"),
    "mech_dk_max_abs_err": ("1", "largest absolute error of an element of dK against fp64 (seed 003's measure)"),
    "mech_dv_max_abs_err": ("1", "largest absolute error of an element of dV against fp64 (seed 003's measure)"),
    "mech_exact_dq_shift": ("1", "median over rows of ||dQ_i(|mu|) - dQ_i(0)|| / ||dQ_i(0)||, fp64 dQ of the rounded "
                                 "operands at this |mu| against those at |mu| = 0 (same q, v, dO): how much the "
                                 "exact problem changed"),
    "mech_distinct_keys": ("1", "distinct key vectors after rounding k + mu to bf16"),
    "mech_distinct_key_values": ("1", "median over components of the number of distinct values of a key "
                                      "component after rounding k + mu to bf16"),
    "src_dq_err": ("1", "median row relative L2 error of dQ against fp64"),
    "src_dk_err": ("1", "median row relative L2 error of dK against fp64"),
    "src_dv_err": ("1", "median row relative L2 error of dV against fp64"),
    "src_dq_rel_err": ("1", "global relative L2 error of dQ against fp64 (all rows together)"),
    "src_dq_max_abs_err": ("1", "largest absolute error of an element of dQ against fp64"),
    "src_dk_max_abs_err": ("1", "largest absolute error of an element of dK against fp64"),
    "src_dv_max_abs_err": ("1", "largest absolute error of an element of dV against fp64"),
    "src_dq_cos": ("1", "cosine between dQ and the fp64 dQ over all elements"),
    "src_kernel": ("1", "emulator kernel of the source checks (registry name) per format"),
    "variant_description": ("1", "what the variant switches on"),
    "qy_dq_err": ("1", "median row relative L2 error of dQ against fp64"),
    "qy_out_err": ("1", "relative L2 error of the forward output against fp64"),
    "qy_out_err_coherence": ("1", "mean over columns of |mean_i e_ic| / rms_i e_ic of the output error e "
                                  "(1: every row errs alike; ~N^-1/2: independent)"),
    "qy_dq_err_cos_pk": ("1", "median over rows of |cos(dQ error, sum_j P_ij k_j)|"),
    "qy_ds_row_sum": ("1", "median over rows of |sum_j dS_ij| / sum_j |dS_ij|, dS as fed to the dQ matmul"),
    "qy_max_prob": ("1", "median over rows of the largest attention probability (fp64)"),
    "diag_key_mean_norm": ("1", "norm of the mean key of the layer at the checkpoint, offset included"),
    "diag_loss": ("nat", "loss of the diagnostic batch at the checkpoint, offset included"),
    "real_mech_dq_err": ("1", "median row relative L2 error of a real kernel's dQ against fp64"),
    "real_mech_dk_err": ("1", "median row relative L2 error of a real kernel's dK against fp64"),
    "real_mech_dv_err": ("1", "median row relative L2 error of a real kernel's dV against fp64"),
    "real_mech_dq_err_cos_mu": ("1", "median over rows of |cos(real kernel's dQ error, mu)|"),
    "real_mech_emulator_dq_err": ("1", "median row relative L2 error of the emulator variant's dQ on the same operands"),
    "real_mech_emulator_dk_err": ("1", "median row relative L2 error of the emulator variant's dK on the same operands"),
    "real_mech_emulator_dv_err": ("1", "median row relative L2 error of the emulator variant's dV on the same operands"),
    "real_mech_dq_err_corr": ("1", "correlation over all elements of the real kernel's and the emulator variant's "
                                   "dQ errors against fp64 on the same operands"),
    "real_mech_status": ("1", "ok, or why the real kernel gave no gradients at this (N, d) "
                              "(unavailable, refused, out of memory)"),
    "real_diag_status": ("1", "ok, or why the diagnostic could not run with this real kernel as the model's attention"),
    "real_diag_checkpoint": ("1", "optimizer updates before the checkpoint the real-kernel diagnostic ran on"),
}
for _name in AXIS_OFFSET_VARS:
    _units, _long = ATTRS[f"mech_{_name}"]
    ATTRS[f"xo_{_name}"] = (_units, _long.replace("bf16", "bf16, keys along a zero first component")
                            + " (axis-offset operands: the exact problem does not change with |mu|)")
for _name, (_units, _long) in DIAG_ATTRS.items():
    ATTRS[f"real_diag_{_name}"] = (_units, f"{_long} (real kernel as every layer's attention, last checkpoint)")


VARIABLES = {**record_variables(), **ATTRS,
             "sharpness": ("1", "factor multiplying q (attention sharpness)"),
             "mu_norm": ("1", "norm of the vector mu added to every key"),
             "offset_norm": ("1", "norm of the common key offset added to every head"),
             "checkpoint": ("1", "optimizer updates before the checkpoint"),
             "real_kernel": ("1", "real kernel (registry name)"),
             "real_variant": ("1", "emulator variant the real kernel is compared with"),
             "real_seq_len": ("1", "sequence length N of the real-kernel grid"),
             "real_head_dim": ("1", "head dimension d of the real-kernel grid"),
             "src_format": ("1", "number format of the operands and the FA2-order emulator (source checks)"),
             "src_mask": ("1", "attention mask of the source checks: none or causal")}
"""CF units and long_name of every variable the study writes (applied by ``ncio.write_results``)."""


def variant_kernel(name: str, block_q: int, block_k: int) -> kernels.Kernel:
    """The registry kernel of one variant."""
    family, policy, fused, _ = KERNEL_VARIANTS[name]
    return kernels.as_kernel(AttentionImpl(family, policy, block_q=block_q, block_k=block_k, fused_scale_max=fused))


def _row_cos(a, b) -> torch.Tensor:
    """|cos| between matching rows of a and b (b broadcast), NaN where either row is 0."""
    a, b = a.double(), b.double().expand_as(a)
    num = (a * b).sum(-1).abs()
    den = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.full_like(den, math.nan))


def _median(x: torch.Tensor) -> float:
    x = x[torch.isfinite(x)]
    return x.median().item() if x.numel() else math.nan


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine between two tensors over all elements (NaN when either is zero)."""
    a, b = a.double().flatten(), b.double().flatten()
    den = (torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)).item()
    return (a @ b).item() / den if den > 0 else math.nan


def max_abs_errors(grads, gold) -> dict[str, float]:
    """``<g>_max_abs_err``: the largest absolute error of an element of dQ, dK, dV (seed 003's measure)."""
    return {f"{g}_max_abs_err": (t.double() - gold[g]).abs().max().item() for g, t in zip(("dq", "dk", "dv"), grads)}


def variant_errors(q, k, v, do, kernel, gold, *, mu=None, causal: bool = False) -> dict[str, float]:
    """Errors of one kernel's forward and backward against the fp64 values ``gold``
    (a dict with out, dq, dk, dv, pk) on the operands q, k, v, dO it reads: the median row
    errors (``<g>_err``), the global relative L2 errors (``<g>_rel_err``; a different metric),
    the largest absolute errors and the global cosine of dQ with the exact dQ."""
    stats = {}
    out, lse = kernel.forward(q, k, v, causal=causal)
    grads = kernel.backward(q, k, v, do, out=out, lse=lse, stats=stats, causal=causal)
    err = grads[0].double() - gold["dq"]
    res = {**gradient_errors(grads, gold, quantiles=(0.9,), global_l2=True), **output_errors(out, gold["out"]),
           **ds_row_sums(stats, keys=("ds_row_sum", "ds_exact_row_sum")), **max_abs_errors(grads, gold)}
    res["dq_cos"] = cosine(grads[0], gold["dq"])
    res["dq_err_cos_pk"] = _median(_row_cos(err, gold["pk"]))
    res["dq_err_cos_mu"] = _median(_row_cos(err, mu)) if mu is not None and mu.abs().sum() > 0 else math.nan
    return res


OPERAND_BUILDERS = {"rounded_offset": mechanism_operands, "axis_offset": axis_offset_operands}
"""The mechanism grid's operands: ``rounded_offset`` (k + mu in a random direction, rounded: the exact
problem changes at large |mu|) or ``axis_offset`` (keys with a zero first component, mu along it: the
exact problem is the same at every |mu|)."""
def mechanism_grid(sharpness, mu_norms, seq_lens, head_dims, seeds, *, variants=tuple(KERNEL_VARIANTS), heads: int = 1,
                   block_q: int = 64, block_k: int = 64, golden_chunk: int = 1024, device="cpu",
                   progress: bool = True, threads: int = 1, operands: str = "rounded_offset") -> xr.Dataset:
    """Errors of every variant over sharpness x |mu| x N x d x seed (see the module docstring).
    ``operands``: a key of ``OPERAND_BUILDERS``; ``axis_offset`` gives variables named ``xo_*``
    (the subset ``AXIS_OFFSET_VARS``) instead of ``mech_*``."""
    build = OPERAND_BUILDERS[operands]
    metrics = ("dq_err", "dk_err", "dv_err", "dq_err_p90", "out_err", "ds_row_sum", "ds_exact_row_sum",
               "dq_err_cos_mu", "dq_rel_err", "dq_cos", "dq_max_abs_err", "dk_max_abs_err", "dv_max_abs_err")
    shape = (len(variants), len(sharpness), len(mu_norms), len(seq_lens), len(head_dims), len(seeds))
    data = {m: np.full(shape, np.nan) for m in metrics}
    problem = {m: np.full(shape[1:], np.nan) for m in ("max_prob", "dq_norm", "exact_dq_shift", "distinct_keys",
                                                      "distinct_key_values")}
    at_zero = {}  # the fp64 dQ at |mu| = 0 of each (sharpness, N, d, seed): what the exact problem was
    work = [(a, s, b, m, c, n, e, d, f, seed) for a, s in enumerate(sharpness) for c, n in enumerate(seq_lens)
            for e, d in enumerate(head_dims) for f, seed in enumerate(seeds) for b, m in enumerate(mu_norms)]
    impls = [variant_kernel(name, block_q, block_k) for name in variants]
    with torch_threads(threads):
        for a, s, b, m, c, n, e, d, f, seed in tqdm(work, desc="mechanism grid", disable=not progress):
            q, k, v, do, mu = build(n, d, s, m, seed, heads=heads, device=device)
            gold = golden_values(q, k, v, do, golden_chunk)
            key = (a, c, e, f)
            if key not in at_zero:
                zero = gold if m == 0 else golden_values(*build(n, d, s, 0.0, seed, heads=heads,
                                                                device=device)[:4], golden_chunk)
                at_zero = {key: zero["dq"]}  # |mu| is the innermost loop: keep one point's dQ at a time
            point = (a, b, c, e, f)
            problem["max_prob"][point] = gold["max_prob"].median().item()
            problem["dq_norm"][point] = torch.linalg.vector_norm(gold["dq"], dim=-1).median().item()
            problem["exact_dq_shift"][point] = _median(row_rel_l2(gold["dq"], at_zero[key]))
            resolution = key_resolution(k)
            problem["distinct_keys"][point] = resolution["distinct_keys"]
            problem["distinct_key_values"][point] = resolution["distinct_values"]
            for i, impl in enumerate(impls):
                res = variant_errors(q, k, v, do, impl, gold, mu=mu)
                for metric in metrics:
                    data[metric][i, a, b, c, e, f] = res[metric]
    dims = ("variant", "sharpness", "mu_norm", "seq_len", "head_dim", "seed")
    coords = {"variant": list(variants), "sharpness": list(map(float, sharpness)),
              "mu_norm": list(map(float, mu_norms)), "seq_len": list(seq_lens), "head_dim": list(head_dims),
              "seed": list(seeds)}
    ds = xr.Dataset({f"mech_{m}": (dims, data[m]) for m in metrics}, coords=coords)
    for name, values in problem.items():
        ds[f"mech_{name}"] = (dims[1:], values)
    ds["variant_description"] = ("variant", [KERNEL_VARIANTS[v][3] for v in variants])
    if operands == "axis_offset":
        ds = ds[[f"mech_{m}" for m in AXIS_OFFSET_VARS] + ["variant_description"]]
        ds = ds.rename({f"mech_{m}": f"xo_{m}" for m in AXIS_OFFSET_VARS})
    return ds


# -- Qiu & Yao's regime beside seed 004's ---------------------------------------------------------

def tied_maxima_comparison(seq_len: int, head_dim: int, seeds, *, variants=tuple(KERNEL_VARIANTS), n_ties: int = 8,
                           mu_norm: float = 100.0, block_q: int = 64, block_k: int = 64,
                           golden_chunk: int = 1024, device="cpu", progress: bool = True,
                           threads: int = 1) -> xr.Dataset:
    """Seed 004's key-offset regime beside Qiu & Yao's tied maxima, tiled and with one key block."""
    metrics = ("dq_err", "out_err", "out_err_coherence", "dq_err_cos_pk", "ds_row_sum")
    shape = (len(REGIMES), len(variants), len(TILINGS), len(seeds))
    data = {m: np.full(shape, np.nan) for m in metrics}
    max_prob = np.full((len(REGIMES), len(seeds)), np.nan)
    work = [(r, regime, s, seed) for r, regime in enumerate(REGIMES) for s, seed in enumerate(seeds)]
    with torch_threads(threads):
        for r, regime, s, seed in tqdm(work, desc="tied maxima", disable=not progress):
            q, k, v, do, mu = regime_operands(regime, seq_len, head_dim, seed, n_ties=n_ties, mu_norm=mu_norm,
                                              device=device)
            gold = golden_values(q, k, v, do, golden_chunk)
            max_prob[r, s] = gold["max_prob"].median().item()
            for i, name in enumerate(variants):
                for t, tiling in enumerate(TILINGS):
                    bk = block_k if tiling == "tiled" else seq_len
                    res = variant_errors(q, k, v, do, variant_kernel(name, block_q, bk), gold, mu=mu)
                    for metric in metrics:
                        data[metric][r, i, t, s] = res[metric]
    dims = ("regime", "variant", "tiling", "seed")
    coords = {"regime": list(REGIMES), "variant": list(variants), "tiling": list(TILINGS), "seed": list(seeds)}
    ds = xr.Dataset({f"qy_{m}": (dims, data[m]) for m in metrics}, coords=coords)
    ds["qy_max_prob"] = (("regime", "seed"), max_prob)
    return ds


# -- the sources' gradient checks ------------------------------------------------------------------

SOURCE_MASKS = ("none", "causal")
SEED003_THRESHOLDS = {"dq": 1e-3, "dk": 1e-3, "dv": 5e-3}
"""Seed 003's gradient thresholds on the largest absolute difference (fp16, N = 1024, d = 64)."""
SEED000_MIN_COS, SEED000_MAX_ANGLE = 0.99, 5.0
"""Seed 000's gradient check: cosine similarity above 0.99 and angle below 5 degrees."""


def source_kernel(fmt: str, block_q: int, block_k: int) -> kernels.Kernel:
    """The FA2-order emulator in ``fmt`` (subtract-then-scale, production rounding points)."""
    return kernels.as_kernel(AttentionImpl("emulator", f"fa2_{fmt}", block_q=block_q, block_k=block_k))


def source_checks(sharpness, mu_norms, seq_len: int, head_dim: int, seeds, *, formats=("bf16", "fp16"),
                  block_q: int = 64, block_k: int = 64, golden_chunk: int = 1024, device="cpu",
                  progress: bool = True, threads: int = 1) -> xr.Dataset:
    """The FA2-order emulator in each format of ``formats``, without and with the causal mask, on the
    mechanism operands rounded to that format (``mechanism_operands_in``), each against the fp64
    gradients of its own operands and mask: seed 003's thresholds and its causal claim."""
    metrics = ("dq_err", "dk_err", "dv_err", "dq_rel_err", "dq_max_abs_err", "dk_max_abs_err", "dv_max_abs_err",
               "dq_cos")
    shape = (len(formats), len(SOURCE_MASKS), len(sharpness), len(mu_norms), len(seeds))
    data = {m: np.full(shape, np.nan) for m in metrics}
    impls = [source_kernel(fmt, block_q, block_k) for fmt in formats]
    work = [(g, fmt, a, s, b, m, f, seed) for g, fmt in enumerate(formats) for a, s in enumerate(sharpness)
            for b, m in enumerate(mu_norms) for f, seed in enumerate(seeds)]
    with torch_threads(threads):
        for g, fmt, a, s, b, m, f, seed in tqdm(work, desc="source checks", disable=not progress):
            q, k, v, do, mu = mechanism_operands_in(fmt, seq_len, head_dim, s, m, seed, device=device)
            for h, mask in enumerate(SOURCE_MASKS):
                causal = mask == "causal"
                out = kernels.golden_attention(q, k, v, chunk=golden_chunk, causal=causal)
                dq, dk, dv = kernels.golden_attention_backward(q, k, v, do, chunk=golden_chunk, causal=causal)
                gold = {"out": out, "dq": dq, "dk": dk, "dv": dv, "pk": torch.zeros_like(dq)}
                res = variant_errors(q, k, v, do, impls[g], gold, causal=causal)
                for metric in metrics:
                    data[metric][g, h, a, b, f] = res[metric]
    dims = ("src_format", "src_mask", "sharpness", "mu_norm", "seed")
    coords = {"src_format": list(formats), "src_mask": list(SOURCE_MASKS), "sharpness": list(map(float, sharpness)),
              "mu_norm": list(map(float, mu_norms)), "seed": list(seeds)}
    ds = xr.Dataset({f"src_{m}": (dims, data[m]) for m in metrics}, coords=coords)
    ds["src_kernel"] = ("src_format", [k.name for k in impls])
    return ds


def seed003_verdicts(ds: xr.Dataset, prefix: str = "src") -> xr.DataArray:
    """1 where dQ, dK and dV all pass seed 003's thresholds on the largest absolute error, else 0."""
    ok = xr.ones_like(ds[f"{prefix}_dq_max_abs_err"], dtype=bool)
    for g, limit in SEED003_THRESHOLDS.items():
        ok = ok & (ds[f"{prefix}_{g}_max_abs_err"] < limit)
    return ok.astype(np.int8)


def seed000_accepts(cos: xr.DataArray) -> xr.DataArray:
    """1 where seed 000's gradient check (cosine > 0.99 and angle < 5 degrees) accepts, else 0."""
    angle = np.degrees(np.arccos(np.clip(cos, -1.0, 1.0)))
    return ((cos > SEED000_MIN_COS) & (angle < SEED000_MAX_ANGLE)).astype(np.int8)


def seed000_table(ds: xr.Dataset, bad: float = 0.5):
    """Per variant, over the mechanism grid: the points whose median row dQ error is at least ``bad``
    (a badly wrong dQ by seed 004's metric), how many of them seed 000's check accepts, and the largest
    median row dQ error it accepts (with that point's cosine, angle and global relative L2 error)."""
    import pandas as pd

    rows = []
    accepted = seed000_accepts(ds["mech_dq_cos"])
    for variant in ds["variant"].values:
        err = ds["mech_dq_err"].sel(variant=variant).values.ravel()
        acc = accepted.sel(variant=variant).values.ravel().astype(bool)
        cos = ds["mech_dq_cos"].sel(variant=variant).values.ravel()
        glob = ds["mech_dq_rel_err"].sel(variant=variant).values.ravel()
        wrong = np.isfinite(err) & (err >= bad)
        worst = np.where(acc & np.isfinite(err), err, -np.inf)
        i = int(np.argmax(worst))
        has = np.isfinite(worst[i])
        rows.append({"variant": str(variant), f"points with median-row dQ err >= {bad:g}": int(wrong.sum()),
                     "of them accepted by seed 000's check": int((wrong & acc).sum()),
                     "largest accepted median-row dQ err": err[i] if has else math.nan,
                     "its cosine": cos[i] if has else math.nan,
                     "its angle (deg)": float(np.degrees(np.arccos(min(1.0, cos[i])))) if has else math.nan,
                     "its global rel. L2 dQ err": glob[i] if has else math.nan})
    return pd.DataFrame(rows).set_index("variant")


def same_problem_limit(ds: xr.Dataset, tolerance: float = 0.1) -> xr.DataArray:
    """Per (sharpness, N, d): the largest |mu| of the grid up to which the exact problem has not moved
    (median over seeds of ``mech_exact_dq_shift`` at most ``tolerance`` at that |mu| and every smaller one)."""
    shift = ds["mech_exact_dq_shift"].median("seed")
    within = (shift <= tolerance).cumprod("mu_norm").astype(bool)  # every |mu| up to here within
    mus = xr.broadcast(ds["mu_norm"], within)[0]
    out = mus.where(within).max("mu_norm")
    out.attrs.update(units="1", long_name=f"largest |mu| at which the exact dQ has moved by at most {tolerance:g} "
                                          "(median row) from |mu| = 0")
    return out


# -- real kernels on the mechanism grid ------------------------------------------------------------

REAL_FORMAT = "bf16"
"""The format real kernels are fed in (the mechanism operands are bf16 values)."""
REAL_GRADS = ("dq_err", "dk_err", "dv_err")


def error_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation over all elements of two error tensors (NaN when either is constant
    or has no finite element in common)."""
    a, b = a.double().flatten(), b.double().flatten()
    ok = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[ok] - a[ok].mean(), b[ok] - b[ok].mean()
    den = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    return (a @ b / den).item() if den > 0 else math.nan


def _failure(exc: BaseException) -> str:
    """The status of a kernel that raised: out of memory or refused, with the first line of the reason."""
    first = (str(exc).splitlines() or [""])[0]
    if isinstance(exc, torch.OutOfMemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return f"out of memory: {first[:200]}"
    return f"refused: {type(exc).__name__}: {first[:300]}"


def real_mechanism_grid(kernel_names, sharpness, mu_norms, seq_lens, head_dims, seeds, *,
                        variants=("bf16", "bf16_fused"), heads: int = 1, block_q: int = 64, block_k: int = 64,
                        golden_chunk: int = 1024, device="cpu", progress: bool = True,
                        threads: int = 1) -> xr.Dataset:
    """Real kernels on the mechanism grid's operands, beside the emulator ``variants`` on the same ones.

    Per sharpness x |mu| x N x d x seed: the operands of ``mechanism_operands`` (bf16 values) go
    to every real kernel as bf16 tensors (``kernel.forward`` / ``kernel.backward``, the registry's
    interface; SDPA kernels back-propagate through autograd) and to the emulator variants as in
    ``mechanism_grid``. Measured with ``gradient_errors`` against the fp64 gradients: median row
    dQ, dK, dV errors, the dQ error's alignment with mu, and the correlation over all elements of
    each real kernel's dQ error with each variant's. ``real_mech_status`` per (kernel, N, d): "ok",
    or the first reason it gave no gradients there ("unavailable: ...", "refused: ...",
    "out of memory: ..."); after a failure the kernel is skipped for the rest of that (N, d).
    """
    real = [kernels.get(name) for name in kernel_names]
    emulated = [variant_kernel(name, block_q, block_k) for name in variants]
    grid = (len(sharpness), len(mu_norms), len(seq_lens), len(head_dims), len(seeds))
    err = {m: np.full((len(real),) + grid, np.nan) for m in REAL_GRADS + ("dq_err_cos_mu",)}
    emu = {m: np.full((len(emulated),) + grid, np.nan) for m in REAL_GRADS}
    corr = np.full((len(real), len(emulated)) + grid, np.nan)
    status = np.full((len(real), len(seq_lens), len(head_dims)), "ok", dtype=object)
    for r, kernel in enumerate(real):
        reason = kernel.unavailable_reason(device)
        if reason:
            status[r] = f"unavailable: {reason}"
    low = FORMATS[REAL_FORMAT]
    work = [(c, n, e, d, f, seed, a, s, b, m) for c, n in enumerate(seq_lens) for e, d in enumerate(head_dims)
            for f, seed in enumerate(seeds) for a, s in enumerate(sharpness) for b, m in enumerate(mu_norms)]
    with torch_threads(threads):
        for c, n, e, d, f, seed, a, s, b, m in tqdm(work, desc="real kernels, mechanism grid",
                                                    disable=not progress):
            at = (a, b, c, e, f)
            q, k, v, do, mu = mechanism_operands(n, d, s, m, seed, heads=heads, device=device)
            gold = golden_values(q, k, v, do, golden_chunk)
            emu_dq_err = []
            for i, impl in enumerate(emulated):
                out, lse = impl.forward(q, k, v)
                grads = impl.backward(q, k, v, do, out=out, lse=lse)
                res = gradient_errors(grads, gold)
                for metric in REAL_GRADS:
                    emu[metric][(i,) + at] = res[metric]
                emu_dq_err.append(grads[0].double() - gold["dq"])
                del grads
            for r, kernel in enumerate(real):
                if status[r, c, e] != "ok":
                    continue
                operands = [t.to(low) for t in (q, k, v, do)]
                try:
                    out, lse = kernel.forward(*operands[:3])
                    stored = dict(out=out, lse=lse) if lse is not None else {}  # a forward the backward reads
                    grads = kernel.backward(*operands, **stored)
                    del out, lse, stored
                except (torch.OutOfMemoryError, RuntimeError, ValueError) as exc:  # recorded, never replaced
                    status[r, c, e] = _failure(exc)
                    continue
                res = gradient_errors(grads, gold)
                for metric in REAL_GRADS:
                    err[metric][(r,) + at] = res[metric]
                dq_err = grads[0].double() - gold["dq"]
                err["dq_err_cos_mu"][(r,) + at] = (_median(_row_cos(dq_err, mu)) if mu.abs().sum() > 0
                                                   else math.nan)
                for i, other in enumerate(emu_dq_err):
                    corr[(r, i) + at] = error_correlation(dq_err, other)
                del grads, dq_err
    dims = ("sharpness", "mu_norm", "real_seq_len", "real_head_dim", "seed")
    coords = {"real_kernel": list(kernel_names), "real_variant": list(variants),
              "sharpness": list(map(float, sharpness)), "mu_norm": list(map(float, mu_norms)),
              "real_seq_len": list(seq_lens), "real_head_dim": list(head_dims), "seed": list(seeds)}
    ds = xr.Dataset({f"real_mech_{m}": (("real_kernel",) + dims, err[m]) for m in err}, coords=coords)
    for m in REAL_GRADS:
        ds[f"real_mech_emulator_{m}"] = (("real_variant",) + dims, emu[m])
    ds["real_mech_dq_err_corr"] = (("real_kernel", "real_variant") + dims, corr)
    ds["real_mech_status"] = (("real_kernel", "real_seq_len", "real_head_dim"), status.astype(str))
    return ds


def dq_growth(ds: xr.Dataset, *, seq_len: int | None = None, head_dim: int | None = None):
    """Per sharpness: each real kernel's and each emulator variant's dQ error at the largest |mu|
    divided by its error at the smallest (|mu| = 0 on every tier; median over seeds), at
    ``seq_len`` / ``head_dim`` (default: the largest N and the first d of the real-kernel grid),
    with both errors beside the ratio (NaN for a kernel that gave no gradients)."""
    import pandas as pd

    at = dict(real_seq_len=int(ds["real_seq_len"][-1]) if seq_len is None else seq_len,
              real_head_dim=int(ds["real_head_dim"][0]) if head_dim is None else head_dim)
    low, top = float(ds["mu_norm"].min()), float(ds["mu_norm"].max())
    rows = []
    for var, dim, kind in (("real_mech_emulator_dq_err", "real_variant", "emulator"),
                           ("real_mech_dq_err", "real_kernel", "real")):
        da = ds[var].sel(**at).median("seed")
        for name in ds[dim].values:
            for s in ds["sharpness"].values:
                zero = float(da.sel({dim: name, "sharpness": s, "mu_norm": low}))
                big = float(da.sel({dim: name, "sharpness": s, "mu_norm": top}))
                rows.append({"kernel": f"{kind}: {name}", "sharpness": float(s), f"dQ err at |mu|={low:g}": zero,
                             f"dQ err at |mu|={top:g}": big, "growth": big / zero if zero > 0 else math.nan})
    return pd.DataFrame(rows).set_index(["kernel", "sharpness"])


def load_gpu_run(name: str = "gpu") -> xr.Dataset | None:
    """The committed CUDA run ``outputs/late_training_gradient_blowup/<name>/results.nc`` of this
    checkout, if present (None otherwise, or when it did not run on a CUDA device)."""
    from ..ncio import open_results
    from ..paths import project_root

    path = project_root() / "outputs" / "late_training_gradient_blowup" / name / "results.nc"
    if not path.exists():
        return None
    ds = open_results(path, squeeze_sweep_dims=True)
    return ds if "cuda" in str(ds.attrs.get("device", "")) else None


def real_kernel_summary(ds: xr.Dataset, *, emulator: str = "bf16", growth_at_least: float = 10.0):
    """One row per real kernel, from the real-kernel grid and the real-kernel diagnostic of a run:
    its status; its median row dQ error at the smallest and the largest |mu| (largest N, first d, the
    range over sharpness), its growth factor beside the emulator variant's on the same operands, whether
    it grows by at least ``growth_at_least`` at every sharpness; the median and the range over
    (sharpness, |mu| > 0, seed) of the correlation of its dQ error with the emulator's; and the FP32
    recompute diagnostic with it as the model's attention: its global relative L2 dQ error (largest over
    layers) without an offset and at the largest offset, the layers flagged without an offset, and the
    query/key projection gradient-norm ratio (largest over layers) without an offset."""
    import pandas as pd

    growth = dq_growth(ds)
    low, top = float(ds["mu_norm"].min()), float(ds["mu_norm"].max())
    at = dict(real_seq_len=int(ds["real_seq_len"][-1]), real_head_dim=int(ds["real_head_dim"][0]))
    rows = []
    for kernel in ds["real_kernel"].values:
        kernel = str(kernel)
        status = ds["real_mech_status"].sel(real_kernel=kernel).values.ravel()
        bad = [str(x) for x in status if str(x) != "ok"]
        g = growth.xs(f"real: {kernel}", level="kernel")
        e = growth.xs(f"emulator: {emulator}", level="kernel") if f"emulator: {emulator}" in growth.index.get_level_values(0) else None
        corr = ds["real_mech_dq_err_corr"].sel(real_kernel=kernel, real_variant=emulator, **at)
        corr = corr.where(corr["mu_norm"] > 0).values.ravel()
        corr = corr[np.isfinite(corr)]
        row = {"kernel": kernel, "status": "ok" if not bad else bad[0][:200],
               f"dQ err at |mu|={low:g}, min": g[f"dQ err at |mu|={low:g}"].min(),
               f"dQ err at |mu|={top:g}, max": g[f"dQ err at |mu|={top:g}"].max(),
               "growth min": g["growth"].min(), "growth max": g["growth"].max(),
               f"emulator {emulator} growth min": e["growth"].min() if e is not None else math.nan,
               f"emulator {emulator} growth max": e["growth"].max() if e is not None else math.nan,
               "grows": bool((g["growth"] >= growth_at_least).all()) if np.isfinite(g["growth"]).all() else None,
               f"corr with {emulator}, median": float(np.median(corr)) if corr.size else math.nan,
               f"corr with {emulator}, min": float(corr.min()) if corr.size else math.nan,
               f"corr with {emulator}, max": float(corr.max()) if corr.size else math.nan}
        if "real_diag_dq_rel_err" in ds:
            diag = ds["real_diag_dq_rel_err"].sel(real_kernel=kernel)
            offsets = ds["offset_norm"].values
            row.update({
                "diag status": str(ds["real_diag_status"].sel(real_kernel=kernel).values)[:200],
                "diag global rel. L2 dQ err, no offset (max layer)": float(diag.sel(offset_norm=0.0).max()),
                f"diag global rel. L2 dQ err, offset {offsets.max():g} (max layer)":
                    float(diag.sel(offset_norm=offsets.max()).max()),
                "diag layers flagged, no offset": int(ds["real_diag_flagged"].sel(real_kernel=kernel,
                                                                                  offset_norm=0.0).sum()),
                "diag q/k grad-norm ratio, no offset (max layer)":
                    float(ds["real_diag_grad_norm_qk_ratio"].sel(real_kernel=kernel, offset_norm=0.0).max()),
            })
        rows.append(row)
    return pd.DataFrame(rows).set_index("kernel")


def real_kernel_sentences(summary, *, emulator: str = "bf16") -> list[str]:
    """One sentence per real kernel built from ``real_kernel_summary``: does it show the dQ growth the
    emulator predicts, how its dQ error correlates with the emulator's, and what the diagnostic finds."""
    out = []
    cols = list(summary.columns)
    low_col = next(c for c in cols if c.startswith("dQ err at") and c.endswith("min"))
    top_col = next(c for c in cols if c.startswith("dQ err at") and c.endswith("max"))
    top_mu = top_col.split("=")[1].split(",")[0]
    for kernel, r in summary.iterrows():
        if not (np.isfinite(r["growth min"]) and np.isfinite(r["growth max"])):
            out.append(f"`{kernel}` gave no gradients at the largest N and first d of the grid"
                       + (f": {r['status']}." if r["status"] != "ok" else " at some sharpness (NaN error)."))
            continue
        verdict = "shows" if r["grows"] else "does not show"
        text = (f"`{kernel}` {verdict} the dQ growth: its median row dQ error goes from {r[low_col]:.2g} (smallest "
                f"over sharpness) at |mu| = 0 to {r[top_col]:.3g} (largest) at |mu| = {top_mu}, a growth of "
                f"{r['growth min']:.3g}x to {r['growth max']:.3g}x over sharpness (emulator `{emulator}`: "
                f"{r[f'emulator {emulator} growth min']:.3g}x to {r[f'emulator {emulator} growth max']:.3g}x); its dQ "
                f"error correlates with the emulator's at a median {r[f'corr with {emulator}, median']:.2f} "
                f"(range {r[f'corr with {emulator}, min']:.2f} to {r[f'corr with {emulator}, max']:.2f}, |mu| > 0).")
        if "diag status" in r and r["diag status"] == "ok":
            off_col = next(c for c in cols if c.startswith("diag global rel. L2 dQ err, offset"))
            text += (f" As the model's attention, the diagnostic finds a global relative L2 dQ error of "
                     f"{r['diag global rel. L2 dQ err, no offset (max layer)']:.3g} without an offset "
                     f"({int(r['diag layers flagged, no offset'])} layer(s) flagged; query/key gradient-norm ratio "
                     f"up to {r['diag q/k grad-norm ratio, no offset (max layer)']:.3g}) and "
                     f"{r[off_col]:.3g} at the largest offset.")
        elif "diag status" in r:
            text += f" The diagnostic could not run with it: {r['diag status']}."
        out.append(text)
    return out


def real_kernel_details(ds: xr.Dataset, *, emulator: str = "bf16", tolerance: float = 0.1):
    """Per real kernel, what ``real_kernel_summary`` leaves out, over the whole real-kernel grid (every
    sharpness, |mu|, N, d and seed): the ratio of its median row dQ error to the emulator variant's at the
    same point (min, max); its median row dQ error growth from |mu| = 0 to the largest |mu| within the
    mechanism grid's same-problem limit (``same_problem_limit`` at ``tolerance``, the smallest over its
    N and d, per sharpness; largest real N, first real d; min and max over sharpness) beside the
    emulator's; the median correlation of its dQ error with the emulator's at each head dimension
    (|mu| > 0); its largest median row dK and dV errors and their largest growth over |mu| = 0 at the same
    point; and, with it as the model's attention, the diagnostic's *median row* dQ error without an
    offset (largest over layers), the smallest offset at which a layer is flagged (by the global relative
    L2 dQ error; NaN: never) and the range of the query/key gradient-norm ratio over offsets and layers."""
    import pandas as pd

    low = float(ds["mu_norm"].min())
    emu = ds["real_mech_emulator_dq_err"].sel(real_variant=emulator)
    at = dict(real_seq_len=int(ds["real_seq_len"][-1]), real_head_dim=int(ds["real_head_dim"][0]))
    limit = (same_problem_limit(ds, tolerance).min([d for d in ("seq_len", "head_dim") if d in ds.dims])
             if "mech_exact_dq_shift" in ds else None)

    def growth_within(da):
        if limit is None:
            return math.nan, math.nan
        g = []
        for s in ds["sharpness"].values:
            top = float(limit.sel(sharpness=s))
            if not np.isfinite(top) or top <= low:
                continue
            e = da.sel(sharpness=s, **at).median("seed")
            g.append(float(e.sel(mu_norm=top) / e.sel(mu_norm=low)))
        g = [x for x in g if np.isfinite(x)]
        return (min(g), max(g)) if g else (math.nan, math.nan)

    def finite(x):
        x = np.asarray(x, dtype=float).ravel()
        return x[np.isfinite(x)]

    e_lo, e_hi = growth_within(emu)
    rows = []
    for kernel in ds["real_kernel"].values:
        kernel = str(kernel)
        real = ds.sel(real_kernel=kernel)
        ratio = finite(real["real_mech_dq_err"] / emu)
        g_lo, g_hi = growth_within(real["real_mech_dq_err"])
        row = {"kernel": kernel,
               f"dQ err / emulator {emulator}'s, min": ratio.min() if ratio.size else math.nan,
               f"dQ err / emulator {emulator}'s, max": ratio.max() if ratio.size else math.nan,
               "same-problem growth, min": g_lo, "same-problem growth, max": g_hi,
               f"emulator {emulator} same-problem growth, min": e_lo,
               f"emulator {emulator} same-problem growth, max": e_hi}
        cos = finite(real["real_mech_dq_err_cos_mu"].sel(mu_norm=float(ds["mu_norm"].max())))
        row["dQ err |cos| with mu at the largest |mu|, min"] = cos.min() if cos.size else math.nan
        corr = real["real_mech_dq_err_corr"].sel(real_variant=emulator)
        for d in ds["real_head_dim"].values:
            c = finite(corr.sel(real_head_dim=d).where(corr["mu_norm"] > 0))
            row[f"corr with {emulator}, median at d={int(d)}"] = float(np.median(c)) if c.size else math.nan
        for g in ("dk", "dv"):
            err = real[f"real_mech_{g}_err"]
            e = finite(err)
            gr = finite(err / err.sel(mu_norm=low))
            name = {"dk": "dK", "dv": "dV"}[g]
            row[f"{name} err, max"] = e.max() if e.size else math.nan
            row[f"{name} err growth over |mu|={low:g}, max"] = gr.max() if gr.size else math.nan
        if "real_diag_dq_row_rel_err" in ds:
            ok = str(ds["real_diag_status"].sel(real_kernel=kernel).values) == "ok"
            flagged = ds["real_diag_flagged"].sel(real_kernel=kernel).max("layer")
            offs = ds["offset_norm"].values[np.asarray(flagged.values) > 0]
            qk = finite(ds["real_diag_grad_norm_qk_ratio"].sel(real_kernel=kernel))
            row.update({
                "diag median row dQ err, no offset (max layer)":
                    float(ds["real_diag_dq_row_rel_err"].sel(real_kernel=kernel, offset_norm=0.0).max()) if ok
                    else math.nan,
                "diag smallest offset flagged": float(offs.min()) if ok and offs.size else math.nan,
                "diag q/k grad-norm ratio, min": qk.min() if ok and qk.size else math.nan,
                "diag q/k grad-norm ratio, max": qk.max() if ok and qk.size else math.nan,
                "diag model grad-norm ratio, largest |ratio - 1|":
                    float(abs(ds["real_diag_total_grad_norm_ratio"].sel(real_kernel=kernel) - 1).max()) if ok
                    else math.nan,
                "diag forward identical at every offset":
                    float(ds["real_diag_forward_identical"].sel(real_kernel=kernel).min()) if ok else math.nan})
        rows.append(row)
    return pd.DataFrame(rows).set_index("kernel")


def _span(lo: float, hi: float) -> str:
    return f"{lo:.3g}x" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}x to {hi:.3g}x"


def real_kernel_detail_sentences(details, *, emulator: str = "bf16") -> list[str]:
    """One sentence per real kernel from ``real_kernel_details`` (kernels without any gradients skipped):
    its dQ error beside the emulator's point by point, the growth up to the same-problem limit, the
    correlation per head dimension, dK and dV, and the diagnostic's median row dQ error and flagging."""
    out = []
    cols = list(details.columns)
    dk_growth = next(c for c in cols if c.startswith("dK err growth"))
    dv_growth = next(c for c in cols if c.startswith("dV err growth"))
    corr_cols = [c for c in cols if c.startswith(f"corr with {emulator}, median at d=")]
    for kernel, r in details.iterrows():
        lo, hi = r[f"dQ err / emulator {emulator}'s, min"], r[f"dQ err / emulator {emulator}'s, max"]
        if not (np.isfinite(lo) and np.isfinite(hi)):
            continue
        text = (f"`{kernel}`: median row dQ error {lo:.3g} to {hi:.3g} times the emulator `{emulator}`'s at the same "
                f"point, over the whole real-kernel grid")
        if np.isfinite(r["same-problem growth, min"]):
            text += (f"; from |mu| = 0 to the largest |mu| at which the exact dQ has not moved (section 1b's limit) "
                     f"it grows {_span(r['same-problem growth, min'], r['same-problem growth, max'])} over sharpness "
                     f"(emulator: {_span(r[f'emulator {emulator} same-problem growth, min'], r[f'emulator {emulator} same-problem growth, max'])})")
        text += (f"; at the largest |mu| the median over rows of |cos(row dQ error, mu)| is at least "
                 f"{r['dQ err |cos| with mu at the largest |mu|, min']:.3f} at every grid point (1: along mu)"
                 "; its dQ error correlates with the emulator's at a median "
                 + ", ".join(f"{r[c]:.2f} at {c.split('at ')[-1].replace('=', ' = ')}" for c in corr_cols)
                 + f" (|mu| > 0); its median row dK and dV errors stay at most {r['dK err, max']:.2g} and "
                   f"{r['dV err, max']:.2g} (at most {r[dk_growth]:.3g}x and {r[dv_growth]:.3g}x their value at "
                   f"|mu| = 0).")
        row_err = r.get("diag median row dQ err, no offset (max layer)", math.nan)
        if np.isfinite(row_err):
            first = r["diag smallest offset flagged"]
            flag = (f"a layer is first flagged (its global relative L2 error of dQ, dK or dV past the threshold) "
                    f"at a common key offset of {first:g}" if np.isfinite(first) else "no layer flagged at any offset")
            text += (f" In the diagnostic: median row dQ error {row_err:.3g} without an offset (largest over layers); "
                     f"{flag}; query/key gradient-norm ratio {r['diag q/k grad-norm ratio, min']:.3g} to "
                     f"{r['diag q/k grad-norm ratio, max']:.3g} over offsets and layers, the model's within "
                     f"{r['diag model grad-norm ratio, largest |ratio - 1|']:.2g} of 1; forward "
                     + ("bitwise identical in both passes at every offset."
                        if r["diag forward identical at every offset"] == 1 else "NOT identical in both passes."))
        out.append(text)
    return out


def trained_model_sentence(ds: xr.Dataset) -> str:
    """What the run's own training reached, as the real-kernel diagnostic's model: at the last checkpoint,
    without an offset, each layer's global relative L2 and median row dQ errors (the diagnostic of the
    trained emulated kernel), the checkpoints at which any layer is flagged without an offset, and each
    layer's largest attention logit at the last recorded step of the trained run."""
    last = int(ds["checkpoint"].values.max())
    no = ds.sel(offset_norm=0.0)
    glob = no["diag_dq_rel_err"].sel(checkpoint=last).values
    row = no["diag_dq_row_rel_err"].sel(checkpoint=last).values
    flagged = no["diag_flagged"].max("layer")
    at = [int(c) for c, f in zip(ds["checkpoint"].values, flagged.values) if f > 0]
    offsets = ds["offset_norm"].values
    first = offsets[ds["diag_flagged"].sel(checkpoint=last).max("layer").values > 0]
    top = ds["diag_dq_rel_err"].sel(checkpoint=last, offset_norm=offsets.max()).values
    logit = ds["train_max_logit"].sel(run="bf16").isel(step=-1).values
    fmt = lambda xs: ", ".join(f"{x:.3g}" for x in xs)
    return (f"the model this run trained, step {last} (layers {fmt(ds['layer'].values)}), with its trained emulated "
            f"kernel: without an offset a global relative L2 dQ error of {fmt(glob)} and a median row dQ error of "
            f"{fmt(row)}; a layer first flagged (global relative L2 error of dQ, dK or dV) at a common key offset of "
            + (f"{first.min():g}" if first.size else "none of the offsets")
            + f"; global relative L2 dQ error {fmt(top)} at the largest offset ({offsets.max():g}). A layer flagged "
              "without an offset at " + (f"checkpoints {at}" if at else f"none of the {ds['checkpoint'].size} "
                                                                         "checkpoints")
            + f"; largest attention logit at the last recorded step {fmt(logit)}")


TRAINING_PARAMS = ("task", "lm_loss", "context", "n_symbols", "n_layer", "n_head", "d_model", "train_attention",
                   "model_block", "steps", "batch_size", "lr", "warmup_steps", "weight_decay", "grad_clip",
                   "train_seed", "data_seed")


def same_training_sentence(ds: xr.Dataset, other: xr.Dataset) -> str | None:
    """When ``ds`` and ``other`` (two runs of this study, e.g. a CPU tier and the committed GPU run) trained the
    same model the same way (``TRAINING_PARAMS`` equal), how their BF16 runs compare: the largest relative
    difference of the loss over the first recorded steps, and each run's final loss; None otherwise."""
    import json

    p, q = (json.loads(x.attrs["parameters"]) if isinstance(x.attrs.get("parameters"), str)
            else dict(x.attrs.get("parameters", {})) for x in (ds, other))
    if not p or not q or any(p.get(k) != q.get(k) for k in TRAINING_PARAMS):
        return None
    a, b = (x["train_loss"].sel(run="bf16") for x in (ds, other))
    n = min(4, a.sizes["step"], b.sizes["step"])
    first = float(abs(a.isel(step=slice(0, n)).values / b.isel(step=slice(0, n)).values - 1).max())
    return (f"this run and the GPU run trained the same model the same way (same parameters, initial weights and "
            f"batches): their BF16 runs' losses over the first {n} recorded steps differ by at most {first:.1e} "
            f"(relative), their final losses are {float(a.isel(step=-1)):.4g} here and {float(b.isel(step=-1)):.4g} "
            f"on the GPU")


class InFormat(kernels.Kernel):
    """A kernel fed q, k, v and dO in ``fmt`` by an fp32 model, its output and gradients handed
    back in the model's format: a real kernel in the model the way the emulator's ``fa2_bf16``
    reads its operands (rounded by its ``inputs`` and ``grad_out`` stages), so the FP32
    recompute reads what the kernel read (``read_operands``). Without it an SDPA kernel in the
    fp32 model would run in fp32 (it reads q, k, v as given)."""

    def __init__(self, kernel: kernels.Kernel, fmt: str = REAL_FORMAT):
        self.inner, self.fmt, self.low = kernel, fmt, FORMATS[fmt]
        self.name = f"{kernel.name}+in={fmt}"
        self.gives_lse = kernel.gives_lse

    def unavailable_reason(self, device="cpu"):
        return self.inner.unavailable_reason(device)

    def read_operands(self, q, k, v, grad_out):
        return tuple(round_to(t.float(), self.fmt) for t in (q, k, v, grad_out))

    def _low(self, *ts):
        return [t.to(self.low) for t in ts]

    def forward(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        out, lse = self.inner.forward(*self._low(q, k, v), causal=causal, attn_bias=attn_bias, scale=scale)
        return out.to(q.dtype), lse

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        return self.inner.differentiable(*self._low(q, k, v), causal=causal, attn_bias=attn_bias,
                                         scale=scale).to(q.dtype)

    def backward(self, q, k, v, grad_out, *, causal=False, attn_bias=None, scale=None, out=None, lse=None,
                 stats=None):
        grads = self.inner.backward(*self._low(q, k, v, grad_out), causal=causal, attn_bias=attn_bias,
                                    scale=scale)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def real_kernel_diagnostics(result, model_cfg: GPTConfig, batch, kernel_names, offset_norms, *,
                            fmt: str = REAL_FORMAT, threshold: float = 0.1, seed: int = 0, device="cpu",
                            progress: bool = True, threads: int = 1) -> xr.Dataset:
    """The FP32 recompute diagnostic on the run's last checkpoint with every layer's attention a real
    kernel (``InFormat``: fed in ``fmt``), with the common key offsets of ``checkpoint_diagnostics``.
    The recompute reference is the FP32 emulator. ``real_diag_status``: "ok" or why not."""
    step = max(result.checkpoints)
    directions = _offset_vectors(model_cfg, seed)
    names = [n for n in DIAG_ATTRS if n != "threshold"]
    n_layer = model_cfg.n_layer
    data = {n: np.full((len(kernel_names), len(offset_norms), n_layer), np.nan) for n in names}
    status = np.full(len(kernel_names), "ok", dtype=object)
    real = [kernels.get(name) for name in kernel_names]
    work = [(r, o, norm) for r in range(len(real)) for o, norm in enumerate(offset_norms)]
    with torch_threads(threads):
        for r, o, norm in tqdm(work, desc="real-kernel diagnostics", disable=not progress):
            kernel = real[r]
            reason = kernel.unavailable_reason(device)
            if reason:
                status[r] = f"unavailable: {reason}"
            if status[r] != "ok":
                continue
            model = load_checkpoint(model_cfg, result.checkpoints[step], device=device)
            for layer, direction in enumerate(directions):
                add_key_offset(model, layer, direction.to(device) * float(norm))
            model.set_attention(InFormat(kernel, fmt))
            try:
                diag = recompute_backward_fp32(model, batch, threshold=threshold)
            except (torch.OutOfMemoryError, RuntimeError, ValueError) as exc:
                status[r] = _failure(exc)
                continue
            for n in names:
                data[n][r, o] = np.broadcast_to(diag[n].values, (n_layer,))
    dims = ("real_kernel", "offset_norm", "layer")
    ds = xr.Dataset({f"real_diag_{n}": (dims, data[n]) for n in names},
                    coords={"real_kernel": list(kernel_names), "offset_norm": list(map(float, offset_norms)),
                            "layer": list(range(n_layer))})
    for n in ("total_grad_norm_ratio", "forward_identical"):  # one value per model, not per layer
        ds[f"real_diag_{n}"] = ds[f"real_diag_{n}"].isel(layer=0, drop=True)
    ds["real_diag_status"] = ("real_kernel", status.astype(str))
    ds["real_diag_checkpoint"] = step
    return ds


# -- training and the diagnostic at checkpoints ---------------------------------------------------

def _offset_vectors(model_cfg: GPTConfig, seed: int) -> list[torch.Tensor]:
    """One unit vector per head and layer (shape (d_model,) per layer, each head's block of norm 1)."""
    gen = generator(seed + 11_000_027)
    return [torch.cat([unit_vector(model_cfg.head_dim, gen) for _ in range(model_cfg.n_head)]).float()
            for _ in range(model_cfg.n_layer)]


def checkpoint_diagnostics(result, model_cfg: GPTConfig, batch, offset_norms, *, threshold: float = 0.1,
                           seed: int = 0, device="cpu", progress: bool = True, threads: int = 1) -> xr.Dataset:
    """The FP32 recompute diagnostic at every checkpoint of a run, with a common key offset of each norm
    in ``offset_norms`` added to every head of every layer (0: the checkpoint as trained)."""
    steps = sorted(result.checkpoints)
    directions = _offset_vectors(model_cfg, seed)
    parts = []
    work = [(step, norm) for step in steps for norm in offset_norms]
    with torch_threads(threads):
        for step, norm in tqdm(work, desc="diagnostics", disable=not progress):
            model = load_checkpoint(model_cfg, result.checkpoints[step], device=device)
            for layer, direction in enumerate(directions):
                add_key_offset(model, layer, direction.to(device) * float(norm))
            diag = recompute_backward_fp32(model, batch, threshold=threshold)
            with torch.no_grad():
                for attn in model.attention_modules():
                    attn.record_stats = True
                _, loss = model(*batch)
                key_mean = [attn.stats["key_mean_norm"] for attn in model.attention_modules()]
                for attn in model.attention_modules():
                    attn.record_stats = False
            diag["key_mean_norm"] = ("layer", key_mean)
            diag["loss"] = loss.item()
            parts.append(diag.expand_dims(checkpoint=[step], offset_norm=[float(norm)]))
    ds = xr.combine_by_coords(parts, combine_attrs="drop_conflicts")
    ds = ds.rename({name: f"diag_{name}" for name in ds.data_vars})
    return ds


def level_crossing(da: xr.DataArray, dim: str, level: float) -> xr.DataArray:
    """The value of coordinate ``dim`` at which ``da`` first reaches ``level``, by log-log
    interpolation between neighbouring points with dim > 0 (NaN when it never does, or
    already does at the first positive point)."""
    x_all = da[dim].values.astype(float)

    def crossing(vals):
        ok = (x_all > 0) & np.isfinite(vals) & (vals > 0)
        x, y = np.log(x_all[ok]), np.log(vals[ok])
        above = np.nonzero(y >= math.log(level))[0]
        if not len(above) or above[0] == 0:
            return math.nan
        i = above[0]
        t = (math.log(level) - y[i - 1]) / (y[i] - y[i - 1])
        return float(np.exp(x[i - 1] + t * (x[i] - x[i - 1])))

    out = xr.apply_ufunc(crossing, da, input_core_dims=[[dim]], vectorize=True)
    out.attrs.update(units="1", long_name=f"{dim} at which {da.name} reaches {level:g}")
    return out


def spike_table(ds: xr.Dataset):
    """The diagnostic at every gradient-norm spike of the trained run: one row per spike step."""
    import pandas as pd

    spikes = ds["diag_step"].values[ds["live_spike"].values == 1]
    sub = ds.sel(diag_step=spikes)
    table = pd.DataFrame({"gradient norm": sub["live_grad_norm_total"].values,
                          "model ratio (as run / FP32 bwd)": sub["live_total_grad_norm_ratio"].values},
                         index=pd.Index(spikes, name="step"))
    for layer in ds["layer"].values:
        table[f"layer {layer} ratio"] = sub["live_grad_norm_ratio"].sel(layer=layer).values
        table[f"layer {layer} dQ global rel. L2 err"] = sub["live_dq_rel_err"].sel(layer=layer).values
    return table


BF16_FLASH_VARIANTS = ("fp32_ds_bf16", "bf16_bwd_fp32", "bf16", "bf16_fused")


def gap_below_bf16(ds: xr.Dataset, variant: str, var: str = "mech_dq_err") -> float:
    """The smallest factor, over every grid point, by which each BF16 flash variant's error exceeds
    ``variant``'s (below 1: somewhere a BF16 flash variant is more accurate)."""
    present = [v for v in BF16_FLASH_VARIANTS if v in ds["variant"].values]
    if variant not in ds["variant"].values or not present:
        return math.nan
    return float((ds[var].sel(variant=present).min("variant") / ds[var].sel(variant=variant)).min())


def spread_over_sizes(ds: xr.Dataset, variant: str, var: str = "mech_dq_err") -> float:
    """The largest ratio, at one (sharpness, |mu| > 0, seed), between the errors of two (N, d) points."""
    da = ds[var].sel(variant=variant).where(ds["mu_norm"] > 0)
    spread = da.max(["seq_len", "head_dim"]) / da.min(["seq_len", "head_dim"])
    return float(spread.max())


def training_summary(ds: xr.Dataset, trained: str = "bf16", baseline: str = "fp32", late_fraction: float = 0.5):
    """One row per run pair: final losses, the loss gap, and the late-training ratio of global
    gradient norms (trained / baseline; median and max over the last ``late_fraction`` of steps)."""
    import pandas as pd

    steps = ds["step"].values
    late = steps >= steps[0] + (1 - late_fraction) * (steps[-1] - steps[0])
    ratio = (ds["train_grad_norm_total"].sel(run=trained) / ds["train_grad_norm_total"].sel(run=baseline)).values[late]
    final = lambda run: float(ds["train_loss"].sel(run=run).isel(step=slice(-10, None)).mean())
    ratio_all = (ds["train_grad_norm_total"].sel(run=trained) / ds["train_grad_norm_total"].sel(run=baseline)).values
    return pd.DataFrame([{
        f"final loss {trained}": final(trained), f"final loss {baseline}": final(baseline),
        "loss gap (nat)": final(trained) - final(baseline),
        "late grad-norm ratio, median": float(np.nanmedian(ratio)),
        "late grad-norm ratio, max": float(np.nanmax(ratio)),
        "grad-norm ratio, max over all steps": float(np.nanmax(ratio_all)),
    }])


# -- figures --------------------------------------------------------------------------------------


# -- gpu_training tier (issue 13): the GPU training campaign's records -----------------------------

GPU_PREFIX = "s04_"  # campaign runs of this study (params/lm/campaign.yaml); records lm_s04_*_s<seed>_d<seed>.nc
GPU_PATTERN = f"lm_{GPU_PREFIX}*.nc"
GPU_DQ_METRIC = "dq_rel_err"  # the main dQ metric of the records (attnum.lm.record.VARIABLES says what it is)
GPU_SERIES = ("loss", "val_loss", "grad_norm", "grad_norm_layer", "grad_norm_qk", "key_mean_norm", "key_norm",
              "key_mean_ratio", "offset_logit", "max_logit", "entropy", "max_prob", "dq_rel_err", "dq_row_rel_err",
              "dk_rel_err", "dv_rel_err", "grad_norm_ratio", "lr", "step_time_s", "tokens_per_s", "elapsed_s",
              "attn_fwd_s", "attn_fwd_bwd_s", "nonfinite_step", "attention_share", "steps_done", "tokens_done",
              "wall_s")
GPU_GROWTH = 2.0  # "the dQ error grew late": its last-fifth / first-fifth mean over layers above this
GPU_LOSS_RISE = 1.5  # "the loss blew up" without becoming non-finite: a logged loss above this x its running minimum
GPU_VAL_RISE = 0.05  # "memorising": the last validation loss above (1 + this) x its minimum, training loss still falling
GPU_SETTING = (("lr", "lr"), ("clip", "clip"), ("weight_decay", "weight decay"), ("seed", "seed"),
               ("data_seed", "data seed"))  # runs compared at equal steps share these parameters
GPU_ATTRS = {
    "loss_rise": ("1", "largest ratio of a logged training loss to the lowest loss logged before it (above 1: the "
                       "loss rose)"),
    "blowup": ("1", "1 if the training loss became non-finite or rose above GPU_LOSS_RISE x its running minimum"),
    "max_key_mean_ratio": ("1", "largest norm of the mean key / mean key norm over steps and layers"),
    "max_offset_spread": ("1", "largest r / sqrt(1 - r^2) over steps and layers, r = key_mean_ratio: the common key "
                               "offset over the keys' spread about it (|mu| / sqrt(d) for the grid's keys)"),
    "campaign_gpu_s": ("s", "GPU time of the gathered records: the sum of their wall_s (whole command from "
                            "process start)"),
    "campaign_all_gpu_s": ("s", "GPU time of every record in the folder (both studies' runs and the pilot): the sum "
                                "of their wall_s"),
    "grid_mu_at_level": ("1", "|mu| at which the mechanism grid's median row dQ error (bf16 flash emulator) "
                              "reaches the level"),
    "grid_offset_spread_at_level": ("1", "the grid's |mu| / sqrt(d) at that |mu|: the key offset over the keys' "
                                         "spread about it (keys i.i.d. N(0, 1) plus mu)"),
    "grid_dq_err_no_offset": ("1", "the mechanism grid's median row dQ error at |mu| = 0 (same variant and point)"),
}


def check_gpu_records(folder):
    """The records folder, or a FileNotFoundError naming what is missing (before any work)."""
    from ..lm import record

    return record.require_records(folder, GPU_PATTERN, record.campaign_runs(GPU_PREFIX),
                                  "for study 04 (late_training_gradient_blowup)")


def _loss_rise(loss: np.ndarray) -> float:
    loss = np.asarray(loss, dtype=float)
    best, worst = math.inf, math.nan
    for value in loss:
        if not math.isfinite(value):
            continue
        if math.isfinite(best) and best > 0:
            worst = max(worst, value / best) if math.isfinite(worst) else value / best
        best = min(best, value)
    return worst


def grid_regime(mech: xr.Dataset | None, level: float = 0.1, *, context: int = 1024) -> dict:
    """Where the mechanism grid (``mech_dq_err``, a run of this study's grid, e.g. the committed
    ``gpu`` run) puts the start of the blowup regime: the |mu| at which the bf16 flash emulator's
    median row dQ error reaches ``level`` at the first sharpness, the N nearest ``context`` and the
    grid's first d; NaNs without a grid."""
    nan = {"grid_mu_at_level": math.nan, "grid_offset_spread_at_level": math.nan, "grid_dq_err_no_offset": math.nan,
           "grid_point": "no mechanism grid"}
    if mech is None or "mech_dq_err" not in mech:
        return nan
    variant = "bf16_fused" if "bf16_fused" in mech["variant"].values else "bf16"
    n = mech["seq_len"].values
    seq = int(n[np.argmin(np.abs(np.log(n / context)))])
    sub = mech["mech_dq_err"].sel(variant=variant, seq_len=seq).isel(sharpness=0, head_dim=0).median("seed")
    d = int(mech["head_dim"].values[0])
    mu = float(level_crossing(sub.rename("mech_dq_err"), "mu_norm", level))
    no_offset = float(sub.sel(mu_norm=0.0)) if 0.0 in sub["mu_norm"].values else math.nan
    return {"grid_mu_at_level": mu, "grid_offset_spread_at_level": mu / math.sqrt(d), "grid_dq_err_no_offset": no_offset,
            "grid_point": f"{variant}, sharpness {float(mech['sharpness'][0]):g}, N = {seq}, d = {d}, "
                          f"{mech.attrs.get('device', '?')}, commit {str(mech.attrs.get('git_commit', '?'))[:12]}"}


def gpu_training_dataset(folder, mech: xr.Dataset | None = None, level: float = 0.1) -> xr.Dataset:
    """This study's GPU training records under ``folder`` gathered (``attnum.lm.record.gather``: one
    ``run`` per record, outer join on steps), the per-layer series kept (no weight sketches),
    ``record.summary``'s numbers as ``sum_*`` per run and member, the loss rise and blowup flag, the
    records' own provenance as ``prov_*`` coordinates, the campaign's GPU time and, from ``mech``
    (a run with the mechanism grid), where the grid puts the blowup regime (``grid_*``)."""
    import json

    from ..lm import record

    folder = check_gpu_records(folder)
    gathered = record.gather(folder, GPU_PATTERN)
    out = gathered[[v for v in GPU_SERIES if v in gathered]]
    out = out.drop_dims([d for d in ("tensor", "sketch", "snapshot") if d in out.dims], errors="ignore")
    table = record.summary(gathered)
    for name in table.data_vars:
        out[f"sum_{name}"] = table[name]
    rise = xr.apply_ufunc(_loss_rise, gathered["loss"], input_core_dims=[["step"]], vectorize=True)
    out["sum_loss_rise"] = rise
    out["sum_blowup"] = ((table["diverged"] == 1) | (rise > GPU_LOSS_RISE)).astype(float).where(
        table["diverged"].notnull())
    ratio = gathered["key_mean_ratio"].isel(step=slice(1, None))
    out["sum_max_key_mean_ratio"] = ratio.max(("step", "layer"))
    out["sum_max_offset_spread"] = _offset_over_spread(ratio).max(("step", "layer"))
    out["campaign_gpu_s"] = float(gathered["wall_s"].sum())
    out["campaign_all_gpu_s"], out.attrs["records_in_folder"] = record.total_wall_s(folder)
    regime = grid_regime(mech, level)
    for key in ("grid_mu_at_level", "grid_offset_spread_at_level", "grid_dq_err_no_offset"):
        out[key] = regime[key]
    out.attrs["grid_point"] = regime["grid_point"]
    out.attrs["grid_level"] = level
    out = out.assign_coords(record.provenance(folder, GPU_PATTERN).coords)
    out.attrs["records_folder"] = str(folder)
    out.attrs["records"] = json.dumps(sorted(str(r) for r in out["run"].values))
    out.attrs["missing_runs"] = json.dumps(record.missing_runs(folder, record.campaign_runs(GPU_PREFIX)))
    for name, (units, long_name) in GPU_ATTRS.items():
        for var in (name, f"sum_{name}"):
            if var in out:
                out[var].attrs.update(units=units, long_name=long_name)
    return out


def _offset_over_spread(ratio):
    """The common key offset over the keys' spread about it, r / sqrt(1 - r^2) for r = key_mean_ratio (the mean
    key's norm over the mean key norm), the measure the mechanism grid's |mu| / sqrt(d) is set against."""
    return ratio / np.sqrt(np.clip(1 - ratio ** 2, 1e-300, None))


def _kernel_of(ds: xr.Dataset, run: str, member: str = "a") -> str:
    return str(ds["member_attention"].sel(run=run, member=member).values)


def gpu_training_table(ds: xr.Dataset):
    """One row per run and trained member: what it reached (``record.summary``) and its setting."""
    import json

    import pandas as pd

    rows = []
    for run in ds["run"].values:
        params = json.loads(str(ds["run_parameters"].sel(run=run).values))
        for member in ds["member"].values:
            if not np.isfinite(float(ds["sum_tokens_done"].sel(run=run))) or \
                    not np.isfinite(float(ds["sum_final_loss"].sel(run=run, member=member))):
                continue
            s = lambda k: float(ds[f"sum_{k}"].sel(run=run, **({"member": member} if "member" in ds[f"sum_{k}"].dims
                                                                 else {})))
            rows.append({"run": str(run), "member": str(member), "attention": _kernel_of(ds, run, member),
                         "lr": float(params["lr"]), "clip": float(params["clip"]),
                         "weight decay": float(params["weight_decay"]), "tokens": s("tokens_done"),
                         "final loss": s("final_loss"), "min val loss": s("min_val_loss"),
                         "min val loss step": _step_or_nan(s("min_val_loss_step")),
                         "final val loss": s("final_val_loss"),
                         "passes": s("train_passes"),
                         "loss rise": s("loss_rise"), "diverged": s("diverged"),
                         f"{GPU_DQ_METRIC} growth": s("dq_err_growth"), f"max {GPU_DQ_METRIC}": s("max_dq_rel_err"),
                         "max dq_row_rel_err": s("max_dq_row_rel_err"), "max key_mean_norm": s("max_key_mean_norm"),
                         "max key_mean_ratio": s("max_key_mean_ratio"), "max offset/spread": s("max_offset_spread"),
                         "max offset_logit": s("max_offset_logit"),
                         "max max_prob": s("max_max_prob"), "max grad norm": s("max_grad_norm"),
                         "tokens/s": float(ds["sum_median_tokens_per_s"].sel(run=run)),
                         "attention share": float(ds["attention_share"].sel(run=run)),
                         "wall s": float(ds["wall_s"].sel(run=run))})
    return pd.DataFrame(rows).set_index(["run", "member"])


def _step_or_nan(step: float):
    return int(step) if math.isfinite(step) else math.nan


def _family(attention: str) -> str:
    if "gproj" in attention:
        return "GProj"
    if attention.startswith("sdpa:math") and attention.endswith("@fp32"):
        return "FP32"
    if attention.startswith("sdpa:flash"):
        return "sdpa:flash"
    return attention


def gpu_training_sentences(ds: xr.Dataset) -> list[str]:
    """Issue 13 section 3's questions answered from the gathered records (every number computed)."""
    import json

    table = gpu_training_table(ds)
    out = []
    gpus = sorted(set(str(g) for g in ds["prov_version_gpu"].values))
    missing = json.loads(ds.attrs.get("missing_runs", "[]"))
    out.append(f"**Campaign.** {len(ds['run'])} record(s) of this study ({', '.join(map(str, ds['run'].values))}) on "
               f"{', '.join(gpus)}; GPU time {float(ds['campaign_gpu_s']):.0f} s for these records and "
               f"{float(ds['campaign_all_gpu_s']):.0f} s for all {int(ds.attrs.get('records_in_folder', 0))} records "
               "of the folder, the whole campaign (sums of the records' "
               f"wall_s, each the whole training command from process start)"
               + (f"; campaign runs without a record here: {', '.join(missing)}." if missing else
                  "; every campaign run of this study has a record."))
    out.append(gpu_throughput_sentence(ds))
    growth_col = table[f"{GPU_DQ_METRIC} growth"]
    grew = table[growth_col > GPU_GROWTH]
    known = int(np.isfinite(growth_col).sum())
    growth = ", ".join(f"{r} ({a}): {_growth_words(g, e, a)}" for (r, _), a, g, e in
                       zip(table.index, table["attention"], growth_col, table[f"max {GPU_DQ_METRIC}"]))
    out.append(f"**Does the dQ error grow late?** The dQ metric is `{GPU_DQ_METRIC}`, the relative L2 error of the "
               f"kernel's dQ against the FP32 recompute on the same operands, per layer on the fixed diagnostic "
               f"batch; its growth is the mean over layers in the last fifth of the logged steps over the first "
               f"fifth (step 0 left out): {growth}. "
               + (f"It grew more than {GPU_GROWTH:g}x in {len(grew)} of the {known} trained members with a growth "
                  f"({', '.join(f'{r}/{m}' for r, m in grew.index)})." if len(grew) else
                  f"In none of the {known} trained member(s) with a growth (five logged steps or more) did the "
                  f"layer mean grow more than {GPU_GROWTH:g}x; by layer, see below." if known else
                  "No member logged the five steps a growth needs: the question stays open."))
    fam = table["attention"].map(_family)
    blew = (table["diverged"] == 1) | (table["loss rise"] > GPU_LOSS_RISE)
    by = {f: bool(blew[fam == f].any()) for f in sorted(set(fam))}
    flash_only = by.get("sdpa:flash", False) and not by.get("FP32", False) and not by.get("GProj", False)
    out.append("**Does the loss diverge with sdpa:flash and not with FP32 attention or GProj?** A run blows up when "
               "its "
               f"training loss becomes non-finite or rises above {GPU_LOSS_RISE:g}x its running minimum. "
               + "; ".join(f"{f}: {'blew up' if b else 'no blowup'} ({int((fam == f).sum())} member(s))"
                           for f, b in by.items()) + ". "
               + ("So the pattern of the sources appears: sdpa:flash blows up, FP32 attention and GProj do not "
                  "(as far as they were run)." if flash_only else
                  "So the sources' pattern (sdpa:flash blows up, FP32 and GProj do not) does not appear here."
                  if any(by.values()) else "Nothing blew up within the budget."))
    if not blew.any():
        mu, ratio = float(ds["grid_mu_at_level"]), float(ds["grid_offset_spread_at_level"])
        level = float(ds.attrs.get("grid_level", 0.1))
        reached = float(table["max offset/spread"].max())
        err = float(table["max dq_row_rel_err"].max())
        bound = (f"**The bound.** The longest run trained {table['tokens'].max():.3g} tokens per model; the "
                 f"largest common key offset reached is key_mean_norm {table['max key_mean_norm'].max():.3g} "
                 f"(offset over the keys' spread about it, r / sqrt(1 - r^2) with r = key_mean_ratio, {reached:.3g}; "
                 f"score shift offset_logit "
                 f"{table['max offset_logit'].max():.3g}), the largest median row dQ error against the FP32 "
                 f"recompute (dq_row_rel_err) {err:.3g} and the largest {GPU_DQ_METRIC} "
                 f"{table[f'max {GPU_DQ_METRIC}'].max():.3g}. ")
        if math.isfinite(mu):
            bound += (f"The mechanism grid ({ds.attrs.get('grid_point', '')}) reaches a median row dQ error of "
                      f"{level:g} at |mu| = {mu:.3g}, an offset over spread |mu| / sqrt(d) of {ratio:.3g} "
                      f"(its error without offset: {float(ds['grid_dq_err_no_offset']):.3g}): the runs' offsets "
                      + (f"stayed {ratio / reached:.3g}x below that ratio" if reached < ratio else
                         f"reached {reached / ratio:.3g}x that ratio")
                      + (f" and their row dQ errors {level / err:.3g}x below that level." if 0 < err < level else
                         f" and their row dQ errors reached {err / level:.3g}x that level." if err >= level else "."))
        else:
            bound += "No mechanism grid in this checkout to set them against (the committed `gpu` run is absent)."
        out.append(bound)
    out.extend(gpu_layer_sentences(ds))
    out.append(gpu_dq_pass_sentence(ds))
    out.extend(gpu_pass_setting_sentences(ds))
    out.extend(gpu_equal_step_sentences(ds))
    out.extend(gpu_offset_sentences(ds))
    out.append(gpu_memorisation_sentence(ds))
    return out


def gpu_layer_growth(ds: xr.Dataset):
    """Per run, trained member and layer: how the dQ error, the common key offset and the sharpness moved
    late in training. Windows over the logged steps (step 0 left out, steps where every layer has a dQ
    error): *mid* is the fifth of them that ends at the middle, *end* the last fifth; each growth is the
    mean over *end* over the mean over *mid*. ``late_corr`` is the correlation over the second half of the
    logged steps of log dq_rel_err with log key_mean_norm in that layer (the mechanism: dQ error in
    proportion to the mean key). Members whose dQ error is 0 throughout (FP32 attention) and members with
    fewer than ten such steps are left out. Columns also give the *end* window's key_mean_norm,
    key_mean_ratio and dq_rel_err, and the window bounds."""
    import pandas as pd

    rows = []
    steps = ds["step"].values
    for run in ds["run"].values:
        for member in ds["member"].values:
            at = dict(run=run, member=member)
            err = ds["dq_rel_err"].sel(**at).transpose("step", "layer").values
            key = ds["key_mean_norm"].sel(**at).transpose("step", "layer").values
            ratio = ds["key_mean_ratio"].sel(**at).transpose("step", "layer").values
            sharp = ds["max_prob"].sel(**at).transpose("step", "layer").values
            ok = (steps > 0) & np.isfinite(err).all(1) & np.isfinite(key).all(1)
            if ok.sum() < 10 or not (err[ok] > 0).any():
                continue
            err, key, ratio, sharp, st = err[ok], key[ok], ratio[ok], sharp[ok], steps[ok]
            n = len(st)
            k = max(1, n // 5)
            mid, end, half = slice(n // 2 - k, n // 2), slice(n - k, n), slice(n // 2, n)
            grow = lambda a: a[end].mean(0) / a[mid].mean(0)  # noqa: E731
            g_err, g_key, g_sharp = grow(err), grow(key), grow(sharp)
            for layer in range(err.shape[1]):
                e, kk = err[half, layer], key[half, layer]
                good = (e > 0) & (kk > 0)
                corr = (float(np.corrcoef(np.log(e[good]), np.log(kk[good]))[0, 1])
                        if good.sum() >= 3 and np.std(np.log(e[good])) > 0 and np.std(np.log(kk[good])) > 0
                        else math.nan)
                rows.append({"run": str(run), "member": str(member), "layer": layer,
                             "attention": _kernel_of(ds, run, member),
                             "dq growth": float(g_err[layer]), "key offset growth": float(g_key[layer]),
                             "max_prob growth": float(g_sharp[layer]), "late_corr": corr,
                             "end key_mean_norm": float(key[end, layer].mean()),
                             "end key_mean_ratio": float(ratio[end, layer].mean()),
                             "end dq_rel_err": float(err[end, layer].mean()),
                             "mid steps": f"{int(st[mid][0])}-{int(st[mid][-1])}",
                             "end steps": f"{int(st[end][0])}-{int(st[end][-1])}"})
    columns = ["run", "member", "layer", "attention", "dq growth", "key offset growth", "max_prob growth",
               "late_corr", "end key_mean_norm", "end key_mean_ratio", "end dq_rel_err", "mid steps", "end steps"]
    return pd.DataFrame(rows, columns=columns).set_index(["run", "member", "layer"])


def gpu_layer_sentences(ds: xr.Dataset) -> list[str]:
    """Section 10's by-layer answer (``gpu_layer_growth``): the layer whose dQ error grew most late in
    each trained member, with its key offset and sharpness, and how the two growths go together across
    layers. Every number computed."""
    table = gpu_layer_growth(ds)
    if not len(table):
        return ["**By layer.** No trained member has ten logged steps with a non-zero dQ error: nothing to say "
                "by layer."]
    out = []
    for (run, member), sub in table.groupby(level=["run", "member"], sort=False):
        sub = sub.droplevel(["run", "member"])
        top = int(sub["dq growth"].idxmax())
        row = sub.loc[top]
        grew = sub.index[sub["dq growth"] > GPU_GROWTH].tolist()
        lg_err, lg_key = np.log(sub["dq growth"].values), np.log(sub["key offset growth"].values)
        across = (float(np.corrcoef(lg_err, lg_key)[0, 1]) if len(sub) >= 3 and np.std(lg_err) > 0
                  and np.std(lg_key) > 0 else math.nan)
        text = (f"{run} ({row['attention']}): from mid-run (steps {row['mid steps']}) to the end (steps "
                f"{row['end steps']}) the dQ error grew most in layer {top}, {row['dq growth']:.3g}x (to "
                f"{GPU_DQ_METRIC} {row['end dq_rel_err']:.3g}), while that layer's common key offset grew "
                f"{row['key offset growth']:.3g}x (to key_mean_norm {row['end key_mean_norm']:.3g}, key_mean_ratio "
                f"{row['end key_mean_ratio']:.3g}) and its sharpness (max_prob) {row['max_prob growth']:.3g}x; over "
                f"the second half of the run that layer's log dQ error and log key offset correlate at "
                f"{row['late_corr']:.2f}. ")
        text += (f"The dQ error grew more than {GPU_GROWTH:g}x late in {len(grew)} of {len(sub)} layers (layer"
                 f"{'s' if len(grew) > 1 else ''} {', '.join(map(str, grew))}). " if grew else
                 f"No layer's dQ error grew more than {GPU_GROWTH:g}x late. ")
        if math.isfinite(across):
            text += (f"Across the {len(sub)} layers, the late growth of the dQ error and of the key offset "
                     f"correlate at {across:.2f} (logs).")
        out.append(text)
    return ["**By layer** (the layer mean above can hide one layer): " + " ".join(out)]


def _growth_words(growth: float, max_err: float, attention: str) -> str:
    if math.isfinite(growth):
        return f"{growth:.3g}x"
    if max_err == 0 and _family(attention) == "FP32":
        return ("no growth: its dQ error is 0 at every logged step, because the diagnostic recomputes this kernel "
                "itself (FP32 attention)")
    if max_err == 0:
        return "no growth: its dQ error is 0 at every logged step (the kernel agrees exactly with the FP32 recompute)"
    return "no growth computed (fewer than five logged steps with an error, or an error of 0 at first)"


def gpu_throughput_sentence(ds: xr.Dataset) -> str:
    """Each run's median tokens per second and the attention share of its step (``record.VARIABLES``
    says how the share is estimated), and how far apart the runs' throughputs are."""
    rate = {str(r): float(ds["sum_median_tokens_per_s"].sel(run=r)) for r in ds["run"].values}
    share = {str(r): float(ds["attention_share"].sel(run=r)) for r in ds["run"].values}
    steps = {str(r): int(ds["steps_done"].sel(run=r)) for r in ds["run"].values}
    each = "; ".join(f"{r} ({_kernel_of(ds, r)}): {rate[r]:.3g} tokens/s, attention share "
                     + (f"{share[r]:.2g}" if math.isfinite(share[r]) else "not timed")
                     + f", {steps[r]} steps in {float(ds['wall_s'].sel(run=r)):.0f} s" for r in rate)
    finite = [v for v in rate.values() if math.isfinite(v) and v > 0]
    spread = (f" The fastest run trained {max(finite) / min(finite):.3g}x the tokens per second of the slowest, so "
              "runs with the same budget stop at different steps (compared at equal steps below)."
              if len(finite) > 1 else "")
    return ("**Throughput and the share of the step in attention.** Median tokens (bytes) per second over the "
            "logged intervals, and the attention share: the number of layers times the median time of one "
            "attention forward and backward alone (timed before training on random operands of the training "
            "shape, in the kernel's own format, causal; summed over a pair's members), over the run's median "
            "step time. It is an estimate "
            "from attention timed outside the model, not a profile of the training step. " + each + "." + spread)


def _setting_of(ds: xr.Dataset, run) -> str:
    import json

    params = json.loads(str(ds["run_parameters"].sel(run=run).values))
    return ", ".join(f"{label} {params.get(key)!s}" for key, label in GPU_SETTING)


def _trained_members(ds: xr.Dataset, run) -> list[str]:
    return [str(m) for m in ds["member"].values
            if np.isfinite(ds["loss"].sel(run=run, member=m).values[1:]).any()]


def _settings(ds: xr.Dataset) -> dict[str, list[tuple[str, str]]]:
    """The trained (run, member) pairs grouped by setting (``GPU_SETTING``), in record order."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for run in ds["run"].values:
        for member in _trained_members(ds, run):
            groups.setdefault(_setting_of(ds, run), []).append((str(run), member))
    return groups


def _common_logged_steps(ds: xr.Dataset, members) -> np.ndarray:
    """The logged steps > 0 at which every one of ``members`` ((run, member) pairs) has a training loss."""
    steps = ds["step"].values
    logged = np.all([np.isfinite(ds["loss"].sel(run=r, member=m).values) for r, m in members], axis=0)
    return steps[logged & (steps > 0)]


def gpu_equal_step_table(ds: xr.Dataset):
    """The runs of one setting (``GPU_SETTING``: same learning rate, clipping, weight decay, seeds) at
    the largest logged step every one of their trained members reached (runs with one budget stop at
    different steps): training loss of that row, the last validation loss at or before it, the mean
    over layers of key_mean_norm, max_prob and dq_rel_err, and the model's gradient norm. Settings
    with a single run are left out."""
    import pandas as pd

    steps = ds["step"].values
    rows = []
    for setting, members in _settings(ds).items():
        if len({r for r, _ in members}) < 2:
            continue
        logged = _common_logged_steps(ds, members)
        if not len(logged):
            continue
        common = int(logged[-1])
        for run, member in members:
            one = ds.sel(run=run, member=member)
            val = one["val_loss"].sel(step=slice(None, common)).dropna("step")
            layer_mean = lambda k: float(one[k].sel(step=common).mean("layer"))
            rows.append({"run": run, "member": member, "setting": setting, "attention": _kernel_of(ds, run, member),
                         "common step": common, "last step": int(steps[np.isfinite(one["loss"].values)][-1]),
                         "train loss": float(one["loss"].sel(step=common)),
                         "val loss": float(val[-1]) if val.size else math.nan,
                         "val step": int(val["step"][-1]) if val.size else -1,
                         "key_mean_norm": layer_mean("key_mean_norm"), "max_prob": layer_mean("max_prob"),
                         GPU_DQ_METRIC: layer_mean(GPU_DQ_METRIC),
                         "grad norm": float(one["grad_norm"].sel(step=common))})
    columns = ["setting", "attention", "common step", "last step", "train loss", "val loss", "val step",
               "key_mean_norm", "max_prob", GPU_DQ_METRIC, "grad norm"]
    if not rows:
        return pd.DataFrame(columns=columns, index=pd.MultiIndex.from_arrays([[], []], names=["run", "member"]))
    return pd.DataFrame(rows).set_index(["run", "member"])[columns]


def _versus(value: float, ref: float) -> str:
    if not (math.isfinite(value) and math.isfinite(ref)) or ref == 0:
        return f"{value:.3g} against {ref:.3g}"
    rel = (value - ref) / abs(ref)
    where = "equal" if rel == 0 else f"{abs(rel) * 100:.2g}% {'above' if rel > 0 else 'below'}"
    return f"{value:.4g} against {ref:.4g} ({where})"


def gpu_equal_step_sentences(ds: xr.Dataset) -> list[str]:
    """One sentence per setting of ``gpu_equal_step_table``: each run against the setting's FP32-attention
    run (else its first run) at the common step."""
    table = gpu_equal_step_table(ds)
    if table.empty:
        return ["**At equal steps.** No two records share a setting (learning rate, clipping, weight decay, "
                "seeds) with a common logged step: no comparison at equal steps."]
    out = []
    for setting, group in table.groupby("setting", sort=False):
        fp32 = group.index[group["attention"].map(_family) == "FP32"]
        ref_key = fp32[0] if len(fp32) else group.index[0]
        ref = group.loc[ref_key]
        common = int(ref["common step"])
        parts = []
        for key, row in group.drop(index=[ref_key]).iterrows():
            parts.append(f"{key[0]} ({row['attention']}) has a training loss {_versus(row['train loss'], ref['train loss'])}, "
                         f"a validation loss (last evaluations, steps {int(row['val step'])} and "
                         f"{int(ref['val step'])}) {_versus(row['val loss'], ref['val loss'])}, a mean key_mean_norm "
                         f"{_versus(row['key_mean_norm'], ref['key_mean_norm'])}, a mean max_prob "
                         f"{_versus(row['max_prob'], ref['max_prob'])}, a mean {GPU_DQ_METRIC} "
                         f"{row[GPU_DQ_METRIC]:.3g} against {ref[GPU_DQ_METRIC]:.3g} and a gradient norm "
                         f"{_versus(row['grad norm'], ref['grad norm'])}")
        stops = ", ".join(f"{k[0]}: step {int(r['last step'])}" for k, r in group.iterrows())
        out.append(f"**At equal steps ({setting}).** The runs of this setting stopped at different steps ({stops}); "
                   f"at step {common}, the largest logged step they all reached, against {ref_key[0]} "
                   f"({ref['attention']}): " + "; ".join(parts) + ".")
    return out


def gpu_offset_sentences(ds: xr.Dataset) -> list[str]:
    """Per setting with an FP32-attention run and another run: over every logged step > 0 that all
    the setting's trained members reached, each run's layer-mean dQ error and common key offset
    (``key_mean_norm``) beside the FP32 run's: at how many of those steps its offset is above FP32's and
    the last step at which it was below; whether the order of the runs by dQ error is their order by key
    offset; and what one run per attention cannot separate (run-to-run variation; the GProj kernel's
    own forward when no Triton run without GProj shares the setting)."""
    out = []
    for setting, members in _settings(ds).items():
        fams = {key: _family(_kernel_of(ds, *key)) for key in members}
        ref = [key for key, fam in fams.items() if fam == "FP32"]
        if not ref or len(members) < 2:
            continue
        ref = ref[0]
        at = _common_logged_steps(ds, members)
        if len(at) < 2:
            continue
        offset = {key: ds["key_mean_norm"].sel(run=key[0], member=key[1], step=at).mean("layer").values for key in members}
        dq = {key: float(ds[GPU_DQ_METRIC].sel(run=key[0], member=key[1], step=at).mean("layer").mean()) for key in members}
        mean_offset = {key: float(np.mean(v)) for key, v in offset.items()}
        parts = []
        for key in members:
            if key == ref:
                continue
            above = offset[key] > offset[ref]
            below_at = at[~above]
            last = f" (last below it at step {int(below_at[-1])})" if len(below_at) else " (never below it)"
            parts.append(f"{key[0]} ({fams[key]}) is above FP32's at {int(above.sum())} of the {len(at)} steps{last}")
        by_dq = sorted(members, key=lambda k: dq[k])
        by_offset = sorted(members, key=lambda k: mean_offset[k])
        per_family: dict[str, list] = {}
        for key in members:
            per_family.setdefault(fams[key], []).append(key)
        label = {key: fams[key] if len(per_family[fams[key]]) == 1 else f"{fams[key]} ({key[0]})" for key in members}
        order = lambda keys, values, fmt: " < ".join(f"{label[k]} {fmt(values[k])}" for k in keys)
        text = (f"**Key offsets beside the dQ error ({setting}).** Over the {len(at)} logged steps all its runs reached "
                f"(steps {int(at[0])}-{int(at[-1])}), ordered by the mean {GPU_DQ_METRIC} (layer mean): "
                + order(by_dq, dq, lambda v: f"{v:.3g}") + "; by the mean key_mean_norm (layer mean): "
                + order(by_offset, mean_offset, lambda v: f"{v:.3g}") + ". The layer-mean key offset of "
                + "; ".join(parts) + ".")
        if by_dq == by_offset:
            text += (" The runs are in the same order by both: the larger a run's dQ error, the larger the common key "
                     "offset its keys grew, the direction in which a biased gradient error that adds up in the weights "
                     "would push (Qiu & Yao's reading of their explosion, `papers.md` section 5).")
        else:
            text += " The two orders differ: a larger dQ error did not go with larger key offsets here."
        repeated = {fam: keys for fam, keys in per_family.items() if len(keys) > 1}
        spread_of = {}  # family -> (key offset, dQ error) ratio of its repeated runs' largest and smallest means
        if not repeated:
            text += (" One run per attention: GPU training is not bitwise deterministic (study 03's repeat pair), and "
                     "no repeated run of this setting measures how far the key offsets of two identical runs differ, "
                     "so these differences are not yet separated from run-to-run variation.")
        else:
            spread = []
            for fam, keys in repeated.items():
                offsets, errs = [mean_offset[k] for k in keys], [dq[k] for k in keys]
                spread_of[fam] = (max(offsets) / min(offsets), max(errs) / min(errs) if min(errs) > 0 else np.nan)
                spread.append(f"the {len(keys)} {fam} runs' mean key_mean_norm " + ", ".join(f"{v:.3g}" for v in offsets)
                              + f" ({spread_of[fam][0]:.3g}x apart) and mean {GPU_DQ_METRIC} "
                              + ", ".join(f"{v:.3g}" for v in errs) + f" ({spread_of[fam][1]:.3g}x apart)")
            text += (" Run to run (GPU training is not bitwise deterministic): " + "; ".join(spread) + ". A difference "
                     "between attentions within that spread is not one between their kernels.")
        plain_triton = [k for k in members if fams[k].startswith("triton:fa2")]
        if "GProj" in per_family and not plain_triton:
            text += (" The GProj run also differs from the flash run in its kernel (our Triton FA2, forward and "
                     "backward, against SDPA's FlashAttention-2); a Triton run without GProj (`s04_triton_lr1e-3`), "
                     "which would separate the two, has no record here.")
        elif "GProj" in per_family:
            g, t = per_family["GProj"][0], plain_triton[0]
            d_ratio, o_ratio = dq[t] / dq[g] if dq[g] > 0 else np.nan, mean_offset[g] / mean_offset[t]
            text += (f" GProj against the same Triton kernel without it ({t[0]}): mean {GPU_DQ_METRIC} {dq[g]:.3g} "
                     f"against {dq[t]:.3g} ({d_ratio:.3g}x lower with GProj), mean key_mean_norm {mean_offset[g]:.3g} "
                     f"against {mean_offset[t]:.3g} ({o_ratio:.3g}x).")
            if spread_of:
                fam, (o_spread, d_spread) = next(iter(spread_of.items()))
                inside = lambda ratio, spread: "within" if max(ratio, 1 / ratio) <= spread else "outside"
                text += (f" Set beside the {fam} repeat's spread ({d_spread:.3g}x in {GPU_DQ_METRIC}, {o_spread:.3g}x "
                         f"in key_mean_norm), GProj's dQ difference is {inside(d_ratio, d_spread)} it and its key "
                         f"offset difference {inside(o_ratio, o_spread)} it.")
        out.append(text)
    return out


def gpu_memorisation_sentence(ds: xr.Dataset) -> str:
    """Per trained member: the lowest validation loss and its step, the last validation loss and the
    training loss there and at the end, and the passes over the training split its tokens make; a
    member memorises when its validation loss ends more than ``GPU_VAL_RISE`` above its minimum while
    its training loss ends below its value at that minimum."""
    table = gpu_training_table(ds)
    parts, memorising = [], []
    for (run, member), row in table.iterrows():
        one = ds.sel(run=run, member=member)
        val = one["val_loss"].dropna("step")
        last_step = int(val["step"][-1]) if val.size else -1
        low, last, low_step = row["min val loss"], row["final val loss"], row["min val loss step"]
        train_at_low = float(one["loss"].sel(step=low_step)) if math.isfinite(low_step) else math.nan
        rise = last / low - 1 if low > 0 else math.nan
        if rise > GPU_VAL_RISE and row["final loss"] < train_at_low:
            memorising.append(run)
        after = (f"{last:.3g} at its last evaluation (step {last_step}), {100 * rise:.2g}% above its minimum"
                 if last_step > low_step else "the step of its last evaluation")
        bytes_ = float(one["run_corpus_train_bytes"]) if "run_corpus_train_bytes" in one.coords else math.nan
        passes = (f"{row['tokens']:.3g} tokens over a training split of {bytes_:.3g} bytes, {row['passes']:.3g} "
                  f"passes over the data" if math.isfinite(row["passes"]) else
                  f"{row['tokens']:.3g} tokens (the record does not give the training split's size)")
        parts.append(f"{run} ({row['attention']}): validation loss lowest {low:.3g} at step {low_step:.0f} "
                     f"(training loss there {train_at_low:.3g}), {after}; training loss at the end "
                     f"{row['final loss']:.3g}; {passes}")
    verdict = (f" {len(memorising)} of {len(table)} trained members ({', '.join(memorising)}) ended with a "
               f"validation loss more than {100 * GPU_VAL_RISE:g}% above its minimum and a training loss below "
               "its value there: past that step they memorise their training split." if memorising else
               f" None of the {len(table)} trained members ended with a validation loss more than "
               f"{100 * GPU_VAL_RISE:g}% above its minimum and a training loss below its value there: no sign of "
               "memorisation within these tokens.")
    return "**Memorisation.** " + "; ".join(parts) + "." + verdict + _dq_after_minimum(ds, table, memorising)


GPU_DQ_LATE_RISE = 0.1  # the dQ error "grew after the validation minimum" by more than this fraction


def _dq_after_minimum(ds: xr.Dataset, table, memorising) -> str:
    """For the memorising members with a dQ error: the layer-mean dQ error at the last logged step at or
    before the validation minimum and at the last logged step, so that the late growth can be placed
    before or inside the memorising phase."""
    parts, grew = [], 0
    for (run, member), row in table.iterrows():
        if run not in memorising:
            continue
        dq = ds[GPU_DQ_METRIC].sel(run=run, member=member).mean("layer").dropna("step")
        dq = dq.sel(step=dq["step"] > 0)
        before = dq.sel(step=dq["step"] <= row["min val loss step"])
        if not before.size or float(dq[-1]) == 0:
            continue
        a, b = float(before[-1]), float(dq[-1])
        grew += b > (1 + GPU_DQ_LATE_RISE) * a
        parts.append(f"{run} {a:.3g} at step {int(before['step'][-1])}, {b:.3g} at step {int(dq['step'][-1])} "
                     f"({b / a:.3g}x)")
    if not parts:
        return ""
    return (f" The layer-mean {GPU_DQ_METRIC} of the memorising members at their validation minimum and at their "
            f"end: " + "; ".join(parts) + f". It grew by more than {100 * GPU_DQ_LATE_RISE:g}% after the minimum in "
            f"{grew} of {len(parts)}" + (": for those, the late dQ growth measured here is growth while the model "
            "memorises its training split, a regime the sources' runs on fresh data never enter." if grew else "."))


GPU_DQ_PASS = 0.1  # "the dQ error passed" this relative error in a layer: ten times a bf16 kernel's usual ~1%


def gpu_dq_pass_sentence(ds: xr.Dataset, level: float = GPU_DQ_PASS) -> str:
    """Every trained member and layer whose dQ error (``GPU_DQ_METRIC``) passed ``level``: the first logged
    step it did and the layer's common key offset, score shift and sharpness there; its largest dQ error,
    with the median row error, the offset and the gradient-norm ratio (kernel over FP32 recompute) at that
    step; the largest dQ error of the member's other layers; and what the loss did from the first pass to
    the end (the training loss, and the validation loss against its minimum). The mechanism grid's measure
    (offset over the keys' spread) is given beside it, since the bound above compares maxima over runs."""
    parts, calm = [], []
    table = gpu_training_table(ds)
    for (run, member), row in table.iterrows():
        one = ds.sel(run=run, member=member)
        dq = one[GPU_DQ_METRIC].dropna("step", how="all")
        dq = dq.sel(step=dq["step"] > 0)
        if not dq.size or not float(dq.max()) > 0:
            continue
        crossings = _passes(ds, run, member, level)
        if not crossings:
            calm.append(f"{run} ({float(dq.max()):.2g})")
            continue
        passed = [layer for layer, _ in crossings]
        pieces = []
        for layer, first in crossings:
            d = dq.sel(layer=layer)
            top = int(d["step"][int(np.nanargmax(d.values))])
            at = lambda v, st: float(one[v].sel(layer=layer, step=st))
            loss = one["loss"].dropna("step")
            val = one["val_loss"].dropna("step")
            val_first = val.sel(step=val["step"] <= first)
            val_text = (f"; its validation loss {float(val[-1]):.3g} at the end against {float(val_first[-1]):.3g} "
                        f"at step {int(val_first['step'][-1])} and a minimum of {float(val.min()):.3g} "
                        f"(step {int(val['step'][int(np.nanargmin(val.values))])})" if val.size and val_first.size else "")
            pieces.append(
                f"layer {layer} passed {level:g} at step {first} (key_mean_norm {at('key_mean_norm', first):.3g}, "
                f"offset_logit {at('offset_logit', first):.3g}, max_prob {at('max_prob', first):.3g}) and reached "
                f"{float(d.max()):.3g} at step {top} (median row error dq_row_rel_err {at('dq_row_rel_err', top):.3g}, "
                f"key_mean_norm {at('key_mean_norm', top):.3g}, offset over spread "
                f"{float(_offset_over_spread(at('key_mean_ratio', top))):.3g}, offset_logit {at('offset_logit', top):.3g}, gradient "
                f"norm of the kernel's (dQ, dK, dV) over the FP32 recompute's {at('grad_norm_ratio', top):.3g}, "
                f"dK error {at('dk_rel_err', top):.3g}, dV error "
                f"{at('dv_rel_err', top):.3g}); the training loss went from {float(loss.sel(step=first, method='nearest')):.3g} "
                f"there to {float(loss[-1]):.3g} at the end{val_text}")
        others = dq.sel(layer=[l for l in dq["layer"].values if int(l) not in passed])
        rest = f"; its other layers stayed at or below {float(others.max()):.2g}" if others.size else ""
        parts.append(f"{run} ({row['attention']}): " + "; ".join(pieces) + rest)
    head = f"**Where the dQ error passed {level:g}** ({GPU_DQ_METRIC} in one layer, ten times a bf16 kernel's usual ~1%): "
    if not parts:
        return head + "in no layer of any run" + (f" (largest: {', '.join(calm)})." if calm else ".")
    return (head + ". ".join(parts) + "."
            + (f" In the other runs no layer passed it (largest {GPU_DQ_METRIC}: {', '.join(calm)})." if calm else ""))


def _passes(ds: xr.Dataset, run: str, member: str, level: float) -> list[tuple[int, int]]:
    """(layer, first logged step > 0 at which its dQ error passed ``level``) for one trained member."""
    dq = ds[GPU_DQ_METRIC].sel(run=run, member=member)
    dq = dq.sel(step=dq["step"] > 0)
    out = []
    for layer in dq["layer"].values:
        d = dq.sel(layer=layer).dropna("step")
        if d.size and float(d.max()) > level:
            out.append((int(layer), int(d["step"][int(np.argmax(d.values > level))])))
    return out


def gpu_pass_setting_sentences(ds: xr.Dataset, level: float = GPU_DQ_PASS) -> list[str]:
    """Per setting (``GPU_SETTING``) in which some layer's dQ error passed ``level``: how many of the
    setting's trained members had a layer pass it, and for each layer that passed, the same layer of the
    setting's other members at the step it passed (or at their last logged step, if they stopped before):
    its dQ error and common key offset there, and its largest dQ error and key offset over the whole run.
    A run that did not pass at a step it reached is the setting's evidence that the pass belongs to one
    trajectory rather than to the setting. Empty when no layer of any run passed."""
    out = []
    for setting, members in _settings(ds).items():
        passes = {key: _passes(ds, *key, level) for key in members}
        passes = {key: p for key, p in passes.items() if p}
        if not passes:
            continue
        parts = []
        for (run, member), layers in passes.items():
            for layer, first in layers:
                others = []
                for r, m in members:
                    if (r, m) == (run, member):
                        continue
                    one = ds.sel(run=r, member=m, layer=layer)
                    d = one[GPU_DQ_METRIC].dropna("step")
                    d = d.sel(step=d["step"] > 0)
                    if not d.size:
                        continue
                    last = int(d["step"][-1])
                    st = min(first, last)
                    when = f"at step {st}" if last >= first else f"at its last logged step {last} (it stopped before step {first})"
                    km = one["key_mean_norm"].dropna("step")
                    others.append(f"{r} ({_kernel_of(ds, r, m)}) {when}: {GPU_DQ_METRIC} {float(d.sel(step=st)):.3g}, "
                                  f"key_mean_norm {float(km.sel(step=st)):.3g}; over its {last} steps at most "
                                  f"{float(d.max()):.3g} and key_mean_norm at most {float(km.max()):.3g}")
                here = float(ds["key_mean_norm"].sel(run=run, member=member, layer=layer, step=first))
                parts.append(f"{run}'s layer {layer} passed at step {first} (key_mean_norm {here:.3g}); the same layer "
                             + ("of the setting's other runs: " + "; ".join(others) if others else
                                "has no other run of this setting to compare"))
        out.append(f"**The same setting ({setting}).** {len(passes)} of the {len(members)} trained runs of this setting "
                   f"had a layer whose {GPU_DQ_METRIC} passed {level:g}. " + ". ".join(parts) + ".")
    return out


def cpu_tier_run(name: str = "default") -> xr.Dataset | None:
    """This checkout's run ``outputs/late_training_gradient_blowup/<name>/results.nc`` of a CPU tier
    (None when absent or made on a GPU): the CPU training the gpu_training tier is set beside."""
    from ..ncio import open_results
    from ..paths import outputs_root

    path = outputs_root() / "late_training_gradient_blowup" / name / "results.nc"
    if not path.exists():
        return None
    ds = open_results(path, squeeze_sweep_dims=True)
    return None if "cuda" in str(ds.attrs.get("device", "")) or "train_grad_norm_total" not in ds else ds
