"""Study 02: FlashInfer before and after its sentinel fix, read from the committed H200 probe files, and the
sources' numbers and definitions the notebook glues. Fast (no smoke run): the readings against values computed
here from the committed JSONs, independently of ``readings_flashinfer``."""
import copy
import json
import math

import pytest
import torch

from attnum import acceptance, inputs
from attnum.paths import project_root
from attnum.precision import min_subnormal
from attnum.studies.extreme_inputs import detection, figures, readings_flashinfer as rf, values

PROBE_DIR = project_root() / "outputs" / "kernels" / "h200"
FILES = {"0.6.18.post1": "seed_kernels_fi18.json", "0.7.0": "seed_kernels_fi70.json"}
TOL = rf.ONSET_TOLERANCE


def _committed():
    if not all((PROBE_DIR / f).exists() for f in FILES.values()):
        pytest.skip("the committed FlashInfer probe files are not in this checkout")
    return {v: json.loads((PROBE_DIR / f).read_text()) for v, f in FILES.items()}


def _onset_by_hand(record, kernel, case):
    """(last right, onset) computed straight from the JSON rows."""
    pts = []
    for r in record["kernels"][kernel]["sentinel"]:
        if "logit_level" not in r:
            continue
        if case == "masked":
            if "masked_weight_max" not in r:
                return None
            err, nan = r["masked_weight_max"], r["masked_nan_rows"]
        else:
            err, nan = r[f"{case}_rel_l2_err"], r[f"{case}_nan_rows"]
        pts.append((r["logit_level_bf16"], not (err <= TOL) or nan > 0))
    pts.sort()
    wrong = [lv for lv, w in pts if w]
    if not wrong:
        return max(lv for lv, _ in pts), None
    first = min(wrong)
    return max(lv for lv, _ in pts if lv < first), first


def test_onsets_are_those_of_the_committed_probe_files():
    records = _committed()
    table = rf.flashinfer_onset_table(rf.load_flashinfer_probes())
    vals = rf.flashinfer_values(rf.load_flashinfer_probes())
    checked = 0
    for version, record in records.items():
        tag = "old" if version == "0.6.18.post1" else "new"
        for kernel in ("flashinfer:prefill", "flashinfer:decode"):
            short = kernel.split(":")[1]
            for case in ("nomask", "causal", "masked"):
                hand = _onset_by_hand(record, kernel, case)
                if hand is None:
                    assert (kernel, case, version) not in table.index
                    assert vals[f"{tag}_{short}_{case}_measured"] is False
                    continue
                row = table.loc[(kernel, case, version)]
                last_right, first = hand
                assert row["last right"] == last_right
                assert (math.isnan(row["onset"]) if first is None else row["onset"] == first)
                assert vals[f"{tag}_{short}_{case}_onset"] == first
                checked += 1
    assert checked == 10  # prefill: three cases, decode: two, per version
    # what the files record: the old version's kernels zero rows somewhere in the scan, the new one's nowhere
    assert vals["old_prefill_nomask_onset"] is not None and vals["old_decode_nomask_onset"] is not None
    assert vals["new_no_onset"] is True
    assert vals["old_sentinel"] == records["0.6.18.post1"]["flashinfer_mask_sentinel"]
    assert vals["new_sentinel"] == records["0.7.0"]["flashinfer_mask_sentinel"]


