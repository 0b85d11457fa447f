"""python -m services.prefill --config CLUSTER.yaml --site NAME"""
from __future__ import annotations

import asyncio

from ember.rpc.server import Server, channel, run_service
from ember.v1 import kvstore_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.common import build_engine, engine_args, load
from services.prefill.service import PrefillService


async def main(args) -> None:
    config = load(args)
    site = config.site(args.site)
    server = Server(site.prefill, [prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name])
    service = PrefillService(site.name, site.kvstore, kvstore_pb2_grpc.KVStoreStub(channel(site.kvstore)))
    prefill_pb2_grpc.add_PrefillServicer_to_server(service, server.server)

    async def warmup():  # health says NOT_SERVING until this returns
        service.engine = await asyncio.to_thread(build_engine, config)

    async def stop():
        service.engine.stop()
    await server.run(warmup=warmup, on_stop=stop)


if __name__ == "__main__":
    args = engine_args("services.prefill")
    run_service(lambda: main(args))
