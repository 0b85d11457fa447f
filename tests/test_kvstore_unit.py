"""KV store pieces in-process: slots, LRU, pins, chunking, the TCP data plane (torch-free)."""
from __future__ import annotations

import asyncio
import os

import pytest

from ember.kv import transfer
from ember.kv.chunks import Assembler, split
from services.kvstore.store import BlockStore

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


def test_data_plane_moves_blocks_into_slots_and_reports_missing():
    async def run():
        src, dst = BlockStore(8 * BLOCK), BlockStore(8 * BLOCK)
        for i in range(5):
            src.put(*block(i))
        server = await transfer.serve("127.0.0.1", 0, src.pinned)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        hashes = [block(i)[0] for i in range(5)]

        def alloc(n):
            slot = dst.reserve(n)
            return slot, dst.view(slot)
        async for h, slot, _ in transfer.fetch(address, hashes, timeout=10, alloc=alloc, release=dst.release):
            dst.commit(h, slot)
        assert all(bytes(dst.get(h)) == block(i)[1] for i, h in enumerate(hashes))
        with pytest.raises(transfer.BlockMissing):
            async for _ in transfer.fetch(address, [hashes[0], b"\x55" * 16], timeout=10):
                pass
        server.close()
        with pytest.raises((ConnectionError, OSError)):
            async for _ in transfer.fetch(address, hashes, timeout=5):
                pass
    asyncio.run(run())
