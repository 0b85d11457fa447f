"""ember serve prefill --config CLUSTER.yaml --site NAME  (or python -m ember.services.prefill ...)"""
from __future__ import annotations

from ember.services.common import service_args, spawn_core


async def main(args) -> None:
    from ember.services.common import serve_engine_service, tokenizer
    from ember.services.prefill.service import PrefillService
    from ember.v1 import prefill_pb2, prefill_pb2_grpc
    site, k = args.cluster.site(args.site), args.cluster.kvstore
    others = frozenset(s.kvstore for s in args.cluster.sites if s.name != site.name and s.has("kvstore"))
    service = PrefillService(site.name, site.kvstore, tokenizer(args.cluster), k.on_transfer_failure,
                             k.recompute_max_tokens, stream_targets=others)
    await serve_engine_service("prefill", prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
                               service, prefill_pb2_grpc.add_PrefillServicer_to_server, args)


if __name__ == "__main__":
    args = service_args("prefill")
    spawn_core("prefill", args)  # first: the core's start overlaps this process's gRPC imports
    from ember.rpc.server import run_service
    run_service(lambda: main(args), "prefill")
