"""SIGTERM drains every service kind of a real cluster: health turns NOT_SERVING at once and
calls are still served for the drain notice (so the router's 0.5 s health polls move away
first), then new calls are refused while the in-flight ones run to completion, and the process
exits 0. Prefill and decode answer NOT_SERVING until their model is warm.

On the session's exact cluster (tests/clusters.py), whose processes this test process started, so
it reads their exit codes: the tests drain decode, prefill and the kvstores in turn and start each
again (the router's drain: tests/test_cluster.py, a second router in front of the same cluster).
Every wait polls a condition against a deadline."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember.cluster.chaos import Cluster, wait_dead
from ember.cluster.traces import read_spans
from ember.rpc import security
from ember.rpc.server import CHANNEL_OPTIONS
from ember.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from tests.cluster_fixture import AT_ONCE_S, wait_until
from tests.clusters import DRAIN_NOTICE_S

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
NOTICE_S = DRAIN_NOTICE_S  # the session clusters' drain notice (tests/clusters.py)
EXIT_S = 20  # SIGTERM to exit: the notice, the in-flight calls' end, the engine core's shutdown


CLUSTER: list[Cluster] = []  # the module's cluster, for dial()
_CHANNELS: dict[tuple, grpc.Channel] = {}


def channel(address: str, as_service: str | None = "operator", options=None) -> grpc.Channel:
    """An open channel to a service of the module's cluster with `as_service`'s certificate (None:
    plaintext, a router's public port), kept for the module: health polls and probes during a drain
    must not each pay a TLS handshake on a loaded host."""
    key = (address, as_service, tuple(options or ()))
    if key not in _CHANNELS:
        from ember.cluster.launcher import credentials
        creds = None if as_service is None else credentials(CLUSTER[0].run_dir, as_service)
        _CHANNELS[key] = security.dial(address, creds, options)
    return _CHANNELS[key]


def health(address: str, timeout_s: float = 2.0, as_service: str | None = "operator") -> int | None:
    """The server's overall health status, or None when it does not answer."""
    try:
        return health_pb2_grpc.HealthStub(channel(address, as_service)).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout_s).status
    except grpc.RpcError:
        return None


def logged_at(run_dir, name: str, text: str, after: float) -> float | None:
    """When (epoch seconds, the log's own `ts`) service `name` first logged a line containing `text`
    at or after `after`; None if it has not."""
    import datetime
    import json
    for line in (run_dir / f"{name}.log").read_text(errors="replace").splitlines():
        if text in line and line.startswith("{"):
            ts = datetime.datetime.fromisoformat(json.loads(line)["ts"]).timestamp()
            if ts >= after:
                return ts
    return None


def refused(call: Callable[[], object]) -> grpc.StatusCode | None:
    """The status a new call is refused with, or None when it is served."""
    try:
        call()
        return None
    except grpc.RpcError as e:
        return e.code()


