"""attnum.train.dist: data-parallel corpus runs (two gloo processes on the CPU under torchrun), rank 0's records,
checkpoints and continued runs, the world-size check, and the one-process run bitwise the trainer before them."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import without_triton_interpreter

from attnum.model import GPTConfig
from attnum.train import Task, TrainConfig, dist, record, train
from attnum.train.__main__ import main

ROOT = Path(__file__).parents[2]
LIB = ROOT / "lib"
TINY = dict(n_layer=2, n_head=2, d_model=32, context=32, batch_size=8, steps=20, log_every=1, eval_every=10,
            snapshot_every=10, corpus_max_bytes=2_000_000, val_windows=8, diag_batch=2, warmup_steps=5, lr=3e-3,
            sketch_size=16, device="cpu", budget_s=0.0, time_attention=False, threads=1,
            kernel="sdpa:math@fp32", autocast="off")
# fp32 end to end (attention in fp32, no autocast): a data-parallel step differs from one process's only by the
# order of fp32 sums (two shard means averaged against one mean; weight gradients summed over 2 x 128 rows and
# then all-reduced against over 256 rows), a relative change of order u = 2^-24 per sum that AdamW carries into
# the next steps. Measured over these 20 steps: at most 2.1e-7 relative (about two ulps of the loss). RTOL is
# ten times that; a wrong shard, a missing average or a stale gradient moves the loss by 1e-3 or more.
RTOL = 2e-6

_no_interpreter = pytest.fixture(scope="module", autouse=True)(without_triton_interpreter)


def _flags(cfg: dict) -> list:
    out = []
    for key, value in cfg.items():
        flag = "--" + key.replace("_", "-")
        out += ([flag] if value else ["--no-" + flag[2:]]) if isinstance(value, bool) else [flag, str(value)]
    return out


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in dist.TORCHRUN_ENV}
    # this tree's lib first, then what the caller's path adds (on the lent GPU machine the carried wheels:
    # without them the ranks could not write their NetCDF records)
    inherited = os.environ.get("PYTHONPATH")
    env.update(PYTHONPATH=os.pathsep.join([str(LIB)] + ([inherited] if inherited else [])), OMP_NUM_THREADS="1",
               TRITON_INTERPRET="0")
    for key in dist.MULTICAST_OFF:  # the launcher must set them itself
        env.pop(key, None)
    return env


def _cli(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "attnum.train", "train", *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)


def _loss(path) -> np.ndarray:
    return record.open_record(path)["loss"].sel(member="a").values


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, the same global batch, 20 steps."""
    out = tmp_path_factory.mktemp("one")
    return train(TrainConfig.byte_lm(**TINY), out_dir=out, progress=False)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Two gloo processes under torchrun (the CLI's --nproc-per-node), stopped after 10 of the 20 steps."""
    base = tmp_path_factory.mktemp("two")
    done = _cli("--nproc-per-node", "2", *_flags(TINY), "--out", str(base / "out"), "--checkpoint-dir",
                str(base / "ckpt"), "--stop-at", "10")
    assert done.returncode == 0, done.stderr[-3000:]
    return base


def test_two_gloo_processes_train_as_one_process_over_the_same_global_batch(one_process, two_ranks):
    records = sorted((two_ranks / "out").iterdir())
    assert [p.name for p in records] == [one_process.path.name]  # one record, rank 0's
    assert [p.name for p in (two_ranks / "ckpt").iterdir()] == [dist.CHECKPOINT]
    two, one = record.open_record(records[0]), one_process.records
    assert two.attrs["dist_world_size"] == 2 and two.attrs["dist_backend"] == "gloo"
    assert {key: two.attrs[f"env_{key}"] for key in dist.MULTICAST_OFF} == dist.MULTICAST_OFF
    assert one.attrs["dist_world_size"] == 1 and one.attrs["dist_backend"] == "none"
    assert two.attrs["data_order_sha256"] == one.attrs["data_order_sha256"]
    assert two.attrs["stop_reason"] == "stop_at" and list(two["step"].values) == list(range(11))
    # step 0: the same initial weights, validated and diagnosed by rank 0 on the same windows: equal
    assert two["val_loss"].values[0, 0] == one["val_loss"].values[0, 0]
    np.testing.assert_array_equal(two["max_prob"].values[:, 0], one["max_prob"].values[:, 0])
    a, b = _loss(records[0])[1:], one["loss"].sel(member="a").values[1:11]
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=0)
    assert b[-1] < b[0] - 0.5  # it trains: the comparison is not of two flat lines


