"""Synthetic tasks, the small GPT, the trainer and the FP32 backward-recompute diagnostic."""
import dataclasses

import numpy as np
import pytest
import torch

from attnum import ncio
from attnum.kernels import AttentionImpl, Kernel
from attnum.train.diag import backward_errors, recompute_backward_fp32
from attnum.inputs import normal_qkv
from attnum.model import GPT, GPTConfig, add_key_offset, perturb_weights
from attnum.train import IGNORE, Task
from attnum.train import TrainConfig, load_checkpoint, train


def _tiny(attention=("emulator:fa2_bf16",), task=None, **kw):
    task = task or Task("induction", context=16, n_symbols=8, lm_loss=True)
    cfg = GPTConfig(vocab_size=task.vocab_size, context=task.context, n_layer=2, n_head=2, d_model=16,
                    attention=tuple(AttentionImpl.parse(a, block_k=8) if a.startswith(("emulator", "reference"))
                                    else a for a in attention), **kw)
    return task, cfg


# -- tasks --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["associative_recall", "copy", "induction"])
def test_tasks_are_seeded_by_data_seed_and_step_only(name):
    task = Task(name, context=24, n_symbols=16, data_seed=3)
    x, y = task.batch(5, 4)
    assert x.shape == y.shape == (4, 24) and x.dtype == torch.long
    assert int(x.max()) < task.vocab_size and int(x.min()) >= 0
    assert torch.equal(x, task.batch(5, 4)[0]) and torch.equal(y, task.batch(5, 4)[1])
    assert not torch.equal(x, task.batch(6, 4)[0])
    assert not torch.equal(x, Task(name, context=24, n_symbols=16, data_seed=4).batch(5, 4)[0])
    assert (y != IGNORE).any()


def test_task_targets_are_the_answers():
    x, y = Task("associative_recall", context=24, n_symbols=16).batch(0, 3)
    pairs = Task("associative_recall", context=24, n_symbols=16).n_pairs
    for b in range(3):
        table = {int(x[b, 2 * i]): int(x[b, 2 * i + 1]) for i in range(pairs)}
        for pos in (y[b] != IGNORE).nonzero().flatten().tolist():
            assert pos >= 2 * pairs and table[int(x[b, pos])] == int(y[b, pos])
    x, y = Task("induction", context=16, n_symbols=8).batch(0, 2)
    assert torch.equal(x[:, :8], x[:, 8:])
    assert torch.equal(y[:, 8:15], x[:, 9:]) and (y[:, :8] == IGNORE).all()
    x, y = Task("induction", context=16, n_symbols=8, lm_loss=True).batch(0, 2)
    assert torch.equal(y[:, :-1], x[:, 1:]) and (y[:, -1] == IGNORE).all()


# -- model --------------------------------------------------------------------------------------

def test_attention_is_chosen_per_layer():
    _, cfg = _tiny(attention=("sdpa:math", "emulator:fa2_bf16:fused"))
    model = GPT(cfg)
    kernels = [attn.attention.kernel for attn in model.attention_modules()]
    assert kernels[0].name == "sdpa:math" and kernels[1].impl.family == "emulator" and kernels[1].impl.fused_scale_max
    model.set_attention("reference:fp32", layers=[0])
    assert model.attention_modules()[0].attention.kernel.name == "reference:fp32"
    with pytest.raises(ValueError, match="3 layers"):
        GPTConfig(vocab_size=8, n_layer=3, attention=("sdpa:math", "sdpa:math"))


def test_key_offset_leaves_the_fp64_forward_unchanged():
    task, cfg = _tiny(attention=("reference:fp64",))
    model = GPT(cfg, seed=1).double()
    x, _ = task.batch(0, 4)
    before = model(x)[0]
    add_key_offset(model, 1, torch.full((cfg.d_model,), 3.0, dtype=torch.float64))
    after = model(x)[0]
    assert (after - before).abs().max().item() < 1e-10
    assert model.attention_modules()[1].qkv.bias[cfg.d_model:2 * cfg.d_model].eq(3.0).all()


def test_perturbation_is_seeded_and_small():
    _, cfg = _tiny()
    a, b = GPT(cfg, seed=0), GPT(cfg, seed=0)
    perturb_weights(b, 1e-6, seed=5)
    diffs = [(p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())]
    assert 0 < max(diffs) < 1e-5
    c = GPT(cfg, seed=0)
    perturb_weights(c, 1e-6, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), c.parameters()))


# -- trainer ------------------------------------------------------------------------------------

