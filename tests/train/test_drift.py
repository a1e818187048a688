"""Weight-drift metrics (attnum.drift): distances, tensor kinds, aggregation, and determinism of runs."""
import numpy as np
import pytest
import torch
from scipy.stats import wasserstein_distance as scipy_w1

from attnum import drift
from attnum.kernels import AttentionImpl
from attnum.model import GPT, GPTConfig
from attnum.train import Task
from attnum.train import TrainConfig, train


def _tiny(attention="reference:fp32"):
    task = Task("induction", context=16, n_symbols=8, lm_loss=True)
    cfg = GPTConfig(vocab_size=task.vocab_size, context=16, n_layer=2, n_head=2, d_model=16,
                    attention=(AttentionImpl.parse(attention, block_q=8, block_k=8),))
    return task, cfg


# -- the distance ---------------------------------------------------------------------------------

def test_wasserstein_matches_scipy_and_is_symmetric():
    gen = np.random.default_rng(0)
    a, b = gen.normal(size=(40, 25)), gen.standard_t(3, size=(40, 25)) * 0.5 + 0.1
    ours = drift.wasserstein_distance(a, b)
    assert ours == pytest.approx(scipy_w1(a.ravel(), b.ravel()), rel=1e-12)
    assert ours == drift.wasserstein_distance(b, a) > 0
    c = gen.normal(size=333)  # unequal sizes go through scipy
    assert drift.wasserstein_distance(a, c) == pytest.approx(scipy_w1(a.ravel(), c), rel=1e-12)
    assert drift.wasserstein_distance(torch.tensor(a), torch.tensor(b, dtype=torch.float32)) == pytest.approx(
        scipy_w1(a.ravel(), b.astype(np.float32).ravel()), rel=1e-6)


def test_a_known_shift_gives_the_known_distance():
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.02
    for shift in (1e-7, 3e-4, 0.5):
        assert drift.wasserstein_distance(w, w + shift) == pytest.approx(shift, rel=1e-9)
        assert drift.wasserstein_distance(w, w - shift) == pytest.approx(shift, rel=1e-9)
    # scaling by s moves every sorted value by (s - 1) |w|: W1 = |s - 1| mean |w|
    assert drift.wasserstein_distance(w, 1.5 * w) == pytest.approx(0.5 * w.abs().mean().item(), rel=1e-12)
    # shifting one entry by d moves the distribution by d / n
    v = w.clone()
    v[3, 7] += 10.0
    assert drift.wasserstein_distance(w, v) == pytest.approx(10.0 / w.numel(), rel=1e-9)


def test_distance_is_blind_to_permutations_and_the_elementwise_metrics_are_not():
    w = torch.randn(50, generator=torch.Generator().manual_seed(2))
    perm = w[torch.randperm(50, generator=torch.Generator().manual_seed(3))]
    d = drift.tensor_drift(w, perm)
    assert d["wasserstein"] == 0.0
    assert d["max_abs"] > 0.5 and d["rel_l2"] > 0.5


def test_tensor_drift_is_zero_for_identical_tensors_and_symmetric_where_it_should_be():
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    same = drift.tensor_drift(a, a.clone())
    assert same == {"wasserstein": 0.0, "max_abs": 0.0, "rel_l2": 0.0, "ref_l2_norm": same["ref_l2_norm"]}
    ab, ba = drift.tensor_drift(a, b), drift.tensor_drift(b, a)
    assert ab["wasserstein"] == ba["wasserstein"] and ab["max_abs"] == ba["max_abs"]
    assert ab["rel_l2"] == pytest.approx(torch.linalg.vector_norm(b - a).item() / torch.linalg.vector_norm(a).item(),
                                         rel=1e-6)
    zero = torch.zeros(4)  # a zero reference (a bias at initialisation) gives 0 or inf, never NaN
    assert drift.tensor_drift(zero, zero)["rel_l2"] == 0.0
    assert drift.tensor_drift(zero, zero + 1)["rel_l2"] == np.inf
    with pytest.raises(ValueError, match="shape"):
        drift.tensor_drift(a, b[:4])


# -- tensors of the model and aggregation ---------------------------------------------------------

def test_every_model_tensor_has_a_kind_and_a_layer():
    _, cfg = _tiny()
    state = GPT(cfg).state_dict()
    kinds = {name: drift.tensor_kind(name) for name in state}
    assert kinds["tok_emb.weight"] == kinds["pos_emb.weight"] == "embedding"
    assert kinds["blocks.1.attn.qkv.weight"] == kinds["blocks.0.attn.proj.bias"] == "attention"
    assert kinds["blocks.0.mlp.2.weight"] == "mlp" and kinds["head.weight"] == "head"
    assert kinds["blocks.1.ln2.bias"] == kinds["ln_f.weight"] == "norm"
    assert set(kinds.values()) == set(drift.KINDS)
    assert drift.tensor_layer("blocks.1.mlp.0.bias") == 1 and drift.tensor_layer("ln_f.bias") == -1
    with pytest.raises(ValueError, match="kind"):
        drift.tensor_kind("rotary.freqs")


