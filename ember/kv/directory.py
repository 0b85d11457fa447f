"""Which site holds which KV block (torch-free): the block directory.

Kvstores publish the blocks they add and evict; entries live `ttl_s` after their last
publish, so a dead kvstore's entries age out (a live one re-publishes everything every
ttl/3). The router asks, in one round trip per request, how many leading blocks of a
prompt each site holds: a placement hint only. A stale or missing answer costs
recomputation, never correctness: every service re-checks its own store.

Two implementations of one interface: `RedisDirectory` (a real Redis shared by every
site, redis-py asyncio; one key per (site, block) with an expiry, MGET to read) and
`MemoryDirectory` (in-process; the local cluster's router hosts one, ember.rpc.directory).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.kv.redis_client import RedisSettings


class BlockDirectory(ABC):
    ttl_s: float

    @abstractmethod
    async def publish(self, site: str, added: list[bytes], evicted: list[bytes]) -> None:
        """Record blocks now held (refreshing their expiry) and blocks gone. Raises on failure."""

    @abstractmethod
    async def lookup(self, block_hashes: list[bytes], sites: list[str]) -> dict[str, int]:
        """Per site: how many leading blocks of `block_hashes` it holds. Raises on failure."""

    async def close(self) -> None:  # noqa: B027 - most directories hold nothing to close
        pass


def leading(flags) -> int:
    count = 0
    for held in flags:
        if not held:
            break
        count += 1
    return count


class MemoryDirectory(BlockDirectory):
    def __init__(self, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self.entries: dict[tuple[str, bytes], float] = {}  # (site, hash) -> expires at

    async def publish(self, site: str, added: list[bytes], evicted: list[bytes]) -> None:
        expires = self.clock() + self.ttl_s
        for h in added:
            self.entries[(site, h)] = expires
        for h in evicted:
            self.entries.pop((site, h), None)
        if len(self.entries) > 4 * 2**20:  # bound memory when publishers vanish without evicting
            self._purge()

    async def lookup(self, block_hashes: list[bytes], sites: list[str]) -> dict[str, int]:
        now = self.clock()
        return {site: leading(self.entries.get((site, h), 0.0) > now for h in block_hashes) for site in sites}

    def _purge(self) -> None:
        now = self.clock()
        self.entries = {k: t for k, t in self.entries.items() if t > now}


class RedisDirectory(BlockDirectory):
    """Keys `ember:blk:<site>:<16-byte hash>` with an expiry; reads are one MGET."""

    def __init__(self, target: RedisSettings | str, ttl_s: float = 60.0, timeout_s: float = 0.5):
        """`target`: a URL, or its settings (TLS, the role's ACL user: ember.kv.redis_client)."""
        from ember.kv.redis_client import connect
        self.ttl_s = ttl_s
        self.url = target if isinstance(target, str) else target.url
        # Short timeouts: a dead Redis must cost a request milliseconds, not seconds.
        self.redis = connect(target, timeout_s)

    @staticmethod
    def key(site: str, block_hash: bytes) -> bytes:
        return b"ember:blk:" + site.encode() + b":" + block_hash

    async def publish(self, site: str, added: list[bytes], evicted: list[bytes]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        ttl_ms = int(self.ttl_s * 1000)
        for h in added:
            pipe.set(self.key(site, h), b"1", px=ttl_ms)
        if evicted:
            pipe.delete(*(self.key(site, h) for h in evicted))
        await pipe.execute()

    async def lookup(self, block_hashes: list[bytes], sites: list[str]) -> dict[str, int]:
        if not block_hashes or not sites:
            return {site: 0 for site in sites}
        values = await self.redis.mget([self.key(site, h) for site in sites for h in block_hashes])
        n = len(block_hashes)
        return {site: leading(v is not None for v in values[i * n:(i + 1) * n]) for i, site in enumerate(sites)}

    async def close(self) -> None:
        await self.redis.aclose()
