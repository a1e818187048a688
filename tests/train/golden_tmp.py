"""TEMPORARY: fingerprints of training runs, made with the old trainers (attnum.training, attnum.lm.train)
and compared bit for bit with the unified trainer. Deleted once the unified trainer reproduces them."""
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

GOLDEN = Path(__file__).with_name("golden_tmp.json")
TIMING = ("step_time_s", "tokens_per_s", "elapsed_s", "wall_s", "attn_fwd_s", "attn_fwd_bwd_s", "attention_share")


def _api():
    try:
        from attnum.train import LiveDiagnostic, TrainConfig, train, train_corpus, CorpusConfig
        from attnum.train.data import Task
        from attnum.model import GPTConfig
        return dict(new=True, LiveDiagnostic=LiveDiagnostic, TrainConfig=TrainConfig, train=train,
                    Task=Task, GPTConfig=GPTConfig, train_corpus=train_corpus, CorpusConfig=CorpusConfig)
    except ImportError:
        from attnum.training import LiveDiagnostic, TrainConfig, train
        from attnum.tasks import Task
        from attnum.model import GPTConfig
        from attnum.lm.train import TrainConfig as CorpusConfig, train as train_corpus
        return dict(new=False, LiveDiagnostic=LiveDiagnostic, TrainConfig=TrainConfig, train=train,
                    Task=Task, GPTConfig=GPTConfig, train_corpus=train_corpus, CorpusConfig=CorpusConfig)


def _synthetic(api, attention, task_kw, model_kw, train_kw, live=None):
    from attnum.kernels import model_kernel
    task = api["Task"](**task_kw)
    impls = tuple(model_kernel(a, block=8) if ":" in a and a.split(":")[0] in ("emulator", "reference") else a
                  for a in attention)
    cfg = api["GPTConfig"](vocab_size=task.vocab_size, context=task.context, attention=impls, **model_kw)
    callback = api["LiveDiagnostic"](**live) if live else None
    res = api["train"](cfg, task, api["TrainConfig"](**train_kw), progress=False, callback=callback)
    out = {f"rec/{k}": torch.from_numpy(np.asarray(res.records[k].values)) for k in res.records.data_vars}
    for step, state in res.checkpoints.items():
        out.update({f"ckpt{step}/{k}": v.clone() for k, v in state.items()})
    out.update({f"final/{k}": v.detach().clone() for k, v in res.model.state_dict().items()})
    if callback is not None:
        ds = callback.dataset()
        out.update({f"live/{k}": torch.from_numpy(np.asarray(ds[k].values)) for k in ds.data_vars})
    out["diverged_at"] = -1 if res.diverged_at is None else res.diverged_at
    return out


def _corpus(api, **kw):
    import xarray as xr
    base = dict(n_layer=2, n_head=2, d_model=32, context=32, batch_size=8, steps=30, log_every=10, eval_every=10,
                snapshot_every=10, corpus_max_bytes=2_000_000, val_windows=8, diag_batch=2, warmup=5, lr=3e-3,
                sketch_size=16, device="cpu", budget_s=300.0, time_attention=False)
    base.update(kw)
    with tempfile.TemporaryDirectory() as tmp:
        path = api["train_corpus"](api["CorpusConfig"](**base), tmp, progress=lambda s: None)
        ds = xr.open_dataset(path).load()
    out = {}
    for k in list(ds.data_vars) + list(ds.coords):
        if k in TIMING:
            continue
        v = np.asarray(ds[k].values)
        out[f"lm/{k}"] = torch.from_numpy(v.copy()) if v.dtype.kind in "fiub" else v.tolist()
    out["lm/attrs"] = {k: v for k, v in ds.attrs.items() if k not in ("created", "wall_s", "elapsed_s") and "time" not in k}
    return out


