"""Study 02's measurements on the flash emulator: input families, fp16 overflow at 65504, mask sentinels.

* ``family_sweep``: every input family of ``attnum.inputs`` through both kernels (unblocked ``reference``
  and the tiled ``emulator``: registry families; the coordinate ``kernel_name`` gives each one's full
  registry name, e.g. ``emulator:fa2_bf16:bk128``), both policy families (``all_*`` and ``fa2_*``) and every dtype, against the fp64
  golden value computed on the inputs the kernel actually read (rounded to its input format);
  ``summarize_families`` adds the error amplification relative to N(0, 1) inputs.
* ``overflow_experiment``: seed 003's q = k = v = 65504 case, with fp16 or fp32 score accumulation and
  with or without the row max subtracted.
* ``sentinel_experiment`` / ``sentinel_onset``: mask fills and additive masks side by side on FlashInfer's
  extreme logits, masked keys with huge scores and fully masked rows; where the -5e4 sentinel's zero
  output starts.

Every kernel evaluation is wrapped: an exception is recorded (a flag in the data, its message in
``ExceptionLog``), never raised.
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch
import xarray as xr

from ...progress import tqdm
from ... import acceptance
from ... import kernels
from ...kernels import default_scale
from ...inputs import FLASHINFER_TARGET_LOGITS, AttentionInputs, make_inputs, mask_to_bias
from ...metrics import finite_error_summary, finiteness_counts, mean_rel_error, rel_l2_error, row_rel_l2_max, scaled_max_error, zero_rows
from ...precision import FORMATS, get_policy, min_subnormal, policy_for


KERNELS = ("reference", "emulator")  # registry families (attnum.kernels)


POLICY_FAMILIES = ("all", "fa2")


MASKED_V_SHIFT = 100.0  # added to V of masked keys to see whether they influence the output


class ExceptionLog:
    """Messages of exceptions raised by kernel evaluations, counted by (where, message)."""

    def __init__(self):
        self.counts: dict[tuple[str, str], int] = {}

    def call(self, where: str, fn):
        """``(fn(), None)``, or ``(None, message)`` when ``fn`` raises (the run goes on)."""
        try:
            return fn(), None
        except Exception as exc:  # recorded as data: an extreme input must not stop the study
            message = f"{type(exc).__name__}: {exc}"
            key = (where, message[:300])
            self.counts[key] = self.counts.get(key, 0) + 1
            return None, message

    def to_json(self) -> str:
        return json.dumps([{"where": w, "message": m, "count": c} for (w, m), c in sorted(self.counts.items())])


def masked_key_columns(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Keys that no query may attend (bool over keys), or None when there are none."""
    if mask is None:
        return None
    cols = ~mask.reshape(-1, mask.shape[-2], mask.shape[-1]).any(dim=-2).any(dim=0)
    return cols if bool(cols.any()) else None


def shift_masked_values(v: torch.Tensor, masked_cols: torch.Tensor, shift: float = MASKED_V_SHIFT):
    """V with the rows of masked keys shifted: a kernel that gives them no weight cannot tell."""
    out = v.clone()
    out[..., masked_cols, :] = out[..., masked_cols, :] + shift
    return out


def _run_kernel(kernel: str, inp: AttentionInputs, policy, *, block_q, block_k, v=None, query_chunk=None):
    v = inp.v if v is None else v
    if kernel == "reference":
        return kernels.reference(policy, query_chunk=query_chunk).forward(inp.q, inp.k, v, attn_bias=inp.attn_bias)[0]
    return kernels.emulator(policy, block_q=block_q, block_k=block_k).forward(inp.q, inp.k, v, attn_bias=inp.attn_bias)[0]


def _golden(inp: AttentionInputs, chunk: int, return_lse: bool = False):
    out, lse = kernels.get("golden", chunk=chunk).forward(inp.q, inp.k, inp.v, attn_bias=inp.attn_bias)
    return (out, lse) if return_lse else out


