"""TEMPORARY: the merged trainer against a copy of the two old ones (``_old_loop.py``, ``_old_record.py``).

Same small configurations, step budgets (no wall-clock budget): every loss, weight and diagnostic must be
bitwise equal (torch.equal / assert_array_equal, NaN equal to NaN). Deleted with the old copies once green.
"""
import json

import numpy as np
import pytest
import torch

import _old_loop as old
from conftest import without_triton_interpreter

from attnum.kernels import AttentionImpl
from attnum.model import GPTConfig
from attnum.train import LiveDiagnostic, Task, TrainConfig, record, train, train_runs

_no_interpreter = pytest.fixture(scope="module", autouse=True)(without_triton_interpreter)

TIME_VARS = ("elapsed_s", "step_time_s", "tokens_per_s", "wall_s", "attention_share", "attn_fwd_s", "attn_fwd_bwd_s")


def _model(task, attention):
    impls = tuple(AttentionImpl.parse(a, block_k=8) if a.startswith(("emulator", "reference")) else a
                  for a in attention)
    return GPTConfig(vocab_size=task.vocab_size, context=task.context, n_layer=2, n_head=2, d_model=16,
                     attention=impls)


def _same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _same_records(a, b):
    assert set(a.data_vars) == set(b.data_vars)
    for name in a.variables:
        np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)


SYNTHETIC = {
    "emulator_and_sdpa_clip": (Task("induction", context=16, n_symbols=8, lm_loss=True),
                               ("emulator:fa2_bf16:fused", "sdpa:flash"),
                               dict(steps=10, batch_size=4, warmup_steps=3, grad_clip=1.0, record_every=2,
                                    checkpoint_steps=(0, 5, 10))),
    "bf16_autocast_perturbed": (Task("associative_recall", context=16, n_symbols=8),
                                ("reference:fa2_bf16",),
                                dict(steps=8, batch_size=4, warmup_steps=2, autocast="bf16", init_perturbation=1e-5,
                                     perturbation_seed=7, seed=3, checkpoint_steps=(0, 8))),
    "fp16_autocast_loss_scaling": (Task("copy", context=16, n_symbols=8, lm_loss=True),
                                   ("reference:fa2_fp16", "emulator:fa2_fp16"),
                                   dict(steps=8, batch_size=4, warmup_steps=2, autocast="fp16", grad_clip=0.5,
                                        checkpoint_steps=(8,))),
    "fp32_cosine_to_the_end": (Task("induction", context=16, n_symbols=8, data_seed=2),
                               ("reference:fp32", "sdpa:math"),
                               dict(steps=9, batch_size=3, warmup_steps=0, lr=1e-2, min_lr_ratio=0.3,
                                    weight_decay=0.0, checkpoint_steps=(9,))),
}


@pytest.mark.parametrize("name", list(SYNTHETIC))
def test_a_synthetic_run_is_bitwise_the_old_trainers(name):
    task, attention, kw = SYNTHETIC[name]
    model_cfg = _model(task, attention)
    was = old.train(model_cfg, task, old.TrainConfig(**{**kw, "autocast": kw.get("autocast", "none")}),
                    progress=False)
    now = train(TrainConfig(**kw), task, model_cfg, progress=False)
    _same_records(was.records, now.records)
    assert sorted(was.checkpoints) == sorted(now.checkpoints)
    for step in was.checkpoints:
        _same_state(was.checkpoints[step], now.checkpoints[step])
    _same_state(was.model.state_dict(), now.model.state_dict())
    assert was.diverged_at == now.diverged_at


def test_train_runs_with_a_live_diagnostic_is_bitwise_the_old():
    task = Task("induction", context=16, n_symbols=8, lm_loss=True)
    model_cfg = _model(task, ("emulator:fa2_bf16",))
    runs = {"bf16": AttentionImpl.parse("emulator:fa2_bf16", block_k=8), "fp32": "reference:fp32"}
    kw = dict(steps=8, batch_size=4, warmup_steps=2, checkpoint_steps=(0, 8), record_every=1)
    live_old, live_new = LiveDiagnostic(every=3, spike_factor=0.0), LiveDiagnostic(every=3, spike_factor=0.0)
    rec_old, res_old = old.train_runs(task, model_cfg, old.TrainConfig(**kw), runs, progress=False,
                                      callbacks={"bf16": live_old})
    rec_new, res_new = train_runs(task, model_cfg, TrainConfig(**kw), runs, progress=False,
                                  callbacks={"bf16": live_new})
    _same_records(rec_old, rec_new)
    _same_records(live_old.dataset(), live_new.dataset())
    for run in runs:
        for step in res_old[run].checkpoints:
            _same_state(res_old[run].checkpoints[step], res_new[run].checkpoints[step])


CORPUS_BASE = dict(n_layer=2, n_head=2, d_model=16, context=16, batch_size=4, steps=12, log_every=4, eval_every=8,
                   snapshot_every=8, corpus_max_bytes=2_000_000, val_windows=4, diag_batch=2, lr=3e-3,
                   sketch_size=8, device="cpu", time_attention=False)
CORPUS = {  # old CorpusConfig keywords, and the new TrainConfig's
    "single_flash": (dict(kernel="sdpa:flash", warmup=3), dict(kernel="sdpa:flash", warmup_steps=3)),
    "pair_flash_fp32_early_noclip": (
        dict(kernel="sdpa:flash", pair=True, pair_kernel="sdpa:math", snapshot_early=3, clip=0.0, warmup=2,
             weight_decay=0.1),
        dict(kernel="sdpa:flash", pair=True, pair_kernel="sdpa:math", snapshot_early=3, grad_clip=0.0,
             warmup_steps=2, weight_decay=0.1)),
    "lowprec_pair_fp16_seed": (
        dict(kernel="sdpa:math", amp="off", pair=True, pair_kernel="sdpa:flash", pair_amp="fp16", pair_seed=1,
             warmup=0, steps=10),
        dict(kernel="sdpa:math", autocast="off", pair=True, pair_kernel="sdpa:flash", pair_autocast="fp16",
             pair_seed=1, warmup_steps=0, steps=10)),
    "emulator_kernel_bf16": (dict(kernel="emulator:fa2_bf16", warmup=2, steps=8),
                             dict(kernel="emulator:fa2_bf16", warmup_steps=2, steps=8)),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_a_corpus_run_is_bitwise_the_old_trainers(name, tmp_path, monkeypatch):
    kw_old, kw_new = CORPUS[name]
    made = []

    class Capturing(old.Member):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(old, "Member", Capturing)
    path_old = old.train_corpus(old.CorpusConfig(**{**CORPUS_BASE, **kw_old}), tmp_path / "old",
                                progress=lambda s: None)
    now = train(TrainConfig.byte_lm(**{**CORPUS_BASE, **kw_new}), out_dir=tmp_path / "new", progress=False)
    assert [m.label for m in made] == list(now.models)
    for m in made:
        _same_state(m.model.state_dict(), now.models[m.label].state_dict())
    was = record.open_record(path_old)  # the old layout, converted on load
    new = record.open_record(now.path)
    assert path_old.name == now.path.name
    assert set(was.data_vars) == set(new.data_vars)
    for var in was.variables:
        if var not in TIME_VARS:
            np.testing.assert_array_equal(was[var].values, new[var].values, err_msg=var)
    p_old, p_new = json.loads(was.attrs["parameters"]), json.loads(new.attrs["parameters"])
    assert {k: p_new[k] for k in p_old} == p_old
    for key in was.attrs:
        if key.startswith(("corpus_", "data_order", "stop_reason", "n_params")):
            assert was.attrs[key] == new.attrs[key], key
