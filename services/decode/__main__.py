"""ember serve decode --config CLUSTER.yaml --site NAME  (or python -m ember.services.decode ...)"""
from __future__ import annotations

from ember.rpc.server import run_service
from ember.services.common import serve_engine_service, service_args
from ember.services.decode.service import DecodeService
from ember.v1 import decode_pb2, decode_pb2_grpc


async def main(args) -> None:
    await serve_engine_service("decode", decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
                               DecodeService(args.cluster.kvstore.on_transfer_failure,
                                             args.cluster.kvstore.recompute_max_tokens),
                               decode_pb2_grpc.add_DecodeServicer_to_server, args)


if __name__ == "__main__":
    args = service_args("decode")
    run_service(lambda: main(args), "decode")
