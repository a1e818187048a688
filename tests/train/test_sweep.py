"""The designed sweep (attnum.train.sweep), qk-layernorm in the model and the dQ error's in-situ signature."""
import json
import math

import pytest
import torch

from attnum import kernels
from attnum.model import GPT, GPTConfig
from attnum.train import diag, sweep

TINY = """
name: tiny
base: {n_layer: 1, d_model: 16, n_head: 2, context: 16, batch_size: 4, steps: 4, warmup_steps: 1, log_every: 2,
       eval_every: 2, snapshot_every: 4, sketch_size: 4, diag_batch: 2, val_windows: 4, time_attention: false,
       device: cpu, autocast: "off", corpus_max_bytes: 3000000, threads: 1}
lrs: [1.0e-3, 1.0e-2]
seeds: [0, 1]
arms:
  ref: {kernel: "sdpa:math"}
  qk: {kernel: "sdpa:math", qk_norm: true, seeds: [1]}
analysis: {margin_nat: 0.05}
"""


def write(tmp_path, text, name="s.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_runs_are_seed_major_and_paired(tmp_path):
    spec = sweep.load(write(tmp_path, TINY))
    runs = sweep.runs(spec)
    assert [(r.seed, r.lr, r.arm) for r in runs] == [
        (0, 1e-3, "ref"), (0, 1e-2, "ref"), (1, 1e-3, "ref"), (1, 1e-3, "qk"), (1, 1e-2, "ref"), (1, 1e-2, "qk")]
    assert all(r.fields["seed"] == r.fields["data_seed"] == r.seed for r in runs)
    assert [r.fields.get("qk_norm", False) for r in runs] == [False, False, False, True, False, True]
    assert runs[3].record == "lm_tiny_qk_lr0.001_s1_d1.nc"
    assert len(spec["_sha256"]) == 64


@pytest.mark.parametrize("edit, message", [
    ("name: tiny", "name: 'bad name'"),
    ("lrs: [1.0e-3, 1.0e-2]", "lrs: [0, 1.0e-2]"),
    ("seeds: [0, 1]", "seeds: [0, 0]"),
    ("ref: {kernel: \"sdpa:math\"}", "ref: {kernel: \"sdpa:math\", n_layers: 2}"),
    ("ref: {kernel: \"sdpa:math\"}", "ref: {kernel: \"no-such-kernel\"}"),
    ("n_layer: 1,", "n_layer: 0,"),
])
def test_bad_sweep_files_are_refused(tmp_path, edit, message):
    text = TINY.replace(edit, message)
    assert text != TINY
    with pytest.raises(ValueError) as err:
        sweep.load(write(tmp_path, text))
    assert str(write(tmp_path, text)) in str(err.value)


def test_flags_round_trip_booleans():
    assert sweep.flags({"qk_norm": True, "time_attention": False, "lr": 0.01}) == [
        "--qk-norm", "--no-time-attention", "--lr", "0.01"]


def test_sweep_runs_keeps_finished_and_restarts_partial(tmp_path):
    spec = sweep.load(write(tmp_path, TINY.replace("seeds: [0, 1]", "seeds: [0]").replace("seeds: [1]", "seeds: [0]")
                            .replace("lrs: [1.0e-3, 1.0e-2]", "lrs: [1.0e-3]")))
    out = tmp_path / "out"
    status = sweep.run_sweep(spec, out, jobs=2, say=lambda s: None)
    assert status["done"] == status["total"] == 2
    records = sorted(p.name for p in out.glob("lm_*.nc"))
    assert records == ["lm_tiny_qk_lr0.001_s0_d0.nc", "lm_tiny_ref_lr0.001_s0_d0.nc"]
    assert (out / sweep.PLAN).read_text() == (tmp_path / "s.yaml").read_text()
    mtime = (out / records[0]).stat().st_mtime_ns
    (out / records[1]).write_bytes(b"not a record")  # a damaged / partial record is run again
    assert sweep.record_state(out / records[1]) == "partial"
    status = sweep.run_sweep(spec, out, jobs=1, say=lambda s: None)
    assert status["done"] == 2
    assert (out / records[0]).stat().st_mtime_ns == mtime  # the finished one was kept
    assert sweep.record_state(out / records[1]) == "done"
    saved = json.loads((out / sweep.STATUS).read_text())
    assert saved["plan_sha256"] == spec["_sha256"]


def test_budget_starts_nothing_that_cannot_finish(tmp_path):
    spec = sweep.load(write(tmp_path, TINY))
    status = sweep.run_sweep(spec, tmp_path / "out", jobs=2, budget_s=1.0, first_estimate_s=60.0, say=lambda s: None)
    assert status["done"] == 0
    assert all(v["state"] == "not started (budget)" for v in status["runs"].values())
    assert not list((tmp_path / "out").glob("lm_*.nc"))


def test_qk_norm_normalises_each_heads_queries_and_keys():
    cfg = GPTConfig(vocab_size=16, context=8, n_layer=1, n_head=2, d_model=8, qk_norm=True, attention_dtype="fp32",
                    attention=("sdpa:math",))
    model = GPT(cfg, seed=0)
    attn = model.blocks[0].attn
    assert attn.ln_q.weight.shape == (4,) and torch.equal(attn.ln_q.weight, torch.ones(4))
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params()
    with torch.no_grad():
        attn.qkv.weight.mul_(1000.0)  # huge projections: the scores stay bounded by the normalisation
    attn.capture = {}
    model(torch.randint(0, 16, (2, 8)))
    k = attn.capture["k"]
    assert torch.allclose(k.mean(-1), torch.zeros(()), atol=1e-4)
    assert torch.allclose(k.var(-1, unbiased=False), torch.ones(()), atol=1e-3)
    plain = GPT(GPTConfig(vocab_size=16, context=8, n_layer=1, n_head=2, d_model=8), seed=0)
    assert sum(p.numel() for p in plain.parameters()) == plain.cfg.n_params()
    assert not hasattr(plain.blocks[0].attn, "ln_q")


def test_dq_error_signature_sees_the_common_key_offset():
    gen = torch.Generator().manual_seed(0)
    b, h, n, d = 1, 2, 128, 64
    q, k, v, do = (torch.randn(b, h, n, d, generator=gen) for _ in range(4))
    mu = torch.randn(d, generator=gen)
    mu = mu / mu.norm() * 200.0
    bf16 = kernels.get("emulator:fa2_bf16:bk128")
    sig = diag.backward_errors(q, k + mu, v, do, bf16, causal=True, reference=kernels.get("reference:fp32"),
                               signature=True)["dq_err_pk_cos"]
    assert sig > 0.9  # the mechanism: the error lines up with (P K)_i ~ mu
    noise = diag.backward_errors(q, k, v, do, bf16, causal=True, reference=kernels.get("reference:fp32"),
                                 signature=True)["dq_err_pk_cos"]
    assert noise < 0.5  # rounding noise spread over the keys
    exact = diag.dq_error_signature(torch.ones(1, 4, 8), torch.ones(1, 4, 8), torch.randn(1, 4, 8),
                                    torch.randn(1, 4, 8))
    assert math.isnan(exact)  # no error anywhere: nothing to line up
