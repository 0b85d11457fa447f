"""`ember bench parallel`: tensor and pipeline parallelism against data parallelism on this machine's
cores.

For each tensor-parallel degree (1, 2, 3; the ranks share the machine's threads): the engine's start
time, rank 0's weight bytes, the 16-stream decode throughput, and the share of a decode step the
driver spends in all-reduces (waiting for the slowest rank included). Pipeline parallel 2: the same,
with the partition the measured profile chose and its predicted stage imbalance against the measured
one (each stage's compute time per decode step, from timing its forward); and TP 2 x PP 2 (four
ranks). Against them: two
data-parallel replicas (two engine processes, half the threads each, 8 streams each) on the same
cores. Dense fp32 weights throughout (the exact path, whose tokens the parallel tests pin),
every configuration the same prompts and tokens.
"""
from __future__ import annotations

import time

from ember.bench.measure import progress, write_result

STREAMS, TOKENS = 16, 32  # --quick, a smoke run: QUICK_STREAMS, QUICK_TOKENS and TP 1-2 only
QUICK_STREAMS, QUICK_TOKENS = 4, 4
PROMPT = ("The keeper wrote down every ship that passed the lighthouse, its flag and its cargo. " * 6
          + "Story {}: on the morning of the storm,")


def _config(model: str, threads: int, degree: int, **extra):
    from ember.engine.config import EngineConfig
    return EngineConfig(model=model, dtype="float32", weights="dense", threads=threads, kv_cache_mb=256,
                        tensor_parallel=degree, **extra)


def _decode(engine, prompts: list[str], tokens: int, before_decode=None) -> dict:
    """Prefill the prompts, then time the decode of `tokens` each (all streams batched); before_decode()
    runs between the two (counters reset, replicas lined up)."""
    from ember.engine.sampling_params import SamplingParams
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True))
    while not all(s.num_output_tokens for s in engine.seqs.values()):
        engine.step()  # prefill (and the first token)
    if before_decode is not None:
        before_decode()
    steps, start, produced = 0, time.perf_counter(), 0
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    wall = time.perf_counter() - start
    return {"tok_per_s": round(produced / wall, 1), "step_ms": round(1000 * wall / steps, 2), "steps": steps}


def _tensor_parallel(model: str, threads: int, degree: int, streams: int, tokens: int) -> dict:
    from ember.engine.engine import LLMEngine
    from ember.parallel import group
    from ember.parallel.shard import rank_cost
    start = time.perf_counter()
    engine = LLMEngine(_config(model, threads, degree))
    load_s = time.perf_counter() - start
    try:
        result = {"degree": degree, "start_s": round(load_s, 2)}
        reduce_s = [0.0]
        if degree > 1:
            me = engine.runner.me
            shards, costs = engine.runner.shards, engine.runner.costs
            result["rank0_weight_mb"] = round(me.loaded.weights_bytes / 2**20, 1)
            result["ranks"] = [{"rank": s.rank, "q_heads": s.q_heads, "kv_heads": s.kv_heads, "columns": s.columns,
                                "vocab": s.vocab} for s in shards]
            if costs is not None:  # an uneven split, balanced by measured cost
                result["measured_costs_ms"] = {"kv_group": round(costs.group, 4),
                                               "mlp_64_columns": round(costs.mlp_step, 4)}
                result["predicted_rank_ms_per_layer"] = [round(rank_cost(engine.loaded.args, s, costs), 4)
                                                         for s in shards]

            def timed(t):
                t0 = time.perf_counter()
                out = group.all_reduce(t)
                reduce_s[0] += time.perf_counter() - t0
                return out
            me.loaded.model.set_tensor_parallel(timed, me.shard.vocab[0])  # the driver's side only
        else:
            result["rank0_weight_mb"] = round(engine.loaded.weights_bytes / 2**20, 1)
        decode = _decode(engine, [PROMPT.format(i) for i in range(streams)], tokens,
                         lambda: reduce_s.__setitem__(0, 0.0))
        result |= decode  # (the all-reduces of the decode steps only, against their time)
        if degree > 1:
            result["all_reduce_share_of_step"] = None  # filled below
        return result | {"_reduce_s": reduce_s[0]}
    finally:
        engine.close()


