"""The edge-placement config (torch-free): sites, links, user regions, hardware profiles,
policy knobs, plus the local cluster's engine and kvstore settings. One YAML file.

Validated on load; an error names the field, the value and what to change. The local
default (configs/local.yaml) is the same schema with two sites and fixed placement.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

ROLES = ("prefill", "decode", "kvstore")


def _address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:50061)")
    return value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HardwareProfile(Strict):
    """Speed model of one site's accelerators (fit from `ember bench engine`, or vendor numbers)."""
    prefill_tokens_per_s: float = Field(gt=0)
    # per-token prefill cost doubles when the attended context reaches this many tokens
    prefill_context_tokens: float = Field(8192, gt=0)
    decode_tokens_per_s: float = Field(gt=0)          # one stream
    decode_batch_tokens_per_s: float = Field(gt=0)    # aggregate, at max_batch
    max_batch: int = Field(64, gt=0)
    pool: Literal["mixed", "prefill-heavy", "decode-heavy"] = "mixed"

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        mean_context = cached_tokens + new_tokens / 2
        return new_tokens / self.prefill_tokens_per_s * (1 + mean_context / self.prefill_context_tokens)

    def step_s(self, batch: int) -> float:
        """Time of one decode step with `batch` running sequences (= TPOT of each)."""
        return max(1 / self.decode_tokens_per_s, batch / self.decode_batch_tokens_per_s)


# Measured on this 2-core CPU (BENCHMARKS.md, Ember fp32, 2 threads): the local default.
CPU_PROFILE = HardwareProfile(prefill_tokens_per_s=560, prefill_context_tokens=3000, decode_tokens_per_s=13.9,
                              decode_batch_tokens_per_s=191, max_batch=32)


class Site(Strict):
    name: str
    region: str = ""                       # defaults to the site name
    tier: Literal["central", "edge"] = "edge"  # central GPU region or edge site (the baselines use it)
    roles: list[Literal["prefill", "decode", "kvstore"]] | None = None  # default: those with an address
    hardware: str = "default"
    capacity: int | None = Field(None, gt=0)  # concurrent decode sequences; default: the profile's max_batch
    kvstore: str | None = None
    kvstore_data: str | None = None        # TCP data plane for bulk block moves
    prefill: str | None = None
    decode: str | None = None

    _check = field_validator("kvstore", "kvstore_data", "prefill", "decode")(
        lambda cls, v: v if v is None else _address(v))

    @model_validator(mode="after")
    def _roles_have_addresses(self):
        if not self.region:
            self.region = self.name
        if self.roles is None:
            self.roles = [r for r in ROLES if getattr(self, r)]
        for role in self.roles:
            if getattr(self, role) is None:
                raise ValueError(f"site {self.name!r} has role {role!r} but no {role!r} address: add "
                                 f"`{role}: HOST:PORT` or drop the role")
        if ("prefill" in self.roles or "decode" in self.roles) and "kvstore" not in self.roles:
            raise ValueError(f"site {self.name!r} runs prefill/decode without a kvstore: add `kvstore: HOST:PORT` "
                             "(KV blocks move through each site's kvstore)")
        return self

    def has(self, role: str) -> bool:
        return role in self.roles


class Link(Strict):
    a: str
    b: str
    rtt_ms: float = Field(ge=0)
    bandwidth_gbps: float = Field(gt=0)    # gigabits per second


class Reach(Strict):
    site: str
    rtt_ms: float = Field(ge=0)


class UserRegion(Strict):
    name: str
    reach: list[Reach] = Field(min_length=1)


class Policy(Strict):
    name: Literal["ember", "central", "edge", "fixed"] = "ember"
    codec_saving: float = Field(0.0, ge=0, lt=1)       # fraction of KV bytes the link codec saves
    layer_overlap: float = Field(0.0, ge=0, lt=1)      # fraction of the KV transfer hidden by layer-wise streaming
    session_affinity: bool = True
    decode_heavy_ratio: float = Field(1.0, gt=0)       # expected output/input above this: decode-heavy request
    pool_slack_ms: float = Field(10.0, ge=0)           # RTT a request gives up to land on a pool of its shape
    default_output_tokens: int = Field(256, gt=0)      # expected output when the request does not say
    kv_bytes_per_token: int = Field(46080, gt=0)       # SmolLM2 fp32: 30 layers x 3 heads x 64 x K,V x 4 B


class EngineSettings(Strict):
    # auto: a Q4_1 GGUF serves its own codes on int4 kernels with bf16 KV (ember.model.files.resolve_serving);
    # weights dense + dtype float32 is the exact path
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    weights: Literal["auto", "dense", "q4"] = "auto"
    block_size: int = Field(16, gt=0)
    kv_cache_mb: int | None = Field(None, gt=0)  # a fixed pool size; default: kv_cache_memory_fraction
    kv_cache_memory_fraction: float = Field(0.1, gt=0, le=0.9)  # of the memory available when the engine starts
    threads: int = Field(2, ge=0)
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(1024, gt=0)

    @model_validator(mode="after")
    def _q4_needs_bf16(self):
        if self.weights == "q4" and self.dtype == "float32":
            raise ValueError("engine.weights 'q4' needs engine.dtype 'bfloat16' or 'auto' "
                             "(torch's int4 CPU kernels take bf16)")
        return self


