"""The router's error paths, without a cluster (issue 47): every HTTP failure is logged (JSON, with
its request id, status and type) and counted in ember:request_errors by HTTP status; the client's
own chat/tool input errors are INVALID_ARGUMENT (400) with a clear message while a router bug is
INTERNAL (500) with a logged traceback and a generic message; a downstream (worker) status and its
text never reach a public caller as they are.

The stand-ins: the real aiohttp app (OpenAIApp), the real RouterService.Generate and _render_chat
(built without placement, workers or a directory: the failures here happen before those), a small
word-level tokenizer under the real Tokenizer (its sandboxed Jinja template), and a downstream
call that fails with a real grpc.aio.AioRpcError."""
from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from multidict import CIMultiDict
from prometheus_client import REGISTRY
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ember.model.tokenizer import Tokenizer
from ember.rpc import logs
from ember.rpc.errors import ErrorInterceptor, RpcError
from ember.services.router import tools
from ember.services.router.admission import Admission
from ember.services.router.auth import KeyTable
from ember.services.router.service import RouterService
from ember.v1 import common_pb2, router_pb2, router_pb2_grpc

S = grpc.StatusCode
USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
# A template as HF ships them: it refuses what it cannot render with raise_exception.
TEMPLATE = ("{% for m in messages %}{% if m.role not in ('system', 'user', 'assistant') %}"
            "{{ raise_exception('Only system, user and assistant roles are supported') }}{% endif %}"
            "{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
SECRET = "peer spiffe://ember/decode-0 at 10.0.0.7:50061 is not authorized"  # a downstream's own text


def _tokenizer() -> Tokenizer:
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "hi", "user", "assistant", ":"])}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    return Tokenizer(backend, TEMPLATE, None, "<eos>")


def _router(downstream: Exception | None = None) -> RouterService:
    """A RouterService up to placement: validation, tokenizing and chat rendering are its own; with
    `downstream`, the request then fails as a worker call failing with it would."""
    service = RouterService.__new__(RouterService)
    service.tokenizer, service.keys = _tokenizer(), KeyTable()
    service.admission = Admission(8, {}, retry_after_s=1.0)
    service.model_id, service.max_model_len, service.vocab_size = "fake-model", 2048, 6
    service.max_text_bytes, service.text_cap_reason = 2**20, "the router's text limit"
    service.retry_after_s, service.shared_prefixes = 1.0, None
    if downstream is not None:
        async def generate(request, context, tenant, bill):
            logs.request_id.set(request.request_id or "rid")
            raise downstream
            yield  # (an async generator, as _generate is)
        service._generate = generate
    return service


def _rpc_error(code: grpc.StatusCode, details: str = SECRET) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _errors(method: str, code: str) -> float:
    return REGISTRY.get_sample_value("ember:request_errors_total", {"method": method, "code": code}) or 0.0