def drain(proc: subprocess.Popen, address: str, in_flight: Future, probe: Callable[[], object],
          router_sees: Callable[[], bool] | None = None, finish: Callable[[], None] | None = None,
          public: bool = False, logs: tuple | None = None) -> dict[str, float]:
    """SIGTERM `proc` while `in_flight` runs and check the drain: NOT_SERVING at once, `probe` (a new
    call) still served during the notice and refused after it while `in_flight` still runs, and
    exit 0. With `router_sees`: the router counts the worker down, and (`logs`: (run_dir, the
    worker's service name, its address)) its own log says it did before the worker began refusing.
    `public`: `address` is a router's public (plaintext) port. `finish` lets the in-flight call end
    (once the refusal is seen). Returns the seconds from the signal to each event."""
    caller = None if public else "operator"
    assert not in_flight.done() and health(address, as_service=caller) == SERVING
    assert refused(probe) is None
    start, signalled = time.monotonic(), time.time()
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: health(address, as_service=caller) == NOT_SERVING, AT_ONCE_S, "health NOT_SERVING after SIGTERM")
    at = {"not_serving_s": time.monotonic() - start}
    assert refused(probe) is None, "still serving during the drain notice"
    at["served_in_notice_s"] = time.monotonic() - start
    if router_sees is not None:
        wait_until(lambda: not router_sees(), AT_ONCE_S, "the router counts the worker down")
        at["router_down_s"] = time.monotonic() - start
    code = wait_until(lambda: refused(probe), NOTICE_S + AT_ONCE_S, "new calls refused after the notice")
    at["refused_s"] = time.monotonic() - start
    assert code == grpc.StatusCode.UNAVAILABLE, code
    assert not in_flight.done(), "refused while a call was still in flight (not after the exit)"
    assert at["refused_s"] >= NOTICE_S * 0.9, at
    if logs is not None:  # the order, by the services' own clocks: the router moved away in the notice
        run_dir, name, worker_address = logs
        draining = logged_at(run_dir, name, "draining on SIGTERM", signalled - 1)
        router_down = logged_at(run_dir, "router", f"@{worker_address} is not serving", signalled - 1)
        assert draining is not None and router_down is not None, (draining, router_down)
        at["router_down_after_drain_s"] = round(router_down - draining, 3)
        assert router_down < draining + NOTICE_S, at
    if finish is not None:
        finish()
    in_flight.result(timeout=EXIT_S)  # the in-flight call ran to completion (the caller checks it)
    assert proc.wait(timeout=EXIT_S) == 0
    at["exit_s"] = time.monotonic() - start
    return at


@pytest.fixture(scope="module")
def cluster(exact_cluster) -> Cluster:
    CLUSTER[:] = [exact_cluster.cluster]
    return exact_cluster.cluster


def watch_startup(cluster: Cluster, name: str, timeout_s: float = 240) -> list[tuple[float, int | None, str]]:
    """Start engine worker `name` again and poll its health, and a real call to it, until it is SERVING:
    (seconds, health, what the call got) per poll. Its core's ready is held (EMBER_TEST_CORE_READY_GATE)
    until a call has been refused while it loads (or for COLD_WATCH_S at most): a core forked from the
    warm engine template can be ready before its service first answers, which shows nothing."""
    seen: list[tuple[float, int | None, str]] = []
    gate = cluster.run_dir / f"{name}.ready-gate"
    gate.unlink(missing_ok=True)
    watcher = threading.Thread(target=_watch, args=(cluster, name, timeout_s, seen, gate), daemon=True)
    watcher.start()
    try:
        cluster.restart(name, timeout_s, env={"EMBER_TEST_CORE_READY_GATE": str(gate)})
    finally:
        gate.touch()
    watcher.join(timeout=10)
    return seen


COLD_WATCH_S = 60


def _watch(cluster: Cluster, name: str, timeout_s: float, seen: list, gate: Path) -> None:
    start = time.monotonic()
    address = cluster.services[name]["address"]
    ch = channel(address, "router")
    if name.startswith("decode"):
        def call():
            decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.DecodeStatsRequest(), timeout=AT_ONCE_S)
    else:
        def call():
            prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                request_id="warm-probe", token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=1)),
                timeout=30)
    while time.monotonic() - start < timeout_s:
        status = health(address)
        probe = "-"
        if status is not None:
            code = refused(call)
            # (a call too slow to answer on a loaded host says nothing of how it would be answered)
            probe = "ok" if code is None else "-" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name
            if probe == "ok" and status != SERVING:
                # the model turned warm between the health check and the call (the service
                # takes calls once its engine is warm and says SERVING a moment later): that
                # call met a warm model, so it counts as SERVING once health says so
                until = time.monotonic() + AT_ONCE_S
                while status != SERVING and time.monotonic() < until:
                    status = health(address)
        seen.append((time.monotonic() - start, status, probe))
        if status == SERVING:
            return
        if probe == "UNAVAILABLE" or time.monotonic() - start > COLD_WATCH_S:
            gate.touch()  # seen refusing while cold: let its core say ready
        time.sleep(0.05)


def process(cluster: Cluster, name: str) -> subprocess.Popen:
    """Service `name`'s process (the session pool started it from this process)."""
    from ember.cluster.launcher import child
    proc = child(cluster.pid(name))
    assert proc is not None, f"{name} was not started by this process"
    return proc


