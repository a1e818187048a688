"""English sentences about the gpu_training tier's records, still written by code (the notebook displays
them); each is to become a reading that returns values (``readings_gpu``) with the wording in the
notebook's markdown."""
from __future__ import annotations

import json
import math

import numpy as np
import xarray as xr

from .gpu_training import (GPU_DQ_LATE_RISE, GPU_DQ_METRIC, GPU_DQ_PASS, GPU_GROWTH, GPU_LOSS_RISE, GPU_VAL_RISE,
                           _common_logged_steps, _family, _kernel_of, _offset_over_spread, _passes, _settings)
from .readings_gpu import gpu_equal_step_table, gpu_layer_growth, gpu_training_table



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