def _input_overflow(raw: AttentionInputs, rounded: AttentionInputs) -> int:
    return int(sum(((~torch.isfinite(b)) & torch.isfinite(a)).sum()
                   for a, b in zip((raw.q, raw.k, raw.v), (rounded.q, rounded.k, rounded.v))))


FAMILY_METRICS = ("nan_where_golden_finite", "inf_where_golden_finite", "finite_where_golden_nonfinite",
                  "finite_max_abs_err", "finite_rel_l2_err", "finite_max_ulp_err", "zero_rows", "nonzero_rows",
                  "masked_key_influence", "kernel_exception")


def family_sweep(families, seq_lens, dtypes, seeds, *, batch, heads, head_dim, block_q, block_k, device,
                 golden_chunk, log: ExceptionLog | None = None, progress=True) -> xr.Dataset:
    """Both kernels, both policy families, every dtype, against the golden value, for each family.

    Also applies every acceptance rule to the correct flash kernel under ``fa2_<dtype>``
    (``family_false_alarm``; NaN where the golden output is not finite), so each rule's
    false alarms can be seen on every family, not only on those of the detection sweep.
    """
    log = log or ExceptionLog()
    rules = acceptance.DETECTION_RULES
    shape = (len(families), len(KERNELS), len(POLICY_FAMILIES), len(dtypes), len(seq_lens), len(seeds))
    data = {m: np.full(shape, np.nan) for m in FAMILY_METRICS}
    base = (len(families), len(dtypes), len(seq_lens), len(seeds))
    golden_nonfinite, overflow = np.full(base, np.nan), np.zeros(base)
    false_alarm = np.full((len(rules),) + base, np.nan)
    work = [(a, fam, i, n, j, s) for a, fam in enumerate(families) for i, n in enumerate(seq_lens)
            for j, s in enumerate(seeds)]
    for a, family, i, n, j, seed in tqdm(work, desc="families", disable=not progress):
        raw = make_inputs(family, batch, heads, n, head_dim, seed=seed, device=device)
        masked_cols = masked_key_columns(raw.mask)
        for d, fmt in enumerate(dtypes):
            inp = raw.rounded(fmt)
            overflow[a, d, i, j] = _input_overflow(raw, inp)
            where = f"{family} N={n} seed={seed} {fmt}"
            ctx, exc = log.call(f"{where} golden and references", lambda: _detection_context(
                inp, policy_for("fa2", fmt), fmt, False, golden_chunk))
            if exc is not None:
                data["kernel_exception"][a, :, :, d, i, j] = 1
                continue
            gold = ctx["gold"]
            golden_nonfinite[a, d, i, j] = int((~torch.isfinite(gold)).sum())
            outputs = {("reference", "fa2"): ctx["ref"], ("reference", "all"): ctx["plain"]}
            cache: dict = {}
            for f, pfam in enumerate(POLICY_FAMILIES):
                pol = policy_for(pfam, fmt)
                for kk, kernel in enumerate(KERNELS):
                    key = (kernel, pol.formats())
                    if key not in cache:
                        if kernel == "reference":
                            result, exc = (outputs[(kernel, pfam)], None), None
                        else:
                            result, exc = log.call(f"{where} emulator {pol.name}", lambda: kernels.emulator(
                                pol, block_q=block_q, block_k=block_k).forward(inp.q, inp.k, inp.v,
                                                                               attn_bias=inp.attn_bias))
                        cache[key] = (result, _family_metrics(kernel, inp, pol, result, exc, gold, fmt, masked_cols,
                                                              block_q, block_k, golden_chunk, log,
                                                              f"{where} {kernel} {pol.name}"))
                    result, metrics = cache[key]
                    for m, value in metrics.items():
                        data[m][a, kk, f, d, i, j] = value
                    if kernel == "emulator" and pfam == "fa2" and result is not None and golden_nonfinite[a, d, i, j] == 0:
                        passes = _judge(result, ctx, n, fmt)["passes"]
                        false_alarm[:, a, d, i, j] = [not passes[r] for r in rules]
    dims = ("family", "kernel", "policy", "dtype", "seq_len", "seed")
    coords = {"family": list(families), "kernel": list(KERNELS), "policy": list(POLICY_FAMILIES),
              "dtype": list(dtypes), "seq_len": list(seq_lens), "seed": list(seeds), "rule": list(rules)}
    ds = xr.Dataset({m: (dims, data[m]) for m in FAMILY_METRICS}, coords=coords)
    ds["kernel_exception"] = ds["kernel_exception"].fillna(0).astype(np.int8)
    ds["golden_nonfinite"] = (("family", "dtype", "seq_len", "seed"), golden_nonfinite)
    ds["input_overflow"] = (("family", "dtype", "seq_len", "seed"), overflow)
    ds["family_false_alarm"] = (("rule", "family", "dtype", "seq_len", "seed"), false_alarm)
    ds["output_size"] = float(batch * heads * head_dim) * xr.DataArray(list(seq_lens), dims="seq_len")
    ds = ds.assign_coords(kernel_name=(("kernel", "policy", "dtype"), family_kernel_names(dtypes, block_q, block_k)))
    return ds


