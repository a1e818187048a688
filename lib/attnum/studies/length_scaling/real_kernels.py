"""Real kernels of the registry (``attnum.kernels``) beside the emulator: errors against the fp64 golden
value, acceptance verdicts, and the fidelity of each emulator configuration to each kernel; and the committed
CUDA runs that measured them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import xarray as xr

from ... import acceptance, kernels
from ...metrics import error_summary
from ...precision import FORMATS, policy_for, round_to
from ...progress import tqdm
from .experiments import _inputs

if TYPE_CHECKING:  # the tables' type in annotations only; pandas is imported where they are built
    import pandas as pd

LONG_SEQUENCE_MIN = 16384
"""Lengths from which the notebook speaks of long sequences (the GPU tier's)."""


BOOLEAN_COORDINATES = ("real_causal",)
"""The study's yes/no coordinates: written as booleans (a CF flag, ``ncio``); runs committed before that hold
them as 0/1 integers, which ``boolean_coordinates`` reads as booleans."""


def boolean_coordinates(ds: xr.Dataset | None) -> xr.Dataset | None:
    """``ds`` with every coordinate of ``BOOLEAN_COORDINATES`` that a run wrote as 0/1 integers as booleans, so
    that ``sel(real_causal=True)`` works on old and new runs alike (None stays None)."""
    from ...ncio import boolean_coordinates as as_booleans

    return as_booleans(ds, BOOLEAN_COORDINATES)


def measured_on_cuda(ds: xr.Dataset | None) -> bool:
    """Whether ``ds`` is a run that measured real kernels on a CUDA device (at least one output)."""
    return (ds is not None and "real_rel_l2_err" in ds and "cuda" in ds.attrs.get("device", "")
            and bool(ds["real_rel_l2_err"].notnull().any()))


def committed_real_kernel_runs() -> list[xr.Dataset]:
    """The committed CUDA runs (``<outputs>/length_scaling/gpu*``, read by ``ncio.committed_run``) that
    measured real kernels, shortest lengths first: what a CPU run shows of the kernels it cannot run."""
    from ...ncio import committed_run
    from ...paths import outputs_root

    runs = []
    for folder in sorted((outputs_root() / "length_scaling").glob("gpu*")):
        ds = boolean_coordinates(committed_run("length_scaling", folder.name)) if folder.is_dir() else None
        if measured_on_cuda(ds):
            ds.attrs["run"] = folder.name
            runs.append(ds)
    return sorted(runs, key=lambda ds: int(ds["real_seq_len"].min()))


LONGEST_RUN = "gpu_long"
"""The parameter set (and committed run folder) that measures the real kernels at the study's longest length."""


def longest_real_run(ds: xr.Dataset | None) -> xr.Dataset | None:
    """The run whose real kernels reach the longest length: ``ds`` itself when it is a ``gpu_long`` run that
    measured them on a GPU (its parameter set, or an override of it), else the committed
    ``<outputs>/length_scaling/gpu_long`` when it did; None without either."""
    import json

    from ...ncio import committed_run

    if measured_on_cuda(ds) and json.loads(ds.attrs.get("parameters", "{}")).get("output_dir", "").startswith(
            f"length_scaling/{LONGEST_RUN}"):
        ds.attrs.setdefault("run", "this run")
        return boolean_coordinates(ds)
    run = boolean_coordinates(committed_run("length_scaling", LONGEST_RUN))
    return run if measured_on_cuda(run) else None


def overlap_values(a: xr.Dataset | None, b: xr.Dataset | None) -> dict:
    """Two runs' real-kernel errors where both measured the same kernel, dtype, head dim, mask, N and seed (the
    same inputs: ``_inputs`` depends on those and on ``batch`` and ``heads``, which must agree): ``cases``, how
    many; ``equal``, how many gave the identical error; ``max_rel_diff``, the largest |a - b| / a; ``n``, the
    lengths they share (a comma list); ``text``, a fixed phrase with these numbers, or saying why there are none.
    Every number None when a run is missing, or the runs share no case or differ in batch or heads."""
    import json

    out = {"cases": None, "equal": None, "max_rel_diff": None, "n": None,
           "text": "not compared: no second run with real kernels was at hand"}
    if a is None or b is None or "real_rel_l2_err" not in a or "real_rel_l2_err" not in b:
        return out
    out["text"] = "not compared: the two runs share no case measured on the same inputs"
    pa, pb = (json.loads(x.attrs.get("parameters", "{}")) for x in (a, b))
    if (pa.get("batch"), pa.get("heads")) != (pb.get("batch"), pb.get("heads")):
        return out
    common = {}
    for dim in ("real_kernel", "real_dtype", "real_head_dim", "real_causal", "real_seq_len", "real_seed"):
        shared = [x for x in a[dim].values.tolist() if x in set(b[dim].values.tolist())]
        if not shared:
            return out
        common[dim] = shared
    # by position: a list of booleans given to sel would be read as a mask, not as labels of real_causal
    ea, eb = (x["real_rel_l2_err"].isel({dim: [x[dim].values.tolist().index(v) for v in shared]
                                         for dim, shared in common.items()}).values.ravel() for x in (a, b))
    ok = np.isfinite(ea) & np.isfinite(eb)
    if not ok.any():
        return out
    ea, eb = ea[ok], eb[ok]
    out.update(cases=int(ok.sum()), equal=int((ea == eb).sum()), max_rel_diff=float(np.max(np.abs(ea - eb) / ea)),
               n=", ".join(str(int(n)) for n in common["real_seq_len"]))
    out["text"] = (f"at N = {out['n']}, of the {out['cases']} cases (kernel, dtype, head dim, mask, N, seed) both "
                   f"measured, {out['equal']} gave the identical error; the largest relative difference is "
                   f"{out['max_rel_diff']:.2g}")
    return out


REAL_ERRORS = ("rel_l2", "max_abs")


def fidelity_configs(block_ks) -> list[tuple[int, bool]]:
    """The emulator configurations a real kernel is compared with: FA2 loop, each key block,
    subtract-then-scale or FA3's fused scale-max (the policy is ``fa2_<dtype>``)."""
    return [(int(bk), fused) for bk in block_ks for fused in (False, True)]


def fidelity_label(block_k: int, fused: bool) -> str:
    return f"bk{block_k}" + (":fused" if fused else "")


def real_kernel_sweep(kernel_names, seq_lens, dtypes, head_dims, causal_modes, seeds, *, block_ks,
                      batch, heads, device, golden_chunk, reference_chunk,
                      progress=True) -> xr.Dataset:
    """Real kernels of the registry on the inputs the emulator gets, against the fp64 golden value.

    Per kernel, dtype, head dim, mask, N and seed: the relative L2 and max error of the output; the
    verdict of every acceptance rule (``acceptance.judge``, the same-precision reference being
    unblocked attention with every stage in the dtype); and the **fidelity** of each emulator
    configuration (``fidelity_configs``, policy ``fa2_<dtype>``): the fraction of output elements
    bitwise equal to the kernel's, and the correlation of the two kernels' deviations from the
    golden value rounded to the dtype (subtracting the output rounding both share). A kernel that
    cannot run here, refuses the inputs or runs out of memory is recorded with the reason (``status``),
    never replaced by another.
    """
    configs = fidelity_configs(block_ks)
    kernels_ = [kernels.get(name) for name in kernel_names]
    base = (len(dtypes), len(head_dims), len(causal_modes), len(seq_lens), len(seeds))
    err = {m: np.full((len(kernels_),) + base, np.nan) for m in REAL_ERRORS}
    emu_err = np.full((len(configs),) + base, np.nan)
    bitwise = np.full((len(kernels_), len(configs)) + base, np.nan)
    corr = np.full((len(kernels_), len(configs)) + base, np.nan)
    passes = np.full((len(acceptance.RULES), len(kernels_)) + base, np.nan)
    status = np.full((len(kernels_),) + base[:-1], "ok", dtype=object)
    work = [(a, fmt, b, d, c, causal, i, n, j, seed) for a, fmt in enumerate(dtypes) for b, d in enumerate(head_dims)
            for c, causal in enumerate(causal_modes) for i, n in enumerate(seq_lens) for j, seed in enumerate(seeds)]
    for a, fmt, b, d, c, causal, i, n, j, seed in tqdm(work, desc="real kernels", disable=not progress):
        q, k, v = _inputs(fmt, n, seed, batch, heads, d, device)
        gold = kernels.get("golden", chunk=golden_chunk).forward(q, k, v, causal=causal)[0]
        gold_rounded = round_to(gold.float(), fmt).double()
        ref = kernels.reference(policy_for("all", fmt), query_chunk=reference_chunk or None)
        reference_max_abs = error_summary(ref.forward(q, k, v, causal=causal)[0], gold, fmt)["max_abs"]
        floor = acceptance.dtype_floor(gold, fmt)
        x_max = max(t.abs().max().item() for t in (q, k, v))
        emulated = []
        for e, (bk, fused) in enumerate(configs):
            out_e = kernels.emulator(policy_for("fa2", fmt), block_q=128, block_k=bk, fused_scale_max=fused).forward(
                q, k, v, causal=causal)[0]
            emu_err[e, a, b, c, i, j] = error_summary(out_e, gold, fmt)["rel_l2"]
            emulated.append(out_e)
        low = FORMATS[fmt]
        for kk, kernel in enumerate(kernels_):
            reason = kernel.unavailable_reason(device)
            if reason:
                status[kk, a, b, c, i] = f"unavailable: {reason}"
                continue
            try:
                out = kernel.forward(q.to(low), k.to(low), v.to(low), causal=causal)[0]
            except torch.OutOfMemoryError as exc:
                torch.cuda.empty_cache()
                status[kk, a, b, c, i] = f"out of memory: {str(exc).splitlines()[0][:200]}"
                continue
            except Exception as exc:  # noqa: BLE001
                # a kernel that refuses these inputs (a dtype, head dim or length it does not take): packages
                # refuse by ValueError, RuntimeError, an assertion (flash-attn-4) or errors of their own; each
                # is recorded with its type and message, and the kernel is never replaced by another
                message = (str(exc).splitlines() or [""])[0][:300]
                status[kk, a, b, c, i] = f"refused: {type(exc).__name__}: {message}"
                continue
            out = out.float()
            summary = error_summary(out, gold, fmt)
            for m in REAL_ERRORS:
                err[m][kk, a, b, c, i, j] = summary[m]
            verdict = acceptance.judge(rel_l2=summary["rel_l2"], max_abs=summary["max_abs"], n=n, x_max=x_max,
                                       fmt=fmt, reference_max_abs=reference_max_abs, floor=floor)
            passes[:, kk, a, b, c, i, j] = [verdict[rule] for rule in acceptance.RULES]
            dev_k = (out.double() - gold_rounded).flatten()
            for e, out_e in enumerate(emulated):
                bitwise[kk, e, a, b, c, i, j] = (out == out_e).double().mean().item()
                dev_e = (out_e.double() - gold_rounded).flatten()
                corr[kk, e, a, b, c, i, j] = _correlation(dev_k, dev_e)
            del out
    dims = ("real_dtype", "real_head_dim", "real_causal", "real_seq_len", "real_seed")
    coords = {"real_kernel": [k.name for k in kernels_], "fidelity_config": [fidelity_label(*c) for c in configs],
              "real_dtype": list(dtypes), "real_head_dim": list(head_dims),
              "real_causal": [bool(x) for x in causal_modes], "real_seq_len": list(seq_lens),
              "real_seed": list(seeds), "rule": list(acceptance.RULES)}
    ds = xr.Dataset({f"real_{m}_err": (("real_kernel",) + dims, err[m]) for m in REAL_ERRORS}, coords=coords)
    ds["real_emulator_rel_l2_err"] = (("fidelity_config",) + dims, emu_err)
    ds["real_bitwise_equal"] = (("real_kernel", "fidelity_config") + dims, bitwise)
    ds["real_error_corr"] = (("real_kernel", "fidelity_config") + dims, corr)
    ds["real_passes"] = (("rule", "real_kernel") + dims, passes)
    ds["real_status"] = (("real_kernel",) + dims[:-1], status.astype(str))
    return ds


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two deviations (NaN when either is constant or not finite)."""
    ok = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[ok] - a[ok].mean(), b[ok] - b[ok].mean()
    den = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    return (a @ b / den).item() if den > 0 else float("nan")


def best_fidelity(ds: xr.Dataset) -> "pd.DataFrame":
    """Per real kernel (dtype, head dim, mask): the emulator configuration with the highest mean
    bitwise-equal fraction over N and seeds, with that fraction and the mean error correlation."""
    import pandas as pd

    rows = []
    mean_bits = ds["real_bitwise_equal"].mean(["real_seq_len", "real_seed"])
    mean_corr = ds["real_error_corr"].mean(["real_seq_len", "real_seed"])
    for kernel in ds["real_kernel"].values:
        for fmt in ds["real_dtype"].values:
            for d in ds["real_head_dim"].values:
                for causal in ds["real_causal"].values:
                    sel = dict(real_kernel=kernel, real_dtype=fmt, real_head_dim=d, real_causal=causal)
                    bits = mean_bits.sel(sel)
                    if not np.isfinite(bits.values).any():
                        continue
                    best = str(bits.idxmax("fidelity_config").values)
                    rows.append({"kernel": kernel, "dtype": fmt, "head_dim": int(d), "causal": bool(causal),
                                 "best emulator config": best,
                                 "bitwise equal": float(bits.sel(fidelity_config=best)),
                                 "error corr": float(mean_corr.sel(sel).sel(fidelity_config=best))})
    return pd.DataFrame(rows)


# -- what the notebook states, computed from a results dataset ---------------------------------------
# Each function returns a table and/or sentences built from the numbers of the dataset it is given
# (this run's, or a committed GPU run's); a variable the dataset lacks gives a sentence saying so.

SEED000_MEAN_REL = {512: 0.0005, 1024: 0.0012, 2048: 0.0035, 4096: 0.012}
"""Seed 000's mean relative output errors of its MI210 port by N (the ROCm migration report, an unpublished
source document described in ``docs/sources.md``)."""
SEED000_TAIL_SHARE = 0.62
"""Seed 000: at n = 4096 the last 10% of the denominator's terms contribute 62% of the total error."""


