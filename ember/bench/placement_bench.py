"""`ember bench placement`: calibrate the simulator against the real cluster.

1. Measure the engine alone in this process (prefill at two lengths, decode steps at batch 1
   and 8): the first cluster's profile.
2. Start a 3-site local cluster (central prefill; west prefill + decode; east decode) behind
   emulated WAN links and measure its engines as served (measure_served_profile); write that
   profile into the config (`--write-profile PATH`, for `ember simulate` and `ember plan`).
3. Restart the cluster with it and replay an agentic trace (arrival times honoured, a
   session's turns in order, real token contexts that grow with the real answers).
4. Simulate the same requests (as actually sent) with the served profile: the simulator's
   hardware model (ember.placement.hardware), never the placer's estimates; and once more
   with the three sites on one shared host (reported beside it).
Reports TTFT p50/p90 and TPOT p50 of both and their ratios (targets: within 15%, 15%, 20% on
>= 100 requests), plus where requests were placed.
"""
from __future__ import annotations

import contextlib
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from ember.bench.measure import progress, write_result
from ember.cluster.launcher import running
from ember.cluster.ports import free_port
from ember.config.schema import ClusterConfig
from ember.placement import trace as traces
from ember.placement.simulate import Simulator


def _fit(short: float, long: float, single: float, eight: float, cv: float) -> dict:
    """A HardwareProfile from prefill times at 256 and 1024 tokens and decode steps at batch 1 and 8:
    t(n) = n / tps * (1 + n / (2 ctx)), two lengths give tps and ctx."""
    a = short / 256                      # = (1 + 128/ctx) / tps
    b = long / 1024                      # = (1 + 512/ctx) / tps
    tps = 384 / (512 * a - 128 * b) if 512 * a > 128 * b else 256 / short
    ctx = 384 / max(1e-6, b * tps - a * tps) if b > a else 1e9
    return {"prefill_tokens_per_s": round(tps, 1), "prefill_context_tokens": round(min(ctx, 1e7), 1),
            "decode_tokens_per_s": round(1 / single, 2), "decode_batch_tokens_per_s": round(8 / eight, 2),
            "max_batch": 16, "service_cv": round(min(2.0, cv), 3)}


def measure_profile(model: str, threads: int, reps: int = 2) -> dict:
    """The engine alone, in this process: the first cluster's profile (its placer's prices); `reps`
    timings of a long prefill and of each decode batch, twice that of a short prefill."""
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(model=model, threads=threads, kv_cache_mb=128))
    rng = random.Random(7)

    def run(batch: int, n: int, tokens: int) -> float:
        prompts = [[rng.randrange(200, 40000) for _ in range(n)] for _ in range(batch)]
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start
    run(1, 64, 1)
    shorts = [run(1, 256, 1) for _ in range(2 * reps)]
    long = min(run(1, 1024, 1) for _ in range(reps))
    single, eight = ((min(run(b, 32, 18) - run(b, 32, 2) for _ in range(reps))) / 16 for b in (1, 8))
    return _fit(min(shorts), long, max(1e-4, single), max(1e-4, eight),
                statistics.pstdev(shorts) / statistics.fmean(shorts))


def measure_served_profile(router: str, hop_s: dict[str, float], reps: int = 2) -> dict:
    """The engines as the cluster serves them (their service, the kvstore write-back, the cores
    they share with everything else): prefill from the router's TTFT (less the hop to a remote
    prefill site), decode steps from the gaps between streamed tokens, one stream and eight at
    once, on fresh prompts, each alone on the cluster."""
    from ember.client import RouterClient
    rng = random.Random(9)

    def one(n: int, tokens: int):
        with RouterClient(router) as client:
            return client.complete(token_ids=[rng.randrange(200, 40000) for _ in range(n)], max_tokens=tokens,
                                   ignore_eos=True, user_region="users-west", timeout=120).final

    def prefill_s(n: int) -> float:
        final = one(n, 1)
        if final.timings.ttft_s <= 0:
            raise RuntimeError(f"no TTFT from the router: {final}")
        return final.timings.ttft_s - hop_s.get(final.placement.prefill_site, 0.0)
    def step_s(streams: int) -> float:
        """A decode step once every stream decodes: the time from a stream's 8th token to its
        last over the tokens between (their prefills and KV moves are over by then; a message
        may carry several tokens)."""
        prompts = [[rng.randrange(200, 40000) for _ in range(32)] for _ in range(streams)]

        def step(ids: list[int]) -> float:
            seen, start = 0, None
            with RouterClient(router) as client:
                for msg in client.stream(token_ids=ids, max_tokens=48, ignore_eos=True, user_region="users-west",
                                         timeout=120):
                    seen += len(msg.token_ids)
                    if start is None and seen >= 8:
                        start, from_token = time.perf_counter(), seen
            return (time.perf_counter() - start) / max(1, seen - from_token)
        with ThreadPoolExecutor(streams) as pool:
            return statistics.median(pool.map(step, prompts))
    one(64, 4)
    shorts = [prefill_s(256) for _ in range(2 * reps)]
    long = min(prefill_s(1024) for _ in range(reps))
    single, eight = min(step_s(1) for _ in range(reps)), step_s(8)
    return _fit(min(shorts), long, single, eight, statistics.pstdev(shorts) / statistics.fmean(shorts))


