"""`ember bench kv`: how fast KV blocks move, and how much the lossless codec saves.

Real kvstore processes (`python -m ember.services.kvstore`), real KV blocks (the model's own KV
for an English prompt, as wire frames), alternating rep by rep so every path sees the
same machine state:
- raw loopback TCP, one sender thread, one receiver: between hot 1 MiB buffers (the
  ceiling) and between two memfd arenas (the memory kvstores really move bytes between);
- put: a client streaming frames into a kvstore: typed gRPC Put, and the raw-bytes bulk
  Put prefill uses;
- pull: one kvstore pulling from another through the gRPC Pull API (bytes on the
  kvstores' TCP data plane), raw and with the planes codec;
- same-host read: what decode does: lease the blocks, read them from the kvstore's
  shared arena, verify every checksum, copy into a reused buffer, release;
- gRPC read: the same through the raw-bytes gRPC stream (the fallback off-host).
Codec figures (saving, encode/decode GB/s on one core) on real bf16 and fp32 KV and on the
model's weights cast to bf16.
"""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import yaml

from ember.bench.measure import progress, write_result
from ember.cluster.launcher import wait_serving
from ember.cluster.ports import write_kvstore_config
from ember.kv import bulk, codec, wire
from ember.kv.chunks import split
from ember.kv.shm import ArenaReader
from ember.rpc.server import CHANNEL_OPTIONS
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc

PARAGRAPH = ("The harbour master of Eastmere kept a ledger of every ship that entered the bay in year {y}: "
             "{n} fishing boats, {m} merchant ships and a lighthouse whose keeper logged the wind, the tide "
             "and the colour of the sky each morning before the bells rang. ")


def english_prompt(num_paragraphs: int) -> str:
    return "".join(PARAGRAPH.format(y=1700 + 7 * i, n=40 + i, m=3 * i + 2) for i in range(num_paragraphs))


def real_kv(model: str, dtype: str, threads: int) -> tuple[wire.FrameHeader, list[bytes], object]:
    """The model's KV blocks for an English prompt (~1,500 tokens) and the loaded model."""
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    from ember.kv.block_hash import chain_hashes
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, weights="dense", kv_cache_mb=192,
                                    threads=threads))
    ids = engine.tokenizer.encode(english_prompt(30))[:1536]
    engine.generate([ids], SamplingParams(max_tokens=1))
    hashes = chain_hashes(ids, engine.config.block_size, engine.block_manager.root_hash)
    return engine.frame_template, engine.export_blocks(hashes), engine.loaded.model


def codec_figures(payloads: list, element_bytes: int) -> dict:
    """Saving and one-core speeds of the planes codec, bit-exactness checked on every block."""
    raw = sum(len(p) for p in payloads)
    encoded, out = [], bytearray(max(len(p) for p in payloads))
    start = time.perf_counter()
    for p in payloads:
        encoded.append(codec.encode(codec.PLANES, p, element_bytes))
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    for e, p in zip(encoded, payloads):
        codec.decode_into(codec.PLANES, e, element_bytes, memoryview(out)[:len(p)])
    decode_s = time.perf_counter() - start
    for e, p in zip(encoded, payloads):
        codec.decode_into(codec.PLANES, e, element_bytes, memoryview(out)[:len(p)])
        if out[:len(p)] != p:
            raise AssertionError("planes codec round trip is not bit-exact")
    return {"raw_bytes": raw, "encoded_bytes": sum(len(e) for e in encoded),
            "saving": 1 - sum(len(e) for e in encoded) / raw,
            "encode_GBps_per_core": raw / encode_s / 1e9, "decode_GBps_per_core": raw / decode_s / 1e9}


def weight_chunks(model, chunk_bytes: int = 1 << 20) -> list[bytes]:
    import torch
    flat = torch.cat([t.detach().flatten().to(torch.bfloat16) for t in model.state_dict().values()])
    data = flat.view(torch.int16).numpy().tobytes()
    return [data[i:i + chunk_bytes] for i in range(0, len(data) - len(data) % 2, chunk_bytes)]


