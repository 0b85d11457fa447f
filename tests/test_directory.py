"""The block directory: one contract for the in-memory and the Redis implementation (a real
redis-server), the kvstore's publisher, and surviving a Redis crash (torch-free)."""
from __future__ import annotations

import asyncio

import pytest

from ember.kv.directory import MemoryDirectory, RedisDirectory
from ember.services.kvstore.publisher import Publisher
from ember.services.kvstore.store import BlockStore
from tests.cluster_fixture import AT_ONCE_S, free_port, wait_until_async
from tests.redis_fixture import RedisServer

H = [bytes([i]) * 16 for i in range(8)]


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(free_port(), tmp_path).start()
    yield server
    server.stop()


def make_directory(kind: str, redis_server, ttl_s: float):
    return MemoryDirectory(ttl_s) if kind == "memory" else RedisDirectory(redis_server.url, ttl_s)


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_directory_reports_the_longest_cached_prefix_per_site(kind, redis_server):
    async def go():
        d = make_directory(kind, redis_server, ttl_s=30)
        await d.publish("central", H[:5], [])
        await d.publish("edge", [H[0], H[1], H[3]], [])
        assert await d.lookup(H[:6], ["central", "edge", "nowhere"]) == {"central": 5, "edge": 2, "nowhere": 0}
        await d.publish("central", [], [H[2]])
        assert await d.lookup(H[:6], ["central"]) == {"central": 2}
        assert await d.lookup([], ["central"]) == {"central": 0}
        await d.close()
    run(go())


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_entries_of_a_silent_kvstore_age_out(kind, redis_server):
    async def go():
        d = make_directory(kind, redis_server, ttl_s=2.0)  # (a publish and a lookup fit in it on a loaded host)
        loop = asyncio.get_running_loop()
        published = loop.time()
        await d.publish("edge", H[:3], [])
        assert (await d.lookup(H[:3], ["edge"]))["edge"] == 3

        async def expired():
            return (await d.lookup(H[:3], ["edge"]))["edge"] == 0
        await wait_until_async(expired, 2.0 + AT_ONCE_S, "the entries expired")  # a dead kvstore's entries expire
        assert loop.time() - published >= 2.0 - 0.02, "not before their TTL"
        await d.close()
    run(go())


def test_redis_lookup_is_one_round_trip(redis_server):
    async def go():
        d = RedisDirectory(redis_server.url)
        await d.publish("a", H, [])
        before = (await d.redis.info("stats"))["total_commands_processed"]
        await d.lookup(H, ["a", "b", "c"])
        after = (await d.redis.info("stats"))["total_commands_processed"]
        assert after - before == 2, "one MGET (plus the INFO that measures it)"
        await d.close()
    run(go())


def block(i: int) -> tuple[bytes, bytes]:
    return H[i], bytes([i]) * 4096


def test_publisher_follows_the_store_and_resyncs_after_redis_comes_back(redis_server):
    async def go():
        store = BlockStore(3 * 4096)
        reader = RedisDirectory(redis_server.url)
        publisher = Publisher(store, RedisDirectory(redis_server.url, ttl_s=30), "edge", retry_s=0.2)
        publisher.start()
        for i in range(3):
            store.put(*block(i))
        await wait_until_async(lambda: _prefix(reader, 3, 3), AT_ONCE_S, "3 blocks published")
        store.put(*block(3))  # evicts block 0
        await wait_until_async(lambda: _prefix(reader, 4, 0), AT_ONCE_S, "the eviction published")
        assert (await reader.lookup(H[1:4], ["edge"]))["edge"] == 3

        redis_server.stop()  # crash: the publisher must not fail the store
        store.put(*block(4))

        async def unhealthy():
            return not publisher.healthy
        await wait_until_async(unhealthy, AT_ONCE_S, "the publisher marked unhealthy")
        assert not publisher._task.done(), "still running, marked unhealthy"
        redis_server.start()  # empty: nothing persisted
        # resynced, including the block added meanwhile
        await wait_until_async(lambda: _held(reader, H[2:5]), AT_ONCE_S, "the store resynced")

        async def healthy():
            return publisher.healthy
        await wait_until_async(healthy, AT_ONCE_S, "the publisher healthy again")
        await publisher.stop()
        await reader.close()
    run(go())


async def _prefix(reader: RedisDirectory, n: int, want: int) -> bool:
    return (await reader.lookup(H[:n], ["edge"]))["edge"] == want


async def _held(reader: RedisDirectory, hashes: list[bytes]) -> bool:
    try:
        return (await reader.lookup(hashes, ["edge"]))["edge"] == len(hashes)
    except Exception:  # noqa: BLE001 - the reader reconnects once redis is back
        return False
