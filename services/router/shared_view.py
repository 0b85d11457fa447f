"""What several routers behind one load balancer tell each other about their workers, through
the block directory's Redis: each router's calls in flight per worker, and the workers a call
just found dead.

Load: every health poll a router writes its own counts to `ember:router-load:<id>` (a hash,
address -> calls in flight, expiring after `ttl_s`) and reads the others' (ids listed in the set
`ember:routers`; an id whose hash expired is dropped from it). Placement then picks the least
loaded worker over every router's calls, not only its own.

Health: a router that marks a worker down publishes it on `ember:worker-down`; the others mark it
down at once instead of at their next health poll. A worker's own health answer stays the
authority: the next SERVING answer brings it back everywhere.

Redis being down costs only this sharing (each router falls back to its own view), never a
request.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from redis.exceptions import RedisError

from ember.kv.redis_client import RedisSettings, connect

log = logging.getLogger("ember.router")
ROUTERS = "ember:routers"
DOWN_CHANNEL = "ember:worker-down"
REDIS_ERRORS = (RedisError, OSError)


def load_key(router_id: str) -> str:
    return f"ember:router-load:{router_id}"


class SharedWorkerView:
    def __init__(self, target: RedisSettings | str, name: str = "router", ttl_s: float = 3.0, timeout_s: float = 0.5):
        """`target`: the directory's Redis, a URL or its settings (TLS, the router's ACL user)."""
        self.router_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.ttl_s = ttl_s
        self.redis = connect(target, timeout_s)
        self._listener: asyncio.Task | None = None
        self._failing = False

    async def sync(self, own: dict[str, int]) -> dict[str, int] | None:
        """Publish this router's calls in flight per worker address; the other routers' sums per
        address (None when Redis did not answer)."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            key = load_key(self.router_id)
            if own:
                pipe.hset(key, mapping=own)
            pipe.pexpire(key, int(self.ttl_s * 1000))
            pipe.sadd(ROUTERS, self.router_id)
            pipe.smembers(ROUTERS)
            members = (await pipe.execute())[-1]
            others = sorted(m.decode() for m in members if m.decode() != self.router_id)
            pipe = self.redis.pipeline(transaction=False)
            for other in others:
                pipe.hgetall(load_key(other))
            loads = await pipe.execute()
        except REDIS_ERRORS as e:
            self._warn(e)
            return None
        self._failing = False
        total: dict[str, int] = {}
        gone = []
        for other, load in zip(others, loads):
            if not load:
                gone.append(other)
            for address, running in load.items():
                total[address.decode()] = total.get(address.decode(), 0) + int(running)
        if gone:
            await self._quietly(self.redis.srem(ROUTERS, *gone))
        return total

    async def announce_down(self, address: str) -> None:
        await self._quietly(self.redis.publish(DOWN_CHANNEL, f"{self.router_id} {address}"))

    def listen(self, on_down: Callable[[str, str], None]) -> None:
        """Call `on_down(address, reporter)` for every worker another router reports down."""
        async def loop():
            while True:
                try:
                    async with self.redis.pubsub() as pubsub:
                        await pubsub.subscribe(DOWN_CHANNEL)
                        async for message in pubsub.listen():
                            if message.get("type") != "message":
                                continue
                            reporter, _, address = message["data"].decode().partition(" ")
                            if reporter != self.router_id:
                                on_down(address, reporter)
                except REDIS_ERRORS as e:
                    self._warn(e)
                    await asyncio.sleep(1.0)
        self._listener = asyncio.get_running_loop().create_task(loop())

    async def _quietly(self, awaitable) -> None:
        try:
            await awaitable
        except REDIS_ERRORS as e:
            self._warn(e)

    def _warn(self, e: Exception) -> None:
        if not self._failing:
            log.warning("shared worker view unavailable (each router uses its own): %s", e)
        self._failing = True

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        await self._quietly(self.redis.delete(load_key(self.router_id)))
        await self._quietly(self.redis.srem(ROUTERS, self.router_id))
        await self.redis.aclose()
