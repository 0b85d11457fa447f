"""Chaos machinery for a local cluster started by `ember up` (tests and `ember bench chaos`).

`Cluster(run_dir)` reads the run directory `ember up` wrote (services.json, pids.json): kill a
service with SIGKILL (its engine core must follow on its own: the pids returned include it),
restart it from its recorded argv and wait until it serves and, for a worker, until the router's
/metrics count it live (`ember:worker_live{role,site,address}`), read decode and kvstore stats,
and check that a cluster settled (no sequence running or waiting, no block used, no lease held);
`reset` brings a cluster back to its start state and proves it, `second_router` puts another router
in front of its workers. Services this process started are its children: `wait_exit` reads their
exit codes. `run_streams` runs N concurrent router streams with a callback while they run and records when
each token arrived; `set_faults` switches the chaos relay's fault modes (faults.json).
Every wait has a deadline; none is a fixed sleep.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import yaml

from ember.client import RouterClient
from ember.cluster.launcher import child, credentials, spawn, wait_serving
from ember.cluster.status import scrape
from ember.rpc import security
from ember.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, router_pb2

POLL_S = 0.05
SCRAPE_S = 10.0  # a service's /metrics on a loaded host: slow is not absent


class Cluster:
    """A running local cluster, by its run directory."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.credentials = credentials(self.run_dir)  # the operator's certificate (None: plaintext)

    @property
    def services(self) -> dict:
        """name -> {address, role, site, metrics, argv} (re-read: a restart changes nothing there)."""
        return json.loads((self.run_dir / "services.json").read_text())

    @property
    def router(self) -> str:
        return self.services["router"]["address"]

    def names(self, role: str) -> list[str]:
        return [n for n, info in self.services.items() if info["role"] == role]

    def pid(self, name: str) -> int:
        return json.loads((self.run_dir / "pids.json").read_text())[name]

    def kill(self, name: str) -> list[int]:
        """SIGKILL the service `name` (its engine core follows when its socket closes); its pids,
        its children's and its engine core's, for `wait_dead`."""
        proc = psutil.Process(self.pid(name))
        pids = [proc.pid] + [c.pid for c in proc.children(recursive=True)]
        if self.services[name]["role"] in ("prefill", "decode") and (core := self.core(name)) is not None:
            pids.append(core.pid)
        os.kill(proc.pid, signal.SIGKILL)
        return list(dict.fromkeys(pids))

    def core(self, name: str) -> psutil.Process | None:
        """Engine service `name`'s engine core process (its /metrics say which: a core forked by the
        engine template is the template's child, not the service's), or None when it has none."""
        from ember.cluster.status import scrape
        pid = scrape(self.services[name].get("metrics")).get("ember:engine_core_pid")
        try:
            return psutil.Process(int(pid)) if pid else None
        except psutil.NoSuchProcess:
            return None

    def restart(self, name: str, timeout_s: float = 240, env: dict[str, str] | None = None) -> dict[str, float]:
        """Start `name` again from its recorded argv (as `ember up` did: same log, passive OpenMP
        waits, JSON logs; `env` added to its environment) and wait until it serves and, for a prefill
        or decode worker, until the router counts it live. Seconds from the call to each:
        {"serving_s", "router_live_s"}."""
        start = time.monotonic()
        info = self.services[name]
        log = self.run_dir / f"{name}.log"
        # (its recorded env: its certificate folder)
        proc = spawn(self.run_dir, name, info["argv"], {**info.get("env", {}), **(env or {})})
        pids = json.loads((self.run_dir / "pids.json").read_text())
        if (old := child(pids.get(name, -1))) is not None:
            old.poll()  # reap the process it replaces (killed), if it was ours
        pids[name] = proc.pid
        tmp = self.run_dir / "pids.json.tmp"
        tmp.write_text(json.dumps(pids))
        tmp.replace(self.run_dir / "pids.json")
        if info["address"] is not None:  # (the links relay serves no gRPC)
            wait_serving(info["address"], start + timeout_s, proc, log,
                         None if name == "router" else self.credentials, info.get("ca"))
        out = {"serving_s": time.monotonic() - start}
        if info["role"] in ("prefill", "decode"):
            self.wait_router_sees(name, live=True)
            out["router_live_s"] = time.monotonic() - start
        return out

    def alive(self, name: str) -> bool:
        """Whether service `name`'s process runs (a zombie is dead)."""
        pid = self.pid(name)
        if (proc := child(pid)) is not None:
            return proc.poll() is None
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def wait_exit(self, name: str, timeout_s: float = 30) -> int:
        """Service `name`'s exit code once it exits (it must have been started by this process)."""
        proc = child(self.pid(name))
        if proc is None:
            raise LookupError(f"{name} was not started by this process: its exit code is not this process's to read")
        return proc.wait(timeout=timeout_s)

    def serving(self, name: str) -> bool:
        """Whether service `name` answers its health check SERVING (the links relay: whether it runs)."""
        from ember.cluster.status import health
        info = self.services[name]
        if info["address"] is None:
            return self.alive(name)
        return health(info["address"], None if name == "router" else self.credentials, info.get("ca")) == "SERVING"

    def reset(self, timeout_s: float = 120) -> list[str]:
        """Back to the state the cluster started in, proven: every service that is down or not serving
        (a worker whose engine core died) started again, every link healed, every worker counted live
        by the router, and nothing left over (no sequence running or waiting anywhere, no block used at
        decode, no lease held). The names of the services it had to start again."""
        restarted = [name for name in self.services if not self.alive(name) or not self.serving(name)]
        for name in restarted:
            if self.alive(name):
                wait_dead(self.kill(name))
            self.restart(name, timeout_s)
        if (self.run_dir / "faults.json").exists():
            self.set_faults({})
        for name in self.names("prefill") + self.names("decode"):
            self.wait_router_sees(name, live=True, timeout_s=timeout_s)
        self.settle(self.names("decode"), timeout_s)
        return restarted

    @contextmanager
    def second_router(self, folder: Path, placement: dict | None = None,
                      **settings) -> Iterator[tuple[dict, subprocess.Popen]]:
        """Another router in front of this cluster's workers, for the `with` block: the cluster's config
        with a router section of its own (fresh ports for its gRPC, internal and, where the cluster
        serves one, HTTP listeners; `settings` on top, paths relative to FOLDER), holding the cluster's
        router certificate. It logs to FOLDER/router-2.log; killed after the block unless it exited.
        Yields its router section and its process. (With `tls={cert, key[, ca]}` its health is checked
        over TLS trusting `ca`, else `cert`.) (The kvstores publish to the first router: its block directory
        stays empty.)"""
        from ember.cluster.ports import free_port
        argv = self.services["router"]["argv"]
        data = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
        ports = {key: f"127.0.0.1:{free_port()}" for key in ("listen", "internal", "http")
                 if key != "http" or data["router"].get("http")}
        data["router"] = {**data["router"], **ports, **settings}
        data["placement"] = {**data.get("placement", {}), **(placement or {})}
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "router-2.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        proc = spawn(folder, "router-2", [*argv[:3], "--config", str(folder / "router-2.yaml")],
                     self.services["router"].get("env", {}))
        try:
            tls = data["router"].get("tls")
            ca = str(folder / (tls.get("ca") or tls["cert"])) if isinstance(tls, dict) else None
            wait_serving(data["router"]["listen"], time.monotonic() + 120, proc, folder / "router-2.log", public_ca=ca)
            yield data["router"], proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=20)

    def router_sees(self, name: str) -> float | None:
        """The router's `ember:worker_live` for worker `name` (1.0 live, 0.0 down, None unknown)."""
        info = self.services[name]
        key = f'ember:worker_live{{address="{info["address"]}",role="{info["role"]}",site="{info["site"]}"}}'
        return scrape(self.services["router"]["metrics"], SCRAPE_S).get(key)

    def wait_router_sees(self, name: str, live: bool, timeout_s: float = 10) -> float:
        """Until the router's /metrics count worker `name` live (or down); a restarted worker is back
        in its pool within a reconnect backoff (at most 1 s) plus a health poll. Seconds waited."""
        start = time.monotonic()
        while self.router_sees(name) != float(live):
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"the router never counted {name} {'live' if live else 'down'}")
            time.sleep(POLL_S)
        return time.monotonic() - start

    def decode_stats(self, name: str):
        with security.dial(self.services[name]["address"], self.credentials) as ch:
            return decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.DecodeStatsRequest(), timeout=10)

    def busiest(self, names: list[str]) -> str:
        """The decode worker among `names` running the most sequences now."""
        return max(names, key=lambda n: self.decode_stats(n).running)

    def leases(self) -> int:
        total = 0
        for name in self.names("kvstore"):
            with security.dial(self.services[name]["address"], self.credentials) as ch:
                total += kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=10).leases
        return total

    def prefill_load(self) -> dict[str, float]:
        """Sequences running or waiting at each prefill worker (its /metrics)."""
        load = {}
        for name in self.names("prefill"):
            m = scrape(self.services[name]["metrics"], SCRAPE_S)
            load[name] = m.get("ember:num_requests_running", 0) + m.get("ember:num_requests_waiting", 0)
        return load

    def settle(self, names: list[str], timeout_s: float = 90) -> float:
        """Until no sequence runs or waits and no block is used on decode workers `names`, nothing runs
        or waits at prefill, and no kvstore holds a lease. Seconds waited; TimeoutError with what was left."""
        start = time.monotonic()
        while True:
            stats = [self.decode_stats(n) for n in names]
            leases, prefill = self.leases(), self.prefill_load()
            if all(s.running == 0 and s.waiting == 0 and s.used_blocks == 0 for s in stats) and leases == 0 \
                    and not any(prefill.values()):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"not settled: {stats}, leases {leases}, prefill {prefill}")
            time.sleep(0.1)

    def log_lines(self, name: str) -> list[str]:
        return (self.run_dir / f"{name}.log").read_text(errors="replace").splitlines()

    def relay_to(self, name: str) -> str:
        """The chaos relay's listen address in front of service `name` (placement.emulate_links)."""
        target = self.services[name]["address"]
        relays = [r["listen"] for r in json.loads((self.run_dir / "links.json").read_text()) if r["target"] == target]
        if len(relays) != 1:
            raise LookupError(f"{len(relays)} relays lead to {name} ({target}); is placement.emulate_links on?")
        return relays[0]

    def set_faults(self, faults: dict[str, str], timeout_s: float = 30) -> None:
        """{relay listen address: mode} for the relay (it re-reads the file every 0.1 s); {} heals every
        link. Returns once the relay says the modes are in force (faults.json.applied)."""
        path, text = self.run_dir / "faults.json", json.dumps(faults)
        path.with_suffix(".tmp").write_text(text)
        path.with_suffix(".tmp").replace(path)  # the relay never reads a half-written file
        applied, deadline = self.run_dir / "faults.json.applied", time.monotonic() + timeout_s
        while not (applied.exists() and applied.read_text() == text):
            if time.monotonic() > deadline or not self.alive("links"):
                raise TimeoutError(f"the links relay did not apply {text} within {timeout_s} s")
            time.sleep(POLL_S)