def real_false_alarms(run: xr.Dataset, min_len: int = LONG_SEQUENCE_MIN) -> "pd.DataFrame":
    """False-alarm rate of each rule on each real kernel over the outputs at N >= ``min_len``, with
    the number of outputs it is taken over (kernels that gave none there are left out)."""
    import pandas as pd

    p = run["real_passes"].sel(real_seq_len=[n for n in run["real_seq_len"].values if n >= min_len])
    rows = []
    for kernel in run["real_kernel"].values:
        for rule in run["rule"].values:
            v = p.sel(real_kernel=kernel, rule=rule).values
            v = v[np.isfinite(v)]
            if v.size:
                rows.append({"kernel": kernel, "rule": rule, "false alarms": 1 - v.mean(), "outputs": v.size})
    if not rows:
        return pd.DataFrame(columns=["false alarms", "outputs"])
    return pd.DataFrame(rows).set_index(["kernel", "rule"])


def fidelity_by_length(run: xr.Dataset) -> "pd.DataFrame":
    """Per real kernel, dtype and N: the bitwise-equal share and deviation correlation of each case's best
    emulator configuration (``best_fidelity``, per dtype, head dim and mask), averaged over head dims,
    masks and seeds. Does the emulator reproduce the kernel equally well at every length?"""
    import pandas as pd

    best = best_fidelity(run)
    rows = []
    for _, b in best.iterrows():
        sel = dict(real_kernel=b["kernel"], real_dtype=b["dtype"], real_head_dim=b["head_dim"],
                   real_causal=bool(b["causal"]), fidelity_config=b["best emulator config"])
        bits = run["real_bitwise_equal"].sel(sel).mean("real_seed")
        corr = run["real_error_corr"].sel(sel).mean("real_seed")
        for n in run["real_seq_len"].values:
            rows.append({"kernel": b["kernel"], "dtype": b["dtype"], "N": int(n),
                         "bitwise equal": float(bits.sel(real_seq_len=n)), "error corr": float(corr.sel(real_seq_len=n))})
    if not rows:
        return pd.DataFrame(columns=["bitwise equal", "error corr"])
    return pd.DataFrame(rows).groupby(["kernel", "dtype", "N"], sort=False).mean()


