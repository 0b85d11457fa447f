"""`ember status`: each service of a running local cluster, its health, load and KV usage
(from grpc.health.v1 and the service's Prometheus /metrics)."""
from __future__ import annotations

import json
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from ember.rpc import metrics_http, security


def health(address: str, creds: security.Credentials | None = None, public_ca: str | None = None) -> str:
    """grpc.health.v1's answer (or the call's status): over mTLS with `creds`, over TLS trusting the
    CA file `public_ca` (the router's public port with router.tls), else plaintext."""
    from ember.client import router_channel
    try:
        with router_channel(address, public_ca) if public_ca else security.dial(address, creds) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    except grpc.RpcError as e:
        return e.code().name


def scrape(endpoint: dict | str | None, timeout_s: float = 2.0) -> dict[str, float]:
    """Every sample of the service's /metrics (Prometheus text, prometheus_client's parser); {} when it
    does not answer within `timeout_s`. `endpoint`: services.json's "metrics" entry (its address and
    how the operator authenticates: ember.rpc.metrics_http), or HOST:PORT of an open one."""
    if not endpoint:
        return {}
    try:
        text = metrics_http.fetch(endpoint, timeout_s)
    except OSError:
        return {}
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:  # name, or name{label="value",...} as exposed
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    except ValueError:  # a malformed exposition: what parsed before it
        pass
    return values


def rows(run_dir: Path) -> list[tuple[str, ...]]:
    from ember.cluster.launcher import credentials
    services = json.loads((run_dir / "services.json").read_text())
    creds = credentials(run_dir)
    table = [("service", "address", "health", "running", "waiting", "KV used", "kvstore blocks / MB", "requests")]
    for name, info in services.items():
        if info["address"] is None:
            continue
        m = scrape(info.get("metrics"))

        def get(key: str, fmt: str = "{:.0f}", m: dict = m) -> str:
            return fmt.format(m[key]) if key in m else "-"
        store = "-"
        if "ember:kvstore_blocks" in m:
            store = f"{m['ember:kvstore_blocks']:.0f} / {m.get('ember:kvstore_bytes', 0) / 2**20:.0f}"
        engine = name.startswith(("prefill", "decode"))  # the others register these gauges but run no engine
        answer = health(info["address"], None if name == "router" else creds, info.get("ca"))  # (ca: router.tls)
        table.append((name, info["address"], answer,
                      get("ember:num_requests_running") if engine else "-",
                      get("ember:num_requests_waiting") if engine else "-",
                      get("ember:kv_cache_usage_perc", "{:.1%}") if engine else "-", store,
                      get("ember:e2e_request_latency_seconds_count") if name == "router" else "-"))
    return table


MEMORY_COLUMNS = (("weights", ("weights",)), ("KV pool", ("kv_pool",)), ("KV arena", ("kv_arena_maps",)),
                  ("workspace", ("workspace",)), ("slack", ("allocator_slack",)),
                  ("rest", ("code", "heap", "python", "stack", "unaccounted")))


def memory_rows(run_dir: Path) -> list[tuple[str, ...]]:
    """Each process's resident MB by part (ember:memory_bytes of every service's /metrics)."""
    services = json.loads((run_dir / "services.json").read_text())
    table = [("service", "process", "resident MB", *(name for name, _ in MEMORY_COLUMNS))]
    for name, info in services.items():
        m = scrape(info.get("metrics"))
        for process in ("service", "engine-core"):
            key = f'ember:memory_resident_bytes{{process="{process}"}}'
            if key not in m:
                continue

            def mb(parts, process=process, m=m):
                total = sum(m.get(f'ember:memory_bytes{{part="{p}",process="{process}"}}', 0) for p in parts)
                return f"{total / 2**20:.0f}"
            table.append((name, process, f"{m[key] / 2**20:.0f}", *(mb(parts) for _, parts in MEMORY_COLUMNS)))
    return table


def _format(table: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)


def render(run_dir: Path) -> str:
    out = _format(rows(run_dir))
    memory = memory_rows(run_dir)
    if len(memory) > 1:
        out += "\n\nresident memory by part (MB; rest: code, heap, Python objects, stack)\n" + _format(memory)
    return out
