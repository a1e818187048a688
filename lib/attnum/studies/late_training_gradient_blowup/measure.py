"""Study 04's measurements for one tier, in one call: the parameters say where the data come from.

``measure(p)`` runs the study's experiments (the mechanism grids, the sources' checks, Qiu & Yao's regime,
the two training runs with the FP32 recompute diagnostic, the real kernels) at the sizes of ``p``; when
``p["gpu_records"]`` names a folder of GPU training records (the ``gpu_training`` tier) it gathers those
records instead and trains nothing, setting them beside the committed ``gpu`` run's mechanism grid, and with
``p["sweep_records"]`` also the designed sweep's records (``designed.sweep_dataset``).
"""
from __future__ import annotations

import xarray as xr

from ... import kernels
from ... import ncio
from . import STUDY, designed, experiments, gpu_training, readings
from . import real_kernels as real
from . import trainer


def measure(p: dict) -> xr.Dataset:
    """The tier's results (not yet written): the experiments at ``p``'s sizes, or the gathered GPU
    training records when ``p["gpu_records"]`` is set (a folder without a record of this study raises
    before anything runs, naming what is missing)."""
    if p.get("gpu_records"):
        folder = gpu_training.check_gpu_records(p["gpu_records"])
        results = gpu_training.gpu_training_dataset(folder, readings.cuda_run(ncio.committed_run(STUDY, "gpu")),
                                                    level=p["diag_threshold"])
        if p.get("sweep_records"):
            sweep = designed.sweep_dataset(p["sweep_records"])
            attrs = {**results.attrs, **sweep.attrs}
            results = xr.merge([results, sweep], join="outer", compat="no_conflicts", combine_attrs="override")
            results.attrs.update(attrs)
        results.attrs["headline_figure"] = "gpu_training.png"
        return results
    device = p["device"]
    task = trainer.Task(p["task"], context=p["context"], n_symbols=p["n_symbols"], data_seed=p["data_seed"],
                        lm_loss=p["lm_loss"])
    attention = {"bf16": kernels.model_kernel(p["train_attention"], block=p["model_block"]),
                 "fp32": kernels.model_kernel(p["baseline_attention"], block=p["model_block"])}
    model = trainer.GPTConfig(vocab_size=task.vocab_size, context=p["context"], n_layer=p["n_layer"],
                              n_head=p["n_head"], d_model=p["d_model"])
    train = trainer.TrainConfig(steps=p["steps"], batch_size=p["batch_size"], lr=p["lr"],
                                warmup_steps=p["warmup_steps"], weight_decay=p["weight_decay"],
                                grad_clip=p["grad_clip"], seed=p["train_seed"],
                                checkpoint_steps=tuple(p["checkpoint_steps"]), record_every=p["record_every"])
    diag_batch = task.batch(10 ** 7, p["diag_batch_size"], device)  # a step index no run reaches
    common = dict(block_q=p["block_q"], block_k=p["block_k"], golden_chunk=p["golden_chunk"], device=device)
    grid = (p["sharpness"], p["mu_norms"], p["seq_lens"], p["head_dims"], p["seeds"])
    mechanism = experiments.mechanism_grid(*grid, variants=p["variants"], **common)
    axis_offset = experiments.mechanism_grid(*grid, variants=p["variants"], operands="axis_offset", **common)
    sources = experiments.source_checks(p["sharpness"], p["mu_norms"], p["src_seq_len"], p["src_head_dim"],
                                        p["seeds"], formats=p["src_formats"], **common)
    tied = experiments.tied_maxima_comparison(p["tie_seq_len"], p["tie_head_dim"], p["seeds"], variants=p["variants"],
                                              n_ties=p["n_ties"], mu_norm=p["tie_mu_norm"], **common)
    live = trainer.LiveDiagnostic(p["diagnose_every"], p["spike_factor"], threshold=p["diag_threshold"])
    records, runs = trainer.train_runs(task, model, train, attention, device=device, callbacks={"bf16": live})
    trained_model = trainer.GPTConfig(**{**model.__dict__, "attention": (attention["bf16"],)})
    diagnostics = experiments.checkpoint_diagnostics(runs["bf16"], trained_model, diag_batch, p["offset_norms"],
                                                     threshold=p["diag_threshold"], seed=p["train_seed"], device=device)
    real_mech = real.real_mechanism_grid(p["real_kernels"], p["sharpness"], p["mu_norms"], p["real_seq_lens"],
                                         p["real_head_dims"], p["seeds"], variants=p["real_variants"], **common)
    real_diag = real.real_kernel_diagnostics(runs["bf16"], trained_model, diag_batch, p["real_kernels"],
                                             p["offset_norms"], threshold=p["diag_threshold"], seed=p["train_seed"],
                                             device=device)
    results = xr.merge([mechanism, axis_offset, sources, tied, records, live.dataset(), diagnostics, real_mech,
                        real_diag], join="outer", compat="no_conflicts")
    results.attrs["headline_figure"] = "error_vs_offset.png"
    return results
