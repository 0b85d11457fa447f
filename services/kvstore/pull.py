"""Fetching blocks from a peer kvstore: TCP data plane (or gRPC bulk), codec choice per link."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from ember.kv import bulk, codec, transfer, wire
from ember.rpc.server import channel
from ember.services.kvstore.store import BlockStore
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc

_MEASURE_MIN_BYTES = 4 * 2**20  # smaller pulls measure latency, not bandwidth


PROBE_EVERY = 8  # once both codecs are measured on a link, every 8th pull tries the slower one again


@dataclass
class Peer:
    channel: grpc.aio.Channel
    data_address: str | None = None  # None until asked
    link_GBps: float | None = None   # raw bytes/s of raw pulls (EWMA): the link as measured
    planes_GBps: float | None = None  # raw bytes/s of planes pulls (EWMA): what compression really gave
    configured_GBps: float | None = None  # the links table's bandwidth to it: the price before a measurement
    pulls: int = 0

    @property
    def known_GBps(self) -> float | None:
        return self.link_GBps if self.link_GBps is not None else self.configured_GBps


class PeerFetcher:
    """`mode`: raw, planes, or auto: the link's price first (codec.worth_it on the configured
    bandwidth, or on a raw pull's measurement), then what each codec really moved on it (a pull's raw
    bytes per second, measured for each codec): the faster one, the other tried again every
    PROBE_EVERY-th pull. A link priced for planes is measured raw once as well, so a host whose
    codec runs slower than it was priced (few or busy cores) falls back to raw."""

    def __init__(self, store: BlockStore, mode: str = "auto", routes: dict[str, str] | None = None, tls=None,
                 link_GBps: dict[str, float] | None = None):
        """`link_GBps`: peer address -> the configured bandwidth (GB/s) of the link to it."""
        if mode not in ("raw", "planes", "auto"):
            raise ValueError(f"codec mode must be raw, planes or auto, got {mode!r}")
        self.store, self.mode = store, mode
        self.routes = routes or {}  # peer address -> emulated-link relay in front of it
        self.configured = link_GBps or {}
        # the codec's speed on this host's cores (auto prices links with it), measured once
        self.codec_GBps = codec.measured_speeds() if mode == "auto" else (codec.ENCODE_GBPS, codec.DECODE_GBPS)
        self.peers: dict[str, Peer] = {}
        self.tls = tls  # ssl.SSLContext of the data plane (mTLS), or None

    def peer(self, address: str) -> Peer:
        if address not in self.peers:
            self.peers[address] = Peer(channel(self.routes.get(address, address)),
                                       configured_GBps=self.configured.get(address))
        return self.peers[address]

    def codec_for(self, peer: Peer, num_blocks: int | None = None) -> int:
        """The codec to ask of `peer` for a pull of `num_blocks` (None: unknown) blocks."""
        if self.mode != "auto":
            return codec.CODES[self.mode]
        frame = self._any_frame()
        measures = num_blocks is None or frame is None or num_blocks * len(frame) >= _MEASURE_MIN_BYTES
        raw, planes = peer.link_GBps, peer.planes_GBps
        if raw is not None and planes is not None:  # both measured: the faster; the other now and then
            best, other = (codec.PLANES, codec.RAW) if planes > raw else (codec.RAW, codec.PLANES)
            if not measures:  # (a small pull would measure latency, not the link: the probes wait for big ones)
                return best
            peer.pulls += 1
            return other if peer.pulls % PROBE_EVERY == 0 else best
        # (an empty store has no frame to tell the KV's width yet: bf16's, the served default)
        link = peer.known_GBps
        width = wire.parse_header(frame).element_bytes if frame is not None else 2
        if link is None or not codec.worth_it(link, width, True, *self.codec_GBps):
            return codec.RAW
        return codec.RAW if planes is not None and measures else codec.PLANES  # planes measured: now raw

    def _any_frame(self):
        for h in self.store.blocks:  # any stored frame tells the KV's dtype and frame size
            return self.store.get(h)
        return None

    async def fetch(self, source: str, hashes: list[bytes], timeout: float | None, reserve: Callable,
                    on_wire: Callable[[int], None], codec_id: int) -> AsyncIterator[tuple[bytes, memoryview]]:
        """Store blocks from `source`, yielding (hash, frame) as each lands; `codec_id` is
        asked of the peer's data plane (codec_for)."""
        peer = self.peer(source)
        if peer.data_address is None:
            stats = await kvstore_pb2_grpc.KVStoreStub(peer.channel).Stats(kvstore_pb2.StatsRequest(), timeout=timeout)
            peer.data_address = self.routes.get(stats.data_address, stats.data_address)
        if not peer.data_address:
            async for block_hash, frame in bulk.fetch(peer.channel, hashes, timeout):
                on_wire(len(frame))
                yield block_hash, file_frame(self.store, reserve, block_hash, frame)
            return
        start, raw_bytes, wire_bytes = time.perf_counter(), 0, 0

        def counted(n: int) -> None:
            nonlocal wire_bytes
            wire_bytes += n
            on_wire(n)
        async for block_hash, slot, frame in transfer.fetch(peer.data_address, hashes, timeout, alloc=reserve,
                                                            release=self.store.abandon, codec_id=codec_id,
                                                            on_wire=counted, tls=self.tls):
            self.store.commit(block_hash, slot)
            raw_bytes += len(frame)
            yield block_hash, frame
        if raw_bytes >= _MEASURE_MIN_BYTES:
            seen = raw_bytes / (time.perf_counter() - start) / 1e9
            field = "link_GBps" if codec_id == codec.RAW else "planes_GBps"
            before = getattr(peer, field)
            setattr(peer, field, seen if before is None else 0.7 * before + 0.3 * seen)


def file_frame(store: BlockStore, reserve: Callable, block_hash: bytes, frame) -> memoryview:
    """Verify a whole frame (any codec) filed as `block_hash` and store it raw; a damaged or
    foreign one raises wire.FrameError and leaves no slot behind. Returns the stored frame."""
    header = wire.parse_header(frame)
    if header.block_hash != block_hash:
        raise wire.LayoutMismatch(f"frame filed as {block_hash.hex()} carries hash {header.block_hash.hex()}")
    slot, view = reserve(wire.frame_bytes(header.raw_len))
    try:
        wire.write_raw(frame, view)
    except BaseException:
        store.abandon(slot)
        raise
    store.commit(block_hash, slot)
    return view
