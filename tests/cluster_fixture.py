"""A real local cluster on free ports, for the service tests."""
from __future__ import annotations

from pathlib import Path

from ember.cluster.ports import free_port, write_local_config
from ember.model.fetch import DEFAULT_MODEL_PATH

__all__ = ["free_port", "write_config"]


def write_config(path: Path, directory: str | None = None, shared_memory: bool = True, **engine) -> dict[str, str]:
    return write_local_config(path, str(DEFAULT_MODEL_PATH), directory=directory, shared_memory=shared_memory,
                              **engine)
