"""An engine service's view of its site's kvstore: lease blocks, read their frames (shared
memory on the same host, raw-bytes gRPC otherwise), verify them, release the lease.

Prefill and decode both import KV through this: decode the blocks prefill made elsewhere,
prefill the blocks its site already holds (a follow-up turn placed at the edge reuses the
KV that decode pulled there). Every frame is checked against the engine's own layout and
model (INVALID_ARGUMENT) and checksum (DATA_LOSS) before import; a lease that expired
before the copy ends the request with DATA_LOSS rather than run on bytes that may have
changed.
"""
from __future__ import annotations

import grpc

from ember.kv import bulk, wire
from ember.kv.shm import ArenaReader
from ember.rpc.errors import RpcError
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc

LEASE_S = 30.0


class SiteKV:
    def __init__(self, channel: grpc.aio.Channel, use_shm: bool = True):
        self.channel = channel
        self.stub = kvstore_pb2_grpc.KVStoreStub(channel)
        self.use_shm = use_shm
        self.arena: ArenaReader | None = None
        self._arena_checked = False
        self.blocks_shared_memory = self.blocks_grpc = 0

    async def _arena(self, store_id: bytes = b"") -> ArenaReader | None:
        """The kvstore's arena when it shares this host (asked once per store process: a lease
        from a restarted store carries a new store id, and its arena is mapped afresh)."""
        if self.use_shm and self._arena_checked and store_id and self.arena is not None \
                and self.arena.store_id != store_id:
            # the old map goes with its last frame view (frames being imported may still use it)
            self.arena, self._arena_checked = None, False
        if self.use_shm and not self._arena_checked:
            stats = await self.stub.Stats(kvstore_pb2.StatsRequest(), timeout=5)
            self.arena = ArenaReader.try_open(stats.shm_socket, stats.store_id)
            self._arena_checked = True
        if self.arena is not None and store_id and self.arena.store_id != store_id:
            return None  # restarted again between the lease and the Stats call: read over gRPC
        return self.arena

    async def pull(self, hashes: list[bytes], source: str, timeout: float | None) -> kvstore_pb2.PullResponse:
        """Bring the blocks here from `source` (only those missing cross) and lease them all."""
        return await self.stub.Pull(kvstore_pb2.PullRequest(block_hashes=hashes, source=source, lease_s=LEASE_S),
                                    timeout=timeout)

    async def acquire(self, hashes: list[bytes], timeout: float | None) -> kvstore_pb2.LeaseResponse:
        return await self.stub.Acquire(kvstore_pb2.AcquireRequest(block_hashes=hashes, lease_s=LEASE_S),
                                       timeout=timeout)

    async def payloads(self, hashes: list[bytes], lease: kvstore_pb2.LeaseResponse, expect: wire.FrameHeader,
                       timeout: float | None) -> dict[bytes, memoryview]:
        """Verified raw payloads of the leased blocks (wire.FrameError if one is damaged or foreign)."""
        arena = await self._arena(lease.store_id)
        held = [(h, offset) for h, offset, ok in zip(hashes, lease.offsets, lease.present) if ok]
        frames = {}
        if arena is not None:
            frames = {h: arena.frame(offset, lease.frame_bytes) for h, offset in held}
            self.blocks_shared_memory += len(frames)
        elif held:
            async for h, frame in bulk.fetch(self.channel, [h for h, _ in held], timeout=timeout):
                frames[h] = frame
            self.blocks_grpc += len(frames)
        return {h: wire.decode_frame(frame, expect, block_hash=h) for h, frame in frames.items()}

    async def release(self, lease_id: int, check: bool = True) -> None:
        """End a lease; with `check`, a lease that expired first is DATA_LOSS for the caller."""
        if not lease_id:
            return
        try:
            await self.stub.Release(kvstore_pb2.LeaseRequest(lease_id=lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:
            if check and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise RpcError(grpc.StatusCode.DATA_LOSS, f"KV blocks were not held long enough to copy: "
                               f"{e.details()}; retry the request") from e
            if check:
                raise
