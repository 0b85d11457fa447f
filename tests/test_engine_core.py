"""The engine core and its KV connector: subprocess vs in-process clients, holds until
admission, the hold deadlock breaker, L2 read-through under a pool too small for every
session (a real kvstore process), and engine-core death."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import grpc
import pytest

from ember.cluster.ports import write_kvstore_config
from ember.engine.config import EngineConfig
from ember.engine.sampling_params import SamplingParams
from ember.kv.block_hash import chain_hashes
from ember.serving.engine_client import InProcessEngineClient, SubprocessEngineClient
from ember.serving.engine_core import EngineCore
from ember.serving.messages import AddRequest, KVPlan
from tests.cluster_fixture import AT_ONCE_S, wait_until_async
from tests.conftest import LONG_TEXT, PROMPTS

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def run(coro, timeout=240):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(client, ids, params=GREEDY, request_id="r", **kw) -> list[int]:
    tokens = []
    async for out in client.generate(ids, params, request_id, **kw):
        tokens.extend(out.new_token_ids)
    return tokens


def test_in_process_and_subprocess_clients_give_identical_tokens(make_engine, model_path):
    engine = make_engine(kv_cache_mb=64)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:4]]

    async def go():
        local = InProcessEngineClient(engine)
        try:
            expected = await asyncio.gather(*(collect(local, ids, request_id=f"l{i}") for i, ids in enumerate(prompts)))
        finally:
            local.close()
        # the same config as `engine` (the exact fp32 path; it compared against the q4 default before,
        # and agreed only while q4's greedy tokens happened to match fp32's on these prompts)
        remote = await SubprocessEngineClient.start(EngineConfig(model=str(model_path), threads=1, kv_cache_mb=64,
                                                                 dtype="float32", weights="dense"))
        try:
            assert remote.info.pid != os.getpid() and remote.info.block_size == 16
            got = await asyncio.gather(*(collect(remote, ids, request_id=f"s{i}") for i, ids in enumerate(prompts)))
            stats = await remote.stats()
        finally:
            remote.close()
        assert got == expected and all(len(t) == 12 for t in got)
        assert stats["running"] == 0 and stats["used_blocks"] == 0 and stats["held_blocks"] == 0
    run(go())


def test_subprocess_core_errors_keep_their_status(model_path):
    from ember.engine.errors import InvalidRequestError

    async def go():
        remote = await SubprocessEngineClient.start(EngineConfig(model=str(model_path), threads=1,
                                                                 kv_cache_mb=16))
        try:
            with pytest.raises(InvalidRequestError, match="token ids must be in"):
                await collect(remote, [10**7])
            assert await collect(remote, [1, 2, 3], request_id="after") != []  # still serving
        finally:
            remote.close()
    run(go())


def test_killing_the_engine_core_fails_streams_at_once(model_path):
    async def go():
        died = asyncio.Event()
        remote = await SubprocessEngineClient.start(EngineConfig(model=str(model_path), threads=1,
                                                                 kv_cache_mb=128), on_death=died.set)
        stream = remote.generate([1, 2, 3, 4], SamplingParams(max_tokens=2000, ignore_eos=True), "long")
        await stream.__anext__()  # decoding
        os.kill(remote.info.pid, signal.SIGKILL)
        killed = time.monotonic()
        from ember.rpc.errors import RpcError
        with pytest.raises(RpcError) as e:
            async for _ in stream:
                pass
        failed_after_s = time.monotonic() - killed
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and failed_after_s < AT_ONCE_S, failed_after_s
        await asyncio.wait_for(died.wait(), AT_ONCE_S)
        assert not remote.alive
        with pytest.raises(RpcError):  # new requests are refused at once, not queued forever
            await collect(remote, [1, 2, 3], request_id="next")
        remote.close()
    run(go())


class LoopbackConnector:
    """An in-memory L2 (unit tests only): blocks exported by another engine, leased by nobody."""

    def __init__(self, frames: dict[bytes, bytes], template):
        import concurrent.futures
        self.frames, self.template, self.futures = frames, template, concurrent.futures
        self.loads = 0

    def _done(self, value):
        f = self.futures.Future()
        f.set_result(value)
        return f

    def load(self, hashes, pull_from, timeout, trace_context=None):
        from ember.kv import wire
        from ember.rpc.kv_connector import Loaded
        self.loads += 1
        payloads = {h: wire.decode_frame(self.frames[h], self.template, block_hash=h)
                    for h in hashes if h in self.frames}
        return self._done(Loaded(hashes, payloads, 0, 0, 0, 0.0))

    def lookup(self, hashes, timeout=None, trace_context=None):
        return self._done([h in self.frames for h in hashes])

    def release(self, lease_id, check=True):
        return self._done(None)

    def store(self, frames, timeout=None, trace_context=None):
        new = [h for h, _ in frames if h not in self.frames]
        self.frames.update(frames)
        return self._done((len(new), len(frames) - len(new)))


def drive(core: EngineCore, requests: list[AddRequest], max_turns: int = 5000) -> dict[str, list[int]]:
    tokens = {r.request_id: [] for r in requests}
    done = set()
    for r in requests:
        for event in core.add(r):
            raise AssertionError(f"add failed: {event}")
    if not requests:
        return tokens
    for _ in range(max_turns):
        for event in core.turn():
            assert event[0] == "out", event
            tokens[event[1].request_id].extend(event[1].new_token_ids)
            if event[1].finished:
                done.add(event[1].request_id)
        if len(done) == len(requests):
            return tokens
    raise AssertionError(f"no progress: {len(done)}/{len(requests)} finished")


def test_imported_blocks_are_held_until_admission_and_no_hold_deadlocks(make_engine):
    source = make_engine(kv_cache_mb=64)
    texts = [LONG_TEXT[i * 300:i * 300 + 1500] for i in range(2)]
    prompts = [source.tokenizer.encode(t) for t in texts]
    frames = {}
    for ids in prompts:
        source.generate([ids], replace(GREEDY, max_tokens=1))
        hashes = chain_hashes(ids, 16, source.block_manager.root_hash)
        frames.update(zip(hashes, source.export_frames(hashes)))
    expected = [c.token_ids for c in source.generate(prompts, GREEDY)]
    blocks_each = -(-max(len(p) for p in prompts) // 16) + 1
    # a pool that holds one request's imported blocks plus its growth, not both requests'
    engine = make_engine(num_kv_blocks=blocks_each + 4)
    connector = LoopbackConnector(frames, engine.frame_template)
    core = EngineCore(engine, connector)
    plan = KVPlan(read_through=True, write_back="none")
    requests = [AddRequest(f"r{i}", ids, GREEDY, plan=plan) for i, ids in enumerate(prompts)]
    # turn 0 imports both: the first request's blocks are held while the second's import
    # finds no free block; the first is then admitted with every imported block a hit
    got = drive(core, requests)
    assert [got["r0"], got["r1"]] == expected
    assert core.tiers.holds_dropped == 1  # both held what the other needed: the younger let go
    assert core.tiers.tokens_l2 > 0 and core.stats()["held_blocks"] == 0
    assert engine.block_manager.num_used_blocks == 0
    first_full = (len(prompts[0]) - 1) // 16 * 16
    assert core.tiers.tokens_l2 >= first_full  # request 0 computed none of its imported prefix


def test_l1_hits_are_pinned_against_eviction_until_admission(make_engine):
    engine = make_engine(num_kv_blocks=120)
    ids = engine.tokenizer.encode(LONG_TEXT[:1200])
    engine.generate([ids], replace(GREEDY, max_tokens=1))  # ids' blocks are cached, unreferenced
    core = EngineCore(engine, LoopbackConnector({}, engine.frame_template))
    assert core.add(AddRequest("hit", ids, GREEDY, plan=KVPlan(write_back="none"))) == []
    bm = engine.block_manager
    assert core.stats()["held_blocks"] == len(ids) // 16
    taken = [bm._take_fresh() for _ in range(bm.num_free_blocks)]  # another request takes every free block
    hashes = chain_hashes(ids, 16, bm.root_hash)
    assert all(h in bm.cached for h in hashes)  # none of the held blocks was evicted
    for block_id in taken:
        bm.release(block_id)
    while engine.has_unfinished():  # admitted at the first step, then run to the end
        core.turn()
        assert core.stats()["held_blocks"] == 0
    assert core.tiers.tokens_l1 == len(ids) // 16 * 16 and bm.num_used_blocks == 0


@pytest.fixture()
def kvstore_process(tmp_path):
    address = write_kvstore_config(tmp_path / "kv.yaml", capacity_mb=256)["kvstore"]
    proc = subprocess.Popen([sys.executable, "-m", "ember.services.kvstore", "--config", str(tmp_path / "kv.yaml"),
                             "--site", "solo"], stdout=open(tmp_path / "kv.log", "w"), stderr=subprocess.STDOUT)
    from ember.cluster.launcher import wait_serving
    try:
        wait_serving(address, time.monotonic() + 60, proc, tmp_path / "kv.log")
        yield address
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_follow_up_turn_reads_its_history_through_from_the_site_kvstore(make_engine, kvstore_process):
    """Pool far too small for 4 sessions: each follow-up turn computes only its new tokens."""
    from ember.rpc.kv_connector import KVConnector
    small = make_engine(num_kv_blocks=50)  # one session at a time
    big = make_engine(kv_cache_mb=128)
    sessions = [small.tokenizer.encode(f"Session {i}. " + LONG_TEXT[i * 500:i * 500 + 2600]) for i in range(4)]
    follow_up = small.tokenizer.encode(" And what came next for the harbour town?")
    plan = KVPlan(read_through=True, write_back="async")

    async def go():
        connector = KVConnector(kvstore_process, small.frame_template)
        client = InProcessEngineClient(small, connector)
        try:
            for i, ids in enumerate(sessions):  # turn 1 of every session: computed, written back
                await collect(client, ids, request_id=f"t1-{i}", plan=plan)
            deadline = time.monotonic() + 30
            while (await client.stats())["blocks_written_back"] < sum(len(s) // 16 for s in sessions):
                assert time.monotonic() < deadline, "write-back did not complete"
                await asyncio.sleep(0.05)
            before = await client.stats()
            got = []
            for i, ids in enumerate(sessions):  # turn 2: history evicted from the pool long ago
                got.append(await collect(client, ids + follow_up, request_id=f"t2-{i}", plan=plan))
            after = await client.stats()
        finally:
            client.close()
        computed = after["tokens_computed"] - before["tokens_computed"]
        from_l2 = after["tokens_l2"] - before["tokens_l2"]
        new_tokens = sum(len(s + follow_up) - len(s) // 16 * 16 for s in sessions)
        assert computed == new_tokens, (computed, new_tokens)
        assert from_l2 == sum(len(s) // 16 * 16 for s in sessions)
        assert got == [c.token_ids for c in big.generate([s + follow_up for s in sessions], GREEDY)]
    run(go())


def test_a_killed_engine_core_makes_its_service_not_serving_and_streams_unavailable(exact_cluster):
    """On the session's exact cluster; the decode worker is started again after (its service stays up
    without a core: NOT_SERVING)."""
    from ember.client import RouterClient
    from ember.cluster.chaos import wait_dead
    from ember.cluster.status import health
    from tests.cluster_fixture import wait_until
    cluster = exact_cluster.cluster
    core = cluster.core("decode-edge")
    try:
        with RouterClient(cluster.router) as client:
            stream = client.stream(text="Count slowly: one, two, three,", max_tokens=2000, ignore_eos=True,
                                   timeout=120)
            next(stream), next(stream)  # decoding at the edge
            core.kill()
            killed = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                for _ in stream:
                    pass
            failed_after_s = time.monotonic() - killed
        # an event, not a hang: the stream fails as the core's socket closes (well under a second on a
        # quiet host), never at its 120 s deadline
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and failed_after_s < AT_ONCE_S, failed_after_s
        address = cluster.services["decode-edge"]["address"]
        wait_until(lambda: health(address, cluster.credentials) == "NOT_SERVING", AT_ONCE_S,
                   "decode says NOT_SERVING once its engine core is dead")
    finally:
        wait_dead(cluster.kill("decode-edge"))
        cluster.restart("decode-edge")


def test_the_waiting_queue_is_bounded_and_a_queued_request_past_its_deadline_is_never_computed(make_engine):
    engine = make_engine(kv_cache_mb=32, max_waiting_requests=2, max_num_seqs=1)
    core = EngineCore(engine)
    ids = engine.tokenizer.encode(PROMPTS[0])
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    assert core.add(AddRequest("running", ids, long)) == []
    core.turn()  # admitted: running, the queue is empty again
    assert core.add(AddRequest("q1", ids, long)) == []
    assert core.add(AddRequest("late", ids + [5], long, timeout_s=0.05)) == []
    [(kind, rid, exc)] = core.add(AddRequest("q3", ids, long))  # a third waiting request: refused
    assert (kind, rid, type(exc).__name__) == ("error", "q3", "CapacityError") and "queue is full" in str(exc)
    while time.monotonic() <= core.deadlines["late"]:  # until its deadline has passed
        time.sleep(0.01)
    events = core.turn()
    expired = [e for e in events if e[0] == "error" and e[1] == "late"]
    assert expired and isinstance(expired[0][2], TimeoutError) and core.tiers.expired_in_queue == 1
    assert "late" not in engine.seqs, "dropped from the queue before any of it was computed"
    while engine.has_unfinished():
        core.turn()
    assert engine.block_manager.num_used_blocks == 0


def test_the_core_publishes_its_state_during_a_long_step_and_counts_as_it_goes(make_engine):
    """A step made long on purpose (its model run first sleeps `long_s`): the service side hears the core's
    state at least every 0.5 s while it runs (the publisher thread of serve_loop, not the step's outputs),
    saying a step is in progress and what it prefills; a request sent meanwhile counts as waiting at once;
    computed and generated tokens advance per step, before the request ends (the later prefill steps
    sleep `chunk_s`, longer than PUBLISH_S, so a state between chunks is heard)."""
    from ember.serving.messages import PUBLISH_S
    long_s, chunk_s, chunk = 1.6, 0.6, 64
    engine = make_engine(kv_cache_mb=64, max_num_batched_tokens=chunk)
    ids = engine.tokenizer.encode(LONG_TEXT[:800])
    assert len(ids) > 2 * chunk
    run_model, slept, started = engine.runner.run, [], []

    def run_long(batch):
        if not slept:
            started.append(time.monotonic())
            time.sleep(long_s)  # (releases the GIL, as the C++ kernels and torch do)
            slept.append(time.monotonic())
        elif batch.num_decodes < len(batch.seqs):
            time.sleep(chunk_s)
        return run_model(batch)
    engine.runner.run = run_long

    async def go():
        client = InProcessEngineClient(engine)
        heard: list[tuple[float, object]] = []  # (when the service side got it, the snapshot)
        deliver = client._deliver

        def recording(events, snapshot):
            heard.append((time.monotonic(), snapshot))
            deliver(events, snapshot)
        client._deliver = recording
        try:
            first = asyncio.ensure_future(collect(client, ids, SamplingParams(max_tokens=6, ignore_eos=True), "long"))
            await wait_until_async(lambda: client.snapshot.step_since, AT_ONCE_S, "the step in progress, heard")
            # the core is inside the step: a second request is waiting from the moment it is sent
            second = asyncio.ensure_future(collect(client, ids[:40], SamplingParams(max_tokens=2, ignore_eos=True),
                                                   "second"))
            await asyncio.sleep(0)  # (its add is sent)
            now = client.current()
            assert (now.running, now.waiting) == (1, 1) and not slept, "counted before the core could read it"
            mid_prefill = await wait_until_async(lambda: next(
                (s for _, s in heard if 0 < s.tokens_computed < len(ids)), None),
                AT_ONCE_S, "tokens computed counted after the first chunk, before the prompt is done")
            assert mid_prefill.tokens_computed % chunk == 0 and mid_prefill.generation_tokens == 0
            await asyncio.gather(first, second)
        finally:
            client.close()
        during = [(t, s) for t, s in heard if s.step_since and s.at < slept[0]]  # (the next step begins after)
        assert len(during) >= int(long_s / 0.5), f"{len(during)} snapshots during a {long_s} s step"
        stamps = [started[0]] + [s.at for _, s in during] + [slept[0]]
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        print(f"state published during a {long_s} s step: {len(during)} times, largest gap {max(gaps):.3f} s "
              f"(PUBLISH_S {PUBLISH_S})")
        assert max(gaps) <= 0.5, gaps
        assert all(s.running == 1 and s.step_prefill_tokens == chunk for _, s in during)
        # the rest of its prompt; the second request is the client's to count until the step ends
        assert all(s.queued_prefill_tokens == len(ids) - chunk and s.waiting == 0 for _, s in during)
        final = client.snapshot
        assert final.tokens_computed + final.tokens_l1 + final.tokens_l2 == len(ids) + 40
        assert final.generation_tokens == 6 + 2 and final.prefix_queries == len(ids) + 40
        assert final.step_since == 0.0 and final.running == final.waiting == 0
    run(go())


class SlowStoreConnector(LoopbackConnector):
    """A store that completes `store_s` later on another thread, as a real kvstore call does."""

    def __init__(self, frames, template, store_s: float):
        super().__init__(frames, template)
        self.store_s = store_s

    def store(self, frames, timeout=None, trace_context=None):
        import threading
        future = self.futures.Future()
        stored = super().store(frames).result()
        threading.Timer(self.store_s, future.set_result, (stored,)).start()
        return future

    def close(self):
        pass


def test_a_sync_write_back_answers_when_its_store_completes_not_after_the_step_in_progress(make_engine):
    """Prefill's answer waits on its blocks reaching the site store (decode pulls them next), and on
    nothing else: with one seat, A (prefill only) finishes its step and its store begins; B's step,
    long on purpose, starts; A's answer arrives when its store completes, mid-step, not after the step
    (it waited for two before). Until then A counts as running at this worker; after, only B does."""
    long_s, store_s = 2.5, 0.6  # (the store outlasts PUBLISH_S: a state is heard before the answer)
    engine = make_engine(kv_cache_mb=64, max_num_seqs=1)
    a, b = engine.tokenizer.encode(LONG_TEXT[:300]), engine.tokenizer.encode(PROMPTS[1])
    run_model, b_step = engine.runner.run, []

    def run_b_long(batch):
        if any(s.request_id == "a" for s in batch.seqs):
            time.sleep(0.5)  # (long enough for B to arrive meanwhile: it waits for the seat)
        if any(s.request_id == "b" for s in batch.seqs) and not b_step:
            b_step.append(time.monotonic())
            time.sleep(long_s)  # (releases the GIL, as the C++ kernels and torch do)
            b_step.append(time.monotonic())
        return run_model(batch)
    engine.runner.run = run_b_long
    sync = KVPlan(write_back="sync", read_through=False)

    async def go():
        client = InProcessEngineClient(engine, SlowStoreConnector({}, engine.frame_template, store_s))
        heard = []  # (when the core took the snapshot, the answers it came with, its running)
        deliver = client._deliver

        def recording(events, snapshot):
            heard.append((snapshot.at, [e[1].request_id for e in events if e[0] == "out"], snapshot.running))
            deliver(events, snapshot)
        client._deliver = recording
        try:
            outs = []

            async def prefill():
                async for out in client.generate(a, SamplingParams(max_tokens=1), "a", plan=sync):
                    outs.append((time.monotonic(), out))
            first = asyncio.ensure_future(prefill())
            await wait_until_async(lambda: client.snapshot.step_since, AT_ONCE_S, "A's step in progress")
            await asyncio.gather(first, collect(client, b, SamplingParams(max_tokens=2, ignore_eos=True), "b"))
        finally:
            client.close()
        [(answered, out)] = outs
        began, ended = b_step
        print(f"A answered {answered - began:.2f} s into B's {long_s} s step (store {store_s} s)")
        assert out.finished and out.kv.blocks_stored == len(a) // engine.config.block_size
        # (before the step's end: the loop cannot emit before then, only the store's thread can)
        assert began < answered < ended, (answered - began, "A's answer waited on B's step")
        # A was running here until its answer went out with a snapshot no longer counting it
        with_answer = next(i for i, (_, rids, _) in enumerate(heard) if "a" in rids)
        assert heard[with_answer][2] == 1, "the answer's snapshot counts B only"
        during = [running for t, rids, running in heard[:with_answer] if began < t]
        assert during and all(r == 2 for r in during), f"A and B both counted until A's answer: {during}"
    run(go())


def test_a_cancelled_write_back_is_answered_and_the_core_keeps_serving(make_engine):
    """A store future cancelled (its channel closing) is a failed store: the answer goes out (recompute:
    decode computes those blocks) or is the caller's error (fail), and the loop goes on."""
    class CancellingConnector(LoopbackConnector):
        def store(self, frames, timeout=None, trace_context=None):
            future = self.futures.Future()
            future.cancel()
            return future

    engine = make_engine(kv_cache_mb=32)
    core = EngineCore(engine, CancellingConnector({}, engine.frame_template))
    for i, on_failure in enumerate(("recompute", "fail")):
        ids = engine.tokenizer.encode(f"Request {i}. " + LONG_TEXT[:300])
        plan = KVPlan(write_back="sync", read_through=False, on_kv_failure=on_failure)
        assert core.add(AddRequest(on_failure, ids, SamplingParams(max_tokens=1), plan=plan)) == []
        mine = []
        for _ in range(500):
            mine += [e for e in core.turn() if (e[1].request_id if e[0] == "out" else e[1]) == on_failure]
            if mine:
                break
        [event] = mine
        if on_failure == "recompute":
            assert event[0] == "out" and event[1].finished and event[1].kv.blocks_stored == 0
        else:
            assert event[0] == "error" and "Cancelled" in type(event[2]).__name__
    assert not core.stores and not engine.has_unfinished()