def test_aggregates_follow_their_definitions():
    a = {"blocks.0.attn.qkv.weight": torch.zeros(2, 2) + 1.0, "blocks.0.ln1.weight": torch.ones(4) * 2.0,
         "tok_emb.weight": torch.ones(3, 2)}
    b = {"blocks.0.attn.qkv.weight": torch.zeros(2, 2) + 1.5, "blocks.0.ln1.weight": torch.ones(4) * 2.0,
         "tok_emb.weight": torch.ones(3, 2) * 0.5}
    ds = drift.state_drift(a, b)
    assert ds["tensor"].values.tolist() == list(a) and ds["tensor_numel"].values.tolist() == [4, 4, 6]
    model = drift.aggregate(ds, "model")
    assert float(model["wasserstein"]) == pytest.approx((0.5 * 4 + 0 * 4 + 0.5 * 6) / 14)
    assert float(model["max_abs"]) == 0.5
    assert float(model["rel_l2"]) == pytest.approx(np.sqrt(4 * 0.25 + 6 * 0.25) / np.sqrt(4 + 16 + 6))
    rms = np.sqrt((4 + 16 + 6) / 14)
    assert float(model["wasserstein_rel"]) == pytest.approx(float(model["wasserstein"]) / rms)
    layer = drift.aggregate(ds, "layer")
    assert layer["layer"].values.tolist() == [0]  # the embedding is in no block
    assert float(layer["wasserstein"].sel(layer=0)) == pytest.approx(0.25)
    kind = drift.aggregate(ds, "kind")
    assert kind["kind"].values.tolist() == ["embedding", "attention", "norm"]
    assert float(kind["rel_l2"].sel(kind="norm")) == 0.0 and float(kind["max_abs"].sel(kind="embedding")) == 0.5
    with pytest.raises(ValueError, match="aggregate by"):
        drift.aggregate(ds, "head")


# -- runs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("attention,autocast", [("reference:fp32", "none"), ("emulator:fa2_bf16", "none"),
                                                ("reference:fa2_bf16", "bf16")])
def test_identical_configurations_give_bitwise_identical_weights_and_zero_drift(attention, autocast):
    task, cfg = _tiny(attention)
    tc = TrainConfig(steps=6, batch_size=4, warmup_steps=2, checkpoint_steps=(0, 3, 6), autocast=autocast)
    a, b = train(tc, task, cfg, progress=False), train(tc, task, cfg, progress=False)
    for step in (0, 3, 6):
        assert all(torch.equal(a.checkpoints[step][n], b.checkpoints[step][n]) for n in a.checkpoints[step])
    ds = drift.checkpoint_drift(a.checkpoints, b.checkpoints)
    assert ds["step"].values.tolist() == [0, 3, 6] and ds["wasserstein"].dims == ("step", "tensor")
    for metric in ("wasserstein", "max_abs", "rel_l2"):
        assert (ds[metric] == 0).all(), metric
    # the weights did move, so the zero is not the trivial one
    assert not torch.equal(a.checkpoints[0]["head.weight"], a.checkpoints[6]["head.weight"])


def test_drift_between_different_runs_is_positive_and_its_distance_symmetric():
    task, cfg = _tiny()
    tc = TrainConfig(steps=6, batch_size=4, warmup_steps=2, checkpoint_steps=(0, 6))
    a = train(tc, task, cfg, progress=False)
    b = train(TrainConfig(**{**tc.__dict__, "init_perturbation": 1e-5}), task, cfg, progress=False)
    ab, ba = drift.checkpoint_drift(a.checkpoints, b.checkpoints), drift.checkpoint_drift(b.checkpoints, a.checkpoints)
    np.testing.assert_array_equal(ab["wasserstein"].values, ba["wasserstein"].values)
    np.testing.assert_array_equal(ab["max_abs"].values, ba["max_abs"].values)
    assert (ab["max_abs"] > 0).all() and float(drift.aggregate(ab, "model")["wasserstein"].sel(step=6)) > 0
    with pytest.raises(ValueError, match="no checkpoint"):
        drift.checkpoint_drift({1: a.checkpoints[0]}, {2: a.checkpoints[0]})


# -- Golden et al.'s comparison at each attention call (study 03, section 3b) -----------------------

def test_per_call_deviation_compares_the_models_own_attention_calls():
    from attnum.studies.wasserstein_weight_drift.experiments import per_call_deviation

    task, cfg = _tiny("emulator:fa2_bf16")
    tc = TrainConfig(steps=4, batch_size=4, warmup_steps=1, checkpoint_steps=(0, 4))
    run = train(tc, task, cfg, progress=False)
    kw = dict(model_block=8, device="cpu")
    # the kernel against itself: the captured output is the kernel's output, bit for bit
    same = per_call_deviation(cfg, run.checkpoints, "emulator:fa2_bf16", "emulator:fa2_bf16", task, 4, **kw)
    assert same["call_max_abs"].dims == ("step", "layer") and same["step"].values.tolist() == [0, 4]
    assert (same["call_max_abs"] == 0).all() and (same["call_rel_l2"] == 0).all()
    np.testing.assert_array_equal(same["call_flash_err"].values, same["call_reference_err"].values)
    # flash against the reference of the same policy: bf16-sized differences, not zero, not large
    ds = per_call_deviation(cfg, run.checkpoints, "emulator:fa2_bf16", "reference:fa2_bf16", task, 4, **kw)
    assert (ds["call_max_abs"] > 0).all()
    assert float(ds["call_rel_l2"].max()) < 2.0 ** -5
    assert (ds["call_flash_err"] > 0).all() and (ds["call_reference_err"] > 0).all()
    # in fp32 the same comparison is orders of magnitude smaller
    fp32 = per_call_deviation(cfg, run.checkpoints, "emulator:fp32", "reference:fp32", task, 4, **kw)
    assert float(fp32["call_max_abs"].max()) < 1e-3 * float(ds["call_max_abs"].min())
    # the checkpoints are left as they were (the comparison only reads them)
    again = train(tc, task, cfg, progress=False)
    assert all(torch.equal(run.checkpoints[4][n], again.checkpoints[4][n]) for n in again.checkpoints[4])
