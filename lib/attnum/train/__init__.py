"""One trainer for every scale: ``attnum.model.GPT`` on a synthetic task (CPU) or on the byte corpus (GPU).

A byte-level GPT-2-style language model on the Python standard library's own source, trained on
one GPU in one command, attention chosen per run from the kernel registry; every run writes one
compact NetCDF record that the studies' ``gpu_training`` tiers gather.

Modules
    loop     one ``TrainConfig`` and one ``train``: the data source is the config's ``data``, a synthetic
             ``Task`` ("task": bitwise reproducible on the CPU; the tiny models of studies 03-05) or the
             byte corpus ("corpus", preset ``TrainConfig.byte_lm``: one run or a lockstep pair within a
             wall-clock budget, one record per command); ``train_runs`` (several kernels from one start),
             ``LiveDiagnostic``
    data     ``Task`` (synthetic tasks) and the stdlib corpus (``Corpus``: fixed order, hash-based
             train/validation split by file, facts and sha256 recorded) with its device-side sampler
             (``BatchSampler``, data order fixed by ``data_seed``)
    diag     the FP32-recompute diagnostic (``recompute_backward_fp32``, ``backward_errors``), per-layer
             statistics (common key offset, sharpness), gradient norms, attention timing, weight
             sketches and exact pair drift
    record   one schema (``VARIABLES``; ``ATTRS`` the names every run records): a task run's (step, layer)
             records (the ``train_*`` variables of a study's results) and a corpus run's NetCDF record;
             ``open_record``/``convert`` read the records of the old corpus layout in it, ``gather`` (a
             folder of records -> one Dataset), ``pair_drift`` and ``sketch_drift`` (for
             ``attnum.drift.aggregate``), ``summary``
    bench    the step-time benchmark of every attention choice
    dist     data-parallel corpus runs under torchrun (``World``: DDP, rank 0's records, NVLink multicast off)
             and the checkpoints a later command continues from

The model is ``attnum.model.GPT`` at both scales; ``GPTConfig.byte_lm`` is the corpus runs' setting
(bf16 autocast for the matmuls, attention ``AttentionChoice`` = registry name [@dtype] called outside
autocast).

Command line (``PYTHONPATH=lib``; every ``TrainConfig`` field but the task runs' own is a flag, its default the
``TrainConfig.byte_lm`` preset's)::

    python -m attnum.train train --kernel sdpa:flash --lr 1e-3 --budget-s 540 --out DIR
    python -m attnum.train train --kernel sdpa:flash --pair --pair-kernel sdpa:math --out DIR   # study 03 pair
    python -m attnum.train bench --out DIR/bench.json
    python -m attnum.train gather DIR --out gathered.nc
    python -m attnum.train corpus            # this machine's corpus facts (size, files, sha256)
    python -m attnum.train train --plan pilot --nproc-per-node 8 --batch-size 128 --checkpoint-dir CK --out DIR
    python -m attnum.train train --plan pilot --nproc-per-node 8 --batch-size 128 --checkpoint-dir CK --out DIR --resume

Attention choices: ``sdpa:flash`` (bf16, PyTorch's FlashAttention-2), ``sdpa:math`` (fp32 by
default: the baseline, attention computed in fp32 from the bf16-computed projections, TF32 off),
``triton:fa2``, ``triton:fa2:gproj_dq``, ``triton:fa2:gproj_dq_dk``, ``triton:fa2:fp32_bwd``,
``triton:fa2:fp32_bwd:bf16x3`` (the FP32 backward on the bf16 tensor cores; our Triton kernel; on a
CPU it is reported unavailable, not run), any other registry name, with
``@bf16``/``@fp16``/``@fp32`` to force the operands' dtype.

Choice of scale for one H200 in one command (9.5 minutes, start-up included). All numbers in this
paragraph are estimates made before any GPU run, to be replaced by the pilot run's measured
throughput (the record's ``tokens_per_s``):

* Model: GPT-2 small's geometry, 12 layers, d_model 768, 12 heads of 64, context 1024 (Qiu & Yao's
  model, arXiv 2510.04212), byte vocabulary (256), so 85 M parameters in the blocks and about 86 M
  in all. Batch 16 x 1024 = 16 k tokens a step, AdamW, no torch.compile. At an estimated
  250-450 k tokens/s in eager bf16 on an H200 (30-50% of the dense bf16 peak; not measured yet),
  about 510 s of training gives roughly 130-230 M tokens, 8 k-14 k steps.
* Corpus: 3.11's stdlib without tests is 12.1 MB (734 files; the device's Python may differ, the
  record says which); 130-230 M tokens are 10-20 passes over it, so late in a run the model
  memorises, and validation loss rises. We keep it (real text, no download) and record the
  validation loss; ``--corpus stdlib,stdlib_tests`` adds the test suite (31.5 MB in 1790 files in
  all on 3.11.7 here) where the installed Python has one.
* A pair (study 03) trains two models in lockstep: half the tokens per model in the same time.

What this costs the question. Qiu & Yao's loss explosion came after tens of billions of tokens
(their reproduction resumes from a checkpoint at step 70000, ~0.33 M tokens a step: Qiu & Yao
2025, arXiv 2510.04212); one command reaches ~0.1-0.2 B tokens, 100-200 times
fewer, and a campaign of a few commands does not change the order of magnitude. So a run that does
not diverge bounds the phenomenon rather than refuting it: the record gives the tokens reached, the
common key offset (``key_mean_norm``, ``offset_logit``), the sharpness (``max_prob``, ``entropy``)
and the dQ error reached, to set against the mechanism grid of study 04. Harsher settings that
reach the sharp regime sooner are parameters (higher ``--lr``, ``--grad-clip 0``, ``--warmup-steps 0``, a
smaller model with more steps), and each is a departure from the sources' setting to be stated.

Campaign: ``params/lm/campaign.yaml`` names every planned run (``python -m attnum.train plan``
lists them); ``python -m attnum.train train --plan NAME --out $OUT`` runs one, flags overriding the
plan. Each run leaves ``lm_<NAME>_s<seed>_d<data seed>.nc`` (a few MiB at most) in ``--out``;
commit the records together under ``outputs/lm/records/`` (the folder the studies' ``gpu_training`` tiers read) and ``gather`` them.

Running on the lent H200 (from the repository root, ``.whl`` carried for netCDF4; set the commit,
since the copy there has no git history)::

    set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=lib ATTNUM_GIT_COMMIT=<sha> ATTNUM_GIT_DIRTY=false
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
    python3 -m attnum.train corpus | tee $OUT/lm_corpus.json                              # that Python's corpus
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/train/test_corpus.py 2>&1 | tee $OUT/lm_gpu_tests.log
    python3 -m attnum.train bench --out $OUT/lm_step_cost.json 2>&1 | tee $OUT/lm_bench.log
    python3 -m attnum.train train --plan pilot --out $OUT 2>&1 | tee $OUT/lm_pilot.log      # one run

The training budget (``--budget-s``, 540 s by default, 480 in ``pilot``) counts from the Python
process' start; pip's few seconds come before it, so one run fits a 600 s command.

Bench: the same model at contexts 1024 and 4096 with 8192 tokens a step; attention's
FLOPs relative to the linear layers' are ~N / (12 d_model): 0.11 at 1024, 0.44 at 4096, so at 4096
attention is a real share of the step. Estimated run time on one H200: about 1-2 minutes
(seven choices x two contexts x 27 steps, plus Triton compilation; fp32 attention is the slowest).
"""
from __future__ import annotations

from . import data, diag, dist, loop, record
from .data import IGNORE, PARTS, TASKS, BatchSampler, Corpus, Task
from .diag import recompute_backward_fp32
from .record import ATTRS, LAYER_RECORDS, STEP_RECORDS, record_variables, records_dataset
from .loop import (AUTOCAST, LiveDiagnostic, TrainConfig, TrainResult, build_model, learning_rate, load_checkpoint,
                   preserve_gradients, torch_threads, train, train_runs, validation_loss)

__all__ = ["ATTRS", "AUTOCAST", "BatchSampler", "Corpus", "IGNORE", "LAYER_RECORDS", "LiveDiagnostic",
           "PARTS", "STEP_RECORDS", "TASKS", "Task", "TrainConfig", "TrainResult", "build_model", "data", "diag",
           "dist", "learning_rate", "load_checkpoint", "loop", "preserve_gradients", "recompute_backward_fp32",
           "record", "record_variables", "records_dataset", "torch_threads", "train", "train_runs",
           "validation_loss"]
