"""Study 04's measurements on the flash emulator, each a function returning an xarray Dataset with CF
attributes (``VARIABLES``).

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
"""
from __future__ import annotations

import math

import numpy as np
import torch
import xarray as xr

from ...progress import tqdm
from ... import kernels
from ...inputs import generator
from ...kernels import AttentionImpl
from ...metrics import ds_row_sums, gradient_errors, output_errors, row_rel_l2
from ...operands import REGIMES, axis_offset_operands, golden_values, key_resolution, mechanism_operands, mechanism_operands_in, regime_operands, unit_vector
from ...precision import get_policy
from .designed import ATTRS as DX_ATTRS
from .trainer import (DIAG_ATTRS, GPT, GPTConfig, Task, add_key_offset, load_checkpoint, record_variables,
                      recompute_backward_fp32, torch_threads)

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
    "variant_kernel": ("1", "the kernel's own name of the variant at the grid's tiles (a registry name, except for "
                            "the two variants whose policy switches one stage: fp32+ds=bf16, fa2_bf16+bwd=fp32)"),
    "real_variant_kernel": ("1", "the kernel's own name of the emulator variant beside the real kernels"),
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


VARIABLES = {**record_variables(), **ATTRS, **DX_ATTRS,
             "dx_arm": ("1", "arm of the designed sweep (params/lm/lr_sweep.yaml)"),
             "dx_lr": ("1", "peak learning rate of the designed sweep's run"),
             "dx_seed": ("1", "seed of the designed sweep's run (initial weights and batch order)"),
             "dx_step": ("1", "optimiser steps done at the logged row of the designed sweep"),
             "dx_kernel": ("1", "attention kernel of the arm (registry name)"),
             "dx_qk_norm": ("1", "whether the arm's model normalises queries and keys (qk-layernorm)"),
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


def variant_base(name: str, block_q: int, block_k: int) -> tuple[str, dict[str, str]]:
    """A variant as the kernel registry knows it: the registry name of the kernel of the variant's family,
    tiles and scale-max under the preset policy the variant's policy starts from, and the stages
    (``{stage: format}``) in which the variant's policy differs from that preset. Empty stages: the variant
    is that registry kernel (``variant_kernel``'s name); otherwise it is that kernel with those stages
    switched, its documented meaning (``KERNEL_VARIANTS``: ``fp32_ds_bf16``, dS rounded to bf16;
    ``bf16_bwd_fp32``, every backward stage in fp32)."""
    family, policy, fused, _ = KERNEL_VARIANTS[name]
    preset = get_policy(policy.name.split("+", 1)[0])
    ours, theirs = policy.as_dict(), preset.as_dict()
    changed = {stage: fmt for stage, fmt in ours.items() if stage != "name" and theirs[stage] != fmt}
    base = AttentionImpl(family, preset, block_q=block_q, block_k=block_k, fused_scale_max=fused)
    return kernels.as_kernel(base).name, changed


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
def mechanism_grid(sharpness, mu_norms, seq_lens, head_dims, seeds, *, variants, block_q: int, block_k: int,
                   golden_chunk: int, device: str, heads: int = 1,
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
    ds["variant_kernel"] = ("variant", [impl.name for impl in impls])
    if operands == "axis_offset":
        ds = ds[[f"mech_{m}" for m in AXIS_OFFSET_VARS] + ["variant_description", "variant_kernel"]]
        ds = ds.rename({f"mech_{m}": f"xo_{m}" for m in AXIS_OFFSET_VARS})
    return ds


# -- Qiu & Yao's regime beside seed 004's ---------------------------------------------------------

def tied_maxima_comparison(seq_len: int, head_dim: int, seeds, *, variants, n_ties: int, mu_norm: float,
                           block_q: int, block_k: int, golden_chunk: int, device: str, progress: bool = True,
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


def source_kernel(fmt: str, block_q: int, block_k: int) -> kernels.Kernel:
    """The FA2-order emulator in ``fmt`` (subtract-then-scale, production rounding points)."""
    return kernels.as_kernel(AttentionImpl("emulator", f"fa2_{fmt}", block_q=block_q, block_k=block_k))


def source_checks(sharpness, mu_norms, seq_len: int, head_dim: int, seeds, *, formats,
                  block_q: int, block_k: int, golden_chunk: int, device: str,
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


# -- training and the diagnostic at checkpoints ---------------------------------------------------

def parameter_count(p: dict) -> int:
    """Parameters of the GPT a tier trains: ``p``'s task (its vocabulary) and model sizes."""
    task = Task(p["task"], context=p["context"], n_symbols=p["n_symbols"], lm_loss=p["lm_loss"])
    model = GPT(GPTConfig(vocab_size=task.vocab_size, context=p["context"], n_layer=p["n_layer"],
                          n_head=p["n_head"], d_model=p["d_model"]))
    return sum(t.numel() for t in model.parameters())


def _offset_vectors(model_cfg: GPTConfig, seed: int) -> list[torch.Tensor]:
    """One unit vector per head and layer (shape (d_model,) per layer, each head's block of norm 1)."""
    gen = generator(seed + 11_000_027)
    return [torch.cat([unit_vector(model_cfg.head_dim, gen) for _ in range(model_cfg.n_head)]).float()
            for _ in range(model_cfg.n_layer)]


def checkpoint_diagnostics(result, model_cfg: GPTConfig, batch, offset_norms, *, threshold: float,
                           seed: int, device: str, progress: bool = True, threads: int = 1) -> xr.Dataset:
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