def wait_dead(pids: list[int], timeout_s: float = 30) -> float:
    """Until every pid is gone (or a zombie); seconds waited."""
    start = time.monotonic()

    def alive(p: int) -> bool:
        try:
            return psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    while any(alive(p) for p in pids):
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"a killed service's processes outlived it: {[p for p in pids if alive(p)]}")
        time.sleep(POLL_S)
    return time.monotonic() - start


@dataclass
class Stream:
    """One stream's outcome: its tokens, when each arrived (time.monotonic()), its final message,
    and the error that ended it (None: it finished)."""
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    final: router_pb2.GenerateResponse | None = None
    error: grpc.RpcError | None = None
    started: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.final is not None and self.final.finished

    def recovered_after(self, t: float) -> float | None:
        """Seconds from a fault at `t` to the end of the stream's longest silence after it: when it
        was streaming again (tokens already on their way at `t` still arrive first, so the next
        token after `t` says nothing). None if no token came after `t`."""
        points = [t] + [s for s in self.stamps if s > t]
        if len(points) < 2:
            return None
        _, end = max((b - a, b) for a, b in zip(points, points[1:]))
        return end - t

    def next_token_after(self, t: float) -> float | None:
        """Seconds from `t` to the first token after it; None if the stream had ended by then
        (or never sent one after it)."""
        later = [s for s in self.stamps if s > t]
        return later[0] - t if later else None


