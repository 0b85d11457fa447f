"""The KV and engine error paths of issue 47 (torch-free, no cluster): a KV producer without its MAC
key fails closed when TLS is on (unless the config opts out), the TCP data plane logs and counts
every connection it drops, and an engine core's start-up traceback reaches its service's log
while the error users see stays one line."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from ember.cluster.certs import write_cluster_certs
from ember.config.load import load_config
from ember.config.schema import ClusterConfig
from ember.kv import transfer
from ember.rpc import metrics, metrics_http, security
from ember.serving.engine_client import SubprocessEngineClient

LOCAL = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """What `ember up` makes with `tls: auto` for the shipped default config."""
    return write_cluster_certs(load_config(LOCAL), tmp_path_factory.mktemp("certs"))


@pytest.fixture
def no_mac(certs, tmp_path) -> Path:
    """prefill-central's folder without its kv-mac.key (a `tls: files` folder made by hand)."""
    folder = tmp_path / "prefill-central"
    folder.mkdir()
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (folder / name).write_bytes((certs / "prefill-central" / name).read_bytes())
    return folder


@pytest.fixture
def installed():
    """Restores this process's installed credentials and /metrics policy after the test."""
    before = security.current(), metrics_http._access
    yield
    security.install(before[0])
    metrics_http.install(before[1])


def config(**security_section) -> ClusterConfig:
    data = load_config(LOCAL).model_dump(mode="json", exclude_unset=True)
    return ClusterConfig.model_validate({**data, "security": security_section})


# -- 1. a missing kv-mac.key fails closed ----------------------------------------------------------

def test_the_default_up_makes_a_mac_key_for_every_kv_producer_and_they_start(certs, monkeypatch, installed):
    from ember.services.common import install_credentials
    monkeypatch.setenv("EMBER_TLS_DIR", str(certs / "{name}"))
    cfg = load_config(LOCAL)
    assert cfg.security.tls == "auto" and cfg.security.kv_mac == "required"
    for role, site in (("prefill", "central"), ("decode", "edge"), ("kvstore", "central")):
        install_credentials(cfg, role, site)
        creds = security.current()
        assert (creds.mac_key is not None) == (role in security.KV_PRODUCERS) and not creds.unsigned_kv, role


def test_a_kv_producer_without_its_mac_key_is_a_start_up_error_naming_the_file_and_the_opt_out(
        no_mac, monkeypatch, installed):
    from ember.services.common import install_credentials
    monkeypatch.setenv("EMBER_TLS_DIR", str(no_mac.parent / "{name}"))
    for tls in ("auto", "files"):
        cfg = config(tls=tls, tls_dir=str(no_mac.parent / "{name}"))
        with pytest.raises(FileNotFoundError) as e:
            install_credentials(cfg, "prefill", "central")
        assert str(no_mac / "kv-mac.key") in str(e.value) and "kv_mac: off" in str(e.value)
        assert "\n" not in str(e.value)  # (one line: `ember serve` prints it as its error)


def test_the_config_opt_out_runs_without_the_key_with_a_warning(no_mac, monkeypatch, installed, caplog):
    from ember.services.common import install_credentials
    monkeypatch.setenv("EMBER_TLS_DIR", str(no_mac.parent / "{name}"))
    with caplog.at_level(logging.WARNING, logger="ember.security"):
        install_credentials(config(tls="auto", kv_mac="off"), "prefill", "central")
    assert security.current().unsigned_kv and security.current().mac_key is None
    assert "kv-mac.key" in caplog.text and "unchecked" in caplog.text
    with pytest.raises(ValueError, match="kv_mac"):
        config(kv_mac="maybe")


def spawn_core(*argv: str) -> tuple[subprocess.Popen, Connection]:
    """An engine core's process as `SubprocessEngineClient.spawn` starts it, with this command line."""
    mine, theirs = socket.socketpair()
    process = subprocess.Popen([sys.executable, "-m", "ember.serving.core_process", "--fd", str(theirs.fileno()),
                                *argv], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
    theirs.close()
    return process, Connection(mine.detach())


def test_the_engine_core_fails_closed_too_unless_its_service_opted_out(no_mac, certs, monkeypatch, installed):
    """The core reads its folder again: it refuses before loading anything, and the service passes
    the opt-out down (--unsigned-kv) only when the config said so."""
    with pytest.raises(RuntimeError, match="kv-mac.key: missing"):
        asyncio.run(SubprocessEngineClient.ready(spawn_core("--config", "{}", "--tls-dir", str(no_mac))))
    monkeypatch.delenv("EMBER_ENGINE_TEMPLATE", raising=False)
    spawned = []
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kw: spawned.append(argv))
    for opted_out, creds in ((False, security.Credentials.load(certs / "prefill-central")),
                             (True, security.require_kv_mac(security.Credentials.load(no_mac), "off"))):
        security.install(creds)
        SubprocessEngineClient.spawn({"model": "x"})[1].close()
        assert ("--unsigned-kv" in spawned[-1]) == opted_out and "--tls-dir" in spawned[-1]


