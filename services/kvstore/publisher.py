"""Publishes this kvstore's adds and evictions to the block directory, batched.

Changes are flushed every `flush_s` in one pipelined call. Everything held is
re-published every ttl/3 (so entries of a live store never expire) and right after the
directory comes back from a failure (a restarted Redis starts empty). While the
directory is down, changes are dropped: its entries expire on their own, and the
resync on recovery rebuilds the truth.
"""
from __future__ import annotations

import asyncio
import logging
import time

from ember.kv.directory import BlockDirectory
from ember.services.kvstore.store import BlockStore

log = logging.getLogger("ember.kvstore.publisher")


class Publisher:
    def __init__(self, store: BlockStore, directory: BlockDirectory, site: str, flush_s: float = 0.05,
                 retry_s: float = 0.5):
        self.store, self.directory, self.site = store, directory, site
        self.flush_s, self.retry_s = flush_s, retry_s
        self.added: set[bytes] = set()
        self.evicted: set[bytes] = set()
        self.healthy = False  # the first flush publishes everything
        self.published = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        store.on_change = self._changed

    def _changed(self, added: list[bytes], evicted: list[bytes]) -> None:
        self.added.update(added)
        self.added.difference_update(evicted)
        self.evicted.update(evicted)
        self.evicted.difference_update(added)
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.directory.close()

    async def _run(self) -> None:
        next_refresh = 0.0
        while True:
            timeout = max(0.0, next_refresh - time.monotonic()) if self.healthy else self.retry_s
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
            await asyncio.sleep(self.flush_s)  # gather a batch
            self._wake.clear()
            full = not self.healthy or time.monotonic() >= next_refresh
            added = list(self.store.blocks) if full else list(self.added)
            evicted = list(self.evicted)
            self.added.clear()
            self.evicted.clear()
            try:
                await self.directory.publish(self.site, added, evicted)
            except Exception as e:  # the directory is a hint: never let it take the store down
                if self.healthy:
                    log.warning("block directory unreachable (%s); retrying every %.1f s", e, self.retry_s)
                self.healthy = False
                continue
            if not self.healthy:
                log.info("block directory reachable: published all %d blocks of site %s", len(added), self.site)
            self.healthy = True
            self.published += len(added)
            if full:
                next_refresh = time.monotonic() + self.directory.ttl_s / 3
