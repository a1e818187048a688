"""attnum.train (corpus runs): the stdlib corpus, the GPU-scale LM and trainer at tiny size on the CPU, records,
gather, the step-cost bench; a GPU test for the real kernels (skipped without CUDA)."""
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import without_triton_interpreter
import torch

from attnum.train import data as corpus, diag, record
from attnum.train.__main__ import main
from attnum.model import GPT, AttentionChoice, GPTConfig
from attnum.train import TrainConfig, learning_rate
from attnum.train import train as _train

MAX_BYTES = 2_000_000  # a truncated corpus keeps the tests small


def _tiny(**kw):
    base = dict(n_layer=2, n_head=2, d_model=32, context=32, batch_size=8, steps=60, log_every=10, eval_every=20,
                snapshot_every=20, corpus_max_bytes=MAX_BYTES, val_windows=8, diag_batch=2, warmup_steps=5, lr=3e-3,
                sketch_size=16, device="cpu", budget_s=300.0, time_attention=False)
    base.update(kw)
    return TrainConfig.byte_lm(**base)


def train(cfg, out_dir, progress=None):
    """A corpus run; its record's path."""
    return _train(cfg, out_dir=out_dir, progress=False).path


# test_triton_fa2 switches the Triton interpreter on for the whole session; these tests check a CPU without it
_without_the_triton_interpreter = pytest.fixture(scope="module", autouse=True)(without_triton_interpreter)


@pytest.fixture(scope="module")
def small_corpus():
    return corpus.Corpus.build(("stdlib",), max_bytes=MAX_BYTES)


# -- corpus ----------------------------------------------------------------------------------------

def test_corpus_hash_is_stable_and_matches_the_concatenated_files(small_corpus):
    again = corpus.Corpus.build(("stdlib",), max_bytes=MAX_BYTES)
    assert again.facts == small_corpus.facts
    files = corpus.source_files(("stdlib",))[:small_corpus.facts["corpus_files"]]
    digest = hashlib.sha256(b"".join(p.read_bytes() + corpus.SEPARATOR for _, p in files)).hexdigest()
    assert small_corpus.facts["corpus_sha256"] == digest
    f = small_corpus.facts
    assert f["corpus_train_bytes"] + f["corpus_val_bytes"] == f["corpus_bytes"] <= MAX_BYTES
    assert 0 < f["corpus_val_files"] < f["corpus_files"]


def test_corpus_leaves_out_tests_and_installed_packages_in_sorted_order():
    labels = [label for label, _ in corpus.source_files(("stdlib",))]
    assert labels == sorted(labels) and len(labels) == len(set(labels))
    parts = [set(label.split("/")[1:-1]) for label in labels]
    assert not any(p & (corpus.TEST_DIRS | corpus.INSTALLED_DIRS) for p in parts)
    assert "stdlib/os.py" in labels
    with pytest.raises(ValueError, match="corpus parts"):
        corpus.source_files(("stdlib", "nope"))


def test_data_order_depends_on_data_seed_only(small_corpus):
    a = corpus.BatchSampler(small_corpus, context=16, batch_size=4, steps=10, data_seed=7)
    b = corpus.BatchSampler(small_corpus, context=16, batch_size=4, steps=10, data_seed=7)
    c = corpus.BatchSampler(small_corpus, context=16, batch_size=4, steps=10, data_seed=8)
    assert a.order_sha256 == b.order_sha256 != c.order_sha256
    x, y = a.batch(3)
    assert torch.equal(x, b.batch(3)[0]) and not torch.equal(x, c.batch(3)[0])
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])  # targets are the next byte
    start = int(a.offsets[3, 0])
    assert bytes(x[0].tolist()) == small_corpus.train[start:start + 16].tobytes()


# -- model -----------------------------------------------------------------------------------------

def test_attention_choice_names_and_dtypes():
    assert AttentionChoice.parse("sdpa:math").label == "sdpa:math@fp32"
    assert AttentionChoice.parse("sdpa:flash").label == "sdpa:flash@bf16"
    assert AttentionChoice.parse("triton:fa2:gproj_dq").dtype == "bf16"
    assert AttentionChoice.parse("sdpa:math@bf16").dtype == "bf16"
    for bad in ("", "sdpa:flash@fp8", "sdpa:nope", "nofamily"):
        with pytest.raises(ValueError):
            AttentionChoice.parse(bad)


