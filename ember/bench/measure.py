"""Small measuring helpers shared by the benchmarks."""
from __future__ import annotations

import statistics
import sys
import time


def median_time(fn, reps: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(dtype, threads: int) -> dict[str, float]:
    """The machine's matmul rate, measured now (the roofline prefill is held against)."""
    import torch
    torch.set_num_threads(threads)
    shapes = {"square_1024": (1024, 1024, 1024), "prefill_mlp_2048x576x1536": (2048, 576, 1536)}
    rates = {}
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        seconds = median_time(lambda a=a, b=b: torch.mm(a, b), reps=5)
        rates[name] = 2 * m * k * n / seconds / 1e9
    rates["roofline"] = max(rates.values())
    return rates


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)
