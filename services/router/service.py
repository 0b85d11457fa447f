"""Router servicer: the public API. Admit, tokenize, place, prefill, stream the first token at
once, then relay decode's stream; the last message carries usage, timings, placement.

Recovery (ember.services.router.workers keeps who is live): a prefill worker that fails is
replaced by another live one at its site, else the decode worker prefills itself (decode-only
fallback); a decode stream that breaks moves to another live decode worker with the tokens
already sent as its output prefix and the same seed (fixed here when the client gave none), so
it continues token for token; the client sees neither the failure nor a duplicate. Admission
is bounded and fair across tenants (services/router/admission.py): past its tenant's share of
`router.max_inflight`, or over one of its tenant's quotas, a request is refused at once with
RESOURCE_EXHAUSTED and `grpc-retry-pushback-ms` (HTTP 429 and Retry-After).

With API keys configured (services/router/auth.py) every call names a key (`authorization:
Bearer KEY`), else UNAUTHENTICATED; the key's tenant picks the request's hash chain
(services/router/tenants.py), so the directory lookups, placement and the cached counts a
response shows are the tenant's own."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
import uuid

import grpc
from jinja2.exceptions import TemplateError, TemplateSyntaxError

from ember.engine import constraints
from ember.engine.sampling_params import Constraint
from ember.errors import InvalidRequestError
from ember.kv.block_hash import chain_hashes
from ember.kv.directory import BlockDirectory
from ember.model.tokenizer import Tokenizer
from ember.placement.policy import Load, NoCapacity, Placer, Request
from ember.rpc import logs, metrics, tracing, validate
from ember.rpc.convert import sampling_from_pb, sampling_to_pb
from ember.rpc.errors import DOWNSTREAM, RpcError, public_error, refuse
from ember.rpc.server import remaining
from ember.services.router import tenants, tools
from ember.services.router.admission import Admission, Throttled
from ember.services.router.auth import ANONYMOUS, Authenticated, KeyTable
from ember.services.router.tenants import SharedPrefixes
from ember.services.router.workers import Worker, WorkerPool
from ember.v1 import common_pb2, decode_pb2, prefill_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger("ember.router")
DIRECTORY_TIMEOUT_S = 0.5
DIRECTORY_RETRY_S = 1.0
TOOL_CHOICES = ("auto", "none", "required", "function")  # ChatInput.tool_choice
INLINE_TOKENIZE_CHARS = 8192  # shorter texts are tokenized on the event loop (< 1 ms)


def invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def text_cap(tokenizer: Tokenizer, max_model_len: int, limit: int | None = None) -> tuple[int, str]:
    """The most UTF-8 bytes of text a request may carry, and why: no more than could still fit the
    context (max_model_len tokens of the vocabulary's longest token; a normalizer could shrink text,
    so then only the fixed cap), never more than validate.MAX_TEXT_BYTES or `limit`."""
    cap, reason = limit or validate.MAX_TEXT_BYTES, "the router's text limit"
    if tokenizer.backend.normalizer is None:
        texts = tokenizer.backend.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False)
        longest = max(len(t.encode()) for t in texts) + 4  # (+4: a decoder may drop a leading space)
        if max_model_len * longest < cap:
            cap = max_model_len * longest
            reason = f"more cannot fit the context of {max_model_len} tokens of at most {longest} bytes"
    return cap, reason


def _json_list(text: str, field: str) -> list[dict]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise invalid(f"{field} is not JSON: {e}") from e
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise invalid(f"{field} must be a JSON list of objects")
    return value


def _tool_view(msg, parser):
    """`msg` as the client sees it when tools may be called: tool-call text moves out of `text` into
    `tool_calls` deltas; the last message says finish_reason "tool_calls" when a call was made."""
    if parser is None:
        return msg
    content, deltas = parser.feed(msg.text)
    if msg.finished:
        tail, more = parser.finish()
        content, deltas = content + tail, deltas + more
        if parser.calls and msg.finish_reason == "stop":
            msg.finish_reason = "tool_calls"
    msg.text = content
    msg.tool_calls.extend(router_pb2.ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments)
                          for d in deltas)
    return msg


def unavailable(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, message)


class StreamStalled(Exception):
    """A decode stream sent nothing for router.stall_timeout_s: its worker (or the link to it) is
    treated as failed, like a broken stream."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)


