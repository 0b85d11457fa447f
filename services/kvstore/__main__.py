"""python -m services.kvstore --listen HOST:PORT [--capacity-mb N]"""
from __future__ import annotations

import argparse

from ember.kv import bulk, transfer
from ember.rpc.server import Server, run_service
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.service import KVStoreService
from services.kvstore.store import BlockStore


async def main(args) -> None:
    server = Server(args.listen, [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name])
    store = BlockStore(args.capacity_mb * 2**20)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreService(store, args.data_listen or ""), server.server)
    server.server.add_generic_rpc_handlers((bulk.get_handler(store.pinned),))
    data_server = None
    if args.data_listen:
        host, port = args.data_listen.rsplit(":", 1)
        data_server = await transfer.serve(host, int(port), store.pinned)

    async def stop():
        if data_server is not None:
            data_server.close()
    await server.run(on_stop=stop)


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="services.kvstore")
    p.add_argument("--listen", required=True)
    p.add_argument("--capacity-mb", type=int, default=1024)
    p.add_argument("--data-listen", help="HOST:PORT for the TCP block data plane (faster than gRPC)")
    args = p.parse_args()
    run_service(lambda: main(args))
