"""Prefill servicer: compute the uncached part of a prompt, leave its new full blocks in the
site's kvstore, return the first token.

The engine core carries out the KV plan: prompt blocks missing from its pool are read from
the site kvstore first (a follow-up turn placed here after decode pulled the conversation's
KV to this site is imported, not recomputed), and the blocks the store lacks are written
to it before the answer comes back (decode is about to pull them).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc

from ember.engine.detokenizer import streamed_text
from ember.kv.block_hash import chain_hashes
from ember.rpc import tracing, validate
from ember.rpc.convert import logprobs_to_pb, tenant_of
from ember.rpc.errors import RpcError, require_ready
from ember.rpc.server import remaining
from ember.serving.messages import KVPlan
from ember.v1 import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("ember.prefill")


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, site: str, kvstore_address: str, tokenizer, on_transfer_failure: str = "recompute",
                 recompute_max_tokens: int | None = None, stream_targets: frozenset[str] = frozenset()):
        """`stream_targets`: the other sites' kvstores, the only places a request may stream its KV to."""
        self.stream_targets = stream_targets
        self.engine = None  # an EngineClient, set once the model is warm
        self.plan = KVPlan(read_through=True, write_back="sync", on_kv_failure=on_transfer_failure,
                           recompute_max_tokens=recompute_max_tokens)
        self.site = site
        self.kvstore_address = kvstore_address
        self.tokenizer = tokenizer

    async def Prefill(self, request, context):
        require_ready(self.engine)
        tracing.received(context, request.request_id)
        params = validate.prefill_request(request, self.engine.info)
        prompt = list(request.token_ids)
        info = self.engine.info
        salt, shared = request.cache_salt, request.shared_blocks  # the tenant's chain, as the router hashed it
        hashes = chain_hashes(prompt, info.block_size, info.root_hash, salt=salt, shared_blocks=shared)
        if request.block_hashes and list(request.block_hashes) != hashes:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "the router's block hashes differ from this "
                           "prefill server's: they disagree on the model, KV dtype or block size")
        plan = self.plan
        if request.stream_to and request.stream_to != self.kvstore_address:
            validate.address(request.stream_to, "stream_to")
            if request.stream_to not in self.stream_targets:  # never dial an address a caller names
                raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                               f"stream_to {request.stream_to!r} is not a kvstore of this cluster's config")
            plan = replace(plan, stream_to=request.stream_to)
        final = None
        try:
            async for out in self.engine.generate(prompt, replace(params, max_tokens=1), request.request_id,
                                                  plan=plan, timeout_s=remaining(context), cache_salt=salt,
                                                  shared_blocks=shared, tenant=tenant_of(request)):
                final = out
        except (asyncio.CancelledError, GeneratorExit):
            left = context.time_remaining()  # the engine drops the request (queued or running)
            reason = "deadline" if left is not None and left < 0.25 else "cancelled"
            tracing.annotate(aborted=reason)
            log.info("aborted (%s) before the first token", reason)
            raise
        kv = final.kv
        tracing.annotate(site=self.site, prompt_tokens=len(prompt), tokens_cached=final.cached_tokens,
                         tokens_computed=len(prompt) - final.cached_tokens, blocks_imported=kv.blocks_l2,
                         blocks_stored=kv.blocks_stored)
        finished = final.finish_reason == "stop" or params.max_tokens == 1
        # Decoding continues elsewhere: send only the text a running stream would have sent
        # (no half character, no possible stop-string start); decode picks up from there.
        first_text = final.new_text if finished else streamed_text(final.new_token_ids, params,
                                                                    self.tokenizer.decode)
        return prefill_pb2.PrefillResponse(
            first_token=final.new_token_ids[0], block_hashes=hashes, kvstore_address=self.kvstore_address,
            site=self.site, cached_tokens=final.cached_tokens, computed_tokens=len(prompt) - final.cached_tokens,
            first_text=first_text, finished=finished,
            finish_reason=final.finish_reason if finished else "", blocks_stored=kv.blocks_stored,
            first_logprob=logprobs_to_pb(final.logprobs)[0] if final.logprobs else None)
