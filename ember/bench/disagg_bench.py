"""`ember bench disagg`: the disaggregated path (router -> prefill -> kvstores -> decode,
separate processes) beside Ember colocated (one in-process engine), same machine, same
prompts; plus kvstore-to-kvstore pull throughput against raw loopback TCP."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from ember.bench.engine_bench import random_prompts
from ember.bench.kv_bench import raw_tcp_GBps
from ember.bench.measure import progress, write_result
from ember.client import RouterClient
from ember.cluster.launcher import running
from ember.cluster.ports import write_local_config
from ember.kv import wire
from ember.kv.chunks import split
from ember.rpc.server import CHANNEL_OPTIONS
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc


def disagg_request(client: RouterClient, ids: list[int], new_tokens: int) -> dict:
    start = time.perf_counter()
    ttft = None
    for msg in client.stream(token_ids=ids, max_tokens=new_tokens, ignore_eos=True, timeout=600):
        if ttft is None:
            ttft = time.perf_counter() - start
        final = msg
    t = final.timings
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - start, "transfer_s": t.transfer_s,
            "server_ttft_s": t.ttft_s, "tpot_s": t.tpot_s}


def colocated_request(engine, ids: list[int], new_tokens: int) -> dict:
    from ember.engine.sampling_params import SamplingParams
    start = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    ttft = None
    while engine.has_unfinished():
        if engine.step() and ttft is None:
            ttft = time.perf_counter() - start
    e2e = time.perf_counter() - start
    return {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / max(1, new_tokens - 1)}


def kv_pull_throughput(addr: dict, num_blocks: int, template: wire.FrameHeader, run_dir: Path | None = None) -> dict:
    """Blocks put into central's store (as prefill) pulled by edge's store (as decode asks): mTLS
    with the run's certificates when the cluster has them."""
    from ember.cluster.launcher import credentials
    from ember.rpc import security
    hashes = [os.urandom(16) for _ in range(num_blocks)]
    blocks = [(h, wire.encode_frame(template, h, os.urandom(template.raw_len))) for h in hashes]
    with security.dial(addr["kv_central"], credentials(run_dir, "prefill-central"), CHANNEL_OPTIONS) as ch:
        chunks = (kvstore_pb2.BlockChunk(block_hash=h, block_bytes=n, offset=o, data=d) for h, n, o, d in split(blocks))
        kvstore_pb2_grpc.KVStoreStub(ch).Put(chunks, timeout=120)
    with security.dial(addr["kv_edge"], credentials(run_dir, "decode-edge"), CHANNEL_OPTIONS) as ch:
        pulled = kvstore_pb2_grpc.KVStoreStub(ch).Pull(
            kvstore_pb2.PullRequest(block_hashes=[h for h, _ in blocks], source=addr["kv_central"]), timeout=120)
    return {"blocks": pulled.blocks_pulled, "bytes": pulled.bytes_pulled, "seconds": pulled.seconds,
            "GiBps": pulled.bytes_pulled / pulled.seconds / 2**30}


def main(args) -> int:
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    lengths, new_tokens, reps = ((128, 512), 8, 1) if args.quick else ((512, 2048), 32, 3)
    threads = args.threads or 2
    result = {"threads_per_process": threads, "new_tokens": new_tokens, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        addr = write_local_config(run_dir / "cluster.yaml", str(Path(args.model).resolve()), kvstore_capacity_mb=1024,
                                  kv_cache_mb=args.kv_cache_mb, threads=threads)
        progress("starting the local cluster")
        with running(run_dir / "cluster.yaml", run_dir, timeout_s=300):
            progress("colocated engine: loading")
            engine = LLMEngine(EngineConfig(model=args.model, threads=threads,
                                            kv_cache_mb=args.kv_cache_mb))
            with RouterClient(addr["router"]) as client:
                client.complete(text="warm up", max_tokens=2, timeout=120)
                colocated_request(engine, [5, 6, 7], 2)
                for n in lengths:
                    prompts = random_prompts(2 * reps, n, seed=n)  # fresh prompts: no cache hits
                    rows = {"disaggregated": [], "colocated": []}
                    for i in range(reps):  # alternate so both see the same machine state
                        progress(f"{n}-token prompt, rep {i + 1}/{reps}")
                        rows["disaggregated"].append(disagg_request(client, prompts[2 * i], new_tokens))
                        rows["colocated"].append(colocated_request(engine, prompts[2 * i + 1], new_tokens))
                    result["runs"][str(n)] = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                                              for mode, rs in rows.items()}
            block_bytes = engine.layout.block_bytes
            progress("kvstore -> kvstore pull throughput")
            result["kv_pull"] = kv_pull_throughput(addr, 256, engine.frame_template, run_dir)
            # kernel-default buffers, as this figure has always been measured
            result["raw_tcp_GiBps"] = raw_tcp_GBps(256 * block_bytes, receive_buffer=None) * 1e9 / 2**30
    ratios = {n: r["disaggregated"]["ttft_s"] / r["colocated"]["ttft_s"] for n, r in result["runs"].items()}
    result["targets"] = {
        "disagg_ttft_over_colocated": {"value": {n: round(v, 3) for n, v in ratios.items()}, "target": 1.1,
                                       "met": all(v <= 1.1 for v in ratios.values())},
        "kvstore_to_kvstore_GiBps": {"value": round(result["kv_pull"]["GiBps"], 3), "target": 1.0,
                                     "met": result["kv_pull"]["GiBps"] >= 1.0},
    }
    write_result(result, args.output)
    return 0
