"""python -m services.kvstore --listen HOST:PORT [--capacity-mb N]"""
from __future__ import annotations

import argparse

from ember.rpc.server import Server, run_service
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.service import KVStoreService
from services.kvstore.store import BlockStore


async def main(args) -> None:
    server = Server(args.listen, [kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name])
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreService(BlockStore(args.capacity_mb * 2**20)),
                                                   server.server)
    await server.run()


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="services.kvstore")
    p.add_argument("--listen", required=True)
    p.add_argument("--capacity-mb", type=int, default=1024)
    args = p.parse_args()
    run_service(lambda: main(args))
