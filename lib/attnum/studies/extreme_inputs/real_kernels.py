"""Study 02's real kernels (PyTorch SDPA pinned to one backend, FlexAttention, our Triton kernel, from
``attnum.kernels``'s registry) on the extreme inputs and mask deliveries, and the tables that read them.

``real_kernel_inputs`` runs every kernel on the families of ``attnum.inputs`` and the study's
``REAL_EXTRA_INPUTS`` (NaN/inf in one key or value, NaN behind the mask, scores near the format's limits)
under every mask delivery (boolean, additive -inf, finite sentinels): what each kernel returns, which
refuse which input, and where two kernels disagree. ``load_gpu_run`` reads the committed ``gpu`` run.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch
import xarray as xr

from ...progress import tqdm
from ... import kernels
from ...inputs import INPUT_FAMILIES, AttentionInputs, make_inputs, mask_to_bias
from ...metrics import finite_error_summary, finiteness_counts, zero_rows
from ...precision import FORMATS
from ...ncio import committed_run
from . import STUDY
from .experiments import masked_key_columns, shift_masked_values


FORMER_KERNEL_NAMES = {"flash": "emulator"}
"""Kernel coordinate values of runs written before the family sweep used the registry's family names."""


def with_registry_names(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` with its ``kernel`` and ``overflow_kernel`` coordinates in the registry's family names (a run
    written before they were renames ``flash`` to ``emulator``; the data are untouched)."""
    for dim in ("kernel", "overflow_kernel"):
        if dim in ds.coords and any(str(v) in FORMER_KERNEL_NAMES for v in ds[dim].values):
            ds = ds.assign_coords({dim: [FORMER_KERNEL_NAMES.get(str(v), str(v)) for v in ds[dim].values]})
    return ds


def load_gpu_run(name: str = "gpu") -> xr.Dataset | None:
    """The committed run ``<outputs>/extreme_inputs/<name>/results.nc`` (``ncio.committed_run``) if it is
    present, ran on CUDA and holds the real-kernel experiment, else None; kernel coordinates in the
    registry's names (``with_registry_names``)."""
    ds = committed_run(STUDY, name)
    if ds is None or "cuda" not in str(ds.attrs.get("device", "")) or "real_status" not in ds:
        return None
    return with_registry_names(ds)


def _where(points) -> str:
    return ", ".join(points) if points else "none"


def _cells(ds: xr.Dataset):
    """``cell(kernel, dtype, input, mask)`` -> {variable: 0-d array} for every real-kernel variable on those
    four dimensions: what ``ds.sel`` of one cell gives ``_real_label`` and the loops, read from numpy arrays
    (thousands of cells a run; a Dataset ``sel`` of each, over the study's 80-odd variables, cost seconds)."""
    dims = ("real_kernel", "real_dtype", "real_input", "real_mask")
    arrays = {str(v): ds[v].transpose(*dims).values for v in ds.data_vars if set(ds[v].dims) == set(dims)}
    index = [{str(x): j for j, x in enumerate(ds[d].values)} for d in dims]

    def cell(k, f, i, m):
        at = tuple(ix[str(x)] for ix, x in zip(index, (k, f, i, m)))
        return {name: np.asarray(a[at]) for name, a in arrays.items()}

    return cell


def real_kernel_summary(ds: xr.Dataset) -> pd.DataFrame:
    """Per real kernel and input format, from the data: points with no output (and the first word
    of why), inputs|masks with NaN/inf where the golden output is finite, with zero rows where the
    golden row is not, with fully masked rows output as NaN, and rows attending masked keys."""
    rows = []
    cells = _cells(ds)
    for kernel in ds["real_kernel"].values:
        for fmt in ds["real_dtype"].values:
            no_out, nonfinite, zero, masked_nan, attend = {}, [], [], [], []
            for inp in ds["real_input"].values:
                for mask in ds["real_mask"].values:
                    cell = cells(kernel, fmt, inp, mask)
                    status = str(cell["real_status"])
                    label = f"{inp}{'' if mask == 'none' else '|' + str(mask)}"
                    if status.startswith("not applicable: the input"):
                        continue
                    if status != "ok":
                        no_out.setdefault(status.split(":")[0], []).append(label)
                        continue
                    if float(cell["real_nonfinite_where_golden_finite"]) > 0:
                        nonfinite.append(f"{label} ({float(cell['real_nonfinite_where_golden_finite']):.0%})")
                    if float(cell["real_zero_rows"]) > 0:
                        zero.append(f"{label} ({float(cell['real_zero_rows']):.0f})")
                    if float(cell["real_masked_rows_nan"]) > 0:
                        masked_nan.append(label)
                    if float(cell["real_rows_attend_masked"]) > 0:
                        attend.append(f"{label} ({float(cell['real_rows_attend_masked']):.0f})")
            rows.append({"kernel": str(kernel), "dtype": str(fmt),
                         "no output": "; ".join(f"{k}: {len(v)} ({_where(v[:4])}{', ...' if len(v) > 4 else ''})"
                                                for k, v in no_out.items()) or "none",
                         "NaN/inf where golden finite": _where(nonfinite), "zero rows": _where(zero),
                         "fully masked rows NaN": _where(masked_nan), "rows attending masked keys": _where(attend)})
    return pd.DataFrame(rows).set_index(["kernel", "dtype"])


def emulator_beside_real(ds: xr.Dataset, policy_family: str = "fa2") -> pd.DataFrame:
    """The emulator (tiled ``emulator`` kernel, ``<policy_family>_<dtype>``, -inf masks, family sweep at
    its largest N) beside every real kernel (mask ``none`` or ``-inf``) on the inputs both ran: the
    ``_real_label`` text of the real kernel, and for the emulator the same words (NaN/inf where the
    golden value is finite, zero rows, masked-key influence; else its relative L2 error)."""
    fams = [f for f in ds["family"].values if f in ds["real_input"].values]
    n = ds["seq_len"].values.max()
    real = _cells(ds)
    emulated = ds[["nan_where_golden_finite", "inf_where_golden_finite", "zero_rows", "masked_key_influence",
                   "finite_rel_l2_err"]]
    rows = []
    for fmt in ds["real_dtype"].values:
        if fmt not in ds["dtype"].values:
            continue
        for fam in fams:
            cell = emulated.sel(family=fam, dtype=fmt, seq_len=n, kernel="emulator", policy=policy_family)
            seed_max = lambda name: float(cell[name].max("seed"))  # noqa: E731
            issues = []
            size = float(ds["output_size"].sel(seq_len=n))
            bad = seed_max("nan_where_golden_finite") + seed_max("inf_where_golden_finite")
            if bad > 0:
                issues.append(f"NaN/inf {bad / size:.0%}" if math.isfinite(size) and size > 0 else "NaN/inf")
            if seed_max("zero_rows") > 0:
                issues.append(f"0 rows {seed_max('zero_rows'):.0f}")
            if seed_max("masked_key_influence") > 0:
                issues.append("masked keys weigh")
            rel = float(cell["finite_rel_l2_err"].median("seed"))
            row = {"dtype": str(fmt), "input": str(fam),
                   f"emulator {policy_family}_<dtype> (N={int(n)})": "; ".join(issues) or (
                       f"{rel:.1e}" if math.isfinite(rel) else "NaN as golden")}
            masks = [m for m in ("none", "-inf") if m in ds["real_mask"].values]
            for kernel in ds["real_kernel"].values:
                texts = []
                for mask in masks:
                    c = real(kernel, fmt, fam, mask)
                    if not str(c["real_status"]).startswith("not applicable: the input"):
                        texts.append(_real_label(c)[1])
                row[str(kernel)] = texts[0] if texts else "-"
            rows.append(row)
    return pd.DataFrame(rows).set_index(["dtype", "input"])


REAL_EXTRA_INPUTS = ("nan_in_one_key", "inf_in_one_key", "nan_in_one_value", "inf_in_one_value",
                     "nan_in_masked_key", "nan_in_masked_value", "scores_near_max", "scores_beyond_max",
                     "scores_near_min")


"""Inputs beyond the named families (``real_case_inputs``): one NaN or +inf in feature 0 of one key
(K) or one value (V) of N(0, 1) inputs; the same NaN in a key or value that the mask hides from every
query (padding: the last quarter of the keys); and scaled scores q.k/sqrt(d) at +0.5, +2 and -0.5
times the largest finite number of the input format (every key of every row; the golden value is
finite, fp64)."""


REAL_INPUTS = tuple(INPUT_FAMILIES) + REAL_EXTRA_INPUTS


REAL_MASKS = ("bool", "-inf", "-5e4", "finfo_min")


"""How an input's mask reaches the kernel: ``bool``: the kernel's boolean mask input (True: attend;
SDPA's ``attn_mask``, FlashInfer's ``custom_mask``; ``boolean_mask_input``: not applicable to the others); ``-inf``, ``-5e4``, ``finfo_min``: an additive bias in the kernel's input format
(0 where visible, the value where masked; ``finfo_min`` of the input format). An input without a mask
runs once, under ``none``."""


REAL_SCORE_TARGETS = {"scores_near_max": 0.5, "scores_beyond_max": 2.0, "scores_near_min": -0.5}


_PADDING_FRACTION = 0.25  # keys masked for every query in the nan_in_masked_* inputs


def real_case_inputs(name: str, fmt: str, batch, heads, seq_len, head_dim, *, seed, device="cpu"):
    """``(inputs, golden_inputs)`` of one real-kernel input, in fp64 before rounding to ``fmt``.

    ``golden_inputs`` is what the golden value is computed on (``inputs`` itself, except for the
    ``nan_in_masked_*`` inputs, whose masked NaN is replaced by 0: a key the mask hides takes no part
    in the answer, whatever it holds). Families come from ``attnum.inputs.make_inputs``.
    """
    if name in INPUT_FAMILIES:
        inp = make_inputs(name, batch, heads, seq_len, head_dim, seed=seed, device=device)
        return inp, inp
    if name in REAL_SCORE_TARGETS:
        # scaled score target * finfo(fmt).max, i.e. raw q.k at that times sqrt(d)
        target = REAL_SCORE_TARGETS[name] * float(torch.finfo(FORMATS[fmt]).max) * math.sqrt(head_dim)
        inp = make_inputs("logit_targeted", batch, heads, seq_len, head_dim, seed=seed, device=device,
                          target=target)
        return inp, inp
    if name not in REAL_EXTRA_INPUTS:
        raise ValueError(f"unknown real-kernel input {name!r}; inputs: {list(REAL_INPUTS)}")
    base = make_inputs("normal", batch, heads, seq_len, head_dim, seed=seed, device=device)
    value = math.nan if name.startswith("nan") else math.inf
    tensor = "k" if name.endswith("key") else "v"
    q, k, v = base.q.clone(), base.k.clone(), base.v.clone()
    mask = None
    if "masked" in name:
        n_pad = max(1, int(round(_PADDING_FRACTION * seq_len)))
        keep = torch.ones(seq_len, dtype=torch.bool, device=q.device)
        keep[seq_len - n_pad:] = False
        mask = keep[None, None, None, :].expand(1, 1, seq_len, seq_len).clone()
        position = seq_len - 1  # a padding key
    else:
        position = seq_len // 3
    {"k": k, "v": v}[tensor][..., position, 0] = value
    inp = AttentionInputs(q, k, v, mask)
    if mask is None:
        return inp, inp
    golden = AttentionInputs(q, k.clone(), v.clone(), mask)
    getattr(golden, tensor)[..., position, 0] = 0.0
    return inp, golden


def _real_bias(mask: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    value = {"-inf": -math.inf, "-5e4": -5e4, "finfo_min": float(torch.finfo(dtype).min)}[mode]
    return mask_to_bias(mask, value).to(dtype)


def boolean_mask_input(kernel) -> str | None:
    """How ``kernel`` takes a boolean mask: ``"bool_mask"`` (SDPA's boolean ``attn_mask``),
    ``"custom_mask"`` (FlashInfer's boolean ``custom_mask``, which ``attnum.kernels.flashinfer`` builds
    from a 0/-inf bias; the kernel then scores masked keys with its own sentinel, ``mask_sentinel()``),
    or None (no boolean mask input: the ``bool`` delivery is not applicable)."""
    from ...kernels.flashinfer import FlashInferKernel
    from ...kernels.sdpa import SdpaKernel

    if isinstance(kernel, SdpaKernel):
        return "bool_mask"
    if isinstance(kernel, FlashInferKernel) and kernel.mode == "prefill":
        return "custom_mask"
    return None


def _real_forward(kernel, q, k, v, mask, mode: str):
    """(output, None) of ``kernel`` with the mask delivered as ``mode``, or (None, status). A kernel that
    refuses the input, the format or the delivery gives its reason as the status; none is replaced by
    another kernel."""
    how = boolean_mask_input(kernel) if mode == "bool" else None
    if mode == "bool" and how is None:
        return None, f"not applicable: {kernel.name} takes no boolean mask input"
    try:
        if mode == "none":
            out = kernel.forward(q, k, v)[0]
        elif how == "bool_mask":
            out = kernel.forward(q, k, v, bool_mask=mask)[0]
        elif how == "custom_mask":
            out = kernel.forward(q, k, v, attn_bias=mask_to_bias(mask, -math.inf).to(q.dtype))[0]
        else:
            out = kernel.forward(q, k, v, attn_bias=_real_bias(mask, mode, q.dtype))[0]
    except torch.OutOfMemoryError as exc:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None, f"out of memory: {str(exc).splitlines()[0][:200]}"
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:  # the kernel refuses: data
        first = str(exc).splitlines()[0] if str(exc) else ""
        return None, f"refused: {type(exc).__name__}: {first[:300]}"
    except Exception as exc:  # anything else a kernel raises is recorded as well, never raised
        first = str(exc).splitlines()[0] if str(exc) else ""
        return None, f"failed: {type(exc).__name__}: {first[:300]}"
    return out.detach().double(), "ok"


REAL_METRICS = ("real_nan_fraction", "real_inf_fraction", "real_nonfinite_where_golden_finite",
                "real_finite_where_golden_nonfinite", "real_zero_rows", "real_nonzero_rows",
                "real_masked_rows_zero", "real_masked_rows_nan", "real_rows_attend_masked",
                "real_max_abs_err", "real_rel_l2_err")


REAL_PAIR_METRICS = ("real_pair_max_abs_diff", "real_pair_nonfinite_mismatch", "real_pair_zero_row_mismatch")


def _rows_attending_masked(out, shifted, fully_masked_rows) -> int:
    """Rows that gave weight to a masked key: the output moved when V of keys masked for every query
    was shifted (``shifted``; None: no such key), or a fully masked row came out finite and not 0."""
    moved = torch.zeros(out.shape[:-1], dtype=torch.bool, device=out.device)
    if shifted is not None:
        both = torch.isfinite(out) & torch.isfinite(shifted)
        moved = (both & (out != shifted)).any(dim=-1)
    if fully_masked_rows is not None:
        finite_nonzero = torch.isfinite(out).all(dim=-1) & (out != 0).any(dim=-1)
        moved = moved | (fully_masked_rows & finite_nonzero)
    return int(moved.sum())


def real_kernel_inputs(kernel_names, inputs, masks, dtypes, seq_len, *, seed, batch, heads, head_dim, device,
                       golden_chunk, progress=True) -> xr.Dataset:
    """Real kernels of the registry on the extreme inputs and mask questions the emulator gets.

    For every kernel, input format, input (``REAL_INPUTS``: the families of ``attnum.inputs`` and
    ``REAL_EXTRA_INPUTS``) and mask delivery (``none`` for an input without a mask, else each of
    ``masks``, ``REAL_MASKS``): the kernel runs on the inputs rounded to the format, in that format,
    through ``attnum.kernels.get(name).forward``; the golden value is fp64 attention on the same
    rounded inputs with the mask as -inf (the mask's meaning, whatever the delivery). Recorded: the
    kernel's ``real_status`` ("ok", "unavailable: ...", "refused: ...", "out of memory: ...",
    "not applicable: ..."), NaN/inf fractions, entries non-finite where the golden value is finite and
    the reverse, rows zeroed where the golden row is not (and the reverse), what fully masked rows gave
    (0 or NaN), rows that gave weight to masked keys (``_rows_attending_masked``, V of keys masked for
    every query shifted by 100), errors over entries finite in both; and for every pair of kernels
    that ran on the same input, their largest difference over entries finite in both and where their
    NaN/inf and zero-row patterns differ. Nothing raises: a kernel that cannot take an input is data.
    """
    names = list(kernel_names)
    kernels_ = [kernels.get(name) for name in names]
    mask_coord = ["none"] + [m for m in masks if m != "none"]
    base = (len(dtypes), len(inputs), len(mask_coord))
    data = {m: np.full((len(kernels_),) + base, np.nan) for m in REAL_METRICS}
    pair = {m: np.full((len(kernels_), len(kernels_)) + base, np.nan) for m in REAL_PAIR_METRICS}
    status = np.full((len(kernels_),) + base, "", dtype=object)
    gold_nonfinite = np.full(base[:2], np.nan)
    masked_rows_total = np.zeros(base[:2])
    rows_total = batch * heads * seq_len
    work = [(a, fmt, i, name) for a, fmt in enumerate(dtypes) for i, name in enumerate(inputs)]
    for a, fmt, i, name in tqdm(work, desc="real kernels", disable=not progress):
        dtype = FORMATS[fmt]
        raw, raw_gold = real_case_inputs(name, fmt, batch, heads, seq_len, head_dim, seed=seed, device=device)
        inp, inp_gold = raw.rounded(fmt), raw_gold.rounded(fmt)
        gold = kernels.get("golden", chunk=golden_chunk).forward(inp_gold.q, inp_gold.k, inp_gold.v,
                                                                 attn_bias=inp_gold.attn_bias)[0]
        gold_nonfinite[a, i] = (~torch.isfinite(gold)).double().mean().item()
        full_mask = None if inp.mask is None else inp.mask.expand(batch, heads, seq_len, seq_len)
        fully_masked = None if full_mask is None else ~full_mask.any(dim=-1)
        masked_rows_total[a, i] = 0 if fully_masked is None else int(fully_masked.sum())
        masked_cols = masked_key_columns(inp.mask)
        q, k, v = (t.to(dtype) for t in (inp.q, inp.k, inp.v))
        v_shifted = None if masked_cols is None else shift_masked_values(inp.v, masked_cols).to(dtype)
        mask = None if full_mask is None else full_mask.contiguous()
        for m, mode in enumerate(mask_coord):
            if (mode == "none") != (mask is None):
                status[:, a, i, m] = ("not applicable: the input has no mask" if mask is None else
                                      "not applicable: the input has a mask (see the mask deliveries)")
                continue
            outputs = {}
            for kk, kernel in enumerate(kernels_):
                reason = kernel.unavailable_reason(device)
                if reason:
                    status[kk, a, i, m] = f"unavailable: {reason}"
                    continue
                out, why = _real_forward(kernel, q, k, v, mask, mode)
                status[kk, a, i, m] = why
                if out is None:
                    continue
                outputs[kk] = out
                idx = (kk, a, i, m)
                counts = finiteness_counts(out, gold)
                size = out.numel()
                data["real_nan_fraction"][idx] = torch.isnan(out).double().mean().item()
                data["real_inf_fraction"][idx] = torch.isinf(out).double().mean().item()
                data["real_nonfinite_where_golden_finite"][idx] = (
                    counts["nan_where_golden_finite"] + counts["inf_where_golden_finite"]) / size
                data["real_finite_where_golden_nonfinite"][idx] = counts["finite_where_golden_nonfinite"] / size
                data["real_zero_rows"][idx] = zero_rows(out, gold)
                data["real_nonzero_rows"][idx] = zero_rows(gold, out)
                if fully_masked is not None:
                    data["real_masked_rows_zero"][idx] = int(((out == 0).all(dim=-1) & fully_masked).sum())
                    data["real_masked_rows_nan"][idx] = int((torch.isnan(out).any(dim=-1) & fully_masked).sum())
                shifted = None
                if v_shifted is not None:
                    shifted, _ = _real_forward(kernel, q, k, v_shifted, mask, mode)
                if mask is not None:
                    data["real_rows_attend_masked"][idx] = _rows_attending_masked(out, shifted, fully_masked)
                summary = finite_error_summary(out, gold, fmt)
                data["real_max_abs_err"][idx] = summary["max_abs"]
                data["real_rel_l2_err"][idx] = summary["rel_l2"]
            for ka, out_a in outputs.items():
                for kb, out_b in outputs.items():
                    pidx = (ka, kb, a, i, m)
                    both = torch.isfinite(out_a) & torch.isfinite(out_b)
                    diff = (out_a - out_b).abs()[both]
                    pair["real_pair_max_abs_diff"][pidx] = diff.max().item() if diff.numel() else np.nan
                    pattern = (torch.isnan(out_a) != torch.isnan(out_b)) | (torch.isinf(out_a) != torch.isinf(out_b))
                    pair["real_pair_nonfinite_mismatch"][pidx] = pattern.double().mean().item()
                    zero_a, zero_b = (out_a == 0).all(dim=-1), (out_b == 0).all(dim=-1)
                    pair["real_pair_zero_row_mismatch"][pidx] = int((zero_a != zero_b).sum())
    dims = ("real_kernel", "real_dtype", "real_input", "real_mask")
    coords = {"real_kernel": [k.name for k in kernels_], "real_other_kernel": [k.name for k in kernels_],
              "real_dtype": list(dtypes), "real_input": list(inputs), "real_mask": mask_coord}
    ds = xr.Dataset({m: (dims, data[m]) for m in REAL_METRICS}, coords=coords)
    for m in REAL_PAIR_METRICS:
        ds[m] = (("real_kernel", "real_other_kernel") + dims[1:], pair[m])
    ds["real_status"] = (dims, status.astype(str))
    ds["real_golden_nonfinite"] = (("real_dtype", "real_input"), gold_nonfinite)
    ds["real_masked_rows"] = (("real_dtype", "real_input"), masked_rows_total)
    ds["real_rows"] = rows_total
    ds["real_seq_len"] = seq_len
    ds["real_head_dim"] = head_dim
    return ds


def _real_label(cell: xr.Dataset) -> tuple[float, str]:
    """(colour code, short text) of one (kernel, dtype, input, mask): 0 agrees with the golden value's
    finite-ness, zero rows and masking (text: its relative error); 1 departs (text: how); 0.5 no output
    (text: why, in one word); NaN not applicable."""
    status = str(np.asarray(cell["real_status"]))
    if status.startswith("not applicable"):
        return math.nan, "n/a"
    if status != "ok":
        return 0.5, status.split(":")[0]
    value = {name: float(cell[name]) for name in REAL_METRICS}
    issues = []
    if value["real_nonfinite_where_golden_finite"] > 0:
        what = "NaN" if value["real_nan_fraction"] > 0 else "inf"
        issues.append(f"{what} {value['real_nonfinite_where_golden_finite']:.0%}")
    if value["real_finite_where_golden_nonfinite"] > 0:
        issues.append(f"finite {value['real_finite_where_golden_nonfinite']:.0%} (golden NaN)")
    if value["real_zero_rows"] > 0:
        issues.append(f"0 rows {value['real_zero_rows']:.0f}")
    attend = value["real_rows_attend_masked"]
    if attend > 0:
        issues.append(f"masked keys: {attend:.0f} rows")
    elif value["real_nonzero_rows"] > 0:
        issues.append(f"not-0 rows {value['real_nonzero_rows']:.0f}")
    if issues:
        return 1.0, "; ".join(issues)
    rel = value["real_rel_l2_err"]
    return 0.0, f"{rel:.1e}" if math.isfinite(rel) else "NaN as golden"


def real_outcome_table(ds: xr.Dataset, dtype: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(codes, labels): inputs and mask deliveries down, kernels across, at one input format
    (``_real_label``); an index entry notes where the golden output itself is not finite."""
    codes, labels, index = [], [], []
    sub = ds.sel(real_dtype=dtype)
    for inp in ds["real_input"].values:
        gold = float(sub["real_golden_nonfinite"].sel(real_input=inp))
        for mask in ds["real_mask"].values:
            statuses = sub["real_status"].sel(real_input=inp, real_mask=mask).values
            if all(str(s).startswith("not applicable: the input") for s in statuses):
                continue
            row = [_real_label(sub.sel(real_input=inp, real_mask=mask, real_kernel=k)) for k in ds["real_kernel"].values]
            codes.append([c for c, _ in row])
            labels.append([t for _, t in row])
            note = f" (golden non-finite {gold:.0%})" if gold > 0 else ""
            index.append(f"{inp}{'' if mask == 'none' else ' | ' + str(mask)}{note}")
    columns = [str(k) for k in ds["real_kernel"].values]
    return pd.DataFrame(codes, index=index, columns=columns), pd.DataFrame(labels, index=index, columns=columns)


def real_status_table(ds: xr.Dataset) -> pd.DataFrame:
    """Per kernel, format and reason: how many (input, mask) points gave no output, and which inputs."""
    rows = []
    status = ds["real_status"].transpose("real_kernel", "real_dtype", "real_input", "real_mask").values
    for a, kernel in enumerate(ds["real_kernel"].values):
        for b, fmt in enumerate(ds["real_dtype"].values):
            reasons: dict[str, list[str]] = {}
            for i, inp in enumerate(ds["real_input"].values):
                for m, mask in enumerate(ds["real_mask"].values):
                    text = str(status[a, b, i, m])
                    if text == "ok" or text.startswith("not applicable: the input"):
                        continue
                    reasons.setdefault(text, []).append(f"{inp}{'' if mask == 'none' else '|' + str(mask)}")
            for text, where in reasons.items():
                shown = ", ".join(where[:6]) + (f", ... ({len(where)} in all)" if len(where) > 6 else "")
                rows.append({"kernel": str(kernel), "dtype": str(fmt), "points": len(where), "why": text[:200],
                             "where": shown})
    return pd.DataFrame(rows, columns=["kernel", "dtype", "points", "why", "where"])


def real_disagreements(ds: xr.Dataset) -> pd.DataFrame:
    """Every pair of kernels that ran on the same input and whose outputs differ in where they are
    NaN/inf or in which rows are all zero, with each kernel's outcome (``_real_label``)."""
    order = ("real_kernel", "real_other_kernel", "real_dtype", "real_input", "real_mask")
    nonfinite, zero, max_diff = (ds[f"real_pair_{v}"].transpose(*order).values
                                 for v in ("nonfinite_mismatch", "zero_row_mismatch", "max_abs_diff"))
    cell = _cells(ds)
    names = [str(k) for k in ds["real_kernel"].values]
    other = {str(k): j for j, k in enumerate(ds["real_other_kernel"].values)}
    rows = []
    for a, ka in enumerate(names):
        for kb in names[a + 1:]:
            b = other[kb]
            for f, fmt in enumerate(ds["real_dtype"].values):
                for i, inp in enumerate(ds["real_input"].values):
                    for m, mask in enumerate(ds["real_mask"].values):
                        at = (a, b, f, i, m)
                        if not (nonfinite[at] > 0 or zero[at] > 0):
                            continue
                        rows.append({"dtype": str(fmt), "input": str(inp), "mask": str(mask), "kernel a": ka,
                                     "kernel b": kb, "NaN/inf pattern differs": float(nonfinite[at]),
                                     "zero rows differ": int(zero[at]), "max |a - b| (finite)": float(max_diff[at]),
                                     "a gave": _real_label(cell(ka, fmt, inp, mask))[1],
                                     "b gave": _real_label(cell(kb, fmt, inp, mask))[1]})
    return pd.DataFrame(rows, columns=["dtype", "input", "mask", "kernel a", "kernel b", "NaN/inf pattern differs",
                                       "zero rows differ", "max |a - b| (finite)", "a gave", "b gave"])


def real_pair_table(ds: xr.Dataset, dtype: str) -> pd.DataFrame:
    """max |O_a - O_b| over entries finite in both, every pair of kernels (columns) on every input
    (rows), at one input format; NaN where a kernel did not run or nothing is finite in both."""
    names = [str(k) for k in ds["real_kernel"].values]
    sub = ds["real_pair_max_abs_diff"].sel(real_dtype=dtype)
    table = {}
    for a, ka in enumerate(names):
        for kb in names[a + 1:]:
            table[f"{ka} vs {kb}"] = sub.sel(real_kernel=ka, real_other_kernel=kb).to_series()
    df = pd.DataFrame(table)
    status = ds["real_status"].sel(real_dtype=dtype)
    applicable = ~status.str.startswith("not applicable: the input").all("real_kernel").to_series()
    df = df[applicable.reindex(df.index).fillna(False).astype(bool)]
    df.index = [f"{i}{'' if m == 'none' else ' | ' + m}" for i, m in df.index]
    return df