def test_trainer_is_bitwise_deterministic_for_a_fixed_seed(tmp_path):
    task, cfg = _tiny(attention=("emulator:fa2_bf16:fused", "sdpa:flash"))
    tc = TrainConfig(steps=12, batch_size=4, warmup_steps=3, grad_clip=1.0, checkpoint_steps=(0, 6, 12),
                     record_every=2)
    a = train(tc, task, cfg, progress=False, checkpoint_dir=tmp_path)
    b = train(tc, task, cfg, progress=False)
    assert sorted(a.checkpoints) == [0, 6, 12]
    for step in a.checkpoints:
        assert all(torch.equal(a.checkpoints[step][n], b.checkpoints[step][n]) for n in a.checkpoints[step])
    for name in a.records.data_vars:
        np.testing.assert_array_equal(a.records[name].values, b.records[name].values)
    # checkpoint 0 is the initialisation; the final checkpoint is the trained model; files were written
    init = GPT(cfg, seed=0).state_dict()
    assert all(torch.equal(init[n], a.checkpoints[0][n]) for n in init)
    assert all(torch.equal(p, a.model.state_dict()[n]) for n, p in a.checkpoints[12].items())
    assert len(list(tmp_path.glob("step*.pt"))) == 3
    reloaded = load_checkpoint(cfg, torch.load(tmp_path / "step0000006.pt"))
    assert all(torch.equal(p, a.checkpoints[6][n]) for n, p in reloaded.state_dict().items())
    # a different seed, or a perturbed start, really trains a different model
    c = train(TrainConfig(**{**tc.__dict__, "seed": 1}), task, cfg, progress=False)
    d = train(TrainConfig(**{**tc.__dict__, "init_perturbation": 1e-4}), task, cfg, progress=False)
    for other in (c, d):
        assert not torch.equal(other.checkpoints[12]["head.weight"], a.checkpoints[12]["head.weight"])


def test_a_diagnostic_callback_leaves_the_run_bitwise_unchanged():
    from attnum.train import LiveDiagnostic

    task, cfg = _tiny(attention=("emulator:fa2_bf16:fused", "emulator:fa2_bf16"))
    tc = TrainConfig(steps=8, batch_size=4, warmup_steps=2, checkpoint_steps=(8,))
    live = LiveDiagnostic(every=3, spike_factor=0.0)
    a = train(tc, task, cfg, progress=False, callback=live)
    b = train(tc, task, cfg, progress=False)
    assert all(torch.equal(a.checkpoints[8][n], b.checkpoints[8][n]) for n in b.checkpoints[8])
    for name in a.records.data_vars:
        np.testing.assert_array_equal(a.records[name].values, b.records[name].values)
    ds = live.dataset()
    assert ds["diag_step"].values.tolist() == [0, 3, 6] and ds["live_dq_rel_err"].dims == ("diag_step", "layer")
    assert np.allclose(ds["live_grad_norm_ratio"].values, 1.0, atol=0.05) and not ds["live_spike"].any()
    np.testing.assert_allclose(ds["live_grad_norm_total"].values, a.records["grad_norm_total"].sel(step=[0, 3, 6]).values)


def test_training_records_and_learning(tmp_path):
    task, cfg = _tiny(attention=("sdpa:flash",), task=Task("copy", context=16, n_symbols=8))
    res = train(TrainConfig(steps=100, batch_size=16, lr=1e-2, warmup_steps=5), task, cfg, progress=False)
    rec = res.records
    assert rec["grad_norm"].dims == ("step", "layer") and rec.sizes["layer"] == 2
    assert rec.sizes["step"] == 100
    for name in ("loss", "accuracy", "grad_norm", "grad_norm_qk", "max_logit", "entropy", "key_mean_norm",
                 "key_mean_ratio"):
        assert np.isfinite(rec[name].values).all(), name
    assert float(rec["loss"][-5:].mean()) < float(rec["loss"][:5].mean()) - 0.4
    ratio = rec["key_mean_ratio"].values
    assert ((ratio > 0) & (ratio <= 1 + 1e-6)).all()
    ncio.write_results(rec, tmp_path / "r.nc", study="t", params={})  # CF attributes are complete


def test_train_config_is_checked():
    with pytest.raises(ValueError, match="autocast"):
        TrainConfig(autocast="fp8")
    with pytest.raises(ValueError, match="outside"):
        TrainConfig(steps=10, checkpoint_steps=(11,))
    assert TrainConfig(steps=100, warmup_steps=10, lr=1.0).lr_at(0) == pytest.approx(0.1)


class _OwnBackward(torch.autograd.Function):
    """Causal attention in fp32 whose backward is this Function's own (recomputed by autograd inside it)."""

    calls = 0

    @staticmethod
    def forward(ctx, q, k, v, scale):
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    @staticmethod
    def backward(ctx, grad_out):
        _OwnBackward.calls += 1
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
        return dq, dk, dv, None


