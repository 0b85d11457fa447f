"""`ember bench link`: the KV link codec priced by the link (issue 19, item 2).

Real KV (the shipped default engine: q4 weights, bf16 KV) of a 2,048-token prompt crosses between two
kvstore processes, over an emulated wide-area link (60 ms RTT, 1 Gbit/s: the `ember.cluster.wan`
relay in front of the source's gRPC and data ports) and over plain loopback. The destination kvstores
ask for `raw`, `planes` or `auto` (the shipped default: the configured link's bandwidth prices the
codec until a raw pull has measured it). Fresh content addresses every rep (nothing cached), modes
alternating rep by rep; medians. Per mode: seconds the Pull took as the caller sees it, bytes on the
wire, the codec used.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ember.bench.kv_bench import KVStoreProcess
from ember.bench.measure import progress, write_result
from ember.cluster.ports import free_port
from ember.kv import wire
from ember.kv.chunks import split
from ember.v1 import kvstore_pb2

RTT_MS, GBPS, PROMPT_TOKENS = 60.0, 1.0, 2048
QUICK_PROMPT_TOKENS = 512  # --quick: a smoke run
MODES = ("raw", "planes", "auto")


def default_kv(model: str, threads: int, tokens: int = PROMPT_TOKENS) -> tuple[wire.FrameHeader, list[bytes]]:
    """The shipped default engine's KV blocks (bf16) of a `tokens`-token English prompt."""
    from ember.bench.kv_bench import english_prompt
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    from ember.kv.block_hash import chain_hashes
    engine = LLMEngine(EngineConfig(model=model, threads=threads, kv_cache_mb=256))
    ids = engine.tokenizer.encode(english_prompt(60))[:tokens]
    engine.generate([ids], SamplingParams(max_tokens=1))
    hashes = chain_hashes(ids, engine.config.block_size, engine.block_manager.root_hash)
    return engine.frame_template, engine.export_blocks(hashes)


def _config(path: Path, codec: str, capacity_mb: int, link: bool = True) -> dict:
    """Sites central and edge, kvstores only, joined by the emulated link (`link`: in the links table;
    the loopback runs configure none); `codec` asked on pulls."""
    def addresses():
        return {"kvstore": f"127.0.0.1:{free_port()}", "kvstore_data": f"127.0.0.1:{free_port()}"}
    central, edge = addresses(), addresses()
    path.write_text(yaml.safe_dump({
        "sites": [{"name": "central", **central}, {"name": "edge", **edge}],
        "links": [{"a": "central", "b": "edge", "rtt_ms": RTT_MS, "bandwidth_gbps": GBPS}] if link else [],
        "kvstore": {"capacity_mb": capacity_mb, "codec": codec}, "security": {"tls": "plaintext"}}, sort_keys=False))
    return {"central": central, "edge": edge}


@dataclass
class Link:
    """A central kvstore behind the emulated link: its process, its addresses, the --route flags that
    send another store's hops to it through the relay, and every store to stop at the end."""
    source: KVStoreProcess
    address: dict
    routes: list[str]
    stores: list[KVStoreProcess] = field(default_factory=list)


@contextmanager
def central_behind_link(run_dir: Path, capacity_mb: int):
    """Start the central kvstore and the relay in front of it; stop them, and every store added to
    `Link.stores`, at the end."""
    cfg = run_dir / "central.yaml"
    address = _config(cfg, "raw", capacity_mb)["central"]
    relay = None
    link = Link(KVStoreProcess(run_dir, "central", config=cfg, site="central"), address, [])
    link.stores.append(link.source)
    try:
        relay, link.routes = wan_relay(run_dir, address)
        yield link
    finally:
        for store in link.stores:
            store.stop()
        if relay is not None:
            relay.terminate()
            relay.wait(timeout=10)


def timed_pull(link: Link, store: KVStoreProcess, template: wire.FrameHeader, payloads: list[bytes],
               timeout: float) -> tuple[float, kvstore_pb2.PullResponse]:
    """Put `payloads` under fresh content addresses (nothing cached anywhere) into the central store, then
    time `store` pulling them from it: (seconds, the Pull's answer)."""
    hashes = [os.urandom(16) for _ in payloads]
    frames = [(h, wire.encode_frame(template, h, p)) for h, p in zip(hashes, payloads)]
    chunks = (kvstore_pb2.BlockChunk(block_hash=h, block_bytes=n, offset=o, data=d) for h, n, o, d in split(frames))
    assert link.source.stub.Put(chunks, timeout=timeout).blocks_stored == len(frames)
    start = time.perf_counter()
    pulled = store.stub.Pull(kvstore_pb2.PullRequest(block_hashes=hashes, source=link.address["kvstore"]),
                             timeout=timeout)
    seconds = time.perf_counter() - start
    assert pulled.blocks_pulled == len(hashes)
    return seconds, pulled