# -- readings of a run's real kernels (tables and values the notebook states) --------------------------

REAL_KERNELS_STATED = ("sdpa:flash", "sdpa:efficient", "sdpa:cudnn", "sdpa:math", "triton:fa2", "flex", "fa4",
                       "flashinfer:prefill")
"""The registry kernels the notebook's prose names (keys ``<kernel with : as _>_*``); others are in the tables."""


def kernel_key(kernel: str) -> str:
    """A glue-key form of a registry name: ``sdpa:cudnn`` -> ``sdpa_cudnn``."""
    return "".join(c if c.isalnum() else "_" for c in kernel.lower())


def real_kernel_table(run: xr.Dataset) -> "pd.DataFrame":
    """Per real kernel: its best emulator configurations, the range of their bitwise-equal share and error
    correlation over dtype, head dim and mask, its error range per dtype, and where it gave no output (and why)."""
    import pandas as pd

    best = best_fidelity(run)
    rows = []
    for kernel in run["real_kernel"].values:
        b = best[best["kernel"] == kernel]
        status = run["real_status"].sel(real_kernel=kernel)
        row = {"kernel": kernel, "best configs": ", ".join(sorted(set(b["best emulator config"]))) or None,
               "bitwise min": b["bitwise equal"].min() if len(b) else np.nan,
               "bitwise max": b["bitwise equal"].max() if len(b) else np.nan,
               "corr min": b["error corr"].min() if len(b) else np.nan,
               "corr max": b["error corr"].max() if len(b) else np.nan}
        for fmt in run["real_dtype"].values:
            e = run["real_rel_l2_err"].sel(real_kernel=kernel, real_dtype=fmt)
            row[f"{fmt} error min"], row[f"{fmt} error max"] = float(e.min()), float(e.max())
        bad = sorted({str(x).split(":")[0] for x in status.values.flatten() if x != "ok"})
        row["no output"] = ", ".join(bad) or None
        row["no output at N"] = ", ".join(str(int(n)) for n in status["real_seq_len"].values
                                          if (status.sel(real_seq_len=n) != "ok").any()) or None
        rows.append(row)
    return pd.DataFrame(rows).set_index("kernel")


