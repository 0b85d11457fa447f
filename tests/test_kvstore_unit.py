"""KV store pieces in-process: slots, LRU, pins, leases, chunking, the TCP data plane (torch-free)."""
from __future__ import annotations

import asyncio
import os
import struct

import pytest

from ember.errors import InvalidRequestError
from ember.kv import codec, transfer, wire
from ember.kv.chunks import Assembler, split
from ember.services.kvstore.pull import Peer, PeerFetcher
from ember.services.kvstore.store import BlockStore, LeaseError
from tests.test_kv_wire import LAYOUT, TEMPLATE, kv_like

BLOCK = 4096


def block(i: int) -> tuple[bytes, bytes]:
    return i.to_bytes(16, "little"), bytes([i % 251]) * BLOCK


def test_lru_eviction_reuses_slots_and_keeps_bytes_intact():
    store = BlockStore(3 * BLOCK)
    for i in range(3):
        assert store.put(*block(i))
    assert store.get(block(0)[0]) is not None  # 0 becomes most recent: 1 is the LRU
    store.put(*block(3))
    assert block(1)[0] not in store and store.stats.evictions == 1
    for i in (0, 2, 3):
        assert bytes(store.get(block(i)[0])) == block(i)[1]
    assert not store.put(*block(3)), "a block already present is not stored twice"


def test_pinned_blocks_are_never_evicted_or_overwritten():
    store = BlockStore(2 * BLOCK)
    store.put(*block(0))
    store.put(*block(1))
    with store.pinned([block(0)[0], block(1)[0], b"\x09" * 16]) as payloads:
        assert payloads[2] is None
        with pytest.raises(MemoryError):
            store.put(*block(2))  # every block is pinned: refuse rather than overwrite
        assert bytes(payloads[0]) == block(0)[1] and bytes(payloads[1]) == block(1)[1]
    store.put(*block(2))  # pins released: now the LRU block goes
    assert block(0)[0] not in store and not store.pins