class _OwnBackwardKernel(Kernel):
    """A kernel like fa4: its output's backward comes from its own autograd.Function."""

    name = "test:own_backward"

    def differentiable(self, q, k, v, *, causal=False, attn_bias=None, scale=None):
        assert causal and attn_bias is None
        return _OwnBackward.apply(q, k, v, scale)


def test_a_kernel_with_its_own_autograd_backward_trains_the_model():
    task, cfg = _tiny(attention=("sdpa:math",))
    kernel = _OwnBackwardKernel()
    own = dataclasses.replace(cfg, attention=(kernel, "sdpa:math"))
    tc = TrainConfig(steps=3, batch_size=4, warmup_steps=1, checkpoint_steps=(3,))
    _OwnBackward.calls = 0
    a = train(tc, task, own, progress=False)
    assert _OwnBackward.calls == 3  # one backward per step through the kernel's own Function
    b = train(tc, task, dataclasses.replace(cfg, attention=("sdpa:math",)), progress=False)
    # the same mathematics: the same losses up to rounding (Adam's normalised steps amplify rounding in the weights)
    np.testing.assert_allclose(a.records["loss"].values, b.records["loss"].values, rtol=1e-5)
    assert np.isfinite(a.records["grad_norm"].values).all() and (a.records["grad_norm"].values > 0).all()
    assert not torch.equal(a.checkpoints[3]["head.weight"], GPT(own, seed=0).state_dict()["head.weight"])


def test_fa4_as_training_attention_is_refused_on_a_cpu_before_any_work():
    task, cfg = _tiny(attention=("sdpa:math",))
    with pytest.raises(ValueError, match=r"layer 1: kernel 'fa4' cannot run on cpu: FlashAttention-4 runs on CUDA"):
        train(TrainConfig(steps=2, batch_size=2), task, dataclasses.replace(cfg, attention=("sdpa:math", "fa4")),
              progress=False)
    with pytest.raises(ValueError, match=r"member a: kernel 'fa4' cannot run on cpu: FlashAttention-4 runs on CUDA"):
        TrainConfig.byte_lm(kernel="fa4", device="cpu")


# -- the diagnostic -----------------------------------------------------------------------------

def test_diagnostic_reports_ratio_one_for_an_fp32_model_and_flags_an_injected_key_offset():
    task, cfg = _tiny(attention=("emulator:fp32",))
    batch = task.batch(0, 8)
    fp32 = recompute_backward_fp32(GPT(cfg, seed=2), batch)
    assert np.allclose(fp32["grad_norm_ratio"].values, 1.0, atol=1e-6)
    assert np.all(fp32["dq_rel_err"].values < 1e-6) and not fp32["flagged"].any()
    assert int(fp32["forward_identical"]) == 1

    _, cfg16 = _tiny(attention=("emulator:fa2_bf16",))
    clean = recompute_backward_fp32(GPT(cfg16, seed=2), batch)
    assert not clean["flagged"].any()
    assert np.allclose(clean["grad_norm_ratio"].values, 1.0, atol=0.02)
    model = GPT(cfg16, seed=2)
    add_key_offset(model, 1, torch.full((cfg16.d_model,), 300.0))
    offset = recompute_backward_fp32(model, batch)
    assert offset["flagged"].values.tolist() == [0, 1]
    assert float(offset["dq_rel_err"].sel(layer=1)) > 10 * float(clean["dq_rel_err"].sel(layer=1))
    assert float(offset["grad_norm_qk_ratio"].sel(layer=1)) > 1.05
    # the model is left as it was
    assert all(attn.attention.backward_kernel is None and attn.attention.capture is None
               for attn in model.attention_modules())


def test_diagnostic_on_raw_tensors_with_the_stored_forward():
    from attnum.kernels import flash_attention

    q, k, v = (t.float() for t in normal_qkv(1, 2, 64, 16, seed=3))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    impl = AttentionImpl("emulator", "fa2_bf16", block_k=16)
    out, lse = flash_attention(q, k, v, impl.policy, block_k=16)
    stored = backward_errors(q, k, v, do, impl, out=out, lse=lse)
    recomputed = backward_errors(q, k, v, do, impl)
    assert stored == recomputed and not stored["flagged"]
    assert 1e-4 < stored["dq_rel_err"] < 0.05
    shifted = backward_errors(q, k + 500.0, v, do, impl)
    assert shifted["flagged"] and shifted["dq_rel_err"] > 0.5
