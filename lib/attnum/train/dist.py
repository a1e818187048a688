"""Data-parallel corpus runs (``torch.distributed``) and the checkpoints that let a run continue.

Under ``torchrun --nproc-per-node N`` (or ``python -m attnum.train train --nproc-per-node N``, which starts
torchrun itself) every process reads its rank from the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and joins one process group: backend ``nccl`` on CUDA (one
GPU per process, ``cuda:LOCAL_RANK``), ``gloo`` on the CPU. Without that environment a run is one process
and nothing here changes its arithmetic (``World.single()``: no group, no wrapper, no collective).

What each rank does (``World``):

* Data. ``cfg.batch_size`` is the global batch. Every rank builds the same ``BatchSampler`` (the offsets of
  every step drawn from ``data_seed`` alone), takes rows ``[r B/N, (r+1) B/N)`` of step s's global batch
  (``World.shard``), and so the global data order, and its hash in the record (``data_order_sha256``), is the
  one-process run's. A global batch not divisible by N is refused before the process group starts.
* Gradients. Each member's model is wrapped in ``DistributedDataParallel``, which all-reduces (averages) the
  gradients during the backward; every rank then holds the same gradients, so the clipping norm, fp16's
  inf check and the AdamW update are the same on every rank and the replicas stay equal. With every
  position scored (the corpus) and equal shards, the mean of the N shard gradients is the gradient of the
  global batch's mean loss; it differs from one process's only by the order of the floating-point sums.
* Logging. At a logged row the ranks' running loss sums are all-reduced (one collective, which also carries
  every rank's stop vote), so every rank reads the same mean loss and makes the same non-finite decision.
  The FP32-recompute diagnostic, validation, weight sketches, the record and the checkpoint are rank 0's
  only, on the unwrapped model (its backward outside a DDP forward starts no all-reduce); the other ranks
  wait at the next collective.
* Stopping. The wall-clock budget is voted on at the logged rows (a collective per step would cost a host
  sync per step): a rank votes stop when the next ``log_every`` steps would pass the budget at the last
  interval's speed; any vote stops all. So a data-parallel budget stop always falls on a logged row.

NVLink multicast stays off in every process this starts or joins (``MULTICAST_OFF``: ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, and NVSHMEM's ``NVSHMEM_DISABLE_NVLS=1``): on the lent multi-GPU
machines a program that uses NVLink multicast can put the host's shared GPUs out of service for a day or more
(the device tool's KINDS.md), and NCCL picks NVLS (NVLink SHARP, multicast) by itself on NVSwitch systems
when it is allowed. NCCL and torch's symmetric memory read these variables when a communicator is made, so
they are set before the process group starts (and in the environment of the torchrun that
``--nproc-per-node`` starts), overriding what the environment said (a warning names an overridden value);
the record keeps the values its rank 0 saw (``env_*`` attributes).

Checkpoints (``save_checkpoint``/``load_checkpoint``): one file ``checkpoint.pt`` per run in the checkpoint
folder, written atomically by rank 0: per member the weights, the AdamW state and the loss scaler's state;
the optimiser steps done; torch's, NumPy's and Python's random-generator states (nothing in the trainer
draws from them: the data order and the weights come from seeded generators of their own, but a callback
may); the record's contents so far; the run's parameters. It holds tensors, numbers, strings, lists and
dicts only and is read with ``torch.load(weights_only=True)``: no code runs on reading it. A later command
with the same parameters (the budget, ``time_attention`` and ``device`` may differ) continues from it:
the same data order from the next step, the same weights and optimiser state, so on the CPU the continued
run's losses are bitwise the uninterrupted run's; its record holds the whole run (``resumed_at`` lists the
steps it continued from, ``elapsed_s`` and ``wall_s`` add up the commands' times).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import warnings
from pathlib import Path

import numpy as np
import torch

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Environment of every process a run starts: NVLink multicast (NVLS, symmetric-memory multicast) off."""
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
CHECKPOINT = "checkpoint.pt"
RESUMABLE = ("budget_s", "time_attention", "device")
"""Parameters a continued run may change; every other one must equal the checkpoint's."""


def multicast_off(env=None) -> dict:
    """Set ``MULTICAST_OFF`` in ``env`` (default ``os.environ``), warning about any value it overrides."""
    env = os.environ if env is None else env
    for key, value in MULTICAST_OFF.items():
        if env.get(key, value) != value:
            warnings.warn(f"{key}={env[key]} overridden to {value}: NVLink multicast stays off", stacklevel=2)
        env[key] = value
    return env


def launched_by_torchrun(env=None) -> bool:
    env = os.environ if env is None else env
    return "WORLD_SIZE" in env and "RANK" in env