def test_model_is_seeded_on_the_cpu_and_feeds_the_kernel_its_dtype():
    cfg = GPTConfig.byte_lm(AttentionChoice.parse("sdpa:math"), n_layer=2, n_head=2, d_model=16, context=8)
    a, b = (GPT(cfg, seed=3) for _ in range(2))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert sum(p.numel() for p in a.parameters()) == cfg.n_params()
    attn = a.attention_modules()[0]
    attn.capture = {}
    x = torch.randint(0, 256, (2, 8))
    _, loss = a(x, x)
    loss.backward()
    assert attn.capture["q"].dtype == torch.float32 and attn.capture["grad_out"].shape == attn.capture["q"].shape
    # the attention dtype is the model's setting (GPTConfig.attention_dtype): a bf16 flash model reads bf16 operands
    flash = GPT(GPTConfig.byte_lm(AttentionChoice.parse("sdpa:flash"), n_layer=2, n_head=2, d_model=16, context=8), seed=3)
    attn = flash.attention_modules()[0]
    attn.capture = {}
    flash(x, x)[1].backward()
    assert attn.capture["q"].dtype == torch.bfloat16


# -- diagnostics -----------------------------------------------------------------------------------

def test_recompute_error_is_zero_for_fp32_attention_and_not_for_bf16():
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 32, 16, generator=gen) for _ in range(4))
    fp32 = AttentionChoice.parse("sdpa:math").kernel()
    cap32 = dict(q=q, k=k, v=v, grad_out=do)
    assert diag.recompute_errors(cap32, fp32)["dq_rel_err"] < 1e-6
    cap16 = {key: t.bfloat16() for key, t in cap32.items()}
    err = diag.recompute_errors(cap16, AttentionChoice.parse("sdpa:flash").kernel())["dq_rel_err"]
    assert 1e-4 < err < 0.1


def test_key_offset_shows_in_the_statistics():
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 32, 16, generator=gen) for _ in range(2))
    plain = diag.attention_stats(q, k)
    shifted = diag.attention_stats(q, k + 10.0)
    assert shifted["key_mean_norm"] > 30 * plain["key_mean_norm"]
    assert shifted["key_mean_ratio"] > 0.95 > plain["key_mean_ratio"]
    assert shifted["entropy"] == pytest.approx(plain["entropy"], rel=1e-3)  # softmax ignores a common shift
    assert 0 < plain["max_prob"] <= 1


def test_sketch_bounds_the_exact_wasserstein_from_below():
    cfg = GPTConfig.byte_lm(AttentionChoice.parse("sdpa:math"), n_layer=1, n_head=2, d_model=16, context=8)
    a = GPT(cfg, seed=0)
    b = GPT(cfg, seed=1)
    exact = diag.exact_drift(a, b)["w1"]
    bound = diag.sketch_wasserstein(diag.weight_sketches(a, 8), diag.weight_sketches(b, 8))
    assert np.all(bound <= exact + 1e-7) and bound.max() > 0.3 * exact.max()
    full = diag.sketch_wasserstein(diag.weight_sketches(a, 10 ** 6), diag.weight_sketches(b, 10 ** 6))
    assert np.allclose(full, exact, rtol=1e-5, atol=1e-9)  # one run per value: the sketch is exact
    assert np.all(diag.exact_drift(a, a)["w1"] == 0)


# -- trainer and record ----------------------------------------------------------------------------

def test_learning_rate_schedule():
    cfg = _tiny(steps=100, warmup_steps=10, schedule="cosine", lr=1e-3, min_lr_ratio=0.01)
    assert learning_rate(cfg, 0) == pytest.approx(1e-4)
    assert learning_rate(cfg, 9) == pytest.approx(1e-4 * 10)
    assert learning_rate(cfg, 10) == pytest.approx(1e-3)  # the cosine's start
    assert learning_rate(cfg, 99) == pytest.approx(1e-5)  # its floor, lr * min_lr_ratio, at the last step
    assert 1e-5 < learning_rate(cfg, 98) < 2e-5
    assert learning_rate(_tiny(warmup_steps=0), 50) == 3e-3  # constant


def test_bad_parameters_are_all_named_before_any_work():
    with pytest.raises(ValueError) as err:
        _tiny(lr=-1, eval_every=15, kernel="sdpa:nope", schedule="linear", autocast="fp8")
    text = str(err.value)
    for word in ("lr must be positive", "eval_every", "sdpa:nope", "schedule", "autocast"):
        assert word in text
    for early in (-1, 20, 25, 2.5):  # snapshot_every is 20
        with pytest.raises(ValueError, match="snapshot_early must be an integer >= 0 and below snapshot_every"):
            _tiny(snapshot_early=early)
    _tiny(snapshot_early=3).check()