def test_the_paged_decode_is_read_where_a_probe_file_has_it():
    """Measured exactly where a committed file has the paged decode's sentinel rows; a file given its rows (here
    the single-request decode's, scaled) reads them, and the readings and the same-bracket flag follow."""
    records = _committed()
    vals = rf.flashinfer_values(rf.load_flashinfer_probes())
    for version, tag in (("0.6.18.post1", "old"), ("0.7.0", "new")):
        entry = records[version]["kernels"].get("flashinfer:decode_paged")
        has = entry is not None and not entry.get("unavailable") and bool(entry.get("sentinel"))
        for case in ("nomask", "causal"):
            assert vals[f"{tag}_decode_paged_{case}_measured"] is has
        assert vals[f"{tag}_decode_paged_masked_measured"] is False  # a decode step takes no mask
    without = copy.deepcopy(records)
    for record in without.values():
        record["kernels"].pop("flashinfer:decode_paged", None)
    vals = rf.flashinfer_values(without)
    assert vals["old_decode_paged_nomask_reading"] == "not measured"
    assert vals["decode_paged_nomask_same_bracket"] is None
    with_paged = copy.deepcopy(without)
    for record in with_paged.values():  # the single-request decode's rows, scaled, as if the paged kernel gave them
        rows = copy.deepcopy(record["kernels"]["flashinfer:decode"])
        for r in rows["sentinel"]:
            if "nomask_rel_l2_err" in r:
                r["nomask_rel_l2_err"] *= 0.5
        record["kernels"]["flashinfer:decode_paged"] = rows
    table = rf.flashinfer_onset_table(with_paged)
    vals = rf.flashinfer_values(with_paged)
    for version, tag in (("0.6.18.post1", "old"), ("0.7.0", "new")):
        hand = _onset_by_hand(with_paged[version], "flashinfer:decode_paged", "nomask")
        assert table.loc[("flashinfer:decode_paged", "nomask", version), "last right"] == hand[0]
        assert vals[f"{tag}_decode_paged_nomask_measured"] is True
        assert vals[f"{tag}_decode_paged_nomask_onset"] == hand[1]
        assert vals[f"{tag}_decode_paged_nomask_err_max"] == pytest.approx(vals[f"{tag}_decode_nomask_err_max"] * 0.5)
    # causal rows are the decode's own: the same bracket, so the flag holds for them
    assert vals["decode_paged_causal_same_bracket"] is True
    last_right, first = _onset_by_hand(with_paged["0.6.18.post1"], "flashinfer:decode_paged", "causal")
    assert vals["old_decode_paged_causal_reading"] == f"right at L = {last_right:.0f}, wrong from L = {first:.0f}"


def test_an_onset_reading_names_the_bracket_or_its_absence():
    base = {"levels_hi": 1e6}
    assert rf.onset_reading({**base, "k_measured": False}, "k") == "not measured"
    assert rf.onset_reading({**base, "k_measured": True, "k_onset": 34048.0, "k_last_right": 33792.0},
                            "k") == "right at L = 33792, wrong from L = 34048"
    assert rf.onset_reading({**base, "k_measured": True, "k_onset": None, "k_last_right": 1e6, "k_err_max": 0.0123},
                            "k") == "no wrong row up to L = 1000000 (largest error 0.012)"
    assert rf.onset_reading({**base, "k_measured": True, "k_onset": 100.0, "k_last_right": None},
                            "k") == "wrong from the lowest level, L = 100"


def test_the_emulators_onset_is_the_p_underflow_of_the_same_sentinel_and_the_agreement_its_bracket():
    records = _committed()
    s = float(records["0.6.18.post1"]["flashinfer_mask_sentinel"])
    expected = s - math.log(min_subnormal("bf16") / 2)  # scale 1: P = exp(-(L - S)) underflows bf16
    assert rf.emulated_onset(s, "nomask") == pytest.approx(expected)
    assert rf.emulated_onset(math.inf, "nomask") == math.inf
    # masked: weight f e^-S / (f e^-S + (1 - f) e^-L) reaches TOL exactly at the predicted level
    lm = rf.emulated_onset(s, "masked")
    f = rf.PROBE_MASKED_FRACTION
    assert f / (f + (1 - f) * math.exp(s - lm)) == pytest.approx(TOL)
    vals = rf.flashinfer_values(rf.load_flashinfer_probes())
    for short in ("prefill", "decode"):
        last_right, first = _onset_by_hand(records["0.6.18.post1"], f"flashinfer:{short}", "nomask")
        assert vals[f"emu_{short}_nomask_agrees"] == (last_right < expected <= first)
        assert vals[f"{short}_nomask_ln2_in_bracket"] == (last_right < s * math.log(2) <= first)


def test_the_newer_versions_error_at_the_older_onset_is_read_at_the_same_level():
    records = _committed()
    vals = rf.flashinfer_values(rf.load_flashinfer_probes())
    for short in ("prefill", "decode"):
        _, first = _onset_by_hand(records["0.6.18.post1"], f"flashinfer:{short}", "nomask")
        at = [r["nomask_rel_l2_err"] for r in records["0.7.0"]["kernels"][f"flashinfer:{short}"]["sentinel"]
              if r.get("logit_level_bf16") == first]
        assert vals[f"new_{short}_nomask_err_at_old_onset"] == pytest.approx(max(at))


