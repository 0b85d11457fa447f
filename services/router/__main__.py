"""python -m ember.services.router --config CLUSTER.yaml"""
from __future__ import annotations

import argparse
import json

from ember.cluster.wan import parse_routes
from ember.kv.block_hash import KVLayout, root_hash
from ember.kv.directory import MemoryDirectory, RedisDirectory
from ember.model.files import folder_fingerprint, model_folder, resolve_serving, weights_fingerprint
from ember.model.tokenizer import Tokenizer
from ember.placement.policy import Placer
from ember.rpc import metrics
from ember.rpc.directory import DirectoryService
from ember.rpc.server import Server, run_service
from ember.v1 import directory_pb2_grpc, router_pb2, router_pb2_grpc
from ember.services.common import REPO_ROOT, load
from ember.services.router import openai_http
from ember.services.router.service import RouterService
from ember.services.router.stubs import SiteStubs


async def main(args) -> None:
    config = load(args)
    folder = model_folder(config.model_path(REPO_ROOT))  # the loaders' HF-layout folder (torch-free read)
    dtype, weights = resolve_serving(config.model_path(REPO_ROOT), config.engine.dtype, config.engine.weights)
    hf_config = json.loads((folder / "config.json").read_text())
    # Redis when configured; otherwise this router hosts an in-memory directory the kvstores publish to
    directory = RedisDirectory(config.directory, config.directory_ttl_s) if config.directory \
        else MemoryDirectory(config.directory_ttl_s)
    service = RouterService(
        Tokenizer.from_folder(folder), model_id=folder.name.removesuffix(".ember"),
        max_model_len=hf_config["max_position_embeddings"], vocab_size=hf_config["vocab_size"],
        placer=Placer(config), stubs=SiteStubs(config, parse_routes(args.route)),
        block_size=config.engine.block_size, root_hash=root_hash(KVLayout(
            weights_fingerprint(folder_fingerprint(folder), weights), dtype,
            config.engine.block_size, hf_config["num_hidden_layers"],
            hf_config.get("num_key_value_heads", hf_config["num_attention_heads"]), hf_config.get("head_dim") or
            hf_config["hidden_size"] // hf_config["num_attention_heads"])),
        directory=directory)
    server = Server(config.router, [router_pb2.DESCRIPTOR.services_by_name["Router"].full_name])
    router_pb2_grpc.add_RouterServicer_to_server(service, server.server)
    if isinstance(directory, MemoryDirectory):
        directory_pb2_grpc.add_BlockDirectoryServicer_to_server(DirectoryService(directory), server.server)
    http = await openai_http.serve(service, config.router_http) if config.router_http else None
    metrics.serve(args.metrics_listen)

    async def stop():
        if http is not None:
            await http.cleanup()
        await directory.close()
    await server.run(on_stop=stop)


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="ember.services.router")
    p.add_argument("--config", required=True)
    p.add_argument("--metrics-listen", help="HOST:PORT serving Prometheus /metrics")
    p.add_argument("--route", action="append", default=[], metavar="ADDRESS=RELAY",
                   help="reach ADDRESS through RELAY (an emulated link); repeatable")
    args = p.parse_args()
    run_service(lambda: main(args), "router")
