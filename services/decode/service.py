"""Decode servicer: the prompt's blocks come to this site, then decode joins the batch.

The engine core's KV connector carries out the plan: blocks missing from its pool are
pulled by the site kvstore from the source store (only the delta crosses), held under a
lease, verified and imported, and held in the pool until the request is admitted; the
blocks decode adds are written back to the site store when the request finishes.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from ember.kv.block_hash import chain_hashes
from ember.rpc import metrics, tracing, validate
from ember.rpc.convert import logprobs_to_pb, tenant_of
from ember.rpc.errors import RpcError, require_ready
from ember.rpc.server import remaining
from ember.serving.messages import KVPlan
from ember.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger("ember.decode")
# A cancel arriving this close to the call's deadline is the deadline (the caller's fired first).
DEADLINE_SLACK_S = 0.25


def abort_reason(context) -> str:
    left = context.time_remaining()
    return "deadline" if left is not None and left < DEADLINE_SLACK_S else "cancelled"


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, on_transfer_failure: str = "recompute", recompute_max_tokens: int | None = None):
        self.engine = None  # an EngineClient, set once the model is warm
        self.on_transfer_failure, self.recompute_max_tokens = on_transfer_failure, recompute_max_tokens

    async def Decode(self, request, context):
        require_ready(self.engine)
        tracing.received(context, request.request_id)
        params = validate.decode_request(request, self.engine.info)
        info = self.engine.info
        prompt, wanted = list(request.prompt_token_ids), list(request.block_hashes)
        # what the client has already: nothing (decode-only fallback), the prefill's first token,
        # or everything a failed decode worker streamed before it died (a migrated stream)
        prefix = [] if request.prefill_here else list(request.output_prefix) or [request.first_token]
        bad = next((t for t in prefix if t >= info.vocab_size), None)  # (the engine checks the prompt's)
        if bad is not None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
        if params.max_tokens <= len(prefix):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.max_tokens ({params.max_tokens}) must exceed "
                           f"the {len(prefix)} token(s) already generated (it counts them)")
        salt, shared = request.cache_salt, request.shared_blocks  # the tenant's chain, as the router hashed it
        if wanted != chain_hashes(prompt, info.block_size, info.root_hash, salt=salt,
                                  shared_blocks=shared)[:len(wanted)]:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "block_hashes are not this prompt's leading blocks "
                           "as this decode server hashes them: the model, KV dtype or block size differ")
        # block_hashes: the prompt's leading blocks the source kvstore holds (prefill stored them)
        plan = KVPlan(pull_from=request.source_kvstore, read_through=True, write_back="async",
                      max_blocks=len(wanted) if request.source_kvstore else None,
                      on_kv_failure=self.on_transfer_failure, recompute_max_tokens=self.recompute_max_tokens)
        first, first_at, sent = True, time.perf_counter(), 0
        try:
            async for out in self.engine.generate(prompt, params, request.request_id, plan=plan,
                                                  output_prefix=prefix, timeout_s=remaining(context),
                                                  cache_salt=salt, shared_blocks=shared,
                                                  tenant=tenant_of(request)):
                msg = decode_pb2.DecodeResponse(token_ids=out.new_token_ids, text=out.new_text,
                                                finished=out.finished, finish_reason=out.finish_reason or "",
                                                completion_tokens=out.completion_tokens,
                                                logprobs=logprobs_to_pb(out.logprobs))
                if first:
                    kv = out.kv
                    msg.transfer_s = kv.transfer_s
                    msg.blocks_pulled, msg.bytes_pulled = kv.blocks_pulled, kv.bytes_pulled
                    msg.recomputed_tokens = max(0, len(prompt) + len(prefix) - out.cached_tokens)
                    tracing.annotate(prompt_tokens=len(prompt), blocks_in_pool=kv.blocks_l1,
                                     blocks_imported=kv.blocks_l2, blocks_pulled=kv.blocks_pulled,
                                     bytes_pulled=kv.bytes_pulled, transfer_s=kv.transfer_s,
                                     recomputed_tokens=msg.recomputed_tokens)
                    first, first_at = False, time.perf_counter()
                if out.finished:
                    tracing.annotate(completion_tokens=out.completion_tokens, finish_reason=out.finish_reason,
                                     tpot_s=(time.perf_counter() - first_at) / max(1, out.completion_tokens - 2))
                yield msg
                sent += len(out.new_token_ids)
        except (asyncio.CancelledError, GeneratorExit):
            # the caller went away (cancel, deadline, its own failure): the engine frees the sequence
            reason = abort_reason(context)
            metrics.ABORTED.labels(reason).inc()
            tracing.annotate(aborted=reason, tokens_sent=sent)
            log.info("aborted (%s) after %d tokens", reason, sent)
            raise

    async def Stats(self, request, context):
        require_ready(self.engine)
        s = await self.engine.stats()
        return decode_pb2.DecodeStatsResponse(running=s["running"], waiting=s["waiting"] + s["loading"],
                                              used_blocks=s["used_blocks"], total_blocks=s["total_blocks"],
                                              blocks_shared_memory=s["blocks_shared_memory"],
                                              blocks_grpc=s["blocks_grpc"])
