"""`ember bench agentic`: agent sessions that resubmit their whole growing context every turn,
through every system in one run, on the same GGUF and workload (ember.bench.agentic_systems).

Phases, each system in turn (so the systems never share the cores):
- replay: S sessions x T turns (default 8 x 6, 32 output tokens), sessions all at once or
  arriving as a Poisson process (--arrival-rate), each turn sent when the previous answer
  is in (closed loop within a session);
- streams16: 16 sessions x 2 turns x 64 output tokens: aggregate output tok/s;
- single: one stream, 128 output tokens: decode tok/s;
- prefill roofline: Ember's prefill of uncached prompts against the best matmul rate
  measured in the same run.

Writes JSON (every request's record), PNG plots beside it, and prints the targets.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

from ember.bench.agentic_report import ProgressBar, plot, summarize, targets
from ember.bench.agentic_systems import (
    LLAMA_SERVER,
    EmberCluster,
    EmberColocated,
    LlamaServer,
    Record,
    Transformers,
    start_llama_server,
)
from ember.bench.agentic_workload import Session, advance, sessions
from ember.bench.measure import matmul_gflops, progress, write_result
from ember.model.files import resolve_serving, serving_dtype

SYSTEMS = ("llama-server", "transformers", "ember-colocated", "ember-disagg")


def phases(quick: bool) -> dict[str, dict]:
    if quick:
        return {"replay": dict(num_sessions=2, turns=2, max_tokens=8),
                "streams16": dict(num_sessions=4, turns=1, max_tokens=8),
                "single_stream": dict(num_sessions=1, turns=1, max_tokens=16)}
    return {"replay": dict(num_sessions=8, turns=6, max_tokens=32),
            "streams16": dict(num_sessions=16, turns=2, max_tokens=64),
            "single_stream": dict(num_sessions=1, turns=1, max_tokens=128)}


async def run_phase(system, label: str, num_sessions: int, turns: int, max_tokens: int, seed: int,
                    arrival_rate: float = 0.0) -> tuple[list[Record], float]:
    """Drive the sessions through `system`; returns every request's record and the wall time."""
    workload = sessions(num_sessions, turns, seed)
    rng = random.Random(seed)
    starts, t = [], 0.0
    for _ in workload:  # Poisson arrivals of sessions, or all at once
        starts.append(t)
        t += rng.expovariate(arrival_rate) if arrival_rate > 0 else 0.0
    records: list[Record] = []
    bar = ProgressBar(f"{label} {system.name}", num_sessions * turns)
    began = time.perf_counter()

    async def agent(s: Session, delay: float):
        await asyncio.sleep(delay)
        turn = 1
        while True:
            sent = time.perf_counter() - began
            answer, record = await system.turn(s, max_tokens)
            record.turn, record.start_s = turn, sent
            records.append(record)
            bar.step(f"turn {turn} TTFT {record.ttft_s:.2f}s {record.cached_tokens}/{record.prompt_tokens} cached")
            if not advance(s, answer):
                return
            turn += 1
    await asyncio.gather(*(agent(s, d) for s, d in zip(workload, starts)))
    return records, time.perf_counter() - began


def main(args) -> int:
    threads = args.threads or 2
    wanted = [s.strip() for s in (args.systems or ",".join(SYSTEMS)).split(",")]
    unknown = set(wanted) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    plan = phases(args.quick)
    if args.phases:
        chosen = [p.strip() for p in args.phases.split(",")]
        if set(chosen) - set(plan):
            raise SystemExit(f"unknown phases {sorted(set(chosen) - set(plan))}; choose from {list(plan)}")
        plan = {p: plan[p] for p in chosen}
    # the shipped default (a Q4_1 GGUF: its own codes, as llama.cpp serves them) unless --weights says
    weights = resolve_serving(args.model, weights=args.weights or "auto")[1]
    slo, arrival = (args.slo_ttft, args.slo_tpot), args.arrival_rate
    out = Path(args.output)
    result: dict = {"model": Path(args.model).name, "threads": threads, "ember_weights": weights,
                    # this process (transformers, ember-colocated); the cluster's processes are always PASSIVE
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "libgomp default (brief spin)"),
                    "sessions": plan.get("replay", {}).get("num_sessions"),
                    "turns": plan.get("replay", {}).get("turns"),
                    "phases": plan, "arrival_rate": arrival, "systems": wanted,
                    "replay": {}, "streams16": {}, "single_stream": {}}
    result["prefill_roofline"] = prefill_roofline(args.model, threads, weights, args.quick)

    async def one_phase(system, phase: str, size: dict) -> dict:
        kv_before = await system.kv_bytes_moved() if hasattr(system, "kv_bytes_moved") else None
        tiers_before = await system.tiers() if hasattr(system, "tiers") else None
        records, wall = await run_phase(system, phase, seed=1 if phase != "streams16" else 2,
                                        arrival_rate=arrival if phase == "replay" else 0.0, **size)
        if phase == "single_stream":  # once warm: the figure is the second stream
            records, wall = await run_phase(system, phase, seed=3, **size)
        summary = summarize(records, wall, *slo)
        if kv_before is not None:
            summary["kv_bytes_moved"] = await system.kv_bytes_moved() - kv_before
        if tiers_before is not None:  # prompt tokens by where their KV came from (engine counters)
            after = await system.tiers()
            moved = {t: after[t] - tiers_before[t] for t in after}
            summary["prompt_tokens_by_tier"] = moved | {
                f"{t}_fraction": v / max(1, sum(moved.values())) for t, v in moved.items()}
        if phase == "single_stream":
            r = records[0]
            summary["decode_tok_per_s"] = (r.output_tokens - 1) / (r.e2e_s - r.ttft_s)
        return summary

    async def measure(make, name: str) -> None:
        system = make()  # inside the loop: aio channels and client sessions bind to it
        try:
            for phase, size in plan.items():
                if name != "llama-server":
                    result[phase][name] = await one_phase(system, phase, size)
                    continue
                # llama.cpp's single-stream decode is faster on one thread on this 2-vCPU machine
                # (its threads synchronise per op): give it its best thread count there
                by_threads = {}
                for t in ((threads, 1) if phase == "single_stream" and threads > 1 else (threads,)):
                    await system.restart(size["num_sessions"], t)
                    by_threads[t] = await one_phase(system, phase, size)
                def rate(s: dict) -> float:
                    return s.get("decode_tok_per_s") or s["output_tok_per_s"]
                best = max(by_threads, key=lambda t: rate(by_threads[t]))
                result[phase][name] = by_threads[best] | {"threads": best, "tok_per_s_by_threads": {
                    str(t): rate(s) for t, s in by_threads.items()}}
        finally:
            await system.close()

    llama_log = out.with_suffix(".llama-server.log")
    in_process = {"llama-server": lambda: ManagedLlamaServer(args.model, llama_log),
                  "transformers": lambda: Transformers(args.model, threads),
                  "ember-colocated": lambda: EmberColocated(args.model, threads, weights)}
    for name in wanted:
        progress(f"system {name}")
        if name == "llama-server" and not LLAMA_SERVER.exists():
            progress(f"llama-server not built ({LLAMA_SERVER}); run scripts/build-llama-server.sh to compare")
            for phase in plan:
                result[phase][name] = {"skipped": "not built"}
            continue
        if name == "llama-server":
            llama_log.parent.mkdir(parents=True, exist_ok=True)
            llama_log.write_bytes(b"")
        if name == "ember-disagg":
            cluster_config = Path(args.cluster_config) if args.cluster_config else None
            result["ember_disagg_config"] = run_cluster(args.model, lambda make: asyncio.run(
                measure(make, "ember-disagg")), cluster_config)
        else:
            asyncio.run(measure(in_process[name], name))
        gc.collect()
    result["targets"] = targets(result)
    result["plots"] = plot(result, out.parent)
    write_result(result, args.output)
    return 0


