"""False alarms and misses of ``attnum.testing.assert_attention_close``: on correct kernels (emulator
configurations of the production policies, unblocked attention under them, SDPA's math backend) and on
study 02's injected faults (``attnum.kernels.faults``, every severity level, in the ``fa2_bf16``
emulator with ``FAULT_BLOCK`` tiles), over N(0, 1) inputs with and without the causal mask."""
from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from .. import kernels
from ..inputs import normal_qkv
from ..kernels import FAULTS, make_fault
from ..progress import tqdm
from ..testing import check_attention_close, reference_values

CORRECT_KERNELS = ("emulator:fa2_bf16:bk64", "emulator:fa2_bf16:bk128:fused", "emulator:fa2_bf16:bk64:fa1",
                   "reference:fa2_bf16", "sdpa:math", "emulator:fa2_fp16:bk128", "reference:fa2_fp16")
"""Kernels that are correct for their precision: the emulator under other tilings, loop orders and FA3's
fused scale-max, unblocked attention under the same policy, and SDPA's math backend (fp32 inside)."""


FAULT_BLOCK = 32
"""Tile size of the faulty emulator: several key blocks even at the small N of a quick tier, so that the
faults of the online softmax's rescaling (missed rescale, stale max) act."""


def _fmt(name: str) -> str:
    return "fp16" if "fp16" in name else "bf16"


def helper_rates(seq_lens, seeds, *, head_dim: int = 64, heads: int = 2, causal_modes=(False, True),
                 faults=tuple(FAULTS), device: str = "cpu", progress: bool = True) -> xr.Dataset:
    """``helper_false_alarm`` (kernel x N x seed x mask: 1 where the check failed a correct kernel) and
    ``helper_missed`` (fault x level x ...: 1 where it passed a faulty output that differs from the correct
    emulator's; NaN where the fault left the output unchanged), with the faulty outputs' error ratio."""
    levels = max(len(FAULTS[f].severities) for f in faults)
    base = (len(seq_lens), len(seeds), len(causal_modes))
    alarm = np.full((len(CORRECT_KERNELS),) + base, np.nan)
    missed = np.full((len(faults), levels) + base, np.nan)
    ratio = np.full((len(faults), levels) + base, np.nan)
    work = [(i, n, j, s, c, causal) for i, n in enumerate(seq_lens) for j, s in enumerate(seeds)
            for c, causal in enumerate(causal_modes)]
    for i, n, j, seed, c, causal in tqdm(work, desc="helper rates", disable=not progress):
        q64, k64, v64 = normal_qkv(1, heads, n, head_dim, seed=seed, device=device)
        refs = {}
        for fmt in ("bf16", "fp16"):
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
            qkv = tuple(t.to(dtype) for t in (q64, k64, v64))
            refs[fmt] = (qkv, reference_values(*qkv, fmt=fmt, causal=causal))
        for a, name in enumerate(CORRECT_KERNELS):
            kernel = kernels.get(name)
            if kernel.unavailable_reason(device):
                continue
            qkv, ref = refs[_fmt(name)]
            alarm[a, i, j, c] = not check_attention_close(kernel, *qkv, causal=causal, reference=ref).passed
        qkv, ref = refs["bf16"]
        correct = kernels.emulator("fa2_bf16", block_q=FAULT_BLOCK, block_k=FAULT_BLOCK).forward(*qkv, causal=causal)[0]
        for f, fault in enumerate(faults):
            for lev in range(len(FAULTS[fault].severities)):
                out = kernels.emulator("fa2_bf16", block_q=FAULT_BLOCK, block_k=FAULT_BLOCK,
                                       fault=make_fault(fault, level=lev)).forward(*qkv, causal=causal)[0]
                if torch.equal(torch.nan_to_num(out, nan=7.0), torch.nan_to_num(correct, nan=7.0)):
                    continue  # the fault did not act on these inputs: nothing to detect
                res = check_attention_close(out, *qkv, causal=causal, reference=ref, fmt="bf16")
                missed[f, lev, i, j, c] = res.passed
                ratio[f, lev, i, j, c] = res.rel_l2 / res.emulator_rel_l2 if res.emulator_rel_l2 else np.nan
    dims = ("helper_seq_len", "helper_seed", "helper_causal")
    coords = {"helper_kernel": list(CORRECT_KERNELS), "helper_fault": list(faults),
              "helper_level": list(range(levels)), "helper_seq_len": list(seq_lens), "helper_seed": list(seeds),
              "helper_causal": [int(x) for x in causal_modes]}
    ds = xr.Dataset({"helper_false_alarm": (("helper_kernel",) + dims, alarm),
                     "helper_missed": (("helper_fault", "helper_level") + dims, missed),
                     "helper_fault_ratio": (("helper_fault", "helper_level") + dims, ratio)}, coords=coords)
    ds["helper_fault_severity"] = (("helper_fault", "helper_level"),
                                   [[float(FAULTS[f].severities[lv]) if lv < len(FAULTS[f].severities) else np.nan
                                     for lv in range(levels)] for f in faults])
    return ds


VARIABLES = {
    "helper_false_alarm": ("1", "1 where assert_attention_close failed a correct kernel"),
    "helper_missed": ("1", "1 where assert_attention_close passed an output changed by an injected fault"),
    "helper_fault_ratio": ("1", "faulty output's relative L2 error over the emulator's on the same inputs"),
    "helper_fault_severity": ("1", "severity value of the fault level (attnum.kernels.faults)"),
}
