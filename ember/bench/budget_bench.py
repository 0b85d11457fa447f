"""`ember bench budget`: how many prefill tokens a step can carry and still meet a TPOT SLO.

With the TTFT-aware scheduler every step runs the decode batch first and then up to the
budget's remaining tokens of prefill, so a decoding stream's time per output token is the
step time of "decode batch + one prefill chunk". This measures that step time through the
real engine (in process: scheduler, runner, kernels) for a growing chunk size, with a
decode batch alongside whose contexts, like the chunk's, sit behind a ~1k-token cached
prefix (agentic contexts), and picks the largest chunk whose median step stays under each
SLO (and, for where a decode step alone misses it, whose chunk adds at most the SLO to a
decode-only step): max_num_batched_tokens = decode batch + that chunk. The grid stops once
a step is well past the largest limit (but always covers chunks up to TABLE_MIN); the last
passing and first failing sizes are then bisected to a block's worth of tokens.
"""
from __future__ import annotations

import gc
import os
import platform
import statistics
import time

import torch

from ember.bench.engine_bench import random_prompts
from ember.bench.measure import progress, write_result
from ember.engine.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.sampling_params import SamplingParams

CONFIGS = {"q4_bfloat16": {"weights": "q4", "dtype": "bfloat16"},
           "dense_float32": {"weights": "dense", "dtype": "float32"}}
GRID = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
TABLE_MIN = 256


class StepProbe:
    """An engine holding `decode_batch` decoding streams; times steps that add a prefill chunk."""

    def __init__(self, engine: LLMEngine, decode_batch: int, context: int, reps: int, seed: int = 0):
        self.engine, self.decode_batch, self.reps = engine, decode_batch, reps
        self.prefix = random_prompts(1, context, seed)[0]  # shared, cached once: contexts are ~context long
        self._seed = seed
        tails = random_prompts(decode_batch, 16, seed + 1)
        room = min(engine.max_model_len - context - 16, 2048)  # more than the sweep's steps
        for tail in tails:
            engine.add_request(self.prefix + tail, SamplingParams(max_tokens=room, ignore_eos=True))
        self._set_budget(context + 16)  # prefill the decoders (the prefix is computed once)
        while any(s.num_computed_tokens < s.prompt_len for s in engine.seqs.values()):
            engine.step()

    def _set_budget(self, tokens: int) -> None:
        self.engine.scheduler.max_num_batched_tokens = tokens

    def fits(self, chunk: int) -> bool:
        """Whether a prompt for `chunk` fits the context length and the pool beside the decoders."""
        tokens = len(self.prefix) + chunk * (self.reps + 1) + 1
        bm = self.engine.block_manager
        return tokens <= self.engine.max_model_len and bm.blocks_needed(tokens) < bm.num_free_blocks

    def step_seconds(self, chunk: int) -> list[float]:
        """`reps` timed steps of decode batch + `chunk` prefill tokens (after one untimed warm-up)."""
        engine = self.engine
        self._set_budget(self.decode_batch + chunk)
        if chunk:
            self._seed += 1
            fresh = random_prompts(1, chunk * (self.reps + 1) + 1, 10_000 + self._seed)[0]
            engine.add_request(self.prefix + fresh, SamplingParams(max_tokens=1))
        times = []
        for rep in range(self.reps + 1):
            before = engine.stats.num_computed_tokens
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            computed = engine.stats.num_computed_tokens - before
            assert computed == self.decode_batch + chunk, f"step ran {computed} tokens, not {self.decode_batch}+{chunk}"
            if rep:
                times.append(elapsed)
        while len(engine.seqs) > self.decode_batch:  # the chunk's last token (and first sample)
            engine.step()
        return times


