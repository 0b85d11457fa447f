"""The engine core: one engine's loop body, carrying out each request's KV plan.

Single-threaded and transport-agnostic: `handle(message)` takes what a service sent,
`turn()` runs one step and returns the events for the service. The same object runs on
a thread of the caller (`InProcessEngineClient`) or on the main thread of its own process
(`ember.serving.core_process`).

The KV connector's part of a request's life (vLLM's KV-connector seam, done once for
prefill and decode alike):
- add: the prompt's full blocks already in the pool (L1) are pinned at once; the rest
  are loaded from the site kvstore (L2, pulled from another site first when the plan
  says so) on the connector's thread while other requests keep stepping.
- import: loaded blocks go into the pool and stay referenced, with the L1 pins, until the
  scheduler admits the request: another request's import can never evict them. If nothing
  can run because held blocks fill the pool, the holds of all but the oldest waiting
  request are dropped (their blocks stay cached, merely evictable): progress over reuse.
- finish: the blocks the request computed leave for the site kvstore right then, before a
  later step could evict them (write-back), so a session's history outlives the pool.

Live state: the loop writes what a service's gauges show (running, waiting, the step in progress
and its prefill tokens, KV blocks, the counters) as one tuple, replaced whole before each step's
model run and after each turn (`_publish`); `live_snapshot()` reads it from any thread, so the
publisher thread of `serve_loop` can send it while a long step runs.

A sync write-back's answer (prefill's first token: decode pulls the blocks next) leaves the moment
its store completes, from the connector's thread through `deliver` (set by `serve_loop`), not at
the end of the step in progress: a step runs for seconds on a CPU, and the answer would wait for
it (it waited for two: the store's completion was only seen at the next turn, whose events went
out after that turn's step). Until then the request counts as running, so the worker's gauges and
the router's count of its calls agree.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ember.engine.engine import LLMEngine
from ember.engine.errors import CapacityError, IntegrityError, InvalidRequestError
from ember.engine.outputs import KVStats, RequestOutput
from ember.engine.scheduler import ScheduledBatch
from ember.kv.block_hash import chain_hashes
from ember.serving.core_spans import CoreSpans
from ember.serving.messages import MEMORY_REFRESH_S, AddRequest, ErrorInfo, Snapshot

log = logging.getLogger("ember.engine")


@dataclass
class _Pending:
    request: AddRequest
    hashes: list[bytes]
    pins: list[int]
    load: concurrent.futures.Future
    l2_lookup: concurrent.futures.Future | None
    aborted: bool = False


@dataclass
class _Live:
    request: AddRequest
    pins: list[int]  # released once the scheduler admits the request
    kv: KVStats
    # sync write-back: which pool hits the site store holds (those it lacks are stored too)
    l1_hashes: list[bytes] = field(default_factory=list)
    l2_lookup: concurrent.futures.Future | None = None
    first_sent: bool = False
    hashes: list[bytes] = field(default_factory=list)  # its prompt's full blocks
    in_store: set[bytes] = field(default_factory=set)  # of those, read from the site store (it holds them)
    streamed: int = 0  # leading full blocks sent on to its plan's stream_to so far
    stream_stores: list[tuple[concurrent.futures.Future, list[bytes]]] = field(default_factory=list)
    counted: bool = False  # its cached tokens are in the tier counters (at its first step)


@dataclass
class _WriteBack:
    """A finished request's blocks on their way to the site store (or its plan's stream_to)."""
    future: concurrent.futures.Future
    out: RequestOutput | None  # sync: its last output, delivered once the store completes
    fail: bool  # sync and on_kv_failure "fail": a failed store is the caller's error


def _outcome(future: concurrent.futures.Future) -> tuple[int, BaseException | None]:
    """A completed store's blocks stored, or its exception (a cancelled one's too)."""
    try:
        return future.result()[0], None
    except Exception as exc:  # noqa: BLE001
        return 0, exc


@dataclass
class TierCounters:
    """Prompt tokens by where their KV came from, counted as the work is done: a request's cached
    tokens (l1, l2) at its first step, computed ones chunk by chunk; tokens sampled step by step."""
    tokens_l1: int = 0
    tokens_l2: int = 0
    tokens_computed: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0  # tokens of requests at their first step (prompt and output prefix), looked up
    blocks_written_back: int = 0
    load_failures: int = 0
    holds_dropped: int = 0
    expired_in_queue: int = 0


@dataclass
class EngineCore:
    engine: LLMEngine
    connector: object | None = None  # ember.rpc.kv_connector.KVConnector when a site kvstore is configured
    pending: dict[str, _Pending] = field(default_factory=dict)
    live: dict[str, _Live] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)  # monotonic, of requests sent with a timeout
    stores: list[_WriteBack] = field(default_factory=list)
    # serve_loop's: deliver(events, answers) sends events from any thread, settling `answers` sync
    # answers (settle_answers) under its send lock just before it takes their snapshot. Set: a sync
    # write-back's completion callback answers it; None (a core driven without serve_loop): the poll
    deliver: Callable[[list, int], None] | None = None
    releases: list[tuple[str, concurrent.futures.Future]] = field(default_factory=list)
    tiers: TierCounters = field(default_factory=TierCounters)
    adds: int = 0  # "add" messages taken in (refused ones too): a client counts those still on their way
    _memory: tuple[tuple[str, int], ...] = ()
    _memory_at: float = float("-inf")
    # the live state (_publish): written by the loop only, read whole by any thread (live_snapshot)
    _state: tuple = ()
    _full: Snapshot = field(default_factory=Snapshot)  # the loop's latest full snapshot
    _version: int = 0
    _step_since: float = 0.0  # the step in progress: when it began (0.0: none), its prefill tokens
    _step_prefill: int = 0
    _step_prompt: int = 0  # of those, prompt tokens (counted as computed once the step is done)
    _running_left: int = 0  # prompt tokens running sequences need beyond the step in progress
    # Sync answers not sent yet count as running here. `_answers_owed`: those counted into the
    # published state (at `_publish`, the moment it stops counting them in the scheduler's running)
    # less those sent (settled under the send lock, just before the answer's own snapshot is taken);
    # `_answers_lock` keeps it and `_state` read together. `_answers_new`: registered since the last
    # publish.
    _answers_owed: int = 0
    _answers_new: int = 0
    _answers_lock: threading.Lock = field(default_factory=threading.Lock)
    spans: CoreSpans | None = None  # each request's spans (queue, chunks, import, decode), when exported

    def __post_init__(self):
        self.engine.on_batch = self._on_batch
        if self.spans is None and CoreSpans.wanted():
            self.spans = CoreSpans()
        self.snapshot()  # (a full one: the publisher thread's base from the start, KV capacity and memory too)

    # -- messages ----------------------------------------------------------------------
    def add(self, request: AddRequest) -> list[tuple]:
        self.adds += 1
        rid = request.request_id
        if rid in self.pending or rid in self.live:
            return [_error(rid, InvalidRequestError(f"request_id {rid!r} is already running"))]
        engine, bm = self.engine, self.engine.block_manager
        try:
            engine.validate(request.prompt_token_ids, request.params)
            engine.check_queue(len(request.prompt_token_ids), also_waiting=len(self.pending),
                               also_tokens=sum(len(p.request.prompt_token_ids) for p in self.pending.values()))
        except (InvalidRequestError, CapacityError) as e:
            return [_error(rid, e)]
        if request.timeout_s is not None:
            self.deadlines[rid] = time.monotonic() + request.timeout_s
        bs = engine.config.block_size
        prompt = request.prompt_token_ids
        hashes = chain_hashes(prompt, bs, bm.root_hash, salt=request.cache_salt, shared_blocks=request.shared_blocks)
        pins = []
        for i, h in enumerate(hashes):
            block_id = bm.lookup(h, prompt[i * bs:(i + 1) * bs])
            if block_id is None:
                break
            bm.pin(block_id)
            pins.append(block_id)
        plan = request.plan
        need = hashes[len(pins):plan.max_blocks if plan is not None else None]
        lookup = None
        if pins and plan is not None and plan.write_back == "sync" and self.connector is not None:
            lookup = self.connector.lookup(hashes[:len(pins)], trace_context=request.trace_context)
        if need and plan is not None and self.connector is not None and (plan.pull_from or plan.read_through):
            load = self.connector.load(need, plan.pull_from, request.timeout_s, request.trace_context)
            self.pending[rid] = _Pending(request, hashes, pins, load, lookup)
            return []
        return self._admit(request, pins, KVStats(blocks_l1=len(pins)), hashes, lookup)

    def abort(self, request_id: str) -> None:
        pending = self.pending.get(request_id)
        if pending is not None:
            pending.aborted = True  # its lease is released when the load completes
            return
        live = self.live.pop(request_id, None)
        if live is not None:
            self._unpin(live)
            self.engine.abort(request_id)
            if self.spans is not None:
                self.spans.finished(request_id, aborted=True)

    def stats(self) -> dict:
        engine, bm = self.engine, self.engine.block_manager
        return {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                "loading": len(self.pending), "used_blocks": bm.num_used_blocks, "total_blocks": bm.num_blocks,
                "held_blocks": sum(len(x.pins) for x in (*self.pending.values(), *self.live.values())),
                "blocks_shared_memory": getattr(self.connector, "blocks_shared_memory", 0),
                "blocks_grpc": getattr(self.connector, "blocks_grpc", 0),
                "frames_forged": getattr(self.connector, "frames_forged", 0),  # refused: their MAC failed
                "preemptions": engine.scheduler.num_preemptions, "evictions": bm.num_evictions,
                "step_choices": dict(engine.scheduler.choices),
                "draft_tokens": engine.stats.num_draft_tokens, "accepted_tokens": engine.stats.num_accepted_tokens,
                "forced_tokens": engine.stats.num_forced_tokens,
                "memory": dict(self.memory(fresh=True)), **vars(self.tiers)}

    def snapshot(self) -> Snapshot:
        """Everything the gauges show, from the loop (after a turn)."""
        engine = self.engine
        self._publish()
        with self._answers_lock:
            state, owed = self._state, self._answers_owed
        (version, running, waiting, adds, since, step_prefill, queued, used, l1, l2, computed, generated,
         queries) = state
        self._full = Snapshot(
            running + owed, waiting, used, engine.block_manager.num_blocks, l1, l2, computed,
            engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens, engine.stats.num_forced_tokens,
            tuple(engine.expert_tokens()), engine.expert_ranks, tuple(engine.scheduler.choices.items()),
            self.memory(), version, time.monotonic(), adds, since, step_prefill, queued, generated, queries)
        return self._full

    def live_snapshot(self) -> Snapshot:
        """The loop's latest snapshot with its live state as written since (a step may be running), as
        of now: safe from any thread, it only reads two references the loop replaces whole."""
        return self._live(self._full)

    def settle_answers(self, sent: int) -> None:
        """`sent` sync answers are about to go out (under serve_loop's send lock): no longer running."""
        if sent:
            with self._answers_lock:
                self._answers_owed -= sent

    def _live(self, base: Snapshot) -> Snapshot:
        with self._answers_lock:
            state, owed = self._state, self._answers_owed
        (version, running, waiting, adds, since, step_prefill, queued, used, l1, l2, computed, generated,
         queries) = state
        return replace(base, version=version, at=time.monotonic(), running=running + owed, waiting=waiting, adds=adds,
                       step_since=since, step_prefill_tokens=step_prefill, queued_prefill_tokens=queued,
                       used_blocks=used, tokens_l1=l1, tokens_l2=l2, tokens_computed=computed,
                       generation_tokens=generated, prefix_queries=queries)

    def _publish(self) -> None:
        """Write the live state (the loop only: before a step's model run, after a turn). One tuple
        replaced whole, so a reader on another thread sees a state as it was, never half of one."""
        scheduler, t = self.engine.scheduler, self.tiers
        queued = self._running_left if scheduler.running else 0
        for pending in self.pending.values():
            queued += len(pending.request.prompt_token_ids)
        for seq in scheduler.waiting:  # (before their prefix-cache hits are known)
            queued += seq.num_tokens - seq.num_computed_tokens
        self._version += 1
        state = (self._version, len(scheduler.running),
                 len(scheduler.waiting) + len(self.pending), self.adds, self._step_since, self._step_prefill,
                 queued, self.engine.block_manager.num_used_blocks, t.tokens_l1, t.tokens_l2,
                 t.tokens_computed, t.generation_tokens, t.prefix_queries)
        with self._answers_lock:  # (finished requests leave the scheduler's running here: their answers
            self._state = state  # start counting here too)
            self._answers_owed += self._answers_new
        self._answers_new = 0

    def _on_batch(self, batch: ScheduledBatch) -> None:
        """A step's batch, scheduled, before the model runs it (LLMEngine.on_batch): what it computes
        and from when go into the live state; a request's first step counts its cached tokens by tier.
        Only the batch's prefill part is looked at (decoders come first): a decode step costs nothing here."""
        seqs, news, t = batch.seqs, batch.num_new_tokens, self.tiers
        step = prompt = left = 0
        for i in range(batch.num_decodes, len(seqs)):
            seq, n = seqs[i], news[i]
            done = seq.num_computed_tokens
            step += n
            prompt += max(0, min(seq.prompt_len, done + n) - done)
            left += seq.num_tokens - done - n
            live = self.live.get(seq.request_id)
            if live is not None and not live.counted:
                live.counted = True
                cached = seq.num_cached_tokens
                from_l2 = min(live.kv.blocks_l2 * self.engine.config.block_size, cached)
                t.tokens_l2 += from_l2
                t.tokens_l1 += cached - from_l2
                t.prefix_queries += seq.num_tokens
        running = self.engine.scheduler.running
        if len(running) > len(seqs):  # running sequences the step left out (its budget ran out)
            scheduled = {id(s) for s in seqs}
            left += sum(s.num_tokens - s.num_computed_tokens for s in running
                        if id(s) not in scheduled and s.num_computed_tokens < s.prompt_len)
        self._running_left, self._step_prefill, self._step_prompt = left, step, prompt
        self._step_since = time.monotonic()
        self._publish()
        if self.spans is not None:
            self.spans.batch(batch)

    def _step_ended(self, done: bool) -> None:
        if done:
            self.tiers.tokens_computed += self._step_prompt
        self._step_since, self._step_prefill, self._step_prompt = 0.0, 0, 0

    def memory_due(self) -> bool:
        return time.monotonic() - self._memory_at >= MEMORY_REFRESH_S

    def memory(self, fresh: bool = False) -> tuple[tuple[str, int], ...]:
        """This process's resident memory by part, measured at most every MEMORY_REFRESH_S (~10 ms each)."""
        now = time.monotonic()
        if fresh or self.memory_due():
            from ember.engine.footprint import engine_memory
            from ember.util.memory import trim
            if not (self.engine.has_unfinished() or self.pending):
                trim()  # idle: the last step's freed buffers go back to the OS (~1 ms)
            try:
                self._memory = tuple(engine_memory(self.engine).items())
            except Exception:  # noqa: BLE001 - a gauge never takes the engine down
                log.exception("measuring the engine's memory failed")
                self._memory = ()
            self._memory_at = now
        return self._memory

    # -- the loop turn -----------------------------------------------------------------------
    def has_work(self) -> bool:
        """True while a step would do something (the loop must not block on its inbox)."""
        return self.engine.has_unfinished() or self._transfers_done()

    def busy(self) -> bool:
        """True while transfers are in flight (the loop waits on its inbox only briefly)."""
        return bool(self.pending or self.stores or self.releases)

    def turn(self) -> list[tuple]:
        events = self._poll_transfers() + self._expire_queued()
        if self.engine.has_unfinished():
            steps = self.engine.stats.num_steps
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the running requests, keep serving
                log.exception("engine step failed")
                self._step_ended(False)
                for rid in list(self.live):
                    self.abort(rid)
                    events.append(_error(rid, exc))
                self._publish()
                return events
            self._step_ended(True)
            if self.spans is not None:
                self.spans.step_done()
            if self.engine.stats.num_steps == steps:
                self._break_hold_deadlock()
            t = self.tiers
            for out in outputs:
                t.generation_tokens += len(out.new_token_ids)
                events.extend(self._on_output(out))
            self._stream_chunks()
            self._release_admitted()
        self._publish()
        return events

    # -- internals -----------------------------------------------------------------------------
    def _expire_queued(self) -> list[tuple]:
        """Requests whose deadline passed before they started are dropped, never computed."""
        if not self.deadlines:
            return []
        now, events = time.monotonic(), []
        waiting = {s.request_id for s in self.engine.scheduler.waiting if s.num_computed_tokens == 0}
        for rid, deadline in list(self.deadlines.items()):
            if rid not in self.pending and rid not in self.live:
                del self.deadlines[rid]
            elif now > deadline and (rid in self.pending or rid in waiting):
                del self.deadlines[rid]
                self.abort(rid)
                self.tiers.expired_in_queue += 1
                events.append(_error(rid, TimeoutError("the request's deadline passed while it was queued")))
        return events

    def _transfers_done(self) -> bool:
        return any(p.load.done() for p in self.pending.values()) or any(w.future.done() for w in self.stores) \
            or any(f.done() for _, f in self.releases)

    def _poll_transfers(self) -> list[tuple]:
        events = []
        for rid, pending in list(self.pending.items()):
            if pending.load.done():
                del self.pending[rid]
                events.extend(self._import(pending))
        for wb in [w for w in self.stores if w.future.done()]:
            self.stores.remove(wb)
            stored, exc = _outcome(wb.future)
            self.tiers.blocks_written_back += stored
            if exc is not None and (wb.out is None or not wb.fail):
                log.warning("write-back to the site kvstore failed (the reader computes instead): %r", exc)
            # (with serve_loop, the store's callback answers it, whether or not it has run yet)
            if wb.out is not None and self.deliver is None:
                events.extend(self._answer(wb))
                self.settle_answers(1)
        for rid, future in [r for r in self.releases if r[1].done()]:
            self.releases.remove((rid, future))
            if future.exception() is not None and rid in self.live:  # lease expired before the copy
                self.abort(rid)
                events.append(_error(rid, future.exception()))
        return events

    def _import(self, pending: _Pending) -> list[tuple]:
        request, rid = pending.request, pending.request.request_id
        try:
            loaded = pending.load.result()
        except Exception as exc:  # noqa: BLE001
            plan = request.plan
            to_compute = len(request.prompt_token_ids) - len(pending.pins) * self.engine.config.block_size
            if pending.aborted or (plan.pull_from and (plan.on_kv_failure == "fail" or (
                    plan.recompute_max_tokens is not None and to_compute > plan.recompute_max_tokens))):
                self._release_pins(pending.pins)
                return [] if pending.aborted else [_error(rid, exc)]
            log.warning("%s from the site kvstore failed (computing %d prompt tokens instead): %s",
                        "pull" if plan.pull_from else "read-through", to_compute, exc)
            self.tiers.load_failures += 1
            return self._admit(request, pending.pins, KVStats(blocks_l1=len(pending.pins)), pending.hashes,
                               pending.l2_lookup)
        if pending.aborted:
            self.connector.release(loaded.lease_id, check=False)
            self._release_pins(pending.pins)
            return []
        kv = KVStats(blocks_l1=len(pending.pins), blocks_pulled=loaded.blocks_pulled,
                     bytes_pulled=loaded.bytes_pulled, transfer_s=loaded.transfer_s)
        held = list(pending.pins)
        covered = pending.hashes[:len(pending.pins) + len(loaded.hashes)]
        payloads = [None] * len(pending.pins) + [loaded.payloads.get(h) for h in loaded.hashes]
        began = time.time_ns()
        try:
            kv.blocks_l2 = self.engine.import_blocks(request.prompt_token_ids, covered, payloads, hold=held,
                                                     cache_salt=request.cache_salt,
                                                     shared_blocks=request.shared_blocks)
        except IntegrityError as exc:
            self.connector.release(loaded.lease_id, check=False)
            self._release_pins(held)
            return [_error(rid, exc)]
        self.releases.append((rid, self.connector.release(loaded.lease_id)))
        if self.spans is not None:
            moved = sum(memoryview(p).nbytes for p in payloads if p is not None)
            self.spans.imported(request, began, kv.blocks_l2, moved)
        return self._admit(request, held, kv, pending.hashes, pending.l2_lookup, in_store=set(loaded.payloads))

    def _admit(self, request: AddRequest, pins: list[int], kv: KVStats, hashes: list[bytes] = (),
               l2_lookup: concurrent.futures.Future | None = None, in_store: set[bytes] = frozenset()
               ) -> list[tuple]:
        try:
            self.engine.add_request(request.prompt_token_ids, request.params, request.request_id,
                                    output_prefix=request.output_prefix, check_queue=False,
                                    cache_salt=request.cache_salt, shared_blocks=request.shared_blocks,
                                    streamed=self._streams(request), tenant=request.tenant)
        except (InvalidRequestError, CapacityError) as e:
            self._release_pins(pins)
            return [_error(request.request_id, e)]
        if self.spans is not None:
            scheduler = self.engine.scheduler
            self.spans.admitted(request, len(scheduler.waiting) - 1, len(scheduler.running))
        self.live[request.request_id] = _Live(request, pins, kv, list(hashes[:kv.blocks_l1]), l2_lookup,
                                              hashes=list(hashes), in_store=set(in_store))
        return []

    def _on_output(self, out: RequestOutput) -> list[tuple]:
        live = self.live.get(out.request_id)
        if live is None:
            return []
        if not live.first_sent:
            out.kv, live.first_sent = live.kv, True
        if not out.finished:
            return [("out", out)]
        del self.live[out.request_id]
        self._unpin(live)
        if self.spans is not None:
            self.spans.finished(out.request_id, out.completion_tokens, out.finish_reason)
        if out.error is not None:  # its grammar failed mid-decode: an error for the caller, not a short answer
            return [_error(out.request_id, InvalidRequestError(f"the request's constraint failed while decoding: "
                                                               f"{out.error}"))]
        plan = live.request.plan
        if plan is None or plan.write_back == "none" or self.connector is None:
            return [("out", out)]
        # Right after the last step: no later step can have evicted these blocks yet.
        wanted = out.block_hashes[out.cached_tokens // self.engine.config.block_size:]
        if live.l2_lookup is not None:
            present = self._present_in_store(live)
            wanted = [h for h in live.l1_hashes if h not in present] + wanted
        # streamed chunks: stored already, or still being stored (the write-back waits for those);
        # only a failed one's blocks go again
        ok = [(f, hashes) for f, hashes in live.stream_stores if not f.done() or f.exception() is None]
        covered = {h for _, hashes in ok for h in hashes}
        frames = []
        for h in dict.fromkeys(h for h in wanted if h not in covered):
            if h in self.engine.block_manager.cached:
                frames.extend(zip([h], self.engine.export_frames([h])))
        out.kv = out.kv or KVStats()
        out.kv.blocks_stored = sum(f.result()[0] for f, _ in ok if f.done())
        self.tiers.blocks_written_back += out.kv.blocks_stored
        pending = [f for f, _ in ok if not f.done()]
        if not frames and not pending:
            return [("out", out)]
        sync = plan.write_back == "sync"
        trace = live.request.trace_context
        # a streaming request's last chunk leaves for the decode site as soon as it is stored, too
        store = self.connector.stream(frames, plan.stream_to, after=pending, trace_context=trace) \
            if self._streams(live.request) else self.connector.store(frames, trace_context=trace)
        wb = _WriteBack(store, out if sync else None, plan.on_kv_failure == "fail")
        self.stores.append(wb)
        if not sync:
            return [("out", out)]
        self._answers_new += 1
        if self.deliver is not None:  # its answer leaves when the store completes, mid-step too
            store.add_done_callback(lambda _, wb=wb: self._answer_now(wb))
        return []

    @staticmethod
    def _answer(wb: _WriteBack) -> list[tuple]:
        """A completed sync write-back's answer: its output, or its error when the store failed and its
        plan says fail (a failed store otherwise means decode computes those blocks instead)."""
        stored, exc = _outcome(wb.future)
        if exc is not None:
            return [_error(wb.out.request_id, exc)] if wb.fail else [("out", wb.out)]
        wb.out.kv.blocks_stored += stored
        return [("out", wb.out)]

    def _answer_now(self, wb: _WriteBack) -> None:
        """On the thread that completed the store (the connector's): send its answer now. (Only a
        transport that is gone fails here, as the loop's own sends would: the service sees the core go.)"""
        deliver = self.deliver
        if deliver is None:  # the loop has stopped: nobody to answer
            return
        try:
            deliver(self._answer(wb), 1)
        except Exception:  # noqa: BLE001 - a callback never raises into the connector's loop
            log.exception("answering a request from its write-back's completion failed")

    @staticmethod
    def _present_in_store(live: _Live) -> set[bytes]:
        """Pool hits the site store holds too, as far as its lookup has answered."""
        lookup = live.l2_lookup
        if lookup is None or not lookup.done() or lookup.exception() is not None:
            return set()
        return {h for h, present in zip(live.l1_hashes, lookup.result()) if present}

    def _streams(self, request: AddRequest) -> bool:
        return bool(request.plan is not None and request.plan.stream_to and self.connector is not None)

    def _stream_chunks(self) -> None:
        """After a step: the full blocks each streaming request's prefill completed leave for its
        plan's stream_to (stored in the site store, pulled there) while its next chunks compute. Its
        last chunk goes with the write-back at its finish; a cached prefix is only pulled there."""
        bs, cached = self.engine.config.block_size, self.engine.block_manager.cached
        for rid, live in self.live.items():
            seq = self.engine.seqs.get(rid)
            if not self._streams(live.request) or seq is None or not seq.admitted_once:
                continue
            full = min(seq.num_computed_tokens, seq.prompt_len) // bs
            if full <= live.streamed:
                continue
            computed_from = max(live.streamed, seq.num_cached_tokens // bs)
            in_store = live.in_store | self._present_in_store(live)
            prefetch = [h for h in live.hashes[live.streamed:computed_from] if h in in_store]
            fresh = [h for h in live.hashes[computed_from:full] if h in cached]
            frames = list(zip(fresh, self.engine.export_frames(fresh)))
            future = self.connector.stream(frames, live.request.plan.stream_to, prefetch,
                                           trace_context=live.request.trace_context)
            live.stream_stores.append((future, fresh))
            live.streamed = full

    def _release_admitted(self) -> None:
        for rid, live in self.live.items():
            if live.pins:
                seq = self.engine.seqs.get(rid)
                if seq is None or seq.admitted_once:
                    self._unpin(live)

    def _break_hold_deadlock(self) -> None:
        """Nothing could be scheduled: if held blocks are why, let all but the oldest go."""
        waiting = list(self.engine.scheduler.waiting)
        if self.engine.scheduler.running or not waiting:
            return
        for seq in waiting[1:]:
            live = self.live.get(seq.request_id)
            if live is not None and live.pins:
                self.tiers.holds_dropped += 1
                self._unpin(live)

    def _unpin(self, live: _Live) -> None:
        self._release_pins(live.pins)
        live.pins = []

    def _release_pins(self, pins: list[int]) -> None:
        for block_id in pins:
            self.engine.block_manager.release(block_id)


def _error(request_id: str, exc: BaseException) -> tuple:
    return ("error", request_id, exc)


def error_info(exc: BaseException) -> ErrorInfo:
    """How an exception crosses the process boundary (the client rebuilds an equivalent one)."""
    from ember.rpc.errors import status_for
    for kind, cls in (("invalid", InvalidRequestError), ("capacity", CapacityError), ("integrity", IntegrityError)):
        if isinstance(exc, cls):
            return ErrorInfo(kind, str(exc))
    code, message = status_for(exc)
    if code.name == "INTERNAL":
        log.error("engine core error", exc_info=exc)
    return ErrorInfo("status", message, code.name)