def raw_tcp_GBps(total_bytes: int, chunk_bytes: int = 1 << 20, arena: bool = False,
                 receive_buffer: int | None = 4 * 2**20) -> float:
    """Loopback TCP measured now, one sender thread, one receiver (GB/s), with the data plane's
    4 MiB receive buffer (None: the kernel's default). Hot 1 MiB buffers on both ends (the
    ceiling), or `arena`: from one populated memfd mapping into another, the memory kvstores
    really move bytes between."""
    server = socket.create_server(("127.0.0.1", 0))
    if receive_buffer:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # inherited by the accepted socket
    port = server.getsockname()[1]
    count = total_bytes // chunk_bytes
    src = _memfd_view(count * chunk_bytes) if arena else None
    dst = _memfd_view(count * chunk_bytes) if arena else None
    hot = os.urandom(chunk_bytes)

    def send():
        with socket.create_connection(("127.0.0.1", port)) as s:
            for i in range(count):
                s.sendall(hot if src is None else src[i * chunk_bytes:(i + 1) * chunk_bytes])
    sender = threading.Thread(target=send)
    sender.start()
    conn, _ = server.accept()
    buf, got, start = memoryview(bytearray(chunk_bytes)), 0, time.perf_counter()
    while got < count * chunk_bytes:
        n = conn.recv_into(buf if dst is None else dst[got:])
        if n == 0:
            break
        got += n
    seconds = time.perf_counter() - start
    sender.join()
    conn.close()
    server.close()
    return got / seconds / 1e9


def _memfd_view(num_bytes: int) -> memoryview:
    import mmap
    fd = os.memfd_create("ember-bench")
    os.ftruncate(fd, num_bytes)
    view = memoryview(mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
    os.close(fd)
    view[:] = bytes(num_bytes)  # written once, as a store's slots are
    return view


class KVStoreProcess:
    """A kvstore service process for `site` of the cluster config `config` (None: a one-site config of
    its own, `capacity_mb` and `codec_mode`), its inter-site hops through `routes` (ADDRESS=RELAY)."""

    def __init__(self, run_dir: Path, name: str, capacity_mb: int = 256, codec_mode: str = "raw",
                 config: Path | None = None, site: str = "solo", routes: list[str] = (),
                 peers: list[KVStoreProcess] = ()):
        """peers: stores this one may pull from (a kvstore pulls only from the kvstores of its config)."""
        if config is None:
            config = run_dir / f"{name}.yaml"
            site = name
            write_kvstore_config(config, capacity_mb, codec_mode, site, peers=[
                {"name": p.site, "kvstore": p.address, "kvstore_data": p.data} for p in peers])
        self.site = site
        addr = next(s for s in yaml.safe_load(config.read_text())["sites"] if s["name"] == site)
        self.address, self.data = addr["kvstore"], addr.get("kvstore_data")
        self.log = run_dir / f"{name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "ember.services.kvstore", "--config", str(config),
                                          "--site", site, *[f"--route={r}" for r in routes]],
                                         stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = kvstore_pb2_grpc.KVStoreStub(self.channel)

    def wait(self) -> None:
        wait_serving(self.address, time.monotonic() + 60, self.proc, self.log)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def put_GBps(store: KVStoreProcess, frames: list[tuple[bytes, bytes]]) -> float:
    start = time.perf_counter()
    chunks = (kvstore_pb2.BlockChunk(block_hash=h, block_bytes=n, offset=o, data=d) for h, n, o, d in split(frames))
    stored = store.stub.Put(chunks, timeout=300).blocks_stored
    seconds = time.perf_counter() - start
    assert stored == len(frames), f"put stored {stored} of {len(frames)}"
    return sum(len(f) for _, f in frames) / seconds / 1e9


