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
"""
from __future__ import annotations

import json
import math
import os
import time
import uuid

import grpc
from aiohttp import web
from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor
from pydantic import ValidationError

from ember.rpc import validate
from ember.rpc.errors import status_for
from ember.rpc.server import bind_address
from ember.services.router.auth import ANONYMOUS, Authenticated, KeyTable
from ember.services.router.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    invalid_request,
)
from ember.v1 import common_pb2, router_pb2

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.DATA_LOSS: (500, "server_error"),
}


# The largest body read: the router's text cap plus room for the rest of a request (a longer
# text is refused by that cap anyway, without parsing a body that size on the event loop).
MAX_BODY_BYTES = validate.MAX_TEXT_BYTES + 2**20
# Routes open without an API key (load balancers and orchestrators probe them).
OPEN_PATHS = frozenset({"/health"})
TENANT = web.RequestKey("tenant", str)  # the caller's, once its key is checked


def error_response(status: int, kind: str, message: str, param: str | None = None,
                   retry_after_s: float | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status, headers=headers or None)


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
            message = ("You didn't provide an API key. Send it as `Authorization: Bearer KEY`." if header is None
                       else "Incorrect API key provided.")
            return error_response(401, "invalid_request_error", message, code="invalid_api_key",
                                  headers={"WWW-Authenticate": 'Bearer realm="ember"'})
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
    sampling = common_pb2.SamplingParams(max_tokens=body.new_tokens, stop=body.stop or [], ignore_eos=body.ignore_eos)
    for field in ("temperature", "top_p", "top_k", "seed"):
        if getattr(body, field) is not None:
            setattr(sampling, field, getattr(body, field))
    return sampling


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
        self.app.middlewares.append(_authentication(keys or KeyTable()))
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
                                          cache_salt=body.cache_salt or "", **inp)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        def build(body: ChatCompletionRequest) -> router_pb2.GenerateRequest:
            chat = router_pb2.ChatInput(messages=[router_pb2.ChatMessage(role=m.role, content=m.text)
                                                  for m in body.messages])
            if body.tools and body.tool_choice != "none":
                chat.tools_json = json.dumps(body.tools)
            return self._request(body, chat=chat)
        return await self._run(request, ChatCompletionRequest, build, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        def build(body: CompletionRequest) -> router_pb2.GenerateRequest:
            return self._request(body, text=body.prompt)
        return await self._run(request, CompletionRequest, build, chat=False)

    async def _run(self, http: web.Request, model: type[GenerationRequest], build, chat: bool) -> web.StreamResponse:
        try:
            body = model.model_validate_json(await http.read())
        except web.HTTPRequestEntityTooLarge:
            return error_response(400, "invalid_request_error", f"the request body is larger than "
                                  f"{MAX_BODY_BYTES} bytes, the most this server accepts")
        except ValidationError as e:
            return error_response(400, "invalid_request_error", *invalid_request(e))
        pb = build(body)
        stream, include_usage = body.stream, body.include_usage
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        context = _Deadline(self.timeout_s, http[TENANT])
        generator = self.service.Generate(pb, context)
        response: web.StreamResponse | None = None
        text, final = [], None
        try:
            async for msg in generator:
                if stream and response is None:
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                    await response.prepare(http)
                    if chat:
                        await self._send(response, self._chunk(rid, created, pb.model, chat,
                                                               {"role": "assistant", "content": ""}, None))
                if msg.finished:
                    final = msg
                if stream and (msg.text or msg.finished):
                    delta = {"content": msg.text} if msg.text else {}
                    await self._send(response, self._chunk(rid, created, pb.model, chat, delta,
                                                           msg.finish_reason if msg.finished else None))
                text.append(msg.text)
        except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI-shaped error
            code, message = status_for(e)
            status, kind = HTTP_STATUS.get(code, (500, "server_error"))
            if response is None:
                return error_response(status, kind, message, retry_after_s=getattr(e, "retry_after_s", None))
            await self._send(response, {"error": {"message": message, "type": kind, "param": None, "code": None}})
            await response.write_eof()
            return response
        finally:
            await generator.aclose()
        if context.code is not None:  # refused before any message (admission)
            status, kind = HTTP_STATUS.get(context.code, (500, "server_error"))
            return error_response(status, kind, context.details, retry_after_s=context.retry_after_s())
        usage = self._usage(final)
        if stream:
            if include_usage:
                chunk = self._chunk(rid, created, pb.model, chat, None, None)
                chunk["choices"], chunk["usage"] = [], usage
                await self._send(response, chunk)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        choice = {"index": 0, "finish_reason": final.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": pb.model or self.service.model_id,
                                  "choices": [choice], "usage": usage})

    def _chunk(self, rid: str, created: int, model: str, chat: bool, delta: dict | None,
               finish_reason: str | None) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = (delta or {}).get("content", "")
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model or self.service.model_id, "choices": [choice]}

    @staticmethod
    def _usage(final) -> dict:
        u = final.usage
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

    @staticmethod
    async def _send(response: web.StreamResponse, payload: dict) -> None:
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def serve(service, address: str) -> web.AppRunner:
    runner = web.AppRunner(OpenAIApp(service, keys=service.keys).app, access_log=None)
    await runner.setup()
    host, port = bind_address(address).rsplit(":", 1)
    await web.TCPSite(runner, host, int(port)).start()
    return runner
