"""Start-up shared by the engine-backed services (prefill, decode)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ember.cluster.config import ClusterConfig, load_config

REPO_ROOT = Path(__file__).resolve().parents[1]


def engine_args(prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--config", required=True, help="cluster YAML")
    p.add_argument("--site", required=True)
    p.add_argument("--metrics-listen", help="HOST:PORT serving Prometheus /metrics")
    return p.parse_args()


def build_engine(config: ClusterConfig):
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.serving.async_engine import AsyncEngine
    e = config.engine
    engine = LLMEngine(EngineConfig(model=str(config.model_path(REPO_ROOT)), dtype=e.dtype, weights=e.weights,
                                    block_size=e.block_size,
                                    kv_cache_bytes=e.kv_cache_mb * 2**20, num_threads=e.threads,
                                    max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens))
    return AsyncEngine(engine)


def load(args) -> ClusterConfig:
    return load_config(args.config)


async def serve_engine_service(address: str, service_name: str, service, add_to_server, config: ClusterConfig,
                               metrics_listen: str | None = None) -> None:
    """Serve an engine-backed servicer: health says NOT_SERVING while the model loads (off the
    event loop, so health checks are answered), SERVING once `service.engine` is set."""
    import asyncio

    from ember.rpc import metrics
    from ember.rpc.server import Server
    server = Server(address, [service_name])
    add_to_server(service, server.server)
    metrics.serve(metrics_listen)

    async def warmup():
        service.engine = await asyncio.to_thread(build_engine, config)
        metrics.watch_engine(service.engine.engine)

    async def stop():
        service.engine.stop()
    await server.run(warmup=warmup, on_stop=stop)