def test_a_rank_other_than_0_trains_its_shard_and_writes_nothing(tmp_path):
    # rank 1 of 2 without a process group (no collectives, no wrapper): what it writes and what it trains on
    cfg = TrainConfig.byte_lm(**{**TINY, "steps": 4})
    res = train(cfg, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", stop_at=2, progress=False,
                world=dist.World(rank=1, size=2))
    assert res.path is None and res.records is None
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert not (tmp_path / "ckpt").exists()
    w = dist.World(rank=1, size=2)
    x, y = torch.arange(8 * 3).reshape(8, 3), torch.arange(8)
    xs, ys = w.shard((x, y))
    assert torch.equal(xs, x[4:]) and torch.equal(ys, y[4:])


def test_a_continued_two_rank_run_reaches_the_uninterrupted_runs_losses(one_process, two_ranks):
    done = _cli("--nproc-per-node", "2", *_flags(TINY), "--out", str(two_ranks / "out"), "--checkpoint-dir",
                str(two_ranks / "ckpt"), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    ds = record.open_record(two_ranks / "out" / one_process.path.name)
    assert ds.attrs["stop_reason"] == "steps" and json.loads(ds.attrs["resumed_at"]) == [10]
    assert list(ds["step"].values) == list(range(21)) and list(ds["snapshot"].values) == [0, 10, 20]
    np.testing.assert_allclose(ds["loss"].values[0, 1:], one_process.records["loss"].values[0, 1:], rtol=RTOL, atol=0)
    assert ds["elapsed_s"].values[11] > ds["elapsed_s"].values[10]  # the clock adds up the two commands


def test_resume_from_a_checkpoint_is_bitwise_the_uninterrupted_run(tmp_path, one_process):
    cfg = TrainConfig.byte_lm(**TINY)
    first = train(cfg, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", stop_at=7, progress=False)
    assert first.records.attrs["stop_reason"] == "stop_at" and int(first.records["steps_done"]) == 7
    with pytest.raises(ValueError, match=r"parameters \['lr'\] differ"):
        train(TrainConfig.byte_lm(**{**TINY, "lr": 1e-3}), out_dir=tmp_path / "x", checkpoint_dir=tmp_path / "ckpt",
              resume=True, progress=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(cfg, out_dir=tmp_path / "x", checkpoint_dir=tmp_path / "none", resume=True, progress=False)
    rest = train(cfg, out_dir=tmp_path / "out", checkpoint_dir=tmp_path / "ckpt", resume=True, progress=False)
    one = one_process.records
    loss, ref_loss = torch.from_numpy(rest.records["loss"].values), torch.from_numpy(one["loss"].values)
    assert torch.equal(loss[:, 1:], ref_loss[:, 1:]) and torch.isnan(loss[:, 0]).all()  # step 0: no training loss
    for name in ("dq_rel_err", "key_mean_norm", "grad_norm_total"):
        np.testing.assert_array_equal(rest.records[name].values, one[name].values, err_msg=name)
    final, ref = rest.model.state_dict(), one_process.model.state_dict()
    assert all(torch.equal(final[n], ref[n]) for n in ref)
    assert json.loads(rest.records.attrs["resumed_at"]) == [7] and rest.records.attrs["stop_reason"] == "steps"


def test_a_global_batch_that_does_not_split_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(["train", *_flags({**TINY, "batch_size": 8}), "--nproc-per-node", "3", "--out", str(out)]) == 2
    assert "global batch_size 8 is not divisible by the 3 processes" in capsys.readouterr().err
    assert not out.exists()
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="global batch_size 8 is not divisible by the 3 processes"):
        train(TrainConfig.byte_lm(**TINY), out_dir=out, progress=False)
    assert not torch.distributed.is_initialized() and not out.exists()  # refused before the process group
    assert main(["train", *_flags(TINY), "--out", str(out)]) == 2  # the CLI under torchrun's environment too
    assert not out.exists()


def test_multicast_off_sets_both_variables_and_warns_about_an_override():
    env = dist.multicast_off({})
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    with pytest.warns(UserWarning, match="NCCL_NVLS_ENABLE=1 overridden to 0"):
        assert dist.multicast_off({"NCCL_NVLS_ENABLE": "1"})["NCCL_NVLS_ENABLE"] == "0"


def test_one_rank_in_a_process_group_is_bitwise_one_process(tmp_path, one_process):
    # the data-parallel path with one rank (DDP wrapper, collectives, rank 0's writes): the one-GPU case
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        res = train(TrainConfig.byte_lm(**TINY), out_dir=tmp_path / "out", progress=False,
                    world=dist.World.from_group())
    finally:
        tdist.destroy_process_group()
    assert res.records.attrs["dist_backend"] == "gloo"
    loss, ref_loss = torch.from_numpy(res.records["loss"].values), torch.from_numpy(one_process.records["loss"].values)
    assert torch.equal(loss[:, 1:], ref_loss[:, 1:])
    assert all(torch.equal(p, one_process.model.state_dict()[n]) for n, p in res.model.state_dict().items())




def test_every_long_run_plan_is_a_valid_configuration_for_its_ranks():
    import re

    import yaml

    from attnum.train.__main__ import load_plan

    path = ROOT / "params" / "lm" / "long_run.yaml"
    plans = yaml.safe_load(path.read_text())
    assert {"long_474m_x1", "long_474m_x8", "long_gpt2s_x8"} <= set(plans)
    for name in plans:
        plan = load_plan(name, str(path))
        ranks = int(re.fullmatch(r".*_x(\d+)", name).group(1))
        cfg = TrainConfig.byte_lm(**{**plan, "device": "cpu"})
        dist.check_world_size(cfg.batch_size, ranks)
        assert cfg.batch_size // ranks == 16 and cfg.steps * 128 * cfg.context >= 2.5e10, name  # at 8 x 16
    big = TrainConfig.byte_lm(**{**load_plan("long_474m_x8", str(path)), "device": "cpu"})
    n = GPTConfig.byte_lm(big.kernel, n_layer=big.n_layer, n_head=big.n_head, d_model=big.d_model,
                          context=big.context).n_params()
    assert 4.4e8 < n < 4.8e8  # seed 004's 450M class


@pytest.mark.gpu
def test_one_rank_on_one_gpu_under_torchrun(tmp_path):
    # the one-GPU case of the data-parallel code (nccl, cuda:LOCAL_RANK), stopped and continued; GPU training is
    # not bitwise reproducible (atomics in some backward kernels), so the losses are checked to be finite and falling
    cfg = {**TINY, "device": "cuda", "kernel": "sdpa:flash", "autocast": "bf16"}
    common = ["--nproc-per-node", "1", *_flags(cfg), "--out", str(tmp_path / "out"), "--checkpoint-dir",
              str(tmp_path / "ckpt")]
    first = _cli(*common, "--stop-at", "10")
    assert first.returncode == 0, first.stderr[-3000:]
    rest = _cli(*common, "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    (path,) = (tmp_path / "out").iterdir()
    ds = record.open_record(path)
    assert ds.attrs["dist_backend"] == "nccl" and ds.attrs["dist_world_size"] == 1
    assert json.loads(ds.attrs["resumed_at"]) == [10] and list(ds["step"].values) == list(range(21))
    loss = _loss(path)[1:]
    assert np.isfinite(loss).all() and loss[-1] < loss[0] - 0.5
