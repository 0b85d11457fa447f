"""OpenAI-shaped errors from the router's HTTP API, without a cluster: the real aiohttp app
(OpenAIApp) over a stand-in RouterService whose Generate fails with a chosen gRPC status before
its first message or after one (mid-stream), and request bodies the models accept or refuse."""
from __future__ import annotations

import asyncio
import json

import grpc
import openai
import pytest

from ember.rpc.errors import RpcError, refuse
from ember.services.router.auth import KeyTable
from ember.services.router.openai_models import ChatCompletionRequest, CompletionRequest
from ember.v1 import common_pb2, router_pb2

USER = [{"role": "user", "content": "hi"}]
S = grpc.StatusCode
KEYS = {"message", "type", "param", "code"}


class _Tokenizer:
    eos_token_id = 2

    @staticmethod
    def token_bytes(token_id: int) -> bytes:
        return f"<{token_id}>".encode()


class _Router:
    """What OpenAIApp needs of RouterService. Generate records its request, then answers, or
    raises `error` before its first message (`after_one` False) or after one."""
    model_id, max_model_len = "fake-model", 2048
    tokenizer = _Tokenizer()

    def __init__(self, error: Exception | None = None, after_one: bool = False, refuse_with: RpcError | None = None):
        self.keys = KeyTable()
        self.requests: list[router_pb2.GenerateRequest] = []
        self.error, self.after_one, self.refuse_with = error, after_one, refuse_with

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.refuse_with is not None:  # as the router's admission refuses: no raise, no message
            refuse(context, self.refuse_with)
            return
        if self.error is not None and not self.after_one:
            raise self.error
        yield router_pb2.GenerateResponse(text="Hel", token_ids=[1])
        if self.error is not None:
            raise self.error
        yield router_pb2.GenerateResponse(text="lo", token_ids=[2], finished=True, finish_reason="stop",
                                          usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2))


async def _exchange(service, method: str, path: str, body=None) -> tuple[int, dict, bytes]:
    from aiohttp.test_utils import TestClient, TestServer

    from ember.services.router.openai_http import OpenAIApp
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    async with TestClient(TestServer(OpenAIApp(service).app)) as client:
        response = await client.request(method, path, data=raw, headers={"Content-Type": "application/json"})
        return response.status, dict(response.headers), await response.read()


def assert_reaches_generate(body: dict) -> None:
    service = _Router()
    status, _, raw = post(service, body)
    assert status == 200, raw
    assert len(service.requests) == body.get("n", 1), "one Generate per choice"


def post(service, body, path: str = "/v1/chat/completions") -> tuple[int, dict, bytes]:
    return asyncio.run(_exchange(service, "POST", path, body))


def error_of(raw: bytes) -> dict:
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == KEYS, body
    return body["error"]


