"""Free loopback ports and a cluster config laid out on them (tests and benchmarks)."""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import yaml


def _port_range() -> range:
    """EMBER_PORT_RANGE=LOW-HIGH (inclusive), else 20000-32767: below Linux's ephemeral range (32768-60999,
    where the kernel picks the local port of every outgoing connection, so a port found free there can
    be a client socket's by the time a service binds it). Processes that draw at once (parallel test
    workers) take disjoint ranges."""
    low, _, high = os.environ.get("EMBER_PORT_RANGE", "20000-32767").partition("-")
    return range(int(low), int(high) + 1)


# drawn from the range, never the same one twice in this process, and checked free when drawn
_handed_out: set[int] = set()
_draw = random.Random()


def free_port() -> int:
    """A loopback port nothing listens on now, not handed out before by this process."""
    ports = _port_range()
    for _ in range(1000):
        port = _draw.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {ports.start}-{ports.stop - 1} (EMBER_PORT_RANGE)")


def merge(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` laid over it, section by section (nested dicts merge; any other value
    replaces)."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write_local_config(path: Path, model: str, kvstore_capacity_mb: int = 256, directory: str | None = None,
                       shared_memory: bool = True, overrides: dict | None = None, **engine) -> dict[str, str]:
    """A two-site cluster config on free ports (`overrides`: settings laid over it, ember.cluster.ports.merge);
    returns the addresses by role."""
    addr = {name: f"127.0.0.1:{free_port()}"
            for name in ("router", "router_http", "router_internal", "prefill", "decode", "kv_central", "kv_edge",
                         "kv_central_data", "kv_edge_data")}
    config = {
        "model": model,
        "router": {"listen": addr["router"], "http": addr["router_http"], "internal": addr["router_internal"]},
        "placement": {"prefill_site": "central", "decode_site": "edge"},
        "sites": [
            {"name": "central", "prefill": addr["prefill"], "kvstore": addr["kv_central"],
             "kvstore_data": addr["kv_central_data"]},
            {"name": "edge", "decode": addr["decode"], "kvstore": addr["kv_edge"],
             "kvstore_data": addr["kv_edge_data"]},
        ],
        "engine": {"kv_cache_mb": 128, "threads": 1, **engine},
        "kvstore": {"capacity_mb": kvstore_capacity_mb, "shared_memory": shared_memory},
    }
    if directory:
        config["directory"] = {"url": directory}
    path.write_text(yaml.safe_dump(merge(config, overrides or {}), sort_keys=False))
    return addr


def write_kvstore_config(path: Path, capacity_mb: int = 256, codec: str = "auto", site: str = "solo",
                         tls_dir: str | None = None, peers: list[dict] = ()) -> dict[str, str]:
    """A config holding only kvstores (kvstore tests and benchmarks): site `site` on free ports, for
    `ember serve kvstore --config PATH --site SITE`, beside `peers` (other sites' entries, {"name",
    "kvstore", "kvstore_data"}: the stores it may pull from). Plaintext (`security: {tls: plaintext}`)
    unless `tls_dir` names certificate folders (`{name}`: the service's; ember.cluster.certs writes
    them). Returns its gRPC and data addresses."""
    addr = {"kvstore": f"127.0.0.1:{free_port()}", "kvstore_data": f"127.0.0.1:{free_port()}"}
    security = {"tls": "files", "tls_dir": tls_dir} if tls_dir else {"tls": "plaintext"}
    path.write_text(yaml.safe_dump({"sites": [{"name": site, **addr}, *peers],
                                    "kvstore": {"capacity_mb": capacity_mb, "codec": codec},
                                    "security": security}, sort_keys=False))
    return addr


def on_free_ports(source: Path, path: Path, model: str | None = None) -> dict:
    """Copy the cluster config `source` to `path` with every address moved to a free loopback port
    and a model path made absolute (relative to `source`'s folder); everything else as shipped."""
    from ember.model.fetch import MODELS
    config = yaml.safe_load(Path(source).read_text())
    taken: set[int] = set()

    def fresh() -> str:
        while (port := free_port()) in taken:
            pass
        taken.add(port)
        return f"127.0.0.1:{port}"
    router = config.setdefault("router", {})
    for key in ("listen", "http", "internal"):
        if key in ("listen", "internal") or router.get(key):
            router[key] = fresh()
    for site in config.get("sites", []):
        for key in ("kvstore", "kvstore_data"):
            if site.get(key):
                site[key] = fresh()
        for key in ("prefill", "decode"):  # one worker or a pool
            if isinstance(site.get(key), str):
                site[key] = fresh()
            elif site.get(key):
                site[key] = [fresh() for _ in site[key]]
    ref = model or config.get("model")
    if ref and ref not in MODELS and not Path(ref).is_absolute():
        ref = str((Path(source).resolve().parent / ref).resolve())
    if ref:
        config["model"] = ref
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config
