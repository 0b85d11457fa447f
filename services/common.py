"""Start-up shared by the services: one command line for all four roles, and the engine-backed
services' serving loop (prefill, decode)."""
from __future__ import annotations

import argparse

from ember.config.load import load_config
from ember.config.schema import ClusterConfig

ROLES = ("router", "prefill", "decode", "kvstore")


def service_parser(role: str) -> argparse.ArgumentParser:
    """`ember serve ROLE` / `python -m ember.services.ROLE`: everything a service runs with comes
    from its section of the cluster YAML; the flags say only which service it is and where the
    process's own side channels go."""
    p = argparse.ArgumentParser(prog=f"ember serve {role}",
                                description=f"the {role} service of the cluster in --config")
    p.add_argument("--config", required=True, help="cluster YAML")
    if role != "router":
        p.add_argument("--site", required=True, help="which site's " + role + " this process is")
    if role in ("prefill", "decode"):
        p.add_argument("--worker", type=int, default=0, help="which of the site's workers (0: the first)")
    p.add_argument("--metrics-listen", help="HOST:PORT serving Prometheus /metrics")
    p.add_argument("--route", action="append", default=[], metavar="ADDRESS=RELAY",
                   help="reach ADDRESS through RELAY (an emulated link; `ember up` sets these); repeatable")
    return p


def service_args(role: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = service_parser(role)
    args = p.parse_args(argv)
    try:
        args.cluster = load_config(args.config)
        if role != "router":
            site = args.cluster.site(args.site)
            if not site.has(role):
                raise ValueError(f"site {args.site!r} has no {role} role in {args.config}")
        install_credentials(args.cluster, role, getattr(args, "site", None), getattr(args, "worker", 0))
    except (ValueError, OSError) as e:
        p.error(str(e))
    return args


def install_credentials(config: ClusterConfig, role: str, site: str | None, worker: int = 0) -> None:
    """This service's certificate becomes its identity on every internal hop (ember.rpc.security),
    unless the config says `security: {tls: plaintext}`; its /metrics policy is installed with it."""
    from ember.config.services import security_settings, services
    from ember.rpc import security
    name = next((s.name for s in services(config) if (s.role, s.site, s.worker) == (role, site, worker)),
                role if site is None else f"{role}-{site}")
    from ember.rpc import metrics_http
    settings = security_settings(config, name)
    metrics_http.install(metrics_http.access_of(settings))  # who may read its /metrics (security.metrics)
    if settings.tls_dir is None:
        security.install(None)
        return
    creds = security.Credentials.load(settings.tls_dir)
    if creds.identity.role != role or creds.identity.site != site:
        raise ValueError(f"{settings.tls_dir}/tls.crt is {creds.identity}'s certificate, not {name}'s")
    security.install(security.require_kv_mac(creds, settings.kv_mac))  # (fails closed: no kv-mac.key)


def tokenizer(config: ClusterConfig):
    """The model's tokenizer, read without loading the model (torch-free)."""
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    return Tokenizer.from_folder(model_folder(config.model_path()))


def spawn_core(role: str, args) -> None:
    """Start the engine core's process (`args.core`) before the service imports its gRPC stack: the
    core's imports and model load (most of a worker's start) overlap the service's own."""
    from ember.cluster.wan import parse_routes
    from ember.config.services import engine_settings
    from ember.serving.engine_client import SubprocessEngineClient
    try:
        args.engine_settings, _ = engine_settings(args.cluster, role, args.site, args.worker, resolve=False)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    s = args.engine_settings
    args.core = SubprocessEngineClient.spawn(s.engine, kvstore=s.kvstore, use_shm=s.shared_memory,
                                             routes=parse_routes(args.route), trace_service=role)


async def serve_engine_service(role: str, service_name: str, service, add_to_server, args) -> None:
    """Serve an engine-backed servicer. Its engine core runs in a process of its own (started by
    `spawn_core`); health says NOT_SERVING while the model loads there, SERVING once
    `service.engine` is warm, and NOT_SERVING again if the core dies (its streams end with
    UNAVAILABLE)."""
    import asyncio

    from grpc_health.v1 import health_pb2

    from ember.rpc import metrics
    from ember.rpc.server import Server
    from ember.serving.engine_client import SubprocessEngineClient
    if getattr(args, "core", None) is None:
        spawn_core(role, args)
    settings = args.engine_settings
    server = Server(settings.listen, [service_name])
    add_to_server(service, server.server)
    metrics.serve(args.metrics_listen)

    async def warmup():
        loop = asyncio.get_running_loop()

        def died():
            loop.create_task(server.set_status(health_pb2.HealthCheckResponse.NOT_SERVING))
        service.engine = await SubprocessEngineClient.ready(args.core, on_death=died)
        metrics.watch_engine(service.engine)

    async def stop():
        if service.engine is not None:
            service.engine.close()
    await server.run(warmup=warmup, on_stop=stop)
