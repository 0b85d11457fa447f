"""A real local cluster on free ports, for the service tests."""
from __future__ import annotations

from pathlib import Path

from ember.cluster.ports import free_port, write_local_config
from ember.model.fetch import DEFAULT_MODEL_PATH

__all__ = ["dial", "free_port", "write_config"]


def write_config(path: Path, directory: str | None = None, shared_memory: bool = True, **engine) -> dict[str, str]:
    """The two-site cluster on free ports, serving the exact path (fp32 dense: its tokens are checked
    against transformers) unless `engine` says otherwise."""
    engine.setdefault("dtype", "float32")
    engine.setdefault("weights", "dense")
    return write_local_config(path, str(DEFAULT_MODEL_PATH), directory=directory, shared_memory=shared_memory,
                              **engine)


def dial(cluster: dict, key: str, as_service: str = "operator", options=None):
    """A blocking channel to `cluster[key]` (an internal service of a test cluster) holding the
    certificate of `as_service` from the run folder (`operator`, `router`, `prefill-central`, ...):
    mTLS as the cluster's own services use it, plaintext when the cluster runs plaintext."""
    from ember.cluster.launcher import credentials
    from ember.rpc import security
    return security.dial(cluster[key], credentials(Path(cluster["config"]).parent, as_service), options)