def run_streams(router: str, ids: list[list[int]], max_tokens: int, during: Callable[[list[int]], bool] | None = None,
                raise_errors: bool = True, timeout_s: float = 300, **sampling) -> list[Stream]:
    """All streams at once (greedy unless `sampling` says otherwise, ignore_eos: every stream
    runs `max_tokens`). `during(counts)` is called from here every POLL_S until it returns True (or
    every stream ended); it sees how many tokens each stream has so far. With raise_errors a failed
    stream raises (at once, while `during` runs); else its error is kept in its Stream."""
    counts = [0] * len(ids)

    def one(i: int) -> Stream:
        s = Stream(started=time.monotonic())
        with RouterClient(router) as client:
            try:
                for msg in client.stream(token_ids=ids[i], max_tokens=max_tokens, ignore_eos=True, timeout=timeout_s,
                                         **sampling):
                    now = time.monotonic()
                    s.tokens += msg.token_ids
                    s.stamps += [now] * len(msg.token_ids)
                    counts[i] = len(s.tokens)
                    s.final = msg
            except grpc.RpcError as e:
                if raise_errors:
                    raise
                s.error = e
        return s
    with ThreadPoolExecutor(len(ids)) as pool:
        futures = [pool.submit(one, i) for i in range(len(ids))]
        deadline = time.monotonic() + timeout_s
        while during is not None and not during(counts):
            failed = [f.exception() for f in futures if f.done() and f.exception()]
            if failed:
                raise failed[0]
            if all(f.done() for f in futures):  # over before `during` was done: the caller sees it did nothing
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the streams ran out of time before `during` was done")
            time.sleep(POLL_S)
        return [f.result(timeout=timeout_s) for f in futures]


def tokens_of(streams: list[Stream]) -> list[list[int]]:
    return [s.tokens for s in streams]