class ManagedLlamaServer(LlamaServer):
    """llama-server restarted per phase with as many slots as the phase has sessions (-np)."""

    def __init__(self, model: str, log: Path):
        super().__init__("")
        self.model, self.log, self.proc = model, log, None

    async def restart(self, slots: int, threads: int) -> None:
        self._stop()
        self.proc, self.url = await asyncio.to_thread(start_llama_server, self.model, slots, threads, 4096, self.log)

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    async def close(self) -> None:
        self._stop()
        await super().close()


def run_cluster(model: str, body, config: Path | None = None) -> dict:
    """Start the shipped local cluster (configs/local.yaml: prefill + decode + two kvstores + router,
    its engine settings untouched) on free ports, run body, stop it; returns the engine settings."""
    from ember.cluster.launcher import default_config, running
    from ember.cluster.ports import on_free_ports
    from ember.config.derived import model_facts
    from ember.config.load import load_config
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        on_free_ports(config or default_config(), run_dir / "cluster.yaml", model)
        cluster = load_config(run_dir / "cluster.yaml")
        engine = cluster.engine.for_role("decode").model_dump()  # effective settings, defaults included
        with running(run_dir / "cluster.yaml", run_dir, timeout_s=300):
            facts = model_facts(cluster)
            dtype, weights = facts.dtype, facts.weights
            services = json.loads((run_dir / "services.json").read_text())
            kvstores = [v["address"] for k, v in services.items() if k.startswith("kvstore")]
            engines = [v["metrics"] for k, v in services.items() if k.startswith(("prefill", "decode"))]
            block_bytes = facts.kv_layout.block_bytes
            from ember.cluster.launcher import credentials
            body(lambda: EmberCluster(services["router"]["address"], kvstores, block_bytes, engines,
                                      credentials(run_dir)))
        return engine | {"dtype": dtype, "weights": weights}


def prefill_roofline(model: str, threads: int, weights: str, quick: bool) -> dict:
    """Ember's prefill GFLOP/s on uncached prompts against the best matmul rate, both measured now."""
    from ember.bench.engine_bench import prefill_flops, random_prompts
    from ember.bench.measure import median_time
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    dtype = serving_dtype(weights)
    import torch
    progress(f"prefill roofline: matmul rate (float32, {dtype}) and Ember prefill")
    # the machine's best matmul, in whichever dtype it is fastest (bf16 is emulated, and ~100x
    # slower, on CPUs without AVX512-BF16)
    by_dtype = {d: matmul_gflops(getattr(torch, d), threads) for d in dict.fromkeys(("float32", dtype))}
    roof = max(by_dtype.values(), key=lambda r: r["roofline"]) | {"by_dtype": by_dtype}
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, weights=weights, threads=threads,
                                    kv_cache_mb=256, max_num_batched_tokens=4096))
    lengths = (256,) if quick else (512, 2048)
    rates = {}
    for n in lengths:
        prompts = iter(random_prompts(8, n, seed=n))
        def once(prompts=prompts):
            engine.generate([next(prompts)], SamplingParams(max_tokens=1))
        seconds = median_time(once, reps=1 if quick else 3)
        rates[str(n)] = {"tok_per_s": n / seconds, "gflops": prefill_flops(engine.loaded.args, n) / seconds / 1e9}
    best = max(r["gflops"] for r in rates.values())
    return {"dtype": dtype, "matmul_gflops": roof, "prefill": rates,
            "fraction_of_roofline": best / roof["roofline"]}