def sweep(probe: StepProbe, slos: list[float], granularity: int = 16) -> dict:
    """Step time per chunk size, and the largest chunk meeting each limit.

    Two kinds of limit per SLO: "200ms", the step itself (the TPOT a decoding stream sees),
    and "+200ms", what the prefill chunk adds to a decode-only step, for a machine (or decode
    batch) whose decode step alone already misses the absolute SLO.
    """
    table: dict[int, list[float]] = {}

    def median(chunk: int) -> float:
        if chunk not in table:
            progress(f"  chunk {chunk}")
            table[chunk] = probe.step_seconds(chunk)
        return statistics.median(table[chunk])

    decode_only = median(0)
    limits = {f"{round(s * 1000)}ms": s for s in slos} | {f"+{round(s * 1000)}ms": decode_only + s for s in slos}
    for chunk in GRID:  # the table always reaches TABLE_MIN; past it, only while near the limits
        if not probe.fits(chunk) or median(chunk) > 1.5 * max(limits.values()) and chunk >= TABLE_MIN:
            break
    chosen = {}
    for name, limit in limits.items():
        measured = sorted(table)
        passing = [c for c in measured if all(median(d) <= limit for d in measured if d <= c)]
        if not passing:
            chosen[name] = None  # a decode step alone misses the SLO
            continue
        lo = passing[-1]
        hi = next((c for c in measured if c > lo), None)
        while hi is not None and hi - lo > granularity:  # bisect to a block's worth of tokens
            mid = (lo + hi) // 2 // granularity * granularity
            if mid <= lo:
                break
            if median(mid) <= limit:
                lo = mid
            else:
                hi = mid
        chosen[name] = lo
    return {"step_ms": {str(c): round(statistics.median(t) * 1e3, 2) for c, t in sorted(table.items())},
            "step_ms_min": {str(c): round(min(t) * 1e3, 2) for c, t in sorted(table.items())},
            "step_ms_samples": {str(c): [round(x * 1e3, 2) for x in t] for c, t in sorted(table.items())},
            "chosen_chunk": chosen}


def main(args) -> int:
    threads = args.threads or os.cpu_count() or 1
    decode_batch, context, reps = (4, 512, 2) if args.quick else (8, 1024, 3)
    slos = sorted({0.1, 0.2, args.slo_tpot})
    configs = {k: v for k, v in CONFIGS.items() if args.weights in (None, "auto") or v["weights"] == args.weights}
    if args.quick:  # a smoke run: the shipped default's config only
        configs = dict(list(configs.items())[:1])
    result = {"machine": {"cpu_count": os.cpu_count(), "threads": threads, "platform": platform.platform(),
                          "torch": torch.__version__},
              "model": os.path.basename(args.model), "decode_batch": decode_batch,
              "context_tokens": context, "reps": reps, "slo_tpot_s": slos,
              "load_average_before": os.getloadavg(), "configs": {}, "targets": {}}
    for name, cfg in configs.items():
        progress(f"{name}: loading, prefilling {decode_batch} decoders behind a {context}-token prefix")
        start = time.perf_counter()
        try:
            engine = LLMEngine(EngineConfig(model=args.model, threads=threads,
                                            kv_cache_mb=args.kv_cache_mb, **cfg))
            engine.scheduler.slo = None  # every step: all the decodes plus the chunk under test
        except (RuntimeError, ValueError) as e:  # a config this machine cannot load
            progress(f"{name}: cannot run here: {e}")
            result["configs"][name] = {"error": str(e)}
            result["targets"][name] = {"met": False, "error": str(e)}
            continue
        probe = StepProbe(engine, decode_batch, context, reps)
        out = sweep(probe, slos)
        out["kernels"] = engine.kernels
        out["seconds"] = round(time.perf_counter() - start, 1)
        result["configs"][name] = out
        for slo_name, chunk in out["chosen_chunk"].items():
            result["targets"][f"{name}_tpot_{slo_name}"] = {
                "max_prefill_chunk": chunk,
                "max_num_batched_tokens": None if chunk is None else decode_batch + chunk,
                "step_ms_decode_only": out["step_ms"]["0"], "met": bool(chunk)}  # 0: no prefill fits
        del probe, engine
        gc.collect()
    result["load_average_after"] = os.getloadavg()  # other work on the cores skews every figure
    write_result(result, args.output)
    return 0