STARTUPS: dict[str, list] = {}  # engine worker -> its watched start-up (watch_startup) after its drain


@pytest.fixture
def restarts(cluster):
    """Each test starts what it drained again (serving, counted live) before the next one runs; an
    engine worker's start is watched (test_an_engine_worker_is_not_serving_until_its_model_is_warm)."""
    drained: list[str] = []
    yield drained
    for name in drained:
        if cluster.alive(name):  # the test failed before its drain ended
            wait_dead(cluster.kill(name))
        if name.startswith(("prefill", "decode")):
            STARTUPS[name] = watch_startup(cluster, name)
        else:
            cluster.restart(name)


def router_sees(cluster: Cluster, name: str) -> Callable[[], bool]:
    return lambda: cluster.router_sees(name) == 1.0


def test_sigterm_drains_decode(cluster, restarts):
    name = "decode-edge"
    address = cluster.services[name]["address"]
    ids = list(range(100, 140))

    def stream() -> list[decode_pb2.DecodeResponse]:
        request = decode_pb2.DecodeRequest(request_id="drain-decode", prompt_token_ids=ids, prefill_here=True,
                                           sampling=common_pb2.SamplingParams(max_tokens=50, ignore_eos=True))
        messages = decode_pb2_grpc.DecodeStub(channel(address, "router")).Decode(request, timeout=60)
        out = [next(messages)]
        first.set_result(True)
        return out + list(messages)

    def probe():  # a call answered by the handler itself (the engine core is frozen meanwhile)
        try:
            list(decode_pb2_grpc.DecodeStub(channel(address, "router")).Decode(
                decode_pb2.DecodeRequest(request_id="drain-probe"), timeout=AT_ONCE_S))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
    first: Future = Future()
    # The in-flight stream is held (its engine core frozen) until the refusal is seen, so however fast
    # this machine decodes its 50 tokens, it is still running when new calls are refused.
    core = engine_core(cluster, name)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(stream)
        first.result(timeout=60)
        restarts.append(name)
        core.suspend()
        try:
            at = drain(process(cluster, name), address, in_flight, probe, router_sees(cluster, name),
                       finish=core.resume, logs=(cluster.run_dir, name, address))
        finally:
            core.resume()
        out = in_flight.result()
    assert sum(len(m.token_ids) for m in out) == 50 and out[-1].finished, "the in-flight stream ran to completion"
    print(name, at)


class engine_core:  # noqa: N801 - reads as what it is: engine_core(cluster, name).suspend()
    """Worker `name`'s engine core process, frozen (SIGSTOP) and let go (SIGCONT): an in-flight call it
    serves is held while a drain is watched. Letting go of a core that has exited is nothing."""

    def __init__(self, cluster: Cluster, name: str):
        self.process = cluster.core(name)

    def suspend(self) -> None:
        self.process.suspend()

    def resume(self) -> None:
        import psutil
        try:
            self.process.resume()
        except psutil.NoSuchProcess:
            pass


def test_sigterm_drains_prefill(cluster, restarts):
    name = "prefill-central"
    address = cluster.services[name]["address"]
    prompts = [[100 + (i * 7919 + j * 31) % 40000 for j in range(512)] for i in range(2)]  # uncached

    def prefill(i: int) -> prefill_pb2.PrefillResponse:
        return prefill_pb2_grpc.PrefillStub(channel(address, "router", CHANNEL_OPTIONS)).Prefill(
            prefill_pb2.PrefillRequest(request_id=f"drain-prefill-{i}", token_ids=prompts[i],
                                       sampling=common_pb2.SamplingParams(max_tokens=8)), timeout=120)

    def probe():  # a call answered by the handler itself, ahead of the busy engine
        try:
            prefill_pb2_grpc.PrefillStub(channel(address, "router")).Prefill(prefill_pb2.PrefillRequest(
                request_id="drain-probe", token_ids=list(range(1, 17)), block_hashes=[b"x" * 16],
                sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=AT_ONCE_S)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise

    def store_reads() -> int:  # the engine core asks the site kvstore for a prompt's blocks first
        return sum(span["name"] == "/ember.v1.KVStore/Acquire" and span["kind"] == "SERVER"
                   for span in read_spans(cluster.run_dir, "kvstore-central"))
    # The in-flight calls are held at their write-back (a frozen site kvstore) until the refusal is
    # seen, so however fast this machine computes, they are still running when new calls are refused.
    store = process(cluster, "kvstore-central")
    before = store_reads()
    with ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(prefill, i) for i in range(len(prompts))]
        wait_until(lambda: store_reads() - before >= len(prompts), 30, "both prefills in the engine core")
        store.send_signal(signal.SIGSTOP)
        try:
            in_flight = pool.submit(lambda: [c.result() for c in calls])
            restarts.append(name)
            at = drain(process(cluster, name), address, in_flight, probe, router_sees(cluster, name),
                       finish=lambda: store.send_signal(signal.SIGCONT), logs=(cluster.run_dir, name, address))
        finally:
            store.send_signal(signal.SIGCONT)
        for response in in_flight.result():
            assert response.computed_tokens == 512 and response.blocks_stored == 512 // 16
    print(name, at)


