"""mTLS on every internal hop of a real cluster (the default `security.tls: auto`), and
authorization by the role a certificate names.

One cluster for the module. Every internal gRPC port (prefill, decode, both kvstores, the
router's internal port) and both kvstores' TCP data planes refuse plaintext, a client without a
certificate and one whose certificate comes from another CA; the cluster's own certificates
work, and only for the roles allowed (ember.rpc.authz).
"""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember.client import RouterClient
from ember.cluster.certs import CertificateAuthority
from ember.cluster.launcher import credentials
from ember.engine.sampling_params import SamplingParams
from ember.kv import bulk, transfer, wire
from ember.kv.chunks import split
from ember.rpc import security
from ember.rpc.server import CHANNEL_OPTIONS
from ember.v1 import directory_pb2, directory_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow
INTERNAL = ("prefill", "decode", "kv_central", "kv_edge", "router_internal")
DATA_PLANES = ("kv_central_data", "kv_edge_data")


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster  # (conftest: one cluster for the modules that only send it requests)


@pytest.fixture(scope="module")
def rogue(tmp_path_factory) -> security.Credentials:
    """A certificate naming a real role and site, signed by another CA."""
    out = tmp_path_factory.mktemp("rogue-ca")
    folder = CertificateAuthority.create("rogue CA").write_service(
        out, "prefill-central", security.Identity("prefill", "central"), ["127.0.0.1:1"])
    return security.Credentials.load(folder)


def certs(cluster, name: str) -> security.Credentials:
    return credentials(cluster["run_dir"], name)


def health(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


@pytest.mark.parametrize("port", INTERNAL)
def test_every_internal_port_refuses_plaintext_no_certificate_and_another_ca(cluster, rogue, port):
    address = cluster[port]
    with grpc.insecure_channel(address) as ch:
        assert health(ch) == grpc.StatusCode.UNAVAILABLE, "plaintext"
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=certs(cluster, "operator").ca_pem)
    with grpc.secure_channel(address, no_client_cert) as ch:
        assert health(ch) == grpc.StatusCode.UNAVAILABLE, "TLS without a client certificate"
    with security.dial(address, rogue) as ch:
        assert health(ch) == grpc.StatusCode.UNAVAILABLE, "a client certificate from another CA"
    with security.dial(address, certs(cluster, "operator")) as ch:
        assert health(ch) == grpc.StatusCode.OK, "the cluster's own certificate"


def test_the_router_public_port_stays_plaintext_and_its_tokens_equal_the_local_engine(cluster, engine):
    """The public API is plaintext (API keys guard it); behind it every hop is mTLS and the exact
    fp32 path still gives the local engine's greedy tokens (the plaintext cluster's, see
    tests/test_cluster.py), with KV moved across sites."""
    ids = engine.tokenizer.encode(PROMPTS[-1])
    [want] = engine.generate([ids], SamplingParams(max_tokens=12))
    with RouterClient(cluster["router"]) as client:
        first = client.complete(token_ids=ids, max_tokens=12, timeout=120)
        again = client.complete(token_ids=ids, max_tokens=12, timeout=120)
    assert first.token_ids == want.token_ids == again.token_ids
    assert again.final.usage.cached_tokens >= len(ids) // 16 * 16 - 16, "the second turn reused KV across mTLS hops"


def put_chunks(frames):
    return (kvstore_pb2.BlockChunk(block_hash=h, block_bytes=n, offset=o, data=d) for h, n, o, d in split(frames))


def some_frames(engine, count: int = 2) -> list[tuple[bytes, bytes]]:
    hashes = [os.urandom(16) for _ in range(count)]
    return [(h, wire.encode_frame(engine.frame_template, h, os.urandom(engine.layout.block_bytes))) for h in hashes]


@pytest.mark.parametrize("caller", ["router", "kvstore-edge", "operator"])
def test_only_kv_producers_may_put_blocks(cluster, engine, caller):
    """A router (or a kvstore, or the operator) certificate calling Put or KVStoreBulk/Put is
    PERMISSION_DENIED and nothing is stored; prefill's certificate stores the same frames."""
    frames = some_frames(engine)
    with security.dial(cluster["kv_central"], certs(cluster, caller), CHANNEL_OPTIONS) as ch:
        with pytest.raises(grpc.RpcError) as e:
            kvstore_pb2_grpc.KVStoreStub(ch).Put(put_chunks(frames), timeout=30)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and caller.split("-")[0] in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            ch.stream_unary(bulk.PUT)(iter([h + f for h, f in frames]), timeout=30)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        present = kvstore_pb2_grpc.KVStoreStub(ch).Lookup(
            kvstore_pb2.LookupRequest(block_hashes=[h for h, _ in frames]), timeout=10).present
        assert list(present) == [False, False]
    with security.dial(cluster["kv_central"], certs(cluster, "prefill-central"), CHANNEL_OPTIONS) as ch:
        assert kvstore_pb2_grpc.KVStoreStub(ch).Put(put_chunks(frames), timeout=30).blocks_stored == 2