def wan_relay(run_dir: Path, source: dict) -> tuple[subprocess.Popen, list[str]]:
    """The emulated link (the `ember.cluster.wan` relay) in front of the `source` kvstore's gRPC and
    data ports: the relay's process, and the --route flags that send a store's hops to it through it."""
    spec = [{"listen": f"127.0.0.1:{free_port()}", "target": source[key], "rtt_ms": RTT_MS, "gbps": GBPS}
            for key in ("kvstore", "kvstore_data")]
    (run_dir / "links.json").write_text(json.dumps(spec))
    with open(run_dir / "relay.log", "wb") as log:
        relay = subprocess.Popen([sys.executable, "-m", "ember.cluster.wan", "--spec", str(run_dir / "links.json")],
                                 stdout=log, stderr=subprocess.STDOUT)
    return relay, [f"{s['target']}={s['listen']}" for s in spec]


def edge_config(run_dir: Path, name: str, codec: str, capacity_mb: int, source: dict, link: bool = True) -> Path:
    """An edge kvstore's config (`_config`) whose central site is the running `source` store."""
    cfg = run_dir / f"{name}.yaml"
    addrs = _config(cfg, codec, capacity_mb, link=link)
    cfg.write_text(cfg.read_text().replace(addrs["central"]["kvstore"], source["kvstore"]).replace(
        addrs["central"]["kvstore_data"], source["kvstore_data"]))  # the one real source
    return cfg


def main(args) -> int:
    threads = args.threads or 2
    tokens = QUICK_PROMPT_TOKENS if args.quick else PROMPT_TOKENS
    progress(f"real KV of a {tokens}-token prompt (default engine: q4 weights, bf16 KV)")
    template, payloads = default_kv(args.model, threads, tokens)
    frame_bytes = wire.frame_bytes(template.raw_len)
    total_mb = len(payloads) * frame_bytes / 2**20
    reps = 2 if args.quick else 4
    capacity = int(total_mb * (2 * reps + 2)) + 16
    result: dict = {"link": {"rtt_ms": RTT_MS, "gbps": GBPS}, "blocks": len(payloads), "kv_mb": round(total_mb, 1),
                    "reps": reps}
    with tempfile.TemporaryDirectory() as tmp, central_behind_link(Path(tmp), capacity) as link:
        run_dir = Path(tmp)
        # one config per destination mode (the codec is the kvstore section's); the source is the
        # same central store, reached through the relay (WAN) or directly (loopback)
        dst: dict[tuple[str, str], KVStoreProcess] = {}
        for path_kind in ("wan", "loopback"):
            for mode in MODES if path_kind == "wan" else ("raw", "auto"):
                cfg = edge_config(run_dir, f"edge-{path_kind}-{mode}", mode, capacity, link.address,
                                  link=path_kind == "wan")
                store = KVStoreProcess(run_dir, f"edge-{path_kind}-{mode}", config=cfg, site="edge",
                                       routes=link.routes if path_kind == "wan" else [])
                link.stores.append(store)
                dst[(path_kind, mode)] = store
        for store in link.stores:
            store.wait()
        rows: dict[str, list[dict]] = {f"{k}_{m}": [] for k, m in dst}
        for rep in range(reps):
            progress(f"rep {rep + 1}/{reps}")
            for (path_kind, mode), store in dst.items():
                seconds, pulled = timed_pull(link, store, template, payloads, timeout=300)
                rows[f"{path_kind}_{mode}"].append({"seconds": seconds, "wire_bytes": pulled.wire_bytes,
                                                    "raw_bytes": pulled.bytes_pulled, "codec": pulled.codec})
    summary = {}
    for key, runs in rows.items():
        summary[key] = {"seconds": round(statistics.median(r["seconds"] for r in runs), 3),
                        "wire_fraction": round(statistics.median(r["wire_bytes"] / r["raw_bytes"] for r in runs), 3),
                        "codecs": [r["codec"] for r in runs]}
    result |= {"summary": summary, "runs": rows}
    wan_raw, wan_auto = summary["wan_raw"], summary["wan_auto"]
    loop_raw, loop_auto = summary["loopback_raw"], summary["loopback_auto"]
    result["targets"] = {
        "bytes on the 1 Gbit/s link, auto / raw": {"value": wan_auto["wire_fraction"], "target": "<= 0.75",
                                                   "met": wan_auto["wire_fraction"] <= 0.75},
        "transfer time on the link, auto / raw": {"value": round(wan_auto["seconds"] / wan_raw["seconds"], 3),
                                                  "target": "< 1", "met": wan_auto["seconds"] < wan_raw["seconds"]},
        "transfer time on loopback, auto / raw": {"value": round(loop_auto["seconds"] / loop_raw["seconds"], 3),
                                                  "target": "not slower (auto sends raw)",
                                                  "met": all(c == "raw" for c in loop_auto["codecs"])}}
    write_result(result, args.output)
    return 0
