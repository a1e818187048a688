"""attnum.timing: one timer for the studies, the kernel benchmark and attnum.train (what it calls, not how fast)."""
import math

from attnum.timing import Timer, median_ms


def test_median_ms_calls_warmup_then_repeats_and_returns_milliseconds():
    calls = []
    ms = median_ms(lambda: calls.append(1), warmup=2, repeats=5, device="cpu")
    assert len(calls) == 7
    assert math.isfinite(ms) and ms >= 0


def test_cpu_timer_reads_the_wall_clock_between_marks():
    timer = Timer("cpu")
    assert not timer.cuda
    start = timer.mark()
    end = timer.mark()
    assert timer.seconds(start, end) == end - start >= 0