def family_kernel_names(dtypes, block_q, block_k) -> list:
    """The registry name of every (kernel, policy family, dtype) of the family sweep
    (``reference:fa2_bf16``, ``emulator:fa2_bf16:bk128``): the name the kernel has everywhere else."""
    def name(kernel, pfam, fmt):
        pol = policy_for(pfam, fmt)
        impl = kernels.reference(pol) if kernel == "reference" else kernels.emulator(pol, block_q=block_q,
                                                                                      block_k=block_k)
        return impl.name
    return [[[name(k, f, d) for d in dtypes] for f in POLICY_FAMILIES] for k in KERNELS]


def _family_metrics(kernel, inp, pol, result, exc, gold, fmt, masked_cols, block_q, block_k, query_chunk, log,
                    where) -> dict:
    if exc is not None:
        return {"kernel_exception": 1}
    out = result[0]
    res = {"kernel_exception": 0, **finiteness_counts(out, gold)}
    res.pop("golden_nonfinite")
    summary = finite_error_summary(out, gold, fmt)
    res.update(finite_max_abs_err=summary["max_abs"], finite_rel_l2_err=summary["rel_l2"],
               finite_max_ulp_err=summary["max_ulp"], zero_rows=zero_rows(out, gold),
               nonzero_rows=zero_rows(gold, out))
    if masked_cols is not None:
        # the same computation as the unshifted output (reference: same query chunks), V of masked keys moved
        shifted, _ = log.call(where + " (masked V shifted)", lambda: _run_kernel(
            kernel, inp, pol, block_q=block_q, block_k=block_k, v=shift_masked_values(inp.v, masked_cols),
            query_chunk=query_chunk))
        if shifted is not None and bool(torch.isfinite(out).all()):  # NaN against NaN says nothing
            res["masked_key_influence"] = scaled_max_error(shifted, out, 1.0)
    return res


def summarize_families(ds: xr.Dataset, baseline: str = "normal") -> xr.Dataset:
    """Add ``amplification``: median rel. L2 error over seeds relative to the ``baseline`` family."""
    out = ds.copy()
    med = ds["finite_rel_l2_err"].median("seed")
    if baseline in ds["family"].values:
        out["amplification"] = med / med.sel(family=baseline)
    else:
        out["amplification"] = med * np.nan
    return out


OVERFLOW_KERNELS = ("textbook", "emulator")  # registry families (attnum.kernels)


