"""Study 05's emulated measurements: the fix grid (with the real kernels on its operands), the
regimes, the costs (analytic, and the emulator's time) and training with each fix. Each function
returns an xarray Dataset; the variables' units and names are ``attnum.studies.gproj_fix.VARIABLES``.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import xarray as xr

from ... import kernels
from ...cost import cost_table
from ...kernels import FIXES, AttentionImpl, with_fix
from ...metrics import ds_row_sums, gradient_errors, output_errors
from ...operands import REGIMES, golden_values, mechanism_operands, regime_operands
from ...progress import tqdm
from ...train import record_variables, torch_threads, train_runs
from .real_kernels import _failure, emulator_equivalent, real_point

GRAD_ERROR_METRICS = ("dq_err", "dk_err", "dv_err", "dq_err_p99", "dk_err_p99", "dv_err_p99", "dq_err_exact_delta",
           "out_err", "out_err_coherence", "zero_rows", "ds_exact_row_sum", "ds_rounded_row_sum", "ds_row_sum")
__all__ = ["record_variables"]


def base_impl(block_q: int, block_k: int) -> AttentionImpl:
    """Seed 004's kernel: BF16 FlashAttention-3 (FA2 policy ``fa2_bf16``, fused scale-max)."""
    return AttentionImpl("emulator", "fa2_bf16", block_q=block_q, block_k=block_k, fused_scale_max=True)


def fix_kernels(fixes, block_q: int, block_k: int, stable_beta: float) -> dict[str, kernels.Kernel]:
    """The registry kernel of every fix: the base with the fix applied."""
    return {fix: kernels.as_kernel(with_fix(base_impl(block_q, block_k), fix, stable_beta=stable_beta))
            for fix in fixes}


def fix_errors(q, k, v, do, kernel, gold: dict) -> dict[str, float]:
    """Every metric of ``GRAD_ERROR_METRICS`` for one emulator kernel on the operands q, k, v, dO it
    reads, against the fp64 values ``gold`` (``attnum.operands.golden_values``)."""
    stats = {}
    out, lse = kernel.forward(q, k, v)
    grads = kernel.backward(q, k, v, do, out=out, lse=lse, stats=stats)
    res = {**gradient_errors(grads, gold, quantiles=(0.99,)), **output_errors(out, gold["out"]), **ds_row_sums(stats)}
    dq_exact_delta = kernel.backward(q, k, v, do, out=gold["out"], lse=lse)[0]
    res["dq_err_exact_delta"] = gradient_errors((dq_exact_delta,), (gold["dq"],))["dq_err"]
    res["zero_rows"] = torch.isneginf(lse).double().mean().item()
    return res


EXACT_METRICS = ("exact_dq_norm", "exact_dq_change", "exact_out_change", "distinct_keys", "distinct_key_values",
                 "key_perturbation", "p_max_not_one")
REAL_METRICS = ("dq_err", "dk_err", "dv_err", "dq_err_p99", "out_err", "emul_dq_err", "emul_dk_err", "emul_dv_err",
                "dq_err_corr", "dq_bitwise")


