"""The KVStore servicer over real gRPC (two stores in one process): pulls, capacity,
integrity, leases, codecs and the shared-memory arena (torch-free)."""
from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager

import grpc
import pytest

from ember.kv import bulk, codec, transfer, wire
from ember.kv.chunks import split
from ember.kv.shm import ArenaReader, ArenaServer
from ember.rpc.errors import ErrorInterceptor
from ember.services.kvstore.service import KVStoreService
from ember.services.kvstore.store import BlockStore
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.cluster_fixture import AT_ONCE_S, wait_until_async
from tests.test_kvstore_unit import frame

SIZE = wire.frame_bytes(2 * 2 * 2 * 16 * 4 * 2)  # tests.test_kv_wire.LAYOUT


@asynccontextmanager
async def kvstore(num_blocks: int, codec_mode: str = "raw", max_lease_s: float = 30.0):
    """A real grpc.aio KVStore server with its TCP data plane; yields (service, stub, address)."""
    store = BlockStore(num_blocks * SIZE, max_lease_s=max_lease_s)
    data = await transfer.serve("127.0.0.1", 0, store.pinned)
    service = KVStoreService(store, f"127.0.0.1:{data.sockets[0].getsockname()[1]}", codec_mode)
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, server)
    server.add_generic_rpc_handlers((bulk.handler(store.pinned, service.put_frame, service.expect),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            yield service, kvstore_pb2_grpc.KVStoreStub(ch), address
        finally:
            data.close()
            await server.stop(0)


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


async def until(condition, stub, deadline_s: float) -> kvstore_pb2.StatsResponse:
    """The store's Stats once `condition(stats)` holds (tests.cluster_fixture.wait_until_async)."""
    async def stats_if_met():
        stats = await stub.Stats(kvstore_pb2.StatsRequest())
        return stats if condition(stats) else None
    return await wait_until_async(stats_if_met, deadline_s, "the kvstore's stats to meet the condition")


def seeded(store: BlockStore, n: int) -> list[tuple[bytes, bytes]]:
    """n test frames (hash, frame), put in `store`."""
    blocks = [frame(i) for i in range(n)]
    for h, f in blocks:
        store.put(h, f)
    return blocks


def put_request(blocks):
    return (kvstore_pb2.BlockChunk(block_hash=h, block_bytes=n, offset=o, data=d) for h, n, o, d in split(blocks))


def test_concurrent_pulls_of_the_same_blocks_fetch_them_once():
    async def go():
        async with kvstore(16) as (src, _, src_addr), kvstore(16) as (dst, dst_stub, _):
            blocks = seeded(src.store, 6)
            hashes = [h for h, _ in blocks]
            request = kvstore_pb2.PullRequest(block_hashes=hashes, source=src_addr)
            first, second = await asyncio.gather(dst_stub.Pull(request), dst_stub.Pull(request))
            assert first.blocks_pulled + second.blocks_pulled == 6
            assert src.store.stats.blocks_served == 6, "each block crossed once"
            assert all(bytes(dst.store.get(h)) == f for h, f in blocks)
    run(go())


def test_a_pull_waits_for_an_announced_push_and_fetches_only_what_it_did_not_deliver():
    """KV streaming's receiving end: a Put that announced its blocks makes a Pull of them wait for
    each as it lands; cut short, the Pull fetches from the source what it never delivered."""
    async def go():
        async with kvstore(16) as (src, _, src_addr), kvstore(16) as (dst, dst_stub, dst_addr):
            blocks = seeded(src.store, 4)
            hashes = [h for h, _ in blocks]
            stalled = asyncio.Event()

            async def push():  # two blocks, then the stream stalls (a link that stopped)
                for h, f in blocks[:2]:
                    yield h + f
                await stalled.wait()
            async with grpc.aio.insecure_channel(dst_addr) as ch:
                call = ch.stream_unary(bulk.PUT)(push(), metadata=((bulk.ANNOUNCE, b"".join(hashes)),))
                await until(lambda st: st.blocks == 2, dst_stub, 10)
                pull = asyncio.ensure_future(dst_stub.Pull(kvstore_pb2.PullRequest(block_hashes=hashes,
                                                                                   source=src_addr)))
                done, _ = await asyncio.wait([pull], timeout=0.3)
                assert not done, "the pull waits for the announced blocks instead of fetching them"
                call.cancel()  # the push dies with two blocks undelivered
                response = await pull
            assert response.blocks_pulled == 2 and src.store.stats.blocks_served == 2
            assert all(bytes(dst.store.get(h)) == f for h, f in blocks)
            assert not dst._pulling and not dst._pushing
    run(go())


def test_a_waiting_pull_that_gives_up_leaves_the_push_it_waited_on_intact():
    """A Pull waiting on an announced push whose caller goes away (its deadline) must not cancel
    what others share: the push still files every block, and the next Pull finds them."""
    async def go():
        async with kvstore(16) as (src, _, src_addr), kvstore(16) as (dst, dst_stub, dst_addr):
            blocks = seeded(src.store, 3)
            hashes = [h for h, _ in blocks]
            go_on = asyncio.Event()

            async def push():
                yield blocks[0][0] + blocks[0][1]
                await go_on.wait()
                for h, f in blocks[1:]:
                    yield h + f
            async with grpc.aio.insecure_channel(dst_addr) as ch:
                call = ch.stream_unary(bulk.PUT)(push(), metadata=((bulk.ANNOUNCE, b"".join(hashes)),))
                await until(lambda st: st.blocks == 1, dst_stub, 10)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await dst_stub.Pull(kvstore_pb2.PullRequest(block_hashes=hashes, source=src_addr), timeout=0.3)
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                go_on.set()
                stored, present = bulk._COUNTS.unpack(await call)
            assert (stored, present) == (3, 0)
            response = await dst_stub.Pull(kvstore_pb2.PullRequest(block_hashes=hashes, source=src_addr))
            assert response.blocks_pulled == 0 and src.store.stats.blocks_served == 0
            assert not dst._pulling and not dst._pushing
    run(go())


def test_a_pull_beyond_capacity_is_resource_exhausted_and_writes_no_partial_block():
    async def go():
        async with kvstore(8) as (src, _, src_addr), kvstore(2) as (dst, dst_stub, _):
            blocks = seeded(src.store, 3)
            request = kvstore_pb2.PullRequest(block_hashes=[h for h, _ in blocks], source=src_addr, lease_s=30)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await dst_stub.Pull(request)  # the lease pins what landed, so the third cannot evict
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(dst.store.blocks) == 2 and not dst.store.pins and not dst.store.leases
            for h, f in blocks[:2]:
                assert bytes(dst.store.get(h)) == f, "what was stored is whole"
    run(go())


def test_put_refuses_damaged_and_misfiled_frames():
    async def go():
        async with kvstore(4) as (svc, stub, _):
            h, f = frame(0)
            damaged = bytearray(f)
            damaged[-5] ^= 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Put(put_request([(h, bytes(damaged))]))
            assert e.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Put(put_request([(b"\x01" * 16, f)]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "carries hash" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Put(put_request([(h, b"garbage" * 10)]))
            assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS)
            assert not svc.store.blocks and len(svc.store.free_slots) == 4, "nothing filed, no slot leaked"
            assert (await stub.Put(put_request([(h, f)]))).blocks_stored == 1
    run(go())


def test_bulk_put_and_get_move_whole_frames_and_refuse_damage():
    async def go():
        async with kvstore(4) as (svc, _, address):
            blocks = [frame(i) for i in range(3)]
            async with grpc.aio.insecure_channel(address) as ch:
                assert await bulk.put(ch, blocks[:2], timeout=10) == (2, 0)
                assert await bulk.put(ch, blocks, timeout=10) == (1, 2)
                got = [(h, bytes(f)) async for h, f in bulk.fetch(ch, [h for h, _ in blocks], timeout=10)]
                assert got == blocks
                h, f = frame(7)
                damaged = f[:-1] + bytes([f[-1] ^ 1])
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await bulk.put(ch, [(h, damaged)], timeout=10)
                assert e.value.code() == grpc.StatusCode.DATA_LOSS
                assert h not in svc.store
    run(go())


def test_an_expired_lease_is_failed_precondition_not_silence():
    async def go():
        async with kvstore(4) as (svc, stub, _):
            h, f = frame(0)
            svc.store.put(h, f)
            # (a 1 s lease: the Stats and Renew calls must come within it on a loaded host too)
            lease = await stub.Acquire(kvstore_pb2.AcquireRequest(block_hashes=[h, b"\x07" * 16], lease_s=1.0))
            assert list(lease.present) == [True, False] and lease.frame_bytes == SIZE
            assert (await stub.Stats(kvstore_pb2.StatsRequest())).pinned_blocks == 1
            renewed = await stub.Renew(kvstore_pb2.LeaseRequest(lease_id=lease.lease_id, lease_s=1.0))
            assert renewed.expires_in_s == pytest.approx(1.0)
            stats = await until(lambda s: s.leases == 0, stub, deadline_s=AT_ONCE_S)  # the TTL ran out
            assert stats.pinned_blocks == 0 and stats.leases_expired == 1 and stats.leases_renewed == 1
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Release(kvstore_pb2.LeaseRequest(lease_id=lease.lease_id))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "expired" in e.value.details()
            stats = await stub.Stats(kvstore_pb2.StatsRequest())
            assert stats.pinned_blocks == 0 and stats.leases == 0 and stats.leases_expired == 1
    run(go())


def test_lease_s_is_bounded_by_the_store_and_nonsense_is_invalid_argument():
    async def go():
        async with kvstore(4, max_lease_s=2.0) as (svc, stub, _):
            h, f = frame(0)
            svc.store.put(h, f)
            lease = await stub.Acquire(kvstore_pb2.AcquireRequest(block_hashes=[h], lease_s=3600))
            assert lease.expires_in_s == pytest.approx(2.0, abs=0.05), "granted the store's maximum"
            renewed = await stub.Renew(kvstore_pb2.LeaseRequest(lease_id=lease.lease_id, lease_s=1e9))
            assert renewed.expires_in_s == 2.0
            assert (await stub.Stats(kvstore_pb2.StatsRequest())).max_lease_s == 2.0
            for bad in (0, -1, float("nan")):
                for call in (stub.Acquire(kvstore_pb2.AcquireRequest(block_hashes=[h], lease_s=bad)),
                             stub.Renew(kvstore_pb2.LeaseRequest(lease_id=lease.lease_id, lease_s=bad))):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease_s" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Pull(kvstore_pb2.PullRequest(block_hashes=[h], lease_s=-1))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await stub.Release(kvstore_pb2.LeaseRequest(lease_id=lease.lease_id))
            stats = await stub.Stats(kvstore_pb2.StatsRequest())
            assert stats.leases == 0 and stats.pinned_blocks == 0
    run(go())


def test_planes_codec_pull_crosses_fewer_bytes_and_stores_exact_frames():
    async def go():
        async with kvstore(8) as (src, _, src_addr), kvstore(8, codec_mode="planes") as (dst, dst_stub, _):
            blocks = seeded(src.store, 4)
            pulled = await dst_stub.Pull(kvstore_pb2.PullRequest(block_hashes=[h for h, _ in blocks], source=src_addr))
            assert pulled.codec == "planes" and pulled.bytes_pulled == 4 * SIZE
            assert pulled.wire_bytes < 0.8 * pulled.bytes_pulled
            assert all(bytes(dst.store.get(h)) == f for h, f in blocks)
    run(go())


def test_auto_codec_is_priced_by_the_configured_link_then_by_measurement():
    """auto: a pull from a peer whose configured link is slow (1 Gbit/s) is compressed from the first
    pull, before anything was measured; one over a fast configured link, or none, goes raw. Then the
    measured throughput of each codec decides: a link priced for planes is measured raw once, the
    faster codec is used, and the other is tried again every PROBE_EVERY-th pull."""
    from ember.services.kvstore import pull as pull_module

    async def go():
        async with kvstore(8) as (src, _, src_addr), kvstore(8, codec_mode="auto") as (dst, dst_stub, _):
            blocks = seeded(src.store, 6)
            fetcher = dst.fetcher
            fetcher.codec_GBps = (0.5, 1.5)  # (this host's codec speed, as a quiet core runs it: not under test)
            fetcher.configured = {src_addr: 1.0 / 8}  # the links table: 1 Gbit/s to the source's site
            pulled = await dst_stub.Pull(kvstore_pb2.PullRequest(block_hashes=[h for h, _ in blocks[:3]],
                                                                 source=src_addr))
            assert pulled.codec == "planes" and pulled.wire_bytes < 0.8 * pulled.bytes_pulled
            assert all(bytes(dst.store.get(h)) == f for h, f in blocks[:3])
            peer = fetcher.peer(src_addr)
            peer.planes_GBps = 0.05  # (as a pull of >= 4 MB would have measured it)
            assert fetcher.codec_for(peer) == codec.RAW, "planes measured, raw not yet: compare"
            peer.link_GBps = 0.1  # raw measured faster than planes on this host: raw, planes now and then
            codecs = [fetcher.codec_for(peer) for _ in range(pull_module.PROBE_EVERY * 2)]
            assert codecs.count(codec.PLANES) == 2 and codecs.count(codec.RAW) == 2 * pull_module.PROBE_EVERY - 2
            peer.planes_GBps = 0.2  # planes measured faster: planes, raw now and then
            codecs = [fetcher.codec_for(peer) for _ in range(pull_module.PROBE_EVERY)]
            assert codecs.count(codec.PLANES) == pull_module.PROBE_EVERY - 1
            fetcher.peers.clear()
            fetcher.configured = {src_addr: 10.0 / 8}  # a 10 Gbit/s link: raw
            pulled = await dst_stub.Pull(kvstore_pb2.PullRequest(block_hashes=[h for h, _ in blocks[3:]],
                                                                 source=src_addr))
            assert pulled.codec == "raw"
            fetcher.peers.clear()
            fetcher.configured = {}  # no configured link, nothing measured: raw
            assert fetcher.codec_for(fetcher.peer(src_addr)) == codec.RAW
    run(go())


def test_shared_memory_arena_gives_same_host_readers_the_frames(tmp_path):
    store = BlockStore(4 * SIZE)
    store_id = os.urandom(16)
    blocks = seeded(store, 3)
    for name in (str(tmp_path / "arena.sock"), f"@ember-test-{store_id.hex()}"):
        server = ArenaServer(name, store.fd, store.capacity_bytes, store_id)
        try:
            reader = ArenaReader.try_open(name, store_id)
            assert reader is not None
            for h, f in blocks:
                assert bytes(reader.frame(store.offset(h), SIZE)) == f
            store.put(*frame(9))  # written after mapping: visible through the shared map
            assert bytes(reader.frame(store.offset(frame(9)[0]), SIZE)) == frame(9)[1]
            assert ArenaReader.try_open(name, os.urandom(16)) is None, "another store's socket is not used"
            with pytest.raises(ValueError):
                reader.frame(len(reader.view), SIZE)
        finally:
            server.close()
    assert ArenaReader.try_open(str(tmp_path / "missing.sock"), store_id) is None
