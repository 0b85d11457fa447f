"""`ember bench agentic`: N concurrent agent sessions x T turns, closed loop (each session sends
its next turn when the previous answer is in), every turn resubmitting the whole context,
through several systems in one run on the same GGUF and workload:

- ember-disagg: the local cluster (router -> prefill -> kvstores -> decode), gRPC streaming;
- ember-colocated: one in-process engine (AsyncEngine), all sessions batched;
- llama-server: llama.cpp's C++ server with -np slots and continuous batching (built by
  scripts/build-llama-server.sh; skipped with a notice when absent).

Per request: TTFT, inter-token gaps, e2e, prompt / cached tokens. Reports p50/p90/p99 (all
turns and turns >= 2), aggregate output tok/s and the prefix hit rate per system; JSON out.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ember.bench.agentic_workload import Session, advance, sessions
from ember.bench.measure import progress, write_result

LLAMA_SERVER = Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "bin" / "llama-server"


@dataclass
class Record:
    session: str
    turn: int
    ttft_s: float
    e2e_s: float
    gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


class EmberCluster:
    name = "ember-disagg"

    def __init__(self, router: str):
        import grpc

        from ember.v1 import router_pb2_grpc
        self.channel = grpc.aio.insecure_channel(router)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    async def turn(self, s: Session, max_tokens: int) -> tuple[str, Record]:
        from ember.v1 import common_pb2, router_pb2
        chat = router_pb2.ChatInput(messages=[router_pb2.ChatMessage(**m) for m in s.messages])
        request = router_pb2.GenerateRequest(chat=chat, session_id=s.session_id,
                                             sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        start = last = time.perf_counter()
        record, text = Record(s.session_id, 0, 0.0, 0.0), []
        async for msg in self.stub.Generate(request, timeout=600):
            now = time.perf_counter()
            if not record.ttft_s:
                record.ttft_s = now - start
            elif msg.token_ids:
                record.gaps_s.append(now - last)
            last = now
            text.append(msg.text)
            if msg.finished:
                record.output_tokens = msg.usage.completion_tokens
                record.prompt_tokens, record.cached_tokens = msg.usage.prompt_tokens, msg.usage.cached_tokens
        record.e2e_s = time.perf_counter() - start
        return "".join(text), record

    async def close(self) -> None:
        await self.channel.close()


class EmberColocated:
    name = "ember-colocated"

    def __init__(self, model: str, threads: int):
        from ember.engine.config import EngineConfig
        from ember.engine.engine import LLMEngine
        from ember.serving.async_engine import AsyncEngine
        self.engine = AsyncEngine(LLMEngine(EngineConfig(model=model, num_threads=threads,
                                                         kv_cache_bytes=768 * 2**20)))

    async def turn(self, s: Session, max_tokens: int) -> tuple[str, Record]:
        from ember.engine.sampling_params import SamplingParams
        tokenizer = self.engine.engine.tokenizer
        ids = tokenizer.encode(tokenizer.apply_chat_template(s.messages))
        start = last = time.perf_counter()
        record, text = Record(s.session_id, 0, 0.0, 0.0, prompt_tokens=len(ids)), []
        async for out in self.engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                              uuid.uuid4().hex):
            now = time.perf_counter()
            if not record.ttft_s:
                record.ttft_s, record.cached_tokens = now - start, out.cached_tokens
            else:
                record.gaps_s.append(now - last)
            last = now
            text.append(out.new_text)
            record.output_tokens = out.completion_tokens
        record.e2e_s = time.perf_counter() - start
        return "".join(text), record

    async def close(self) -> None:
        self.engine.stop()


class LlamaServer:
    name = "llama-server"

    def __init__(self, url: str):
        import aiohttp
        # a fresh connection per request: llama-server closes a streamed response's connection
        self.url = url
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=900))

    async def turn(self, s: Session, max_tokens: int) -> tuple[str, Record]:
        body = {"messages": s.messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "cache_prompt": True, "ignore_eos": True}
        start = last = time.perf_counter()
        record, text = Record(s.session_id, 0, 0.0, 0.0), []
        async with self.session.post(f"{self.url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                piece = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
                now = time.perf_counter()
                if piece:
                    if not record.ttft_s:
                        record.ttft_s = now - start
                    else:
                        record.gaps_s.append(now - last)
                    last = now
                    text.append(piece)
                    record.output_tokens += 1
                if "timings" in chunk:
                    t = chunk["timings"]
                    record.cached_tokens = t.get("cache_n", 0)
                    record.prompt_tokens = t.get("cache_n", 0) + t.get("prompt_n", 0)
        record.e2e_s = time.perf_counter() - start
        return "".join(text), record

    async def close(self) -> None:
        await self.session.close()


async def run_system(system, num_sessions: int, turns: int, max_tokens: int, seed: int) -> tuple[list[Record], float]:
    workload = sessions(num_sessions, turns, seed)
    records: list[Record] = []

    async def agent(s: Session):
        turn = 1
        while True:
            answer, record = await system.turn(s, max_tokens)
            record.turn = turn
            records.append(record)
            progress(f"{system.name}: {s.session_id} turn {turn}: TTFT {record.ttft_s:.2f} s, "
                     f"{record.cached_tokens}/{record.prompt_tokens} cached")
            if not advance(s, answer):
                return
            turn += 1
    start = time.perf_counter()
    await asyncio.gather(*(agent(s) for s in workload))
    return records, time.perf_counter() - start


def summarize(records: list[Record], wall_s: float) -> dict:
    def pct(values: list[float]) -> dict:
        if not values:
            return {}
        v = sorted(values)
        return {p: v[min(len(v) - 1, int(q * len(v)))] for p, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
    later = [r for r in records if r.turn >= 2]
    prompt = sum(r.prompt_tokens for r in records)
    return {"requests": len(records), "wall_s": wall_s, "ttft": pct([r.ttft_s for r in records]),
            "ttft_turn2plus": pct([r.ttft_s for r in later]), "e2e": pct([r.e2e_s for r in records]),
            "itl": pct([g for r in records for g in r.gaps_s]),
            "output_tok_per_s": sum(r.output_tokens for r in records) / wall_s,
            "prefix_hit_rate": sum(r.cached_tokens for r in records) / max(1, prompt),
            "records": [asdict(r) | {"gaps_s": None, "itl_mean_s": statistics.mean(r.gaps_s) if r.gaps_s else None}
                        for r in records]}


def start_llama_server(model: str, slots: int, threads: int, context: int, log: Path) -> tuple[subprocess.Popen, str]:
    from ember.cluster.ports import free_port
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(LLAMA_SERVER), "-m", model, "-np", str(slots), "-t", str(threads),
                                 "-c", str(context * slots), "--port", str(port), "--host", "127.0.0.1"],
                                stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, LD_LIBRARY_PATH=str(LLAMA_SERVER.parent)))
    import urllib.request
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server did not come up")


def main(args) -> int:
    from ember.cluster.launcher import down, up
    from ember.cluster.ports import write_local_config
    num_sessions, turns, max_tokens = (2, 2, 8) if args.quick else (8, 6, 32)
    threads = args.threads or 2
    result: dict = {"sessions": num_sessions, "turns": turns, "max_tokens": max_tokens, "threads": threads,
                    "systems": {}}

    async def measure(make) -> None:
        system = make()  # inside the loop: aio channels and client sessions bind to it
        try:
            records, wall = await run_system(system, num_sessions, turns, max_tokens, seed=1)
            result["systems"][system.name] = summarize(records, wall)
        finally:
            await system.close()

    if LLAMA_SERVER.exists():
        log = Path(args.output).with_suffix(".llama-server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        proc, url = start_llama_server(args.model, num_sessions, threads, 4096, log)
        try:
            asyncio.run(measure(lambda: LlamaServer(url)))
        finally:
            proc.kill()
    else:
        progress(f"llama-server not built ({LLAMA_SERVER}); run scripts/build-llama-server.sh to compare with it")
        result["systems"]["llama-server"] = {"skipped": "not built"}
    asyncio.run(measure(lambda: EmberColocated(args.model, threads)))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        write_local_config(run_dir / "cluster.yaml", str(Path(args.model).resolve()), kvstore_capacity_mb=1024,
                           kv_cache_mb=768, threads=threads)
        up(run_dir / "cluster.yaml", run_dir, timeout_s=300)
        try:
            router = json.loads((run_dir / "services.json").read_text())["router"]["address"]
            asyncio.run(measure(lambda: EmberCluster(router)))
        finally:
            down(run_dir)
    result["targets"] = _targets(result["systems"])
    write_result(result, args.output)
    return 0


def _targets(systems: dict) -> dict:
    peer = systems.get("llama-server", {})
    if "ttft_turn2plus" not in peer:
        return {"vs_llama_server": {"value": None, "target": "turn>=2 TTFT p50 <= 0.5x", "met": None}}
    out = {}
    for name in ("ember-disagg", "ember-colocated"):
        mine = systems.get(name, {})
        if "ttft_turn2plus" in mine:
            ratio = mine["ttft_turn2plus"]["p50"] / peer["ttft_turn2plus"]["p50"]
            out[f"{name}_turn2plus_ttft_p50_over_llama_server"] = {"value": round(ratio, 3), "target": 0.5,
                                                                    "met": ratio <= 0.5}
    return out
