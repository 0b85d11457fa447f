"""KVStore servicer: lookup, chunked put/get, pull-from-peer, stats."""
from __future__ import annotations

import asyncio
import time

import grpc

from ember.kv.chunks import Assembler, split
from ember.rpc.errors import RpcError
from ember.rpc.server import channel
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.store import BlockStore


class KVStoreService(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, store: BlockStore):
        self.store = store
        self._peers: dict[str, kvstore_pb2_grpc.KVStoreStub] = {}
        self._inflight: dict[bytes, asyncio.Future] = {}  # one fetch per block at a time

    def _peer(self, address: str) -> kvstore_pb2_grpc.KVStoreStub:
        if address not in self._peers:
            self._peers[address] = kvstore_pb2_grpc.KVStoreStub(channel(address))
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

    def _put(self, block_hash: bytes, payload: bytes) -> bool:
        try:
            return self.store.put(block_hash, payload)
        except MemoryError as e:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e

    async def Get(self, request, context):
        blocks = []
        for h in request.block_hashes:
            payload = self.store.get(h)
            if payload is None:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"block {h.hex()} is not in this store")
            blocks.append((h, payload))  # taken up front: an eviction mid-stream cannot cut it
        for block_hash, total, offset, data in split(blocks):
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
                timeout = context.time_remaining()
                stream = self._peer(request.source).Get(kvstore_pb2.GetRequest(block_hashes=missing), timeout=timeout)
                assembler = Assembler()
                async for chunk in stream:
                    block = assembler.add(chunk.block_hash, chunk.block_bytes, chunk.offset, chunk.data)
                    if block is not None:
                        self._put(*block)
                        pulled_blocks += 1
                        pulled_bytes += len(block[1])
                        futures[block[0]].set_result(True)
                assembler.finish()
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

    async def Stats(self, request, context):
        s = self.store.stats
        return kvstore_pb2.StatsResponse(
            blocks=len(self.store.blocks), bytes=self.store.bytes, capacity_bytes=self.store.capacity_bytes,
            hits=s.hits, misses=s.misses, evictions=s.evictions, blocks_pulled=s.blocks_pulled,
            bytes_pulled=s.bytes_pulled, blocks_put=s.blocks_put, blocks_served=s.blocks_served)
