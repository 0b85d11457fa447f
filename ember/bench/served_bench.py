"""Served decode against the same engine driven directly: what the service layer costs.

- direct: an LLMEngine of the shipped default config stepped on this process's main thread;
- served: the shipped local cluster (configs/local.yaml on free ports), one greedy stream
  through the router over gRPC, decode in its engine-core process.
Both decode the same prompt for the same number of tokens; the figure is decode tok/s after
the first token (median of `--reps` streams). Target: served >= 0.9x direct.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from ember.bench.measure import progress, write_result

PROMPT = ("You are a coding agent. Read the tool output below and answer with the file you would edit.\n"
          + "\n".join(f"src/module_{i}.py:{10 * i}: def handler_{i}(request): return respond(request, {i})"
                      for i in range(40)))


def direct(model: str, max_tokens: int, reps: int) -> dict:
    from ember.cluster.launcher import default_config
    from ember.config.load import load_config
    from ember.config.services import engine_settings
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    config = load_config(default_config())
    config.model = model
    engine = LLMEngine(engine_settings(config, "decode", config.placement.decode_site)[1])
    ids = engine.tokenizer.encode(PROMPT)
    rates = []
    for i in range(reps + 1):
        engine.add_request(ids + [100 + i], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        first = None
        while engine.has_unfinished():
            if engine.step() and first is None:
                first = time.perf_counter()
        if i:  # the first stream warms up
            rates.append((max_tokens - 1) / (time.perf_counter() - first))
    return {"decode_tok_per_s": statistics.median(rates), "runs": rates, "prompt_tokens": len(ids),
            "engine": {"dtype": engine.config.dtype, "weights": engine.config.weights,
                       "threads": engine.config.torch_threads()}}


def served(model: str, max_tokens: int, reps: int) -> dict:
    from ember.bench.agentic_bench import run_cluster
    out: dict = {}

    def body(make):
        async def go():
            system = make()
            import grpc

            from ember.model.files import model_folder
            from ember.model.tokenizer import Tokenizer
            from ember.v1 import common_pb2, router_pb2
            ids = Tokenizer.from_folder(model_folder(model)).encode(PROMPT)
            rates = []
            try:
                for i in range(reps + 1):
                    request = router_pb2.GenerateRequest(
                        tokens=router_pb2.TokenInput(token_ids=ids + [100 + i]),
                        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                    stamps = [time.perf_counter() async for m in system.stub.Generate(request, timeout=300)
                              if m.token_ids]
                    if i:
                        rates.append((max_tokens - 1) / (stamps[-1] - stamps[0]))
            except grpc.aio.AioRpcError as e:
                raise SystemExit(f"served stream failed: {e.code()} {e.details()}") from e
            finally:
                await system.close()
            out.update(decode_tok_per_s=statistics.median(rates), runs=rates)
        asyncio.run(go())
    out["engine"] = run_cluster(model, body)
    return out


def main(args) -> int:
    model = str(Path(args.model).resolve())
    max_tokens, reps = (32, 1) if args.quick else (128, 3)
    progress("direct: the engine on this process's main thread")
    result = {"max_tokens": max_tokens, "direct": direct(model, max_tokens, reps)}
    progress("served: the shipped local cluster, through the router")
    result["served"] = served(model, max_tokens, reps)
    ratio = result["served"]["decode_tok_per_s"] / result["direct"]["decode_tok_per_s"]
    result["targets"] = {"served / direct decode tok/s": {"value": round(ratio, 3), "target": 0.9,
                                                          "met": ratio >= 0.9}}
    write_result(result, args.output)
    return 0
