"""The maintained libraries that replaced hand-rolled code do the job Ember needs of them:
opentelemetry-instrumentation-grpc (spans and context across streaming handlers), the
Prometheus text parser (`ember status`), tqdm (the bench progress bar), pydantic (OpenAI bodies)."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ember.cluster.ports import free_port
from ember.errors import InvalidRequestError
from ember.rpc import tracing
from ember.rpc.errors import RpcError
from ember.rpc.server import Server, channel


@pytest.fixture(scope="module")
def exporter():
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(resource=Resource.create({"service.name": "test"}))
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def _echo_service(address: str, closed: list[str]) -> grpc.GenericRpcHandler:
    """test.Echo: Unary (fails on b"bad"), and Stream, a server-streaming handler that awaits,
    annotates and calls out (unary and streaming) at different steps."""

    async def unary(request: bytes, context) -> bytes:
        tracing.annotate(unary_got=request.decode())
        await asyncio.sleep(0)
        if request == b"bad":
            raise InvalidRequestError("bad request")
        if request == b"gone":
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "gone")
        return request

    async def stream(request: bytes, context):
        try:
            async with channel(address) as ch:
                call_unary = ch.unary_unary("/test.Echo/Unary")
                call_stream = ch.unary_stream("/test.Echo/Count")
                for step in range(4):
                    await asyncio.sleep(0.01)
                    tracing.annotate(**{f"step_{step}": step})
                    if step == 1:
                        await call_unary(b"inner-unary", timeout=10)
                    if step == 2:
                        assert [m async for m in call_stream(b"3", timeout=10)] == [b"0", b"1", b"2"]
                    if request == b"fail" and step == 2:
                        raise InvalidRequestError("the handler failed mid-stream")
                    yield str(step).encode()
                    if request == b"slow":
                        await asyncio.sleep(30)
        finally:
            closed.append(request.decode())

    async def count(request: bytes, context):
        for i in range(int(request)):
            await asyncio.sleep(0)
            tracing.annotate(counted=i)
            yield str(i).encode()

    async def flood(request: bytes, context):
        # never awaits itself: a client that stops reading leaves it blocked in gRPC's write
        sent = 0
        try:
            while True:
                yield b"x" * 2**20
                sent += 1
        except (asyncio.CancelledError, GeneratorExit):
            tracing.annotate(flood_sent=sent)  # must land on the SERVER span, before it ends
            raise
        finally:
            closed.append("flood")

    def same(x: bytes) -> bytes:
        return x
    return grpc.method_handlers_generic_handler("test.Echo", {
        "Flood": grpc.unary_stream_rpc_method_handler(flood, same, same),
        "Unary": grpc.unary_unary_rpc_method_handler(unary, same, same),
        "Stream": grpc.unary_stream_rpc_method_handler(stream, same, same),
        "Count": grpc.unary_stream_rpc_method_handler(count, same, same)})


async def _scenario(exporter) -> tuple[dict, list[str]]:
    address = f"127.0.0.1:{free_port()}"
    closed: list[str] = []
    server = Server(address, ["test.Echo"])
    server.server.add_generic_rpc_handlers((_echo_service(address, closed),))
    await server.server.start()
    await server.set_status(health_pb2.HealthCheckResponse.SERVING)
    results = {}
    try:
        async with channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == \
                health_pb2.HealthCheckResponse.SERVING
            with tracing.tracer.start_as_current_span("caller") as caller:
                results["caller"] = caller.get_span_context()
                results["ok"] = [m async for m in ch.unary_stream("/test.Echo/Stream")(b"ok", timeout=30)]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [m async for m in ch.unary_stream("/test.Echo/Stream")(b"fail", timeout=30)]
            results["fail"] = e.value.code()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/test.Echo/Unary")(b"bad", timeout=10)
            results["bad"] = e.value.code()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary("/test.Echo/Unary")(b"gone", timeout=10)
            results["gone"] = e.value.code()
            slow = ch.unary_stream("/test.Echo/Stream")(b"slow", timeout=30)
            assert await slow.__aiter__().__anext__() == b"0"
            slow.cancel()  # the client goes away mid-stream
            flood = ch.unary_stream("/test.Echo/Flood")(b"", timeout=30)
            assert len(await flood.__aiter__().__anext__()) == 2**20
            await asyncio.sleep(0.2)  # the server fills the flow-control window and blocks writing
            flood.cancel()  # ... so the cancel reaches it in gRPC's write, not in the handler
            deadline = time.monotonic() + 30
            while not {"slow", "flood"} <= set(closed):
                assert time.monotonic() < deadline, f"the server never closed both handlers: {closed}"
                await asyncio.sleep(0.01)
    finally:
        await server.server.stop(0)
    return results, closed


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_grpc_instrumentation_keeps_streaming_handlers_in_their_span(exporter, caplog, loop):
    """A server-streaming handler's annotations land on its SERVER span at every step, its
    outgoing calls (unary and streaming) are children of it, errors mark it, health checks are
    not traced, a client cancel closes the handler at once, and no context is detached wrongly."""
    exporter.clear()
    with caplog.at_level(logging.ERROR, logger="opentelemetry"):
        if loop == "uvloop":
            import uvloop
            results, closed = uvloop.run(_scenario(exporter))
        else:
            results, closed = asyncio.run(_scenario(exporter))
    assert not [r for r in caplog.records if "detach" in r.getMessage()], caplog.text
    assert results["ok"] == [b"0", b"1", b"2", b"3"]
    assert results["fail"] == grpc.StatusCode.INVALID_ARGUMENT and results["bad"] == grpc.StatusCode.INVALID_ARGUMENT
    assert results["gone"] == grpc.StatusCode.UNAVAILABLE
    assert sorted(closed) == ["fail", "flood", "ok", "slow"], "every streaming handler closed, cancelled ones too"

    spans = exporter.get_finished_spans()
    assert not [s for s in spans if s.name.startswith("/grpc.")], "health checks stay out of traces"
    caller = results["caller"]
    mine = [s for s in spans if s.context.trace_id == caller.trace_id]
    by_id = {s.context.span_id: s for s in mine}
    [client] = [s for s in mine if s.name == "/test.Echo/Stream" and s.kind == trace.SpanKind.CLIENT]
    [server] = [s for s in mine if s.name == "/test.Echo/Stream" and s.kind == trace.SpanKind.SERVER]
    assert client.parent.span_id == caller.span_id and server.parent.span_id == client.context.span_id
    assert {f"ember.step_{i}" for i in range(4)} <= set(server.attributes), "every step annotates the SERVER span"
    for name in ("/test.Echo/Unary", "/test.Echo/Count"):
        [out] = [s for s in mine if s.name == name and s.kind == trace.SpanKind.CLIENT]
        [inner] = [s for s in mine if s.name == name and s.kind == trace.SpanKind.SERVER]
        assert out.parent.span_id == server.context.span_id, f"{name}, called from the stream, is its child"
        assert inner.parent.span_id == out.context.span_id
    [unary] = [s for s in mine if s.name == "/test.Echo/Unary" and s.kind == trace.SpanKind.SERVER]
    assert unary.attributes["ember.unary_got"] == "inner-unary"
    [count] = [s for s in mine if s.name == "/test.Echo/Count" and s.kind == trace.SpanKind.SERVER]
    assert count.attributes["ember.counted"] == 2
    assert all(s.parent.span_id in by_id for s in mine if s.name != "caller"), "one connected trace"

    failed = [s for s in spans if s.name == "/test.Echo/Stream" and s.kind == trace.SpanKind.SERVER
              and s.status.status_code == trace.StatusCode.ERROR]
    assert len(failed) == 1 and failed[0].attributes["ember.status_code"] == "INVALID_ARGUMENT"
    assert "ember.step_2" in failed[0].attributes and "ember.step_3" not in failed[0].attributes
    gone = [s for s in spans if s.kind == trace.SpanKind.SERVER and s.attributes.get("ember.unary_got") == "gone"]
    assert gone[0].status.status_code == trace.StatusCode.ERROR and gone[0].attributes["rpc.grpc.status_code"] == 14
    cancelled = [s for s in spans if s.kind == trace.SpanKind.SERVER and s.name == "/test.Echo/Stream"
                 and "ember.step_0" in s.attributes and "ember.step_1" not in s.attributes]
    assert len(cancelled) == 1, "the cancelled stream's span ended too"
    [flooded] = [s for s in spans if s.kind == trace.SpanKind.SERVER and s.name == "/test.Echo/Flood"]
    assert flooded.attributes.get("ember.flood_sent", 0) >= 1, \
        "a handler cancelled while gRPC writes is closed inside its span (its last words are kept)"


class _FakeRouter:
    """What OpenAIApp needs of RouterService; Generate records its request and, when given an
    address, makes a gRPC call there (as the real one calls prefill and decode)."""
    model_id, max_model_len = "fake-model", 2048

    def __init__(self, call: str | None = None):
        self.requests, self.call = [], call

    async def Generate(self, request, context):
        from ember.v1 import common_pb2, router_pb2
        self.requests.append(request)
        tracing.annotate(request_id="http-1")
        if self.call:
            async with channel(self.call) as ch:
                assert await ch.unary_unary("/test.Echo/Unary")(b"from-http", timeout=10) == b"from-http"
        yield router_pb2.GenerateResponse(text="Hello")
        yield router_pb2.GenerateResponse(text=" there", finished=True, finish_reason="stop",
                                          usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=2))


async def _http(service, requests: list[tuple[str, bytes]]) -> list[tuple[int, dict]]:
    from aiohttp.test_utils import TestClient, TestServer

    from ember.services.router.openai_http import OpenAIApp
    out = []
    async with TestClient(TestServer(OpenAIApp(service).app)) as client:
        for path, body in requests:
            response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
            out.append((response.status, await response.json()))
    return out


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": USER, "max_tokens": -1}, "max_tokens"),
    ({"messages": USER, "max_tokens": "12"}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "temperature": -0.5}, "temperature"),
    ({"messages": USER, "top_p": 1.5}, "top_p"),
    ({"messages": USER, "top_k": -1}, "top_k"),
    ({"messages": USER, "seed": -1}, "seed"),
    ({"messages": USER, "n": 17}, "n"),
    ({"messages": USER, "stop": 5}, "stop"),
    ({"messages": USER, "stop": ["ok", ""]}, "stop.1"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"messages": []}, "messages"),
    ({"model": "x"}, "messages"),
    (b"{not json", None),
    (b"", None),
    (b"[1, 2]", None),
])
def test_bad_openai_bodies_are_400_naming_the_field(body, param):
    raw = body if isinstance(body, bytes) else __import__("json").dumps(body)
    service = _FakeRouter()
    [(status, answer)] = asyncio.run(_http(service, [("/v1/chat/completions", raw)]))
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    if param:
        assert error["message"].startswith(f"{param}: ")
    assert service.requests == [], "nothing reached the router"


def test_bad_completion_prompt_is_400():
    [(status, answer)] = asyncio.run(_http(_FakeRouter(), [("/v1/completions", b'{"prompt": ["a", "b"]}')]))
    assert status == 400 and answer["error"]["param"] == "prompt"


def test_openai_bodies_become_generate_requests():
    import json
    service = _FakeRouter()
    chat = {"model": "fake-model", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]},
                                                {"role": "assistant", "content": None}],
            "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.9, "seed": 3, "stop": "\n",
            "user": "someone", "stream_options": {"include_usage": True}, "logit_bias": {}, "frequency_penalty": 0,
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
            "top_k": 4, "ignore_eos": True, "user_region": "edge", "session_id": "s1", "speculative": False}
    results = asyncio.run(_http(service, [("/v1/chat/completions", json.dumps(chat).encode()),
                                          ("/v1/completions", b'{"prompt": ["Once"]}')]))
    assert [status for status, _ in results] == [200, 200]
    assert results[0][1]["choices"][0]["message"] == {"role": "assistant", "content": "Hello there"}
    assert results[1][1]["choices"][0]["text"] == "Hello there"
    pb, text = service.requests
    assert [(m.role, m.content) for m in pb.chat.messages] == [("system", "Be brief."), ("user", "ab"),
                                                                ("assistant", "")]
    assert json.loads(pb.chat.tools_json) == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}]  # parameters: OpenAI's default
    s = pb.sampling
    assert (s.max_tokens, s.top_k, s.seed, list(s.stop), s.ignore_eos) == (7, 4, 3, ["\n"], True)
    assert s.temperature == 0 and abs(s.top_p - 0.9) < 1e-6
    assert s.HasField("speculative") and not s.speculative  # Ember's switch; unset: the server's default
    assert not text.sampling.HasField("speculative")
    assert (pb.model, pb.user_region, pb.session_id) == ("fake-model", "edge", "s1")
    assert text.text == "Once" and text.sampling.max_tokens == 256 and not text.sampling.HasField("seed")


def test_an_http_request_is_one_trace_with_the_grpc_calls_it_makes(exporter):
    """opentelemetry-instrumentation-aiohttp-server: each request is a SERVER span, what the
    handler annotates lands on it, and the gRPC calls it makes are its children; /health is not traced."""
    import json

    async def scenario():
        address = f"127.0.0.1:{free_port()}"
        server = Server(address, ["test.Echo"])
        server.server.add_generic_rpc_handlers((_echo_service(address, []),))
        await server.server.start()
        try:
            from aiohttp.test_utils import TestClient, TestServer

            from ember.services.router.openai_http import OpenAIApp
            async with TestClient(TestServer(OpenAIApp(_FakeRouter(call=address)).app)) as client:
                assert (await client.get("/health")).status == 200
                response = await client.post("/v1/chat/completions", data=json.dumps({"messages": USER}))
                assert response.status == 200, await response.text()
        finally:
            await server.server.stop(0)

    exporter.clear()
    asyncio.run(scenario())
    spans = exporter.get_finished_spans()
    [http] = [s for s in spans if s.kind == trace.SpanKind.SERVER and s.name == "POST /v1/chat/completions"]
    assert http.parent is None and http.attributes["ember.request_id"] == "http-1"
    assert not [s for s in spans if "/health" in s.name]
    mine = [s for s in spans if s.context.trace_id == http.context.trace_id]
    [call] = [s for s in mine if s.kind == trace.SpanKind.CLIENT]
    [echo] = [s for s in mine if s.kind == trace.SpanKind.SERVER and s.name == "/test.Echo/Unary"]
    assert call.parent.span_id == http.context.span_id and echo.parent.span_id == call.context.span_id
    assert echo.attributes["ember.unary_got"] == "from-http"


def test_status_scrape_reads_prometheus_text():
    """`ember status` reads a service's /metrics with prometheus_client's parser: the unlabelled
    names rows() looks up, counters' _total, histograms' _count, labels kept."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from ember.cluster import status
    registry = CollectorRegistry()
    Gauge("ember:num_requests_running", "running", registry=registry).set(3)
    Gauge("ember:kv_cache_usage_perc", "usage", registry=registry).set(0.25)
    Histogram("ember:e2e_request_latency_seconds", "e2e", registry=registry).observe(0.5)
    Counter("ember:request_errors", "errors", ["code", "method"], registry=registry).labels(
        "INVALID_ARGUMENT", "/ember.v1.Router/Generate").inc(2)
    body = generate_latest(registry)

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        m = status.scrape(f"127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert m["ember:num_requests_running"] == 3 and m["ember:kv_cache_usage_perc"] == 0.25
    assert m["ember:e2e_request_latency_seconds_count"] == 1 and m["ember:e2e_request_latency_seconds_sum"] == 0.5
    assert m['ember:request_errors_total{code="INVALID_ARGUMENT",method="/ember.v1.Router/Generate"}'] == 2
    assert status.scrape(None) == {} and status.scrape(f"127.0.0.1:{free_port()}") == {}


def test_only_embers_own_errors_get_a_status_anything_else_is_internal():
    from ember.errors import CapacityError, IntegrityError, NotFoundError
    from ember.rpc.errors import status_for
    assert status_for(InvalidRequestError("x"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(CapacityError("x"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_for(IntegrityError("x"))[0] == grpc.StatusCode.DATA_LOSS
    assert status_for(NotFoundError("x"))[0] == grpc.StatusCode.NOT_FOUND
    import ssl  # the data plane's TLS: a connection cut mid-block, a peer whose certificate fails
    assert status_for(ssl.SSLEOFError(8, "EOF occurred in violation of protocol"))[0] == grpc.StatusCode.UNAVAILABLE
    assert status_for(ssl.SSLCertVerificationError(1, "bad"))[0] == grpc.StatusCode.UNAUTHENTICATED
    for bug in (ValueError("x"), KeyError("x"), OSError("x"), IndexError("index out of range")):
        assert status_for(bug)[0] == grpc.StatusCode.INTERNAL, f"{type(bug).__name__} must not hide as a status"
