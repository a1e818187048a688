"""The report's measurements: the kernel-facing experiments of studies 01, 02 and 04 called as they are
(``length_scaling.real_kernels.real_kernel_sweep``, ``extreme_inputs.real_kernels.real_kernel_inputs``,
``late_training_gradient_blowup.real_kernels.real_mechanism_grid``) on the kernels under test and the
registry kernels they are set against, plus their speed; one dataset whose variables carry the section's
prefix (``fwd_``, ``ext_``, ``bwd_``, ``speed_``) over one ``kernel`` dimension."""
from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from .. import kernels
from ..timing import median_ms

EMULATOR_EXTREMES = "emulator:fa2_bf16:bk128"
"""The correct kernel of the production bf16 policy, set beside the kernels on extreme inputs."""
BACKWARD_VARIANTS = ("bf16", "bf16_fused", "fp32")
"""Study 04's emulated variants beside each kernel's backward (``KERNEL_VARIANTS``): FA2 BF16 (its dQ error
grows with a key offset), FA3's fused scale-max in BF16, and FP32 attention (the baseline)."""


def _prefixed(ds: xr.Dataset, prefix: str) -> xr.Dataset:
    """Every variable and dimension of a study's dataset renamed ``<prefix><name without real_>``; the
    kernel dimension becomes ``kernel`` (shared by every section)."""
    names = {}
    for name in list(ds.variables):
        if name == "real_kernel":
            names[name] = "kernel"
        elif name == "real_other_kernel":
            names[name] = f"{prefix}other_kernel"
        else:
            names[name] = prefix + (name[5:] if name.startswith("real_") else name)
    return ds.rename(names)


def forward_band(names, p: dict, device: str, progress: bool) -> xr.Dataset:
    """Study 01's real-kernel sweep: each kernel's error against fp64 beside the emulator's (``fa2_<dtype>``,
    key block 128, FA2 loop and FA3's fused scale-max) on the same inputs, and every acceptance rule."""
    from ..studies.length_scaling.real_kernels import real_kernel_sweep

    ds = real_kernel_sweep(names, p["forward_seq_lens"], p["forward_dtypes"], p["forward_head_dims"],
                           [bool(c) for c in p["forward_causal"]], p["forward_seeds"], block_ks=[128], batch=1,
                           heads=p["forward_heads"], device=device, golden_chunk=None if device == "cpu" else 1024,
                           reference_chunk=256 if device == "cpu" else 0, progress=progress)
    ds = _prefixed(ds, "fwd_")
    ds["fwd_ratio"] = ds["fwd_rel_l2_err"] / ds["fwd_emulator_rel_l2_err"].sel(fwd_fidelity_config="bk128", drop=True)
    return ds


def extremes(names, p: dict, device: str, progress: bool) -> xr.Dataset:
    """Study 02's real-kernel inputs (extreme values, special values, masks delivered as -inf biases): what
    each kernel returns beside fp64 attention, the emulator and the other kernels."""
    from ..studies.extreme_inputs.real_kernels import real_kernel_inputs

    chunk = 128 if device == "cpu" else 1024
    ds = real_kernel_inputs(list(names) + [EMULATOR_EXTREMES], p["extreme_inputs"], ["-inf"], p["extreme_dtypes"],
                            p["extreme_seq_len"], seed=0, batch=1, heads=2, head_dim=p["extreme_head_dim"],
                            device=device, golden_chunk=chunk, progress=progress)
    return _prefixed(ds, "ext_").rename({"kernel": "ext_kernel"})


def backward_offsets(names, p: dict, device: str, progress: bool) -> xr.Dataset:
    """Study 04's mechanism grid on real kernels: dQ, dK, dV errors (median row, against fp64) as a common key
    offset |mu| and the sharpness grow, beside the emulated BF16 and FP32 backward on the same operands."""
    from ..studies.late_training_gradient_blowup.real_kernels import real_mechanism_grid

    ds = real_mechanism_grid(names, p["backward_sharpness"], p["backward_mu_norms"], [p["backward_seq_len"]],
                             [p["backward_head_dim"]], p["backward_seeds"], variants=list(BACKWARD_VARIANTS),
                             block_q=64, block_k=64, golden_chunk=128 if device == "cpu" else 1024, device=device,
                             progress=progress)
    ds = ds.squeeze(["real_seq_len", "real_head_dim"], drop=True)
    return _prefixed(ds, "bwd_")