def bulk_put_GBps(store: KVStoreProcess, frames: list[tuple[bytes, bytes]]) -> float:
    """What prefill uses: raw-bytes gRPC, one message per frame."""
    import asyncio

    async def send() -> int:
        async with grpc.aio.insecure_channel(store.address, options=CHANNEL_OPTIONS) as ch:
            return (await bulk.put(ch, frames, timeout=300))[0]
    start = time.perf_counter()
    stored = asyncio.run(send())
    seconds = time.perf_counter() - start
    assert stored == len(frames), f"bulk put stored {stored} of {len(frames)}"
    return sum(len(f) for _, f in frames) / seconds / 1e9


def pull(dst: KVStoreProcess, src: KVStoreProcess, hashes: list[bytes]) -> kvstore_pb2.PullResponse:
    start = time.perf_counter()
    pulled = dst.stub.Pull(kvstore_pb2.PullRequest(block_hashes=hashes, source=src.address), timeout=300)
    assert pulled.blocks_pulled == len(hashes), "every block crosses (fresh hashes per rep)"
    pulled.seconds = time.perf_counter() - start  # as the caller sees it
    return pulled


def same_host_read_GBps(store: KVStoreProcess, arena: ArenaReader, hashes: list[bytes], dest: np.ndarray,
                        expect: wire.FrameHeader) -> float:
    """Decode's same-host path: lease, read from the shared arena, verify, copy, release."""
    start = time.perf_counter()
    lease = store.stub.Acquire(kvstore_pb2.AcquireRequest(block_hashes=hashes, lease_s=30), timeout=30)
    total = 0
    for i, (h, offset) in enumerate(zip(hashes, lease.offsets)):
        payload = wire.decode_frame(arena.frame(offset, lease.frame_bytes), expect, block_hash=h)
        dest[i, :len(payload)] = np.frombuffer(payload, np.uint8)
        total += lease.frame_bytes
    store.stub.Release(kvstore_pb2.LeaseRequest(lease_id=lease.lease_id), timeout=30)
    return total / (time.perf_counter() - start) / 1e9


def grpc_read_GBps(store: KVStoreProcess, hashes: list[bytes], dest: np.ndarray, expect: wire.FrameHeader) -> float:
    """The off-host fallback: the raw-bytes gRPC stream, verify, copy."""
    import asyncio

    async def read() -> int:
        total = 0
        async with grpc.aio.insecure_channel(store.address, options=CHANNEL_OPTIONS) as ch:
            i = 0
            async for h, frame in bulk.fetch(ch, hashes, timeout=300):
                payload = wire.decode_frame(frame, expect, block_hash=h)
                dest[i, :len(payload)] = np.frombuffer(payload, np.uint8)
                total += len(frame)
                i += 1
        return total
    start = time.perf_counter()
    total = asyncio.run(read())
    return total / (time.perf_counter() - start) / 1e9


