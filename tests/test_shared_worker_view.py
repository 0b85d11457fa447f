"""Several routers share worker load and down reports through a real redis-server: a router
places away from a worker another router keeps busy, hears at once of a worker another router
found dead (the worker's own health still decides when it is back), and keeps routing on its
own view when Redis dies. The workers are real gRPC health servers; the routers' pools are the
product's WorkerPool (torch-free)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ember.config.load import config_from_dict
from ember.services.router.shared_view import DOWN_CHANNEL, SharedWorkerView
from ember.services.router.workers import WorkerPool
from tests.cluster_fixture import AT_ONCE_S, free_port, wait_until_async
from tests.redis_fixture import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(free_port(), tmp_path).start()
    yield server
    server.stop()


async def health_server(address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server.add_insecure_port(address)
    await server.start()
    return server


def two_decode_workers() -> tuple:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    config = config_from_dict({"model": "unused", "sites": [
        {"name": "edge", "decode": addresses, "kvstore": "127.0.0.1:1"}]}, Path("."))
    return config, addresses


async def until(condition, timeout_s: float = AT_ONCE_S, what: str = "condition") -> float:
    """Seconds until `condition()` held (tests.cluster_fixture.wait_until_async)."""
    start = time.monotonic()
    await wait_until_async(condition, timeout_s, what)
    return time.monotonic() - start


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


async def _at_least(count, n: int) -> bool:
    return await count >= n


def test_a_router_places_away_from_a_worker_another_router_keeps_busy(redis_server):
    async def go():
        config, addresses = two_decode_workers()
        servers = [await health_server(a) for a in addresses]
        a = WorkerPool(config, shared=SharedWorkerView(redis_server.url, "a"))
        b = WorkerPool(config, shared=SharedWorkerView(redis_server.url, "b"))
        lone = WorkerPool(config)  # no shared view: sees only its own calls
        try:
            for pool in (a, b, lone):
                pool.start()
            busy = a.all("decode", "edge")[0]
            busy.running = 3  # router a has three streams on worker 0
            await until(lambda: b.all("decode", "edge")[0].others_running == 3, what="b hears a's load")
            assert b.pick("decode", "edge").address == addresses[1]
            assert lone.pick("decode", "edge").address == addresses[0], "without sharing, worker 0 looks idle"
            busy.running = 0
            await until(lambda: b.all("decode", "edge")[0].others_running == 0, what="a's load drains")
            await a.close()
            a = None
            # a closed router's load is gone at once, not only after its key expires
            assert await b.shared.sync({}) == {}
        finally:
            for pool in (a, b, lone):
                if pool is not None:
                    await pool.close()
            for s in servers:
                await s.stop(None)
    run(go())


def test_a_worker_one_router_finds_dead_is_down_at_the_others_before_their_next_poll(redis_server):
    async def go():
        config, addresses = two_decode_workers()
        servers = [await health_server(a) for a in addresses]
        a = WorkerPool(config, shared=SharedWorkerView(redis_server.url, "a"))
        b = WorkerPool(config, shared=SharedWorkerView(redis_server.url, "b"))
        try:
            for pool in (a, b):
                pool.start()
            async def subscribers() -> int:  # pub/sub delivers only to current subscribers
                return dict(await a.shared.redis.pubsub_numsub(DOWN_CHANNEL)).get(DOWN_CHANNEL.encode(), 0)
            await wait_until_async(lambda: _at_least(subscribers(), 2), AT_ONCE_S, "both routers subscribe")
            at_b = b.all("decode", "edge")[1]
            await until(lambda: at_b.live, what="worker 1 live at b")
            a.down(a.all("decode", "edge")[1], "Decode failed: UNAVAILABLE")
            # `failures` counts only failed calls and reports of them (a health poll that finds the worker
            # down does not count one), and worker 1 still answers SERVING: b heard it over pub/sub
            heard = await until(lambda: at_b.failures == 1, what="b hears of the failure")
            print(f"b heard of the failure after {heard:.3f} s (its own health poll: every 0.5 s)")
            # the worker still answers SERVING: its own health brings it back at both routers
            await until(lambda: at_b.live and a.all("decode", "edge")[1].live, what="health restores it")
        finally:
            for pool in (a, b):
                await pool.close()
            for s in servers:
                await s.stop(None)
    run(go())


def test_with_redis_dead_each_router_keeps_routing_on_its_own_view(redis_server):
    async def go():
        config, addresses = two_decode_workers()
        servers = [await health_server(a) for a in addresses]
        a = WorkerPool(config, shared=SharedWorkerView(redis_server.url, "a"))
        try:
            a.start()
            await a.share_load()
            redis_server.stop()
            started = time.monotonic()
            await a.share_load()  # a dead Redis: a warning, no error, bounded by the socket timeout (0.5 s)
            gave_up_s = time.monotonic() - started
            assert gave_up_s < AT_ONCE_S, gave_up_s
            a.all("decode", "edge")[0].running = 2
            assert a.pick("decode", "edge").address == addresses[1]
            a.down(a.all("decode", "edge")[1], "test")  # announcing to a dead Redis must not raise
            await asyncio.sleep(0)
            assert a.pick("decode", "edge").address == addresses[0]
        finally:
            await a.close()
            for s in servers:
                await s.stop(None)
    run(go())


class SlowHealth(health_pb2_grpc.HealthServicer):
    def __init__(self):
        self.delay_s = 0.0

    async def Check(self, request, context):
        await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_a_slow_health_answer_is_not_a_dead_worker_but_several_in_a_row_are():
    """On a saturated host a health check can time out while the worker streams fine: one or two
    timeouts keep it live; SLOW_CHECKS_DOWN in a row, or a refused connection, mark it down."""
    from ember.services.router.workers import HEALTH_TIMEOUT_S, SLOW_CHECKS_DOWN

    async def go():
        config, addresses = two_decode_workers()
        servicer = SlowHealth()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        server.add_insecure_port(addresses[0])
        await server.start()
        pool = WorkerPool(config)
        worker, absent = pool.all("decode", "edge")
        try:
            await pool.check(worker)
            assert worker.live
            servicer.delay_s = HEALTH_TIMEOUT_S + 0.5
            for _ in range(SLOW_CHECKS_DOWN - 1):
                await pool.check(worker)
                assert worker.live, "a slow answer alone does not mark it down"
            await pool.check(worker)
            assert not worker.live, f"{SLOW_CHECKS_DOWN} timeouts in a row do"
            servicer.delay_s = 0.0
            await pool.check(worker)
            assert worker.live
            await pool.check(absent)  # nothing listens there: down at the first check
            assert not absent.live
        finally:
            await pool.close()
            await server.stop(None)
    run(go())
