"""The services a cluster config defines, and the effective settings of each: what the process
started as `ember serve ROLE --config FILE [--site SITE]` runs with. `ember up`, Compose and
Kubernetes start the same list, each service from its own section of the same file."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ember.config.schema import ENGINE_ROLES, ClusterConfig
from ember.kv.redis_client import RedisSettings, RedisUser


@dataclass(frozen=True)
class ServiceSpec:
    name: str            # router, kvstore-<site>, <role>-<site> (one worker) or <role>-<site>-<i> (a pool)
    role: str            # router, prefill, decode, kvstore
    site: str | None     # None for the router
    address: str         # where it serves gRPC
    worker: int = 0      # which of the site's `role` workers (`--worker`)

    def args(self) -> list[str]:
        """Its flags after `ember serve ROLE --config FILE`."""
        return (["--site", self.site] if self.site else []) + (["--worker", str(self.worker)] if self.worker else [])


def worker_name(role: str, site: str, worker: int, pool_size: int) -> str:
    return f"{role}-{site}" if pool_size == 1 else f"{role}-{site}-{worker}"


def services(config: ClusterConfig) -> list[ServiceSpec]:
    """Every process of the cluster, kvstores first (the engines pull from them), router last."""
    out = []
    for site in config.sites:
        if site.has("kvstore"):
            out.append(ServiceSpec(f"kvstore-{site.name}", "kvstore", site.name, site.kvstore))
    for role in ENGINE_ROLES:
        for site in config.engine_sites(role):
            pool = site.workers(role)
            out += [ServiceSpec(worker_name(role, site.name, i, len(pool)), role, site.name, address, i)
                    for i, address in enumerate(pool)]
    out.append(ServiceSpec("router", "router", None, config.router.listen))
    return out


@dataclass(frozen=True)
class KVStoreSettings:
    site: str
    listen: str
    data_listen: str | None
    capacity_mb: int
    codec: str
    shm_socket: str | None   # None: an abstract socket named after the store; "" : shared memory off
    directory: str           # redis://... or grpc://ROUTER
    directory_ttl_s: float
    max_lease_s: float       # the longest lease it grants (longer requests are clamped)
    peers: tuple[str, ...] = ()  # the other sites' kvstores (gRPC): the only sources a Pull may name
    link_GBps: tuple[tuple[str, float], ...] = ()  # (peer kvstore, GB/s of the configured link to its site)
    redis: RedisSettings | None = None  # how it connects to the directory's Redis (None: no Redis)


@dataclass(frozen=True)
class EngineServiceSettings:
    role: str
    site: str
    worker: int
    listen: str
    kvstore: str
    shared_memory: bool
    on_transfer_failure: str
    recompute_max_tokens: int | None
    engine: dict             # EngineConfig fields ("auto" resolved against the model, unless not resolved)


@dataclass(frozen=True)
class RouterSettings:
    listen: str
    http: str | None
    site: str
    max_inflight: int
    retry_after_s: float
    max_migrations: int
    stall_timeout_s: float
    model: str
    directory: str | None    # Redis URL; None: the router hosts the in-memory directory
    directory_ttl_s: float
    internal: str = "127.0.0.1:50052"  # mTLS port of the in-memory directory
    api_keys_file: str | None = None   # absolute path (resolved against the config file)
    require_api_key: bool = False
    reflection: bool | None = None     # None: on unless API keys are configured
    shared_prefixes: tuple[str, ...] = ()
    redis: RedisSettings | None = None  # how it connects to the directory's Redis (None: no Redis)
    tls: str | None = None             # the public ports: None (plaintext), "auto" (EMBER_ROUTER_TLS_DIR), "files"
    tls_cert: str | None = None        # files: absolute paths (resolved against the config file)
    tls_key: str | None = None
    tls_ca: str | None = None          # the CA clients trust (default: the certificate itself)


@dataclass(frozen=True)
class SecuritySettings:
    tls: str                 # auto, files, plaintext
    tls_dir: str | None      # this service's folder (ca.crt, tls.crt, tls.key[, kv-mac.key]); None: plaintext
    metrics_auth: str = "none"            # who may scrape its /metrics: mtls, token, none
    metrics_token_file: str | None = None  # token: the file holding the bearer token
    kv_mac: str = "required"               # a KV producer's missing kv-mac.key: a start-up error, or off (allowed)


def kvstore_settings(config: ClusterConfig, site_name: str) -> KVStoreSettings:
    site = config.site(site_name)
    if not site.has("kvstore"):
        raise ValueError(f"site {site_name!r} has no kvstore")
    k = config.kvstore
    others = [s for s in config.sites if s.has("kvstore") and s.name != site.name]
    links = tuple((s.kvstore, link.bandwidth_gbps / 8) for s in others
                  if (link := config.link(site.name, s.name)) is not None)
    return KVStoreSettings(site.name, site.kvstore, site.kvstore_data, k.capacity_mb, k.codec,
                           k.shm_socket if k.shared_memory else "", config.directory_url(), config.directory.ttl_s,
                           k.max_lease_s, tuple(s.kvstore for s in others), links,
                           redis_settings(config, "kvstore", f"kvstore-{site.name}"))


def _path(config: ClusterConfig, value: str, service_name: str) -> str:
    """A file named in the config: `{name}` is the service's name, relative to the config's folder."""
    return str((config._base / value.replace("{name}", service_name)).resolve())


def redis_settings(config: ClusterConfig, role: str, service_name: str) -> RedisSettings | None:
    """How service `service_name` (a router or kvstore) connects to the directory's Redis: the URL,
    the CA of its TLS and the ACL user of `role` (where its password is read from); None: no Redis."""
    d = config.directory
    if d.url is None:
        return None
    u = getattr(d.users, role)
    user = None if u is None else RedisUser(
        u.username, None if u.password_file is None else _path(config, u.password_file, service_name),
        u.password_env, f"directory.users.{role}")
    return RedisSettings(d.url, None if d.tls_ca is None else _path(config, d.tls_ca, service_name), d.client_cert,
                         user)


def engine_values(config: ClusterConfig, role: str, site_name: str, worker: int = 0) -> dict:
    """The EngineConfig fields of `role` worker number `worker` at `site_name`, "auto" values left for
    the engine to resolve against the model (torch-free: the service process passes them to its core)."""
    site = config.site(site_name)
    if not site.has(role):
        raise ValueError(f"site {site_name!r} has no {role} role")
    pool = site.workers(role)
    if not 0 <= worker < len(pool):
        raise ValueError(f"site {site_name!r} has {len(pool)} {role} worker(s); --worker {worker} is not one")
    values = config.engine.for_role(role).model_dump()
    if values["cpus"] == "auto":
        values["cpus"] = host_cpu_sets(config).get((role, site.name, worker))
    slo = config.router.slo
    return {"model": str(config.model_path()), "slo_ttft_s": slo.ttft_s, "slo_tpot_s": slo.tpot_s, **values}


def engine_settings(config: ClusterConfig, role: str, site_name: str, worker: int = 0, resolve: bool = True):
    """(EngineServiceSettings, EngineConfig) of `role` worker number `worker` at `site_name`. resolve=False:
    (settings, None), the settings' `engine` left unresolved, without importing torch (the service process)."""
    values = engine_values(config, role, site_name, worker)
    engine = None
    if resolve:
        from ember.engine.config import EngineConfig
        engine = EngineConfig(**values)
    site, k = config.site(site_name), config.kvstore
    settings = EngineServiceSettings(role, site.name, worker, site.workers(role)[worker], site.kvstore,
                                     k.shared_memory, k.on_transfer_failure, k.recompute_max_tokens,
                                     engine.model_dump() if engine is not None else values)
    return settings, engine