def test_engines_take_work_only_from_the_router_and_the_directory_only_from_kvstores(cluster):
    from ember.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
    with security.dial(cluster["prefill"], certs(cluster, "decode-edge")) as ch:
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(request_id="x", token_ids=[1, 2]),
                                                     timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with security.dial(cluster["decode"], certs(cluster, "kvstore-edge")) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(decode_pb2_grpc.DecodeStub(ch).Decode(decode_pb2.DecodeRequest(request_id="x", prompt_token_ids=[1]),
                                                       timeout=10))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    publish = directory_pb2.PublishRequest(site="edge", added=[os.urandom(16)])
    with security.dial(cluster["router_internal"], certs(cluster, "prefill-central")) as ch:
        with pytest.raises(grpc.RpcError) as e:
            directory_pb2_grpc.BlockDirectoryStub(ch).Publish(publish, timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with grpc.insecure_channel(cluster["router"]) as ch:  # the directory on the public port: nobody's certificate
        with pytest.raises(grpc.RpcError) as e:
            directory_pb2_grpc.BlockDirectoryStub(ch).Publish(publish, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with security.dial(cluster["router_internal"], certs(cluster, "kvstore-edge")) as ch:
        directory_pb2_grpc.BlockDirectoryStub(ch).Publish(directory_pb2.PublishRequest(site="edge"), timeout=10)


def fetch(address: str, hashes: list[bytes], tls: ssl.SSLContext | None) -> list[bytes]:
    async def go():
        return [bytes(frame) async for _, _, frame in transfer.fetch(address, hashes, timeout=20, tls=tls)]
    return asyncio.run(go())


@pytest.mark.parametrize("plane", DATA_PLANES)
def test_the_data_plane_serves_blocks_only_to_kvstores_over_mtls(cluster, engine, rogue, plane):
    store = plane.removesuffix("_data")
    frames = some_frames(engine, 1)
    with security.dial(cluster[store], certs(cluster, "prefill-central"), CHANNEL_OPTIONS) as ch:
        assert kvstore_pb2_grpc.KVStoreStub(ch).Put(put_chunks(frames), timeout=30).blocks_stored == 1
    hashes = [frames[0][0]]
    with pytest.raises((ConnectionError, OSError)):
        fetch(cluster[plane], hashes, None)  # plaintext
    no_cert = ssl.create_default_context(cadata=certs(cluster, "operator").ca_pem.decode())
    for refused in (no_cert, rogue.client_context(), certs(cluster, "router").client_context()):
        with pytest.raises((ConnectionError, OSError, asyncio.IncompleteReadError)):
            fetch(cluster[plane], hashes, refused)
    peer = "kvstore-edge" if store == "kv_central" else "kvstore-central"
    [got] = fetch(cluster[plane], hashes, certs(cluster, peer).client_context())
    assert wire.parse_header(got).block_hash == hashes[0]


def test_certificates_name_roles_sites_and_the_kv_secret_lives_only_with_producers(cluster):
    run_dir: Path = cluster["run_dir"]
    names = {p.name for p in (run_dir / "certs").iterdir() if p.is_dir()}
    assert names == {"router", "prefill-central", "decode-edge", "kvstore-central", "kvstore-edge", "operator"}
    for name in names:
        creds = certs(cluster, name)
        role, _, site = name.partition("-")
        assert creds.identity == security.Identity(role, site or None)
        assert (creds.mac_key is not None) == (role in ("prefill", "decode")), name
        assert (run_dir / "certs" / name / "tls.key").stat().st_mode & 0o077 == 0, "private keys are owner-only"
    assert certs(cluster, "prefill-central").mac_key == certs(cluster, "decode-edge").mac_key
    assert not (run_dir / "certs" / "router" / "ca.key").exists(), "the CA key stays at the top of the folder"


def test_a_plaintext_tcp_peer_on_the_data_plane_gets_nothing(cluster):
    """Bytes of the plaintext protocol to a TLS data plane: the server answers no frame."""
    host, port = cluster["kv_edge_data"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(transfer._REQUEST.pack(transfer.MAGIC, 0, 1) + b"\x01" * 16)
        s.settimeout(5)
        try:
            data = s.recv(4096)
        except (ConnectionError, TimeoutError):
            data = b""
    assert transfer.MAGIC not in data and not data.startswith(b"\x01" * 16)


def list_services(channel: grpc.Channel) -> list[str] | grpc.StatusCode:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    try:
        [answer] = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return sorted(s.name for s in answer.list_services_response.service)


def test_reflection_is_on_at_a_keyless_public_port_and_for_cluster_identities(cluster):
    """`router.reflection` unset on a cluster without API keys: the public port describes itself
    (grpcurl needs no proto files; with keys: tests/test_secure_router.py); internal ports do, to a
    caller holding a cluster certificate."""
    with grpc.insecure_channel(cluster["router"]) as ch:
        assert "ember.v1.Router" in list_services(ch)
    with security.dial(cluster["kv_edge"], certs(cluster, "operator")) as ch:
        assert "ember.v1.KVStore" in list_services(ch)
