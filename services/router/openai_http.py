"""OpenAI-compatible HTTP API at the router (aiohttp, on the router's event loop).

/v1/chat/completions (SSE streaming and not), /v1/completions, /v1/models. Each request
becomes a `GenerateRequest` and runs through `RouterService.Generate`, the same placement,
prefill, KV and decode path as the gRPC API. Errors come back in OpenAI's JSON shape with
the HTTP status matching the gRPC status. Ember extensions in the body (`extra_body` in the
openai client): `user_region`, `session_id`, `top_k`, `ignore_eos`, `cache_salt` (vLLM's).

With API keys configured (services/router/auth.py), every route but /health needs
`Authorization: Bearer KEY` (the openai client's `api_key`): else 401 with OpenAI's error body
(`code: invalid_api_key`). The key's tenant goes with the request into `RouterService.Generate`
(in its context).

Errors. Every error body is exactly `{"error": {"message", "type", "param", "code"}}`. A body
that does not validate is a 400 (openai_models: `param` names the field; `code`
unsupported_parameter / unsupported_value for a field Ember does not support). A gRPC status
from `Generate` maps, in `openai_error`, to:
  INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE  400 invalid_request_error
  UNAUTHENTICATED     401 invalid_request_error  code invalid_api_key (as the key check answers)
  PERMISSION_DENIED   403 permission_error
  NOT_FOUND           404 invalid_request_error  code model_not_found when about the model
  RESOURCE_EXHAUSTED  429 rate_limit_error       code rate_limit_exceeded, with Retry-After
  UNAVAILABLE         503 server_error
  DEADLINE_EXCEEDED   504 server_error
  anything else       500 server_error (DATA_LOSS, INTERNAL, UNKNOWN, ...)
Before the answer started, that is the HTTP status and the body. Once an SSE stream started (200
sent), an error is one event `data: {"error": {...}}`, the same message, type and param, with
`code` the named code above or, where there is none, the HTTP status the error would have had, as
a string ("503", "400"); then `data: [DONE]` and the stream ends (as vLLM does; the openai client
raises APIError on the error event). An unknown route or method is OpenAI's 404/405 body too.

Every request gets an id (the X-Request-Id header of its answer, the log context's request id, the
GenerateRequest's, and the body's `chatcmpl-ID`). Every failure is one log line (status, type and
message; a 500 from an exception with its traceback) and one count in ember:request_errors by route
and HTTP status. What a caller reads is the router's public error (ember.rpc.errors.public_error):
a downstream status and text never reach it; an internal error says only that, and the request id.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import time
import uuid

import grpc
from aiohttp import web
from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor
from pydantic import ValidationError

from ember.rpc import logs, metrics, validate
from ember.rpc.cert_reload import CertSource, watch
from ember.rpc.errors import INTERNAL_MESSAGE, public_error
from ember.rpc.server import bind_address
from ember.services.router import public_auth
from ember.services.router.auth import ANONYMOUS, Authenticated, KeyTable
from ember.services.router.openai_choices import Choice
from ember.services.router.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    invalid_request,
    invalid_request_code,
)
from ember.v1 import common_pb2, router_pb2

# gRPC status -> OpenAI's (HTTP status, error type, code); anything not here: SERVER_ERROR
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", None),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", None),
    grpc.StatusCode.DATA_LOSS: (500, "server_error", None),
}
SERVER_ERROR = (500, "server_error", None)
WWW_AUTHENTICATE = {"WWW-Authenticate": 'Bearer realm="ember"'}


# The largest body read: the router's text cap plus room for the rest of a request (a longer
# text is refused by that cap anyway, without parsing a body that size on the event loop).
MAX_BODY_BYTES = validate.MAX_TEXT_BYTES + 2**20
# Routes open without an API key (load balancers and orchestrators probe them).
OPEN_PATHS = frozenset({"/health"})
TENANT = web.RequestKey("tenant", str)  # the caller's, once its key is checked
REQUEST_ID = web.RequestKey("request_id", str)  # every request's, also sent back as X-Request-Id
STREAM = web.RequestKey("stream", web.StreamResponse)  # an SSE answer once started (its status is sent)
FAILURE = "ember_failure"  # on a response: the Failure it answers (read by _observe)
log = logging.getLogger("ember.router.http")


@dataclasses.dataclass
class Failure:
    """What an error answer said (its HTTP status, OpenAI type and message), for the log line and
    the error metric; `error`, when an exception caused it, logged with its traceback (a 500)."""
    status: int
    kind: str
    message: str
    error: BaseException | None = None


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, kind: str, message: str, param: str | None = None,
                   retry_after_s: float | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    response = web.json_response(error_body(message, kind, param, code), status=status, headers=headers or None)
    response[FAILURE] = Failure(status, kind, message)
    return response


def openai_error(code: grpc.StatusCode, message: str) -> tuple[int, str, str | None, str | None]:
    """OpenAI's (HTTP status, type, code, param) for a gRPC status and its message (the table in
    the module docstring). The router's NOT_FOUND about the model (RouterService: "model ... is
    not served here") is OpenAI's model_not_found."""
    status, kind, named = HTTP_STATUS.get(code, SERVER_ERROR)
    param = None
    if code == grpc.StatusCode.NOT_FOUND and message.startswith("model "):
        named, param = "model_not_found", "model"
    return status, kind, named, param