def fidelity_length_table(run: xr.Dataset) -> "pd.DataFrame":
    """Per real kernel and dtype: its best configurations' bitwise share and correlation at the shortest and the
    longest N where it gave an output (``fidelity_by_length``)."""
    import pandas as pd

    t = fidelity_by_length(run)
    rows = []
    for (kernel, fmt), sub in t.groupby(level=["kernel", "dtype"], sort=False):
        sub = sub.droplevel(["kernel", "dtype"]).dropna(subset=["bitwise equal"])
        if sub.empty:
            continue
        rows.append({"kernel": kernel, "dtype": fmt, "N short": int(sub.index[0]), "N long": int(sub.index[-1]),
                     "bitwise short": sub["bitwise equal"].iloc[0], "bitwise long": sub["bitwise equal"].iloc[-1],
                     "corr short": sub["error corr"].iloc[0], "corr long": sub["error corr"].iloc[-1]})
    return pd.DataFrame(rows).set_index(["kernel", "dtype"]) if rows else pd.DataFrame()


def real_growth_table(run: xr.Dataset) -> "pd.DataFrame":
    """Per real kernel, mask and dtype: its median error's factor from the shortest to the longest N where it
    gave an output (range over head dims), beside the emulator's (``fa2_<dtype>``, its configurations' range)."""
    import pandas as pd

    rows = []
    for causal in run["real_causal"].values:
        err = run["real_rel_l2_err"].sel(real_causal=causal).median("real_seed")
        emu = run["real_emulator_rel_l2_err"].sel(real_causal=causal).median("real_seed")
        for kernel in run["real_kernel"].values:
            for fmt in run["real_dtype"].values:
                e = err.sel(real_kernel=kernel, real_dtype=fmt)
                ok = [n for n in run["real_seq_len"].values if np.isfinite(e.sel(real_seq_len=n).values).all()]
                if len(ok) < 2:
                    continue
                f = (e.sel(real_seq_len=ok[-1]) / e.sel(real_seq_len=ok[0])).values
                fe = (emu.sel(real_dtype=fmt, real_seq_len=ok[-1]) / emu.sel(real_dtype=fmt, real_seq_len=ok[0])).values
                rows.append({"kernel": kernel, "mask": "causal" if causal else "none", "dtype": fmt,
                             "N short": int(ok[0]), "N long": int(ok[-1]), "growth min": float(np.min(f)),
                             "growth max": float(np.max(f)), "emulator growth min": float(np.min(fe)),
                             "emulator growth max": float(np.max(fe))})
    return pd.DataFrame(rows).set_index(["kernel", "mask", "dtype"]) if rows else pd.DataFrame()