def test_missing_probe_files_read_as_absent_and_the_values_as_not_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNUM_OUTPUTS", str(tmp_path))
    probes = rf.load_flashinfer_probes()
    assert probes == {"0.6.18.post1": None, "0.7.0": None}
    assert len(rf.missing_probes(probes)) == 2 and len(rf.flashinfer_onset_table(probes)) == 0
    vals = rf.flashinfer_values(probes)
    assert vals["present"] is False and vals["old_prefill_nomask_onset"] is None and vals["new_no_onset"] is None
    # one file present: read from the outputs root that ATTNUM_OUTPUTS names
    records = _committed()
    (tmp_path / "kernels" / "h200").mkdir(parents=True)
    (tmp_path / "kernels" / "h200" / FILES["0.7.0"]).write_text(json.dumps(records["0.7.0"]))
    probes = rf.load_flashinfer_probes()
    assert probes["0.6.18.post1"] is None and probes["0.7.0"] is not None
    vals = rf.flashinfer_values(probes)
    assert vals["emu_prefill_nomask_onset"] is None and vals["new_no_onset"] is True
    figures.plot_flashinfer_sentinel(probes)


def test_a_probe_file_of_another_version_is_refused(tmp_path):
    records = _committed()
    (tmp_path / "kernels" / "h200").mkdir(parents=True)
    (tmp_path / "kernels" / "h200" / FILES["0.6.18.post1"]).write_text(json.dumps(records["0.7.0"]))
    with pytest.raises(ValueError, match="expected '0.6.18.post1'"):
        rf.load_flashinfer_probes(tmp_path)


def test_the_figure_draws_both_versions():
    _committed()
    fig = figures.plot_flashinfer_sentinel(rf.load_flashinfer_probes())
    assert len(fig.axes) == 3 and len(fig.axes[0].lines) >= 4


# -- the sources' numbers and the definitions the prose states --------------------------------------

def test_source_values_are_the_constants_the_experiments_use():
    src = values.source_values()
    assert src["seed000_tolerance"] == detection.FIXED_TOLERANCE
    import inspect
    assert inspect.signature(acceptance.fixed_relative_rule).parameters["rtol"].default == detection.FIXED_TOLERANCE
    assert src["seed000_missed_error"] == detection.SEED000_MISSED_ERROR
    assert src["seed002_production_logit"] == min(inputs.FLASHINFER_TARGET_LOGITS)
    assert values.format_facts()["score_65504_d128"] == 65504.0 ** 2 * src["seed003_head_dim"]
    assert sum(values.SEED000_MIX.values()) == pytest.approx(1.0)


def test_the_seed000_mix_draws_the_shares_the_prose_states():
    x = inputs.seed000_mix_family(1, 1, 512, 64, seed=0).q.flatten()
    special = ~torch.isfinite(x) | (x == 0)
    extreme = x.abs() == 1e6
    regular = ~special & ~extreme & (x.abs() <= 10)
    n = x.numel()
    for share, mask in ((values.SEED000_MIX["regular"], regular), (values.SEED000_MIX["extreme"], extreme),
                        (values.SEED000_MIX["special"], special)):
        assert float(mask.sum()) / n == pytest.approx(share, abs=4 * math.sqrt(share * (1 - share) / n) + 1e-3)


def test_the_reference_shift_is_the_one_the_acceptance_floor_uses():
    g = torch.linspace(-3, 3, 101, dtype=torch.float64)
    s = values.REFERENCE_RELATIVE_SHIFT
    from attnum.precision import round_to
    r = round_to(g, "bf16")
    expected = 2.0 * (round_to(round_to(r + s, "bf16") - s, "bf16") - r).abs().max().item()
    assert acceptance.dtype_floor(g, "bf16") == expected


def test_definition_values_are_the_codes_defaults():
    d = values.definition_values()
    assert d["sparse_zero_fraction"] == 0.95 and d["fully_masked_row_fraction"] == 0.1
    assert d["masked_key_fraction"] == 0.25 and d["score_near_max"] == 0.5 and d["score_near_min"] == -0.5
    assert d["reference_factor"] == 2.0 and d["scaled_factor"] == 2.0 and d["scaled_floor"] == 2.0
