"""Runs an LLMEngine on its own thread and serves asyncio callers.

The engine is single-threaded by design; every touch of it (adding requests, aborting,
exporting or importing KV) runs on the engine thread between steps, so a step never sees
a half-made change. Callers await results; streams receive outputs as steps produce them.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ember.engine.engine import LLMEngine, RequestOutput
from ember.engine.sampling_params import SamplingParams

log = logging.getLogger("ember.engine")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    on_finish: Callable[[LLMEngine, RequestOutput], Any] | None


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(lambda: None)
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps; return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def job():
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)
        self._inbox.put(job)
        return await future

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str,
                       before_add: Callable[[LLMEngine], Any] | None = None,
                       on_finish: Callable[[LLMEngine, RequestOutput], Any] | None = None,
                       output_prefix: list[int] = (),
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. `before_add` runs on the engine thread just before the
        request is added (e.g. importing its KV); `on_finish` right after its last step,
        before any other step could evict its blocks. Leaving the iterator early aborts the
        request and frees its blocks."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), on_finish)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        self._streams[request_id] = stream

        def add(engine: LLMEngine):
            if before_add is not None:
                before_add(engine)
            engine.add_request(prompt, params, request_id, output_prefix=output_prefix)
        finished = False
        try:
            await self.call(add)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(lambda: self.engine.abort(request_id))

    def _run(self) -> None:
        while not self._stopped.is_set():
            block = not self.engine.has_unfinished()
            try:
                while True:
                    self._inbox.get(block=block, timeout=0.5 if block else None)()
                    block = False
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed")
                for rid in list(self._streams):
                    self.engine.abort(rid)
                    self._deliver(rid, exc)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished and stream.on_finish is not None:
                    try:
                        stream.on_finish(self.engine, out)
                    except Exception as exc:  # noqa: BLE001
                        self._deliver(out.request_id, exc)
                        continue
                self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _set_result(future: asyncio.Future, result) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