def test_blocks_of_another_size_are_refused():
    store = BlockStore(4 * BLOCK)
    store.put(*block(0))
    with pytest.raises(ValueError, match="block size"):
        store.put(b"\x07" * 16, b"x" * (BLOCK // 2))


def test_chunk_round_trip_and_malformed_streams():
    blocks = [(os.urandom(16), os.urandom(n)) for n in (10, 3000, 2500)]
    chunks = list(split(blocks, chunk_bytes=1024))
    assembler = Assembler()
    out = [b for c in chunks if (b := assembler.add(*c)) is not None]
    assembler.finish()
    assert out == blocks
    bad = Assembler()
    with pytest.raises(ValueError):
        bad.add(chunks[2][0], chunks[2][1], 1024, chunks[2][3])  # starts mid-block
    cut = Assembler()
    cut.add(*chunks[1])
    with pytest.raises(ValueError):
        cut.finish()


def frame(i: int, layout_seed: int = 0) -> tuple[bytes, bytes]:
    """A real wire frame (bf16 KV-like values) for block i."""
    h = (1000 + i).to_bytes(16, "little")
    return h, wire.encode_frame(TEMPLATE, h, kv_like(LAYOUT.block_bytes, 2, seed=i))


def slot_alloc(store: BlockStore):
    def alloc(n):
        slot = store.reserve(n)
        return slot, store.view(slot)
    return alloc


@pytest.mark.parametrize("codec_id", [codec.RAW, codec.PLANES])
def test_data_plane_moves_verified_frames_into_slots_and_reports_missing(codec_id):
    async def run():
        size = wire.frame_bytes(LAYOUT.block_bytes)
        src, dst = BlockStore(8 * size), BlockStore(8 * size)
        for i in range(5):
            src.put(*frame(i))
        server = await transfer.serve("127.0.0.1", 0, src.pinned)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        hashes = [frame(i)[0] for i in range(5)]
        wire_bytes = []
        async for h, slot, _ in transfer.fetch(address, hashes, timeout=10, alloc=slot_alloc(dst),
                                               release=dst.abandon, codec_id=codec_id, on_wire=wire_bytes.append):
            dst.commit(h, slot)
        assert all(bytes(dst.get(h)) == frame(i)[1] for i, h in enumerate(hashes)), "stored raw, bit-exact"
        if codec_id == codec.PLANES:
            assert sum(wire_bytes) < 0.8 * 5 * size, "compressed on the wire"
        with pytest.raises(transfer.BlockMissing):
            async for _ in transfer.fetch(address, [hashes[0], b"\x55" * 16], timeout=10):
                pass
        server.close()
        with pytest.raises((ConnectionError, OSError)):
            async for _ in transfer.fetch(address, hashes, timeout=5):
                pass
    asyncio.run(run())


def test_data_plane_refuses_a_damaged_block_and_never_files_it():
    async def run():
        size = wire.frame_bytes(LAYOUT.block_bytes)
        src, dst = BlockStore(4 * size), BlockStore(4 * size)
        good, bad = frame(0), frame(1)
        src.put(*good)
        src.put(*bad)
        src.get(bad[0])[wire.HEADER_BYTES + 100] ^= 0xFF  # bit rot in the source store
        server = await transfer.serve("127.0.0.1", 0, src.pinned)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        landed = []
        with pytest.raises(wire.CorruptFrame, match="checksum"):
            async for h, slot, _ in transfer.fetch(address, [good[0], bad[0]], timeout=10, alloc=slot_alloc(dst),
                                                   release=dst.abandon):
                dst.commit(h, slot)
                landed.append(h)
        assert landed == [good[0]] and bad[0] not in dst
        assert len(dst.free_slots) == 3, "the damaged block's slot went back to the free list"
        server.close()
    asyncio.run(run())


def test_data_plane_cuts_off_a_receiver_that_takes_nothing_and_unpins_its_blocks():
    store = BlockStore(4 * wire.frame_bytes(LAYOUT.block_bytes))
    h, f = frame(0)
    store.put(h, f)
    repeats = 64 * 2**20 // len(f)  # 64 MiB asked for: more than socket buffers hold

    async def run():
        server = await transfer.serve("127.0.0.1", 0, store.pinned, stall_s=0.3)
        host, port = server.sockets[0].getsockname()
        reader, writer = await asyncio.open_connection(host, port)  # a receiver that then reads nothing
        writer.write(struct.pack("<4sBxxxI", transfer.MAGIC, codec.RAW, repeats) + h * repeats)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 10
        while not store.pins:  # the stream is under way
            assert loop.time() < give_up
            await asyncio.sleep(0.01)
        stalled = loop.time()
        while store.pins:  # cut off once its buffers are full and nothing moves for stall_s
            assert loop.time() < give_up, "a frozen receiver kept its blocks pinned"
            await asyncio.sleep(0.01)
        # not before stall_s (less the poll by which the test saw the stream start after the server did)
        assert loop.time() - stalled >= 0.3 - 0.1
        writer.close()
        server.close()
    asyncio.run(asyncio.wait_for(run(), 30))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_leases_pin_until_released_and_expiry_is_a_clear_error():
    clock = Clock()
    store = BlockStore(2 * BLOCK, clock=clock)
    store.put(*block(0))
    store.put(*block(1))
    lease = store.acquire([block(0)[0], block(1)[0], b"\x09" * 16], ttl_s=5)
    assert lease.block_hashes == [block(0)[0], block(1)[0]], "missing blocks are not leased"
    with pytest.raises(MemoryError, match="pinned"):
        store.put(*block(2))  # every block is leased: refuse rather than overwrite
    clock.now = 4
    store.renew(lease.lease_id, ttl_s=5)
    clock.now = 8
    with pytest.raises(MemoryError):
        store.put(*block(2))  # renewed: still held at t=8
    clock.now = 9.5
    store.put(*block(2))  # expired at t=9: its blocks are fair game again
    assert store.stats.leases_expired == 1 and not store.pins
    with pytest.raises(LeaseError, match="expired"):
        store.release_lease(lease.lease_id)
    with pytest.raises(LeaseError, match="unknown"):
        store.release_lease(12345)
    held = store.acquire([block(2)[0]], ttl_s=5)
    store.release_lease(held.lease_id)
    assert not store.pins and not store.leases


def test_a_held_lease_outlives_its_ttl_and_its_ttl_runs_from_the_hold_s_end():
    clock = Clock()
    store = BlockStore(2 * BLOCK, clock=clock, max_lease_s=2)
    store.put(*block(0))
    lease = store.acquire([block(0)[0]], ttl_s=60)
    assert lease.ttl_s == 2 and lease.expires_at == 2, "bounded by max_lease_s"
    with store.held(lease.lease_id):
        clock.now = 50  # a pull across a slow link still filling it
        assert store.expire_leases() == 0 and block(0)[0] in store.pins
    assert lease.expires_at == 52
    clock.now = 51
    store.renew(lease.lease_id, ttl_s=1)
    clock.now = 52.5
    assert store.expire_leases() == 1 and not store.pins and store.stats.leases_renewed == 1


def test_lease_times_must_be_positive_and_the_maximum_is_sane():
    store = BlockStore(2 * BLOCK, max_lease_s=5)
    for bad in (0, -1, float("nan")):
        with pytest.raises(InvalidRequestError, match="lease_s"):
            store.acquire([], ttl_s=bad)
    assert store.granted_ttl(float("inf")) == 5 and store.granted_ttl(0.5) == 0.5
    for bad in (0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_lease_s"):
            BlockStore(BLOCK, max_lease_s=bad)
    assert not store.leases


def test_store_reports_adds_and_evictions_to_its_listener():
    store = BlockStore(2 * BLOCK)
    changes = []
    store.on_change = lambda added, evicted: changes.append((added, evicted))
    for i in range(3):
        store.put(*block(i))
    assert changes == [([block(0)[0]], []), ([block(1)[0]], []), ([], [block(0)[0]]), ([block(2)[0]], [])]


def test_auto_codec_compresses_only_on_slow_links():
    store = BlockStore(4 * wire.frame_bytes(LAYOUT.block_bytes))
    fetcher = PeerFetcher(store, "auto")
    fetcher.codec_GBps = (0.5, 1.5)  # (a quiet core's codec speed: this host's is not under test)
    slow, fast, unknown = Peer(channel=None, link_GBps=0.05), Peer(channel=None, link_GBps=2.5), Peer(channel=None)
    assert fetcher.codec_for(slow) == codec.PLANES, "no block stored yet: priced as bf16, the served default"
    store.put(*frame(0))  # bf16 frames
    assert fetcher.codec_for(slow) == codec.PLANES
    assert fetcher.codec_for(fast) == codec.RAW and fetcher.codec_for(unknown) == codec.RAW
    assert PeerFetcher(store, "planes").codec_for(fast) == codec.PLANES
    assert PeerFetcher(store, "raw").codec_for(slow) == codec.RAW
    with pytest.raises(ValueError, match="codec mode"):
        PeerFetcher(store, "gzip")
