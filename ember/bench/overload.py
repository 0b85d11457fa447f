"""`ember bench overload`: far more concurrent streams than the router admits.

The shipped default cluster (configs/local.yaml, or `--cluster-config`) on free ports with
router.max_inflight = `--max-inflight` (8). Each round, on prompts the cluster has never seen
(so every prefill is real, nothing comes from a cache):

1. unloaded: streams one at a time, each alone; their TTFT (median: "unloaded TTFT");
2. at capacity: `max_inflight` streams at once, nothing else;
3. overload: `--clients` (80) streams at once, from one channel each, connected beforehand so
   the call is timed and not the connect. A refusal must be RESOURCE_EXHAUSTED with
   `grpc-retry-pushback-ms` trailing metadata; its time is from the call to the error.
   Every accepted stream's tokens are checked against the same prompt run alone afterwards.

Router RSS (psutil, the router process) before the first round and after the last. Figures:
refused count and time to refusal, accepted TTFT p99 against unloaded TTFT and against the
at-capacity p99 (how much the refused extra costs the admitted streams), RSS growth. TTFT is
client-side, from the call to the first token message.
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from ember.bench.measure import progress, write_result

QUESTIONS = ["What is the capital of France?", "Write a haiku about the tide.", "What is 17 times 3?",
             "Name the three primary colours.", "Explain what a lighthouse keeper does.",
             "Give me a word that rhymes with harbour."]


def prompt_ids(tok, tag: str, n: int) -> list[list[int]]:
    """`n` chat prompts no cluster has seen (`tag` leads each), ~30 tokens each."""
    return [tok.encode(f"<|im_start|>user\n[{tag}-{i}] {QUESTIONS[i % len(QUESTIONS)]}<|im_end|>\n"
                       "<|im_start|>assistant\n") for i in range(n)]


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(0.99 * len(values) + 0.5) - 1))]


async def _streams(router: str, ids: list[list[int]], max_tokens: int) -> list[dict]:
    """All at once, one channel each (connected first); each stream's outcome."""
    import grpc

    from ember.v1 import common_pb2, router_pb2, router_pb2_grpc
    channels = [grpc.aio.insecure_channel(router) for _ in ids]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in channels)), 60)

        async def one(channel, prompt) -> dict:
            request = router_pb2.GenerateRequest(
                tokens=router_pb2.TokenInput(token_ids=prompt),
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            tokens, first, final = [], None, None
            start = time.perf_counter()
            try:
                async for m in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=300):
                    if m.token_ids and first is None:
                        first = time.perf_counter() - start
                    tokens += m.token_ids
                    final = m
                return {"ok": final is not None and final.finished, "ttft_s": first, "tokens": tokens,
                        "e2e_s": time.perf_counter() - start,
                        "server_ttft_s": final.timings.ttft_s if final is not None else None}
            except grpc.aio.AioRpcError as e:
                metadata = dict(e.trailing_metadata() or ())
                return {"ok": False, "code": e.code().name, "after_s": time.perf_counter() - start,
                        "pushback_ms": metadata.get("grpc-retry-pushback-ms"), "details": e.details()}
        return await asyncio.gather(*(one(c, p) for c, p in zip(channels, ids)))
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def streams(router: str, ids: list[list[int]], max_tokens: int) -> list[dict]:
    return asyncio.run(_streams(router, ids, max_tokens))