def real_error_at_longest(run: xr.Dataset) -> "pd.DataFrame":
    """Per real kernel and dtype: the longest N where it gave an output for every head dim and mask, and the range
    of its median relative L2 error there over head dims and masks (``err min``, ``err max``)."""
    import pandas as pd

    err = run["real_rel_l2_err"].median("real_seed")
    rows = []
    for kernel in run["real_kernel"].values:
        for fmt in run["real_dtype"].values:
            e = err.sel(real_kernel=kernel, real_dtype=fmt)
            ok = [n for n in run["real_seq_len"].values if np.isfinite(e.sel(real_seq_len=n).values).all()]
            if ok:
                at = e.sel(real_seq_len=ok[-1]).values
                rows.append({"kernel": kernel, "dtype": fmt, "N": int(ok[-1]), "err min": float(np.min(at)),
                             "err max": float(np.max(at))})
    return pd.DataFrame(rows).set_index(["kernel", "dtype"]) if rows else pd.DataFrame()


def _sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test: the probability, under a fair coin, of a split at least as uneven as
    ``wins``:``losses`` (ties left out before the call)."""
    from math import comb

    n = wins + losses
    if n == 0:
        return float("nan")
    k = min(wins, losses)
    return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n)


def fused_contrast(run: xr.Dataset) -> "pd.DataFrame":
    """Does a kernel compute the scores' scale and max subtraction as one fused step (FlashAttention-3's forward,
    seed 004) or as two (subtract, then scale)? Per real kernel, over every case (dtype, head dim, mask, N, seed)
    and key block of the run: the bitwise-equal share of the fused emulator configuration minus that of the
    unfused one at the same key block. ``fused better`` / ``unfused better``: the cases where the difference is
    positive / negative (ties, usually where the kernel matches neither, left out); ``sign p``: the two-sided
    sign test of that split; ``mean``, ``min``, ``max``: of the differences; ``best bitwise``: the kernel's best
    configuration's share (``best_fidelity``), which says how near the emulator the kernel is at all."""
    import pandas as pd

    best = best_fidelity(run)
    labels = [str(c) for c in run["fidelity_config"].values]
    pairs = [(c, c + ":fused") for c in labels if not c.endswith(":fused") and c + ":fused" in labels]
    rows = []
    for kernel in run["real_kernel"].values:
        bits = run["real_bitwise_equal"].sel(real_kernel=kernel)
        diffs = np.concatenate([(bits.sel(fidelity_config=f) - bits.sel(fidelity_config=u)).values.ravel()
                                for u, f in pairs]) if pairs else np.array([])
        diffs = diffs[np.isfinite(diffs)]
        if not diffs.size:
            continue
        wins, losses = int((diffs > 0).sum()), int((diffs < 0).sum())
        b = best[best["kernel"] == kernel]["bitwise equal"]
        rows.append({"kernel": kernel, "cases": int(diffs.size), "fused better": wins, "unfused better": losses,
                     "sign p": _sign_test_p(wins, losses), "mean": float(diffs.mean()), "min": float(diffs.min()),
                     "max": float(diffs.max()), "best bitwise": float(b.max()) if len(b) else np.nan})
    return pd.DataFrame(rows).set_index("kernel") if rows else pd.DataFrame()