class ClusterConfig(Strict):
    model: str = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
    router: str = "127.0.0.1:50051"
    router_http: str | None = None         # OpenAI-compatible HTTP API of the router (HOST:PORT)
    router_site: str | None = None         # where the router runs (for emulated links); default: decode_site
    prefill_site: str | None = None        # fixed placement, or the fallback for requests with no region
    decode_site: str | None = None
    sites: list[Site] = Field(min_length=1)
    links: list[Link] = []
    regions: list[UserRegion] = []
    hardware: dict[str, HardwareProfile] = {}
    policy: Policy = Policy()
    emulate_links: bool = False            # `ember up` relays every inter-site hop through an emulated link
    engine: EngineSettings = EngineSettings()
    kvstore_capacity_mb: int = Field(1024, gt=0)
    kvstore_codec: Literal["auto", "raw", "planes"] = "auto"  # asked of peers on pulls
    # same-host readers (decode) map the kvstore's block arena; off: they stream over gRPC
    kvstore_shared_memory: bool = True
    # Block directory: a Redis URL (redis://HOST:PORT/DB) shared by all sites, or None for
    # the in-memory directory the router hosts (the embedded default).
    directory: str | None = None
    directory_ttl_s: float = Field(60.0, gt=0)

    _check = field_validator("router", "router_http")(lambda cls, v: v if v is None else _address(v))
    _by_name: dict[str, Site] = PrivateAttr(default_factory=dict)
    _links: dict[tuple[str, str], Link] = PrivateAttr(default_factory=dict)

    @field_validator("directory")
    @classmethod
    def _redis_url(cls, v):
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{v!r} is not a Redis URL (e.g. redis://127.0.0.1:6379/0); omit it for the "
                             "in-memory directory")
        return v

    @model_validator(mode="after")
    def _topology(self):
        names = [s.name for s in self.sites]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"sites: names must be unique, {dupes} appear more than once")
        known = f"known sites: {', '.join(names)}"
        self.hardware = {"default": CPU_PROFILE, **self.hardware}
        self._by_name = {s.name: s for s in self.sites}
        for i, site in enumerate(self.sites):
            if site.hardware not in self.hardware:
                raise ValueError(f"sites[{i}].hardware: {site.hardware!r} is not a profile; define it under "
                                 f"`hardware:` or use one of {sorted(self.hardware)}")
        for i, link in enumerate(self.links):
            for end in ("a", "b"):
                if getattr(link, end) not in self._by_name:
                    raise ValueError(f"links[{i}].{end}: unknown site {getattr(link, end)!r}; {known}")
            if link.a == link.b:
                raise ValueError(f"links[{i}]: a link joins two different sites, got {link.a!r} twice")
        for i, region in enumerate(self.regions):
            for j, reach in enumerate(region.reach):
                if reach.site not in self._by_name:
                    raise ValueError(f"regions[{i}].reach[{j}].site: unknown site {reach.site!r}; {known}")
            if not any(self._by_name[r.site].has("decode") for r in region.reach):
                raise ValueError(f"regions[{i}] ({region.name!r}) reaches no site with the decode role: add a "
                                 "decode site to its `reach` list")
        for field, role in (("prefill_site", "prefill"), ("decode_site", "decode")):
            value = getattr(self, field)
            if value is not None and (value not in self._by_name or not self._by_name[value].has(role)):
                raise ValueError(f"{field}: {value!r} must name a site with the {role} role; {known}")
        if not self.regions:
            if self.prefill_site is None or self.decode_site is None:
                raise ValueError("prefill_site and decode_site are required when no `regions` are configured")
            self.policy = self.policy.model_copy(update={"name": "fixed"})  # nothing to choose between
        if self.router_site is None:
            self.router_site = self.decode_site or names[0]
        elif self.router_site not in self._by_name:
            raise ValueError(f"router_site: unknown site {self.router_site!r}; {known}")
        self._links = {}
        for link in self.links:
            self._links[(link.a, link.b)] = self._links[(link.b, link.a)] = link
        return self

    def site(self, name: str) -> Site:
        return self._by_name[name]

    def profile(self, site: str) -> HardwareProfile:
        return self.hardware[self._by_name[site].hardware]

    def link(self, a: str, b: str) -> Link | None:
        """The link between two sites; None when a == b or none is configured."""
        return self._links.get((a, b))

    def region(self, name: str) -> UserRegion | None:
        return next((r for r in self.regions if r.name == name), None)

    def decode_capacity(self, site: str) -> int:
        s = self._by_name[site]
        return s.capacity or self.profile(site).max_batch

    def model_path(self, base: Path) -> Path:
        path = Path(self.model)
        return path if path.is_absolute() else (base / path).resolve()

    def directory_url(self) -> str:
        """What kvstores publish to: Redis, or the router's in-memory directory."""
        return self.directory or f"grpc://{self.router}"


def load_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        return ClusterConfig.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as e:
        raise ValueError(f"{path}: invalid config:\n{_explain(e)}") from e


def _explain(error: ValidationError) -> str:
    """One line per problem: where, what was given, what is wrong."""
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        given = item.get("input")
        shown = "" if isinstance(given, dict | list) or given is None else f" (got {given!r})"
        lines.append(f"  {where}{shown}: {item['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)