def measure(router: str, router_pid: int, tok, capacity: int = 8, clients: int = 80, rounds: int = 1,
            max_tokens: int = 16, unloaded_streams: int = 3) -> dict:
    """The three phases, `rounds` times; every figure, and per round."""
    import psutil
    proc = psutil.Process(router_pid)
    streams(router, prompt_ids(tok, "warm", 2), max_tokens)  # first calls pay one-time costs
    rss_before = proc.memory_info().rss
    per_round, tag = [], time.strftime("%H%M%S")
    for r in range(rounds):
        unloaded = [streams(router, [p], max_tokens)[0] for p in prompt_ids(tok, f"u{tag}{r}", unloaded_streams)]
        at_capacity = streams(router, prompt_ids(tok, f"c{tag}{r}", capacity), max_tokens)
        ids = prompt_ids(tok, f"o{tag}{r}", clients)
        burst = streams(router, ids, max_tokens)
        accepted = [i for i, s in enumerate(burst) if s["ok"]]
        references = {i: streams(router, [ids[i]], max_tokens)[0]["tokens"] for i in accepted}  # each alone
        refused = [s for s in burst if s.get("code") == "RESOURCE_EXHAUSTED"]
        other = [s for s in burst if not s["ok"] and s.get("code") != "RESOURCE_EXHAUSTED"]
        un = statistics.median(s["ttft_s"] for s in unloaded)
        cap = p99([s["ttft_s"] for s in at_capacity])
        acc = p99([burst[i]["ttft_s"] for i in accepted]) if accepted else None
        per_round.append({
            "unloaded_ttft_s": [round(s["ttft_s"], 4) for s in unloaded], "unloaded_ttft_median_s": round(un, 4),
            "at_capacity_ttft_s": sorted(round(s["ttft_s"], 4) for s in at_capacity),
            "at_capacity_ttft_p99_s": round(cap, 4), "at_capacity_ok": all(s["ok"] for s in at_capacity),
            "clients": clients, "accepted": len(accepted), "refused": len(refused), "other_errors": len(other),
            "other_error_details": sorted({f"{s.get('code')}: {s.get('details')}"[:200] for s in other}),
            "refused_with_pushback": sum(s["pushback_ms"] is not None for s in refused),
            "pushback_ms": sorted({s["pushback_ms"] for s in refused if s["pushback_ms"] is not None}),
            "refusal_s": {"max": round(max(s["after_s"] for s in refused), 4) if refused else None,
                          "p50": round(statistics.median(s["after_s"] for s in refused), 4) if refused else None},
            "refused_within_100ms": sum(s["after_s"] <= 0.1 for s in refused),
            "accepted_ttft_s": sorted(round(burst[i]["ttft_s"], 4) for i in accepted),
            "accepted_e2e_s": sorted(round(burst[i]["e2e_s"], 4) for i in accepted),
            "accepted_server_ttft_s": sorted(round(burst[i]["server_ttft_s"], 4) for i in accepted),
            "accepted_ttft_p99_s": round(acc, 4) if acc is not None else None,
            "accepted_correct": all(burst[i]["tokens"] == references[i] and len(references[i]) == max_tokens
                                    for i in accepted),
            "accepted_p99_over_unloaded": round(acc / un, 3) if acc else None,
            "accepted_p99_over_at_capacity_p99": round(acc / cap, 3) if acc else None,
            "accepted_p50_over_at_capacity_p50": round(statistics.median(burst[i]["ttft_s"] for i in accepted)
                                                       / statistics.median(s["ttft_s"] for s in at_capacity), 3)
            if accepted else None,
            "at_capacity_p99_over_unloaded": round(cap / un, 3),
        })
    rss_after = proc.memory_info().rss
    worst = {key: max(r[key] for r in per_round) for key in (
        "accepted_p99_over_unloaded", "accepted_p99_over_at_capacity_p99", "at_capacity_p99_over_unloaded")}
    return {"capacity": capacity, "clients": clients, "rounds": per_round, "max_tokens": max_tokens,
            "prompt_tokens": len(prompt_ids(tok, "x", 1)[0]),
            "refused_min": min(r["refused"] for r in per_round),
            "refused_within_100ms_min": min(r["refused_within_100ms"] for r in per_round),
            "refused_all_with_pushback": all(r["refused_with_pushback"] == r["refused"] for r in per_round),
            "refusal_max_s": max(r["refusal_s"]["max"] or 0 for r in per_round),
            "accepted_correct": all(r["accepted_correct"] for r in per_round),
            "other_errors": sum(r["other_errors"] for r in per_round),
            "worst": worst, "router_rss_before_mb": round(rss_before / 2**20, 1),
            "router_rss_after_mb": round(rss_after / 2**20, 1),
            "router_rss_growth_mb": round((rss_after - rss_before) / 2**20, 1)}


def with_capacity(source: Path, path: Path, model: str, capacity: int) -> dict:
    """`source` on free ports (ember.cluster.ports.on_free_ports) with router.max_inflight = capacity."""
    from ember.cluster.ports import on_free_ports
    data = on_free_ports(source, path, model)
    data.setdefault("router", {})["max_inflight"] = capacity
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def main(args) -> int:
    import json

    from ember.cluster.launcher import default_config, running
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    model = str(Path(args.model).resolve())
    source = Path(args.cluster_config).resolve() if args.cluster_config else default_config()
    tok = Tokenizer.from_folder(model_folder(model))
    args.max_inflight, args.clients = args.max_inflight or 8, args.clients or 80
    rounds, max_tokens = (1, 16) if args.quick else (3, 24)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        with_capacity(source, run_dir / "cluster.yaml", model, args.max_inflight)
        with running(run_dir / "cluster.yaml", run_dir, timeout_s=300):
            router_pid = json.loads((run_dir / "pids.json").read_text())["router"]
            router = json.loads((run_dir / "services.json").read_text())["router"]["address"]
            progress(f"{rounds} rounds: unloaded, {args.max_inflight} at once, {args.clients} at once "
                     f"(router.max_inflight {args.max_inflight})")
            result = measure(router, router_pid, tok, args.max_inflight, args.clients, rounds, max_tokens)
    result |= {"config": str(source), "model": model, "wall_s": round(time.monotonic() - started, 1)}
    need = args.clients - args.max_inflight - 2
    w = result["worst"]
    result["targets"] = {
        f"refused within 100 ms with pushback (of {args.clients})": {
            "value": result["refused_within_100ms_min"] if result["refused_all_with_pushback"] else 0,
            "target": f">= {need}", "met": result["refused_all_with_pushback"]
            and result["refused_within_100ms_min"] >= need},
        "every accepted stream correct": {"value": result["accepted_correct"], "target": True,
                                          "met": result["accepted_correct"] and result["other_errors"] == 0},
        "accepted p99 TTFT / unloaded TTFT": {"value": w["accepted_p99_over_unloaded"], "target": 2.0,
                                              "met": w["accepted_p99_over_unloaded"] <= 2.0},
        "accepted p99 TTFT / at-capacity p99 TTFT": {"value": w["accepted_p99_over_at_capacity_p99"],
                                                     "target": "reported (the refused extra's cost)", "met": True},
        "router RSS growth (MB)": {"value": result["router_rss_growth_mb"], "target": 50,
                                   "met": result["router_rss_growth_mb"] < 50},
    }
    write_result(result, args.output)
    return 0
