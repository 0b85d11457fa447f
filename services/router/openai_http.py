"""OpenAI-compatible HTTP API at the router (aiohttp, on the router's event loop).

/v1/chat/completions (SSE streaming and not), /v1/completions, /v1/models. Each request
becomes a `GenerateRequest` and runs through `RouterService.Generate`, the same placement,
prefill, KV and decode path as the gRPC API. Errors come back in OpenAI's JSON shape with
the HTTP status matching the gRPC status. Ember extensions in the body (`extra_body` in the
openai client): `user_region`, `session_id`, `top_k`, `ignore_eos`.
"""
from __future__ import annotations

import json
import time
import uuid

import grpc
from aiohttp import web

from ember.rpc.errors import status_for
from ember.rpc.server import bind_address
from ember.v1 import common_pb2, router_pb2

DEFAULT_MAX_TOKENS = 256
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.DATA_LOSS: (500, "server_error"),
}


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_response(status: int, kind: str, message: str, param: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


class _Deadline:
    """What `Generate` needs of a gRPC context, for HTTP callers."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s

    def time_remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


def _sampling(body: dict) -> common_pb2.SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise BadRequest("max_tokens must be a positive integer", "max_tokens")
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, stop=stop,
                                         ignore_eos=bool(body.get("ignore_eos", False)))
    for field, pb_field, kind in (("temperature", "temperature", (int, float)), ("top_p", "top_p", (int, float)),
                                  ("top_k", "top_k", int), ("seed", "seed", int)):
        if body.get(field) is not None:
            if not isinstance(body[field], kind) or isinstance(body[field], bool):
                raise BadRequest(f"{field} must be a number", field)
            setattr(sampling, pb_field, body[field])
    return sampling


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")


class OpenAIApp:
    def __init__(self, service, timeout_s: float = 600.0):
        self.service, self.timeout_s = service, timeout_s
        self.app = web.Application()
        self.app.add_routes([web.get("/v1/models", self.models), web.post("/v1/chat/completions", self.chat),
                             web.post("/v1/completions", self.completions), web.get("/health", self.health)])

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.service.model_id, "object": "model", "created": 0, "owned_by": "ember",
             "max_model_len": self.service.max_model_len}]})

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def _request(self, body: dict, **inp) -> router_pb2.GenerateRequest:
        return router_pb2.GenerateRequest(model=body.get("model") or "", sampling=_sampling(body),
                                          user_region=body.get("user_region", ""),
                                          session_id=body.get("session_id", ""), **inp)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        async def build():
            body = await self._body(request)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("messages must be a non-empty list", "messages")
            chat = router_pb2.ChatInput(messages=[
                router_pb2.ChatMessage(role=str(m.get("role", "")), content=_content(m, i))
                for i, m in enumerate(messages) if isinstance(m, dict)])
            if len(chat.messages) != len(messages):
                raise BadRequest("every message must be an object with role and content", "messages")
            if body.get("tools") and body.get("tool_choice") != "none":
                chat.tools_json = json.dumps(body["tools"])
            return body, self._request(body, chat=chat)
        return await self._run(request, build, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        async def build():
            body = await self._body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise BadRequest("prompt must be a string", "prompt")
            return body, self._request(body, text=prompt)
        return await self._run(request, build, chat=False)

    async def _run(self, http: web.Request, build, chat: bool) -> web.StreamResponse:
        try:
            body, pb = await build()
        except BadRequest as e:
            return error_response(400, "invalid_request_error", str(e), e.param)
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        generator = self.service.Generate(pb, _Deadline(self.timeout_s))
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
                return error_response(status, kind, message)
            await self._send(response, {"error": {"message": message, "type": kind, "param": None, "code": None}})
            await response.write_eof()
            return response
        finally:
            await generator.aclose()
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
    runner = web.AppRunner(OpenAIApp(service).app, access_log=None)
    await runner.setup()
    host, port = bind_address(address).rsplit(":", 1)
    await web.TCPSite(runner, host, int(port)).start()
    return runner