def fingerprints() -> dict:
    api = _api()
    runs = {}
    # tests/train/test_training.py's tiny configuration
    runs["tiny"] = _synthetic(api, ("emulator:fa2_bf16:fused", "sdpa:flash"),
                              dict(name="associative_recall", context=16, n_symbols=8, data_seed=0),
                              dict(n_layer=2, n_head=2, d_model=16),
                              dict(steps=12, batch_size=4, warmup_steps=3, grad_clip=1.0, checkpoint_steps=(0, 6, 12),
                                   record_every=2))
    # study 03's smoke tier: induction with lm_loss, fp16 training, a perturbed start, the flash emulator
    smoke03_task = dict(name="induction", context=16, n_symbols=8, data_seed=0, lm_loss=True)
    smoke03_train = dict(steps=20, batch_size=4, lr=0.003, warmup_steps=5, weight_decay=0.0, grad_clip=0.0,
                         checkpoint_steps=(0, 5, 10, 15, 20), record_every=2)
    model = dict(n_layer=2, n_head=2, d_model=16)
    runs["s03_fp16"] = _synthetic(api, ("reference:fa2_fp16",), smoke03_task, model,
                                  dict(smoke03_train, seed=1, perturbation_seed=1_000_004, autocast="fp16"))
    runs["s03_bf16"] = _synthetic(api, ("reference:fa2_bf16",), smoke03_task, model,
                                  dict(smoke03_train, seed=0, perturbation_seed=1_000_003, autocast="bf16"))
    runs["s03_flash_perturbed"] = _synthetic(api, ("emulator:fa2_bf16",), smoke03_task, model,
                                             dict(smoke03_train, seed=0, init_perturbation=1e-6,
                                                  perturbation_seed=1_000_003))
    # study 04's smoke tier: the fused emulator trained with the live diagnostic, weight decay and clipping on
    runs["s04_live"] = _synthetic(api, ("emulator:fa2_bf16:fused",), smoke03_task, model,
                                  dict(steps=40, batch_size=16, lr=0.003, warmup_steps=5, weight_decay=0.1,
                                       grad_clip=1.0, record_every=2, checkpoint_steps=(0, 20, 40)),
                                  live=dict(every=10, spike_factor=3.0, window=50, threshold=0.1))
    # attnum.lm: one member, and a pair with fp16 and the fp32 baseline
    runs["lm_one"] = _corpus(api)
    runs["lm_pair"] = _corpus(api, pair=True, pair_kernel="sdpa:math", pair_amp="fp16", snapshot_early=3, clip=0.5,
                              weight_decay=0.1, schedule="cosine")
    return runs


IGNORED_ATTRS = ("git_commit", "git_dirty", "history", "created", "title")  # title: prose, reworded


def digest(value):
    """sha256 of a tensor's dtype, shape and bytes (NaN is NaN), or the value itself."""
    import hashlib
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes()
                              if t.numel() else f"{t.dtype}{tuple(t.shape)}".encode()).hexdigest()
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in IGNORED_ATTRS}
    return value


def digests(runs: dict) -> dict:
    return {name: {k: digest(v) for k, v in run.items()} for name, run in runs.items()}


def compare(runs: dict, golden: dict) -> list[str]:
    import json
    runs = json.loads(json.dumps(digests(runs), sort_keys=True, default=str))
    bad = []
    for name, ref in golden.items():
        got = runs[name]
        if set(got) != set(ref):
            bad.append(f"{name}: keys differ: {sorted(set(got) ^ set(ref))[:10]}")
        for key in set(got) & set(ref):
            a, b = ref[key], got[key]
            if isinstance(a, dict):
                a = {k: v for k, v in a.items() if k not in IGNORED_ATTRS}
            if a != b:
                if isinstance(a, dict):
                    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                    bad.append(f"{name}/{key}: differ in {keys}")
                else:
                    bad.append(f"{name}/{key}: {str(a)[:120]} != {str(b)[:120]}")
    return bad


if __name__ == "__main__":
    import json
    GOLDEN.write_text(json.dumps(digests(fingerprints()), indent=0, sort_keys=True, default=str))
    print("wrote", GOLDEN, file=sys.stderr)