def overflow_experiment(seq_len, head_dim, *, batch, heads, block_q, block_k, device, golden_chunk,
                        log: ExceptionLog | None = None) -> xr.Dataset:
    """q = k = v = 65504 in fp16: fp16 or fp32 score accumulation, with or without max subtraction.

    ``textbook`` is ``textbook_attention``; ``emulator`` (the tiled kernel) always subtracts the running max,
    so its "without" entries are NaN (not applicable). Other stages follow ``fa2_fp16``.
    """
    log = log or ExceptionLog()
    inp = make_inputs("fp16_max", batch, heads, seq_len, head_dim, seed=0, device=device).rounded("fp16")
    score_formats, subtract = ("fp16", "fp32"), ("yes", "no")
    shape = (len(OVERFLOW_KERNELS), len(score_formats), len(subtract))
    nan_frac, inf_frac, err = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    gold, exc = log.call("overflow golden", lambda: _golden(inp, golden_chunk))
    if exc is not None:
        gold = torch.full_like(inp.q, math.nan)
    for a, kernel in enumerate(OVERFLOW_KERNELS):
        for b, score in enumerate(score_formats):
            pol = get_policy("fa2_fp16").replace(score=score)
            for c, sub in enumerate(subtract):
                if kernel == "emulator" and sub == "no":
                    continue
                if kernel == "emulator":
                    fn = lambda: kernels.emulator(pol, block_q=block_q, block_k=block_k).forward(inp.q, inp.k, inp.v)[0]
                else:
                    fn = lambda: kernels.TextbookKernel(pol, subtract_max=(sub == "yes")).forward(inp.q, inp.k, inp.v)[0]
                out, exc = log.call(f"overflow {kernel} score={score} subtract_max={sub}", fn)
                if exc is not None:
                    continue
                nan_frac[a, b, c] = torch.isnan(out).double().mean().item()
                inf_frac[a, b, c] = torch.isinf(out).double().mean().item()
                err[a, b, c] = finite_error_summary(out, gold, "fp16")["max_abs"]
    dims = ("overflow_kernel", "score_format", "max_subtraction")
    ds = xr.Dataset({"overflow_nan_fraction": (dims, nan_frac), "overflow_inf_fraction": (dims, inf_frac),
                     "overflow_max_abs_err": (dims, err)},
                    coords={"overflow_kernel": list(OVERFLOW_KERNELS), "score_format": list(score_formats),
                            "max_subtraction": list(subtract)})
    ds["overflow_golden_value"] = gold.abs().max().item()
    ds["overflow_head_dim"] = head_dim
    ds["overflow_seq_len"] = seq_len
    return ds


MASK_HANDLINGS = ("fill_-inf", "fill_-5e4", "fill_-1e4", "fill_finfo_min", "additive_-1e4",
                  "additive_finfo_min", "softmax_unguarded")


"""``fill_*``: the flash emulator replaces masked raw scores by the value and starts the running
max there (FlashInfer's scheme; ``-inf`` is the NaN-safe fix). ``additive_*``: unblocked
attention with the value added to masked scores (HF-style masks; ``finfo_min`` of the input
format). ``softmax_unguarded``: textbook softmax with -inf masks and no NaN guard."""


def sentinel_cases(targets=FLASHINFER_TARGET_LOGITS) -> list[str]:
    return [f"logit_{t:g}" for t in targets] + ["masked_huge", "masked_huge_valid_-6e4", "fully_masked"]


def sentinel_inputs(case: str, batch, heads, seq_len, head_dim, *, seed, device="cpu") -> AttentionInputs:
    """The inputs of one sentinel case (see ``sentinel_cases``)."""
    if case.startswith("logit_"):
        return make_inputs("logit_targeted", batch, heads, seq_len, head_dim, seed=seed, device=device,
                           target=float(case[len("logit_"):]))
    if case == "masked_huge":
        return make_inputs("masked_huge_scores", batch, heads, seq_len, head_dim, seed=seed, device=device)
    if case == "masked_huge_valid_-6e4":
        return make_inputs("masked_huge_scores", batch, heads, seq_len, head_dim, seed=seed, device=device,
                           valid_target=-6e4)
    if case == "fully_masked":
        return make_inputs("fully_masked_rows", batch, heads, seq_len, head_dim, seed=seed, device=device)
    raise ValueError(f"unknown sentinel case {case!r}; cases: {sentinel_cases()}")


