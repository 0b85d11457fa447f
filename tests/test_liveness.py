"""A peer that accepts bytes but never answers (the chaos relay's blackhole) is abandoned within
a bound on both sides, with the product's own channel and server options: a client's call fails
UNAVAILABLE within KEEPALIVE_S + KEEPALIVE_TIMEOUT_S instead of waiting out its deadline, and a
server cancels the handler of a client that went silent (no keepalive of its own) within
SERVER_KEEPALIVE_S + KEEPALIVE_TIMEOUT_S: no compute for nobody."""
from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember.cluster.ports import free_port
from ember.cluster.wan import LinkState, Relay, serve
from ember.rpc.server import CHANNEL_OPTIONS, KEEPALIVE_S, KEEPALIVE_TIMEOUT_S, SERVER_KEEPALIVE_S, SERVER_OPTIONS

SLACK_S = 5.0  # keepalive runs on gRPC-core timers: a loaded host delays them little


class NeverAnswers(health_pb2_grpc.HealthServicer):
    """A handler that runs until cancelled; records when it was."""

    def __init__(self):
        self.started = asyncio.Event()
        self.cancelled_at: float | None = None

    async def Check(self, request, context):
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled_at = time.monotonic()
            raise
        return health_pb2.HealthCheckResponse()


async def blackholed_call(client_options: list) -> tuple[float, float, grpc.StatusCode]:
    """A call through a relay that is blackholed once the handler runs: seconds until the client's
    call ended, seconds until the server cancelled the handler, and the client's status."""
    servicer = NeverAnswers()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    listen, states = f"127.0.0.1:{free_port()}", {}
    relays = await serve([Relay(listen, f"127.0.0.1:{port}", rtt_ms=2, gbps=1.0)], states)
    channel = grpc.aio.insecure_channel(listen, options=client_options)
    try:
        # a deadline far past the bounds: the call must not be ended by it
        call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=120)
        await asyncio.wait_for(servicer.started.wait(), 10)
        state: LinkState = states[listen]
        state.set("blackhole")
        cut = time.monotonic()
        try:
            await call
            raise AssertionError("a call to a blackholed peer returned")
        except grpc.aio.AioRpcError as e:
            code, client_s = e.code(), time.monotonic() - cut
        while servicer.cancelled_at is None:
            assert time.monotonic() - cut < 60, "the server never dropped the handler"
            await asyncio.sleep(0.1)
        return client_s, servicer.cancelled_at - cut, code
    finally:
        await channel.close()
        for r in relays:
            r.close()
        await server.stop(None)


def test_a_blackholed_peer_is_abandoned_by_client_and_server_within_the_keepalive_bound():
    silent_client = [o for o in CHANNEL_OPTIONS if not o[0].startswith(("grpc.keepalive", "grpc.http2"))]

    async def both():
        return await asyncio.gather(blackholed_call(CHANNEL_OPTIONS), blackholed_call(silent_client))
    (client_s, _, code), (_, server_s, _) = asyncio.run(asyncio.wait_for(both(), 90))
    print(f"blackholed peer abandoned: by an Ember client after {client_s:.1f} s, "
          f"by an Ember server (client silent) after {server_s:.1f} s")
    assert code == grpc.StatusCode.UNAVAILABLE
    assert client_s <= KEEPALIVE_S + KEEPALIVE_TIMEOUT_S + SLACK_S, client_s
    assert server_s <= SERVER_KEEPALIVE_S + KEEPALIVE_TIMEOUT_S + SLACK_S, server_s
    assert server_s >= 1.0, "the silent client really relied on the server's keepalive"
