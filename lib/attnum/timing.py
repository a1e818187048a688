"""Timing on either device: CUDA events on a GPU (no synchronisation until a time is read), the wall
clock (``time.perf_counter``) on a CPU. One place for the studies, the kernel benchmark and attnum.train."""
from __future__ import annotations

import time

import numpy as np
import torch


class Timer:
    """Marks and the seconds between two of them, on ``device``'s clock."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


def median_ms(fn, warmup: int, repeats: int, device) -> float:
    """Median time of ``fn()`` in milliseconds over ``repeats`` calls, after ``warmup`` untimed ones."""
    timer = Timer(device)
    for _ in range(warmup):
        fn()
    if timer.cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = timer.mark()
        fn()
        times.append(timer.seconds(start, timer.mark()) * 1e3)
    return float(np.median(times))