def sse_events(raw: bytes) -> list:
    lines = [line for line in raw.decode().split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


# -- gRPC status -> HTTP, before the answer started ------------------------------------------------
CODES = [  # gRPC status, HTTP status, type, code (the named one; mid-stream: else the status)
    (S.INVALID_ARGUMENT, 400, "invalid_request_error", None),
    (S.FAILED_PRECONDITION, 400, "invalid_request_error", None),
    (S.UNAUTHENTICATED, 401, "invalid_request_error", "invalid_api_key"),
    (S.PERMISSION_DENIED, 403, "permission_error", None),
    (S.NOT_FOUND, 404, "invalid_request_error", None),
    (S.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded"),
    (S.UNAVAILABLE, 503, "server_error", None),
    (S.DEADLINE_EXCEEDED, 504, "server_error", None),
    (S.DATA_LOSS, 500, "server_error", None),
    (S.INTERNAL, 500, "server_error", None),
    (S.UNKNOWN, 500, "server_error", None),
]
IDS = [c[0].name for c in CODES]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("grpc_code, status, kind, code", CODES, ids=IDS)
def test_a_refusal_before_the_first_message_is_the_http_status(grpc_code, status, kind, code, stream):
    retry = 1.5 if grpc_code == S.RESOURCE_EXHAUSTED else None
    service = _Router(RpcError(grpc_code, f"refused with {grpc_code.name}", retry_after_s=retry))
    got, headers, raw = post(service, {"messages": USER, "stream": stream})
    error = error_of(raw)
    assert got == status and headers["Content-Type"].startswith("application/json")
    assert (error["type"], error["code"], error["param"]) == (kind, code, None)
    assert error["message"] == f"refused with {grpc_code.name}"
    assert headers.get("Retry-After") == ("2" if retry else None)  # rounded up to whole seconds
    assert ("WWW-Authenticate" in headers) == (status == 401)


def test_an_unknown_model_is_404_model_not_found():
    service = _Router(RpcError(S.NOT_FOUND, "model 'gpt-4' is not served here; use 'fake-model' (see ListModels)"))
    status, _, raw = post(service, {"model": "gpt-4", "messages": USER})
    error = error_of(raw)
    assert status == 404 and (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "model_not_found", "model")


def test_admission_refusal_without_raising_is_429_with_retry_after():
    service = _Router(refuse_with=RpcError(S.RESOURCE_EXHAUSTED, "at the admission limit", retry_after_s=3))
    status, headers, raw = post(service, {"messages": USER})
    error = error_of(raw)
    assert status == 429 and headers["Retry-After"] == "3"
    assert (error["type"], error["code"], error["message"]) == ("rate_limit_error", "rate_limit_exceeded",
                                                               "at the admission limit")


def test_an_unexpected_exception_is_500_server_error():
    status, _, raw = post(_Router(RuntimeError("boom")), {"prompt": "x"}, "/v1/completions")
    error = error_of(raw)
    # a generic message: the exception's text is logged (tests/test_router_error_paths.py), never sent
    assert status == 500 and error["type"] == "server_error" and "boom" not in error["message"]


@pytest.mark.parametrize("grpc_code, status, kind, code", CODES, ids=IDS)
def test_the_openai_client_raises_the_matching_error(grpc_code, status, kind, code):
    classes = {400: openai.BadRequestError, 401: openai.AuthenticationError, 403: openai.PermissionDeniedError,
               404: openai.NotFoundError, 429: openai.RateLimitError}

    async def go():
        from aiohttp.test_utils import TestClient, TestServer

        from ember.services.router.openai_http import OpenAIApp
        service = _Router(RpcError(grpc_code, "no"))
        async with TestClient(TestServer(OpenAIApp(service).app)) as client:
            api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
            with pytest.raises(openai.APIStatusError) as e:
                await api.chat.completions.create(model="", messages=USER)
            await api.close()
            return e.value
    e = asyncio.run(go())
    assert isinstance(e, classes.get(status, openai.InternalServerError))
    assert e.status_code == status and e.code == code and e.type == kind and e.body["message"] == "no"


# -- after the stream started ----------------------------------------------------------------------
@pytest.mark.parametrize("grpc_code, status, kind, code", CODES, ids=IDS)
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "stream": True}),
    ("/v1/completions", {"prompt": "x", "stream": True}),
], ids=["chat", "completions"])
def test_a_mid_stream_error_is_one_error_event_then_done(grpc_code, status, kind, code, path, body):
    got, headers, raw = post(_Router(RpcError(grpc_code, "went away"), after_one=True), body, path)
    assert got == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    [error] = [e for e in events[:-1] if "error" in e]
    assert events[-2] is error and set(error) == {"error"} and set(error["error"]) == KEYS
    assert error["error"] == {"message": "went away", "type": kind, "param": None, "code": code or str(status)}
    texts = [e["choices"][0].get("delta", {}).get("content") or e["choices"][0].get("text") for e in events[:-2]]
    assert "Hel" in texts  # what came before the failure was sent


