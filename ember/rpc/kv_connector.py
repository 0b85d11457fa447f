"""The engine core's one door to its site's kvstore (L2): load blocks in, store blocks out.

The engine core's main thread never waits on the network: every kvstore call runs on the
connector's own thread (an asyncio loop with one gRPC channel), and the core polls the
futures it gets back between steps. Loading leases the blocks (pulling them from another
site's store first when asked), reads their frames (the store's shared memory on the same
host, gRPC otherwise) and verifies each one against the engine's layout, model, checksum
and MAC (when the cluster has a MAC key); the core copies them into its pool and then releases the lease, which the
connector's loop renews until then (SiteKV), however long the core takes to get to it.
Storing signs the frames with the MAC key (here, off the core's thread) and sends them with
the raw bulk Put (the store verifies their checksums again and skips what it holds).

The MAC key is a parameter: whoever builds the connector reads it at its edge
(ember.serving.core_process: the installed credentials' kv-mac.key); None means a plaintext
cluster, whose frames go unsigned and are read unchecked.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import grpc

from ember.kv import bulk, wire
from ember.rpc import tracing
from ember.rpc.server import channel
from ember.rpc.site_kv import SiteKV
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc

STREAM_TIMEOUT_S = 60.0  # a streamed chunk's push (or pull) at the decode site
CONNECTOR_NICE = 5
log = logging.getLogger("ember.kv_connector")


@dataclass
class Loaded:
    hashes: list[bytes]  # what was asked for
    payloads: dict[bytes, memoryview]  # verified raw payloads (views into the arena or a gRPC message)
    lease_id: int
    blocks_pulled: int
    bytes_pulled: int
    transfer_s: float


class KVConnector:
    def __init__(self, kvstore_address: str, frame_template: wire.FrameHeader, use_shm: bool = True,
                 mac_key: bytes | None = None, routes: dict[str, str] | None = None):
        """`routes`: another site's kvstore address -> the emulated link in front of it (streaming)."""
        self.frame_template = frame_template
        self.kvstore_address, self.routes = kvstore_address, routes or {}
        self._peers: dict[str, grpc.aio.Channel] = {}  # other sites' kvstores (streaming)
        self._streaming: set[asyncio.Task] = set()
        self.blocks_streamed = self.streams_failed = 0
        self.mac_key = wire.check_mac_key(mac_key)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kv-connector", daemon=True)
        self._thread.start()
        self._kv: SiteKV = self._submit(self._open(kvstore_address, use_shm, self.mac_key)).result(timeout=30)

    def _run(self) -> None:
        # below the engine's threads: a chunk's stream (signing, sending) takes the cores the prefill
        # leaves, never the prefill's own (Linux: a thread's nice value is its own)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CONNECTOR_NICE)
        self._loop.run_forever()

    @staticmethod
    async def _open(address: str, use_shm: bool, mac_key: bytes | None) -> SiteKV:
        return SiteKV(channel(address), use_shm, mac_key)

    def _submit(self, coro, trace_context: dict[str, str] | None = None, span: str | None = None,
                **attributes) -> concurrent.futures.Future:
        """Run `coro` on the connector's loop; with a request's `trace_context`, inside a `span` of its
        trace (`ember.` `attributes`; the coroutine adds its own with tracing.annotate)."""
        async def traced():
            with tracing.carried(trace_context):  # the kvstore calls join the request's trace
                if span is None:
                    return await coro
                with tracing.child_span(span, kvstore=self.kvstore_address, **attributes):
                    return await coro
        return asyncio.run_coroutine_threadsafe(traced(), self._loop)

    @property
    def blocks_shared_memory(self) -> int:
        return self._kv.blocks_shared_memory

    @property
    def blocks_grpc(self) -> int:
        return self._kv.blocks_grpc

    @property
    def frames_forged(self) -> int:
        """Frames refused because their MAC failed (never imported)."""
        return self._kv.frames_forged

    @property
    def leases_renewed(self) -> int:
        return self._kv.renewals

    def load(self, hashes: list[bytes], pull_from: str, timeout: float | None,
             trace_context: dict[str, str] | None = None) -> concurrent.futures.Future:
        """Lease (after pulling from `pull_from`, when given) and read the blocks the store has."""
        async def run() -> Loaded:
            start = time.perf_counter()
            pulled = bytes_pulled = 0
            if pull_from:
                response = await self._kv.pull(hashes, pull_from, timeout)
                lease, pulled, bytes_pulled = response.lease, response.blocks_pulled, response.bytes_pulled
            else:
                lease = await self._kv.acquire(hashes, timeout)
            try:
                payloads = await self._kv.payloads(hashes, lease, self.frame_template, timeout)
            except BaseException:
                await self._kv.release(lease.lease_id, check=False)
                raise
            tracing.annotate(blocks_pulled=pulled, bytes_pulled=bytes_pulled, blocks_read=len(payloads),
                             bytes_read=sum(memoryview(p).nbytes for p in payloads.values()))
            return Loaded(hashes, payloads, lease.lease_id, pulled, bytes_pulled, time.perf_counter() - start)
        return self._submit(run(), trace_context, "kv.load", blocks=len(hashes), pull_from=pull_from or None)

    def lookup(self, hashes: list[bytes], timeout: float | None = 10.0,
               trace_context: dict[str, str] | None = None) -> concurrent.futures.Future:
        """Which of the blocks the store holds (a list of bools)."""
        async def run() -> list[bool]:
            response = await self._kv.stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes), timeout=timeout)
            return list(response.present)
        return self._submit(run(), trace_context, "kv.lookup", blocks=len(hashes))

    def release(self, lease_id: int, check: bool = True) -> concurrent.futures.Future:
        """End a lease once its blocks are copied; with `check`, an expired lease fails (DATA_LOSS)."""
        return self._submit(self._kv.release(lease_id, check=check))

    def store(self, frames: list[tuple[bytes, bytes]], timeout: float | None = 60.0,
              trace_context: dict[str, str] | None = None) -> concurrent.futures.Future:
        """Bulk-put (hash, frame) pairs (raw frames from the engine; signed here, lazily, on the
        connector's thread); the future gives (blocks stored, blocks already there)."""
        async def run() -> tuple[int, int]:
            stored, present = await bulk.put(self._kv.channel, self._signed(frames), timeout=timeout)
            tracing.annotate(blocks_stored=stored, blocks_present=present)
            return stored, present
        return self._submit(run(), trace_context, "kv.store", blocks=len(frames), bytes=_nbytes(frames))

    def _signed(self, frames):
        """The frames signed with the cluster's MAC key as they are consumed (on the connector's
        thread); as they are without one."""
        key = self.mac_key
        return frames if key is None else ((h, wire.sign_frame(frame, key)) for h, frame in frames)

    def stream(self, frames: list[tuple[bytes, bytes]], to: str, prefetch: list[bytes] = (),
               after: list[concurrent.futures.Future] = (),
               trace_context: dict[str, str] | None = None) -> concurrent.futures.Future:
        """Layer-wise streaming at chunk grain: a prefill chunk's new blocks (`frames`, raw; signed
        here, on the connector's thread) are pushed to `to` (the decode site's kvstore; announced
        up front, so a pull of them there waits for them) while they are stored in the site store;
        the `prefetch` blocks, which the site store holds, are pulled there. The future gives the
        site store's (stored, already there), summed with the `after` streams' (earlier chunks
        still being stored: it resolves once they have, and fails if one did); what goes to `to`
        runs on in the background (a failure is counted, never raised: decode pulls, or
        recomputes, what did not arrive)."""
        hashes = [h for h, _ in frames]

        async def run() -> tuple[int, int]:
            signed = list(self._signed(frames))  # (sent twice: to `to` and to the site store)
            if hashes:  # the push leaves first: its announcement must reach `to` before decode's pull can
                self._track(self._send_on(to, self._push(to, signed, hashes), len(hashes), "kv.push",
                                          _nbytes(signed)))
            if prefetch:
                self._track(self._send_on(to, self._pull_there(to, list(prefetch)), len(prefetch), "kv.pull_there"))
            stored, present = await bulk.put(self._kv.channel, signed, timeout=60.0) if signed else (0, 0)
            tracing.annotate(blocks_stored=stored, blocks_present=present)
            for earlier in after:
                more = await asyncio.wrap_future(earlier)
                stored, present = stored + more[0], present + more[1]
            return stored, present
        return self._submit(run(), trace_context, "kv.stream", blocks=len(frames), bytes=_nbytes(frames), to=to,
                            relay=self.routes.get(to), prefetch_blocks=len(prefetch))

    def _track(self, coro) -> None:
        """Run `coro` on the connector's loop in the background (closing cancels it)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._streaming.add(task)
        task.add_done_callback(self._streaming.discard)

    def _peer(self, to: str) -> grpc.aio.Channel:
        if to not in self._peers:
            self._peers[to] = channel(self.routes.get(to, to))
        return self._peers[to]

    async def _push(self, to: str, frames, hashes: list[bytes]) -> None:
        await bulk.put(self._peer(to), frames, timeout=STREAM_TIMEOUT_S, announce=hashes)

    async def _pull_there(self, to: str, hashes: list[bytes]) -> None:
        await kvstore_pb2_grpc.KVStoreStub(self._peer(to)).Pull(kvstore_pb2.PullRequest(
            block_hashes=hashes, source=self.kvstore_address, lease_s=0), timeout=STREAM_TIMEOUT_S)

    async def _send_on(self, to: str, moving, count: int, span: str, nbytes: int | None = None) -> None:
        """`moving` to the other site, as a `span` of the request's trace (a child of its kv.stream)."""
        with tracing.child_span(span, to=to, relay=self.routes.get(to), kvstore=self.kvstore_address,
                                blocks=count, bytes=nbytes):
            try:
                await moving
                self.blocks_streamed += count
            except Exception as e:  # noqa: BLE001  (counted and logged: decode pulls or recomputes what is missing)
                self.streams_failed += 1
                why = f"{e.code().name} {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else repr(e)
                tracing.annotate(failed=why)
                log.info("streaming %d blocks to %s failed (decode pulls or recomputes them): %s", count, to, why)

    def close(self) -> None:
        async def shut():
            for lease_id in self._kv.leases_renewing:  # what was never released ends now, not at its TTL
                await self._kv.release(lease_id, check=False)
            for task in list(self._streaming):
                task.cancel()
            for peer in self._peers.values():
                await peer.close()
            await self._kv.channel.close()
        try:
            self._submit(shut()).result(timeout=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def _nbytes(frames) -> int:
    """The bytes of (hash, frame) pairs."""
    return sum(memoryview(frame).nbytes for _, frame in frames)
