"""Study 05: the GProj fix of seed 004, against every other fix.

Every fix is one change of a base kernel, the emulated BF16 FlashAttention-3 of seed 004
(``fa2_bf16`` with the fused scale-max), named in ``attnum.kernels.fixes.FIXES`` and applied by
``with_fix``. Four experiments, each a function returning an xarray Dataset with CF attributes:

``fix_grid``
    study 04's mechanism grid (its operands and fp64 golden values, from
    ``attnum.operands``): q scaled by a sharpness factor, a vector mu of norm
    |mu| added to every key (the exact output and dQ do not depend on it). Per fix: dQ, dK, dV
    median and 99th-percentile row relative errors against fp64; the forward error; the row sums
    of dS before and after its rounding and as the dQ matmul effectively multiplies it; the dQ
    error when D is formed from the exact output instead of the stored one (what is left when the
    D path is removed); the fraction of rows whose output collapsed to zero.

``regime_comparison``
    study 04's regimes (``attnum.operands.regime_operands``): seed 004's key offset beside
    Qiu & Yao's tied maxima with negative-mean or zero-mean values.

``fix_costs``
    the analytic count of ``attnum.cost`` for a real kernel, and the emulator's measured time
    (a CPU emulation, not a kernel timing).

``fix_training``
    the small GPT trained from the same initialisation and data order with FP32 attention, the
    BF16 flash emulator and each fix (``attnum.training.train_runs``).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import xarray as xr
from ..progress import tqdm

from .. import kernels
from ..cost import cost_table
from ..kernels import FIXES, AttentionImpl, with_fix
from ..metrics import ds_row_sums, gradient_errors, output_errors
from ..operands import REGIMES, golden_values, mechanism_operands, regime_operands
from ..training import record_variables, torch_threads, train_runs

SEED004_DQ_ERR_BEFORE = 2.19  # [src] seed 004: median relative dQ error before GProj
SEED004_DQ_ERR_AFTER = 0.0034  # [src] seed 004: after GProj
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


VARIABLES = {**record_variables(), **ATTRS, **{f"{prefix}{name}": entry for prefix in ("grid_", "regime_")
                                               for name, entry in ATTRS.items()},
             "sharpness": ("1", "factor multiplying q (attention sharpness)"),
             "mu_norm": ("1", "norm of the vector mu added to every key")}
"""CF units and long_name of every variable the study writes (applied by ``ncio.write_results``)."""


def base_impl(block_q: int, block_k: int) -> AttentionImpl:
    """Seed 004's kernel: BF16 FlashAttention-3 (FA2 policy ``fa2_bf16``, fused scale-max)."""
    return AttentionImpl("emulator", "fa2_bf16", block_q=block_q, block_k=block_k, fused_scale_max=True)


def fix_kernels(fixes, block_q: int, block_k: int, stable_beta: float = 2.0) -> dict[str, kernels.Kernel]:
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


def fix_grid(sharpness, mu_norms, seq_lens, head_dims, seeds, *, fixes=tuple(FIXES), block_q: int = 64,
             block_k: int = 64, stable_beta: float = 2.0, golden_chunk: int = 1024, device="cpu",
             progress: bool = True, threads: int = 1) -> xr.Dataset:
    """Every fix's errors over sharpness x |mu| x N x d x seed, on study 04's mechanism operands."""
    shape = (len(fixes), len(sharpness), len(mu_norms), len(seq_lens), len(head_dims), len(seeds))
    data = {m: np.full(shape, np.nan) for m in GRAD_ERROR_METRICS}
    max_prob = np.full(shape[1:], np.nan)
    impls = fix_kernels(fixes, block_q, block_k, stable_beta)
    work = [(a, s, b, m, c, n, e, d, f, seed) for a, s in enumerate(sharpness) for b, m in enumerate(mu_norms)
            for c, n in enumerate(seq_lens) for e, d in enumerate(head_dims) for f, seed in enumerate(seeds)]
    with torch_threads(threads):
        for a, s, b, m, c, n, e, d, f, seed in tqdm(work, desc="fix grid", disable=not progress):
            q, k, v, do, _ = mechanism_operands(n, d, s, m, seed, device=device)
            gold = golden_values(q, k, v, do, golden_chunk)
            max_prob[a, b, c, e, f] = gold["max_prob"].median().item()
            for i, fix in enumerate(fixes):
                res = fix_errors(q, k, v, do, impls[fix], gold)
                for metric in GRAD_ERROR_METRICS:
                    data[metric][i, a, b, c, e, f] = res[metric]
    dims = ("fix", "sharpness", "mu_norm", "seq_len", "head_dim", "seed")
    coords = {"fix": list(fixes), "sharpness": list(map(float, sharpness)), "mu_norm": list(map(float, mu_norms)),
              "seq_len": list(seq_lens), "head_dim": list(head_dims), "seed": list(seeds)}
    ds = xr.Dataset({f"grid_{m}": (dims, data[m]) for m in GRAD_ERROR_METRICS}, coords=coords)
    ds["grid_max_prob"] = (dims[1:], max_prob)
    ds["fix_description"] = ("fix", [FIXES[fix].description for fix in fixes])
    return ds


