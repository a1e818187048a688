"""The trainer's data: synthetic sequence tasks (``Task``) and the byte corpus (``Corpus``, ``BatchSampler``).

-- Synthetic tasks that need sharp attention, generated in code --

Each task maps ``(step, batch_size)`` to a batch ``(inputs, targets)`` of token ids
(long, shape (batch, context)); ``targets`` is -100 wherever no prediction is
scored. The batch of a step depends only on the task's ``data_seed`` and the
step, never on a model or its initialisation seed, so every run that shares a
data seed sees the same data in the same order.

    associative_recall  key-value pairs, then queries of some keys; predict each
                        queried key's value (multi-query associative recall,
                        Arora et al. 2023, "Zoology")
    copy                a random string, a separator, then the string again; predict
                        the copy
    induction           a random string followed by its repetition; predict each
                        token of the repetition from the previous one (the task of
                        induction heads, Olsson et al. 2022)

``lm_loss=True`` scores every next-token prediction, as a language model is trained:
the unpredictable parts (random strings, keys) then keep an irreducible loss, so
gradients do not vanish once the task is solved, as they do not in pretraining.

-- The byte corpus --

Real text that every machine has without a download: the Python standard library's own source.

The corpus is the bytes of the ``*.py`` files under ``sysconfig.get_paths()['stdlib']``, read in
one fixed order (paths relative to that folder, sorted as strings, folders walked without
following links), each file followed by one ``\\0`` byte as a document separator, concatenated.
A byte-level language model reads it with a vocabulary of 256.

What is left out, and why: ``site-packages``/``dist-packages`` (whatever happens to be installed,
different on every machine) and the test suites (folders named ``test``, ``tests``,
``idle_test``), which distributions strip or split off (Debian's ``libpython3-testsuite``; the
official Docker images delete them), so that two installs of one Python version give the same
corpus as far as possible. ``parts`` can add them back: ``stdlib_tests`` (the test folders of the
standard library) and ``site_packages`` (``*.py`` of the purelib folder; machine-dependent).

Different Python versions give different corpora (3.11's stdlib without tests is about 12 MB in
734 files). Every run records the Python version, the file count, the byte size and the sha256 of
the concatenation (``Corpus.facts``): compare hashes, not names, before comparing runs.

Split: deterministic and contiguous. The files are assigned to validation by a hash of their
relative path (``val_fraction`` of files by the first 8 bytes of sha256(path)), so the split does
not move when a file is added elsewhere and a file is never cut between train and validation.

Batches (``BatchSampler``): the start offsets of every training window for every step are drawn
up front on the CPU from one seeded ``torch.Generator`` (so the data order is the same on every
device, and two runs with the same ``data_seed`` see the same batches in the same order), moved to
the device once; a batch is one gather from the corpus held on the device as a ``uint8`` tensor.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from pathlib import Path

import numpy as np
import torch

from ..model import IGNORE

TASKS = ("associative_recall", "copy", "induction")


@dataclasses.dataclass(frozen=True)
class Task:
    """A seeded synthetic task. ``n_symbols`` sets the vocabulary (see ``vocab_size``)."""

    name: str = "associative_recall"
    context: int = 64
    n_symbols: int = 32
    data_seed: int = 0
    lm_loss: bool = False

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"unknown task {self.name!r}; allowed: {list(TASKS)}")
        if self.context < 4 or self.context % 2:
            raise ValueError(f"context must be an even number >= 4, got {self.context}")
        if self.name == "associative_recall" and self.n_symbols < self.n_pairs:
            raise ValueError(f"associative_recall needs n_symbols >= {self.n_pairs} distinct keys "
                             f"for context {self.context}, got {self.n_symbols}")

    @property
    def n_pairs(self) -> int:
        """Key-value pairs of an associative-recall sequence (3/4 of it; the rest are queries)."""
        return (3 * self.context // 4) // 2

    @property
    def vocab_size(self) -> int:
        if self.name == "associative_recall":
            return 2 * self.n_symbols  # keys, then values
        if self.name == "copy":
            return self.n_symbols + 1  # symbols, then the separator
        return self.n_symbols

    def generator(self, step: int) -> torch.Generator:
        # one stream per (data_seed, step): the data order does not depend on anything else
        return torch.Generator(device="cpu").manual_seed(self.data_seed * 1_000_003 + step)

    def batch(self, step: int, batch_size: int, device="cpu"):
        gen = self.generator(step)
        make = {"associative_recall": self._recall, "copy": self._copy, "induction": self._induction}[self.name]
        inputs, targets = make(batch_size, gen)
        if self.lm_loss:
            targets = torch.cat([inputs[:, 1:], torch.full_like(inputs[:, :1], IGNORE)], dim=1)
        return inputs.to(device), targets.to(device)

    # -- the tasks --

    def _recall(self, b: int, gen):
        n_pairs, n_queries = self.n_pairs, (self.context - 2 * self.n_pairs) // 2
        keys = torch.stack([torch.randperm(self.n_symbols, generator=gen)[:n_pairs] for _ in range(b)])
        values = torch.randint(self.n_symbols, self.n_symbols * 2, (b, n_pairs), generator=gen)
        pick = torch.randint(0, n_pairs, (b, n_queries), generator=gen)
        seq = torch.empty(b, self.context, dtype=torch.long)
        seq[:, 0:2 * n_pairs:2], seq[:, 1:2 * n_pairs:2] = keys, values
        q0 = 2 * n_pairs
        seq[:, q0::2] = keys.gather(1, pick)
        seq[:, q0 + 1::2] = values.gather(1, pick)
        targets = torch.full_like(seq, IGNORE)
        targets[:, q0::2] = values.gather(1, pick)  # at a query key, predict its value
        return seq, targets

    def _copy(self, b: int, gen):
        half = self.context // 2
        string = torch.randint(0, self.n_symbols, (b, half - 1), generator=gen)
        sep = torch.full((b, 1), self.n_symbols, dtype=torch.long)
        seq = torch.cat([string, sep, string, string[:, :1]], dim=1)[:, :self.context]
        targets = torch.full_like(seq, IGNORE)
        targets[:, half - 1:self.context - 2] = seq[:, half:self.context - 1]
        return seq, targets

    def _induction(self, b: int, gen):
        half = self.context // 2
        string = torch.randint(0, self.n_symbols, (b, half), generator=gen)
        seq = torch.cat([string, string], dim=1)
        targets = torch.full_like(seq, IGNORE)
        targets[:, half:-1] = seq[:, half + 1:]
        return seq, targets


# -- the byte corpus --
PARTS = ("stdlib", "stdlib_tests", "site_packages")
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
INSTALLED_DIRS = frozenset({"site-packages", "dist-packages"})
SEPARATOR = b"\0"
VOCAB_SIZE = 256


def _py_files(root: Path, *, tests: str) -> list[Path]:
    """``*.py`` under ``root`` in sorted relative-path order; ``tests``: "skip", "only" or "any"."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        rel_parts = Path(folder).relative_to(root).parts
        dirs[:] = sorted(d for d in dirs if d not in INSTALLED_DIRS and d != "__pycache__")
        in_tests = bool(set(rel_parts) & TEST_DIRS)
        if tests == "skip":
            dirs[:] = [d for d in dirs if d not in TEST_DIRS]
        if tests != "only" or in_tests:
            found += [Path(folder) / f for f in files if f.endswith(".py") and not os.path.islink(Path(folder) / f)]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def source_files(parts=("stdlib",)) -> list[tuple[str, Path]]:
    """``(label, path)`` of every file of the corpus, in corpus order; the label is
    ``<part>/<path relative to the part's root>``."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"corpus parts must be a non-empty selection of {list(PARTS)}, got {list(parts)}")
    paths = sysconfig.get_paths()
    roots = {"stdlib": (Path(paths["stdlib"]), "skip"), "stdlib_tests": (Path(paths["stdlib"]), "only"),
             "site_packages": (Path(paths["purelib"]), "any")}
    out = []
    for part in PARTS:  # fixed order of parts, whatever order they were named in
        if part not in parts:
            continue
        root, tests = roots[part]
        if not root.is_dir():
            raise FileNotFoundError(f"corpus part {part!r}: folder {root} does not exist")
        out += [(f"{part}/{p.relative_to(root).as_posix()}", p) for p in _py_files(root, tests=tests)]
    return out


def _in_validation(label: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "big")
    return h < val_fraction * 2 ** 64


@dataclasses.dataclass
class Corpus:
    """The corpus as bytes, split; ``facts`` are what a record stores about it."""

    train: np.ndarray  # uint8
    val: np.ndarray  # uint8
    facts: dict

    @classmethod
    def build(cls, parts=("stdlib",), val_fraction: float = 0.05, max_bytes: int = 0) -> "Corpus":
        """Read the corpus. ``max_bytes`` > 0 keeps only the first files up to that many bytes
        (tests; the facts then describe the truncated corpus)."""
        if not 0 < val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
        files = source_files(tuple(parts))
        digest, train, val, total, n_files, n_val = hashlib.sha256(), [], [], 0, 0, 0
        for label, path in files:
            data = path.read_bytes() + SEPARATOR
            if max_bytes and total + len(data) > max_bytes and n_files:
                break
            digest.update(data)
            total += len(data)
            n_files += 1
            if _in_validation(label, val_fraction):
                val.append(data)
                n_val += 1
            else:
                train.append(data)
        if not train or not val:
            raise ValueError(f"corpus {list(parts)} has too few files ({n_files}) for a train/validation split")
        train_b, val_b = b"".join(train), b"".join(val)
        facts = {"corpus_parts": ",".join(p for p in PARTS if p in parts),
                 "corpus_python": platform.python_version(),
                 "corpus_implementation": platform.python_implementation(),
                 "corpus_root": sysconfig.get_paths()["stdlib"],
                 "corpus_files": n_files, "corpus_val_files": n_val,
                 "corpus_bytes": total, "corpus_train_bytes": len(train_b), "corpus_val_bytes": len(val_b),
                 "corpus_sha256": digest.hexdigest(), "corpus_val_fraction": val_fraction,
                 "corpus_max_bytes": max_bytes}
        return cls(np.frombuffer(train_b, dtype=np.uint8), np.frombuffer(val_b, dtype=np.uint8), facts)


class BatchSampler:
    """Random training windows and fixed validation windows, gathered on the device.

    ``offsets`` (steps, batch) are drawn on the CPU from ``torch.Generator().manual_seed(data_seed)``:
    batch ``s`` is the same on every device and in every run with this seed, batch size, context,
    and training split. ``order_sha256`` hashes them (a pair's two records must agree on it).
    """

    def __init__(self, corpus: Corpus, *, context: int, batch_size: int, steps: int, data_seed: int,
                 device="cpu", val_windows: int = 64):
        n = len(corpus.train)
        if n < context + 2 or len(corpus.val) < context + 2:
            raise ValueError(f"the corpus splits ({n}, {len(corpus.val)} bytes) are shorter than one "
                             f"window of context {context} + 1")
        self.context, self.batch_size, self.device = context, batch_size, torch.device(device)
        gen = torch.Generator(device="cpu").manual_seed(int(data_seed))
        offsets = torch.randint(0, n - context - 1, (steps, batch_size), generator=gen, dtype=torch.int64)
        self.order_sha256 = hashlib.sha256(offsets.numpy().tobytes()).hexdigest()
        self.offsets = offsets.to(self.device)
        self.train = torch.from_numpy(corpus.train.copy()).to(self.device)
        self.val = torch.from_numpy(corpus.val.copy()).to(self.device)
        # validation: evenly spaced windows over the whole validation split, always the same
        m = len(corpus.val) - context - 1
        self.val_offsets = torch.linspace(0, m, val_windows, dtype=torch.float64).round().long().to(self.device)
        self._span = torch.arange(context + 1, device=self.device)

    def _windows(self, data, starts):
        chunk = data[starts[:, None] + self._span].long()
        return chunk[:, :-1], chunk[:, 1:]

    def batch(self, step: int):
        """``(inputs, targets)`` of training step ``step`` (int64, shape (batch, context))."""
        if not 0 <= step < len(self.offsets):
            raise IndexError(f"step {step} is outside the {len(self.offsets)} planned steps")
        return self._windows(self.train, self.offsets[step])

    def val_batches(self, batch_size: int | None = None):
        """The validation windows, in batches of ``batch_size`` (default: the training batch size)."""
        size = batch_size or self.batch_size
        for i in range(0, len(self.val_offsets), size):
            yield self._windows(self.val, self.val_offsets[i:i + size])
