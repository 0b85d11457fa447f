"""ember serve kvstore --config CLUSTER.yaml --site NAME  (or python -m ember.services.kvstore ...)

Everything comes from the YAML: the site's `kvstore` / `kvstore_data` addresses and the
`kvstore:` and `directory:` sections (ember.config.services.kvstore_settings)."""
from __future__ import annotations

import os

from ember.cluster.wan import parse_routes
from ember.config.services import kvstore_settings
from ember.config.weights import weight_store_settings
from ember.kv import bulk, transfer
from ember.kv.shm import ArenaServer
from ember.rpc import cert_reload, metrics, security
from ember.rpc.directory import open_directory
from ember.rpc.server import Server, bind_address, run_service
from ember.services.common import service_args
from ember.services.kvstore.chunk_store import ChunkStore
from ember.services.kvstore.publisher import Publisher
from ember.services.kvstore.service import KVStoreService
from ember.services.kvstore.store import BlockStore
from ember.services.kvstore.weights import WeightStoreService
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc


async def main(args) -> None:
    s = kvstore_settings(args.cluster, args.site)
    w = weight_store_settings(args.cluster, args.site)
    server = Server(s.listen, [kvstore_pb2.DESCRIPTOR.services_by_name[name].full_name
                               for name in ("KVStore", "WeightStore")])
    store = BlockStore(s.capacity_mb * 2**20, max_lease_s=s.max_lease_s)
    metrics.watch_store(store)
    metrics.serve(args.metrics_listen)
    store_id = os.urandom(16)
    shm_socket = f"@ember-kvstore-{store_id.hex()}" if s.shm_socket is None else s.shm_socket
    arena = ArenaServer(shm_socket, store.fd, store.capacity_bytes, store_id) if shm_socket else None
    creds = security.current()
    service = KVStoreService(store, s.data_listen or "", s.codec, shm_socket, store_id,
                             routes=parse_routes(args.route), peers=set(s.peers),
                             tls=None if creds is None else creds.client_context(), link_GBps=dict(s.link_GBps),
                             site=s.site, sites={x.kvstore: x.name for x in args.cluster.sites if x.has("kvstore")})
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, server.server)
    weights = WeightStoreService(ChunkStore(w.chunks_dir, w.capacity_bytes), w.peers, parse_routes(args.route),
                                 w.codec, w.seed_model, s.max_lease_s)
    kvstore_pb2_grpc.add_WeightStoreServicer_to_server(weights, server.server)
    server.server.add_generic_rpc_handlers((bulk.handler(store.pinned, service.put_frame, service.expect),))
    data_server = None
    if s.data_listen:
        host, port = bind_address(s.data_listen).rsplit(":", 1)
        data_server = await transfer.serve(  # over mTLS, blocks stream only to the cluster's kvstores
            host, int(port), store.pinned, tls=None if creds is None else data_plane_tls(creds),
            authorize=lambda peercert: security.peer_has_role(peercert, {"kvstore"}),
            refused=lambda reason: metrics.KV_FRAMES_REFUSED.labels(reason).inc())  # (each also logged)
    try:  # (rediss:// and the kvstores' ACL user when configured: ember.kv.redis_client)
        directory = open_directory(s.directory, s.directory_ttl_s, s.redis)
    except ValueError as e:  # its Redis password cannot be read
        raise SystemExit(f"kvstore-{s.site}: {e}") from None
    publisher = Publisher(store, directory, s.site)
    publisher.start()

    async def stop():
        await publisher.stop()
        await weights.close()
        if data_server is not None:
            data_server.close()
        if arena is not None:
            arena.close()
    await server.run(on_stop=stop)


def data_plane_tls(creds: security.Credentials):
    """The data plane's server context: the service's folder, re-read for new connections when it
    changes (ember.rpc.cert_reload; the CA too), with the data plane's TLS 1.2 suite."""
    folder = creds.folder
    return cert_reload.watch(cert_reload.CertSource(
        folder / "tls.crt", folder / "tls.key", folder / "ca.crt", name=f"{creds.identity} data plane",
        client_auth=True, tls12_data_plane=True)).ssl_context()


if __name__ == "__main__":
    args = service_args("kvstore")
    run_service(lambda: main(args), f"kvstore-{args.site}")
