"""Certificates re-read without a restart (ember.rpc.cert_reload) and API keys on every public gRPC
call (services/router/public_auth.py), in one process: real TLS handshakes against an in-process
gRPC server and an asyncio TLS server, no cluster. The router's real ports: tests/test_public_edge.py."""
from __future__ import annotations

import asyncio
import os
import signal
import ssl
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember.cluster.certs import CertificateAuthority
from ember.config.schema import RouterSection
from ember.rpc import cert_reload, metrics
from ember.rpc.server import Server
from ember.services.router.auth import KeyTable
from ember.services.router.public_auth import ApiKeyInterceptor, refusal
from tests.cluster_fixture import free_port, wait_until_async

KEY = "sk-unit-0123456789abcdef"


def write_pair(folder: Path, ca: CertificateAuthority) -> int:
    """A fresh server certificate from `ca` in folder/tls.crt, tls.key (+ ca.crt); its serial."""
    ca.write_server(folder, "ember router", ["127.0.0.1:1"])
    return x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes()).serial_number


def served_serial(port: int, ca: CertificateAuthority) -> int | None:
    """The serial of the certificate a new TLS connection to 127.0.0.1:`port` is shown, when it
    verifies against `ca`; None when the handshake fails."""
    import socket
    ctx = ssl.create_default_context(cadata=ca.cert_pem.decode())
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            return x509.load_der_x509_certificate(s.getpeercert(binary_form=True)).serial_number
    except (ssl.SSLError, OSError):
        return None


def test_a_changed_pair_is_taken_whole_and_a_broken_one_is_not(tmp_path):
    ca = CertificateAuthority.create()
    first = write_pair(tmp_path, ca)
    source = cert_reload.CertSource(tmp_path / "tls.crt", tmp_path / "tls.key")
    assert source.generation == 1 and not source.check(), "unchanged files are not re-read"
    good_key = (tmp_path / "tls.key").read_bytes()
    other = CertificateAuthority.create().issue_server("x", [])[1]
    (tmp_path / "tls.key").write_bytes(other)  # half a rotation: the key no longer matches the certificate
    assert not source.check() and source.generation == 1
    assert x509.load_pem_x509_certificate(source.cert_pem).serial_number == first
    (tmp_path / "tls.key").write_bytes(good_key)
    second = write_pair(tmp_path, ca)
    assert source.check() and source.generation == 2
    assert x509.load_pem_x509_certificate(source.cert_pem).serial_number == second != first
    os.utime(tmp_path / "tls.crt")  # touched, same bytes: nothing new
    assert not source.check(force=True) and source.generation == 2


def test_bad_files_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="tls.crt"):
        cert_reload.CertSource(tmp_path / "tls.crt", tmp_path / "tls.key")


def test_router_tls_config_is_auto_files_or_unset_and_names_the_field():
    assert RouterSection().tls is None and RouterSection().reflection is None
    assert RouterSection(tls="auto").tls == "auto"
    assert RouterSection(tls={"cert": "a.pem", "key": "b.pem"}).tls.ca is None
    for bad, where in (("yes", "tls"), ({"cert": "a.pem"}, "key"), ({"cert": "a", "key": "b", "pass": 1}, "pass")):
        with pytest.raises(ValueError) as e:
            RouterSection(tls=bad)
        assert "tls" in str(e.value) and where in str(e.value)


def test_refusal_reasons():
    keys = KeyTable({KEY: "alpha"})
    assert refusal(keys, f"Bearer {KEY}") is None and refusal(KeyTable(), None) is None
    assert refusal(keys, None) == "missing_key" and refusal(keys, "  ") == "missing_key"
    assert refusal(keys, f"Basic {KEY}") == "malformed_header" and refusal(keys, "Bearer") == "malformed_header"
    assert refusal(keys, "Bearer sk-wrong") == "invalid_key"


def _reflection_list(channel, metadata=None):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    return stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                     metadata=metadata, timeout=10)