async def _messages(stream, stall_timeout_s: float, answers=None):
    """The stream's messages; StreamStalled when, after the first, none arrives within
    `stall_timeout_s` (the first may wait in the worker's queue or on a prefill: the deadline
    bounds that) and the worker does not answer `answers()` either (its health check). A worker
    that answers is slow, not gone (a saturated host, a step prefilling other streams' migrated
    contexts): the stream waits on, and only the request's deadline bounds it."""
    it, first = stream.__aiter__(), True
    while True:
        nxt = asyncio.ensure_future(it.__anext__())  # waited on, never cancelled by a timeout
        try:
            while not (await asyncio.wait({nxt}, timeout=None if first else stall_timeout_s))[0]:
                if answers is None or not await answers():
                    raise StreamStalled(f"no message for {stall_timeout_s:g} s and no answer to its health check")
                log.warning("a decode stream sent nothing for %g s; its worker answers its health check: "
                            "waiting on", stall_timeout_s)
        except BaseException:
            nxt.cancel()
            raise
        try:
            message = nxt.result()
        except StopAsyncIteration:
            return
        first = False
        yield message


def worker_failed(e: grpc.aio.AioRpcError) -> bool:
    """A call failure that says the worker (or its engine) is gone, not that the request is bad."""
    return e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


