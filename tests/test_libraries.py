"""The maintained libraries that replaced hand-rolled code do the job Ember needs of them:
opentelemetry-instrumentation-grpc (spans and context across streaming handlers), the
Prometheus text parser (`ember status`), tqdm (the bench progress bar), pydantic (OpenAI bodies)."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ember.cluster.ports import free_port
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
            raise ValueError("bad request")
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
                        raise ValueError("the handler failed mid-stream")
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

    def same(x: bytes) -> bytes:
        return x
    return grpc.method_handlers_generic_handler("test.Echo", {
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
            for _ in range(200):
                if "slow" in closed:
                    break
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
    assert sorted(closed) == ["fail", "ok", "slow"], "every streaming handler was closed, the cancelled one too"

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