@pytest.mark.parametrize("name", ["kvstore-edge", "kvstore-central"])
def test_sigterm_drains_a_kvstore(cluster, restarts, name):
    from ember.config.derived import model_facts
    from ember.config.load import load_config
    from ember.kv import wire
    from ember.kv.block_hash import root_hash
    from ember.kv.chunks import split
    address = cluster.services[name]["address"]
    layout = model_facts(load_config(cluster.run_dir / "cluster.yaml")).kv_layout  # the cluster's own model's frames
    template = wire.layout_header(layout, root_hash(layout))
    hashes = [os.urandom(16) for _ in range(4)]
    blocks = [(h, wire.encode_frame(template, h, bytes(layout.block_bytes))) for h in hashes]
    chunks = [kvstore_pb2.BlockChunk(block_hash=h, block_bytes=n, offset=o, data=d) for h, n, o, d in split(blocks)]
    release = threading.Event()

    def stats() -> kvstore_pb2.StatsResponse:
        return kvstore_pb2_grpc.KVStoreStub(channel(address)).Stats(kvstore_pb2.StatsRequest(), timeout=AT_ONCE_S)

    def put() -> kvstore_pb2.PutResponse:
        def held():  # the first block now, the rest once the drain is under way
            yield from chunks[:1]
            release.wait(timeout=60)
            yield from chunks[1:]
        producer = channel(address, "prefill-central", CHANNEL_OPTIONS)  # a KV producer may put
        return kvstore_pb2_grpc.KVStoreStub(producer).Put(held(), timeout=60)
    before = stats().blocks_put
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(put)
        wait_until(lambda: stats().blocks_put > before, 10, "the Put's first block stored (the call is open)")
        restarts.append(name)
        at = drain(process(cluster, name), address, in_flight, stats, finish=release.set)
        assert in_flight.result().blocks_stored == len(blocks), "the in-flight Put ran to completion"
    print(name, at)


@pytest.mark.parametrize("name", ["prefill-central", "decode-edge"])
def test_an_engine_worker_is_not_serving_until_its_model_is_warm(cluster, name):
    """Watched as its drain test above started it again; run alone, it kills and starts it itself."""
    seen = STARTUPS.get(name)
    if seen is None:
        wait_dead(cluster.kill(name))
        seen = watch_startup(cluster, name)
    answered = [(t, status, probe) for t, status, probe in seen if status is not None]
    assert answered, seen
    first, last = answered[0], answered[-1]
    assert first[1] == NOT_SERVING and last[1] == SERVING, answered
    cold = [a for a in answered if a[1] == NOT_SERVING]
    # it listens at once and says NOT_SERVING through the model's load; calls meanwhile are
    # UNAVAILABLE (retry elsewhere), never served half-warm; once SERVING it serves
    served_cold = [a for a in cold if a[2] not in ("UNAVAILABLE", "-")]
    assert not served_cold, served_cold
    assert any(probe == "UNAVAILABLE" for _, _, probe in cold), cold
    assert answered.index(last) == len(answered) - 1 and last[2] == "ok", answered
