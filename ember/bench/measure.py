"""Small measuring helpers shared by the benchmarks."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ember.util.timing import median_time  # noqa: F401 - the benchmarks' import of it


def matmul_gflops(dtype, threads: int) -> dict[str, float]:
    """The machine's best matmul rate, measured now: the roofline prefill is held against.

    Both torch.mm (MKL) and oneDNN's prepacked kernel are tried, on a square problem and on
    the model's prefill shapes; the roofline is the best of them.
    """
    import torch

    from ember.kernels.cpu_linear import PackedLinear, onednn_available
    torch.set_num_threads(threads)
    shapes = {"square_1024": (1024, 1024, 1024), "mlp_up_1024x576x3072": (1024, 576, 3072),
              "mlp_down_1024x1536x576": (1024, 1536, 576)}
    rates = {}
    if dtype == torch.bfloat16 and not onednn_available(dtype):
        # emulated in software here (~100x slower than float32): one small problem says so in
        # seconds instead of a minute, and float32's rate is the roofline
        shapes = {"square_256_emulated": (256, 256, 256)}
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        rates[f"mm_{name}"] = 2 * m * k * n / median_time(lambda a=a, b=b: torch.mm(a, b), reps=5) / 1e9
        if onednn_available(dtype):  # bf16 packing needs AVX512 / AVX-NE-CONVERT
            packed = PackedLinear(b.t().contiguous())
            rates[f"onednn_{name}"] = 2 * m * k * n / median_time(lambda a=a, p=packed: p(a), reps=5) / 1e9
    rates["roofline"] = max(rates.values())
    return rates


def require(module: str, why: str):
    """`import module` for a benchmark that measures against it (a peer or a plot library, not a
    dependency of the product): a clear message when it is missing, not a traceback."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(f"ember bench: {why} needs the Python package {module.split('.')[0]!r}, which is not "
                         "installed: pip install 'ember[bench]' (or .venv from `make setup`, which has it)") from None


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def write_result(result: dict, output: str) -> None:
    """Write the benchmark's JSON and print its targets table."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["targets"], indent=2))
    progress(f"wrote {out}")