def test_grpc_rotation_keeps_open_connections_and_gives_new_ones_the_new_certificate(tmp_path):
    """A public-style server (server TLS from a CertSource, API keys): SIGHUP makes new handshakes
    use new files of a new CA; the channel opened before keeps working; a client trusting only the
    old CA is refused afterwards. Keys: every call but health needs one, reflection included
    (UNAUTHENTICATED without, never UNKNOWN), and an unknown method is UNIMPLEMENTED only with one."""
    old_ca, new_ca = CertificateAuthority.create(), CertificateAuthority.create()
    write_pair(tmp_path, old_ca)
    source = cert_reload.CertSource(tmp_path / "tls.crt", tmp_path / "tls.key", name="unit public TLS")
    port = free_port()
    address = f"127.0.0.1:{port}"

    async def main():
        server = Server(address, ["grpc.health.v1.Health"], public=True, public_tls=source, reflection_on=False,
                        interceptors=[ApiKeyInterceptor(KeyTable({KEY: "alpha"}))])
        await server.server.start()
        await server.set_status(health_pb2.HealthCheckResponse.SERVING)
        reloading = asyncio.create_task(cert_reload.run(every_s=0.1))
        try:
            await asyncio.to_thread(checks)
        finally:
            reloading.cancel()
            cert_reload.forget(source)
            await server.server.stop(0)

    def health(ch):
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status

    def checks():
        serving = health_pb2.HealthCheckResponse.SERVING
        before = grpc.secure_channel(address, grpc.ssl_channel_credentials(old_ca.cert_pem))
        assert health(before) == serving
        refused = [0]
        for metadata, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                               ((("authorization", "Bearer sk-wrong"),), grpc.StatusCode.UNAUTHENTICATED),
                               ((("authorization", f"Bearer {KEY}"),), None)):
            with pytest.raises(grpc.RpcError) as e:
                list(_reflection_list(before, metadata))
            assert e.value.code() == (code or grpc.StatusCode.UNIMPLEMENTED), e.value
            unknown = before.unary_unary("/ember.v1.Nothing/Here")
            with pytest.raises(grpc.RpcError) as e:
                unknown(b"", metadata=metadata, timeout=10)
            assert e.value.code() == (code or grpc.StatusCode.UNIMPLEMENTED), e.value
            refused[0] += code is not None
        new_serial = write_pair(tmp_path, new_ca)
        os.kill(os.getpid(), signal.SIGHUP)
        asyncio.run(wait_until_async(lambda: served_serial(port, new_ca) == new_serial, 10,
                                     "a new connection shown the new certificate"))
        assert served_serial(port, old_ca) is None, "the old CA no longer verifies what new connections get"
        assert health(before) == serving, "the channel opened before the rotation keeps its connection"
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(old_ca.cert_pem)) as ch:
            with pytest.raises(grpc.RpcError) as e:
                health(ch)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(new_ca.cert_pem)) as ch:
            assert health(ch) == serving
        before.close()
        # the file-change poll, no SIGHUP
        third = write_pair(tmp_path, new_ca)
        asyncio.run(wait_until_async(lambda: served_serial(port, new_ca) == third, 10, "the poll's reload"))

    failures = {r: metrics.AUTH_FAILURES.labels(r, "grpc")._value.get() for r in ("missing_key", "invalid_key")}
    asyncio.run(main())
    for reason in failures:  # one reflection and one unknown call each
        assert metrics.AUTH_FAILURES.labels(reason, "grpc")._value.get() == failures[reason] + 2


def test_an_ssl_context_switches_new_connections_to_new_files(tmp_path):
    """The asyncio/aiohttp side (the HTTP API, the kvstores' data plane): new connections get the
    new certificate, a CA removed is no longer trusted for client certificates."""
    server_ca, client_ca, other_ca = (CertificateAuthority.create() for _ in range(3))
    write_pair(tmp_path, server_ca)
    (tmp_path / "ca.crt").write_bytes(client_ca.cert_pem)
    source = cert_reload.CertSource(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt",
                                    client_auth=True, tls12_data_plane=True)
    from ember.rpc.security import Identity

    def client_ctx(ca: CertificateAuthority) -> ssl.SSLContext:
        cert, key = ca.issue("client", Identity("kvstore", "edge"), [])
        (tmp_path / "c.pem").write_bytes(cert + key)
        ctx = ssl.create_default_context(cadata=server_ca.cert_pem.decode())
        ctx.load_cert_chain(tmp_path / "c.pem")
        return ctx

    async def main():
        async def handle(reader, writer):
            writer.write(b"ok")
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=source.ssl_context())
        port = server.sockets[0].getsockname()[1]

        async def talk(ctx) -> bytes | None:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
                data = await reader.read()
                writer.close()
                return data
            except (ssl.SSLError, ConnectionError):
                return None
        assert await talk(client_ctx(client_ca)) == b"ok" and await talk(client_ctx(other_ca)) in (None, b"")
        (tmp_path / "ca.crt").write_bytes(other_ca.cert_pem)
        assert source.check()
        assert await talk(client_ctx(other_ca)) == b"ok" and await talk(client_ctx(client_ca)) in (None, b"")
        server.close()
    asyncio.run(main())
