"""Start and stop a real local cluster on free ports (used by the service tests)."""
from __future__ import annotations

import socket
from pathlib import Path

import yaml

from ember.model.fetch import DEFAULT_MODEL_PATH


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, **engine) -> dict:
    addr = {name: f"127.0.0.1:{free_port()}" for name in
            ("router", "prefill", "decode", "kv_central", "kv_edge")}
    config = {
        "model": str(DEFAULT_MODEL_PATH),
        "router": addr["router"],
        "prefill_site": "central",
        "decode_site": "edge",
        "sites": [
            {"name": "central", "prefill": addr["prefill"], "kvstore": addr["kv_central"]},
            {"name": "edge", "decode": addr["decode"], "kvstore": addr["kv_edge"]},
        ],
        "engine": {"kv_cache_mb": 128, "threads": 1, **engine},
        "kvstore_capacity_mb": 256,
    }
    path.write_text(yaml.safe_dump(config))
    return addr
