"""Content-addressed block store: preallocated slots, byte capacity, LRU eviction, pins.

Holds bytes only (no torch): the payload layout is the engine's business. Payloads live
in one arena mapped and populated up front (MAP_POPULATE: ~0.5 s per GiB at start) and
cut into slots of the first block size seen, so a block arriving from the network is
received straight into memory that is already mapped. Measured here for 720 KiB copies:
populated 12.4 GB/s, fresh anonymous memory 1.6 GB/s, numpy's huge-page-advised memory
0.8 GB/s (the kernel compacts memory on fault).
A block being read out (a Get stream, a data-plane send) is pinned: eviction skips it,
so a slot is never reused while its old bytes are still going out.
"""
from __future__ import annotations

import mmap
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    blocks_put: int = 0
    blocks_served: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0


class BlockStore:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, capacity_bytes, flags=flags)
        self.arena = memoryview(self._map)
        self.slot_bytes = 0  # fixed by the first block stored
        self.free_slots: list[int] = []
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self.pins: Counter[bytes] = Counter()
        self.stats = StoreStats()

    @property
    def bytes(self) -> int:
        return len(self.blocks) * self.slot_bytes

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return self.arena[start:start + self.slot_bytes]

    def reserve(self, num_bytes: int) -> int:
        """A free slot for one incoming block (evicting the LRU unpinned block if needed).
        Write it through `view(slot)`, then `commit` it, or `release` it."""
        if not self.slot_bytes:
            if not 0 < num_bytes <= self.capacity_bytes:
                raise MemoryError(f"block of {num_bytes} bytes does not fit capacity {self.capacity_bytes}")
            self.slot_bytes = num_bytes
            self.free_slots = list(reversed(range(self.capacity_bytes // num_bytes)))
        if num_bytes != self.slot_bytes:
            raise ValueError(f"block of {num_bytes} bytes does not match this store's block size {self.slot_bytes}")
        if not self.free_slots:
            self._evict_one()
        return self.free_slots.pop()

    def commit(self, block_hash: bytes, slot: int) -> bool:
        """File a written slot under its hash; False if the block was already here."""
        if block_hash in self.blocks:
            self.release(slot)
            self.blocks.move_to_end(block_hash)
            return False
        self.blocks[block_hash] = slot
        self.stats.blocks_put += 1
        return True

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def put(self, block_hash: bytes, payload) -> bool:
        """Copy a payload in; False if the block was already here."""
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return False
        slot = self.reserve(len(payload))
        self.view(slot)[:] = payload
        return self.commit(block_hash, slot)

    def get(self, block_hash: bytes) -> memoryview | None:
        """The payload, valid until the block is evicted: hold `pinned` while using it."""
        slot = self.blocks.get(block_hash)
        if slot is None:
            self.stats.misses += 1
            return None
        self.blocks.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.blocks_served += 1
        return self.view(slot)

    @contextmanager
    def pinned(self, block_hashes: list[bytes]):
        """Payloads (None where missing) that stay valid for the duration of the block."""
        payloads = [self.get(h) for h in block_hashes]
        held = [h for h, p in zip(block_hashes, payloads) if p is not None]
        self.pins.update(held)
        try:
            yield payloads
        finally:
            self.pins.subtract(held)
            for h in held:
                if self.pins[h] <= 0:
                    del self.pins[h]

    def _evict_one(self) -> None:
        victim = next((h for h in self.blocks if h not in self.pins), None)
        if victim is None:
            raise MemoryError("every block in the store is pinned by a transfer in flight")
        self.release(self.blocks.pop(victim))
        self.stats.evictions += 1