FUSED_DECIDED_P = 0.01
"""The sign test's p below which ``fused_reading`` says the fidelity map tells the two orders apart."""


def fused_reading(contrast: "pd.DataFrame", kernel: str) -> str | None:
    """A fixed phrase filled with ``fused_contrast``'s numbers for ``kernel`` (None when the run lacks it): which
    order matches more of its outputs and whether the split is beyond chance (sign test p < ``FUSED_DECIDED_P``)."""
    if contrast is None or not len(contrast) or kernel not in contrast.index:
        return None
    row = contrast.loc[kernel]
    split = (f"the fused configuration matches more outputs in {int(row['fused better'])} and the unfused one in "
             f"{int(row['unfused better'])} of {int(row['cases'])} cases (sign test p = {row['sign p']:.2g}; mean "
             f"difference {row['mean']:+.2g} of the outputs, range {row['min']:+.2g} to {row['max']:+.2g})")
    return f"{split}: {fused_verdict(contrast, kernel)}"


REPRODUCED_BITS = (0.95, 0.80)
"""Bitwise-equal shares (best configuration, bf16, shortest N) from which ``reproduction`` says a kernel is
reproduced nearly bit for bit (at or above the first), in part (between), or not (at or below the second)."""


def reproduction(bits_short: float | None) -> str | None:
    """A fixed phrase for how closely the emulator reproduces a kernel, from its best configuration's bitwise-equal
    share at the shortest N (bf16; None: not measured)."""
    if bits_short is None or not np.isfinite(bits_short):
        return None
    high, low = REPRODUCED_BITS
    if bits_short >= high:
        return "reproduced nearly bit for bit by its best emulator configuration"
    if bits_short <= low:
        return "not reproduced bit for bit by any emulator configuration tried"
    return "reproduced in part by its best emulator configuration"


