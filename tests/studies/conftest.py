"""Fixtures the study tests share: a study's smoke run, and tiny CPU training records for the gpu_training tiers.

Each reads what differs from the test module that asks: ``STUDY`` (the study whose smoke tier runs) and
``RUNS`` (tag -> ``attnum.train.TrainConfig.byte_lm`` fields of each record to train). A module that defines a
fixture of the same name uses its own.
"""
import importlib.util
from pathlib import Path

import pytest

from attnum import runs


def _load_tests_conftest():
    """``tests/conftest.py`` under a name of its own. Test modules take its helpers with ``from conftest import
    ...``; once this file exists that name can resolve to either conftest (pytest imports both as ``conftest``),
    so this one offers the same helpers."""
    spec = importlib.util.spec_from_file_location("attnum_tests_conftest", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


without_triton_interpreter = _load_tests_conftest().without_triton_interpreter

# A byte-corpus model small enough to train on a CPU in seconds, recording everything a gpu_training tier reads.
TINY_CORPUS = dict(n_layer=2, n_head=2, d_model=32, context=32, batch_size=8, steps=30, log_every=5, eval_every=10,
                   snapshot_every=10, corpus_max_bytes=2_000_000, val_windows=8, diag_batch=2, warmup_steps=2, lr=3e-3,
                   sketch_size=16, device="cpu", budget_s=300.0, time_attention=False)


@pytest.fixture(scope="module")
def smoke_run(request, tmp_path_factory):
    """The folder of the smoke tier of the module's ``STUDY``, run once per module in a private outputs root."""
    outputs = tmp_path_factory.mktemp("outputs")
    return runs.run(request.module.STUDY, "smoke", outputs=outputs, progress=False)


@pytest.fixture(scope="session")
def tiny_corpus_config():
    """``TINY_CORPUS`` updated with the keyword arguments, as an ``attnum.train.TrainConfig.byte_lm``."""
    from attnum.train import TrainConfig

    def build(**kw):
        return TrainConfig.byte_lm(**{**TINY_CORPUS, **kw})

    return build


@pytest.fixture(scope="module")
def records(request, tmp_path_factory, tiny_corpus_config):
    """A folder of the module's ``RUNS`` trained as tiny CPU records (``attnum.train.train``)."""
    from attnum.train import train

    folder = tmp_path_factory.mktemp("records")
    for tag, kw in request.module.RUNS.items():
        train(tiny_corpus_config(tag=tag, **kw), out_dir=folder, progress=False)
    return folder