def masked_attention(handling: str, inp: AttentionInputs, policy, *, v=None, block_q=128, block_k=128):
    """(out, lse or None) of one mask handling (see ``MASK_HANDLINGS``)."""
    v = inp.v if v is None else v
    pol = get_policy(policy)
    if handling.startswith("fill_"):
        fill = handling[len("fill_"):]
        fill = fill if fill in ("-inf", "finfo_min") else float(fill)
        return kernels.emulator(pol, block_q=block_q, block_k=block_k, mask_fill=fill).forward(
            inp.q, inp.k, v, attn_bias=inp.attn_bias)
    if handling.startswith("additive_"):
        value = handling[len("additive_"):]
        value = float(torch.finfo(FORMATS[pol.inputs]).min) if value == "finfo_min" else float(value)
        bias = None if inp.mask is None else mask_to_bias(inp.mask, value)
        return kernels.reference(pol).forward(inp.q, inp.k, v, attn_bias=bias)
    if handling == "softmax_unguarded":
        return kernels.TextbookKernel(pol).forward(inp.q, inp.k, v, attn_bias=inp.attn_bias)
    raise ValueError(f"unknown mask handling {handling!r}; allowed: {MASK_HANDLINGS}")


SENTINEL_METRICS = ("sentinel_zero_row_fraction", "sentinel_nonzero_row_fraction", "sentinel_nan_fraction",
                    "sentinel_rel_l2_err", "sentinel_masked_key_influence", "sentinel_lse_max_abs_err",
                    "sentinel_exception")


def sentinel_experiment(seq_len, policies, seeds, *, targets=FLASHINFER_TARGET_LOGITS, handlings=MASK_HANDLINGS,
                        batch, heads, head_dim, block_q, block_k, device, golden_chunk,
                        log: ExceptionLog | None = None, progress=True) -> xr.Dataset:
    """Every mask handling on every sentinel case, policy and seed."""
    log = log or ExceptionLog()
    cases = sentinel_cases(targets)
    shape = (len(handlings), len(cases), len(policies), len(seeds))
    data = {m: np.full(shape, np.nan) for m in SENTINEL_METRICS}
    rows_total = batch * heads * seq_len
    work = [(c, case, s, seed) for c, case in enumerate(cases) for s, seed in enumerate(seeds)]
    for c, case, s, seed in tqdm(work, desc="sentinels", disable=not progress):
        raw = sentinel_inputs(case, batch, heads, seq_len, head_dim, seed=seed, device=device)
        masked_cols = masked_key_columns(raw.mask)
        for p, policy in enumerate(policies):
            pol = get_policy(policy)
            inp = raw.rounded(pol.inputs)
            golden, exc = log.call(f"sentinel golden {case} {policy} seed={seed}",
                                   lambda: _golden(inp, golden_chunk, return_lse=True))
            if exc is not None:
                data["sentinel_exception"][:, c, p, s] = 1
                continue
            gold, gold_lse = golden
            for h, handling in enumerate(handlings):
                where = f"sentinel {handling} {case} {policy} seed={seed}"
                res, exc = log.call(where, lambda: masked_attention(handling, inp, pol, block_q=block_q,
                                                                    block_k=block_k))
                data["sentinel_exception"][h, c, p, s] = exc is not None
                if exc is not None:
                    continue
                out, lse = res
                data["sentinel_zero_row_fraction"][h, c, p, s] = zero_rows(out, gold) / rows_total
                data["sentinel_nonzero_row_fraction"][h, c, p, s] = zero_rows(gold, out) / rows_total
                data["sentinel_nan_fraction"][h, c, p, s] = torch.isnan(out).double().mean().item()
                data["sentinel_rel_l2_err"][h, c, p, s] = finite_error_summary(out, gold, pol.output)["rel_l2"]
                if lse is not None:
                    ok = torch.isfinite(gold_lse)
                    data["sentinel_lse_max_abs_err"][h, c, p, s] = scaled_max_error(lse[ok], gold_lse[ok], 1.0) \
                        if bool(ok.any()) else np.nan
                if masked_cols is not None:
                    shifted, _ = log.call(where + " (masked V shifted)", lambda: masked_attention(
                        handling, inp, pol, v=shift_masked_values(inp.v, masked_cols), block_q=block_q,
                        block_k=block_k))
                    if shifted is not None and bool(torch.isfinite(out).all()):
                        data["sentinel_masked_key_influence"][h, c, p, s] = scaled_max_error(shifted[0], out, 1.0)
    dims = ("mask_handling", "case", "sentinel_policy", "seed")
    ds = xr.Dataset({m: (dims, data[m]) for m in SENTINEL_METRICS},
                    coords={"mask_handling": list(handlings), "case": cases, "sentinel_policy": list(policies),
                            "seed": list(seeds)})
    ds["sentinel_exception"] = ds["sentinel_exception"].fillna(0).astype(np.int8)
    ds["sentinel_seq_len"] = seq_len
    return ds


