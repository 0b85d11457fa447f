"""The systems `ember bench agentic` drives, each behind one coroutine: turn(session, max_tokens).

- EmberCluster: the local cluster's router over gRPC streaming (disaggregated);
- EmberColocated: one in-process engine (InProcessEngineClient), all sessions batched;
- Transformers: Hugging Face transformers on the same GGUF, a greedy loop with its own KV
  cache per request, one request at a time, nothing kept across requests;
- LlamaServer: llama.cpp's C++ server (-np slots, continuous batching, cache_prompt).

Each returns the answer text and a Record with TTFT, inter-token gaps and token counts.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ember.bench.agentic_workload import Session
from ember.rpc import metrics_http

# built by scripts/build-llama-server.sh into the checkout (run the bench from its root), or anywhere else
LLAMA_SERVER = Path(os.environ.get("EMBER_LLAMA_SERVER", "third_party/llama.cpp/bin/llama-server")).resolve()


@dataclass
class Record:
    session: str
    turn: int = 0
    start_s: float = 0.0  # since the phase began
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (the mean inter-token gap)."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


class _Timer:
    """Stamps a streamed response: the first piece sets TTFT, later ones add gaps, one per token (a
    piece of n tokens, as a speculative step streams them, adds its gap and n - 1 zero gaps)."""

    def __init__(self, record: Record):
        self.record, self.start = record, time.perf_counter()
        self.last = self.start

    def piece(self, num_tokens: int = 1) -> None:
        now = time.perf_counter()
        if not self.record.ttft_s:
            self.record.ttft_s = now - self.start
        else:
            self.record.gaps_s.append(now - self.last)
        self.record.gaps_s.extend([0.0] * (num_tokens - 1))
        self.last = now

    def done(self) -> Record:
        self.record.e2e_s = time.perf_counter() - self.start
        return self.record


class EmberCluster:
    name = "ember-disagg"

    def __init__(self, router: str, kvstores: list[str], block_bytes: int, engine_metrics: list[dict | str] = (),
                 credentials=None):
        """`credentials`: the operator's certificate (ember.cluster.launcher.credentials) for the
        kvstores' stats over mTLS; None: plaintext."""
        import grpc

        from ember.v1 import kvstore_pb2_grpc, router_pb2_grpc
        self.channel = grpc.aio.insecure_channel(router)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.kv_channels = [grpc.aio.insecure_channel(a) if credentials is None else
                            grpc.aio.secure_channel(a, credentials.channel_credentials()) for a in kvstores]
        self.kv_stubs = [kvstore_pb2_grpc.KVStoreStub(c) for c in self.kv_channels]
        self.block_bytes = block_bytes
        self.engine_metrics = list(engine_metrics)

    async def turn(self, s: Session, max_tokens: int) -> tuple[str, Record]:
        from ember.v1 import common_pb2, router_pb2
        chat = router_pb2.ChatInput(messages=[router_pb2.ChatMessage(**m) for m in s.messages])
        request = router_pb2.GenerateRequest(chat=chat, session_id=s.session_id,
                                             sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        timer, text = _Timer(Record(s.session_id)), []
        async for msg in self.stub.Generate(request, timeout=900):
            if msg.token_ids:
                timer.piece(len(msg.token_ids))
            text.append(msg.text)
            if msg.finished:
                usage = msg.usage
                timer.record.output_tokens = usage.completion_tokens
                timer.record.prompt_tokens, timer.record.cached_tokens = usage.prompt_tokens, usage.cached_tokens
        return "".join(text), timer.done()

    async def tiers(self) -> dict[str, float]:
        """Prompt tokens by KV tier, summed over the engine services (their Prometheus /metrics)."""
        from prometheus_client.parser import text_string_to_metric_families
        totals = {"l1": 0.0, "l2": 0.0, "computed": 0.0}
        for address in self.engine_metrics:
            text = await asyncio.to_thread(metrics_http.fetch, address, 30)  # services.json's endpoint
            for family in text_string_to_metric_families(text):
                if family.name == "ember:prompt_tokens_by_tier":
                    for sample in family.samples:
                        totals[sample.labels["tier"]] += sample.value
        return totals

    async def kv_bytes_moved(self) -> int:
        """KV bytes the site kvstores took in so far (prefill's puts + pulls between sites)."""
        from ember.v1 import kvstore_pb2
        total = 0
        for stub in self.kv_stubs:
            stats = await stub.Stats(kvstore_pb2.StatsRequest(), timeout=10)
            total += stats.blocks_put * self.block_bytes + stats.bytes_pulled
        return total

    async def close(self) -> None:
        for c in [self.channel, *self.kv_channels]:
            await c.close()


class EmberColocated:
    name = "ember-colocated"

    def __init__(self, model: str, threads: int, weights: str = "auto"):
        from ember.engine.config import EngineConfig
        from ember.engine.engine import LLMEngine
        from ember.serving.engine_client import InProcessEngineClient
        self.engine = InProcessEngineClient(LLMEngine(EngineConfig(model=model, weights=weights, threads=threads)))

    async def tiers(self) -> dict[str, float]:
        t = self.engine.core.tiers
        return {"l1": t.tokens_l1, "l2": t.tokens_l2, "computed": t.tokens_computed}

    async def turn(self, s: Session, max_tokens: int) -> tuple[str, Record]:
        from ember.engine.sampling_params import SamplingParams
        tokenizer = self.engine.engine.tokenizer
        ids = tokenizer.encode(tokenizer.apply_chat_template(s.messages))
        timer, text = _Timer(Record(s.session_id, prompt_tokens=len(ids))), []
        async for out in self.engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                              uuid.uuid4().hex):
            if out.new_token_ids:
                timer.piece(len(out.new_token_ids))
            timer.record.cached_tokens = out.cached_tokens
            text.append(out.new_text)
            timer.record.output_tokens = out.completion_tokens
        return "".join(text), timer.done()

    async def close(self) -> None:
        self.engine.close()


