"""python -m services.decode --config CLUSTER.yaml --site NAME"""
from __future__ import annotations

import asyncio

from ember.rpc.server import Server, channel, run_service
from ember.v1 import decode_pb2, decode_pb2_grpc
from services.common import build_engine, engine_args, load
from services.decode.service import DecodeService


async def main(args) -> None:
    config = load(args)
    site = config.site(args.site)
    server = Server(site.decode, [decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name])
    service = DecodeService(channel(site.kvstore))
    decode_pb2_grpc.add_DecodeServicer_to_server(service, server.server)

    async def warmup():  # health says NOT_SERVING until this returns
        service.engine = await asyncio.to_thread(build_engine, config)

    async def stop():
        service.engine.stop()
    await server.run(warmup=warmup, on_stop=stop)


if __name__ == "__main__":
    args = engine_args("services.decode")
    run_service(lambda: main(args))