def grpc_error_response(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> web.Response:
    """The answer to a request `Generate` refused before its first message."""
    status, kind, named, param = openai_error(code, message)
    return error_response(status, kind, message, param, retry_after_s if status == 429 else None, named,
                          headers=WWW_AUTHENTICATE if status == 401 else None)


def stream_error(code: grpc.StatusCode, message: str) -> dict:
    """The SSE event (payload) for an error after the stream started: the status can no longer
    change, so `code` is the named code or, failing one, the HTTP status as a string."""
    status, kind, named, param = openai_error(code, message)
    return error_body(message, kind, param, named or str(status))


def validation_error_response(error: ValidationError) -> web.Response:
    return error_response(400, "invalid_request_error", *invalid_request(error), code=invalid_request_code(error))


def _route(request: web.Request) -> str:
    """The error metric's `method` label: METHOD and route of a served route (gRPC's are
    /package.Service/Method); anything else one value (a path a client made up is no label)."""
    resource = request.match_info.route.resource
    return f"{request.method} {resource.canonical}" if resource is not None else "HTTP (no route)"


def _record(request: web.Request, failure: Failure) -> None:
    """Every failed HTTP request: one log line (its request id in the JSON log's `request_id`, the
    status and error type in the message; a 500 from an exception with its traceback) and one count
    in ember:request_errors, by route and HTTP status."""
    metrics.RPC_ERRORS.labels(_route(request), str(failure.status)).inc()
    line = "%s %s -> HTTP %d %s: %s"
    args = (request.method, request.path, failure.status, failure.kind, failure.message)
    if failure.error is not None and failure.status >= 500:
        log.error(line, *args, exc_info=failure.error)
    else:
        log.log(logging.WARNING if failure.status >= 500 else logging.INFO, line, *args)


@web.middleware
async def _observe(request: web.Request, handler):
    """The outermost middleware: gives the request its id (the log context's, the X-Request-Id
    header's, and the answer's), records every failure (_record) and turns an exception no handler
    answered into OpenAI's 500 with a generic message (its traceback logged, never sent)."""
    request_id = uuid.uuid4().hex
    request[REQUEST_ID] = request_id
    logs.request_id.set(request_id)
    try:
        response = await handler(request)
    except (web.HTTPException, asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # noqa: BLE001 - a bug: logged, counted, answered as a 500
        if STREAM in request:  # the status went out already: the connection is dropped
            _record(request, Failure(500, "server_error", INTERNAL_MESSAGE, e))
            raise
        response = error_response(500, "server_error", f"{INTERNAL_MESSAGE} (request id {request_id})")
        response[FAILURE].error = e
    failure = response.get(FAILURE)
    if failure is not None:
        _record(request, failure)
    return response


async def _request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]


@web.middleware
async def _http_errors(request: web.Request, handler):
    """aiohttp's own errors (no such route, wrong method, ...) in OpenAI's shape. (Other exceptions
    pass: a handler's own failures are its answers, and one that escapes may do so after an SSE
    response started.)"""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = (f"Invalid URL ({request.method} {request.path})" if e.status == 404
                   else f"{e.reason}: {request.method} {request.path}")
        kind = "server_error" if e.status >= 500 else "invalid_request_error"
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return error_response(e.status, kind, message, headers=headers)


def _authentication(keys):
    """A middleware answering 401 (OpenAI's body) to a request on any route but OPEN_PATHS whose
    `Authorization: Bearer KEY` names no configured key; the tenant goes in `request[TENANT]`."""
    @web.middleware
    async def authenticate(request: web.Request, handler):
        if not keys.enabled or request.path in OPEN_PATHS:
            request[TENANT] = ANONYMOUS
            return await handler(request)
        header = request.headers.get("Authorization")
        tenant = keys.check_authorization(header)
        if tenant is None:
            public_auth.count(public_auth.refusal(keys, header) or "invalid_key", "http")  # (never the key)
            message = ("You didn't provide an API key. Send it as `Authorization: Bearer KEY`." if header is None
                       else "Incorrect API key provided.")
            return error_response(401, "invalid_request_error", message, code="invalid_api_key",
                                  headers=WWW_AUTHENTICATE)
        request[TENANT] = tenant
        return await handler(request)
    return authenticate


class _Deadline(Authenticated):
    """What `Generate` needs of a gRPC context, for HTTP callers: the time left, the caller's
    tenant (its key checked here), and the status of a request it refused without raising
    (admission)."""

    def __init__(self, timeout_s: float, tenant: str = ANONYMOUS):
        self.tenant = tenant
        self.deadline = time.monotonic() + timeout_s
        self.code: grpc.StatusCode | None = None
        self.details, self.trailing = "", ()

    def time_remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, trailing) -> None:
        self.trailing = tuple(trailing)

    def retry_after_s(self) -> float | None:
        ms = dict(self.trailing).get("grpc-retry-pushback-ms")
        return int(ms) / 1000 if ms is not None else None