def test_the_openai_client_raises_on_a_mid_stream_error():
    async def go():
        from aiohttp.test_utils import TestClient, TestServer

        from ember.services.router.openai_http import OpenAIApp
        service = _Router(RpcError(S.UNAVAILABLE, "decode worker lost"), after_one=True)
        async with TestClient(TestServer(OpenAIApp(service).app)) as client:
            api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="k", max_retries=0)
            text = []
            with pytest.raises(openai.APIError) as e:
                async for chunk in await api.chat.completions.create(model="", messages=USER, stream=True):
                    text.append(chunk.choices[0].delta.content or "")
            await api.close()
            return "".join(text), e.value
    text, e = asyncio.run(go())
    assert text == "Hel" and e.code == "503" and e.type == "server_error" and "decode worker lost" in e.message


# -- aiohttp's own errors --------------------------------------------------------------------------
def test_unknown_routes_and_methods_are_openai_errors():
    status, _, raw = asyncio.run(_exchange(_Router(), "POST", "/v1/embeddings", {"input": "x"}))
    assert status == 404 and error_of(raw)["message"] == "Invalid URL (POST /v1/embeddings)"
    status, headers, raw = asyncio.run(_exchange(_Router(), "GET", "/v1/chat/completions"))
    assert status == 405 and error_of(raw)["type"] == "invalid_request_error" and "POST" in headers["Allow"]


# -- request bodies ------------------------------------------------------------------------------
UNSUPPORTED = [  # (field, value, code)
    ("audio", {"voice": "alloy", "format": "wav"}, "unsupported_parameter"),
    ("modalities", ["text", "audio"], "unsupported_value"),
    ("prediction", {"type": "content", "content": "x"}, "unsupported_parameter"),
    ("web_search_options", {}, "unsupported_parameter"),
    ("functions", [{"name": "f"}], "unsupported_parameter"),
    ("function_call", "auto", "unsupported_parameter"),
    ("reasoning_effort", "low", "unsupported_parameter"),
    ("store", True, "unsupported_value"),
    ("metadata", {"k": "v"}, "unsupported_value"),
    ("service_tier", "flex", "unsupported_value"),
    ("verbosity", "high", "unsupported_value"),
]


@pytest.mark.parametrize("field, value, code", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_an_unsupported_openai_field_is_400_naming_it(field, value, code):
    service = _Router()
    status, _, raw = post(service, {"messages": USER, field: value})
    error = error_of(raw)
    assert status == 400 and (error["type"], error["param"], error["code"]) == ("invalid_request_error", field, code)
    assert error["message"].startswith(f"{field}: ") and service.requests == []


@pytest.mark.parametrize("body, field, code", [
    ({"prompt": "x", "best_of": 2}, "best_of", "unsupported_value"),
    ({"prompt": "x", "echo": True}, "echo", "unsupported_value"),
    ({"prompt": "x", "suffix": "</code>"}, "suffix", "unsupported_parameter"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of", None),  # OpenAI's rule: best_of >= n
    ({"prompt": "x", "logprobs": 6}, "logprobs", None),
    ({"prompt": "x", "logprobs": True}, "logprobs", None),
    ({"prompt": "x", "messages": USER}, "messages", None),
], ids=["best_of", "echo", "suffix", "best_of<n", "logprobs>5", "logprobs-bool", "messages"])
def test_unsupported_completion_fields_are_400_naming_them(body, field, code):
    service = _Router()
    status, _, raw = post(service, body, "/v1/completions")
    error = error_of(raw)
    assert status == 400 and (error["param"], error["code"]) == (field, code) and service.requests == []


@pytest.mark.parametrize("body", [
    {"messages": USER, "audio": None, "modalities": ["text"], "store": False, "metadata": {},
     "service_tier": "auto", "functions": None, "verbosity": "medium"},
    {"messages": USER, "service_tier": "default", "safety_identifier": "h", "prompt_cache_key": "k"},
], ids=["nulls-and-no-ops", "hints"])
def test_no_op_values_of_unsupported_fields_are_accepted(body):
    assert_reaches_generate(body)


def test_completions_no_op_values_are_accepted():
    service = _Router()
    status, _, raw = post(service, {"prompt": "x", "best_of": 1, "echo": False, "suffix": None}, "/v1/completions")
    assert status == 200, raw
    status, _, raw = post(service, {"prompt": "x", "n": 2, "best_of": 2}, "/v1/completions")
    assert status == 200, raw


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "foo": 1}),
    ("/v1/completions", {"prompt": "x", "foo": 1}),
    ("/v1/chat/completions", {"messages": USER, "foo": 1, "temperature": "hot"}),  # unrecognized first
], ids=["chat", "completions", "with-another-error"])
def test_an_unknown_field_is_openais_unrecognized_argument(path, body):
    service = _Router()
    status, _, raw = post(service, body, path)
    error = error_of(raw)
    assert status == 400 and error["message"] == "Unrecognized request argument supplied: foo"
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "foo", None)


