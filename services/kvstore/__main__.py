"""python -m ember.services.kvstore --listen HOST:PORT [--capacity-mb N] [--data-listen HOST:PORT]
[--shm-socket PATH|@NAME|off] [--codec auto|raw|planes] [--site NAME --directory URL]"""
from __future__ import annotations

import argparse
import os

from ember.cluster.wan import parse_routes
from ember.kv import bulk, transfer
from ember.kv.shm import ArenaServer
from ember.rpc import metrics
from ember.rpc.directory import open_directory
from ember.rpc.server import Server, bind_address, run_service
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
from ember.services.kvstore.publisher import Publisher
from ember.services.kvstore.service import KVStoreService
from ember.services.kvstore.store import BlockStore


async def main(args) -> None:
    server = Server(args.listen, [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name])
    store = BlockStore(args.capacity_mb * 2**20)
    metrics.watch_store(store)
    metrics.serve(args.metrics_listen)
    store_id = os.urandom(16)
    shm_socket = "" if args.shm_socket == "off" else args.shm_socket or f"@ember-kvstore-{store_id.hex()}"
    arena = ArenaServer(shm_socket, store.fd, store.capacity_bytes, store_id) if shm_socket else None
    service = KVStoreService(store, args.data_listen or "", args.codec, shm_socket, store_id,
                             routes=parse_routes(args.route))
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(service, server.server)
    server.server.add_generic_rpc_handlers((bulk.handler(store.pinned, service.put_frame),))
    data_server = None
    if args.data_listen:
        host, port = bind_address(args.data_listen).rsplit(":", 1)
        data_server = await transfer.serve(host, int(port), store.pinned)
    publisher = None
    if args.directory:
        publisher = Publisher(store, open_directory(args.directory, args.directory_ttl_s), args.site)
        publisher.start()

    async def stop():
        if publisher is not None:
            await publisher.stop()
        if data_server is not None:
            data_server.close()
        if arena is not None:
            arena.close()
    await server.run(on_stop=stop)


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="ember.services.kvstore")
    p.add_argument("--listen", required=True)
    p.add_argument("--capacity-mb", type=int, default=1024)
    p.add_argument("--data-listen", help="HOST:PORT for the TCP block data plane (faster than gRPC)")
    p.add_argument("--shm-socket", help="Unix socket handing same-host readers the block arena "
                   "(default: an abstract socket named after the store; 'off' disables)")
    p.add_argument("--codec", default="auto", choices=["auto", "raw", "planes"],
                   help="codec asked of peers on pulls; auto compresses only on links slow enough for it to pay")
    p.add_argument("--site", default="", help="this kvstore's site name (for the block directory)")
    p.add_argument("--directory", default="", help="block directory: redis://HOST:PORT/DB or grpc://HOST:PORT")
    p.add_argument("--route", action="append", default=[], metavar="ADDRESS=RELAY",
                   help="reach peer ADDRESS through RELAY (an emulated link); repeatable")
    p.add_argument("--metrics-listen", help="HOST:PORT serving Prometheus /metrics")
    p.add_argument("--directory-ttl-s", type=float, default=60.0, help="directory entries expire unless refreshed")
    args = p.parse_args()
    if args.directory and not args.site:
        p.error("--directory needs --site")
    run_service(lambda: main(args), f"kvstore-{args.site}" if args.site else "kvstore")