def speed(names, p: dict, device: str) -> xr.Dataset:
    """Median time of the forward and of forward + backward (``forward`` then ``backward`` given what the
    forward stored; a plain function's backward is autograd, which runs its forward once more) of every kernel on bf16 inputs of one size, on ``device``."""
    from ..inputs import normal_qkv

    n, d, h, repeats = p["speed_seq_len"], p["speed_head_dim"], p["speed_heads"], p["speed_repeats"]
    q, k, v, do = (t.to(device=device, dtype=torch.bfloat16)
                   for t in normal_qkv(1, h, n, d, seed=0, device="cpu") + (torch.randn(1, h, n, d, dtype=torch.float64),))
    fwd, both = np.full(len(names), np.nan), np.full(len(names), np.nan)
    status = np.full(len(names), "ok", dtype=object)
    for i, name in enumerate(names):
        kernel = kernels.get(name)
        reason = kernel.unavailable_reason(device)
        if reason:
            status[i] = f"unavailable: {reason}"
            continue
        try:
            with torch.no_grad():
                fwd[i] = median_ms(lambda: kernel.forward(q, k, v), 1, repeats, device)
            if kernel.has_backward:
                def step():
                    out, lse = kernel.forward(q, k, v)
                    kernel.backward(q, k, v, do, **({"out": out, "lse": lse} if lse is not None else {}))
                both[i] = median_ms(step, 1, repeats, device)
        except Exception as exc:  # a kernel that refuses is recorded, never replaced
            status[i] = f"refused: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    ds = xr.Dataset({"speed_forward_ms": ("kernel", fwd), "speed_forward_backward_ms": ("kernel", both),
                     "speed_status": ("kernel", status.astype(str))}, coords={"kernel": list(names)})
    ds["speed_seq_len"], ds["speed_head_dim"], ds["speed_heads"] = n, d, h
    return ds


VARIABLES = {
    "fwd_ratio": ("1", "relative L2 error over the emulator's (fa2_<dtype>, bk128) on the same inputs"),
    "fwd_ratio_factor": ("1", "the verdict's allowed ratio (attnum.testing.FACTOR)"),
    "speed_forward_ms": ("ms", "median forward time"),
    "speed_forward_backward_ms": ("ms", "median forward + backward time"),
    "speed_status": ("1", "ok, or why the kernel was not timed"),
    "speed_seq_len": ("1", "sequence length of the timing"),
    "speed_head_dim": ("1", "head dim of the timing"),
    "speed_heads": ("1", "heads of the timing"),
}


def measure(names, against, p: dict, *, device: str = "cpu", progress: bool = True) -> xr.Dataset:
    """Every section of the report on the kernels ``names`` and the registry kernels ``against``."""
    from ..testing import FACTOR

    every = list(dict.fromkeys(list(names) + list(against)))
    parts = [forward_band(every, p, device, progress), extremes(every, p, device, progress),
             backward_offsets(every, p, device, progress), speed(every, p, device)]
    ds = xr.merge(parts, combine_attrs="drop_conflicts", compat="override", join="outer")
    ds["fwd_ratio_factor"] = FACTOR
    ds["under_test"] = ("kernel", [name in names for name in every])
    ds["under_test"].attrs.update(units="1", long_name="1: a kernel under test, 0: a registry kernel set beside them")
    return ds


def variables_table(ds: xr.Dataset) -> dict:
    """CF units and long names of every variable of the report's dataset: the studies' own tables
    (``VARIABLES`` of studies 01, 02 and 04) under the section's prefix, and the report's."""
    from ..studies import extreme_inputs, late_training_gradient_blowup, length_scaling
    from .rates import VARIABLES as RATES

    table = {**VARIABLES, **RATES}
    for prefix, study in (("fwd_", length_scaling), ("ext_", extreme_inputs), ("bwd_", late_training_gradient_blowup)):
        for name, entry in study.VARIABLES.items():
            if name.startswith("real_"):
                table.setdefault(prefix + name[5:], entry)
    for name in ds.variables:  # coordinates the studies' tables leave without a description
        if name not in table and name in ds.coords:
            table[name] = ("1", f"coordinate {name}")
    return table