def test_several_unknown_fields_are_named_together():
    status, _, raw = post(_Router(), {"messages": USER, "foo": 1, "bar": 2})
    error = error_of(raw)
    assert status == 400 and error["message"] == "Unrecognized request arguments supplied: foo, bar"


def test_embers_extensions_are_accepted():
    service = _Router()
    status, _, raw = post(service, {"messages": USER, "user_region": "edge", "session_id": "s", "top_k": 4,
                                    "ignore_eos": True, "cache_salt": "salt", "user": "u", "seed": 7})
    assert status == 200, raw
    [pb] = service.requests
    assert (pb.user_region, pb.session_id, pb.cache_salt, pb.sampling.top_k) == ("edge", "s", "salt", 4)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     "messages.0.content.1.type"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio",
                                                "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]},
     "messages.0.content.0.type"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "n": 17}, "n"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "logprobs": 1}, "logprobs"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": USER, "tools": TOOLS * 129}, "tools"),
    ({"messages": USER, "logit_bias": {"hello": 5}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"-1": 5}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"12": 101}}, "logit_bias.12"),
    ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": USER, "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": USER, "frequency_penalty": "1"}, "frequency_penalty"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages.0.function_call"),
], ids=["image", "audio-part", "file-part", "max_tokens=0", "max_completion_tokens=0", "n=17", "n=0",
        "top_logprobs-alone", "top_logprobs-logprobs-false", "top_logprobs>20", "logprobs-int",
        "tool_choice-unknown-function", "tool_choice-without-tools", "tool_choice-mode", "tool_choice-no-function",
        "tool-name", "tool-type", "tool-no-function", "129-tools", "logit_bias-word", "logit_bias-negative",
        "logit_bias-value", "presence>2", "frequency<-2", "penalty-string", "json_schema-missing",
        "json_schema-name", "json_schema-schema-text", "response_format-type", "tool-message-no-id",
        "user-tool_calls", "arguments-object", "function_call-message"])
def test_bad_bodies_are_400_naming_the_field(body, param):
    service = _Router()
    status, _, raw = post(service, body)
    error = error_of(raw)
    assert status == 400, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(f"{param}: ") and service.requests == []


def test_an_image_is_refused_as_text_only():
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    error = error_of(post(_Router(), body)[2])
    assert error["message"] == "messages.0.content.0.type: 'image_url' content is not supported: this model " \
                               "reads text only"


def test_max_tokens_zero_never_becomes_the_default():
    for field in ("max_tokens", "max_completion_tokens"):
        service = _Router()
        status, _, raw = post(service, {"prompt": "x", field: 0}, "/v1/completions")
        assert status == 400 and error_of(raw)["param"] == field and service.requests == []


FULL = {"model": "fake-model", "messages": [
    {"role": "system", "content": "Answer with tools."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "refusal": None, "annotations": [], "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": False, "n": 3, "logprobs": True, "top_logprobs": 5, "presence_penalty": 0.5,
    "frequency_penalty": -1, "logit_bias": {"50256": -100, "7": 2.5}, "seed": 1, "temperature": 0.7,
    "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "strict": True, "schema": {
        "type": "object", "properties": {"sky": {"type": "string"}}, "required": ["sky"]}}}}