# -- 2. the data plane logs and counts what it drops -----------------------------------------------

def refusals(reason: str) -> float:
    return REGISTRY.get_sample_value("ember:kv_frames_refused_total", {"reason": reason}) or 0.0


async def _drop(payload: bytes, caplog, server_tls=None, client_tls=None) -> list[str]:
    """Send `payload` to a data-plane server and close; the reasons it reported, once it did."""
    reasons: list[str] = []
    done = asyncio.Event()

    def refused(reason: str) -> None:
        metrics.KV_FRAMES_REFUSED.labels(reason).inc()  # (as services/kvstore/__main__.py counts them)
        reasons.append(reason)
        done.set()

    @contextlib.contextmanager
    def pinned(hashes):
        yield [None] * len(hashes)
    server = await transfer.serve("127.0.0.1", 0, pinned, refused=refused, tls=server_tls,
                                  authorize=lambda peercert: security.peer_has_role(peercert, {"kvstore"}))
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_tls)
        host, local_port = writer.get_extra_info("sockname")[:2]
        local = f"{host}:{local_port}"
        with contextlib.suppress(ConnectionError):  # (a refused TLS peer may see its connection reset)
            writer.write(payload)
            await writer.drain()
            writer.close()
        if payload:
            await asyncio.wait_for(done.wait(), 10)
            assert local in caplog.text, "the log names the peer"
        else:  # a port probe: give the server the time to (wrongly) report it
            await asyncio.sleep(0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)
    finally:
        server.close()
        await server.wait_closed()
    return reasons


@pytest.mark.parametrize("reason, payload", [
    ("bad_magic", b"HTTP" + bytes(8)),
    ("unknown_codec", transfer._REQUEST.pack(transfer.MAGIC, 250, 1) + bytes(16)),
    ("truncated", transfer._REQUEST.pack(transfer.MAGIC, 0, 4) + bytes(20)),
    ("truncated", b"EKV"),
])
def test_a_refused_data_plane_connection_is_logged_with_its_peer_and_counted(reason, payload, caplog):
    before = refusals(reason)
    with caplog.at_level(logging.WARNING, logger="ember.kv"):
        assert asyncio.run(_drop(payload, caplog)) == [reason]
    assert "data plane: dropped 127.0.0.1:" in caplog.text and reason in caplog.text
    assert refusals(reason) == before + 1


def test_a_peer_the_data_plane_does_not_serve_is_logged_with_its_identity_and_counted(certs, caplog):
    server = security.Credentials.load(certs / "kvstore-central").server_context()
    operator = security.Credentials.load(certs / "operator").client_context()
    before = refusals("unauthorized")
    with caplog.at_level(logging.WARNING, logger="ember.kv"):
        assert asyncio.run(_drop(transfer._REQUEST.pack(transfer.MAGIC, 0, 0), caplog, server, operator)) == [
            "unauthorized"]
    assert "spiffe://ember/operator" in caplog.text and refusals("unauthorized") == before + 1


def test_a_connection_closed_before_its_first_byte_is_no_refusal(caplog):
    with caplog.at_level(logging.WARNING, logger="ember.kv"):
        assert asyncio.run(_drop(b"", caplog)) == []
    assert "dropped" not in caplog.text


# -- 3. an engine core's start-up traceback reaches its service's log --------------------------------

def test_a_core_start_up_failure_logs_its_traceback_and_tells_one_line(caplog):
    with caplog.at_level(logging.ERROR, logger="ember.engine"):
        with pytest.raises(RuntimeError) as e:
            asyncio.run(SubprocessEngineClient.ready(spawn_core("--config", "{not json")))
    message = str(e.value)
    assert message.startswith("the engine core failed to start: JSONDecodeError: ") and "\n" not in message
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "ember.engine")
    assert "Traceback (most recent call last)" in logged and "core_process.py" in logged
    assert "json.decoder.JSONDecodeError" in logged
