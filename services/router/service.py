"""Router servicer: the public API. Tokenize, place, prefill, stream the first token at
once, then relay decode's stream; the last message carries usage, timings, placement."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import grpc

from ember.kv.block_hash import chain_hashes
from ember.kv.directory import BlockDirectory
from ember.model.tokenizer import Tokenizer
from ember.placement.policy import Load, NoCapacity, Placer, Request
from ember.rpc import logs, metrics, tracing
from ember.rpc.convert import sampling_from_pb, sampling_to_pb
from ember.rpc.errors import RpcError
from ember.services.router.stubs import SiteStubs
from ember.v1 import common_pb2, decode_pb2, prefill_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger("ember.router")
DIRECTORY_TIMEOUT_S = 0.5
DIRECTORY_RETRY_S = 1.0


def invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, tokenizer: Tokenizer, model_id: str, max_model_len: int, vocab_size: int,
                 placer: Placer, stubs: SiteStubs, block_size: int, root_hash: bytes, directory: BlockDirectory):
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.placer, self.stubs = placer, stubs
        self.load = Load()  # this router's view: prefill work in flight, decodes running, per site
        self.block_size, self.root_hash = block_size, root_hash
        self.directory, self.sites = directory, [s.name for s in placer.config.sites]
        self._directory_retry_at = 0.0  # after a failure, skip the directory for a while

    async def _cached_blocks(self, hashes: list[bytes]) -> dict[str, int]:
        """Leading prompt blocks held per site, in one directory round trip; {} when the
        directory is down (a hint only: the request goes on and recomputes what it must)."""
        if not hashes or time.monotonic() < self._directory_retry_at:
            return {}
        try:
            return await asyncio.wait_for(self.directory.lookup(hashes, self.sites), DIRECTORY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any directory failure degrades to "nothing cached"
            if not self._directory_retry_at:
                log.warning("block directory unreachable (%s: %s); placing without it", type(e).__name__, e)
            self._directory_retry_at = time.monotonic() + DIRECTORY_RETRY_S
            return {}

    async def ListModels(self, request, context):
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(id=self.model_id,
                                                                          context_length=self.max_model_len)])

    def _prompt(self, request) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "text":
            ids = self.tokenizer.encode(request.text)
        elif kind == "chat":
            if not request.chat.messages:
                raise invalid("chat.messages is empty")
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            extra = {}
            if request.chat.tools_json:
                try:
                    extra["tools"] = json.loads(request.chat.tools_json)
                except ValueError as e:
                    raise invalid(f"chat.tools_json is not JSON: {e}") from e
            try:
                ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, **extra))
            except ValueError as e:
                raise invalid(f"chat: {e}") from e
        elif kind == "tokens":
            ids = list(request.tokens.token_ids)
            if any(t >= self.vocab_size for t in ids):
                raise invalid(f"tokens.token_ids must be < vocab size {self.vocab_size}")
        else:
            raise invalid("input is required: set text, chat or tokens")
        if not ids:
            raise invalid(f"input ({kind}) is empty")
        return ids

    async def Generate(self, request, context):
        received = time.perf_counter()
        if request.model and request.model != self.model_id:
            raise invalid(f"model {request.model!r} is not served here; use {self.model_id!r} (see ListModels)")
        try:
            params = sampling_from_pb(request.sampling)
        except ValueError as e:
            raise invalid(f"sampling: {e}") from e
        prompt = self._prompt(request)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise invalid(f"input ({len(prompt)} tokens) + sampling.max_tokens ({params.max_tokens}) exceeds the "
                          f"context length {self.max_model_len}")
        request_id = request.request_id or uuid.uuid4().hex
        logs.request_id.set(request_id)
        pb_params = sampling_to_pb(params)

        # content addresses of the prompt's full blocks, where they are cached already, and placement
        hashes = chain_hashes(prompt, self.block_size, self.root_hash)
        looked_up = time.perf_counter()
        cached = await self._cached_blocks(hashes)
        directory_s = time.perf_counter() - looked_up
        with tracing.tracer.start_as_current_span("placement"):
            try:
                decision = self.placer.place(Request(len(prompt), params.max_tokens, request.user_region or None,
                                                     cached, request.session_id), self.load)
            except NoCapacity as e:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
            est = decision.estimate
            tracing.annotate(prefill_site=decision.prefill_site, decode_site=decision.decode_site,
                             reason=decision.reason, estimated_queue_s=est.queue_s, estimated_prefill_s=est.prefill_s,
                             estimated_link_s=est.link_s, uncached_tokens=est.uncached_tokens,
                             cached_blocks=json.dumps(cached), directory_s=directory_s)
        tracing.annotate(request_id=request_id, prompt_tokens=len(prompt), user_region=request.user_region)
        log.info("%s: %s", request_id, decision.summary())
        placement = common_pb2.Placement(
            prefill_site=decision.prefill_site, decode_site=decision.decode_site, cached_blocks=cached,
            directory_s=directory_s, reason=decision.reason, estimated_queue_s=est.queue_s,
            estimated_prefill_s=est.prefill_s, estimated_link_s=est.link_s, uncached_tokens=est.uncached_tokens)
        queue = self.load.prefill_queue_s
        queue[decision.prefill_site] = queue.get(decision.prefill_site, 0.0) + est.prefill_s
        try:
            pre = await self.stubs.prefill(decision.prefill_site).Prefill(
                prefill_pb2.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=pb_params,
                                           block_hashes=hashes), timeout=context.time_remaining())
        finally:
            queue[decision.prefill_site] = max(0.0, queue[decision.prefill_site] - est.prefill_s)
        first_at = time.perf_counter()
        metrics.TTFT.observe(first_at - received)
        metrics.PROMPT_TOKENS.inc(len(prompt))
        metrics.PLACEMENTS.labels(decision.prefill_site, decision.decode_site).inc()
        usage = common_pb2.Usage(prompt_tokens=len(prompt), cached_tokens=pre.cached_tokens, completion_tokens=1)
        timings = common_pb2.Timings(ttft_s=first_at - received, prefill_s=first_at - received)
        first = router_pb2.GenerateResponse(request_id=request_id, token_ids=[pre.first_token], text=pre.first_text)
        if pre.finished:
            timings.e2e_s = timings.ttft_s
            metrics.E2E.observe(timings.e2e_s)
            metrics.GENERATION_TOKENS.inc(1)
            metrics.REQUEST_SUCCESS.labels(pre.finish_reason).inc()
            first.MergeFrom(router_pb2.GenerateResponse(finished=True, finish_reason=pre.finish_reason, usage=usage,
                                                        timings=timings, placement=placement))
            yield first
            return
        yield first  # the client sees the first token before decode starts

        running = self.load.decode_running
        running[decision.decode_site] = running.get(decision.decode_site, 0) + 1
        stream = self.stubs.decode(decision.decode_site).Decode(decode_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt, first_token=pre.first_token,
            block_hashes=pre.block_hashes, source_kvstore=pre.kvstore_address, sampling=pb_params),
            timeout=context.time_remaining())
        try:
            last = first_at
            async for d in stream:
                now = time.perf_counter()
                if d.token_ids:
                    metrics.INTER_TOKEN.observe(now - last)
                    last = now
                if d.transfer_s:
                    timings.transfer_s = d.transfer_s
                msg = router_pb2.GenerateResponse(request_id=request_id, token_ids=d.token_ids, text=d.text)
                if d.finished:
                    done = time.perf_counter()
                    usage.completion_tokens = d.completion_tokens
                    timings.decode_s = done - first_at
                    timings.e2e_s = done - received
                    timings.tpot_s = timings.decode_s / max(1, d.completion_tokens - 1)
                    tracing.annotate(completion_tokens=d.completion_tokens, cached_tokens=usage.cached_tokens,
                                     ttft_s=timings.ttft_s, tpot_s=timings.tpot_s, finish_reason=d.finish_reason)
                    metrics.TPOT.observe(timings.tpot_s)
                    metrics.E2E.observe(timings.e2e_s)
                    metrics.GENERATION_TOKENS.inc(d.completion_tokens)
                    metrics.REQUEST_SUCCESS.labels(d.finish_reason).inc()
                    msg.MergeFrom(router_pb2.GenerateResponse(finished=True, finish_reason=d.finish_reason, usage=usage,
                                                              timings=timings, placement=placement))
                yield msg
        finally:
            # A client cancel or deadline cancels this handler; cancel the decode call
            # explicitly too, so decode frees the sequence now rather than whenever the
            # call object is collected.
            stream.cancel()
            running[decision.decode_site] -= 1
