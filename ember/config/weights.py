"""A kvstore's model-chunk settings (`kvstore.chunks_*`): where its chunks live at rest, how much
they may take, whether it compresses them, which local model file seeds them, and its peers cheapest
first by the links table (ember.services.kvstore.weights). Torch-free."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ember.config.schema import ClusterConfig

PRICED_BYTES = 100e6  # a link is priced by the time to move a small model over it (its RTT and bandwidth)


@dataclass(frozen=True)
class WeightStoreSettings:
    chunks_dir: str              # this kvstore's content-addressed folder
    capacity_bytes: int
    codec: str                   # auto (smallest per chunk) or raw
    seed_model: str | None       # the config's model, when its file or folder exists on this host
    peers: tuple[str, ...]       # the other sites' kvstores, cheapest link first (unlinked: same network)


def link_cost_s(config: ClusterConfig, a: str, b: str) -> float:
    link = config.link(a, b)
    return 0.0 if link is None else link.rtt_ms / 1e3 + PRICED_BYTES * 8 / (link.bandwidth_gbps * 1e9)


def weight_store_settings(config: ClusterConfig, site_name: str, cache_dir: Path | None = None) -> WeightStoreSettings:
    from ember.cache import cache_dir as user_cache
    site = config.site(site_name)
    k = config.kvstore
    root = (Path(k.chunks_dir).expanduser() if k.chunks_dir else (cache_dir or user_cache()) / "chunks") / site.name
    others = sorted((s for s in config.sites if s.has("kvstore") and s.name != site.name),
                    key=lambda s: link_cost_s(config, site.name, s.name))
    model = config.model_path()
    return WeightStoreSettings(str(root), k.chunks_capacity_mb * 2**20, k.chunks_codec,
                               str(model) if model.exists() else None, tuple(s.kvstore for s in others))