class _JsonLines(logging.Handler):
    """The router's JSON log lines (ember.rpc.logs.JsonFormatter, as `ember up` writes them)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logs.JsonFormatter("router"))
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def json_log():
    handler, logger = _JsonLines(), logging.getLogger("ember")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(old)


async def _exchange(service, method: str, path: str, body=None, headers=None):
    from aiohttp.test_utils import TestClient, TestServer

    from ember.services.router.openai_http import OpenAIApp
    async with TestClient(TestServer(OpenAIApp(service, keys=service.keys).app)) as client:
        response = await client.request(method, path, data=None if body is None else json.dumps(body).encode(),
                                        headers={"Content-Type": "application/json", **(headers or {})})
        return response.status, CIMultiDict(response.headers), await response.read()  # (any case)


def post(service, body, path: str = CHAT, headers=None):
    return asyncio.run(_exchange(service, "POST", path, body, headers))


def error_of(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    return body["error"]


def http_lines(lines: list[dict]) -> list[dict]:
    return [line for line in lines if line["logger"] == "ember.router.http"]


# -- 1. every HTTP failure logged and counted --------------------------------------------------------
def test_a_failed_request_is_one_json_log_line_with_its_request_id_and_one_count(json_log):
    before = _errors(f"POST {CHAT}", "503")
    status, headers, raw = post(_router(_rpc_error(S.UNAVAILABLE)), {"messages": USER})
    assert status == 503 and error_of(raw)["type"] == "server_error"
    assert _errors(f"POST {CHAT}", "503") == before + 1
    [line] = http_lines(json_log)
    assert line["request_id"] == headers["X-Request-Id"] and len(headers["X-Request-Id"]) == 32
    assert f"POST {CHAT} -> HTTP 503 server_error" in line["message"] and line["level"] == "WARNING"
    # the router's own line about the downstream failure names the same request and keeps its text
    [cause] = [x for x in json_log if x["logger"] == "ember.router"]
    assert cause["request_id"] == headers["X-Request-Id"] and "UNAVAILABLE" in cause["message"]


@pytest.mark.parametrize("method, path, body, headers, status, label", [
    ("POST", CHAT, {"messages": []}, None, 400, f"POST {CHAT}"),  # the body does not validate
    ("POST", CHAT, {"messages": USER}, {"Authorization": "Bearer wrong"}, 401, f"POST {CHAT}"),
    ("POST", "/v1/embeddings", {"input": "x"}, None, 404, "HTTP (no route)"),  # no per-path label
    ("GET", CHAT, None, None, 405, "HTTP (no route)"),
], ids=["400", "401", "404", "405"])
def test_every_kind_of_http_failure_is_logged_and_counted_by_status(json_log, method, path, body, headers, status,
                                                                    label):
    service = _router()
    if status == 401:
        service.keys = KeyTable({"right-key": "acme"})
    before = _errors(label, str(status))
    got, answer_headers, raw = asyncio.run(_exchange(service, method, path, body, headers))
    assert got == status and error_of(raw)["type"]
    assert _errors(label, str(status)) == before + 1
    [line] = http_lines(json_log)
    assert line["request_id"] == answer_headers["X-Request-Id"] and f"-> HTTP {status} " in line["message"]
    assert line["level"] == "INFO"  # the client's fault: no alarm


def test_a_failure_after_the_stream_started_is_counted_under_the_status_it_would_have_had(json_log):
    class Breaks:
        model_id, max_model_len, keys, tokenizer = "fake-model", 2048, KeyTable(), None

        async def Generate(self, request, context):
            yield router_pb2.GenerateResponse(text="Hel", token_ids=[1])
            raise RpcError(S.UNAVAILABLE, "decode failed 3 times for this request")
    before = _errors(f"POST {CHAT}", "503")
    status, _, raw = post(Breaks(), {"messages": USER, "stream": True})
    assert status == 200 and b'"code": "503"' in raw
    assert _errors(f"POST {CHAT}", "503") == before + 1
    [line] = http_lines(json_log)
    assert "HTTP 503 server_error: decode failed 3 times" in line["message"]


def test_an_exception_escaping_a_handler_is_a_generic_500_with_its_traceback_logged(json_log, monkeypatch):
    from ember.services.router import openai_http

    def broken(pb, n):
        raise KeyError("a router bug at /srv/ember/secret.py")
    monkeypatch.setattr(openai_http, "choice_requests", broken)  # outside _run's own error handling
    before = _errors(f"POST {CHAT}", "500")
    status, headers, raw = post(_router(), {"messages": USER})
    error = error_of(raw)
    assert status == 500 and error["type"] == "server_error" and "secret" not in error["message"]
    assert headers["X-Request-Id"] in error["message"]
    assert _errors(f"POST {CHAT}", "500") == before + 1
    [line] = http_lines(json_log)
    assert line["level"] == "ERROR" and "KeyError" in line["exception"] and "secret.py" in line["exception"]


# -- 2. the client's input errors are 400; the router's bugs are 500 -----------------------------------
def _chat(messages: list[dict], offered: list[dict] | None = None, choice: str = "") -> router_pb2.GenerateRequest:
    """A gRPC chat request as a client builds it (its JSON fields unchecked by any HTTP model)."""
    chat = router_pb2.ChatInput(tool_choice=choice, tools_json=json.dumps(offered) if offered else "")
    for m in messages:
        chat.messages.append(router_pb2.ChatMessage(role=m["role"], content=m.get("content") or "",
                                                    tool_calls_json=json.dumps(m["tool_calls"])
                                                    if "tool_calls" in m else ""))
    return router_pb2.GenerateRequest(chat=chat, sampling=common_pb2.SamplingParams(max_tokens=4))


@pytest.mark.parametrize("request_, says", [
    (_chat([{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": "f"}]}, *USER]),
     "messages[0].tool_calls[0] needs a function object with a string name"),
    (_chat([{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}, *USER]),
     "messages[0].tool_calls[0] needs a function object with a string name"),
    (_chat(USER, [{"type": "function", "function": {"name": "f", "parameters": {"x-guidance": "abc"}}}], "required"),
     "function 'f': parameters.x-guidance must be an object"),
    (_chat(USER, [{"type": "function", "function": {"parameters": {}}}], "required"),
     "a tool needs a function with a name"),
    (_chat([{"role": "critic", "content": "hi"}]),
     "the model's chat template refused these messages: Only system, user and assistant roles"),
], ids=["tool-call-function-not-an-object", "tool-call-without-function", "bad-x-guidance", "tool-without-name",
        "template-raise_exception"])
def test_the_clients_own_bad_input_is_invalid_argument_saying_what_is_wrong(request_, says):
    with pytest.raises(RpcError) as e:
        asyncio.run(_drain(_router(), request_))
    assert e.value.code == S.INVALID_ARGUMENT and says in str(e.value), str(e.value)


@pytest.mark.parametrize("body, says", [
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x-guidance": "abc"}}}],
      "tool_choice": "required"}, "function 'f': parameters.x-guidance must be an object"),
    ({"messages": [{"role": "developer", "content": "be brief"}, *USER]},
     "the model's chat template refused these messages: Only system, user and assistant roles"),
], ids=["bad-x-guidance", "template-raise_exception"])
def test_the_clients_own_bad_input_is_an_http_400_without_a_traceback(json_log, body, says):
    status, _, raw = post(_router(), body)
    error = error_of(raw)
    assert status == 400 and error["type"] == "invalid_request_error" and says in error["message"], error
    assert not any(line.get("exception") for line in json_log)  # the client's fault: no traceback


@pytest.mark.parametrize("bug", [KeyError("role"), TypeError("unhashable type: 'dict'"),
                                 AttributeError("'NoneType' object has no attribute 'get'"),
                                 ValueError("messages[0] needs 'role' and 'content'")],
                         ids=["KeyError", "TypeError", "AttributeError", "ValueError"])
def test_a_router_bug_while_rendering_is_a_500_with_its_traceback_logged(json_log, monkeypatch, bug):
    def render(messages, offered, knows):
        raise bug
    monkeypatch.setattr(tools, "render", render)
    status, headers, raw = post(_router(), {"messages": USER})
    error = error_of(raw)
    assert status == 500 and error["type"] == "server_error"
    assert str(bug) not in error["message"] and "internal error" in error["message"]
    [line] = http_lines(json_log)
    assert line["level"] == "ERROR" and type(bug).__name__ in line["exception"] and "render" in line["exception"]


def test_a_router_bug_is_internal_to_a_grpc_caller_too(monkeypatch):
    """RouterService.Generate itself (the gRPC API's handler) turns the bug into INTERNAL."""
    monkeypatch.setattr(tools, "render", lambda *a: {}["role"])
    request = _chat(USER)
    with pytest.raises(RpcError) as e:
        asyncio.run(_drain(_router(), request))
    assert e.value.code == S.INTERNAL and "role" not in str(e.value) and isinstance(e.value.__cause__, KeyError)


# -- 3. downstream failures become the router's own public errors --------------------------------------
DOWNSTREAM = [  # a worker's status -> what the public caller gets (HTTP status, type, code)
    (S.UNAUTHENTICATED, 500, "server_error", None),  # never the client's 401 invalid_api_key
    (S.PERMISSION_DENIED, 500, "server_error", None),  # never the client's 403
    (S.INTERNAL, 500, "server_error", None),
    (S.DATA_LOSS, 500, "server_error", None),
    (S.NOT_FOUND, 500, "server_error", None),  # a block or lease gone: not the client's 404
    (S.FAILED_PRECONDITION, 500, "server_error", None),
    (S.UNAVAILABLE, 503, "server_error", None),
    (S.CANCELLED, 503, "server_error", None),
    (S.DEADLINE_EXCEEDED, 504, "server_error", None),
    (S.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded"),
    (S.INVALID_ARGUMENT, 400, "invalid_request_error", None),
]


@pytest.mark.parametrize("downstream, status, kind, code", DOWNSTREAM, ids=[c[0].name for c in DOWNSTREAM])
def test_a_downstream_status_reaches_an_http_caller_as_the_routers_own_error(json_log, downstream, status, kind,
                                                                            code):
    got, headers, raw = post(_router(_rpc_error(downstream)), {"messages": USER})
    error = error_of(raw)
    assert (got, error["type"], error["code"]) == (status, kind, code)
    assert "spiffe" not in raw.decode() and "10.0.0.7" not in raw.decode()  # no downstream text
    assert "WWW-Authenticate" not in headers
    assert ("Retry-After" in headers) == (status == 429)
    # the downstream's status and text are in the router's log, at ERROR for an internal auth failure
    [cause] = [x for x in json_log if x["logger"] == "ember.router"]
    assert SECRET in cause["message"] and downstream.name in cause["message"]
    assert cause["level"] == ("ERROR" if downstream in (S.UNAUTHENTICATED, S.PERMISSION_DENIED) else "WARNING")


async def _drain(service, request, context=None):
    from ember.services.router.auth import Authenticated

    class Context(Authenticated):
        tenant = ""
    return [m async for m in service.Generate(request, context or Context())]


async def _over_grpc(service) -> grpc.aio.AioRpcError:
    """Generate through a real gRPC server with the services' ErrorInterceptor: what a gRPC caller reads."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    router_pb2_grpc.add_RouterServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(text="hi"), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            return e.value
    finally:
        await server.stop(None)


@pytest.mark.parametrize("downstream, public", [(S.UNAUTHENTICATED, S.INTERNAL), (S.PERMISSION_DENIED, S.INTERNAL),
                                                (S.INTERNAL, S.INTERNAL), (S.CANCELLED, S.UNAVAILABLE)],
                         ids=["UNAUTHENTICATED", "PERMISSION_DENIED", "INTERNAL", "CANCELLED"])
def test_a_downstream_status_reaches_a_grpc_caller_as_the_routers_own_error(downstream, public):
    e = asyncio.run(_over_grpc(_router(_rpc_error(downstream))))
    assert e.code() == public and "spiffe" not in e.details() and "10.0.0.7" not in e.details()


def test_the_routers_own_refusals_stay_as_they_are():
    """Its API-key check (UNAUTHENTICATED), its quotas (RESOURCE_EXHAUSTED) and its validation
    (INVALID_ARGUMENT) are the client's: their codes and messages are unchanged."""
    service = _router()
    service.keys = KeyTable({"right-key": "acme"})
    e = asyncio.run(_over_grpc(service))  # no key
    assert e.code() == S.UNAUTHENTICATED and "API key" in e.details()
    status, _, raw = post(_router(), {"messages": USER, "model": "gpt-4"})
    assert status == 404 and error_of(raw)["code"] == "model_not_found" and "gpt-4" in error_of(raw)["message"]
    own = RpcError(S.RESOURCE_EXHAUSTED, "tenant acme is over its requests_per_s quota", retry_after_s=2)
    status, headers, raw = post(_router(own), {"messages": USER})
    assert status == 429 and headers["Retry-After"] == "2" and error_of(raw)["message"] == str(own)
    status, _, raw = post(_router(), {"messages": USER, "max_tokens": 4000})
    assert status == 400 and "4000" in error_of(raw)["message"], error_of(raw)
