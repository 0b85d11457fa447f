"""ember serve decode --config CLUSTER.yaml --site NAME  (or python -m ember.services.decode ...)"""
from __future__ import annotations

from ember.services.common import service_args, spawn_core


async def main(args) -> None:
    from ember.services.common import serve_engine_service
    from ember.services.decode.service import DecodeService
    from ember.v1 import decode_pb2, decode_pb2_grpc
    await serve_engine_service("decode", decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
                               DecodeService(args.cluster.kvstore.on_transfer_failure,
                                             args.cluster.kvstore.recompute_max_tokens),
                               decode_pb2_grpc.add_DecodeServicer_to_server, args)


if __name__ == "__main__":
    args = service_args("decode")
    spawn_core("decode", args)  # first: the core's start overlaps this process's gRPC imports
    from ember.rpc.server import run_service
    run_service(lambda: main(args), "decode")
