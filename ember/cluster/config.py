"""The local-cluster config: sites, their service addresses, and engine settings (torch-free).

Validated on load; an error names the field and what to change. (The full edge-placement
config with links, regions and hardware profiles grows from this.)
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


def _address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:50061)")
    return value


class Site(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    kvstore: str
    kvstore_data: str | None = None  # TCP data plane for bulk block moves
    prefill: str | None = None
    decode: str | None = None

    _check = field_validator("kvstore", "kvstore_data", "prefill", "decode")(
        lambda cls, v: v if v is None else _address(v))


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: str = "float32"
    block_size: int = Field(16, gt=0)
    kv_cache_mb: int = Field(256, gt=0)
    threads: int = Field(2, ge=0)
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(1024, gt=0)


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    router: str
    prefill_site: str
    decode_site: str
    sites: list[Site]
    engine: EngineSettings = EngineSettings()
    kvstore_capacity_mb: int = Field(1024, gt=0)
    kvstore_codec: Literal["auto", "raw", "planes"] = "auto"  # asked of peers on pulls
    # same-host readers (decode) map the kvstore's block arena; off: they stream over gRPC
    kvstore_shared_memory: bool = True
    # Block directory: a Redis URL (redis://HOST:PORT/DB) shared by all sites, or None for
    # the in-memory directory the router hosts (the embedded default).
    directory: str | None = None
    directory_ttl_s: float = Field(60.0, gt=0)

    @field_validator("directory")
    @classmethod
    def _redis_url(cls, v):
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{v!r} is not a Redis URL (e.g. redis://127.0.0.1:6379/0); omit it for the "
                             "in-memory directory")
        return v

    def directory_url(self) -> str:
        """What kvstores publish to: Redis, or the router's in-memory directory."""
        return self.directory or f"grpc://{self.router}"

    _check = field_validator("router")(lambda cls, v: _address(v))

    @model_validator(mode="after")
    def _sites_exist(self):
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names):
            raise ValueError(f"site names must be unique, got {names}")
        if self.prefill_site not in names or self.site(self.prefill_site).prefill is None:
            raise ValueError(f"prefill_site {self.prefill_site!r} must name a site with a prefill address")
        if self.decode_site not in names or self.site(self.decode_site).decode is None:
            raise ValueError(f"decode_site {self.decode_site!r} must name a site with a decode address")
        return self

    def site(self, name: str) -> Site:
        return next(s for s in self.sites if s.name == name)

    def model_path(self, base: Path) -> Path:
        path = Path(self.model)
        return path if path.is_absolute() else (base / path).resolve()


def load_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        return ClusterConfig.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as e:
        raise ValueError(f"{path}: invalid cluster config:\n{e}") from e
