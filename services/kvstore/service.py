"""KVStore servicer: lookup, chunked put/get, pull-from-peer, stats."""
from __future__ import annotations

import asyncio
import time

import grpc

from ember.kv import bulk, transfer
from ember.kv.chunks import Assembler, split
from ember.rpc.errors import RpcError
from ember.rpc.server import channel
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.store import BlockStore


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore, data_address: str = ""):
        self.store = store
        self.data_address = data_address
        self._peer_data: dict[str, str] = {}  # peer gRPC address -> its data plane address
        self._peers: dict[str, grpc.aio.Channel] = {}
        self._inflight: dict[bytes, asyncio.Future] = {}  # one fetch per block at a time

    def _peer(self, address: str) -> grpc.aio.Channel:
        if address not in self._peers:
            self._peers[address] = channel(address)
        return self._peers[address]

    async def Lookup(self, request, context):
        present = [h in self.store for h in request.block_hashes]
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        return kvstore_pb2.LookupResponse(present=present, prefix_blocks=prefix)

    async def Put(self, request_iterator, context):
        assembler, stored, present = Assembler(), 0, 0
        async for chunk in request_iterator:
            try:
                block = assembler.add(chunk.block_hash, chunk.block_bytes, chunk.offset, chunk.data)
            except ValueError as e:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed block stream: {e}") from e
            if block is not None:
                if self._put(*block):
                    stored += 1
                else:
                    present += 1
        try:
            assembler.finish()
        except ValueError as e:
            raise RpcError(grpc.StatusCode.DATA_LOSS, f"block stream cut short: {e}") from e
        return kvstore_pb2.PutResponse(blocks_stored=stored, blocks_present=present)

    def _put(self, block_hash: bytes, payload) -> bool:
        try:
            return self.store.put(block_hash, payload)
        except MemoryError as e:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e

    def _reserve(self, num_bytes: int) -> tuple[int, memoryview]:
        try:
            slot = self.store.reserve(num_bytes)
        except MemoryError as e:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
        return slot, self.store.view(slot)

    async def Get(self, request, context):
        hashes = list(request.block_hashes)
        with self.store.pinned(hashes) as payloads:  # no slot is reused while it streams out
            for h, payload in zip(hashes, payloads):
                if payload is None:
                    raise RpcError(grpc.StatusCode.NOT_FOUND, f"block {h.hex()} is not in this store")
            for block_hash, total, offset, data in split(zip(hashes, payloads)):
                yield kvstore_pb2.BlockChunk(block_hash=block_hash, block_bytes=total, offset=offset, data=data)

    async def Pull(self, request, context):
        start = time.perf_counter()
        hashes = list(dict.fromkeys(request.block_hashes))
        missing = [h for h in hashes if h not in self.store and h not in self._inflight]
        waiting = [self._inflight[h] for h in hashes if h in self._inflight]
        pulled_blocks = pulled_bytes = 0
        if missing:
            if not request.source:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "source is required to pull missing blocks")
            loop = asyncio.get_running_loop()
            futures = {h: loop.create_future() for h in missing}
            self._inflight.update(futures)
            try:
                async for block_hash, payload in self._fetch(request.source, missing, context.time_remaining()):
                    pulled_blocks += 1
                    pulled_bytes += len(payload)
                    futures[block_hash].set_result(True)
            finally:
                for h, f in futures.items():
                    self._inflight.pop(h, None)
                    if not f.done():
                        f.set_result(False)
            self.store.stats.blocks_pulled += pulled_blocks
            self.store.stats.bytes_pulled += pulled_bytes
        if waiting and not all(await asyncio.gather(*waiting)):
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "a concurrent pull of the same blocks failed")
        return kvstore_pb2.PullResponse(blocks_pulled=pulled_blocks, blocks_present=len(hashes) - pulled_blocks,
                                        bytes_pulled=pulled_bytes, seconds=time.perf_counter() - start)

    async def _fetch(self, source: str, hashes: list[bytes], timeout: float | None):
        """Store blocks from a peer, yielding (hash, payload) as each lands: over the peer's
        TCP data plane straight into store slots when it has one, else gRPC bulk."""
        if source not in self._peer_data:
            stats = await kvstore_pb2_grpc.KVStoreStub(self._peer(source)).Stats(kvstore_pb2.StatsRequest(),
                                                                                 timeout=timeout)
            self._peer_data[source] = stats.data_address
        data_address = self._peer_data[source]
        if data_address:
            async for block_hash, slot, view in transfer.fetch(data_address, hashes, timeout,
                                                               alloc=self._reserve, release=self.store.release):
                self.store.commit(block_hash, slot)
                yield block_hash, view
        else:
            async for block_hash, payload in bulk.fetch(self._peer(source), hashes, timeout):
                self._put(block_hash, payload)
                yield block_hash, payload

    async def Stats(self, request, context):
        s = self.store.stats
        return kvstore_pb2.StatsResponse(
            blocks=len(self.store.blocks), bytes=self.store.bytes, capacity_bytes=self.store.capacity_bytes,
            hits=s.hits, misses=s.misses, evictions=s.evictions, blocks_pulled=s.blocks_pulled,
            bytes_pulled=s.bytes_pulled, blocks_put=s.blocks_put, blocks_served=s.blocks_served,
            data_address=self.data_address)
