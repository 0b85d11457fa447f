"""ember serve router --config CLUSTER.yaml  (or python -m ember.services.router ...)"""
from __future__ import annotations

import os

from ember.cluster.wan import parse_routes
from ember.config.derived import model_facts
from ember.config.services import router_settings
from ember.kv.block_hash import root_hash
from ember.kv.directory import MemoryDirectory, RedisDirectory
from ember.model.tokenizer import Tokenizer
from ember.placement.policy import Placer
from ember.rpc import metrics
from ember.rpc.directory import DirectoryService
from ember.rpc.server import Server, run_service
from ember.services.common import service_args
from ember.services.router import auth, openai_http
from ember.services.router.public_auth import ApiKeyInterceptor
from ember.services.router.public_tls import source as tls_source
from ember.services.router.service import RouterService
from ember.services.router.tenants import SharedPrefixes
from ember.services.router.workers import WorkerPool
from ember.v1 import directory_pb2_grpc, router_pb2, router_pb2_grpc


async def main(args) -> None:
    config, s = args.cluster, router_settings(args.cluster)
    try:  # API keys: the keys file, plus EMBER_API_KEY (tenant `default`), read here once
        keys = auth.load(s.api_keys_file, os.environ.get("EMBER_API_KEY"))
    except ValueError as e:
        raise SystemExit(f"router: {e}") from None
    try:  # the public ports' certificate (router.tls), before anything starts
        public_tls = tls_source(s)
    except ValueError as e:
        raise SystemExit(f"router: {e}") from None
    if s.require_api_key and not keys.enabled:
        raise SystemExit("router: router.require_api_key is set but no API key is configured: set EMBER_API_KEY "
                         "or router.api_keys_file (a YAML file mapping each key to its tenant)")
    model = model_facts(config)  # the KV layout every engine of the cluster writes, read from the model's files
    # Redis when configured; otherwise this router hosts an in-memory directory the kvstores publish to
    # (rediss:// and the router's ACL user when configured: ember.kv.redis_client)
    try:
        directory = RedisDirectory(s.redis, s.directory_ttl_s) if s.redis else MemoryDirectory(s.directory_ttl_s)
        # several routers behind one balancer share worker load and down reports through that Redis
        shared = None
        if s.redis:  # (redis is imported only for a Redis: ~0.3 s of CPU at every start otherwise)
            from ember.services.router.shared_view import SharedWorkerView
            shared = SharedWorkerView(s.redis, name=f"router@{s.listen}")
    except ValueError as e:  # its Redis password cannot be read
        raise SystemExit(f"router: {e}") from None
    workers = WorkerPool(config, parse_routes(args.route), shared)
    tokenizer = Tokenizer.from_folder(model.folder)
    service = RouterService(
        tokenizer, model_id=model.model_id, max_model_len=model.max_model_len,
        vocab_size=model.vocab_size, placer=Placer(config), workers=workers,
        block_size=model.kv_layout.block_size, root_hash=root_hash(model.kv_layout), directory=directory,
        max_inflight=s.max_inflight, max_migrations=s.max_migrations, retry_after_s=s.retry_after_s,
        stall_timeout_s=s.stall_timeout_s, keys=keys,
        shared_prefixes=SharedPrefixes(tokenizer, s.shared_prefixes, model.kv_layout.block_size))
    # the public API over TLS (router.tls) or plaintext, API keys on every call but health (reflection
    # included: on by default only without keys); cluster services reach the directory on the mTLS port
    server = Server(s.listen, [router_pb2.DESCRIPTOR.services_by_name["Router"].full_name], public=True,
                    reflection_on=not keys.enabled if s.reflection is None else s.reflection,
                    internal=None if s.directory else s.internal, public_tls=public_tls,
                    interceptors=[ApiKeyInterceptor(keys)])
    router_pb2_grpc.add_RouterServicer_to_server(service, server.server)
    if isinstance(directory, MemoryDirectory):
        directory_pb2_grpc.add_BlockDirectoryServicer_to_server(DirectoryService(directory), server.server)
    http = await openai_http.serve(service, s.http, public_tls) if s.http else None
    metrics.watch_workers(workers)
    metrics.serve(args.metrics_listen)
    workers.start()

    async def stop():
        await workers.close()
        if http is not None:
            await http.cleanup()
        await directory.close()
    await server.run(on_stop=stop)


if __name__ == "__main__":
    args = service_args("router")
    run_service(lambda: main(args), "router")