def test_early_snapshots_fall_before_the_first_regular_one_at_any_step(tmp_path):
    ds = record.open_record(train(_tiny(steps=40, pair=True, pair_kernel="sdpa:math", snapshot_early=3, tag="early"),
                                  tmp_path, progress=lambda s: None))
    # early every 3 steps below snapshot_every (20), also between logged steps (log_every 10); then every 20
    assert list(ds["snapshot"].values) == [0, 3, 6, 9, 12, 15, 18, 20, 40]
    assert list(ds["step"].values) == [0, 10, 20, 30, 40]
    w1 = ds["pair_w1"].sel(snapshot=[3, 18]).mean("tensor").values
    assert 0 < w1[0] < w1[1]  # the pair's drift in its first steps, growing
    assert json.loads(ds.attrs["parameters"])["snapshot_early"] == 3


def test_training_learns_and_writes_a_complete_record(tmp_path):
    path = train(_tiny(), tmp_path, progress=lambda s: None)
    ds = record.open_record(path)
    assert list(ds["step"].values) == [0, 10, 20, 30, 40, 50, 60]
    assert list(ds["snapshot"].values) == [0, 20, 40, 60]
    val = ds["val_loss"].sel(member="a").values
    assert val[0] == pytest.approx(math.log(256), abs=0.1) and val[-1] < val[0] - 1.0  # it learns
    loss = ds["loss"].sel(member="a").values
    assert np.isnan(loss[0]) and loss[-1] < loss[1]
    for name in diag.LAYER_STATS + diag.DIAG_ERRORS + ("grad_norm",):
        assert ds[name].dims == ("member", "step", "layer")
        assert np.isfinite(ds[name].values[:, 1:]).all(), name
    assert (ds["dq_rel_err"].values[:, 1:] > 0).all()  # bf16 flash against its FP32 recompute
    assert ds.attrs["corpus_sha256"] == corpus.Corpus.build(("stdlib",), max_bytes=MAX_BYTES).facts["corpus_sha256"]
    assert json.loads(ds.attrs["parameters"])["kernel"] == "sdpa:flash"
    assert ds.attrs["stop_reason"] == "steps" and int(ds["steps_done"]) == 60
    assert "git_commit" in ds.attrs and ds.attrs["version_torch"] == torch.__version__
    assert "pair_w1" not in ds and ds["weight_sketch"].shape == (1, 4, len(ds["tensor"]), 16)


def test_pair_same_kernel_on_cpu_is_bitwise_repeatable_and_fp32_pair_drifts(tmp_path):
    same = record.open_record(train(_tiny(steps=20, pair=True, tag="same"), tmp_path, progress=lambda s: None))
    assert float(same["pair_w1"].max()) == 0.0 and float(same["pair_max_abs"].max()) == 0.0
    assert np.array_equal(same["loss"].sel(member="a").values[1:], same["loss"].sel(member="b").values[1:])
    diff = record.open_record(train(_tiny(steps=20, pair=True, pair_kernel="sdpa:math", tag="fp32"), tmp_path,
                                    progress=lambda s: None))
    assert list(diff["member_attention"].values) == ["sdpa:flash@bf16", "sdpa:math@fp32"]
    assert float(diff["pair_w1"].isel(snapshot=0).max()) == 0.0  # same init
    assert float(diff["pair_w1"].isel(snapshot=-1).max()) > 0.0
    assert (diff["dq_rel_err"].sel(member="b").values[1:] < 1e-5).all()  # fp32 attention: its own recompute
    ds = record.gather(tmp_path)
    assert set(ds["run"].values) == {"lm_same_s0_d0", "lm_fp32_s0_d0"}
    bound = record.sketch_drift(ds, ("lm_fp32_s0_d0", "a"), ("lm_fp32_s0_d0", "b"))
    exact = record.pair_drift(ds.sel(run="lm_fp32_s0_d0")).sel(snapshot=bound["snapshot"])
    assert (bound["wasserstein"].values <= exact["wasserstein"].values + 1e-7).all()
    assert np.allclose(exact["wasserstein"].values, diff["pair_w1"].values)
    from attnum.drift import aggregate

    by_kind = aggregate(exact, "kind")
    assert set(by_kind["kind"].values) == {"embedding", "attention", "mlp", "norm", "head"}
    assert float(by_kind["wasserstein"].isel(snapshot=-1).max()) > 0
    assert np.isfinite(aggregate(bound, "layer")["wasserstein_rel"].values).all()
    assert main(["gather", str(tmp_path), "--out", str(tmp_path / "gathered.nc")]) == 0
    with __import__("xarray").open_dataset(tmp_path / "gathered.nc") as back:
        assert back.sizes["run"] == 2 and np.allclose(back["pair_w1"].values, ds["pair_w1"].values, equal_nan=True)
    table = record.summary(ds)
    assert set(table.dims) == {"run", "member"}
    assert int(table["tokens_done"].sel(run="lm_same_s0_d0")) == 20 * 8 * 32
    assert (table["final_val_loss"].sel(member="a") < math.log(256)).all()
    assert (table["max_dq_rel_err"].sel(run="lm_fp32_s0_d0", member="b") < 1e-5)
    assert (table["max_dq_rel_err"].sel(run="lm_fp32_s0_d0", member="a") > 1e-4)
    assert (table["diverged"] == 0).all()  # both runs are pairs: no member is missing
    with pytest.raises(ValueError, match="not a pair"):
        record.pair_drift(ds.sel(run="lm_fp32_s0_d0").drop_vars("pair_w1"))