def exact_problem(gold: dict, gold_zero: dict, k, k_zero, mu) -> dict[str, float]:
    """How far the rounded operands at this |mu| moved the exact problem from the one at |mu| = 0
    (same q, v, dO, seed; ``k_zero`` the keys there): median row norm of the exact dQ, relative L2
    change of the exact dQ and output, the number of distinct (bf16-rounded) key vectors over N,
    the mean over key components of the number of distinct values over N, and the relative size of
    the perturbation rounding put on the keys, ||(k + mu rounded) - mu - k|| / ||k||."""
    rel = lambda a, b: (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()
    keys = k.reshape(-1, k.shape[-1])
    values = np.mean([torch.unique(keys[:, j]).numel() for j in range(keys.shape[-1])]) / keys.shape[0]
    shift = k.double() - mu.double() - k_zero.double()
    return {"exact_dq_norm": torch.linalg.vector_norm(gold["dq"], dim=-1).median().item(),
            "exact_dq_change": rel(gold["dq"], gold_zero["dq"]),
            "exact_out_change": rel(gold["out"], gold_zero["out"]),
            "distinct_keys": torch.unique(keys, dim=0).shape[0] / keys.shape[0],
            "distinct_key_values": float(values),
            "key_perturbation": (torch.linalg.vector_norm(shift) / torch.linalg.vector_norm(k_zero.double())).item()}


def p_max_not_one(q, k, block_k: int) -> float:
    """Fraction of rows where the fused scale-max forward (FlashAttention-3's one FMA,
    ``exp2(fma(s, c, -round(m c)))``, fp32) gives the row's maximum score a probability other
    than exactly 1 before normalisation (seed 004, cause 1); the emulator's own ``exponent``."""
    from ...kernels.common import exponent
    from ...precision import PRESETS

    s = q.float() @ k.float().transpose(-1, -2)  # fp32 scores of bf16 operands
    m = s.amax(-1, keepdim=True)
    p = exponent(m, m, 1.0 / math.sqrt(q.shape[-1]), True, PRESETS["fa2_bf16"])
    return (p != 1).double().mean().item()


def fix_grid(sharpness, mu_norms, seq_lens, head_dims, seeds, *, fixes, block_q: int, block_k: int,
             stable_beta: float, golden_chunk: int, real_kernels, device="cpu",
             progress: bool = True, threads: int = 1) -> xr.Dataset:
    """Every fix's errors over sharpness x |mu| x N x d x seed, on study 04's mechanism operands;
    how the rounded operands change the exact problem (against the same seed at |mu| = 0); and,
    for every name in ``real_kernels``, that real kernel on the same operands beside its emulated
    equivalent (``real_*``; ``real_status`` per kernel, N and d: "ok" or why it gave nothing there,
    after which it is skipped at that N and d)."""
    shape = (len(fixes), len(sharpness), len(mu_norms), len(seq_lens), len(head_dims), len(seeds))
    data = {m: np.full(shape, np.nan) for m in GRAD_ERROR_METRICS}
    max_prob = np.full(shape[1:], np.nan)
    exact = {m: np.full(shape[1:], np.nan) for m in EXACT_METRICS}
    impls = fix_kernels(fixes, block_q, block_k, stable_beta)
    real = [kernels.get(name) for name in real_kernels]
    equivalents = [emulator_equivalent(name) for name in real_kernels]
    eq_names = [kernels.as_kernel(e).name if e is not None else "" for e in equivalents]
    eq_kernels = {name: kernels.as_kernel(e) for name, e in zip(eq_names, equivalents) if e is not None}
    real_data = {m: np.full((len(real),) + shape[1:], np.nan) for m in REAL_METRICS}
    status = np.full((len(real), len(seq_lens), len(head_dims)), "ok", dtype=object)
    for r, kernel in enumerate(real):
        reason = kernel.unavailable_reason(device)
        if reason:
            status[r] = f"unavailable: {reason}"
    # |mu| innermost, so the exact values at |mu| = 0 of one (sharpness, N, d, seed) are computed once
    work = [(a, s, b, m, c, n, e, d, f, seed) for a, s in enumerate(sharpness) for c, n in enumerate(seq_lens)
            for e, d in enumerate(head_dims) for f, seed in enumerate(seeds) for b, m in enumerate(mu_norms)]
    zero = {}
    with torch_threads(threads):
        for a, s, b, m, c, n, e, d, f, seed in tqdm(work, desc="fix grid", disable=not progress):
            at = (a, b, c, e, f)
            q, k, v, do, mu = mechanism_operands(n, d, s, m, seed, device=device)
            gold = golden_values(q, k, v, do, golden_chunk)
            if (a, c, e, f) not in zero:
                zero.clear()
                if m == 0:
                    zero[(a, c, e, f)] = (gold, k)
                else:
                    q0, k0, v0, do0, _ = mechanism_operands(n, d, s, 0.0, seed, device=device)
                    zero[(a, c, e, f)] = (golden_values(q0, k0, v0, do0, golden_chunk), k0)
            gold_zero, k_zero = zero[(a, c, e, f)]
            for metric, value in exact_problem(gold, gold_zero, k, k_zero, mu).items():
                exact[metric][at] = value
            exact["p_max_not_one"][at] = p_max_not_one(q, k, block_k)
            max_prob[at] = gold["max_prob"].median().item()
            for i, fix in enumerate(fixes):
                res = fix_errors(q, k, v, do, impls[fix], gold)
                for metric in GRAD_ERROR_METRICS:
                    data[metric][(i,) + at] = res[metric]
            emulated = {}
            for name, kernel in eq_kernels.items():
                if all(status[r, c, e] != "ok" for r, eq in enumerate(eq_names) if eq == name):
                    continue
                out, lse = kernel.forward(q, k, v)
                grads = kernel.backward(q, k, v, do, out=out, lse=lse)
                emulated[name] = {"grads": grads, "errors": gradient_errors(grads, gold)}
            for r, kernel in enumerate(real):
                if status[r, c, e] != "ok":
                    continue
                try:
                    res = real_point(kernel, q, k, v, do, gold, emulated.get(eq_names[r]))
                except Exception as exc:  # noqa: BLE001 -- recorded as data (refused, out of memory, a compile error), never replaced
                    status[r, c, e] = _failure(exc)
                    continue
                for metric, value in res.items():
                    real_data[metric][(r,) + at] = value
            del emulated
    dims = ("fix", "sharpness", "mu_norm", "seq_len", "head_dim", "seed")
    coords = {"fix": list(fixes), "sharpness": list(map(float, sharpness)), "mu_norm": list(map(float, mu_norms)),
              "seq_len": list(seq_lens), "head_dim": list(head_dims), "seed": list(seeds)}
    ds = xr.Dataset({f"grid_{m}": (dims, data[m]) for m in GRAD_ERROR_METRICS}, coords=coords)
    ds["grid_max_prob"] = (dims[1:], max_prob)
    for metric in EXACT_METRICS:
        ds[f"grid_{metric}"] = (dims[1:], exact[metric])
    ds["fix_description"] = ("fix", [FIXES[fix].description for fix in fixes])
    if real:
        ds = ds.assign_coords(real_kernel=list(real_kernels))
        for metric in REAL_METRICS:
            ds[f"real_{metric}"] = (("real_kernel",) + dims[1:], real_data[metric])
        ds["real_status"] = (("real_kernel", "seq_len", "head_dim"), status.astype(str))
        ds["real_equivalent"] = ("real_kernel", eq_names)
    return ds


def regime_comparison(seq_len: int, head_dim: int, seeds, *, fixes, n_ties: int, mu_norm: float, block_q: int,
                      block_k: int, stable_beta: float, golden_chunk: int, device="cpu", progress: bool = True, threads: int = 1) -> xr.Dataset:
    """Every fix in seed 004's key-offset regime and Qiu & Yao's tied-maxima regimes."""
    shape = (len(REGIMES), len(fixes), len(seeds))
    data = {m: np.full(shape, np.nan) for m in GRAD_ERROR_METRICS}
    impls = fix_kernels(fixes, block_q, block_k, stable_beta)
    work = [(r, regime, s, seed) for r, regime in enumerate(REGIMES) for s, seed in enumerate(seeds)]
    with torch_threads(threads):
        for r, regime, s, seed in tqdm(work, desc="regimes", disable=not progress):
            q, k, v, do, _ = regime_operands(regime, seq_len, head_dim, seed, n_ties=n_ties, mu_norm=mu_norm,
                                                    device=device)
            gold = golden_values(q, k, v, do, golden_chunk)
            for i, fix in enumerate(fixes):
                res = fix_errors(q, k, v, do, impls[fix], gold)
                for metric in GRAD_ERROR_METRICS:
                    data[metric][r, i, s] = res[metric]
    coords = {"regime": list(REGIMES), "fix": list(fixes), "seed": list(seeds)}
    ds = xr.Dataset({f"regime_{m}": (("regime", "fix", "seed"), data[m]) for m in GRAD_ERROR_METRICS}, coords=coords)
    return ds


def emulator_seconds(fixes, seq_len: int, head_dim: int, *, block_q: int, block_k: int, stable_beta: float,
                     repeats: int, device="cpu", threads: int = 1) -> xr.Dataset:
    """Wall time of the emulator's forward and backward per fix, one head: the fixes take turns
    (so a burst of load on a shared machine hits all of them), a warm-up round is dropped and the
    fastest of ``repeats`` rounds is kept. The emulator loops over key blocks in Python: its times
    rank the fixes' extra work only roughly and say nothing of a GPU kernel's."""
    impls = fix_kernels(fixes, block_q, block_k, stable_beta)
    q, k, v, do, _ = mechanism_operands(seq_len, head_dim, 1.0, 0.0, 0, device=device)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    times = np.full((repeats + 1, len(fixes), 2), np.nan)
    with torch_threads(threads):
        for r in range(repeats + 1):
            for i, fix in enumerate(fixes):
                sync()
                t0 = time.perf_counter()
                out, lse = impls[fix].forward(q, k, v)
                sync()
                t1 = time.perf_counter()
                impls[fix].backward(q, k, v, do, out=out, lse=lse)
                sync()
                times[r, i] = (t1 - t0, time.perf_counter() - t1)
    fwd, bwd = times[1:].min(axis=0).T
    ds = xr.Dataset({"emul_forward_seconds": ("fix", fwd), "emul_backward_seconds": ("fix", bwd)},
                    coords={"fix": list(fixes)})
    ds.attrs.update(timing_seq_len=seq_len, timing_head_dim=head_dim)
    return ds


def fix_costs(fixes, *, seq_len: int, head_dim: int, block: int, causal: bool, timing_seq_len: int,
              timing_head_dim: int, block_q: int, block_k: int, stable_beta: float,
              repeats: int, device="cpu", threads: int = 1) -> xr.Dataset:
    """The analytic cost of each fix for a real kernel beside the emulator's measured time."""
    analytic = cost_table(fixes, seq_len, head_dim, block_q=block, block_k=block, causal=causal)
    measured = emulator_seconds(fixes, timing_seq_len, timing_head_dim, block_q=block_q, block_k=block_k,
                                stable_beta=stable_beta, repeats=repeats, device=device, threads=threads)
    return xr.merge([analytic, measured], combine_attrs="no_conflicts")


def fix_training(task, model_cfg, train_cfg, *, baseline: AttentionImpl, fixes, block: int,
                 stable_beta: float, device="cpu", progress: bool = True) -> xr.Dataset:
    """Train the small GPT from one initialisation and data order with ``baseline`` attention (FP32
    attention: the run is named after its kernel's registry name) and with the base BF16 kernel under each
    fix (run named after the fix; ``none`` is the BF16 flash emulator as it is)."""
    name = kernels.as_kernel(baseline).name
    if name in FIXES:
        raise ValueError(f"the baseline kernel's name {name!r} is also a fix's name")
    runs = {name: baseline, **fix_kernels(fixes, block, block, stable_beta)}
    records, _ = train_runs(task, model_cfg, train_cfg, runs, device=device, progress=progress)
    return records

