"""Decode servicer: pull the prompt's blocks to this site, import them, decode in the batch.

The site's kvstore pulls what it lacks and holds every needed block under a lease until
the engine has copied it. On the same host the frames are read straight out of the
kvstore's shared arena (ember.kv.shm); otherwise they stream over gRPC. Every frame is
verified (layout, model, checksum) before import; after the copy the lease is released,
and if it had expired the request fails rather than run on bytes that may have changed.
"""
from __future__ import annotations

import time

import grpc

from ember.engine.engine import LLMEngine
from ember.kv import bulk, wire
from ember.kv.shm import ArenaReader
from ember.rpc.convert import sampling_from_pb
from ember.rpc.errors import RpcError, require_ready
from ember.serving.async_engine import AsyncEngine
from ember.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

LEASE_S = 30.0


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, kvstore_channel: grpc.aio.Channel, use_shm: bool = True):
        self.engine: AsyncEngine | None = None  # set once the model is loaded
        self.kvstore_channel = kvstore_channel
        self.kvstore = kvstore_pb2_grpc.KVStoreStub(kvstore_channel)
        self.use_shm = use_shm
        self.arena: ArenaReader | None = None
        self._arena_checked = False
        self.blocks_shared_memory = self.blocks_grpc = 0

    async def _arena(self) -> ArenaReader | None:
        """The local kvstore's arena when it shares this host (asked once)."""
        if self.use_shm and not self._arena_checked:
            stats = await self.kvstore.Stats(kvstore_pb2.StatsRequest(), timeout=5)
            self.arena = ArenaReader.try_open(stats.shm_socket, stats.store_id)
            self._arena_checked = True
        return self.arena

    async def Decode(self, request, context):
        require_ready(self.engine)
        params = sampling_from_pb(request.sampling)
        if params.max_tokens < 2:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens must be >= 2 for decode "
                           "(it counts the first token, which prefill already produced)")
        prompt, hashes = list(request.prompt_token_ids), list(request.block_hashes)
        start = time.perf_counter()
        in_pool = await self.engine.call(lambda e: [h in e.block_manager.cached for h in hashes])
        need = [h for h, cached in zip(hashes, in_pool) if not cached]
        pulled, payloads, lease = kvstore_pb2.PullResponse(), {}, [0]
        if need:
            # only the delta crosses sites: the local store pulls what it lacks from the source
            pulled = await self.kvstore.Pull(kvstore_pb2.PullRequest(block_hashes=need, source=request.source_kvstore,
                                                                     lease_s=LEASE_S),
                                             timeout=context.time_remaining())
            lease[0] = pulled.lease.lease_id
        try:
            if need:
                payloads = await self._verified_payloads(need, pulled.lease, context.time_remaining())

            def import_kv(engine: LLMEngine) -> None:
                engine.import_blocks(prompt, hashes, [payloads.get(h) for h in hashes])
            transfer_s = time.perf_counter() - start
            first = True
            async for out in self.engine.generate(prompt, params, request.request_id, before_add=import_kv,
                                                  output_prefix=[request.first_token]):
                msg = decode_pb2.DecodeResponse(token_ids=out.new_token_ids, text=out.new_text, finished=out.finished,
                                                finish_reason=out.finish_reason or "",
                                                completion_tokens=out.completion_tokens)
                if first:
                    lease_id, lease[0] = lease[0], 0
                    await self._release(lease_id)  # the engine has copied the blocks
                    msg.transfer_s = transfer_s
                    msg.blocks_pulled, msg.bytes_pulled = pulled.blocks_pulled, pulled.bytes_pulled
                    msg.recomputed_tokens = len(prompt) + 1 - out.cached_tokens
                    first = False
                yield msg
        finally:
            await self._release(lease[0], check=False)  # an error or cancel before the copy

    async def _verified_payloads(self, need: list[bytes], lease, timeout: float | None) -> dict[bytes, memoryview]:
        """Raw payloads of the leased blocks, each frame checked against this engine's layout."""
        expect = self.engine.engine.frame_template
        arena = await self._arena()
        frames = {}
        if arena is not None:
            frames = {h: arena.frame(offset, lease.frame_bytes)
                      for h, offset, held in zip(need, lease.offsets, lease.present) if held}
            self.blocks_shared_memory += len(frames)
        else:
            held = [h for h, ok in zip(need, lease.present) if ok]
            async for h, frame in bulk.fetch(self.kvstore_channel, held, timeout=timeout):
                frames[h] = frame
            self.blocks_grpc += len(frames)
        # a damaged or foreign frame raises wire.FrameError: DATA_LOSS / INVALID_ARGUMENT
        return {h: wire.decode_frame(frame, expect, block_hash=h) for h, frame in frames.items()}

    async def _release(self, lease_id: int, check: bool = True) -> None:
        if not lease_id:
            return
        try:
            await self.kvstore.Release(kvstore_pb2.LeaseRequest(lease_id=lease_id), timeout=5)
        except grpc.aio.AioRpcError as e:
            if check and e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise RpcError(grpc.StatusCode.DATA_LOSS, f"KV blocks were not held long enough to copy: "
                               f"{e.details()}; retry the request") from e
            if check:
                raise

    async def Stats(self, request, context):
        require_ready(self.engine)

        def stats(e: LLMEngine):
            bm = e.block_manager
            return decode_pb2.DecodeStatsResponse(running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
                                                  used_blocks=bm.num_used_blocks, total_blocks=bm.num_blocks,
                                                  blocks_shared_memory=self.blocks_shared_memory,
                                                  blocks_grpc=self.blocks_grpc)
        return await self.engine.call(stats)