def test_low_precision_training_pairs_with_fp32_training(tmp_path):
    for amp in ("bf16", "fp16"):
        cfg = _tiny(steps=20, pair=True, kernel="sdpa:math", autocast="off", pair_kernel="sdpa:flash", pair_autocast=amp,
                    tag=f"lowprec_{amp}")
        ds = record.open_record(train(cfg, tmp_path, progress=lambda s: None))
        assert list(ds["member_attention"].values) == ["sdpa:math@fp32", f"sdpa:flash@{amp}"]
        assert list(ds["member_amp"].values) == ["off", amp]
        loss = ds["loss"].values
        assert np.isfinite(loss[:, 1:]).all() and loss[1, -1] < loss[1, 1]
        assert float(ds["pair_w1"].isel(snapshot=-1).max()) > 0.0


def test_budget_stops_cleanly_with_a_final_record(tmp_path, monkeypatch):
    # the stop keeps >= 5 s for the final evaluation and record: a 9 s budget leaves a few seconds of steps;
    # the trainer's clock is a counter (0.05 s a reading), so that a loaded machine cannot cut the run short
    import types

    from attnum.train import loop

    ticks = iter(range(10 ** 9))
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(monotonic=lambda: 0.05 * next(ticks)))
    path = train(_tiny(steps=100000, budget_s=9.0, log_every=7, eval_every=7, snapshot_every=7),
                 tmp_path, progress=lambda s: None)
    ds = record.open_record(path)
    assert ds.attrs["stop_reason"] == "budget"
    assert 0 < int(ds["steps_done"]) < 100000 and np.isfinite(ds["val_loss"].values[0, -1])
    assert int(ds["step"].values[-1]) == int(ds["steps_done"])
    assert int(ds["snapshot"].values[-1]) == int(ds["step"].values[-1])


def test_cli_train_and_bench_on_cpu(tmp_path, capsys):
    args = ["train", "--device", "cpu", "--out", str(tmp_path / "run"), "--n-layer", "1", "--n-head", "2",
            "--d-model", "16", "--context", "16", "--batch-size", "4", "--steps", "10", "--log-every", "5",
            "--eval-every", "5", "--snapshot-every", "5", "--corpus-max-bytes", str(MAX_BYTES),
            "--val-windows", "4", "--diag-batch", "2", "--no-time-attention", "--tag", "cli", "--budget-s", "1e6"]
    assert main(args) == 0
    assert (tmp_path / "run" / "lm_cli_s0_d0.nc").exists()
    assert int(record.open_record(tmp_path / "run" / "lm_cli_s0_d0.nc")["steps_done"]) == 10
    assert main(["train", "--device", "cpu", "--out", str(tmp_path), "--kernel", "sdpa:nope"]) == 2
    assert "sdpa:nope" in capsys.readouterr().err
    out = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--kernels", "sdpa:flash,sdpa:math,triton:fa2,fa4", "--n-layer", "1",
                 "--n-head", "2", "--d-model", "16", "--contexts", "16", "--tokens-per-step", "64",
                 "--warmup", "1", "--steps", "2", "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    by = {r["attention"]: r for r in result["results"]}
    assert by["sdpa:flash@bf16"]["status"] == "ok" and by["sdpa:flash@bf16"]["timed_steps"] == 2
    assert by["sdpa:math@fp32"]["overhead_vs_sdpa_flash"] == pytest.approx(
        by["sdpa:math@fp32"]["step_s_median"] / by["sdpa:flash@bf16"]["step_s_median"] - 1)
    if not torch.cuda.is_available():
        assert by["triton:fa2@bf16"]["status"].startswith("unavailable")
        # FlashAttention-4 is a training attention like any other: where it cannot run, the bench says why
        assert by["fa4@bf16"]["status"] == "unavailable: " + AttentionChoice.parse("fa4").unavailable_reason("cpu")