def predicted_onset(fill: float, p_format: str, head_dim: int, scale: float | None = None) -> float:
    """Raw row-max logit below which every P of the row rounds to 0 under a finite sentinel.

    The running max never rises above ``fill``, so P_j = exp((s_j - fill) * scale);
    once the largest of them is below half the smallest positive number of P's format
    it rounds to zero and P V is exactly zero (the row sum l, kept in the stats format,
    may still be a tiny positive number). The stats-format rounding of ``fill`` itself
    is not modelled (it matters for fp16 statistics). ``scale``: the softmax scale (default 1/sqrt(d)).
    """
    scale = default_scale(head_dim) if scale is None else float(scale)
    return fill + math.log(min_subnormal(p_format) / 2) / scale


def sentinel_onset(seq_len, logits, policies, *, seed, fill=-5e4, batch, heads, head_dim, block_q, block_k,
                   device, golden_chunk, log: ExceptionLog | None = None,
                   progress=True) -> xr.Dataset:
    """Per row: its largest valid logit and whether the ``fill``-sentinel kernel zeroed it."""
    log = log or ExceptionLog()
    n_rows = batch * heads * seq_len
    row_max = np.full((len(logits), len(policies), n_rows), np.nan)
    row_zero = np.zeros((len(logits), len(policies), n_rows), dtype=np.int8)
    rel = np.full((len(logits), len(policies)), np.nan)
    for t, target in enumerate(tqdm(logits, desc="onset", disable=not progress)):
        raw = make_inputs("logit_targeted", batch, heads, seq_len, head_dim, seed=seed, device=device,
                          target=float(target))
        for p, policy in enumerate(policies):
            pol = get_policy(policy)
            inp = raw.rounded(pol.inputs)
            scores = inp.q.double() @ inp.k.double().transpose(-1, -2)
            row_max[t, p] = scores.amax(dim=-1).flatten().cpu().numpy()
            gold, exc = log.call(f"onset golden {policy} target={target}", lambda: _golden(inp, golden_chunk))
            if exc is not None:
                continue
            res, exc = log.call(f"onset {policy} target={target}", lambda: kernels.emulator(
                pol, block_q=block_q, block_k=block_k, mask_fill=fill).forward(inp.q, inp.k, inp.v)[0])
            if exc is not None:
                continue
            row_zero[t, p] = ((res == 0).all(dim=-1) & (gold != 0).any(dim=-1)).flatten().cpu().numpy()
            rel[t, p] = finite_error_summary(res, gold, pol.output)["rel_l2"]
    ds = xr.Dataset({
        "onset_row_max_logit": (("onset_logit", "sentinel_policy", "row"), row_max),
        "onset_row_zero": (("onset_logit", "sentinel_policy", "row"), row_zero),
        "onset_rel_l2_err": (("onset_logit", "sentinel_policy"), rel),
        "onset_predicted_logit": (("sentinel_policy",), [predicted_onset(fill, get_policy(p).p, head_dim)
                                                         for p in policies]),
    }, coords={"onset_logit": [float(x) for x in logits], "sentinel_policy": list(policies),
               "row": np.arange(n_rows)})
    ds["onset_fill"] = fill
    return ds


