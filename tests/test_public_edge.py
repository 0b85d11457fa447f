"""The router's public edge on real processes (issue 34): reflection, TLS on the public gRPC and HTTP
ports, and certificates rotated without a restart.

On the session's default cluster (the shipped configs/local.yaml, no API keys) and, for TLS, a
second router in front of its workers with `router.tls: {cert, key, ca}` (a certificate from the
cluster's CA). grpcurl is not installable here (not in Debian bookworm, no Go module proxy): the
`list` client is grpcio-reflection's ProtoReflectionDescriptorDatabase, which speaks the same
server-reflection protocol grpcurl does and builds the descriptors from the server's answers
alone. With API keys: tests/test_secure_router.py. In one process: tests/test_cert_reload.py.
"""
from __future__ import annotations

import shutil
import signal
import socket
import ssl
import threading
import time
from pathlib import Path

import grpc
import openai
import pytest
from cryptography import x509
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from ember.client import RouterClient, router_channel
from ember.cluster.certs import CertificateAuthority
from ember.rpc.security import Identity
from tests.cluster_fixture import AT_ONCE_S, wait_until

pytestmark = pytest.mark.slow
TIMEOUT_S = 120
CHAT = [{"role": "user", "content": "Name three colours."}]
STREAM_TOKENS = 200


def reflected_router(channel: grpc.Channel) -> tuple[list[str], list[str]]:
    """What grpcurl `list` and `describe ember.v1.Router` show: the services, and the Router's
    methods from descriptors built out of the server's reflection answers (no proto file here)."""
    db = ProtoReflectionDescriptorDatabase(channel)
    services = list(db.get_services())
    router = descriptor_pool.DescriptorPool(db).FindServiceByName("ember.v1.Router")
    return services, sorted(router.methods_by_name)


def test_reflection_lists_the_router_without_proto_files(default_cluster):
    with grpc.insecure_channel(default_cluster.cluster.router) as ch:
        services, methods = reflected_router(ch)
    assert {"ember.v1.Router", "grpc.health.v1.Health"} <= set(services)
    assert {"Generate", "ListModels"} <= set(methods)