def fused_verdict(contrast: "pd.DataFrame", kernel: str) -> str | None:
    """The verdict of ``fused_reading`` alone: which order the fidelity map favours for ``kernel``, or that it
    does not tell them apart (None when the run lacks the kernel)."""
    if contrast is None or not len(contrast) or kernel not in contrast.index:
        return None
    row = contrast.loc[kernel]
    if row["sign p"] < FUSED_DECIDED_P:
        order = "fused" if row["fused better"] > row["unfused better"] else "unfused (subtract, then scale)"
        return f"the map favours the {order} order"
    return "the map does not tell the two orders apart"


def math_backend_values(run: xr.Dataset | None, kernel: str = "sdpa:math") -> dict:
    """Is the math backend the fp32-inside reference? The range (``ratio_min``, ``ratio_max``) over ``cases``
    of its median error (no mask) over the emulated fp32-inside reference's at the same N, dtype and head dim
    (other inputs: a ratio near 1 says the same arithmetic, not the same bits); None where not measurable."""
    import json

    out = {"ratio_min": None, "ratio_max": None, "cases": 0, "head_dim": None}
    if run is None or kernel not in run["real_kernel"].values or "fp32_inside_rel_l2_err" not in run:
        return out
    head_dim = json.loads(run.attrs.get("parameters", "{}")).get("head_dim")
    out["head_dim"] = head_dim
    if head_dim not in run["real_head_dim"].values:
        return out
    real = run["real_rel_l2_err"].sel(real_kernel=kernel, real_causal=False, real_head_dim=head_dim).median("real_seed")
    inside = run["fp32_inside_rel_l2_err"].median("seed")
    ratios = []
    for fmt in real["real_dtype"].values:
        if fmt not in inside["dtype"].values:
            continue
        for n in real["real_seq_len"].values:
            r = float(real.sel(real_dtype=fmt, real_seq_len=n))
            if np.isfinite(r) and n in inside["seq_len"].values:
                ratios.append(r / float(inside.sel(dtype=fmt, seq_len=n)))
    if ratios:
        out.update(ratio_min=min(ratios), ratio_max=max(ratios), cases=len(ratios))
    return out


def real_false_alarms_by_dtype(run: xr.Dataset, min_len: int = LONG_SEQUENCE_MIN) -> "pd.DataFrame":
    """False-alarm rate of each rule over every real kernel's outputs at N >= ``min_len``, per dtype."""
    import pandas as pd

    p = run["real_passes"].sel(real_seq_len=[n for n in run["real_seq_len"].values if n >= min_len])
    rows = {}
    for rule in run["rule"].values:
        for fmt in run["real_dtype"].values:
            v = p.sel(rule=rule, real_dtype=fmt).values
            v = v[np.isfinite(v)]
            rows.setdefault(rule, {})[fmt] = 1 - v.mean() if v.size else np.nan
    return pd.DataFrame(rows).T.rename_axis("rule")


