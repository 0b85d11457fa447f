"""Measured medians, for the parts of the product that plan by what this machine really costs (the
parallel planners' cost profiles) and for the benchmarks."""
from __future__ import annotations

import statistics
import time


def median_time(fn, reps: int = 3, warmup: int = 1) -> float:
    """The median of `reps` timed calls of `fn()` (seconds), after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