class Transformers:
    """transformers' own GGUF loader (fp32 dequantized weights) and a greedy KV-cached loop."""
    name = "transformers"

    def __init__(self, model: str, threads: int):
        import torch

        from ember.bench.measure import require
        require("transformers", "the transformers peer")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        path = Path(model)
        torch.set_num_threads(threads)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        self.lock = asyncio.Lock()  # one request at a time: transformers has no serving batcher

    def _generate(self, ids: list[int], max_tokens: int, timer: _Timer) -> list[int]:
        torch, out_ids = self.torch, []
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True)
            for i in range(max_tokens):
                token = int(out.logits[0, -1].argmax())
                out_ids.append(token)
                timer.piece()
                if i + 1 < max_tokens:
                    out = self.model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
        return out_ids

    async def turn(self, s: Session, max_tokens: int) -> tuple[str, Record]:
        ids = self.tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        timer = _Timer(Record(s.session_id, prompt_tokens=len(ids)))  # queueing for the lock counts, as in a server
        async with self.lock:
            out_ids = await asyncio.get_running_loop().run_in_executor(None, self._generate, ids, max_tokens, timer)
        timer.record.output_tokens = len(out_ids)
        return self.tokenizer.decode(out_ids, skip_special_tokens=True), timer.done()

    async def close(self) -> None:
        pass


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
        timer, text = _Timer(Record(s.session_id)), []
        async with self.session.post(f"{self.url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                piece = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
                if piece:
                    timer.piece()
                    text.append(piece)
                    timer.record.output_tokens += 1
                if "timings" in chunk:
                    t = chunk["timings"]
                    timer.record.cached_tokens = t.get("cache_n", 0)
                    timer.record.prompt_tokens = t.get("cache_n", 0) + t.get("prompt_n", 0)
                    timer.record.output_tokens = t.get("predicted_n", timer.record.output_tokens)
        return "".join(text), timer.done()

    async def close(self) -> None:
        await self.session.close()


def _amx_host() -> bool:
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def start_llama_server(model: str, slots: int, threads: int, context: int, log: Path,
                       extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """llama-server on a free port with `slots` parallel slots of `context` tokens each.

    On a CPU with AMX, llama.cpp's AMX matmul (an "extra buffer type") segfaulted on its first
    matmul in this VM; `--no-repack` turns the extra buffer types off, leaving its AVX-512 VNNI
    Q4_1 path, the one every non-AMX x86 host runs."""
    import urllib.request

    from ember.cluster.ports import free_port
    port = free_port()
    extra = [*extra, *(["--no-repack"] if _amx_host() else [])]
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(LLAMA_SERVER), "-m", model, "-np", str(slots), "-t", str(threads),
                                 "-c", str(context * slots), "--port", str(port), "--host", "127.0.0.1", *extra],
                                stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, LD_LIBRARY_PATH=str(LLAMA_SERVER.parent)))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"llama-server did not come up (see {log})")
