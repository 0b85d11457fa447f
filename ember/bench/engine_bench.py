"""`ember bench engine`: prefill and decode speed of Ember's engine beside transformers.

Both run in this process on the same GGUF weights and threads, one after the other, so
the ratios hold on a noisy machine. Startup time and peak RSS come from a fresh serving
process (ember.bench.serve_probe).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from ember.bench.measure import matmul_gflops, median_time, progress
from ember.engine.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prefill_flops(args, num_tokens: int) -> float:
    """FLOPs a prefill of num_tokens needs: linears, causal attention, one row of logits."""
    h, inter, kv = args.hidden_size, args.intermediate_size, args.num_kv_heads * args.head_dim
    per_layer_params = h * (args.num_heads * args.head_dim) * 2 + h * kv * 2 + 3 * h * inter
    linears = 2 * num_tokens * per_layer_params * args.num_layers
    attention = 4 * args.num_heads * args.head_dim * num_tokens * (num_tokens + 1) / 2 * args.num_layers
    logits = 2 * h * args.vocab_size
    return linears + attention + logits


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(count)]


def ember_prefill(engine: LLMEngine, length: int, seed: int) -> float:
    prompts = iter(random_prompts(4, length, seed))  # fresh prompt each time: no cache hits
    seconds = median_time(lambda: engine.generate([next(prompts)], SamplingParams(max_tokens=1)), reps=3)
    return length / seconds


def ember_decode(engine: LLMEngine, batch: int, new_tokens: int, seed: int) -> float:
    for p in random_prompts(batch, 64, seed):
        engine.add_request(p, SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True))
    produced = 0
    while produced < batch:  # prefill (and first token) of every sequence
        produced += len(engine.step())
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished():
        produced += len(engine.step())
    return produced / (time.perf_counter() - start)


def hf_prefill(model, length: int, seed: int) -> float:
    prompts = iter(random_prompts(4, length, seed))

    def run():
        ids = torch.tensor([next(prompts)])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    with torch.inference_mode():
        return length / median_time(run, reps=3)


def hf_decode(model, batch: int, new_tokens: int, seed: int) -> float:
    ids = torch.tensor(random_prompts(batch, 64, seed))
    mask = torch.ones_like(ids)

    def gen(n):
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
        return time.perf_counter() - start
    with torch.inference_mode():
        gen(2)
        decode_seconds = gen(new_tokens + 1) - gen(1)
    return batch * new_tokens / decode_seconds


def run_serve_probe(model: str, kv_cache_mb: int, threads: int) -> dict:
    cmd = [sys.executable, "-m", "ember.bench.serve_probe", "--model", model,
           "--kv-cache-mb", str(kv_cache_mb), "--threads", str(threads)]
    runs = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout)
            for _ in range(2)]
    return runs[-1] | {"startup_to_first_token_s_first_run": runs[0]["startup_to_first_token_s"]}


def bench_ember(model: str, dtype: str, threads: int, kv_cache_mb: int, quick: bool) -> dict:
    progress(f"ember {dtype}: loading")
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, num_threads=threads,
                                    kv_cache_bytes=kv_cache_mb * 2**20))
    lengths, batches, new_tokens = ((128, 512), (1, 8), 8) if quick else ((512, 2048), (1, 8, 32), 48)
    out = {"kernels": engine.kernels, "prefill_tok_s": {}, "decode_tok_s": {}, "prefill_gflops": {}}
    for n in lengths:
        progress(f"ember {dtype}: prefill {n}")
        rate = ember_prefill(engine, n, seed=n)
        out["prefill_tok_s"][str(n)] = rate
        out["prefill_gflops"][str(n)] = prefill_flops(engine.loaded.args, n) / (n / rate) / 1e9
    for b in batches:
        progress(f"ember {dtype}: decode x{b}")
        out["decode_tok_s"][str(b)] = ember_decode(engine, b, new_tokens, seed=1000 + b)
    return out


def bench_transformers(model_path: Path, threads: int, quick: bool) -> dict:
    from transformers import AutoModelForCausalLM
    progress("transformers: loading")
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                 dtype=torch.float32).eval()
    lengths, batches, new_tokens = ((128, 512), (1, 8), 8) if quick else ((512, 2048), (1, 8, 32), 48)
    out = {"prefill_tok_s": {}, "decode_tok_s": {}}
    for n in lengths:
        progress(f"transformers: prefill {n}")
        out["prefill_tok_s"][str(n)] = hf_prefill(model, n, seed=n)
    for b in batches:
        progress(f"transformers: decode x{b}")
        out["decode_tok_s"][str(b)] = hf_decode(model, b, new_tokens, seed=1000 + b)
    return out


def targets(result: dict) -> dict:
    e, hf, roof = result["ember_float32"], result["transformers"], result["matmul_gflops"]["float32"]["roofline"]
    batches = sorted(e["decode_tok_s"], key=int)
    prefill_ratio = min(e["prefill_tok_s"][n] / hf["prefill_tok_s"][n] for n in hf["prefill_tok_s"])
    checks = {
        "prefill_vs_transformers": (prefill_ratio, 1.2),
        "prefill_fraction_of_matmul_roofline": (min(e["prefill_gflops"].values()) / roof, 0.85),
        "single_stream_decode_vs_transformers": (e["decode_tok_s"]["1"] / hf["decode_tok_s"]["1"], 2.0),
        f"decode_x{batches[-1]}_vs_single_stream": (e["decode_tok_s"][batches[-1]] / e["decode_tok_s"]["1"], 8.0),
    }
    if "ember_bfloat16" in result:
        b = result["ember_bfloat16"]
        checks["bf16_single_stream_decode_vs_transformers"] = (b["decode_tok_s"]["1"] / hf["decode_tok_s"]["1"], 2.0)
        checks["bf16_prefill_fraction_of_bf16_matmul_roofline"] = (
            min(b["prefill_gflops"].values()) / result["matmul_gflops"]["bfloat16"]["roofline"], 0.85)
    rss = result["serving_process"]
    checks["peak_rss_overhead_mb"] = (rss["peak_rss_mb"] - rss["weights_mb"] - rss["kv_pool_mb"], 400)
    checks["startup_to_first_token_s"] = (rss["startup_to_first_token_s"], 2.0)
    lower_is_better = {"peak_rss_overhead_mb", "startup_to_first_token_s"}
    return {name: {"value": round(v, 3), "target": t,
                   "met": v <= t if name in lower_is_better else v >= t} for name, (v, t) in checks.items()}


def main(args) -> int:
    threads = args.threads or os.cpu_count() or 1
    model = Path(args.model)
    result = {
        "machine": {"cpu_count": os.cpu_count(), "threads": threads, "platform": platform.platform(),
                    "torch": torch.__version__},
        "model": model.name,
        "matmul_gflops": {},
    }
    for dtype in ("float32", "bfloat16"):
        progress(f"matmul roofline {dtype}")
        result["matmul_gflops"][dtype] = matmul_gflops(DTYPES[dtype], threads)
    result["ember_float32"] = bench_ember(str(model), "float32", threads, args.kv_cache_mb, args.quick)
    result["ember_bfloat16"] = bench_ember(str(model), "bfloat16", threads, args.kv_cache_mb, args.quick)
    result["transformers"] = bench_transformers(model, threads, args.quick)
    progress("serving process: startup and peak RSS")
    result["serving_process"] = run_serve_probe(str(model), args.kv_cache_mb, threads)
    result["targets"] = targets(result)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["targets"], indent=2))
    progress(f"wrote {out}")
    return 0
