"""Synthetic sequence tasks that need sharp attention, generated in code.

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
"""
from __future__ import annotations

import dataclasses

import torch

TASKS = ("associative_recall", "copy", "induction")
IGNORE = -100


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
