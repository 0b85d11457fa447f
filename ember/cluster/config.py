"""The cluster config is the edge-placement config (ember.placement.config); re-exported here
for the launcher and services, with the one mapping from its engine section to an EngineConfig."""
from pathlib import Path

from ember.placement.config import ClusterConfig, EngineSettings, Site, load_config

__all__ = ["ClusterConfig", "EngineSettings", "Site", "engine_config", "load_config"]


def engine_config(config: ClusterConfig, base: Path):
    """The EngineConfig an engine service of `config` runs (model path resolved against `base`)."""
    from ember.engine.config import EngineConfig
    e = config.engine
    return EngineConfig(model=str(config.model_path(base)), dtype=e.dtype, weights=e.weights,
                        block_size=e.block_size, kv_cache_bytes=e.kv_cache_mb * 2**20 if e.kv_cache_mb else None,
                        kv_cache_memory_fraction=e.kv_cache_memory_fraction, num_threads=e.threads,
                        max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens)