@dataclasses.dataclass
class _Bill:
    """A request's tokens against its tenant's tokens/min quota: charged prompt + max_tokens at
    admission, what it did not generate given back when it ends."""
    charged: int = 0
    prompt: int = 0
    generated: int = 0

    def unused(self) -> int:
        return max(0, self.charged - self.prompt - self.generated) if self.charged else 0


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, tokenizer: Tokenizer, model_id: str, max_model_len: int, vocab_size: int,
                 placer: Placer, workers: WorkerPool, block_size: int, root_hash: bytes, directory: BlockDirectory,
                 max_inflight: int = 256, max_migrations: int = 2, retry_after_s: float = 1.0,
                 stall_timeout_s: float = 30.0, max_text_bytes: int | None = None, keys: KeyTable | None = None,
                 shared_prefixes: SharedPrefixes | None = None):
        self.tokenizer = tokenizer
        self.keys = keys or KeyTable()  # none: nobody is asked for a key
        self.admission = Admission(max_inflight, self.keys.policies, retry_after_s=retry_after_s)
        self.shared_prefixes = shared_prefixes
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.placer, self.workers = placer, workers
        self.max_inflight, self.max_migrations, self.retry_after_s = max_inflight, max_migrations, retry_after_s
        self.stall_timeout_s = stall_timeout_s
        self.load = Load()  # this router's view: prefill work in flight, decodes running, per site
        self.block_size, self.root_hash = block_size, root_hash
        self.directory, self.sites = directory, [s.name for s in placer.config.sites]
        # where a remote prefill streams its KV (kvstore.stream_prefill): the decode site's kvstore, when
        # the links table has a link between the two sites (a WAN: on one host the move is a memcpy
        # away and streaming would only take the prefill's cores)
        config = placer.config
        stores = {s.name: s.kvstore for s in config.sites if s.has("kvstore")}
        self.stream_targets = {(link.a, link.b): stores[link.b] for link in config.links if link.b in stores} | \
            {(link.b, link.a): stores[link.a] for link in config.links if link.a in stores} \
            if config.kvstore.stream_prefill else {}
        self._directory_retry_at = 0.0  # after a failure, skip the directory for a while
        self.max_text_bytes, self.text_cap_reason = text_cap(tokenizer, max_model_len, max_text_bytes)

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

    async def _authenticate(self, context) -> str:
        """The caller's tenant from its `authorization` metadata; UNAUTHENTICATED when keys are
        configured and it names none of them. An in-process edge that checked the key itself (the
        HTTP API) hands over an `Authenticated` context."""
        if isinstance(context, Authenticated):
            return context.tenant
        if not self.keys.enabled:
            return ANONYMOUS
        header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
        tenant = self.keys.check_authorization(header)
        if tenant is None:
            log.info("unauthenticated call from %s: %s", context.peer(),
                     "no API key" if header is None else "not a configured API key")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required: send the metadata "
                                "`authorization: Bearer KEY`" if header is None else "invalid API key")
        return tenant

    async def ListModels(self, request, context):
        await self._authenticate(context)
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelInfo(id=self.model_id,
                                                                          context_length=self.max_model_len)])

    async def _encode(self, text: str) -> list[int]:
        """Token ids of `text`; a long text is tokenized off the event loop, so running streams
        are not stalled (`encode_batch` releases the GIL, `encode` does not)."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text)
        backend = self.tokenizer.backend  # Tokenizer.encode: add_special_tokens=False
        return await asyncio.to_thread(lambda: backend.encode_batch([text], add_special_tokens=False)[0].ids)

    async def _prompt(self, request) -> tuple[list[int], str | None]:
        """The prompt's token ids, and the grammar its answer must follow when the request offers
        tools that may be called (services/router/tools.py), else None."""
        kind = request.WhichOneof("input")
        cap = self.max_text_bytes
        grammar = None
        if kind == "text":
            validate.text_size(request.text, "text", cap, self.text_cap_reason)  # before any tokenizing
            ids = await self._encode(request.text)
        elif kind == "chat":
            text, grammar = await self._render_chat(request.chat)
            ids = await self._encode(text)
        elif kind == "tokens":
            ids = validate.token_ids(request.tokens.token_ids, self.vocab_size, "tokens.token_ids", self.max_model_len)
        else:
            raise invalid("input is required: set text, chat or tokens")
        if not ids:
            raise invalid(f"input ({kind}) is empty")
        return ids, grammar

    async def _render_chat(self, chat) -> tuple[str, str | None]:
        """The chat as the model's template renders it (tools in the template, or in the system prompt
        when the template knows none), and the tool-call grammar (None: no tool may be called)."""
        cap = self.max_text_bytes
        if not chat.messages:
            raise invalid("chat.messages is empty")
        validate.count(chat.messages, "chat.messages", validate.MAX_CHAT_MESSAGES)
        chars = sum(len(m.content) + len(m.tool_calls_json) for m in chat.messages)
        size = chars if chars > cap else sum(validate.utf8_bytes(m.content) + validate.utf8_bytes(m.tool_calls_json)
                                             for m in chat.messages)
        if size > cap:
            raise invalid(f"chat.messages hold {size} bytes of content or more; at most {cap} bytes are "
                          f"accepted ({self.text_cap_reason})")
        messages = []
        for i, m in enumerate(chat.messages):
            validate.name(m.role, f"chat.messages[{i}].role")
            validate.name(m.tool_call_id, f"chat.messages[{i}].tool_call_id")
            validate.name(m.name, f"chat.messages[{i}].name")
            message = {"role": m.role, "content": m.content}
            if m.tool_calls_json:
                message["tool_calls"] = _json_list(m.tool_calls_json, f"chat.messages[{i}].tool_calls_json")
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            if m.name:
                message["name"] = m.name
            messages.append(message)
        offered = None
        if chat.tools_json:
            validate.text_size(chat.tools_json, "chat.tools_json", cap, self.text_cap_reason)
            offered = _json_list(chat.tools_json, "chat.tools_json")
        choice = chat.tool_choice or ("auto" if offered else "none")
        if choice not in TOOL_CHOICES:
            raise invalid(f"chat.tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {choice!r}")
        if choice != "none" and not offered:
            raise invalid(f"chat.tool_choice is {choice!r} but chat.tools_json offers no tool")
        if choice == "none":
            offered = None  # not shown to the model: it could not call them
        if not self.tokenizer.chat_template:  # (the Tokenizer renders nothing then)
            raise invalid("chat: this model has no chat template; send text instead")
        knows = tools.template_knows_tools(self.tokenizer.chat_template)
        try:  # the client's tools and messages: tools.py raises InvalidRequestError for what is malformed
            names = [tools.function_of(t)["name"] for t in offered or ()]
            if choice == "function" and chat.tool_choice_name not in names:
                raise invalid(f"chat.tool_choice_name {chat.tool_choice_name!r} is none of the tools offered")
            messages, extra = tools.render(messages, offered, knows)
            grammar = None if offered is None else tools.grammar(
                offered, choice, chat.tool_choice_name or None,
                chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True)
        except InvalidRequestError as e:
            raise invalid(f"chat: {e}") from e
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, **extra)
        except TemplateSyntaxError:  # the model's template itself is broken: not the client's fault
            raise
        except TemplateError as e:
            # the template refused these messages (its raise_exception: roles that do not alternate,
            # a role it does not know, ...) or read a field they lack. Anything else escaping the
            # template (ValueError, TypeError, KeyError, ...) is a bug in what the router built:
            # INTERNAL, its traceback logged, never the client's 400.
            raise invalid(f"chat: the model's chat template refused these messages: {e}") from e
        return text, grammar

    @property
    def inflight(self) -> int:
        """Admitted requests not finished yet (counted at admission: a burst cannot slip past)."""
        return self.admission.inflight

    async def Generate(self, request, context):
        tenant = await self._authenticate(context)  # before anything else, admission included
        try:
            self.admission.admit(tenant)
        except Throttled as e:
            self._throttled(context, tenant, e)
            return
        metrics.TENANT_REQUESTS.labels(tenant or "-").inc()
        bill = _Bill()
        try:
            async for msg in self._generate(request, context, tenant, bill):
                bill.generated += len(msg.token_ids)
                yield msg
        except Throttled as e:  # its tokens/min quota, charged once its prompt is known (before any output)
            self._throttled(context, tenant, e)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure leaves as the router's own public error
            public = self._public_error(e)
            if public is e:
                raise
            raise public from e
        finally:
            self.admission.refund(tenant, bill.unused())
            self.admission.release(tenant)

    def _public_error(self, e: Exception) -> RpcError:
        """`e` as this router's public error (ember.rpc.errors.public_error): a downstream status
        and text stay here, in the log (an internal authorization failure at ERROR: an operator must
        fix it), never in the answer."""
        request_id = logs.request_id.get()
        if isinstance(e, (grpc.aio.AioRpcError, StreamStalled)):
            code = e.code()
            level = logging.ERROR if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) \
                else logging.WARNING
            log.log(level, "%s: a downstream call failed with %s: %s", request_id or "-", code.name, e.details())
            if isinstance(e, StreamStalled):
                return unavailable(DOWNSTREAM[grpc.StatusCode.UNAVAILABLE][1])
        return public_error(e, self.retry_after_s, request_id)

    def _throttled(self, context, tenant: str, e: Throttled) -> None:
        metrics.REJECTED.inc()
        metrics.TENANT_THROTTLED.labels(tenant or "-", e.reason).inc()
        refuse(context, RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), retry_after_s=e.retry_after_s))

    async def _generate(self, request, context, tenant: str, bill: _Bill):
        received = time.perf_counter()
        for field in ("request_id", "model", "user_region", "session_id", "cache_salt", "user"):
            validate.name(getattr(request, field), field)
        if request.model and request.model != self.model_id:
            raise RpcError(grpc.StatusCode.NOT_FOUND,
                           f"model {request.model!r} is not served here; use {self.model_id!r} (see ListModels)")
        params = sampling_from_pb(request.sampling, self.vocab_size, self.max_model_len)  # caps: ember.rpc.validate
        if params.seed is None:  # fixed here, so a migrated or failed-over stream samples the same tokens
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        prompt, tool_grammar = await self._prompt(request)
        parser = None
        if tool_grammar is not None:  # the answer is a tool call (or, with "auto", maybe text)
            if params.constraint is not None:
                raise invalid("sampling.constraint (response_format) and callable tools exclude each other: "
                              "set tool_choice to none, or drop the constraint")
            params = dataclasses.replace(params, constraint=Constraint("lark", tool_grammar))
            parser = tools.ToolCallParser()
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise invalid(f"input ({len(prompt)} tokens) + sampling.max_tokens ({params.max_tokens}) exceeds the "
                          f"context length {self.max_model_len}")
        self.admission.charge(tenant, len(prompt) + params.max_tokens)  # its tokens/min quota (Throttled)
        bill.charged, bill.prompt = len(prompt) + params.max_tokens, len(prompt)
        if params.constraint is not None:  # a bad grammar is refused before any work is placed (a big
            await asyncio.to_thread(constraints.check, params.constraint)  # one takes a while: off the loop)
        request_id = request.request_id or uuid.uuid4().hex
        logs.request_id.set(request_id)
        pb_params = sampling_to_pb(params)

        # content addresses of the prompt's full blocks (on its tenant's chain), where they are cached
        # already, and placement
        salt, shared = tenants.chain(tenant, request.cache_salt, prompt, self.shared_prefixes)
        hashes = chain_hashes(prompt, self.block_size, self.root_hash, salt=salt, shared_blocks=shared)
        looked_up = time.perf_counter()
        cached = await self._cached_blocks(hashes)
        directory_s = time.perf_counter() - looked_up
        with tracing.tracer.start_as_current_span("placement"):
            try:
                decision = self.placer.place(Request(len(prompt), params.max_tokens, request.user_region or None,
                                                     cached, request.session_id), self.load)
            except NoCapacity as e:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), retry_after_s=self.retry_after_s) from e
            est = decision.estimate
            tracing.annotate(prefill_site=decision.prefill_site, decode_site=decision.decode_site,
                             reason=decision.reason, estimated_queue_s=est.queue_s, estimated_prefill_s=est.prefill_s,
                             estimated_link_s=est.link_s, uncached_tokens=est.uncached_tokens,
                             cached_blocks=json.dumps(cached), directory_s=directory_s)
        tracing.annotate(request_id=request_id, prompt_tokens=len(prompt), user_region=request.user_region,
                         tenant=tenant, shared_blocks=shared, user=request.user)
        placement = common_pb2.Placement(
            prefill_site=decision.prefill_site, decode_site=decision.decode_site, cached_blocks=cached,
            directory_s=directory_s, reason=decision.reason, estimated_queue_s=est.queue_s,
            estimated_prefill_s=est.prefill_s, estimated_link_s=est.link_s, uncached_tokens=est.uncached_tokens)
        # a live decode worker first: never spend prefill on a dead decode site
        decoder = await self._decode_worker(placement, ())
        decoder.running += 1  # counted at the pick: a burst spreads over the workers before any Decode starts
        colocated_s = 0.0  # the prefill work a colocated request adds to its decode site until its first token
        try:
            log.info("%s: %s%s", request_id, decision.summary(), f" (user {request.user!r})" if request.user else "")
            usage = common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=1)
            timings = common_pb2.Timings()
            weight = self.admission.weight(tenant)
            decode_req = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, sampling=pb_params,
                                                  cache_salt=salt, shared_blocks=shared, tenant=tenant,
                                                  tenant_weight=weight)
            prefill_req = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=pb_params,
                                                     block_hashes=hashes, cache_salt=salt, shared_blocks=shared,
                                                     tenant=tenant, tenant_weight=weight)

            prefill_req.stream_to = self.stream_targets.get((placement.prefill_site, placement.decode_site), "")
            if decision.colocated:
                pre, colocated_s = None, est.prefill_s
                self.load.prefill_queue_s[decision.decode_site] = \
                    self.load.prefill_queue_s.get(decision.decode_site, 0.0) + colocated_s
            else:
                pre = await self._prefill(prefill_req, placement, est.prefill_s, context)
            emitted: list[int] = []
            if pre is not None:
                first_at = time.perf_counter()
                metrics.TTFT.observe(first_at - received)
                metrics.TENANT_TTFT.labels(tenant or "-").observe(first_at - received)
                timings.ttft_s = timings.prefill_s = first_at - received
                usage.cached_tokens = pre.cached_tokens
                emitted = [pre.first_token]
                first = router_pb2.GenerateResponse(request_id=request_id, token_ids=[pre.first_token],
                                                    text=pre.first_text)
                if pre.HasField("first_logprob"):
                    first.logprobs.append(pre.first_logprob)
                decode_req.first_token = pre.first_token
                decode_req.block_hashes[:] = pre.block_hashes
                decode_req.source_kvstore = pre.kvstore_address
                if pre.finished:
                    self._finished(timings, usage, received, first_at, 1, pre.finish_reason, placement, prompt)
                    first.MergeFrom(router_pb2.GenerateResponse(finished=True, finish_reason=pre.finish_reason,
                                                                usage=usage, timings=timings, placement=placement))
                    yield _tool_view(first, parser)
                    return
                yield _tool_view(first, parser)  # the client sees the first token before decode starts
            else:
                decode_req.prefill_here = True
                first_at = None

            failed: tuple[Worker, ...] = ()
            last = time.perf_counter()
            while True:
                if decoder is not None:  # its count, taken at the pick, is now the stream's
                    worker, decoder = decoder, None
                else:
                    worker = await self._decode_worker(placement, failed)
                    worker.running += 1
                if emitted:  # a migrated stream: continue after what the client has
                    decode_req.output_prefix[:] = emitted
                    decode_req.prefill_here = False
                stream = self.workers.stub(worker).Decode(decode_req, timeout=remaining(context))
                site = worker.site
                self.load.decode_running[site] = self.load.decode_running.get(site, 0) + 1
                try:
                    async for d in _messages(stream, self.stall_timeout_s, lambda w=worker: self.workers.answers(w)):
                        now = time.perf_counter()
                        if d.token_ids:
                            if colocated_s:
                                self._unqueue(decision.decode_site, colocated_s)
                                colocated_s = 0.0
                            if first_at is None:  # decode-only fallback: its first token is the first token
                                first_at = now
                                timings.ttft_s = now - received
                                metrics.TTFT.observe(timings.ttft_s)
                                metrics.TENANT_TTFT.labels(tenant or "-").observe(timings.ttft_s)
                                usage.cached_tokens = max(0, len(prompt) - d.recomputed_tokens)
                            else:
                                metrics.INTER_TOKEN.observe(now - last)
                            last = now
                            emitted += d.token_ids
                        if d.transfer_s:
                            timings.transfer_s = d.transfer_s
                        msg = router_pb2.GenerateResponse(request_id=request_id, token_ids=d.token_ids, text=d.text,
                                                          logprobs=d.logprobs)
                        if d.finished:
                            self._finished(timings, usage, received, first_at, d.completion_tokens, d.finish_reason,
                                           placement, prompt)
                            msg.MergeFrom(router_pb2.GenerateResponse(
                                finished=True, finish_reason=d.finish_reason, usage=usage, timings=timings,
                                placement=placement))
                        yield _tool_view(msg, parser)
                    return
                except (grpc.aio.AioRpcError, StreamStalled) as e:
                    if not (isinstance(e, StreamStalled) or worker_failed(e)) or remaining(context) <= 0:
                        raise
                    self.workers.down(worker, f"decode stream broke: {e.code().name} {e.details()}")
                    failed += (worker,)
                    if placement.migrations >= self.max_migrations:
                        raise unavailable(f"decode failed {placement.migrations + 1} times for this request "
                                          f"(router.max_migrations is {self.max_migrations}); retry") from e
                    placement.migrations += 1
                    metrics.MIGRATIONS.inc()
                    log.warning("%s: decode on %s broke after %d tokens (%s); migrating", request_id, worker.name,
                                len(emitted), e.code().name)
                finally:
                    # A client cancel or deadline cancels this handler; cancel the decode call
                    # explicitly too, so decode frees the sequence now rather than whenever the
                    # call object is collected.
                    stream.cancel()
                    worker.running -= 1
                    self.load.decode_running[site] -= 1
        finally:
            if decoder is not None:  # never reached Decode (prefill failed, or finished the request)
                decoder.running -= 1
            if colocated_s:
                self._unqueue(decision.decode_site, colocated_s)

    def _unqueue(self, site: str, seconds: float) -> None:
        queue = self.load.prefill_queue_s
        queue[site] = max(0.0, queue.get(site, 0.0) - seconds)


    async def _decode_worker(self, placement, failed: tuple[Worker, ...]) -> Worker:
        """A live decode worker at the placed site, else at another decode site; at last one that failed
        this request but is live again (it answered its health check since), rather than refusing it;
        UNAVAILABLE at once when there is none."""
        worker = (await self.workers.pick_or_recheck("decode", placement.decode_site, exclude=failed)
                  or self._live_decode_worker(placement, failed) or self._live_decode_worker(placement, ()))
        if worker is None:
            raise unavailable("no live decode worker: every decode worker is down or still loading")
        return worker

    def _live_decode_worker(self, placement, exclude: tuple[Worker, ...]) -> Worker | None:
        """The least-loaded live decode worker not in `exclude` at the placed site, else at another site
        (the placement then says the decode moved)."""
        for site in [placement.decode_site, *self.workers.sites_with_live("decode")]:
            worker = self.workers.pick("decode", site, exclude=exclude)
            if worker is not None:
                if site != placement.decode_site:
                    placement.reason += f"; decode moved to {site}: no live decode worker at {placement.decode_site}"
                    placement.decode_site = site
                return worker
        return None

    async def _prefill(self, prefill_req, placement, estimate_s: float, context):
        """Prefill on a live worker of the placed site, trying the next one when a worker fails;
        None when none is left (the decode worker then prefills: decode-only fallback)."""
        site, tried = placement.prefill_site, ()
        queue = self.load.prefill_queue_s
        while (worker := await self.workers.pick_or_recheck("prefill", site, exclude=tried)) is not None:
            queue[site] = queue.get(site, 0.0) + estimate_s
            worker.running += 1
            try:
                return await self.workers.stub(worker).Prefill(prefill_req, timeout=remaining(context))
            except grpc.aio.AioRpcError as e:
                if not worker_failed(e) or remaining(context) <= 0:
                    raise
                self.workers.down(worker, f"prefill failed: {e.code().name} {e.details()}")
                tried += (worker,)
                placement.prefill_fallback = "another worker"
            finally:
                worker.running -= 1
                queue[site] = max(0.0, queue[site] - estimate_s)
        placement.prefill_fallback = "decode-only"
        placement.prefill_site = placement.decode_site
        log.warning("%s: no live prefill worker at %s; the decode worker prefills", prefill_req.request_id, site)
        return None

    def _finished(self, timings, usage, received: float, first_at: float, completion_tokens: int,
                  finish_reason: str, placement, prompt) -> None:
        done = time.perf_counter()
        usage.completion_tokens = completion_tokens
        timings.decode_s = done - first_at
        timings.e2e_s = done - received
        timings.tpot_s = timings.decode_s / max(1, completion_tokens - 1)
        tracing.annotate(completion_tokens=completion_tokens, cached_tokens=usage.cached_tokens,
                         ttft_s=timings.ttft_s, tpot_s=timings.tpot_s, finish_reason=finish_reason,
                         migrations=placement.migrations, prefill_fallback=placement.prefill_fallback)
        if completion_tokens > 1:
            metrics.TPOT.observe(timings.tpot_s)
        metrics.E2E.observe(timings.e2e_s)
        metrics.PROMPT_TOKENS.inc(len(prompt))
        metrics.GENERATION_TOKENS.inc(completion_tokens)
        metrics.REQUEST_SUCCESS.labels(finish_reason).inc()
        metrics.PLACEMENTS.labels(placement.prefill_site, placement.decode_site).inc()
