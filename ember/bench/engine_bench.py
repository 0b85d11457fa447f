"""`ember bench engine`: prefill and decode speed of Ember's engine beside transformers.

Both run in this process on the same GGUF weights and threads, one after the other, so
the ratios hold on a noisy machine. Startup time and peak RSS come from a fresh serving
process (ember.bench.serve_probe).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ember.bench.measure import matmul_gflops, progress, write_result
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


class EmberSystem:
    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def prefill_seconds(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.engine.generate([prompt], SamplingParams(max_tokens=1))
        return time.perf_counter() - start

    def decode_tok_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        for p in prompts:
            self.engine.add_request(p, SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True))
        produced = 0
        while produced < len(prompts):  # prefill (and first token) of every sequence
            produced += len(self.engine.step())
        start, produced = time.perf_counter(), 0
        while self.engine.has_unfinished():
            produced += len(self.engine.step())
        return produced / (time.perf_counter() - start)


class TransformersSystem:
    def __init__(self, model):
        self.model = model

    def _generate(self, ids: torch.Tensor, n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    def prefill_seconds(self, prompt: list[int]) -> float:
        return self._generate(torch.tensor([prompt]), 1)

    def decode_tok_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)
        decode_seconds = self._generate(ids, new_tokens + 1) - self._generate(ids, 1)
        return len(prompts) * new_tokens / decode_seconds


def compare(systems: dict, lengths, batches, new_tokens: int, reps: int) -> dict:
    """Every measurement alternates between the systems, rep by rep, so a noisy spell on
    this shared machine hits them alike; medians are reported."""
    out = {name: {"prefill_tok_s": {}, "decode_tok_s": {}} for name in systems}
    for n in lengths:
        prompts = random_prompts(reps * len(systems) + 1, n, seed=n)  # fresh prompts: no cache hits
        for system in systems.values():
            system.prefill_seconds(prompts[-1][: n // 4])  # warm up this shape family
        samples = {name: [] for name in systems}
        for rep in range(reps):
            for i, (name, system) in enumerate(systems.items()):
                progress(f"prefill {n}: {name} (rep {rep + 1}/{reps})")
                samples[name].append(n / system.prefill_seconds(prompts[rep * len(systems) + i]))
        for name in systems:
            out[name]["prefill_tok_s"][str(n)] = statistics.median(samples[name])
    for b in batches:
        samples = {name: [] for name in systems}
        for rep in range(reps):
            prompts = random_prompts(b, 64, seed=1000 * b + rep)
            for name, system in systems.items():
                progress(f"decode x{b}: {name} (rep {rep + 1}/{reps})")
                samples[name].append(system.decode_tok_s(prompts, new_tokens))
        for name in systems:
            out[name]["decode_tok_s"][str(b)] = statistics.median(samples[name])
    return out


def run_serve_probe(model: str, kv_cache_mb: int | None, threads: int, runs: int = 2) -> dict:
    """`runs` fresh serving processes (the first pays cold caches); the last one's figures."""
    cmd = [sys.executable, "-m", "ember.bench.serve_probe", "--model", model,
           "--kv-cache-mb", str(kv_cache_mb or 512), "--threads", str(threads)]
    out = [json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout)
           for _ in range(runs)]
    return out[-1] | {"startup_to_first_token_s_first_run": out[0]["startup_to_first_token_s"]}


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
    from ember.bench.measure import require
    require("transformers", "the engine bench's transformers peer")
    from transformers import AutoModelForCausalLM
    threads = args.threads or os.cpu_count() or 1
    model = Path(args.model)
    # --quick: a smoke run through every part (its figures are not comparable with a full run's)
    lengths, batches, new_tokens, reps = ((64, 256), (1, 4), 4, 1) if args.quick else ((512, 2048), (1, 8, 32), 48, 3)
    result = {
        "machine": {"cpu_count": os.cpu_count(), "threads": threads, "platform": platform.platform(),
                    "torch": torch.__version__},
        "model": model.name, "new_tokens": new_tokens, "reps": reps,
        "matmul_gflops": {},
    }
    for dtype in ("float32", "bfloat16"):
        progress(f"matmul roofline {dtype}")
        result["matmul_gflops"][dtype] = matmul_gflops(DTYPES[dtype], threads)
    progress("loading Ember (float32, bfloat16) and transformers")
    systems = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, weights="dense", threads=threads,
                                        kv_cache_mb=args.kv_cache_mb))
        systems[f"ember_{dtype}"] = EmberSystem(engine)
        result.setdefault("kernels", engine.kernels)
    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(model.parent, gguf_file=model.name, dtype=torch.float32).eval()
    systems["transformers"] = TransformersSystem(hf)
    result.update(compare(systems, lengths, batches, new_tokens, reps))
    args_ = systems["ember_float32"].engine.loaded.args
    for name in ("ember_float32", "ember_bfloat16"):
        result[name]["prefill_gflops"] = {n: prefill_flops(args_, int(n)) * rate / int(n) / 1e9
                                          for n, rate in result[name]["prefill_tok_s"].items()}
    del systems, hf
    progress("serving process: startup and peak RSS")
    result["serving_process"] = run_serve_probe(str(model), 64 if args.quick else args.kv_cache_mb, threads,
                                                runs=1 if args.quick else 2)
    result["targets"] = targets(result)
    write_result(result, args.output)
    return 0
