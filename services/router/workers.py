"""The router's view of every prefill and decode worker: its channel, whether it is live, and
how many of this router's calls it is running.

A worker is live while its `grpc.health.v1` status is SERVING. The router polls each worker
(`watch`, every `HEALTH_POLL_S`) and marks one down at once when a call to it fails with
UNAVAILABLE (`down`); only a later SERVING health answer brings it back. Placement picks the
least-loaded live worker of a site (`pick`), counting the other routers' calls too when they
share a Redis (`shared`: ember.services.router.shared_view). Channels go through the emulated
link when one is configured (`routes`: true address -> relay address).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember.config.schema import ClusterConfig
from ember.rpc.server import channel
from ember.v1 import decode_pb2_grpc, prefill_pb2_grpc

if TYPE_CHECKING:  # (imported where a Redis is configured: redis costs ~0.3 s of CPU at start)
    from ember.services.router.shared_view import SharedWorkerView

log = logging.getLogger("ember.router")
HEALTH_POLL_S = 0.5
HEALTH_TIMEOUT_S = 1.0
SLOW_CHECKS_DOWN = 3
STUBS = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub}


@dataclass
class Worker:
    role: str
    site: str
    address: str
    index: int
    live: bool = True        # until the first health answer says otherwise
    running: int = 0         # this router's calls in flight on it
    others_running: int = 0  # the other routers' (shared view; 0 without one)
    failures: int = 0
    slow_checks: int = 0     # health checks in a row that timed out
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)
    _stub: object = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.site}[{self.index}]@{self.address}"


class WorkerPool:
    def __init__(self, config: ClusterConfig, routes: dict[str, str] | None = None,
                 shared: SharedWorkerView | None = None):
        self.routes = routes or {}
        self.shared = shared
        self.workers: dict[tuple[str, str], list[Worker]] = {}
        for site in config.sites:
            for role in STUBS:
                if site.has(role):
                    self.workers[(role, site.name)] = [Worker(role, site.name, a, i)
                                                       for i, a in enumerate(site.workers(role))]
        self._watch: asyncio.Task | None = None

    def _connect(self, worker: Worker) -> grpc.aio.Channel:
        if worker._channel is None:
            worker._channel = channel(self.routes.get(worker.address, worker.address))
            worker._stub = STUBS[worker.role](worker._channel)
        return worker._channel

    def stub(self, worker: Worker):
        self._connect(worker)
        return worker._stub

    def all(self, role: str, site: str) -> list[Worker]:
        return self.workers.get((role, site), [])

    def live(self, role: str, site: str) -> list[Worker]:
        return [w for w in self.all(role, site) if w.live]

    def pick(self, role: str, site: str, exclude: tuple[Worker, ...] = ()) -> Worker | None:
        """The least-loaded live `role` worker at `site` not in `exclude`, or None."""
        candidates = [w for w in self.live(role, site) if w not in exclude]
        return min(candidates, key=lambda w: (w.running + w.others_running, w.index)) if candidates else None

    def sites_with_live(self, role: str) -> list[str]:
        return [site for (r, site), workers in self.workers.items() if r == role and any(w.live for w in workers)]

    def down(self, worker: Worker, why: str, announce: bool = True) -> None:
        worker.failures += 1
        if worker.live:
            log.warning("%s marked down: %s", worker.name, why)
            if announce and self.shared is not None:
                asyncio.get_running_loop().create_task(self.shared.announce_down(worker.address))
        worker.live = False

    def _reported_down(self, address: str, reporter: str) -> None:
        for worker in self.everyone():
            if worker.address == address:
                self.down(worker, f"reported down by {reporter}", announce=False)

    def everyone(self) -> list[Worker]:
        return [w for ws in self.workers.values() for w in ws]

    async def share_load(self) -> None:
        """Publish this router's calls per worker and take in the other routers'."""
        others = await self.shared.sync({w.address: w.running for w in self.everyone()})
        if others is not None:
            for w in self.everyone():
                w.others_running = others.get(w.address, 0)

    # -- health ----------------------------------------------------------------------------
    async def _serving(self, worker: Worker) -> bool:
        """Its health answer within HEALTH_TIMEOUT_S: SERVING or not (AioRpcError: no answer)."""
        stub = health_pb2_grpc.HealthStub(self._connect(worker))
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def check(self, worker: Worker) -> None:
        try:
            serving = await self._serving(worker)
            worker.slow_checks = 0
        except grpc.aio.AioRpcError as e:
            # A slow answer on a saturated host is not a dead worker (that was marking a busy
            # decode worker down mid-burst, sending every new stream to the other): only
            # SLOW_CHECKS_DOWN in a row count. A refused connection or NOT_SERVING counts at once.
            worker.slow_checks = worker.slow_checks + 1 if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else 0
            if 0 < worker.slow_checks < SLOW_CHECKS_DOWN:
                return
            serving = False
        if serving != worker.live:
            log.warning("%s is %s", worker.name, "live again" if serving else "not serving")
        worker.live = serving

    async def answers(self, worker: Worker) -> bool:
        """Whether `worker` answers its health check SERVING within HEALTH_TIMEOUT_S now (its link and
        its service are up), without changing what the pool thinks of it."""
        try:
            return await self._serving(worker)
        except grpc.aio.AioRpcError:
            return False

    async def check_all(self, role: str | None = None) -> None:
        await asyncio.gather(*(self.check(w) for w in self.everyone() if role is None or w.role == role))

    async def pick_or_recheck(self, role: str, site: str, exclude: tuple[Worker, ...] = ()) -> Worker | None:
        """`pick`, and when nothing is live, ask every `role` worker's health now and pick again (a
        worker that just came up is not missed for a poll interval)."""
        worker = self.pick(role, site, exclude)
        if worker is None:
            await self.check_all(role)
            worker = self.pick(role, site, exclude)
        return worker

    def start(self) -> None:
        async def loop():
            while True:
                await self.check_all()
                if self.shared is not None:
                    await self.share_load()
                await asyncio.sleep(HEALTH_POLL_S)
        self._watch = asyncio.get_running_loop().create_task(loop())
        if self.shared is not None:
            self.shared.listen(self._reported_down)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.shared is not None:
            await self.shared.close()
        for w in self.everyone():
            if w._channel is not None:
                await w._channel.close()