def host_cpu_sets(config: ClusterConfig) -> dict[tuple[str, str, int], str]:
    """`engine.cpus: auto`: the engines on each machine (ClusterConfig.host_of) split its cores into
    disjoint sets, sized by their ranks (tensor x pipeline x expert parallel); (role, site, worker) ->
    CPU list. Engines of a machine with fewer cores than ranks, or of sites on machines of their own,
    are left out (not pinned)."""
    from ember.util.cpus import format_cpus, host_cpus, split_cores
    by_host: dict[str, list[tuple[tuple[str, str, int], int]]] = {}
    for spec in services(config):
        if spec.role not in ENGINE_ROLES:
            continue
        e = config.engine.for_role(spec.role)
        if e.cpus != "auto":
            continue
        host = config.host_of(spec.site)
        if host is not None:
            # (expert parallelism inside a tensor-parallel group adds no ranks)
            ranks = e.tensor_parallel * e.pipeline_parallel * (e.expert_parallel if e.tensor_parallel == 1 else 1)
            by_host.setdefault(host, []).append(((spec.role, spec.site, spec.worker), ranks))
    out = {}
    for engines in by_host.values():
        sets = split_cores(host_cpus(), [ranks for _, ranks in engines])
        if sets is not None:
            out.update({key: format_cpus(cpus) for (key, _), cpus in zip(engines, sets)})
    return out