def check_world_size(batch_size: int, world_size: int) -> None:
    """The global batch must split into equal shards (equal shards make the mean of the shard gradients
    the global batch's gradient)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"the number of processes must be a positive integer, got {world_size!r}")
    if batch_size % world_size:
        raise ValueError(f"global batch_size {batch_size} is not divisible by the {world_size} processes "
                         f"(WORLD_SIZE / --nproc-per-node): each rank takes an equal shard; choose a batch size "
                         f"that is a multiple of {world_size} or another number of processes")


@dataclasses.dataclass
class World:
    """This process's place in the run: ``rank`` of ``size``; ``group`` true when a process group is up
    (then the models are wrapped and the row reductions are collectives)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str = ""
    group: bool = False

    @classmethod
    def single(cls) -> "World":
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, cfg) -> "World":
        """The torchrun environment's world, its process group started (``World.single()`` without one).
        ``cfg`` is checked against the world size first, so a bad one is refused before any work."""
        if not launched_by_torchrun():
            return cls.single()
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        check_world_size(cfg.batch_size, size)
        if cfg.data != "corpus":
            raise ValueError("data-parallel training runs the corpus (data='corpus'); a task run is one process")
        multicast_off()
        import torch.distributed as dist

        cuda = torch.device(cfg.device).type == "cuda"
        backend = "nccl" if cuda else "gloo"
        if not dist.is_initialized():
            if cuda:
                torch.cuda.set_device(local)
            dist.init_process_group(backend=backend, device_id=torch.device("cuda", local) if cuda else None)
        return cls(rank=rank, size=size, local_rank=local, backend=dist.get_backend(), group=True)

    @classmethod
    def from_group(cls) -> "World":
        """The world of a process group started by the caller."""
        import torch.distributed as dist

        rank = dist.get_rank()
        return cls(rank=rank, size=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                   backend=dist.get_backend(), group=True)

    def device(self, device: str) -> str:
        """This rank's device: ``cuda:LOCAL_RANK`` for a CUDA run in a group, else ``device``."""
        d = torch.device(device)
        if self.group and d.type == "cuda":
            return f"cuda:{self.local_rank}"
        return device

    def shard(self, batch):
        """This rank's rows of a global batch (the batch itself for one process)."""
        if self.size == 1:
            return batch
        n = batch[0].shape[0] // self.size
        return tuple(t[self.rank * n:(self.rank + 1) * n] for t in batch)

    def wrap(self, model: torch.nn.Module):
        """The callable a member trains through: the model, or its DDP wrapper in a group."""
        if not self.group:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [model.tok_emb.weight.device] if model.tok_emb.weight.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def reduce_row(self, loss_sums: list, stop: bool) -> tuple[list, bool]:
        """The ranks' mean of each running loss sum, and whether any rank voted stop (one all-reduce)."""
        if not self.group:
            return loss_sums, stop
        import torch.distributed as dist

        flat = torch.stack([s.detach().float().reshape(()) for s in loss_sums]
                           + [torch.tensor(float(stop), device=loss_sums[0].device)])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        return [flat[i] / self.size for i in range(len(loss_sums))], bool(flat[-1].item() > 0)

    def barrier(self) -> None:
        if self.group:
            import torch.distributed as dist

            dist.barrier()

    def facts(self) -> dict:
        """The record's attributes: processes, backend, and the multicast variables as this process saw them."""
        out = {"dist_world_size": self.size, "dist_backend": self.backend or "none"}
        out.update({f"env_{key}": os.environ.get(key, "") for key in MULTICAST_OFF})
        return out


# -- checkpoints --------------------------------------------------------------------------------------

def _plain(value):
    """Numpy arrays to tensors, numpy scalars to Python numbers, recursively (what weights_only reads)."""
    if isinstance(value, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.ascontiguousarray(value).copy())}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _restore(value):
    if isinstance(value, dict):
        if set(value) == {"__ndarray__"}:
            return value["__ndarray__"].numpy()
        return {k: _restore(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_restore(v) for v in value)
    return value


STATE_FIELDS = ("steps", "elapsed_s", "lr", "step_time_s", "grad_norms", "member_rows", "member_layers",
                "nonfinite_step", "attention_timing", "snapshot_steps", "sketches", "weight_l2", "pair_drift",
                "resumed_at")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": json.dumps(random.getstate())}
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(folder, *, cfg, members, done: int, run_state, final_cost: float, wall_s: float) -> Path:
    """Write ``folder/checkpoint.pt`` atomically (rank 0's call; see the module docstring)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": 1,
        "params": json.dumps(cfg.params(), sort_keys=True),
        "done": int(done),
        "final_cost": float(final_cost),
        "wall_s": float(wall_s),
        "members": {m.label: {"model": m.model.state_dict(), "optimizer": m.opt.state_dict(),
                              "scaler": m.scaler.state_dict(), "nonfinite_step": int(m.nonfinite_step)}
                    for m in members},
        "rng": rng_state(),
        "record": _plain({key: getattr(run_state, key) for key in STATE_FIELDS}),
    }
    path = folder / CHECKPOINT
    tmp = folder / (CHECKPOINT + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(folder, cfg) -> dict:
    """Read ``folder/checkpoint.pt`` for a run with parameters ``cfg``; a clear error when there is none or
    when it belongs to a run with other parameters (other than ``RESUMABLE``)."""
    path = Path(folder) / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint {path} to continue from (start the run without --resume)")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    saved, now = json.loads(payload["params"]), json.loads(json.dumps(cfg.params(), sort_keys=True))
    differ = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE and saved.get(k) != now.get(k))
    if differ:
        raise ValueError(f"checkpoint {path} belongs to another run: parameters {differ} differ "
                         f"(checkpoint: {[saved.get(k) for k in differ]}, now: {[now.get(k) for k in differ]})")
    if payload["done"] >= cfg.steps:
        raise ValueError(f"checkpoint {path} is at step {payload['done']}: the run's {cfg.steps} steps are done")
    payload["record"] = _restore(payload["record"])
    return payload


def restore_members(payload: dict, members) -> None:
    for m in members:
        saved = payload["members"][m.label]
        m.model.load_state_dict(saved["model"])
        m.opt.load_state_dict(saved["optimizer"])
        m.scaler.load_state_dict(saved["scaler"])
        m.nonfinite_step = saved["nonfinite_step"]
        if m.nonfinite_step >= 0:
            m.stopped_at = m.nonfinite_step


def restore_run_state(payload: dict, run_state) -> None:
    for key, value in payload["record"].items():
        setattr(run_state, key, value)


def elapsed_offset(payload: dict) -> float:
    """The run's wall clock at its checkpoint: a continued run's clock starts from it."""
    wall = float(payload.get("wall_s", math.nan))
    return wall if math.isfinite(wall) else 0.0
