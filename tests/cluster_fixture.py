"""A real local cluster on free ports, for the service tests."""
from __future__ import annotations

from pathlib import Path

from ember.cluster.ports import free_port, write_local_config
from ember.model.fetch import DEFAULT_MODEL_PATH

__all__ = ["free_port", "write_config"]


def write_config(path: Path, directory: str | None = None, shared_memory: bool = True, **engine) -> dict[str, str]:
    """The two-site cluster on free ports, serving the exact path (fp32 dense: its tokens are checked
    against transformers) unless `engine` says otherwise."""
    engine.setdefault("dtype", "float32")
    engine.setdefault("weights", "dense")
    return write_local_config(path, str(DEFAULT_MODEL_PATH), directory=directory, shared_memory=shared_memory,
                              **engine)