def router_settings(config: ClusterConfig) -> RouterSettings:
    r = config.router
    keys = None if r.api_keys_file is None else str((config._base / r.api_keys_file).resolve())
    return RouterSettings(r.listen, r.http, r.site, r.max_inflight, r.retry_after_s, r.max_migrations,
                          r.stall_timeout_s, str(config.model_path()), config.directory.url, config.directory.ttl_s,
                          r.internal, keys, r.require_api_key, r.reflection, tuple(r.shared_prefixes),
                          redis_settings(config, "router", "router"), **router_tls(config))


def router_tls(config: ClusterConfig) -> dict:
    """RouterSettings' tls fields: router.tls's mode and, for files, their absolute paths."""
    t = config.router.tls
    if t is None or t == "auto":
        return {"tls": t}
    cert = str((config._base / t.cert).resolve())
    return {"tls": "files", "tls_cert": cert, "tls_key": str((config._base / t.key).resolve()),
            "tls_ca": cert if t.ca is None else str((config._base / t.ca).resolve())}


def security_settings(config: ClusterConfig, service_name: str, env: dict | None = None) -> SecuritySettings:
    """Where service `service_name` finds its certificates: EMBER_TLS_DIR (what `ember up` sets in auto
    mode), else security.tls_dir; `{name}` in either stands for the service's name."""
    import os
    sec = config.security
    m = sec.metrics
    metrics = (m.mode(sec.tls), None if m.token_file is None else _path(config, m.token_file, service_name))
    if sec.tls == "plaintext":
        return SecuritySettings("plaintext", None, *metrics)
    folder = (os.environ if env is None else env).get("EMBER_TLS_DIR") or sec.tls_dir
    if not folder:
        raise ValueError(f"{service_name}: security.tls is {sec.tls!r} but no certificates are known: `ember up` "
                         "makes them (auto), or set security.tls_dir / EMBER_TLS_DIR to a folder of ca.crt, tls.crt "
                         "and tls.key (`ember certs` writes one per service), or say `security: {tls: plaintext}`")
    return SecuritySettings(sec.tls, str((config._base / folder.replace("{name}", service_name)).resolve()), *metrics,
                            kv_mac=sec.kv_mac)


def service_settings(config: ClusterConfig, role: str, site: str | None = None, worker: int = 0) -> dict:
    """The effective settings of one service, as a plain dict (what deploy tests compare)."""
    if role == "router":
        return asdict(router_settings(config))
    if role == "kvstore":
        return asdict(kvstore_settings(config, site))
    return asdict(engine_settings(config, role, site, worker)[0])