def _sampling(body: GenerationRequest) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams(max_tokens=body.new_tokens, stop=body.stop or [], ignore_eos=body.ignore_eos,
                                         presence_penalty=body.presence_penalty,
                                         frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias_ids)
    for field in ("temperature", "top_p", "top_k", "seed", "speculative"):
        if getattr(body, field) is not None:
            setattr(sampling, field, getattr(body, field))
    if body.engine_logprobs is not None:
        sampling.logprobs = body.engine_logprobs
    constraint = getattr(body, "constraint", None)  # chat's response_format
    if constraint is not None:
        kind, spec = constraint
        setattr(sampling.constraint, kind, True if kind == "json_object" else spec)
    return sampling


def choice_requests(pb: router_pb2.GenerateRequest, n: int) -> list[router_pb2.GenerateRequest]:
    """`n` requests for `n` choices: choice i samples with seed + i (reproducible when a seed is given)
    and, past the first, has request id ID-i (each is its own sequence at the workers)."""
    requests = [pb]
    for i in range(1, n):
        other = router_pb2.GenerateRequest()
        other.CopyFrom(pb)
        if pb.request_id:
            other.request_id = f"{pb.request_id}-{i}"
        if pb.sampling.HasField("seed"):
            other.sampling.seed = (pb.sampling.seed + i) % 2**63
        requests.append(other)
    return requests