def test_every_campaign_run_is_a_valid_configuration():
    import yaml

    from attnum.train.__main__ import load_plan

    plans = yaml.safe_load(open(Path(__file__).parents[2] / "params" / "lm" / "campaign.yaml"))
    assert {"pilot", "s04_flash_lr1e-3", "s04_fp32_lr1e-3", "s04_gproj_lr1e-3", "s03_flash_vs_fp32_s0",
            "s03_noise_floor_s0", "s03_repeat_s0", "s03_lowprec_s0"} <= set(plans)
    for name in plans:
        plan = load_plan(name)
        assert plan["tag"] == name
        try:
            TrainConfig.byte_lm(**{**plan, "device": "cpu"})
        except ValueError as exc:  # only the Triton kernels may fail here, and only for want of a GPU
            assert "triton" in str(exc) and "bad training parameters:\n  member a: kernel 'triton" in str(exc), name
            assert str(exc).count("\n") == 1, name
    with pytest.raises(ValueError, match="no run 'nope'"):
        load_plan("nope")


def test_cli_plan_with_overrides(tmp_path):
    args = ["train", "--plan", "s03_repeat_s0", "--device", "cpu", "--out", str(tmp_path), "--n-layer", "1",
            "--n-head", "2", "--d-model", "16", "--context", "16", "--batch-size", "4", "--steps", "10",
            "--log-every", "5", "--eval-every", "5", "--snapshot-every", "5", "--corpus-max-bytes", str(MAX_BYTES),
            "--val-windows", "4", "--diag-batch", "2", "--no-time-attention", "--budget-s", "1e6"]
    assert main(args) == 2  # the plan's snapshot_early (25) is not below the flag's snapshot_every (5): named, no run
    assert not list(tmp_path.glob("*.nc"))
    assert main(args + ["--snapshot-early", "2"]) == 0
    ds = record.open_record(tmp_path / "lm_s03_repeat_s0_s0_d0.nc")
    params = json.loads(ds.attrs["parameters"])
    assert params["pair"] is True and params["lr"] == 3e-4 and params["steps"] == 10  # plan, then the flags
    assert ds.sizes["member"] == 2 and list(ds["snapshot"].values) == [0, 2, 4, 5, 10]


def test_triton_kernels_train_in_the_cpu_interpreter(tmp_path):
    """The Triton choices inside the trainer's model (GProj on and off), through Triton's CPU
    interpreter in fp16 (a subprocess: TRITON_INTERPRET must be set before triton is imported)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("on a GPU the gpu-marked test runs the compiled kernels")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).parents[2] / "lib")}
    args = [sys.executable, "-m", "attnum.train", "train", "--device", "cpu", "--out", str(tmp_path), "--n-layer", "1",
            "--n-head", "2", "--d-model", "32", "--context", "32", "--batch-size", "2", "--steps", "4",
            "--log-every", "2", "--eval-every", "2", "--snapshot-every", "2", "--val-windows", "2",
            "--diag-batch", "1", "--corpus-max-bytes", str(MAX_BYTES), "--autocast", "fp16", "--no-time-attention",
            "--kernel", "triton:fa2:gproj_dq", "--pair", "--pair-kernel", "triton:fa2", "--tag", "interp"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ds = record.open_record(tmp_path / "lm_interp_s0_d0.nc")
    assert list(ds["member_attention"].values) == ["triton:fa2:gproj_dq@fp16", "triton:fa2@fp16"]
    err = ds["dq_rel_err"].values[:, 1:]
    assert np.isfinite(err).all() and (err > 0).all() and (err < 1e-2).all()  # fp16 rounding, not a bug


@pytest.mark.gpu
def test_every_training_attention_runs_a_few_steps_on_the_gpu(tmp_path):
    for kernel in ("sdpa:flash", "sdpa:math", "triton:fa2", "triton:fa2:gproj_dq"):
        cfg = _tiny(device="cuda", kernel=kernel, n_head=2, d_model=128, context=128, steps=20, tag=kernel,
                    time_attention=True)
        ds = record.open_record(train(cfg, tmp_path, progress=lambda s: None))
        assert np.isfinite(ds["loss"].values[0, 1:]).all(), kernel
        assert np.isfinite(ds["dq_rel_err"].values[0, 1:]).all(), kernel
        assert float(ds["attn_fwd_bwd_s"].values[0]) > 0