def _pipeline(model: str, threads: int, streams: int, tokens: int, tp: int = 1) -> dict:
    from ember.engine.engine import LLMEngine
    start = time.perf_counter()
    engine = LLMEngine(_config(model, threads, tp, pipeline_parallel=2))
    load_s = time.perf_counter() - start
    try:
        runner = engine.runner
        stage0 = runner.me
        spent = [0.0]
        original = stage0._stage

        def timed(inputs, x):
            t0 = time.perf_counter()
            out = original(inputs, x)
            spent[0] += time.perf_counter() - t0
            return out
        stage0._stage = timed
        decode = _decode(engine, [PROMPT.format(i) for i in range(streams)], tokens, lambda: spent.__setitem__(0, 0.0))
        predicted = runner.predicted_ms
        step_ms = decode["step_ms"]
        stage0_ms = 1000 * spent[0] / decode["steps"]
        return {"stages": 2, "tensor_parallel": tp, "start_s": round(load_s, 2), "partition": runner.counts,
                "profile_ms": {k: round(v, 3) for k, v in runner.costs.items()},
                "predicted_stage_ms": [round(p, 2) for p in predicted],
                "predicted_imbalance": round(max(predicted) / min(predicted), 2),
                "rank0_weight_mb": round(stage0.loaded.weights_bytes / 2**20, 1),
                "stage0_compute_ms_per_step": round(stage0_ms, 2),
                "stage0_share_of_step": round(stage0_ms / step_ms, 2), **decode}
    finally:
        engine.close()


def _replica(model: str, threads: int, first: int, count: int, tokens: int, ready, go, results) -> None:
    from ember.engine.engine import LLMEngine
    engine = LLMEngine(_config(model, threads, 1))
    ready.wait()  # every replica loaded
    results.put(_decode(engine, [PROMPT.format(i) for i in range(first, first + count)], tokens, go.wait)
                | {"first": first})


def _data_parallel(model: str, threads: int, streams: int, tokens: int, replicas: int = 2) -> dict:
    import multiprocessing as mp
    context = mp.get_context("spawn")
    ready, go, results = context.Barrier(replicas + 1), context.Barrier(replicas), context.Queue()
    per = streams // replicas
    each = max(1, threads // replicas)
    procs = [context.Process(target=_replica, args=(model, each, r * per, per, tokens, ready, go, results))
             for r in range(replicas)]
    for p in procs:
        p.start()
    ready.wait()
    parts = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return {"replicas": replicas, "tok_per_s": round(sum(p["tok_per_s"] for p in parts), 1), "per_replica": parts,
            "note": "aggregate: the replicas' decode rates, their decodes started together (prefill excluded)"}


def main(args) -> int:
    threads = args.threads or 2
    streams, tokens = (QUICK_STREAMS, QUICK_TOKENS) if args.quick else (STREAMS, TOKENS)
    result: dict = {"threads": threads, "streams": streams, "tokens": tokens, "weights": "dense fp32", "tp": {}}
    for degree in (1, 2) if args.quick else (1, 2, 3):
        progress(f"tensor parallel {degree}: start, {streams} streams x {tokens} tokens")
        r = _tensor_parallel(args.model, threads, degree, streams, tokens)
        reduce_s = r.pop("_reduce_s")
        if degree > 1:
            decode_s = r["steps"] * r["step_ms"] / 1000
            r["all_reduce_share_of_step"] = round(reduce_s / decode_s, 3) if decode_s else None
        result["tp"][str(degree)] = r
    progress(f"pipeline parallel 2: {streams} streams x {tokens} tokens")
    result["pp2"] = _pipeline(args.model, threads, streams, tokens)
    progress(f"tensor parallel 2 x pipeline parallel 2: {streams} streams x {tokens} tokens")
    result["tp2_pp2"] = _pipeline(args.model, threads, streams, tokens, tp=2)
    progress(f"data parallel: 2 replicas x {streams // 2} streams")
    result["dp2"] = _data_parallel(args.model, threads, streams, tokens)
    tp1, tp2, dp2 = result["tp"]["1"]["tok_per_s"], result["tp"]["2"]["tok_per_s"], result["dp2"]["tok_per_s"]
    result["targets"] = {
        "rank 0 weight bytes, TP=2 / TP=1": {
            "value": round(result["tp"]["2"]["rank0_weight_mb"] / result["tp"]["1"]["rank0_weight_mb"], 2),
            "target": "< 0.6"},
        f"{streams} streams, TP=2 / TP=1": {"value": round(tp2 / tp1, 2), "target": "reported"},
        f"{streams} streams, 2 DP replicas / TP=2": {"value": round(dp2 / tp2, 2), "target": "> 1 on two cores"},
        f"{streams} streams, 2 DP replicas / PP=2": {"value": round(dp2 / result["pp2"]["tok_per_s"], 2),
                                                     "target": "> 1 on two cores"}}
    write_result(result, args.output)
    return 0