def regime_comparison(seq_len: int, head_dim: int, seeds, *, fixes=tuple(FIXES), n_ties: int = 8,
                      mu_norm: float = 100.0, block_q: int = 64, block_k: int = 64, stable_beta: float = 2.0,
                      golden_chunk: int = 1024, device="cpu", progress: bool = True, threads: int = 1) -> xr.Dataset:
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


def emulator_seconds(fixes, seq_len: int, head_dim: int, *, block_q: int = 64, block_k: int = 64,
                     stable_beta: float = 2.0, repeats: int = 3, device="cpu", threads: int = 1) -> xr.Dataset:
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
              timing_head_dim: int, block_q: int = 64, block_k: int = 64, stable_beta: float = 2.0,
              repeats: int = 3, device="cpu", threads: int = 1) -> xr.Dataset:
    """The analytic cost of each fix for a real kernel beside the emulator's measured time."""
    analytic = cost_table(fixes, seq_len, head_dim, block_q=block, block_k=block, causal=causal)
    measured = emulator_seconds(fixes, timing_seq_len, timing_head_dim, block_q=block_q, block_k=block_k,
                                stable_beta=stable_beta, repeats=repeats, device=device, threads=threads)
    return xr.merge([analytic, measured], combine_attrs="no_conflicts")


def fix_training(task, model_cfg, train_cfg, *, baseline: AttentionImpl, fixes, block: int,
                 stable_beta: float = 2.0, device="cpu", progress: bool = True) -> xr.Dataset:
    """Train the small GPT from one initialisation and data order with ``baseline`` attention (run
    ``fp32``) and with the base BF16 kernel under each fix (run named after the fix; ``none`` is the
    BF16 flash emulator as it is)."""
    runs = {"fp32": baseline, **fix_kernels(fixes, block, block, stable_beta)}
    records, _ = train_runs(task, model_cfg, train_cfg, runs, device=device, progress=progress)
    return records


# -- tables ---------------------------------------------------------------------------------------

def seed004_comparison(ds: xr.Dataset, var: str = "grid_dq_err"):
    """Per sharpness (largest N, first d, median over seeds): the grid's |mu| at which the unfixed
    kernel's median dQ error is nearest seed 004's 219% (in log), the errors of ``none``, the GProj
    variants and FP32 attention there, and seed 004's own before/after numbers, marked as theirs."""
    import pandas as pd

    sub = ds[var].isel(seq_len=-1, head_dim=0).median("seed")
    rows = []
    for s in ds["sharpness"].values:
        none = sub.sel(fix="none", sharpness=s)
        dist = np.abs(np.log(none.values / SEED004_DQ_ERR_BEFORE))
        mu = float(ds["mu_norm"].values[int(np.nanargmin(dist))])
        row = {"sharpness": float(s), "|mu|": mu}
        for fix in ("none", "gproj_dq", "gproj_dq_dk", "mean_key", "fp32_backward", "fp32_attention"):
            if fix in ds["fix"].values:
                row[f"ours: {fix}"] = float(sub.sel(fix=fix, sharpness=s, mu_norm=mu))
        row["theirs (seed 004): before GProj"] = SEED004_DQ_ERR_BEFORE
        row["theirs (seed 004): after GProj"] = SEED004_DQ_ERR_AFTER
        rows.append(row)
    return pd.DataFrame(rows).set_index(["sharpness", "|mu|"])