def _nan_aware_rel_l2(out, gold) -> float:
    if bool((~torch.isfinite(out) & torch.isfinite(gold)).any()):
        return math.inf
    return rel_l2_error(out, gold)


def _nan_aware_max_abs(out, gold) -> float:
    return scaled_max_error(out, gold, 1.0)


def _detection_context(inp: AttentionInputs, pol, fmt: str, causal: bool, golden_chunk: int) -> dict:
    """Golden output and LSE, P|V|, and the references every rule needs, for one input.

    ``ref``/``lse_ref``: unblocked attention under the kernel's own policy (the yardstick of the
    scaled rules); ``plain``: unblocked attention with every stage in the low dtype (the
    FlashAttention rule's ``out_pt``).
    """
    v_both = torch.cat([inp.v, inp.v.abs()], dim=-1)
    both, lse_g = kernels.get("golden", chunk=golden_chunk).forward(inp.q, inp.k, v_both, causal=causal,
                                                                   attn_bias=inp.attn_bias)
    d = inp.v.shape[-1]
    gold, gold_abs = both[..., :d], both[..., d:]
    ref, lse_r = kernels.reference(pol, query_chunk=golden_chunk).forward(inp.q, inp.k, inp.v, causal=causal,
                                                                          attn_bias=inp.attn_bias)
    plain = kernels.reference(policy_for("all", fmt), query_chunk=golden_chunk).forward(
        inp.q, inp.k, inp.v, causal=causal, attn_bias=inp.attn_bias)[0]
    finite = [t[torch.isfinite(t)] for t in (inp.q, inp.k, inp.v)]
    ctx = {"gold": gold, "lse_gold": lse_g, "ref": ref, "lse_ref": lse_r, "plain": plain,
           "scale_out": acceptance.error_scale(gold_abs, fmt),
           "scale_lse": acceptance.error_scale(lse_g.abs().clamp(min=1.0), pol.lse),
           "pt_err": _nan_aware_max_abs(plain, gold),
           "floor": acceptance.dtype_floor(gold, fmt),
           "xmax": max(t.abs().max().item() if t.numel() else 0.0 for t in finite)}
    ctx["kappa_ref"] = scaled_max_error(ref, gold, ctx["scale_out"])
    ctx["kappa_ref_lse"] = scaled_max_error(lse_r, lse_g, ctx["scale_lse"])
    return ctx


def _judge(result, ctx: dict, n: int, fmt: str) -> dict:
    """Errors of one (out, lse) and the verdict of every rule."""
    out, lse = result
    gold = ctx["gold"]
    rel = _nan_aware_rel_l2(out, gold)
    max_abs = _nan_aware_max_abs(out, gold)
    kappa_out = scaled_max_error(out, gold, ctx["scale_out"])
    kappa_lse = scaled_max_error(lse, ctx["lse_gold"], ctx["scale_lse"])
    passes = acceptance.judge(rel_l2=rel, max_abs=max_abs, n=n, x_max=ctx["xmax"], fmt=fmt,
                              reference_max_abs=ctx["pt_err"], floor=ctx["floor"], kappa=kappa_out,
                              kappa_reference=ctx["kappa_ref"], kappa_lse=kappa_lse,
                              kappa_reference_lse=ctx["kappa_ref_lse"])
    mean_rel = math.inf if math.isinf(rel) else mean_rel_error(out, gold)
    return {"rel_l2": rel, "mean_rel": mean_rel, "worst_row": row_rel_l2_max(out, gold), "kappa_out": kappa_out,
            "lse_max_abs": scaled_max_error(lse, ctx["lse_gold"], 1.0), "passes": passes}
