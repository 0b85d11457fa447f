"""The local cluster with its block directory in a real Redis (TLS, one ACL user per role: the
certificates, users and passwords `ember certs` writes for the config), and Redis killed mid-run;
shared memory off, so decode takes the gRPC fallback for KV frames."""
from __future__ import annotations

import asyncio
import time

import pytest

from ember.client import RouterClient
from ember.cluster.launcher import running
from ember.config.load import load_config
from ember.config.services import router_settings
from ember.engine.sampling_params import SamplingParams
from ember.kv.block_hash import chain_hashes
from ember.kv.directory import RedisDirectory
from ember.v1 import decode_pb2, decode_pb2_grpc
from tests.cluster_fixture import dial, free_port, write_config
from tests.conftest import LONG_TEXT
from tests.redis_fixture import RedisServer, installed, secure_overrides, secure_server, write_secure_files


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory, model_path):
    """Private: its block directory is a redis-server this module crashes, and its decode reads frames over
    gRPC (no shared memory)."""
    run_dir = tmp_path_factory.mktemp("redis-cluster")
    port = free_port()
    addr = write_config(run_dir / "cluster.yaml", shared_memory=False,
                        overrides=secure_overrides(f"rediss://127.0.0.1:{port}/0"))
    redis = secure_server(port, write_secure_files(run_dir / "cluster.yaml")).start()
    try:
        with running(run_dir / "cluster.yaml", run_dir, timeout_s=240):
            yield addr | {"config": str(run_dir / "cluster.yaml")}, redis
    finally:
        redis.stop()


def cached_blocks(client: RouterClient, ids: list[int]) -> dict[str, int]:
    out = client.complete(token_ids=ids, max_tokens=3, ignore_eos=True, timeout=120)
    assert len(out.token_ids) == 3
    return dict(out.final.placement.cached_blocks)


def in_redis(redis: RedisServer, hashes: list[bytes], blocks: int, timeout_s: float = 30) -> None:
    """Until Redis itself says both sites hold the prompt's first `blocks` blocks."""
    async def held() -> dict[str, int]:  # as the router reads it: its user, its certificate
        with installed(redis.workdir / "certs" / "router"):
            d = RedisDirectory(router_settings(load_config(redis.workdir / "cluster.yaml")).redis)
        try:
            return await d.lookup(hashes, ["central", "edge"])
        except Exception:  # noqa: BLE001 - redis still starting
            return {}
        finally:
            await d.close()
    deadline = time.monotonic() + timeout_s
    while (seen := asyncio.run(held())) != {"central": blocks, "edge": blocks}:
        assert time.monotonic() < deadline, f"the kvstores did not publish to Redis within {timeout_s} s: {seen}"
        time.sleep(0.05)


def test_router_reads_redis_and_requests_survive_a_redis_crash(redis_cluster, engine):
    addr, redis = redis_cluster
    ids = engine.tokenizer.encode(LONG_TEXT[:700])
    full = len(ids) // 16
    hashes = chain_hashes(ids, 16, engine.block_manager.root_hash)
    with RouterClient(addr["router"]) as client:
        assert cached_blocks(client, ids) == {"central": 0, "edge": 0}, "nothing cached on the first request"
        in_redis(redis, hashes, full)  # kvstores publish in batches every 50 ms
        assert cached_blocks(client, ids) == {"central": full, "edge": full}

        redis.stop()  # crash: the directory is gone, requests must not be
        started = time.monotonic()
        assert cached_blocks(client, ids) == {}, "directory down: placement sees nothing, the request still runs"
        assert cached_blocks(client, ids + [42] * 20) == {}
        assert time.monotonic() - started < 60

        redis.start()  # back, empty: kvstores re-publish what they hold
        in_redis(redis, hashes, full, timeout_s=30)
        # the router skips the directory for DIRECTORY_RETRY_S after a failure: it reads it again once that
        # passed (a republish faster than that would otherwise race the next request)
        deadline = time.monotonic() + 30
        while (seen := cached_blocks(client, ids)) != {"central": full, "edge": full}:
            assert time.monotonic() < deadline, f"the router did not read the directory again: {seen}"
            time.sleep(0.2)


def test_without_shared_memory_decode_streams_frames_over_grpc_and_tokens_match(redis_cluster, engine):
    addr, _ = redis_cluster
    ids = engine.tokenizer.encode("In the archive by the quay, " + LONG_TEXT[700:1400])
    with RouterClient(addr["router"]) as client:
        out = client.complete(token_ids=ids, max_tokens=6, timeout=120)
    [want] = engine.generate([ids], SamplingParams(max_tokens=6))
    assert out.token_ids == want.token_ids
    with dial(addr, "decode") as ch:
        stats = decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.DecodeStatsRequest(), timeout=10)
    assert stats.blocks_grpc >= len(ids) // 16 and stats.blocks_shared_memory == 0
