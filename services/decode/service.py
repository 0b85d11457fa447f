"""Decode servicer: pull the prompt's blocks to this site, import them, decode in the batch.

The site's kvstore pulls what it lacks and holds every needed block under a lease until
the engine has copied it (ember.rpc.site_kv: shared memory on the same host, gRPC
otherwise, every frame verified); then the lease is released.
"""
from __future__ import annotations

import time

import grpc

from ember.engine.engine import LLMEngine
from ember.rpc import metrics, tracing
from ember.rpc.convert import sampling_from_pb
from ember.rpc.errors import RpcError, require_ready
from ember.rpc.site_kv import SiteKV
from ember.serving.async_engine import AsyncEngine
from ember.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, kvstore_channel: grpc.aio.Channel, use_shm: bool = True):
        self.engine: AsyncEngine | None = None  # set once the model is loaded
        self.kv = SiteKV(kvstore_channel, use_shm)

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
            pulled = await self.kv.pull(need, request.source_kvstore, context.time_remaining())
            lease[0] = pulled.lease.lease_id
        try:
            if need:
                payloads = await self.kv.payloads(need, pulled.lease, self.engine.engine.frame_template,
                                                  context.time_remaining())

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
                    await self.kv.release(lease_id)  # the engine has copied the blocks
                    msg.transfer_s = transfer_s
                    msg.blocks_pulled, msg.bytes_pulled = pulled.blocks_pulled, pulled.bytes_pulled
                    msg.recomputed_tokens = len(prompt) + 1 - out.cached_tokens
                    metrics.PREFIX_QUERIES.inc(len(prompt) + 1)
                    metrics.PREFIX_HITS.inc(out.cached_tokens)
                    tracing.annotate(prompt_tokens=len(prompt), blocks_needed=len(need),
                                     blocks_pulled=pulled.blocks_pulled, bytes_pulled=pulled.bytes_pulled,
                                     transfer_s=transfer_s, recomputed_tokens=msg.recomputed_tokens)
                    first = False
                    first_at = time.perf_counter()
                if out.finished:
                    tracing.annotate(completion_tokens=out.completion_tokens, finish_reason=out.finish_reason,
                                     tpot_s=(time.perf_counter() - first_at) / max(1, out.completion_tokens - 2))
                yield msg
        finally:
            await self.kv.release(lease[0], check=False)  # an error or cancel before the copy

    async def Stats(self, request, context):
        require_ready(self.engine)

        def stats(e: LLMEngine):
            bm = e.block_manager
            return decode_pb2.DecodeStatsResponse(running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
                                                  used_blocks=bm.num_used_blocks, total_blocks=bm.num_blocks,
                                                  blocks_shared_memory=self.kv.blocks_shared_memory,
                                                  blocks_grpc=self.kv.blocks_grpc)
        return await self.engine.call(stats)
