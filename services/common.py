"""Start-up shared by the engine-backed services (prefill, decode)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ember.cluster.config import ClusterConfig, Site, engine_config, load_config

REPO_ROOT = Path(__file__).resolve().parents[1]


def engine_args(prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--config", required=True, help="cluster YAML")
    p.add_argument("--site", required=True)
    p.add_argument("--metrics-listen", help="HOST:PORT serving Prometheus /metrics")
    return p.parse_args()


def tokenizer(config: ClusterConfig):
    """The model's tokenizer, read without loading the model (torch-free)."""
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    return Tokenizer.from_folder(model_folder(config.model_path(REPO_ROOT)))


def load(args) -> ClusterConfig:
    return load_config(args.config)


async def serve_engine_service(address: str, service_name: str, service, add_to_server, config: ClusterConfig,
                               site: Site, metrics_listen: str | None = None) -> None:
    """Serve an engine-backed servicer. Its engine core runs in a process of its own; health
    says NOT_SERVING while the model loads there, SERVING once `service.engine` is warm, and
    NOT_SERVING again if the core dies (its streams end with UNAVAILABLE)."""
    import asyncio

    from grpc_health.v1 import health_pb2

    from ember.rpc import metrics
    from ember.rpc.server import Server
    from ember.serving.engine_client import SubprocessEngineClient
    server = Server(address, [service_name])
    add_to_server(service, server.server)
    metrics.serve(metrics_listen)

    async def warmup():
        loop = asyncio.get_running_loop()

        def died():
            loop.create_task(server.set_status(health_pb2.HealthCheckResponse.NOT_SERVING))
        service.engine = await SubprocessEngineClient.start(engine_config(config, REPO_ROOT), kvstore=site.kvstore,
                                                            use_shm=config.kvstore_shared_memory, on_death=died)
        metrics.watch_engine(service.engine)

    async def stop():
        if service.engine is not None:
            service.engine.close()
    await server.run(warmup=warmup, on_stop=stop)
