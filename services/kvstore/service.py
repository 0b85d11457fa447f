"""KVStore servicer: lookup, chunked put/get, pull-from-peer, leases, stats.

Leases: a requested lease_s above the store's max_lease_s (`kvstore.max_lease_s`) is
granted as max_lease_s, never refused; every LeaseResponse's expires_in_s says what was
granted, and holders renew within it (ember.rpc.site_kv). A Pull's lease is held open by the
Pull itself while blocks cross a slow link; its TTL starts when the Pull answers.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from ember.errors import InvalidRequestError
from ember.kv import codec
from ember.kv.chunks import Assembler, split
from ember.rpc import metrics, tracing, validate
from ember.rpc.errors import RpcError
from ember.rpc.server import remaining
from ember.services.kvstore.pull import PeerFetcher, file_frame
from ember.services.kvstore.store import BlockStore, LeaseError
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc

MAX_ANNOUNCED = 4096  # hashes one Put may announce (more are simply not awaited)
WAIT_FOR_OTHERS_S = 10.0  # the longest a pull waits on another's transfer before fetching itself

class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore, data_address: str = "", codec_mode: str = "auto",
                 shm_socket: str = "", store_id: bytes = b"", routes: dict[str, str] | None = None,
                 peers: set[str] | None = None, tls=None, link_GBps: dict[str, float] | None = None,
                 site: str = "", sites: dict[str, str] | None = None):
        """`peers`: the kvstores a Pull may name as its source (the config's other sites; None:
        any, for in-process tests); `tls`: the data plane's client context (mTLS); `link_GBps`: peer
        address -> the configured bandwidth of the link to it (the codec's price before a measurement);
        `site`, `sites`: this store's site and the others' by kvstore address (named on a pull's span)."""
        self.store = store
        self.site, self.sites = site, sites or {}
        self.data_address, self.shm_socket, self.store_id = data_address, shm_socket, store_id
        self.peers = peers
        self.fetcher = PeerFetcher(store, codec_mode, routes, tls, link_GBps)
        self.wire_bytes_pulled = 0
        # blocks on their way here, one transfer each: fetched by a pull, or brought by an announced Put
        self._pulling: dict[bytes, asyncio.Future] = {}
        self._pushing: dict[bytes, asyncio.Future] = {}

    async def Lookup(self, request, context):
        present = [h in self.store for h in validate.block_hashes(request.block_hashes)]
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        return kvstore_pb2.LookupResponse(present=present, prefix_blocks=prefix)

    async def Put(self, request_iterator, context):
        assembler, stored, present = Assembler(), 0, 0
        async for chunk in request_iterator:
            validate.block_hashes([chunk.block_hash], "block_hash")
            try:
                block = assembler.add(chunk.block_hash, chunk.block_bytes, chunk.offset, chunk.data)
            except ValueError as e:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed block stream: {e}") from e
            if block is not None:
                if self.put_frame(*block):
                    stored += 1
                else:
                    present += 1
        try:
            assembler.finish()
        except ValueError as e:
            raise RpcError(grpc.StatusCode.DATA_LOSS, f"block stream cut short: {e}") from e
        return kvstore_pb2.PutResponse(blocks_stored=stored, blocks_present=present)

    @contextlib.contextmanager
    def expect(self, hashes: list[bytes]):
        """Blocks a Put announced are in flight while it runs: a Pull of them meanwhile waits for
        it (and fetches itself whatever the Put did not deliver) instead of fetching them twice."""
        loop = asyncio.get_running_loop()
        mine = {h: loop.create_future() for h in list(dict.fromkeys(hashes))[:MAX_ANNOUNCED]
                if h not in self.store and self._arriving(h) is None}
        self._pushing.update(mine)
        try:
            yield
        finally:
            for h, f in mine.items():
                if self._pushing.get(h) is f:  # (not delivered: a waiting Pull fetches it itself)
                    self._landed(h, False)

    def _arriving(self, block_hash: bytes) -> asyncio.Future | None:
        """The transfer bringing this block here now (a pull's or an announced Put's), if any."""
        return self._pulling.get(block_hash) or self._pushing.get(block_hash)

    def _landed(self, block_hash: bytes, ok: bool) -> None:
        future = self._pushing.pop(block_hash, None)
        if future is not None:
            if not future.done():
                future.set_result(ok)

    def put_frame(self, block_hash: bytes, frame) -> bool:
        """Verify and file one frame; a damaged or foreign one is refused (wire.FrameError:
        DATA_LOSS or INVALID_ARGUMENT), never stored."""
        if block_hash in self.store:
            self.store.get(block_hash)
            self._landed(block_hash, True)
            return False
        view = file_frame(self.store, self._reserve, block_hash, frame)
        self.store.stats.bytes_put += len(view)
        self._landed(block_hash, True)  # a Pull waiting for this announced block goes on now
        return True

    def _reserve(self, num_bytes: int) -> tuple[int, memoryview]:
        try:
            slot = self.store.reserve(num_bytes)
        except MemoryError as e:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
        except ValueError as e:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        return slot, self.store.view(slot)

    async def Get(self, request, context):
        hashes = validate.block_hashes(request.block_hashes)
        with self.store.pinned(hashes) as frames:  # no slot is reused while it streams out
            for h, frame in zip(hashes, frames):
                if frame is None:
                    raise RpcError(grpc.StatusCode.NOT_FOUND, f"block {h.hex()} is not in this store")
            for block_hash, total, offset, data in split(zip(hashes, frames)):
                yield kvstore_pb2.BlockChunk(block_hash=block_hash, block_bytes=total, offset=offset, data=data)

    async def Pull(self, request, context):
        hashes = list(dict.fromkeys(validate.block_hashes(request.block_hashes)))
        validate.address(request.source, "source")
        if request.source and self.peers is not None and request.source not in self.peers:
            # never dial an address a caller names: only the cluster's own kvstores
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                           f"source {request.source!r} is not a kvstore of this cluster's config")
        if request.lease_s > 0:
            validate.lease_s(request.lease_s)
        if not request.lease_s >= 0:  # NaN too
            raise InvalidRequestError(f"lease_s must be >= 0 (0: no lease), got {request.lease_s}")
        if request.lease_s == 0:
            return await self._pull_blocks(request, hashes, None, context)
        # lease first, so blocks already here cannot be evicted by this very pull
        lease = self.store.acquire(hashes, request.lease_s)
        try:
            with self.store.held(lease.lease_id):  # however long the transfer takes
                response = await self._pull_blocks(request, hashes, lease, context)
                for h in hashes:  # blocks another pull brought in while we waited
                    if h not in lease.block_hashes:
                        self.store.add_to_lease(lease.lease_id, h)
            response.lease.CopyFrom(self._lease_pb(lease.lease_id, hashes))  # its TTL runs from now
            return response
        except BaseException:
            if lease.lease_id in self.store.leases:
                self.store.release_lease(lease.lease_id)
            raise

    async def _pull_blocks(self, request, hashes: list[bytes], lease, context) -> kvstore_pb2.PullResponse:
        start = time.perf_counter()
        arriving = {h: f for h in hashes if (f := self._arriving(h)) is not None}
        missing = [h for h in hashes if h not in self.store and h not in arriving]
        waiting = list(arriving.values())
        pulled_blocks = pulled_bytes = wire_bytes = 0
        codec_name = "raw"
        if missing:
            if not request.source:
                raise InvalidRequestError("source is required to pull missing blocks")
            codec_id = self.fetcher.codec_for(self.fetcher.peer(request.source), len(missing))
            codec_name = codec.NAMES[codec_id]
            pulled_blocks, pulled_bytes, wire_bytes = await self._pull(request.source, missing, lease,
                                                                       remaining(context), codec_id)
        if waiting and not await self._others_delivered(waiting, remaining(context)):
            # a concurrent pull or announced push of some of these blocks failed (a stream cut
            # short, its deadline) or is taking too long: this pull fetches what is missing itself
            again = [h for h in hashes if h not in self.store and h not in missing and h not in self._pulling]
            if again:
                if not request.source:
                    raise RpcError(grpc.StatusCode.UNAVAILABLE, "a concurrent pull of the same blocks failed")
                more = await self._pull(request.source, again, lease, remaining(context),
                                        self.fetcher.codec_for(self.fetcher.peer(request.source), len(again)))
                pulled_blocks, pulled_bytes, wire_bytes = (a + b for a, b in zip((pulled_blocks, pulled_bytes,
                                                                                  wire_bytes), more))
        if pulled_bytes:
            metrics.KV_PULL_THROUGHPUT.observe(pulled_bytes / max(1e-9, time.perf_counter() - start))
        tracing.annotate(source=request.source, blocks_requested=len(hashes), blocks_pulled=pulled_blocks,
                         bytes_pulled=pulled_bytes, wire_bytes=wire_bytes, codec=codec_name,
                         seconds=time.perf_counter() - start)
        return kvstore_pb2.PullResponse(blocks_pulled=pulled_blocks, bytes_pulled=pulled_bytes,
                                        blocks_present=len(hashes) - pulled_blocks, wire_bytes=wire_bytes,
                                        codec=codec_name, seconds=time.perf_counter() - start)

    async def _others_delivered(self, waiting: list[asyncio.Future], timeout: float | None) -> bool:
        """Whether the pulls and announced pushes this pull waits on delivered every block, within
        WAIT_FOR_OTHERS_S (an announcing Put that never sends must not hold a pull longer). Shielded:
        this pull's cancellation (its caller gone) never cancels the futures others share."""
        limit = WAIT_FOR_OTHERS_S if timeout is None else min(timeout, WAIT_FOR_OTHERS_S)
        done, _ = await asyncio.wait([asyncio.shield(f) for f in waiting], timeout=limit)
        return len(done) == len(waiting) and all(not f.cancelled() and f.result() for f in done)

    async def _pull(self, source: str, missing: list[bytes], lease, timeout: float | None,
                    codec_id: int) -> tuple[int, int, int]:
        loop = asyncio.get_running_loop()
        futures = {h: loop.create_future() for h in missing if h not in self._pulling}
        self._pulling.update(futures)
        blocks = raw_bytes = wire_bytes = 0

        def on_wire(n: int) -> None:
            nonlocal wire_bytes
            wire_bytes += n
        started = time.perf_counter()
        span = tracing.child_span("kv.pull", source=source, source_site=self.sites.get(source),
                                  codec=codec.NAMES.get(codec_id), blocks_requested=len(missing))
        try:
            with span:
                async for block_hash, frame in self.fetcher.fetch(source, missing, timeout, self._reserve, on_wire,
                                                                      codec_id):
                    blocks += 1
                    raw_bytes += len(frame)
                    if lease is not None:
                        self.store.add_to_lease(lease.lease_id, block_hash)
                    self._landed(block_hash, True)  # (a push announced it too: its waiters go on)
                    f = futures.get(block_hash)
                    if f is not None and not f.done():
                        f.set_result(True)
                self._annotate_link(source, blocks, raw_bytes, wire_bytes)
        finally:
            for h, f in futures.items():
                if self._pulling.get(h) is f:
                    del self._pulling[h]
                if not f.done():
                    f.set_result(False)
            self.store.stats.blocks_pulled += blocks
            self.store.stats.bytes_pulled += raw_bytes
            self.wire_bytes_pulled += wire_bytes
            link = f"{self.sites.get(source, source)}->{self.site or 'here'}"  # (a pull cut short counts too)
            metrics.KV_PULL_BYTES.labels(link).inc(raw_bytes)
            metrics.KV_PULL_WIRE_BYTES.labels(link).inc(wire_bytes)
            metrics.KV_PULL_SECONDS.labels(link).inc(time.perf_counter() - started)
        return blocks, raw_bytes, wire_bytes

    def _annotate_link(self, source: str, blocks: int, raw_bytes: int, wire_bytes: int) -> None:
        """A pull's span: what crossed, and the link it crossed (sites, the peer's address, the data
        plane's address, or gRPC when the peer has none; a relay when the link is emulated)."""
        peer = self.fetcher.peers.get(source)
        data = peer.data_address if peer is not None else None
        tracing.annotate(blocks=blocks, bytes=raw_bytes, wire_bytes=wire_bytes, site=self.site or None,
                         link=f"{self.sites.get(source, source)} -> {self.site or 'here'}",
                         via="data plane" if data else "grpc", data_address=data or None,
                         relay=self.fetcher.routes.get(source))

    def _lease_pb(self, lease_id: int, hashes: list[bytes]) -> kvstore_pb2.LeaseResponse:
        lease = self.store.leases[lease_id]
        held = set(lease.block_hashes)
        return kvstore_pb2.LeaseResponse(
            lease_id=lease_id, expires_in_s=lease.expires_at - self.store.clock(),
            present=[h in held for h in hashes],
            offsets=[self.store.offset(h) if h in held else 0 for h in hashes], frame_bytes=self.store.slot_bytes,
            store_id=self.store_id)

    async def Acquire(self, request, context):
        hashes = validate.block_hashes(request.block_hashes)
        validate.lease_s(request.lease_s)
        return self._lease_pb(self.store.acquire(hashes, request.lease_s).lease_id, hashes)

    async def Renew(self, request, context):
        validate.lease_s(request.lease_s)
        try:
            lease = self.store.renew(request.lease_id, request.lease_s)
        except LeaseError as e:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
        return kvstore_pb2.LeaseResponse(lease_id=lease.lease_id, expires_in_s=lease.ttl_s)

    async def Release(self, request, context):
        try:
            self.store.release_lease(request.lease_id)
        except LeaseError as e:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
        return kvstore_pb2.LeaseResponse(lease_id=request.lease_id)

    async def Stats(self, request, context):
        s, store = self.store.stats, self.store
        store.expire_leases()
        return kvstore_pb2.StatsResponse(
            blocks=len(store.blocks), bytes=store.bytes, capacity_bytes=store.capacity_bytes,
            hits=s.hits, misses=s.misses, evictions=s.evictions, blocks_pulled=s.blocks_pulled,
            bytes_pulled=s.bytes_pulled, blocks_put=s.blocks_put, blocks_served=s.blocks_served,
            data_address=self.data_address, pinned_blocks=len(store.pins), leases=len(store.leases),
            leases_expired=s.leases_expired, shm_socket=self.shm_socket, store_id=self.store_id,
            wire_bytes_pulled=self.wire_bytes_pulled, leases_renewed=s.leases_renewed, max_lease_s=store.max_lease_s)
