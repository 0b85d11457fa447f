"""python -m ember.services.prefill --config CLUSTER.yaml --site NAME"""
from __future__ import annotations

from ember.rpc.server import run_service
from ember.v1 import prefill_pb2, prefill_pb2_grpc
from ember.services.common import engine_args, load, serve_engine_service, tokenizer
from ember.services.prefill.service import PrefillService


async def main(args) -> None:
    config = load(args)
    site = config.site(args.site)
    service = PrefillService(site.name, site.kvstore, tokenizer(config))
    await serve_engine_service(site.prefill, prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
                               service, prefill_pb2_grpc.add_PrefillServicer_to_server, config, site,
                               args.metrics_listen)


if __name__ == "__main__":
    args = engine_args("ember.services.prefill")
    run_service(lambda: main(args), "prefill")
