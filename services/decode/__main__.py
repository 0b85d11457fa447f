"""python -m ember.services.decode --config CLUSTER.yaml --site NAME"""
from __future__ import annotations

from ember.rpc.server import run_service
from ember.v1 import decode_pb2, decode_pb2_grpc
from ember.services.common import engine_args, load, serve_engine_service
from ember.services.decode.service import DecodeService


async def main(args) -> None:
    config = load(args)
    site = config.site(args.site)
    await serve_engine_service(site.decode, decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
                               DecodeService(), decode_pb2_grpc.add_DecodeServicer_to_server, config, site,
                               args.metrics_listen)


if __name__ == "__main__":
    args = engine_args("ember.services.decode")
    run_service(lambda: main(args), "decode")