@pytest.mark.parametrize("body", [
    FULL,
    {"messages": USER, "tools": TOOLS, "tool_choice": "required", "stream": True},
    {"messages": USER, "tools": TOOLS, "tool_choice": "none"},
    {"messages": USER, "tool_choice": "none"},
    {"messages": USER, "tools": [], "parallel_tool_calls": None},
    {"messages": USER, "response_format": {"type": "json_object"}, "logprobs": True},
    {"messages": USER, "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": None},
    {"messages": USER, "n": 16, "presence_penalty": None, "logit_bias": {}},
], ids=["everything", "required-stream", "none", "none-without-tools", "empty-tools", "json_object", "text", "n=16"])
def test_bodies_with_the_new_fields_reach_generate(body):
    assert_reaches_generate(body)


def test_the_chat_models_read_out_what_the_engine_needs():
    body = ChatCompletionRequest.model_validate_json(json.dumps(FULL))
    assert body.n == 3 and body.engine_logprobs == 5
    assert (body.presence_penalty, body.frequency_penalty) == (0.5, -1.0)
    assert body.logit_bias_ids == {50256: -100.0, 7: 2.5}
    assert (body.tool_choice_mode, body.tool_choice_name, body.parallel_tool_calls) == ("function", "get_weather",
                                                                                        False)
    assert json.loads(body.tools_json) == TOOLS
    kind, schema = body.constraint
    assert kind == "json_schema" and json.loads(schema) == FULL["response_format"]["json_schema"]["schema"]
    system, user, assistant, tool = body.messages
    assert user.text == "Weather in Paris?" and assistant.text == "" and tool.text == "sunny"
    assert json.loads(assistant.tool_calls_json) == FULL["messages"][2]["tool_calls"] and user.tool_calls_json == ""
    assert (tool.tool_call_id, tool.role) == ("call_1", "tool")

    plain = ChatCompletionRequest.model_validate_json(json.dumps({"messages": USER}))
    assert (plain.engine_logprobs, plain.logit_bias_ids, plain.constraint, plain.tools_json) == (None, {}, None, "")
    assert (plain.tool_choice_mode, plain.tool_choice_name, plain.parallel_tool_calls) == ("none", None, True)
    assert (plain.presence_penalty, plain.frequency_penalty, plain.n, plain.new_tokens) == (0.0, 0.0, 1, 256)

    def read(**fields) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate_json(json.dumps({"messages": USER} | fields))
    assert read(logprobs=True).engine_logprobs == 0 and read(logprobs=False).engine_logprobs is None
    assert read(tools=TOOLS).tool_choice_mode == "auto" and read(tools=TOOLS, tool_choice="none").tool_choice_mode \
        == "none"
    assert read(response_format={"type": "json_object"}).constraint == ("json_object", "")
    assert read(tools=[{"type": "function", "function": {"name": "f"}}]).tools[0].function.parameters == {
        "type": "object", "properties": {}}
    assert read(max_tokens=9, max_completion_tokens=5).new_tokens == 5


def test_completion_logprobs_are_the_legacy_count():
    def read(**fields) -> CompletionRequest:
        return CompletionRequest.model_validate_json(json.dumps({"prompt": "x"} | fields))
    assert read().engine_logprobs is None and read(logprobs=0).engine_logprobs == 0
    assert read(logprobs=5).engine_logprobs == 5 and read(logit_bias={"3": 1}).logit_bias_ids == {3: 1.0}


def test_user_and_the_sampling_fields_reach_the_generate_request():
    service = _Router()
    body = {"messages": USER, "user": "alice", "n": 2, "seed": 7, "logprobs": True, "top_logprobs": 2,
            "presence_penalty": 0.5, "logit_bias": {"11": -5},
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}
    status, _, raw = post(service, body)
    assert status == 200, raw
    first, second = service.requests
    assert first.user == "alice" and first.sampling.logprobs == 2 and first.sampling.presence_penalty == 0.5
    assert dict(first.sampling.logit_bias) == {11: -5.0} and first.sampling.constraint.json_schema
    assert (first.sampling.seed, second.sampling.seed) == (7, 8), "choice i samples with seed + i"
