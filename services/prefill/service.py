"""Prefill servicer: compute the uncached part of a prompt, ship new full blocks to the
site's kvstore, return the first token."""
from __future__ import annotations

from dataclasses import replace

import grpc

from ember.engine.detokenizer import streamed_text
from ember.engine.engine import LLMEngine, RequestOutput
from ember.kv import bulk
from ember.kv.block_hash import chain_hashes
from ember.rpc import metrics, tracing
from ember.rpc.convert import sampling_from_pb
from ember.rpc.errors import RpcError, require_ready
from ember.rpc.site_kv import SiteKV
from ember.serving.async_engine import AsyncEngine
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc, prefill_pb2, prefill_pb2_grpc


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, site: str, kvstore_address: str, kvstore_channel: grpc.aio.Channel):
        self.engine: AsyncEngine | None = None  # set once the model is loaded
        self.site = site
        self.kvstore_address = kvstore_address
        self.kvstore_channel = kvstore_channel
        self.kvstore = kvstore_pb2_grpc.KVStoreStub(kvstore_channel)
        self.kv = SiteKV(kvstore_channel)

    async def Prefill(self, request, context):
        require_ready(self.engine)
        params = sampling_from_pb(request.sampling)
        prompt = list(request.token_ids)
        engine = self.engine.engine
        hashes = chain_hashes(prompt, engine.config.block_size, engine.block_manager.root_hash)
        if request.block_hashes and list(request.block_hashes) != hashes:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "the router's block hashes differ from this "
                           "prefill server's: they disagree on the model, KV dtype or block size")
        present = await self.kvstore.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes),
                                            timeout=context.time_remaining())
        missing = {h for h, p in zip(hashes, present.present) if not p}
        exported: list[tuple[bytes, bytes]] = []
        # Blocks this site's kvstore holds but the engine does not (a follow-up turn placed
        # here after decode pulled the conversation's KV to this site): import, don't recompute.
        in_pool = await self.engine.call(lambda e: [h in e.block_manager.cached for h in hashes])
        reuse = []
        for h, stored_here, pooled in zip(hashes, present.present, in_pool):
            if not pooled:
                if not stored_here:
                    break
                reuse.append(h)
        lease_id, payloads = 0, {}
        if reuse:
            lease = await self.kv.acquire(reuse, context.time_remaining())
            lease_id = lease.lease_id
        try:
            if reuse:
                payloads = await self.kv.payloads(reuse, lease, engine.frame_template, context.time_remaining())
            final = await self._prefill(prompt, params, hashes, payloads, missing, exported, request.request_id)
        finally:
            await self.kv.release(lease_id, check=False)

        stored = 0
        if exported:
            # raw-bytes gRPC: ~3x the typed Put (protobuf copies every bytes field)
            stored, _ = await bulk.put(self.kvstore_channel, exported, timeout=context.time_remaining())
        metrics.PREFIX_QUERIES.inc(len(prompt))
        metrics.PREFIX_HITS.inc(final.cached_tokens)
        tracing.annotate(site=self.site, prompt_tokens=len(prompt), tokens_cached=final.cached_tokens,
                         tokens_computed=len(prompt) - final.cached_tokens, blocks_imported=len(payloads),
                         blocks_stored=stored)
        finished = final.finish_reason == "stop" or params.max_tokens == 1
        # Decoding continues elsewhere: send only the text a running stream would have sent
        # (no half character, no possible stop-string start); decode picks up from there.
        first_text = final.new_text if finished else streamed_text(final.new_token_ids, params,
                                                                    engine.tokenizer.decode)
        return prefill_pb2.PrefillResponse(
            first_token=final.new_token_ids[0], block_hashes=hashes, kvstore_address=self.kvstore_address,
            site=self.site, cached_tokens=final.cached_tokens, computed_tokens=len(prompt) - final.cached_tokens,
            first_text=first_text, finished=finished,
            finish_reason=final.finish_reason if finished else "", blocks_stored=stored)

    async def _prefill(self, prompt, params, hashes, payloads, missing, exported, request_id) -> RequestOutput:
        def import_kv(engine: LLMEngine) -> None:
            if payloads:
                engine.import_blocks(prompt, hashes, [payloads.get(h) for h in hashes])

        def export(engine: LLMEngine, out: RequestOutput) -> None:
            # On the engine thread right after the last step: no later step can have
            # evicted these blocks yet. Only blocks the kvstore lacks are copied out.
            wanted = [h for h in out.block_hashes if h in missing]
            exported.extend(zip(wanted, engine.export_frames(wanted)))

        final = None
        async for out in self.engine.generate(prompt, replace(params, max_tokens=1), request_id,
                                              before_add=import_kv, on_finish=export):
            final = out
        return final
