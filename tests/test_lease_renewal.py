"""Leases on long transfers, with real processes: two kvstores (`ember serve kvstore`) joined by
the emulated WAN relay at 0.01 Gbps, and a lease TTL (kvstore.max_lease_s) of 2 s. A pull
that takes ~2.5x the TTL completes with exact blocks; its holder (the engine's KVConnector)
renews the lease until it releases it; a holder SIGKILLed mid-pull or mid-hold strands no
lease (torch-free).

Run as `python -m tests.test_lease_renewal DST SRC FIRST COUNT`, this file is that holder: it
loads the blocks through a KVConnector, prints `leased ID` and holds them until killed."""
from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml

from ember.cluster.launcher import wait_serving
from ember.cluster.ports import free_port
from ember.kv import bulk, wire
from ember.kv.block_hash import HASH_BYTES, KVLayout
from ember.rpc.kv_connector import KVConnector
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.cluster_fixture import AT_ONCE_S, wait_until

TTL_S = 2.0  # renewed every TTL/3: a holder stalled up to ~2/3 of it (a loaded host) keeps its lease
LINK_GBPS = 0.01                    # 1.25 MB/s
LAYOUT = KVLayout("lease-test", "bfloat16", block_size=16, num_layers=8, num_kv_heads=2, head_dim=64)  # 64 KiB
TEMPLATE = wire.layout_header(LAYOUT, b"\x33" * 16)
SLOW_PULL_BLOCKS = 96               # ~6.3 MB: ~5 s across the link, 2.5x the TTL

pytestmark = pytest.mark.timeout(90)


def block(i: int) -> tuple[bytes, bytes]:
    """(hash, wire frame) of test block i."""
    h = (7000 + i).to_bytes(16, "little")
    return h, wire.encode_frame(TEMPLATE, h, random.Random(i).randbytes(LAYOUT.block_bytes))


def blocks(first: int, count: int) -> list[tuple[bytes, bytes]]:
    return [block(i) for i in range(first, first + count)]


class Sites:
    """central's kvstore (the source) and edge's, which reaches central through the relay."""

    def __init__(self, run_dir: Path):
        def addr() -> str:
            return f"127.0.0.1:{free_port()}"
        self.run_dir = run_dir
        self.central, self.central_data, self.edge, self.edge_data = addr(), addr(), addr(), addr()
        relayed = {self.central: addr(), self.central_data: addr()}
        self.data_relay = relayed[self.central_data]
        (run_dir / "cluster.yaml").write_text(yaml.safe_dump({
            "router": {"listen": addr()},  # no router runs: the stores' directory publishing just retries
            "sites": [{"name": "central", "kvstore": self.central, "kvstore_data": self.central_data},
                      {"name": "edge", "kvstore": self.edge, "kvstore_data": self.edge_data}],
            "kvstore": {"capacity_mb": 32, "codec": "raw", "max_lease_s": TTL_S},
            "security": {"tls": "plaintext"}}))  # leases, not certificates, are under test here
        (run_dir / "links.json").write_text(json.dumps(
            [{"listen": relay, "target": true, "rtt_ms": 2, "gbps": LINK_GBPS} for true, relay in relayed.items()]))
        self.procs: list[subprocess.Popen] = []
        self.faults = run_dir / "faults.json"
        self.relay = self._start("relay", [sys.executable, "-m", "ember.cluster.wan", "--spec",
                                           str(run_dir / "links.json"), "--faults", str(self.faults)])
        routes = [arg for true, relay in relayed.items() for arg in ("--route", f"{true}={relay}")]
        for site, address in (("central", self.central), ("edge", self.edge)):
            proc = self._start(f"kvstore-{site}", [sys.executable, "-m", "ember.services.kvstore", "--config",
                                                   str(run_dir / "cluster.yaml"), "--site", site] + routes)
            wait_serving(address, time.monotonic() + 60, proc, run_dir / f"kvstore-{site}.log")
        for relay in relayed.values():
            wait_until(lambda relay=relay: accepts(relay), 30, f"relay {relay} listening")
        self._channel = grpc.insecure_channel(self.edge)
        self._edge_stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=open(self.run_dir / f"{name}.log", "wb"), stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def edge_stats(self) -> kvstore_pb2.StatsResponse:
        return self._edge_stub.Stats(kvstore_pb2.StatsRequest(), timeout=10)

    def set_faults(self, faults: dict[str, str]) -> None:
        """{relay listen address: mode} (ember.cluster.wan's faults), once the relay applies them."""
        text = json.dumps(faults)
        self.faults.with_suffix(".tmp").write_text(text)
        self.faults.with_suffix(".tmp").replace(self.faults)
        applied = Path(str(self.faults) + ".applied")
        wait_until(lambda: applied.exists() and applied.read_text() == text, 30, f"the relay applying {text}")

    def holder(self, first: int, count: int) -> tuple[subprocess.Popen, Path]:
        """A process leasing blocks first.. at edge (pulled from central) through a KVConnector."""
        log = self.run_dir / f"holder-{first}.log"
        proc = self._start(log.stem, [sys.executable, "-m", "tests.test_lease_renewal", self.edge, self.central,
                                      str(first), str(count)])
        return proc, log

    def close(self) -> None:
        self._channel.close()
        for proc in reversed(self.procs):
            proc.kill()
            proc.wait(timeout=10)


def accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """Private: two kvstores alone, a 2 s lease TTL and a 10 Mbit/s link between them."""
    s = Sites(tmp_path_factory.mktemp("lease-renewal"))
    try:
        yield s
    finally:
        s.close()


def put_at_central(sites: Sites, frames: list[tuple[bytes, bytes]]) -> None:
    central = KVConnector(sites.central, TEMPLATE)
    try:
        assert central.store(frames).result(timeout=30) == (len(frames), 0)
    finally:
        central.close()


def test_a_pull_slower_than_the_lease_ttl_completes_and_its_holder_renews_until_release(sites):
    frames = blocks(0, SLOW_PULL_BLOCKS)
    put_at_central(sites, frames)
    before = sites.edge_stats()
    assert before.max_lease_s == TTL_S and before.leases == 0
    connector = KVConnector(sites.edge, TEMPLATE)
    try:
        start = time.monotonic()
        loaded = connector.load([h for h, _ in frames], sites.central, timeout=60).result(timeout=60)
        took = time.monotonic() - start
        assert loaded.blocks_pulled == SLOW_PULL_BLOCKS and took > 2 * TTL_S, f"the pull took {took:.2f} s"
        for h, f in frames:  # exactly the bytes central holds (read from edge's arena)
            assert bytes(loaded.payloads[h]) == f[wire.HEADER_BYTES:]
        # a slow import: the holder keeps the lease for well over its TTL by renewing it
        # (the store counts a renewal when it grants it, the connector when the answer is back: wait for both)
        held = wait_until(lambda: connector.leases_renewed >= 4
                          and (s := sites.edge_stats()).leases_renewed >= before.leases_renewed + 4 and s,
                          4 * TTL_S + AT_ONCE_S, "four renewals")
        assert held.leases == 1 and held.pinned_blocks == SLOW_PULL_BLOCKS
        connector.release(loaded.lease_id, check=True).result(timeout=10)  # not expired: no DATA_LOSS
    finally:
        connector.close()
    after = sites.edge_stats()
    assert after.leases == 0 and after.pinned_blocks == 0 and after.leases_expired == before.leases_expired
    assert frames_at(sites.edge, [h for h, _ in frames]) == frames, "edge stores byte-identical frames"


def frames_at(address: str, hashes: list[bytes]) -> list[tuple[bytes, bytes]]:
    """(hash, frame) of each block, read back from the store at `address` (bulk Get)."""
    with grpc.insecure_channel(address) as ch:
        return [(m[:HASH_BYTES], m[HASH_BYTES:]) for m in ch.unary_stream(bulk.GET)(bulk.encode_hashes(hashes),
                                                                                    timeout=30)]


def test_a_holder_killed_mid_pull_leaves_no_lease(sites):
    frames = blocks(1000, SLOW_PULL_BLOCKS)
    put_at_central(sites, frames)
    before = sites.edge_stats()
    # the data link at 1/100 of its rate (~5 s a block): however fast this host, the pull is still
    # under way when its holder is killed
    sites.set_faults({sites.data_relay: "slow"})
    try:
        proc, log = sites.holder(1000, SLOW_PULL_BLOCKS)
        wait_until(lambda: (s := sites.edge_stats()).leases == 1 and s.blocks > before.blocks, 60,
                   "the holder's pull under way")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert "leased" not in log.read_text(), "killed before its pull answered"
        freed = wait_until(lambda: (s := sites.edge_stats()).leases == 0 and s.pinned_blocks == 0 and s,
                           TTL_S + AT_ONCE_S, "the lease freed")
        assert freed.blocks < before.blocks + SLOW_PULL_BLOCKS, "the pull was cut short"
    finally:
        sites.set_faults({})


def test_a_holder_killed_while_holding_frees_its_lease_within_the_ttl(sites):
    frames = blocks(2000, 8)
    put_at_central(sites, frames)
    before = sites.edge_stats()
    proc, log = sites.holder(2000, 8)
    wait_until(lambda: "leased" in log.read_text(), 30, "the holder's lease")
    # alive, it keeps the lease past its TTL
    wait_until(lambda: sites.edge_stats().leases_renewed >= before.leases_renewed + 4, 10, "four renewals")
    assert sites.edge_stats().leases == 1
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    killed = time.monotonic()
    freed = wait_until(lambda: (s := sites.edge_stats()).leases == 0 and s, TTL_S + AT_ONCE_S, "the lease expired")
    freed_s = time.monotonic() - killed
    print(f"lease freed {freed_s:.2f} s after its holder's kill (TTL {TTL_S} s)")
    assert freed_s <= TTL_S + AT_ONCE_S, freed_s
    assert freed.leases_expired == before.leases_expired + 1, "freed by its TTL: nobody released it"
    assert freed.pinned_blocks == 0


def _hold(dst: str, src: str, first: int, count: int) -> None:
    connector = KVConnector(dst, TEMPLATE)
    loaded = connector.load([h for h, _ in blocks(first, count)], src, timeout=60).result(timeout=60)
    print(f"leased {loaded.lease_id}", flush=True)
    threading.Event().wait()  # hold (renewing) until killed


if __name__ == "__main__":
    _hold(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
