"""Free loopback ports and a cluster config laid out on them (tests and benchmarks)."""
from __future__ import annotations

import socket
from pathlib import Path

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_local_config(path: Path, model: str, kvstore_capacity_mb: int = 256, directory: str | None = None,
                       shared_memory: bool = True, **engine) -> dict[str, str]:
    """A two-site cluster config on free ports; returns the addresses by role."""
    addr = {name: f"127.0.0.1:{free_port()}"
            for name in ("router", "router_http", "prefill", "decode", "kv_central", "kv_edge", "kv_central_data",
                         "kv_edge_data")}
    config = {
        "model": model,
        "router": addr["router"],
        "router_http": addr["router_http"],
        "prefill_site": "central",
        "decode_site": "edge",
        "sites": [
            {"name": "central", "prefill": addr["prefill"], "kvstore": addr["kv_central"],
             "kvstore_data": addr["kv_central_data"]},
            {"name": "edge", "decode": addr["decode"], "kvstore": addr["kv_edge"],
             "kvstore_data": addr["kv_edge_data"]},
        ],
        "engine": {"kv_cache_mb": 128, "threads": 1, **engine},
        "kvstore_capacity_mb": kvstore_capacity_mb,
    }
    if directory:
        config["directory"] = directory
    if not shared_memory:
        config["kvstore_shared_memory"] = False
    path.write_text(yaml.safe_dump(config))
    return addr


ADDRESS_KEYS = ("router", "router_http", "prefill", "decode", "kvstore", "kvstore_data")


def on_free_ports(source: Path, path: Path, model: str | None = None) -> dict:
    """Copy the cluster config `source` to `path` with every address moved to a free loopback port
    and the model path made absolute; everything else (engine, kvstore, policy) as shipped."""
    config = yaml.safe_load(Path(source).read_text())
    taken: set[int] = set()

    def fresh() -> str:
        while (port := free_port()) in taken:
            pass
        taken.add(port)
        return f"127.0.0.1:{port}"
    for holder in (config, *config.get("sites", [])):
        for key in ADDRESS_KEYS:
            if holder.get(key):
                holder[key] = fresh()
    model_path = Path(model or config["model"])
    if not model_path.is_absolute():
        model_path = (Path(source).resolve().parents[1] / model_path).resolve()  # configs/ sits at the repo root
    config["model"] = str(model_path)
    path.write_text(yaml.safe_dump(config))
    return config