def _warm(router: str) -> None:
    """A restarted cluster's first request pays one-time costs: not the trace's."""
    from ember.client import RouterClient
    with RouterClient(router) as client:
        client.complete(token_ids=list(range(300, 364)), max_tokens=4, ignore_eos=True, user_region="users-west",
                        timeout=120)


def cluster_config(model: str, profile: dict, threads: int) -> dict:
    def addr():
        return f"127.0.0.1:{free_port()}"
    sites = [{"name": "central", "tier": "central", "prefill": addr(), "kvstore": addr(), "kvstore_data": addr()},
             {"name": "west", "prefill": addr(), "decode": addr(), "kvstore": addr(), "kvstore_data": addr()},
             {"name": "east", "decode": addr(), "kvstore": addr(), "kvstore_data": addr()}]
    for s in sites:
        s["hardware"] = "measured"
    return {
        "model": model, "router": {"listen": addr(), "site": "west"}, "placement": {"emulate_links": True},
        "sites": sites,
        "links": [{"a": "central", "b": "west", "rtt_ms": 60, "bandwidth_gbps": 1.0},
                  {"a": "central", "b": "east", "rtt_ms": 60, "bandwidth_gbps": 1.0},
                  {"a": "west", "b": "east", "rtt_ms": 30, "bandwidth_gbps": 1.0}],
        "regions": [{"name": "users-west", "reach": [{"site": "west", "rtt_ms": 0}, {"site": "east", "rtt_ms": 30}]},
                    {"name": "users-east", "reach": [{"site": "east", "rtt_ms": 0}, {"site": "west", "rtt_ms": 30}]}],
        "hardware": {"measured": profile},
        "engine": {"kv_cache_mb": 160, "threads": threads},
        "kvstore": {"capacity_mb": 256},
    }


def replay(router: str, trace: list[traces.TraceRequest], vocab: int = 40000) -> list[tuple]:
    """Send the trace through the router; returns (request as sent, final message) pairs."""
    from ember.client import RouterClient
    rng = random.Random(11)
    contexts: dict[str, list[int]] = {}
    done: dict[str, threading.Event] = {}
    results: list[tuple] = []
    lock = threading.Lock()
    start = time.monotonic()

    def one(r: traces.TraceRequest, previous: threading.Event | None):
        if previous is not None:
            previous.wait()
        delay = r.t - (time.monotonic() - start)
        if delay > 0:
            time.sleep(delay)
        context = contexts.setdefault(r.session, [])
        context.extend(rng.randrange(200, vocab) for _ in range(r.prompt_tokens - len(context)))
        sent = replace(r, t=time.monotonic() - start, prompt_tokens=len(context))
        with RouterClient(router) as client:
            out = client.complete(token_ids=list(context), max_tokens=r.output_tokens, ignore_eos=True,
                                  user_region=r.region, session_id=r.session, timeout=300)
        context.extend(out.token_ids)
        with lock:
            results.append((sent, out.final))
        done[(r.session, r.turn)].set()

    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = []
        for r in trace:
            done[(r.session, r.turn)] = threading.Event()
            futures.append(pool.submit(one, r, done.get((r.session, r.turn - 1))))
        for f in futures:
            f.result()
    return sorted(results, key=lambda x: x[0].t)


