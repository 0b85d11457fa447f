"""How a service talks to its engine core: one interface, two transports.

- `InProcessEngineClient`: the core loop on a thread of this process (tests, benches,
  `ember generate`-style use). Errors arrive as the engine raised them.
- `SubprocessEngineClient`: the core on the main thread of its own process
  (`ember.serving.core_process`), so the model loop never shares a GIL with gRPC, tracing
  or metrics (vLLM V1's EngineCoreProc). Messages are pickled over a socketpair; errors
  arrive as the gRPC status they map to. If the process dies, every open stream ends
  with UNAVAILABLE at once and `on_death` runs (the service reports NOT_SERVING).

Both run the same `serve_loop` over the same `EngineCore`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from multiprocessing.connection import Connection

from ember.engine.outputs import RequestOutput
from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import NO_TENANT, Tenant
from ember.errors import InvalidRequestError
from ember.serving.messages import MEMORY_REFRESH_S, PUBLISH_S, AddRequest, CoreInfo, ErrorInfo, KVPlan, Snapshot

log = logging.getLogger("ember.engine")


def serve_loop(core, receive: Callable[[float | None], list], emit: Callable[[list, Snapshot], None],
               idle_timeout: float | None = None, publish_s: float = PUBLISH_S) -> None:
    """Run `core` until a ("shutdown",) message: drain the inbox, turn, emit the events.

    A publisher thread sends the core's live state (`core.live_snapshot()`) whenever the loop has
    sent nothing for `publish_s`: during a long step too, since it never waits for the step (it
    reads the state the loop wrote before the step began; ctypes kernels and torch release the GIL).
    The core's `deliver` sends a sync write-back's answer from the thread that completed its store.
    `emit` is called under one lock from every thread, each snapshot taken under it: the service
    sees them in the order they were taken."""
    lock = threading.Lock()
    last_sent = [time.monotonic()]
    stop = threading.Event()

    def send(events: list, snapshot: Callable[[], Snapshot]) -> None:
        with lock:
            emit(events, snapshot())
            last_sent[0] = time.monotonic()

    def publish() -> None:
        while not stop.wait(max(0.005, last_sent[0] + publish_s - time.monotonic())):
            if time.monotonic() - last_sent[0] >= publish_s:
                try:
                    send([], core.live_snapshot)
                except Exception:  # noqa: BLE001 - a gauge never takes the engine down
                    log.exception("publishing the engine core's state failed")
                    last_sent[0] = time.monotonic()

    def deliver(events: list, answers: int) -> None:  # (from the connector's thread: sync answers)
        def snapshot() -> Snapshot:
            core.settle_answers(answers)  # no longer running from the snapshot that goes with them
            return core.live_snapshot()
        send(events, snapshot)
    core.deliver = deliver
    publisher = threading.Thread(target=publish, name="engine-publisher", daemon=True)
    publisher.start()
    try:
        while True:
            timeout = 0.0 if core.has_work() else 0.002 if core.busy() else idle_timeout
            if timeout is None or timeout > MEMORY_REFRESH_S:  # an idle core still refreshes its gauges
                timeout = MEMORY_REFRESH_S
            events = []
            for message in receive(timeout):
                kind = message[0]
                if kind == "shutdown":
                    return
                if kind == "add":
                    events.extend(core.add(message[1]))
                elif kind == "abort":
                    core.abort(message[1])
                elif kind == "stats":
                    events.append(("stats", message[1], core.stats()))
            events.extend(core.turn())
            if events or core.memory_due():
                send(events, core.snapshot)
    finally:
        core.deliver = None
        stop.set()
        publisher.join(timeout=5)


class EngineClient:
    """Streams per request; the transport (`_send`, `_start`) is the subclass's."""

    def __init__(self, on_death: Callable[[], None] | None = None):
        self.info: CoreInfo | None = None
        self.snapshot = Snapshot()
        self.alive = True
        self.on_death = on_death
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = iter(range(1, 2**62))
        self._adds_sent = 0  # requests sent to the core (the snapshot's `adds`: those it has taken in)

    # -- the interface ---------------------------------------------------------------------
    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       plan: KVPlan | None = None, output_prefix: list[int] = (),
                       timeout_s: float | None = None, cache_salt: bytes = b"",
                       shared_blocks: int = 0, tenant: Tenant = NO_TENANT) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Leaving the iterator early aborts the request. `cache_salt`,
        `shared_blocks`: its tenant's hash chain (ember.kv.block_hash); `tenant`: whose it is (the
        scheduler's fair queue)."""
        self._require_alive()
        self._loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already running")
        from ember.rpc import tracing  # (not at import: a service spawns its core before its gRPC stack loads)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            self._send(("add", AddRequest(request_id, list(prompt), params, list(output_prefix), plan, timeout_s,
                                          tracing.current_carrier(), cache_salt, shared_blocks, tenant)))
            self._adds_sent += 1
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.alive:
                self._send(("abort", request_id))

    def current(self) -> Snapshot:
        """The latest snapshot, its `waiting` counting the requests on their way to the core too: a
        request counts as waiting from the moment it reaches this service, even while the core is busy
        in a long step and has not read it yet."""
        snapshot = self.snapshot
        unseen = self._adds_sent - snapshot.adds
        return replace(snapshot, waiting=snapshot.waiting + unseen) if unseen > 0 else snapshot

    async def stats(self) -> dict:
        self._require_alive()
        self._loop = asyncio.get_running_loop()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send(("stats", call_id))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def close(self) -> None:
        raise NotImplementedError

    # -- transport hooks ---------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        raise NotImplementedError

    def _error(self, item) -> BaseException:
        return item

    # -- delivery (on the event loop) -------------------------------------------------------------
    def _deliver(self, events: list, snapshot: Snapshot) -> None:
        if snapshot.version >= self.snapshot.version:  # (the loop's and the publisher's may cross)
            self.snapshot = snapshot
        for event in events:
            if event[0] == "out":
                stream = self._streams.get(event[1].request_id)
                if stream is not None:
                    stream.put_nowait(event[1])
            elif event[0] == "error":
                stream = self._streams.get(event[1])
                if stream is not None:
                    stream.put_nowait(self._error(event[2]))
            elif event[0] == "stats":
                future = self._calls.get(event[1])
                if future is not None and not future.done():
                    future.set_result(event[2])

    def _post(self, events: list, snapshot: Snapshot) -> None:
        """From the transport's thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, events, snapshot)

    def _died(self, reason: str) -> None:
        if not self.alive:
            return
        self.alive = False
        log.error("engine core died: %s", reason)
        error = _unavailable(f"the engine core died ({reason}); retry the request")
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        if self.on_death is not None:
            self.on_death()

    def _require_alive(self) -> None:
        if not self.alive:
            raise _unavailable("the engine core is not running; retry on another worker")


class InProcessEngineClient(EngineClient):
    """The core loop on a daemon thread of this process."""

    def __init__(self, engine, connector=None):
        super().__init__()
        from ember.serving.engine_core import EngineCore
        self.engine = engine
        self.core = EngineCore(engine, connector)
        bm = engine.block_manager
        self.info = CoreInfo(os.getpid(), engine.config.block_size, bm.root_hash, engine.loaded.args.vocab_size,
                             engine.max_model_len, list(engine.kernels))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        def receive(timeout):
            messages = []
            try:
                messages.append(self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait())
                while True:
                    messages.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            return messages
        serve_loop(self.core, receive, self._post, idle_timeout=0.5)

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)

    def close(self) -> None:
        self._inbox.put(("shutdown",))
        self._thread.join(timeout=10)
        if self.engine.on_batch == self.core._on_batch:
            self.engine.on_batch = None
        if self.core.connector is not None:
            self.core.connector.close()
        self.core.engine.close()


class SubprocessEngineClient(EngineClient):
    """The core in its own process (`python -m ember.serving.core_process`)."""

    def __init__(self, process: subprocess.Popen, conn: Connection, info: CoreInfo,
                 on_death: Callable[[], None] | None):
        super().__init__(on_death)
        self.process, self._conn, self.info = process, conn, info
        self.snapshot = Snapshot(memory=info.memory)  # (until its first turn's)
        self._send_lock = threading.Lock()
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    async def start(cls, config, kvstore: str | None = None, use_shm: bool = True,
                    on_death: Callable[[], None] | None = None, routes: dict[str, str] | None = None,
                    trace_service: str | None = None) -> SubprocessEngineClient:
        """Spawn the core for `config` (an EngineConfig, or its fields as a dict: the core resolves their
        "auto" values, so the service never imports torch) and wait until its model is warm. `routes`:
        other sites' kvstores -> the emulated links in front of them (the core streams KV there)."""
        return await cls.ready(cls.spawn(config, kvstore, use_shm, routes, trace_service), on_death)

    @staticmethod
    def spawn(config, kvstore: str | None = None, use_shm: bool = True, routes: dict[str, str] | None = None,
              trace_service: str | None = None) -> tuple[subprocess.Popen, Connection]:
        """Start the core's process now (a service does this first thing, so the core's imports and model
        load overlap the service's own start-up); `ready` waits for it. `trace_service`: the service's
        name, under which the core exports its spans (when the service exports its own)."""
        mine, theirs = socket.socketpair()
        args = ["--config", json.dumps(config) if isinstance(config, dict) else config.model_dump_json()]
        if kvstore:
            args += ["--kvstore", kvstore] + ([] if use_shm else ["--no-shm"])
            args += [a for true, relay in (routes or {}).items() for a in ("--route", f"{true}={relay}")]
        if trace_service:
            args += ["--trace-service", trace_service]
        from ember.rpc import security
        if security.current() is not None:  # the core dials the kvstore as this service
            args += ["--tls-dir", str(security.current().folder)]
            args += ["--unsigned-kv"] if security.current().unsigned_kv else []
        template = os.environ.get("EMBER_ENGINE_TEMPLATE")
        process = None
        if template:  # forked from a warm interpreter (ember.serving.template), else a fresh one
            from ember.serving.template import ForkedCore, request_core
            try:
                process = ForkedCore(request_core(template, args, theirs.fileno()))
            except (OSError, RuntimeError, ValueError) as e:
                log.warning("no engine template at %s (%s): starting the engine core afresh", template, e)
        if process is None:
            process = subprocess.Popen([sys.executable, "-m", "ember.serving.core_process", "--fd",
                                        str(theirs.fileno()), *args], pass_fds=[theirs.fileno()],
                                       stdin=subprocess.DEVNULL)
        theirs.close()
        return process, Connection(mine.detach())

    @classmethod
    async def ready(cls, spawned: tuple[subprocess.Popen, Connection], on_death: Callable[[], None] | None = None
                    ) -> SubprocessEngineClient:
        """The client of a spawned core, once its model is warm."""
        process, conn = spawned
        try:
            first = await asyncio.to_thread(conn.recv)
        except (EOFError, OSError):
            process.wait(timeout=10)
            raise RuntimeError(f"the engine core exited during start-up (code {process.returncode})") from None
        if first[0] != "ready":
            process.wait(timeout=10)
            raise RuntimeError(start_failure(first))
        return cls(process, conn, first[1], on_death)

    def _read(self) -> None:
        try:
            while True:
                events, snapshot = self._conn.recv()
                self._post(events, snapshot)
        except (EOFError, OSError) as e:
            code = self.process.wait()
            reason = f"exit code {code}" if code is not None else type(e).__name__
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._died, reason)

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError as e:
            self._died(f"{type(e).__name__}: {e}")
            raise _unavailable("the engine core is not running; retry on another worker") from e

    def _error(self, item) -> BaseException:
        return rebuild_error(item)

    def close(self) -> None:
        self.alive = False
        try:
            self._send(("shutdown",))
        except Exception:  # noqa: BLE001 - already gone
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def start_failure(message: tuple) -> str:
    """The one line a core's ("failed", "Type: message"[, traceback]) start-up report becomes; the
    traceback (the core's own frames: where it failed) goes whole to this service's log first."""
    summary = " | ".join(line.strip() for line in str(message[1]).splitlines() if line.strip())
    if len(message) > 2 and message[2]:
        log.error("the engine core failed to start; its traceback:\n%s", str(message[2]).rstrip())
    return f"the engine core failed to start: {summary}"


def rebuild_error(info: ErrorInfo) -> BaseException:
    from ember.engine.errors import CapacityError, IntegrityError, InvalidRequestError
    kinds = {"invalid": InvalidRequestError, "capacity": CapacityError, "integrity": IntegrityError}
    if info.kind in kinds:
        return kinds[info.kind](info.message)
    import grpc

    from ember.rpc.errors import RpcError
    return RpcError(getattr(grpc.StatusCode, info.status, grpc.StatusCode.INTERNAL), info.message)


def _unavailable(message: str) -> BaseException:
    import grpc

    from ember.rpc.errors import RpcError
    return RpcError(grpc.StatusCode.UNAVAILABLE, message)