def _traced_app() -> web.Application:
    """An aiohttp app whose every request is a SERVER span (opentelemetry-instrumentation-
    aiohttp-server); the gRPC calls a request makes are its children. /health stays out."""
    if not (os.environ.get("OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS") or os.environ.get("OTEL_PYTHON_EXCLUDED_URLS")):
        os.environ["OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS"] = "^/health$"
    # the middleware needs the instrumentor's set-up (tracer, exclusions, metrics); once
    # instrumented, every web.Application starts with the middleware (idempotent)
    AioHttpServerInstrumentor().instrument()
    return web.Application(client_max_size=MAX_BODY_BYTES)


class OpenAIApp:
    def __init__(self, service, timeout_s: float = 600.0, keys: KeyTable | None = None):
        self.service, self.timeout_s = service, timeout_s
        self.app = _traced_app()
        self.app.middlewares.extend((_observe, _http_errors, _authentication(keys or KeyTable())))
        self.app.on_response_prepare.append(_request_id_header)
        self.app.add_routes([web.get("/v1/models", self.models), web.post("/v1/chat/completions", self.chat),
                             web.post("/v1/completions", self.completions), web.get("/health", self.health)])

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.service.model_id, "object": "model", "created": 0, "owned_by": "ember",
             "max_model_len": self.service.max_model_len}]})

    def _request(self, body: GenerationRequest, **inp) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(model=body.model or "", sampling=_sampling(body),
                                          user_region=body.user_region or "", session_id=body.session_id or "",
                                          cache_salt=body.cache_salt or "", user=body.user or "", **inp)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        def build(body: ChatCompletionRequest) -> router_pb2.GenerateRequest:
            chat = router_pb2.ChatInput(messages=[router_pb2.ChatMessage(
                role=m.role, content=m.text, tool_calls_json=m.tool_calls_json, tool_call_id=m.tool_call_id or "",
                name=m.name or "") for m in body.messages])
            if body.tools and body.tool_choice_mode != "none":
                chat.tools_json = body.tools_json
                chat.tool_choice, chat.tool_choice_name = body.tool_choice_mode, body.tool_choice_name or ""
                chat.parallel_tool_calls = body.parallel_tool_calls
            return self._request(body, chat=chat)
        return await self._run(request, ChatCompletionRequest, build, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        def build(body: CompletionRequest) -> router_pb2.GenerateRequest:
            return self._request(body, text=body.prompt)
        return await self._run(request, CompletionRequest, build, chat=False)

    async def _choices(self, requests: list, contexts: list):
        """(choice index, GenerateResponse) from every choice's stream as they come. Choice 0 runs first;
        the others start once its first token is out (its prompt's KV is then cached and stored, so
        theirs is reused, not recomputed); a refused choice 0 (admission) starts none of them."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            generator = self.service.Generate(requests[i], contexts[i])
            try:
                async for msg in generator:
                    queue.put_nowait((i, msg))
                queue.put_nowait((i, None))
            except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((i, e))
            finally:
                await generator.aclose()
        tasks = [asyncio.create_task(pump(0))]
        ended = 0
        try:
            while ended < len(tasks):
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is None:
                    ended += 1
                    continue
                if len(tasks) == 1 and len(requests) > 1:
                    tasks += [asyncio.create_task(pump(j)) for j in range(1, len(requests))]
                yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, http: web.Request, model: type[GenerationRequest], build, chat: bool) -> web.StreamResponse:
        try:
            body = model.model_validate_json(await http.read())
        except web.HTTPRequestEntityTooLarge:
            return error_response(400, "invalid_request_error", f"the request body is larger than "
                                  f"{MAX_BODY_BYTES} bytes, the most this server accepts")
        except ValidationError as e:
            return validation_error_response(e)
        pb = build(body)
        pb.request_id = http[REQUEST_ID]  # the router's and the workers' logs name it too
        requests = choice_requests(pb, body.n)
        model_name = requests[0].model
        stream, include_usage = body.stream, body.include_usage
        rid = ("chatcmpl-" if chat else "cmpl-") + http[REQUEST_ID]
        created = int(time.time())
        contexts = [_Deadline(self.timeout_s, http[TENANT]) for _ in requests]
        choices = [Choice(i, chat, getattr(self.service, "tokenizer", None), body.engine_logprobs is not None)
                   for i in range(len(requests))]
        response: web.StreamResponse | None = None
        try:
            async with contextlib.aclosing(self._choices(requests, contexts)) as answers:
                async for i, msg in answers:
                    if stream and response is None:
                        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                               "Cache-Control": "no-cache"})
                        await response.prepare(http)
                        http[STREAM] = response
                    if stream and chat and not choices[i].started:  # OpenAI's first chunk of a choice: its role
                        await self._send(response, self._chunk(rid, created, model_name, chat,
                                                               [choices[i].first_chunk()]))
                    piece = choices[i].delta(msg)
                    if stream and piece is not None:
                        await self._send(response, self._chunk(rid, created, model_name, chat, [piece]))
        except ConnectionResetError:  # the client went away mid-stream: its choices are stopped (aclosing)
            return response
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI-shaped error
            # the router's own error as it stands (RouterService.Generate made it public); anything
            # else (a bug here, a stand-in's exception) is made public now: no internal text leaves
            error = public_error(e, request_id=http[REQUEST_ID])
            code, message = error.code, str(error)
            cause = e if code == grpc.StatusCode.INTERNAL else None
            if response is None:
                answer = grpc_error_response(code, message, error.retry_after_s)
                answer[FAILURE].error = cause
                return answer
            self._failed_stream(response, code, message, cause)
            try:
                await self._send(response, stream_error(code, message))
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
            except ConnectionResetError:
                pass
            return response
        refused = next((c for c in contexts if c.code is not None), None)  # admission refused, without raising
        if refused is not None or any(c.final is None for c in choices):
            code, message = ((refused.code, refused.details) if refused is not None
                             else (grpc.StatusCode.UNAVAILABLE, "the answer ended before it finished; retry"))
            if response is None:
                return grpc_error_response(code, message, refused.retry_after_s() if refused is not None else None)
            self._failed_stream(response, code, message)
            await self._send(response, stream_error(code, message))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        usage = self._usage([c.final for c in choices])
        if stream:
            if include_usage:
                chunk = self._chunk(rid, created, model_name, chat, [])
                chunk["usage"] = usage
                await self._send(response, chunk)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": model_name or self.service.model_id,
                                  "choices": [c.choice() for c in choices], "usage": usage})

    @staticmethod
    def _failed_stream(response: web.StreamResponse, code: grpc.StatusCode, message: str,
                       cause: BaseException | None = None) -> None:
        """Marks a started SSE answer as failed with the status its error would have had (for _observe)."""
        status, kind, _, _ = openai_error(code, message)
        response[FAILURE] = Failure(status, kind, message, cause)

    def _chunk(self, rid: str, created: int, model: str, chat: bool, pieces: list[dict]) -> dict:
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model or self.service.model_id, "choices": pieces}

    @staticmethod
    def _usage(finals: list) -> dict:
        """The prompt counts once; completion tokens are summed over the choices; cached tokens are the
        most any choice reused (the choices after the first reuse its prompt's KV)."""
        prompt = finals[0].usage.prompt_tokens
        completion = sum(f.usage.completion_tokens for f in finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": max(f.usage.cached_tokens for f in finals)}}

    @staticmethod
    async def _send(response: web.StreamResponse, payload: dict) -> None:
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def serve(service, address: str, tls: CertSource | None = None) -> web.AppRunner:
    """The API on `address`: HTTPS when `tls` is given (HTTP/1.1 by ALPN: aiohttp's server speaks no
    HTTP/2; its certificate re-read on SIGHUP and file change for new connections), else plain HTTP."""
    runner = web.AppRunner(OpenAIApp(service, keys=service.keys).app, access_log=None)
    await runner.setup()
    host, port = bind_address(address).rsplit(":", 1)
    await web.TCPSite(runner, host, int(port), ssl_context=None if tls is None else watch(tls).ssl_context()).start()
    return runner