@contextmanager
def _cluster(data: dict):
    """The cluster of config `data`, running from a temporary folder for the `with` block."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        (run_dir / "cluster.yaml").write_text(yaml.safe_dump(data))
        with running(run_dir / "cluster.yaml", run_dir, timeout_s=400):
            yield


def main(args) -> int:
    threads = args.threads or 2
    progress("measuring this machine's hardware profile")
    reps = 1 if args.quick else 2  # --quick: a smoke run (its figures say nothing)
    profile = measure_profile(args.model, threads, reps)
    progress(f"profile: {profile}")
    data = cluster_config(str(Path(args.model).resolve()), profile, threads)
    config = ClusterConfig.model_validate(data)
    regions = [r.name for r in config.regions]
    # --quick: a smoke run (a few sessions, replayed on the first cluster: its figures say nothing)
    sessions_per_s, duration, system, context = (0.3, 10, (100, 300), 800) if args.quick else \
        (0.1, 480, (300, 900), 2200)  # 141 requests; the rig below saturation
    trace = traces.agentic(regions, None, sessions_per_s=sessions_per_s, duration_s=duration, mean_turns=4,
                           system_tokens=system, max_context=context, max_output=12, tool_scale=0.3, seed=5)
    progress(f"trace: {len(trace)} requests in {len({r.session for r in trace})} sessions")
    progress("starting the 3-site cluster behind emulated links, to measure its engines as served")
    with contextlib.ExitStack() as cluster:
        cluster.enter_context(_cluster(data))
        hops = {link["a"]: link["rtt_ms"] / 1e3 for link in data["links"] if link["b"] == "west"}
        served = measure_served_profile(data["router"]["listen"], hops, reps)
        progress(f"served profile: {served}")
        data["hardware"]["measured"] = served
        config = ClusterConfig.model_validate(data)
        if args.write_profile:
            Path(args.write_profile).parent.mkdir(parents=True, exist_ok=True)
            Path(args.write_profile).write_text(f"# ember bench placement: the engines' profile as this machine serves "
                                                f"them in the 3-site calibration cluster\n"
                                                f"{yaml.safe_dump(data, sort_keys=False)}")
            progress(f"wrote the measured profile into {args.write_profile}")
        if args.quick:
            progress("replaying the trace in real time on the same cluster (--quick: its placer keeps its profile)")
        else:
            progress("starting it again with that profile; replaying the trace in real time")
            cluster.close()
            cluster.enter_context(_cluster(data))
        _warm(data["router"]["listen"])
        results = replay(data["router"]["listen"], trace)
    sent = [r for r, _ in results]
    # The router at west, measuring from its own receipt (the replaying client sits beside it).
    # The served profile already carries this rig's shared cores; the shared-host model (each
    # busy engine at 1/k) is reported beside it, and counts that contention twice.
    sim = Simulator(config, "ember", router_site="west", user_rtt=False).run(sent)
    shared = ClusterConfig.model_validate({**data, "sites": [{**s, "host": "this-machine"} for s in data["sites"]]})
    sim_shared = Simulator(shared, "ember", router_site="west", user_rtt=False).run(sent)
    placed = [f"{m.placement.prefill_site}->{m.placement.decode_site}" for _, m in results]
    real = {"ttft": [m.timings.ttft_s for _, m in results], "tpot": [m.timings.tpot_s for _, m in results]}
    result = {
        "profile": served, "engine_alone_profile": profile, "requests": len(results),
        "real": {k: {"p50": _percentile(v, 50), "p90": _percentile(v, 90)} for k, v in real.items()},
        "sim": {"ttft": {"p50": sim.ttft["p50"], "p90": sim.ttft["p90"]},
                "tpot": {"p50": sim.tpot["p50"], "p90": sim.tpot["p90"]}},
        "sim_shared_host": {"ttft": {"p50": sim_shared.ttft["p50"], "p90": sim_shared.ttft["p90"]},
                            "tpot": {"p50": sim_shared.tpot["p50"], "p90": sim_shared.tpot["p90"]}},
        "placements": {p: placed.count(p) for p in sorted(set(placed))},
        "requests_detail": [{"t": r.t, "session": r.session, "turn": r.turn, "prompt_tokens": r.prompt_tokens,
                             "ttft_s": m.timings.ttft_s, "tpot_s": m.timings.tpot_s,
                             "placement": f"{m.placement.prefill_site}->{m.placement.decode_site}",
                             "cached_tokens": m.usage.cached_tokens} for r, m in results],
    }
    targets = {}
    for metric, quantile, tolerance in (("ttft", "p50", 0.15), ("ttft", "p90", 0.15), ("tpot", "p50", 0.2)):
        ratio = result["sim"][metric][quantile] / result["real"][metric][quantile]
        targets[f"sim_over_real_{metric}_{quantile}"] = {
            "value": round(ratio, 3), "target": f"{1 - tolerance:g}-{1 + tolerance:g}",
            "met": abs(ratio - 1) <= tolerance and len(results) >= 100}
    result["targets"] = targets
    write_result(result, args.output)
    return 0


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))
