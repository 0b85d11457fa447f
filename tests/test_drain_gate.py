"""The drain's gate on a real aio server with the production interceptors: a call counts until
gRPC is done with it (a cancelled one stops counting); once closed, every new call (unary or
streaming, either way) is refused UNAVAILABLE while a running client-streaming call runs to
completion, and `idle` waits for it. (tests/test_drain.py drains the real services with SIGTERM.)"""
import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ember.rpc import tracing
from ember.rpc.drain import DrainGate
from ember.rpc.errors import ErrorInterceptor

SERVICE = "ember.test.Gated"


def serve(gate: DrainGate, entered: asyncio.Event, hang: asyncio.Event) -> grpc.aio.Server:
    async def echo(request: bytes, context) -> bytes:
        return request

    async def hold(request: bytes, context) -> bytes:  # runs until its client cancels it
        hang.set()
        await asyncio.Event().wait()

    async def chat(requests, context):
        async for r in requests:
            yield r

    async def collect(requests, context) -> bytes:  # a Put-like call held open by its client
        entered.set()
        return b"".join([r async for r in requests])

    async def count(request: bytes, context):
        for i in range(3):
            yield bytes([i])
    # the interceptors in production order (ember.rpc.server.Server): the tracing one turns a
    # streaming handler into a coroutine writing to its context
    server = grpc.aio.server(interceptors=[gate, tracing.server_interceptor(), ErrorInterceptor()])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Hold": grpc.unary_unary_rpc_method_handler(hold),
        "Chat": grpc.stream_stream_rpc_method_handler(chat),
        "Collect": grpc.stream_unary_rpc_method_handler(collect),
        "Count": grpc.unary_stream_rpc_method_handler(count)}),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server


def test_a_closed_gate_refuses_new_calls_unavailable_and_waits_for_the_running_ones():
    async def main():
        gate, release, entered, hang = DrainGate(), asyncio.Event(), asyncio.Event(), asyncio.Event()
        server = serve(gate, entered, hang)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                echo = ch.unary_unary(f"/{SERVICE}/Echo")
                count = ch.unary_stream(f"/{SERVICE}/Count")
                assert await echo(b"x", timeout=5) == b"x"
                assert [m async for m in count(b"", timeout=5)] == [b"\0", b"\1", b"\2"]
                chat = ch.stream_stream(f"/{SERVICE}/Chat")
                assert [m async for m in chat(iter([b"p", b"q"]), timeout=5)] == [b"p", b"q"]
                # a call its client cancels stops counting (a drain does not wait for it)
                held = ch.unary_unary(f"/{SERVICE}/Hold")(b"", timeout=10)
                await asyncio.wait_for(hang.wait(), 5)
                assert gate.running == 1
                held.cancel()
                assert await gate.idle(5), "a cancelled call still counted"

                async def held():
                    yield b"a"
                    await release.wait()
                    yield b"b"
                running = asyncio.ensure_future(ch.stream_unary(f"/{SERVICE}/Collect")(held(), timeout=10))
                await asyncio.wait_for(entered.wait(), 5)
                assert gate.running == 1
                gate.close()
                for call in (echo(b"x", timeout=5), count(b"", timeout=5).read(),
                             chat(iter([b"p"]), timeout=5).read()):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
                    assert "draining" in refused.value.details()
                # health still answers through the gate (a drain says NOT_SERVING there)
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                assert not await gate.idle(0.2), "idle while a call still runs"
                release.set()
                assert await gate.idle(5)
                assert await running == b"ab", "the running call completed"
                assert gate.running == 0
        finally:
            await server.stop(0)
    asyncio.run(main())
