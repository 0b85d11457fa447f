"""`ember bench security`: what mTLS and the KV frame MAC cost, side by side in one run.

The shipped default config (configs/local.yaml: `security.tls: auto`, mTLS on every internal
hop, MAC'd KV frames) against the same config with `security: {tls: plaintext}`, each laid
onto free ports, clusters started one at a time and alternated over rounds (ABBA, so drift on
a shared machine hits both). Per round:

- kvstore pull GB/s: N fresh blocks of the model's layout put into central's store (as
  prefill), then one Pull at edge's store (as decode asks), over the TCP data plane: the
  store's own `seconds` for the move.
- TTFT through the router's public API for fresh (uncached) prompts of ~PROMPT_TOKENS tokens,
  one at a time: prefill at central, frames to central's store, pulled to edge's, imported by
  decode, first token. Tokens of each prompt are compared across the two modes.

Targets (issue 15): pull >= 0.6x plaintext, TTFT <= 1.05x plaintext.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import yaml

from ember.bench.measure import progress, write_result

PROMPT_TOKENS = 1000
QUICK_PROMPT_TOKENS = 256  # --quick: a smoke run
MODES = ("mtls", "plaintext")


def lay_out(source: Path, path: Path, model: str, mode: str) -> dict:
    from ember.cluster.ports import on_free_ports
    data = on_free_ports(source, path, model)
    if mode == "plaintext":
        data["security"] = {"tls": "plaintext"}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def pull_GBps(run_dir: Path, data: dict, template, num_blocks: int) -> float:
    from ember.cluster.launcher import credentials
    from ember.kv import wire
    from ember.kv.chunks import split
    from ember.rpc import security
    from ember.rpc.server import CHANNEL_OPTIONS
    from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
    central, edge = (next(s for s in data["sites"] if s["name"] == n) for n in ("central", "edge"))
    hashes = [os.urandom(16) for _ in range(num_blocks)]
    payload = os.urandom(template.raw_len)
    frames = [(h, wire.encode_frame(template, h, payload)) for h in hashes]
    with security.dial(central["kvstore"], credentials(run_dir, "prefill-central"), CHANNEL_OPTIONS) as ch:
        chunks = (kvstore_pb2.BlockChunk(block_hash=h, block_bytes=n, offset=o, data=d) for h, n, o, d in split(frames))
        kvstore_pb2_grpc.KVStoreStub(ch).Put(chunks, timeout=300)
    with security.dial(edge["kvstore"], credentials(run_dir, "decode-edge"), CHANNEL_OPTIONS) as ch:
        pulled = kvstore_pb2_grpc.KVStoreStub(ch).Pull(
            kvstore_pb2.PullRequest(block_hashes=hashes, source=central["kvstore"]), timeout=300)
    assert pulled.blocks_pulled == num_blocks, pulled
    return pulled.bytes_pulled / pulled.seconds / 1e9


def ttfts(router: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    from ember.client import RouterClient
    times, tokens = [], []
    with RouterClient(router) as client:
        grpc.channel_ready_future(client.channel).result(timeout=30)
        for ids in prompts:
            start, first, got = time.perf_counter(), None, []
            for m in client.stream(token_ids=ids, max_tokens=max_tokens, ignore_eos=True, timeout=300):
                if m.token_ids and first is None:
                    first = time.perf_counter() - start
                got += m.token_ids
            times.append(first)
            tokens.append(got)
    return times, tokens


def main(args) -> int:
    from ember.cluster.launcher import default_config, running
    from ember.config.derived import model_facts
    from ember.config.load import load_config
    from ember.kv import wire
    from ember.kv.block_hash import root_hash
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    model = str(Path(args.model).resolve())
    source = Path(args.cluster_config).resolve() if args.cluster_config else default_config()
    tok = Tokenizer.from_folder(model_folder(model))
    rounds, num_prompts, num_blocks, length = (1, 2, 32, QUICK_PROMPT_TOKENS) if args.quick else \
        (2, 4, 128, PROMPT_TOKENS)
    words = tok.decode(list(range(1000, 1000 + length)))  # varied text, re-tokenized below
    samples = {m: {"pull_GBps": [], "ttft_s": [], "tokens": []} for m in MODES}
    started = time.monotonic()
    layout = None
    for r in range(rounds):
        # the same fresh prompts for both modes in a round: uncached in each new cluster
        prompts = [tok.encode(f"Round {r} prompt {i}: " + words)[:length] for i in range(num_prompts)]
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = Path(tmp)
                data = lay_out(source, run_dir / "cluster.yaml", model, mode)
                with running(run_dir / "cluster.yaml", run_dir, timeout_s=300):
                    if layout is None:
                        layout = model_facts(load_config(run_dir / "cluster.yaml")).kv_layout
                    template = wire.layout_header(layout, root_hash(layout))
                    warm = [tok.encode(f"Warm-up {r} {mode}: " + words)[:length]]
                    ttfts(data["router"]["listen"], warm, 2)  # first-request costs out of the figure
                    gbps = [pull_GBps(run_dir, data, template, num_blocks) for _ in range(3)]
                    times, tokens = ttfts(data["router"]["listen"], prompts, 4)
            samples[mode]["pull_GBps"] += gbps
            samples[mode]["ttft_s"] += times
            samples[mode]["tokens"] += tokens
            progress(f"round {r} {mode}: pull {statistics.median(gbps):.2f} GB/s, "
                     f"TTFT median {statistics.median(times) * 1000:.0f} ms")
    med = {m: {k: statistics.median(v) for k, v in samples[m].items() if k != "tokens"} for m in MODES}
    pull_ratio = med["mtls"]["pull_GBps"] / med["plaintext"]["pull_GBps"]
    ttft_ratio = med["mtls"]["ttft_s"] / med["plaintext"]["ttft_s"]
    equal = samples["mtls"]["tokens"] == samples["plaintext"]["tokens"]
    result = {
        "config": str(source), "model": model, "rounds": rounds, "prompt_tokens": length,
        "blocks_per_pull": num_blocks, "block_bytes": layout.block_bytes if layout else None,
        "median": med, "samples": {m: {k: v for k, v in samples[m].items() if k != "tokens"} for m in MODES},
        "tokens_equal_across_modes": equal, "wall_s": round(time.monotonic() - started, 1),
        "targets": {
            "kvstore pull GB/s, mTLS / plaintext": {"value": round(pull_ratio, 3), "target": ">= 0.6",
                                                    "met": pull_ratio >= 0.6},
            "TTFT, mTLS + MAC / plaintext": {"value": round(ttft_ratio, 3), "target": "<= 1.05",
                                             "met": ttft_ratio <= 1.05},
            "tokens equal across modes": {"value": equal, "target": True, "met": equal},
        },
    }
    write_result(result, args.output)
    return 0