# -- TLS at the public ports ----------------------------------------------------------------------
def serial_at(address: str, ca: Path, alpn: list[str] | None = None) -> tuple[int, str | None] | None:
    """(serial of the certificate a new TLS connection to `address` is shown, the ALPN protocol
    chosen) when it verifies against the CA file `ca`; None when the handshake fails."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(ca))
    if alpn:
        ctx.set_alpn_protocols(alpn)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as s:
            cert = x509.load_der_x509_certificate(s.getpeercert(binary_form=True))
            return cert.serial_number, s.selected_alpn_protocol()
    except (ssl.SSLError, OSError):
        return None


class TLSRouter:
    def __init__(self, settings: dict, proc, folder: Path):
        self.settings, self.proc, self.folder = settings, proc, folder

    @property
    def ca(self) -> Path:
        return self.folder / "public" / "ca.crt"

    def rotate(self, ca: CertificateAuthority) -> int:
        """New files in place (a certificate from `ca`, and `ca` as the CA file); the new serial."""
        ca.write_server(self.folder / "public", "ember router", [self.settings["listen"], self.settings["http"]])
        return x509.load_pem_x509_certificate((self.folder / "public" / "tls.crt").read_bytes()).serial_number

    def openai(self, ca: Path | None) -> openai.OpenAI:
        http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(ca)) if ca else True)
        return openai.OpenAI(base_url=f"https://{self.settings['http']}/v1", api_key="unused", max_retries=0,
                             timeout=TIMEOUT_S, http_client=http)


@pytest.fixture(scope="module")
def tls_router(default_cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls-router")
    ca = CertificateAuthority.load(default_cluster.run_dir / "certs")
    ca.write_server(folder / "public", "ember router", ["127.0.0.1:1"])
    tls = {"cert": "public/tls.crt", "key": "public/tls.key", "ca": "public/ca.crt"}
    with default_cluster.cluster.second_router(folder, tls=tls) as (settings, proc):
        yield TLSRouter(settings, proc, folder)


def test_grpc_over_tls_streams_and_reflects(tls_router):
    with RouterClient(tls_router.settings["listen"], ca=tls_router.ca) as c:
        out = c.complete(messages=CHAT, max_tokens=6, timeout=TIMEOUT_S)
    assert out.final.finished and out.token_ids and out.text
    with router_channel(tls_router.settings["listen"], tls_router.ca) as ch:
        services, methods = reflected_router(ch)  # grpcurl over TLS
    assert "ember.v1.Router" in services and "Generate" in methods
    assert serial_at(tls_router.settings["listen"], tls_router.ca, ["h2"])[1] == "h2"


def test_the_openai_client_streams_a_chat_over_https(tls_router):
    chunks = list(tls_router.openai(tls_router.ca).chat.completions.create(
        model="", messages=CHAT, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # HTTP/1.1 by ALPN: aiohttp's server speaks no HTTP/2, and does not pretend to
    assert serial_at(tls_router.settings["http"], tls_router.ca, ["h2", "http/1.1"])[1] == "http/1.1"


def test_plaintext_and_untrusting_clients_are_refused(tls_router, tmp_path):
    other = tmp_path / "other-ca.crt"
    other.write_bytes(CertificateAuthority.create("another CA").cert_pem)
    for ca in (None, other):  # plaintext gRPC; TLS trusting another CA
        with router_channel(tls_router.settings["listen"], ca) as ch:
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    plain = openai.OpenAI(base_url=f"http://{tls_router.settings['http']}/v1", api_key="unused", max_retries=0,
                          timeout=TIMEOUT_S)
    for api in (plain, tls_router.openai(other), tls_router.openai(None)):  # http://; another CA; the system's CAs
        with pytest.raises(openai.APIConnectionError):
            api.chat.completions.create(model="", messages=CHAT, max_tokens=2)


def test_an_internal_certificate_is_reread_when_its_files_change(default_cluster, tls_router, tmp_path):
    """The internal mTLS ports re-read their service's folder: the router's folder gets a new
    certificate (same identity, same CA) and a new mTLS connection to the second router's internal
    port is shown it, while the cluster keeps serving."""
    folder = default_cluster.run_dir / "certs" / "router"
    ca = CertificateAuthority.load(default_cluster.run_dir / "certs")
    cert, key = ca.issue("router", Identity("router"), [tls_router.settings["listen"]])
    (tmp_path / "tls.key").write_bytes(key)
    (tmp_path / "tls.crt").write_bytes(cert)
    for name in ("tls.key", "tls.crt"):  # each file replaced whole (a rename), as a Secret update does
        shutil.copy(tmp_path / name, folder / f".{name}.new")
        (folder / f".{name}.new").replace(folder / name)
    serial = x509.load_pem_x509_certificate(cert).serial_number
    operator = default_cluster.run_dir / "certs" / "operator"

    def shown() -> int | None:
        host, port = tls_router.settings["internal"].rsplit(":", 1)
        ctx = ssl.create_default_context(cafile=str(operator / "ca.crt"))
        ctx.load_cert_chain(operator / "tls.crt", operator / "tls.key")
        with socket.create_connection((host, int(port)), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as s:
            return x509.load_der_x509_certificate(s.getpeercert(binary_form=True)).serial_number
    wait_until(lambda: shown() == serial, AT_ONCE_S, "the internal port showing the new certificate")
    with RouterClient(default_cluster.cluster.router) as c:
        assert c.complete("The sea is", max_tokens=3, timeout=TIMEOUT_S).token_ids


def test_rotation_on_sighup_keeps_a_running_stream(tls_router):
    """New certificates of a new CA, SIGHUP: a stream running across the rotation finishes, new
    connections are shown the new certificate (its serial), a client trusting only the old CA is
    refused afterwards."""
    old_ca = tls_router.folder / "old-ca.crt"
    shutil.copy(tls_router.ca, old_ca)
    arrivals: list[float] = []
    done: dict = {}

    def stream():
        try:
            with RouterClient(tls_router.settings["listen"], ca=old_ca) as c:
                for m in c.stream(messages=CHAT, max_tokens=STREAM_TOKENS, ignore_eos=True, speculative=False,
                                  timeout=TIMEOUT_S):  # (one token a step: it runs for seconds)
                    arrivals.extend(time.monotonic() for _ in m.token_ids)
                    if m.finished:
                        done["final"] = m
        except grpc.RpcError as e:
            done["error"] = e
    thread = threading.Thread(target=stream)
    thread.start()
    wait_until(lambda: len(arrivals) >= 4 or done, TIMEOUT_S, "the stream's first tokens")
    new_serial = tls_router.rotate(CertificateAuthority.create("rotated CA"))
    tls_router.proc.send_signal(signal.SIGHUP)
    rotated_at = time.monotonic()
    wait_until(lambda: (serial_at(tls_router.settings["listen"], tls_router.ca) or (None,))[0] == new_serial,
               AT_ONCE_S, "new gRPC connections shown the new certificate")
    assert serial_at(tls_router.settings["http"], tls_router.ca)[0] == new_serial
    assert serial_at(tls_router.settings["listen"], old_ca) is None, "the old CA no longer verifies"
    with router_channel(tls_router.settings["listen"], old_ca) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(openai.APIConnectionError):
        tls_router.openai(old_ca).models.list()
    thread.join(TIMEOUT_S)
    assert "error" not in done, done.get("error")
    assert done["final"].finished and done["final"].usage.completion_tokens == STREAM_TOKENS == len(arrivals)
    assert arrivals[-1] > rotated_at, "the stream was still running when the certificates changed"
    assert tls_router.proc.poll() is None, "SIGHUP did not stop the router"
    assert [m.id for m in tls_router.openai(tls_router.ca).models.list().data], "new clients trust the new CA"


def test_a_file_change_alone_reloads(tls_router):
    """No signal: the router polls its certificate files (~1 s) and new connections get the new one."""
    new_serial = tls_router.rotate(CertificateAuthority.create("polled CA"))
    wait_until(lambda: (serial_at(tls_router.settings["http"], tls_router.ca) or (None,))[0] == new_serial,
               AT_ONCE_S, "new HTTPS connections shown the new certificate")
    with RouterClient(tls_router.settings["listen"], ca=tls_router.ca) as c:
        assert c.complete("Hello", max_tokens=2, timeout=TIMEOUT_S).token_ids