def real_kernel_values(run: xr.Dataset | None, min_len: int = LONG_SEQUENCE_MIN) -> dict:
    """The numbers the prose about a run's real kernels states, same keys for every run (None where the run
    did not measure a kernel): per kernel of ``REAL_KERNELS_STATED`` (``k`` = ``kernel_key``): ``k_best`` (its
    best configurations), ``k_bits_min``/``_max``, ``k_bits_<dtype>_short``/``_long`` and
    ``k_corr_<dtype>_short``/``_long`` (best configuration at the shortest and longest N),
    ``k_growth_<dtype>_nomask_max`` (error growth without a mask), ``k_err_<dtype>_n_long`` and
    ``k_err_<dtype>_long_min``/``_max`` (the longest N with an output and the error range there,
    ``real_error_at_longest``), ``k_fused`` and ``k_fused_verdict`` (``fused_reading``, ``fused_verdict``), ``k_reproduction``
    (``reproduction`` of ``k_bits_bf16_short``),
    ``k_runs_as`` (what ran under the name: the run's ``real_kernel_backends``), ``k_no_output`` (why none, or
    ``"none"``);
    the emulator's growth range without a mask (``emulator_growth_<dtype>_nomask_max``); and each rule's
    false-alarm rate at N >= ``min_len`` over all kernels per dtype (``alarms_<rule>_<dtype>``)."""
    import json

    out = {"commit": None, "device": None, "n_min": None, "n_max": None}
    dtypes, rules = ("bf16", "fp16"), {"fixed_0.1pct": "fixed", "dynamic_threshold": "dynamic",
                                       "reference_relative": "refrel"}
    summary = real_kernel_table(run) if run is not None else None
    by_n = fidelity_length_table(run) if run is not None else None
    growth = real_growth_table(run) if run is not None else None
    alarms = real_false_alarms_by_dtype(run, min_len) if run is not None else None
    longest = real_error_at_longest(run) if run is not None else None
    contrast = fused_contrast(run) if run is not None else None
    runs_as = json.loads(run.attrs.get("real_kernel_backends", "{}")) if run is not None else {}
    if run is not None:
        out.update(commit=str(run.attrs.get("git_commit", ""))[:7] or None, device=run.attrs.get("device"),
                   n_min=int(run["real_seq_len"].min()), n_max=int(run["real_seq_len"].max()))

    def cell(table, index, column):
        if table is None or not len(table) or index not in table.index or column not in table.columns:
            return None
        value = table.loc[index, column]
        # an object column holds None where one kernel has nothing to say and another has a string
        if value is None or (isinstance(value, float) and not np.isfinite(value)):
            return None
        return value if isinstance(value, str) else float(value)

    for kernel in REAL_KERNELS_STATED:
        k = kernel_key(kernel)
        out[f"{k}_best"] = cell(summary, kernel, "best configs")
        out[f"{k}_bits_min"], out[f"{k}_bits_max"] = cell(summary, kernel, "bitwise min"), cell(summary, kernel, "bitwise max")
        measured = summary is not None and kernel in summary.index
        out[f"{k}_no_output"] = (cell(summary, kernel, "no output") or "none") if measured else None
        for fmt in dtypes:
            for end in ("short", "long"):
                out[f"{k}_bits_{fmt}_{end}"] = cell(by_n, (kernel, fmt), f"bitwise {end}")
                out[f"{k}_corr_{fmt}_{end}"] = cell(by_n, (kernel, fmt), f"corr {end}")
            out[f"{k}_growth_{fmt}_nomask_max"] = cell(growth, (kernel, "none", fmt), "growth max")
            n_long = cell(longest, (kernel, fmt), "N")
            out[f"{k}_err_{fmt}_n_long"] = None if n_long is None else int(n_long)
            out[f"{k}_err_{fmt}_long_min"] = cell(longest, (kernel, fmt), "err min")
            out[f"{k}_err_{fmt}_long_max"] = cell(longest, (kernel, fmt), "err max")
        out[f"{k}_fused"] = fused_reading(contrast, kernel)
        out[f"{k}_reproduction"] = reproduction(out[f"{k}_bits_bf16_short"])
        out[f"{k}_fused_verdict"] = fused_verdict(contrast, kernel)
        out[f"{k}_runs_as"] = runs_as.get(kernel) if measured else None
    for fmt in dtypes:
        try:
            emu = growth.xs(("none", fmt), level=("mask", "dtype"))
        except (AttributeError, KeyError, TypeError):  # no table, or no such rows
            emu = None
        out[f"emulator_growth_{fmt}_nomask_max"] = None if emu is None or not len(emu) else float(
            emu["emulator growth max"].max())
        for rule, name in rules.items():
            out[f"alarms_{name}_{fmt}"] = cell(alarms, rule, fmt)
    return out