def main(args) -> int:
    reps, num_blocks = (1, 64) if args.quick else (3, 256)
    threads = args.threads or 2
    result: dict = {"reps": reps, "blocks_per_transfer": num_blocks}
    progress("real KV: fp32 (the cluster default) and bf16")
    template, payloads32, model = real_kv(args.model, "float32", threads)
    template16, payloads16, _ = real_kv(args.model, "bfloat16", threads)
    progress("codec on KV and weights")
    result["codec"] = {"bf16_kv": codec_figures(payloads16, 2), "fp32_kv": codec_figures(payloads32, 4),
                       "bf16_weights": codec_figures(weight_chunks(model), 2)}
    del model

    def frames_for(rep: int) -> list[tuple[bytes, bytes]]:
        hashes = [os.urandom(16) for _ in range(num_blocks)]  # fresh content addresses: nothing cached
        return [(h, wire.encode_frame(template, h, payloads32[i % len(payloads32)])) for i, h in enumerate(hashes)]
    frame_bytes = wire.frame_bytes(template.raw_len)
    set_mb = num_blocks * frame_bytes // 2**20 + 1
    rows: dict[str, list[float]] = {k: [] for k in ("raw_tcp", "raw_tcp_arena", "put", "bulk_put", "pull",
                                                    "pull_planes", "same_host", "grpc_read")}
    wire_ratio = []
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        src = KVStoreProcess(run_dir, "src", capacity_mb=2 * set_mb * reps + 8)
        dst = KVStoreProcess(run_dir, "dst", capacity_mb=set_mb + 8, peers=[src])
        dst_planes = KVStoreProcess(run_dir, "dst-planes", capacity_mb=set_mb + 8, codec_mode="planes", peers=[src])
        try:
            for store in (src, dst, dst_planes):
                store.wait()
            stats = dst.stub.Stats(kvstore_pb2.StatsRequest(), timeout=10)
            arena = ArenaReader.try_open(stats.shm_socket, stats.store_id)
            if arena is None:
                raise RuntimeError("could not map the kvstore arena (same host expected)")
            dest = np.ones((num_blocks, template.raw_len), np.uint8)  # touched once: a warm pool, as in decode
            for rep in range(reps):
                progress(f"rep {rep + 1}/{reps}")
                frames = frames_for(rep)
                hashes = [h for h, _ in frames]
                rows["raw_tcp"].append(raw_tcp_GBps(num_blocks * frame_bytes))
                rows["raw_tcp_arena"].append(raw_tcp_GBps(num_blocks * frame_bytes, arena=True))
                rows["put"].append(put_GBps(src, frames_for(rep)))  # another fresh set
                rows["bulk_put"].append(bulk_put_GBps(src, frames))
                pulled = pull(dst, src, hashes)
                rows["pull"].append(pulled.bytes_pulled / pulled.seconds / 1e9)
                rows["same_host"].append(same_host_read_GBps(dst, arena, hashes, dest, template))
                rows["grpc_read"].append(grpc_read_GBps(dst, hashes, dest, template))
                planes = pull(dst_planes, src, hashes)
                rows["pull_planes"].append(planes.bytes_pulled / planes.seconds / 1e9)
                wire_ratio.append(planes.wire_bytes / planes.bytes_pulled)
                del frames
        finally:
            for store in (src, dst, dst_planes):
                store.stop()
    med = {k: statistics.median(v) for k, v in rows.items()}
    c = result["codec"]
    result.update({
        "raw_tcp_GBps": med["raw_tcp"], "raw_tcp_arena_GBps": med["raw_tcp_arena"],
        "put_GBps": med["put"], "bulk_put_GBps": med["bulk_put"],
        "grpc_pull_GBps": med["pull"],
        "planes_pull_GBps": med["pull_planes"], "planes_pull_wire_fraction": statistics.median(wire_ratio),
        "same_host_GBps": med["same_host"], "grpc_read_GBps": med["grpc_read"],
        "bf16_kv_saving": c["bf16_kv"]["saving"], "fp32_kv_saving": c["fp32_kv"]["saving"],
        "bf16_weights_saving": c["bf16_weights"]["saving"], "runs": rows,
    })
    decode_rates = [c[k]["decode_GBps_per_core"] for k in ("bf16_kv", "fp32_kv", "bf16_weights")]
    result["targets"] = {
        "grpc_pull_over_raw_tcp": {"value": round(med["pull"] / med["raw_tcp"], 3), "target": 0.6,
                                   "met": med["pull"] >= 0.6 * med["raw_tcp"]},
        "grpc_pull_over_raw_tcp_arena": {"value": round(med["pull"] / med["raw_tcp_arena"], 3), "target": 0.6,
                                         "met": med["pull"] >= 0.6 * med["raw_tcp_arena"]},
        "same_host_GBps": {"value": round(med["same_host"], 2), "target": 4.0, "met": med["same_host"] >= 4.0},
        "bf16_kv_saving": {"value": round(result["bf16_kv_saving"], 3), "target": 0.25,
                           "met": result["bf16_kv_saving"] >= 0.25},
        "bf16_weights_saving": {"value": round(result["bf16_weights_saving"], 3), "target": 0.30,
                                "met": result["bf16_weights_saving"] >= 0.30},
        "codec_decode_GBps_per_core": {"value": round(min(decode_rates), 2), "target": 1.0,
                                       "met": min(decode_rates) >= 1.0},
    }
    write_result(result, args.output)
    return 0