def offset_growth(ds: xr.Dataset, var: str = "grid_dq_err"):
    """Per fix and sharpness (largest N, first d, median over seeds): the error at |mu| = 0, at the
    largest |mu|, and their ratio (1: the offset does nothing)."""
    sub = ds[var].isel(seq_len=-1, head_dim=0).median("seed")
    first, last = sub.isel(mu_norm=0, drop=True), sub.isel(mu_norm=-1, drop=True)
    table = xr.Dataset({f"|mu| = {float(ds['mu_norm'][0]):g}": first, f"|mu| = {float(ds['mu_norm'][-1]):g}": last,
                        "growth": last / first})
    return table.to_dataframe().drop(columns=["seq_len", "head_dim"], errors="ignore").unstack("sharpness")


def grid_summary(ds: xr.Dataset, var: str = "grid_dq_err", mu_max: float = 1000.0):
    """One row per fix, over the whole grid (median over seeds): the largest error with |mu| <= ``mu_max``
    and with any |mu|, and the smallest and largest ratio of the fix's error to the unfixed kernel's."""
    import pandas as pd

    err = ds[var].median("seed")
    dims = [d for d in err.dims if d != "fix"]
    ratio = err / err.sel(fix="none")
    return pd.DataFrame({f"largest, |mu| <= {mu_max:g}": err.where(ds["mu_norm"] <= mu_max).max(dims).values,
                         "largest": err.max(dims).values,
                         "smallest ratio to none": ratio.min(dims).values,
                         "largest ratio to none": ratio.max(dims).values},
                        index=pd.Index(ds["fix"].values, name="fix"))


def cost_summary(ds: xr.Dataset):
    """One row per fix: analytic extras over the base kernel (per head, forward + backward) and the
    emulator's measured time relative to the base's (labelled as an emulation)."""
    import pandas as pd

    total = lambda name: ds[f"cost_{name}"].sum("kernel_pass")
    base = lambda name: float(total(name).sel(fix="none"))
    emul = ds["emul_forward_seconds"] + ds["emul_backward_seconds"]
    table = pd.DataFrame({
        "extra GEMM FLOPs, low precision (x base)": (total("gemm_flops_low") - base("gemm_flops_low")).values
        / base("gemm_flops_low"),
        "GEMM FLOPs in fp32 (x base GEMM FLOPs)": total("gemm_flops_fp32").values / base("gemm_flops_low"),
        "extra exponentials (x base)": (total("exp_ops") - base("exp_ops")).values / base("exp_ops"),
        "extra memory traffic (x base)": ds["cost_extra_traffic_vs_attention"].values,
        "extra tile passes per backward": ds["cost_tile_passes"].sel(kernel_pass="backward").values
        - float(ds["cost_tile_passes"].sel(kernel_pass="backward", fix="none")),
        "extra small kernels": (total("extra_kernels") - base("extra_kernels")).values,
        "workspace (KiB per head)": total("workspace_bytes").values / 1024,
        "extra arithmetic time at H100 peaks, / base backward": ds["cost_extra_compute_vs_backward"].values,
        "extra arithmetic time at H100 peaks, / base fwd+bwd": ds["cost_extra_compute_vs_attention"].values,
        "EMULATION (CPU): fwd+bwd time / base": (emul / emul.sel(fix="none")).values,
    }, index=pd.Index(ds["fix"].values, name="fix"))
    return table


def training_table(ds: xr.Dataset, baseline: str = "fp32", last: int = 10, late_fraction: float = 0.5):
    """One row per run: final loss (mean of the last ``last`` records), its gap to ``baseline``, the
    median late-training ratio of the global gradient norm to the baseline's, and the final key-mean
    norm of each layer."""
    import pandas as pd

    steps = ds["step"].values
    late = steps >= steps[0] + (1 - late_fraction) * (steps[-1] - steps[0])
    final = ds["train_loss"].isel(step=slice(-last, None)).mean("step")
    ratio = (ds["train_grad_norm_total"] / ds["train_grad_norm_total"].sel(run=baseline)).isel(step=late)
    table = pd.DataFrame({"attention": ds["run_attention"].values, "final loss (nat)": final.values,
                          f"gap vs {baseline} (nat)": (final - final.sel(run=baseline)).values,
                          "late grad-norm ratio, median": ratio.median("step").values},
                         index=pd.Index(ds["run"].values, name="run"))
    for layer in ds["layer"].values:
        table[f"final key-mean norm, layer {layer}"] = ds["train_key_mean_norm"].sel(layer=layer).isel(
            step=slice(-last, None)).mean("step").values
    return table


# -- figures --------------------------------------------------------------------------------------
