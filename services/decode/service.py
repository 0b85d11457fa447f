"""Decode servicer: pull the prompt's blocks to this site, import them, decode in the batch."""
from __future__ import annotations

import time

import grpc

from ember.engine.engine import LLMEngine
from ember.kv import bulk
from ember.rpc.convert import sampling_from_pb
from ember.rpc.errors import RpcError, require_ready
from ember.serving.async_engine import AsyncEngine
from ember.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, kvstore_channel: grpc.aio.Channel):
        self.engine: AsyncEngine | None = None  # set once the model is loaded
        self.kvstore_channel = kvstore_channel
        self.kvstore = kvstore_pb2_grpc.KVStoreStub(kvstore_channel)

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
        payloads, pulled = {}, kvstore_pb2.PullResponse()
        if need:
            # only the delta crosses sites: the local store pulls what it lacks from the source
            pulled = await self.kvstore.Pull(kvstore_pb2.PullRequest(block_hashes=need, source=request.source_kvstore),
                                             timeout=context.time_remaining())
            async for block_hash, payload in bulk.fetch(self.kvstore_channel, need, timeout=context.time_remaining()):
                payloads[block_hash] = payload

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
                msg.transfer_s = transfer_s
                msg.blocks_pulled, msg.bytes_pulled = pulled.blocks_pulled, pulled.bytes_pulled
                msg.recomputed_tokens = len(prompt) + 1 - out.cached_tokens
                first = False
            yield msg

    async def Stats(self, request, context):
        require_ready(self.engine)

        def stats(e: LLMEngine):
            bm = e.block_manager
            return decode_pb2.DecodeStatsResponse(running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
                                                  used_blocks=bm.num_used_blocks, total_blocks=bm.num_blocks)
        return await self.engine.call(stats)
