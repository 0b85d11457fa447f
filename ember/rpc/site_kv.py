"""An engine service's view of its site's kvstore: lease blocks, read their frames (shared
memory on the same host, raw-bytes gRPC otherwise), verify them, release the lease.

Prefill and decode both import KV through this: decode the blocks prefill made elsewhere,
prefill the blocks its site already holds (a follow-up turn placed at the edge reuses the
KV that decode pulled there). Every frame is checked against the engine's own layout and
model (INVALID_ARGUMENT), checksum and, with the cluster's MAC key, MAC (DATA_LOSS: a frame
no KV producer of this cluster signed is never imported) before import; a lease that
expired before the copy ends the request with DATA_LOSS rather than run on bytes that may
have changed.

Every lease this gets (from Pull or Acquire) is renewed every third of its granted time to
live until `release` ends it, however long the frames take to read and import; renewal
stops on release, when the store no longer knows the lease, or after MAX_HOLD_S. A holder
that dies renews nothing, and the store's TTL frees its blocks.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from ember.kv import bulk, wire
from ember.kv.shm import ArenaReader
from ember.rpc import tracing
from ember.rpc.errors import RpcError
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc

LEASE_S = 15.0      # asked for; the store grants at most its kvstore.max_lease_s
MAX_HOLD_S = 900.0  # renewal gives up after this (a holder that never releases is a bug)
_MIN_RENEW_S = 0.05

log = logging.getLogger("ember.site_kv")


class SiteKV:
    def __init__(self, channel: grpc.aio.Channel, use_shm: bool = True, mac_key: bytes | None = None):
        """`mac_key`: the cluster's KV frame MAC key; None (plaintext clusters) reads unsigned frames."""
        self.channel = channel
        self.mac_key = wire.check_mac_key(mac_key)
        self.frames_forged = 0  # frames refused for their MAC
        self.stub = kvstore_pb2_grpc.KVStoreStub(channel)
        self.use_shm = use_shm
        self.arena: ArenaReader | None = None
        self._arena_checked = False
        self.blocks_shared_memory = self.blocks_grpc = 0
        self.renewals = 0
        self._renewing: dict[int, asyncio.Task] = {}  # lease id -> its renewal loop

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
        """Bring the blocks here from `source` (only those missing cross) and lease them all
        (renewed until `release`)."""
        response = await self.stub.Pull(kvstore_pb2.PullRequest(block_hashes=hashes, source=source,
                                                                lease_s=LEASE_S), timeout=timeout)
        self._keep(response.lease)
        return response

    async def acquire(self, hashes: list[bytes], timeout: float | None) -> kvstore_pb2.LeaseResponse:
        """Lease the blocks the store holds (renewed until `release`)."""
        lease = await self.stub.Acquire(kvstore_pb2.AcquireRequest(block_hashes=hashes, lease_s=LEASE_S),
                                        timeout=timeout)
        self._keep(lease)
        return lease

    def _keep(self, lease: kvstore_pb2.LeaseResponse) -> None:
        if lease.lease_id and lease.lease_id not in self._renewing:
            task = asyncio.get_running_loop().create_task(self._renew_until_released(lease.lease_id,
                                                                                     lease.expires_in_s))
            self._renewing[lease.lease_id] = task
            task.add_done_callback(lambda _, lease_id=lease.lease_id: self._renewing.pop(lease_id, None))

    async def _renew_until_released(self, lease_id: int, granted_s: float) -> None:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + MAX_HOLD_S
        while True:
            every = max(_MIN_RENEW_S, (granted_s or LEASE_S) / 3)
            await asyncio.sleep(every)
            if loop.time() > give_up_at:
                log.warning("lease %d held for over %.0f s without release: no longer renewed", lease_id, MAX_HOLD_S)
                return
            try:
                renewed = await self.stub.Renew(kvstore_pb2.LeaseRequest(lease_id=lease_id, lease_s=LEASE_S),
                                                timeout=every)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.warning("lease %d could not be renewed: %s", lease_id, e.details())
                    return  # expired or unknown (a restarted store): release reports it to the caller
                continue  # the store is unreachable for now: try again within the time granted
            self.renewals += 1
            granted_s = renewed.expires_in_s

    @property
    def leases_renewing(self) -> list[int]:
        return list(self._renewing)

    async def payloads(self, hashes: list[bytes], lease: kvstore_pb2.LeaseResponse, expect: wire.FrameHeader,
                       timeout: float | None) -> dict[bytes, memoryview]:
        """Verified raw payloads of the leased blocks (wire.FrameError if one is damaged, foreign
        or, with a MAC key, not signed with it: wire.ForgedFrame)."""
        arena = await self._arena(lease.store_id)
        held = [(h, offset) for h, offset, ok in zip(hashes, lease.offsets, lease.present) if ok]
        frames = {}
        if arena is not None:
            frames = {h: arena.frame(offset, lease.frame_bytes) for h, offset in held}
            self.blocks_shared_memory += len(frames)
            tracing.annotate(read_via="shared memory")
        elif held:
            async for h, frame in bulk.fetch(self.channel, [h for h, _ in held], timeout=timeout):
                frames[h] = frame
            self.blocks_grpc += len(frames)
            tracing.annotate(read_via="grpc")
        try:
            return {h: wire.decode_frame(frame, expect, block_hash=h, mac_key=self.mac_key)
                    for h, frame in frames.items()}
        except wire.ForgedFrame as e:
            self.frames_forged += 1
            log.warning("refused a KV block from the site kvstore: %s", e)
            raise

    async def release(self, lease_id: int, check: bool = True) -> None:
        """End a lease; with `check`, a lease that expired first is DATA_LOSS for the caller."""
        if not lease_id:
            return
        renewal = self._renewing.pop(lease_id, None)
        if renewal is not None:
            renewal.cancel()
        try:
            await self.stub.Release(kvstore_pb2.LeaseRequest(lease_id=lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:
            if check and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise RpcError(grpc.StatusCode.DATA_LOSS, f"KV blocks were not held long enough to copy: "
                               f"{e.details()}; retry the request") from e
            if check:
                raise
