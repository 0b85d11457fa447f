"""In-memory content-addressed block store with a byte capacity and LRU eviction.

Holds bytes only (no torch): the payload layout is the engine's business.
"""
from __future__ import annotations

from collections import OrderedDict
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
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.stats = StoreStats()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def put(self, block_hash: bytes, payload: bytes) -> bool:
        """Store a block; False if it was already here. Evicts LRU blocks to make room."""
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return False
        if len(payload) > self.capacity_bytes:
            raise MemoryError(f"block of {len(payload)} bytes exceeds the store's capacity")
        while self.bytes + len(payload) > self.capacity_bytes:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= len(old)
            self.stats.evictions += 1
        self.blocks[block_hash] = payload
        self.bytes += len(payload)
        self.stats.blocks_put += 1
        return True

    def get(self, block_hash: bytes) -> bytes | None:
        payload = self.blocks.get(block_hash)
        if payload is None:
            self.stats.misses += 1
            return None
        self.blocks.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.blocks_served += 1
        return payload
