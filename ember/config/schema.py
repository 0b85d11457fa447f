"""The cluster config: one pydantic schema, one YAML file, every service reads its own section.

    model       a named model (fetched into the user cache) or a path relative to the file
    router      the edge service: gRPC and OpenAI HTTP addresses, its site
    placement   policy and its knobs, fixed sites, emulated links
    sites       name, tier, region, hardware, capacity and the address of each role there
    links, regions, hardware   the edge-placement topology
    engine      settings of every engine (ember.engine.config.EngineSettings), with per-role
                overrides under engine.prefill / engine.decode
    kvstore     capacity, codec, shared memory (every site's store)
    directory   where blocks are found: Redis, or the router's in-memory directory
    security    mTLS on every internal hop (certificates made by `ember up`, or mounted files)

Each setting has one name and one default, here. Values that follow from the model (the KV
layout, KV bytes per token) are derived (ember.config.derived), not configured. Errors name
the key, what was given and what to change; an unknown key is an error that names it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from ember.config.section import Section
from ember.engine.config import EngineSettings
from ember.model.fetch import DEFAULT_MODEL, resolve_model

ROLES = ("prefill", "decode", "kvstore")
ENGINE_ROLES = ("prefill", "decode")
# Engine settings a role may set for itself. The rest name the bytes of a KV block (dtype,
# weights, block size) or the request limit the router checks, so both roles must agree.
ROLE_SETTINGS = ("kv_cache_mb", "memory_utilization", "max_num_seqs", "max_num_batched_tokens", "threads",
                 "cpus", "tensor_parallel", "pipeline_parallel", "expert_parallel")


def _address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:50061)")
    return value


class HardwareProfile(Section):
    """Speed model of one site's accelerators (fit from `ember bench engine`, or vendor numbers)."""
    prefill_tokens_per_s: float = Field(gt=0)
    prefill_context_tokens: float = Field(8192, gt=0, description="attended context at which the per-token "
                                                                  "prefill cost doubles")
    decode_tokens_per_s: float = Field(gt=0, description="one stream")
    decode_batch_tokens_per_s: float = Field(gt=0, description="aggregate, at max_batch")
    max_batch: int = Field(64, gt=0)
    pool: Literal["mixed", "prefill-heavy", "decode-heavy"] = "mixed"
    service_cv: float = Field(0.1, ge=0, le=2, description="coefficient of variation of prefill, decode-step "
                                                          "and transfer times (the simulator's noise)")

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        mean_context = cached_tokens + new_tokens / 2
        return new_tokens / self.prefill_tokens_per_s * (1 + mean_context / self.prefill_context_tokens)

    def step_s(self, batch: int) -> float:
        """Time of one decode step with `batch` running sequences (= TPOT of each)."""
        return max(1 / self.decode_tokens_per_s, batch / self.decode_batch_tokens_per_s)


# Measured on this 2-core CPU (BENCHMARKS.md, Ember fp32, 2 threads): the profile `default`.
CPU_PROFILE = HardwareProfile(prefill_tokens_per_s=560, prefill_context_tokens=3000, decode_tokens_per_s=13.9,
                              decode_batch_tokens_per_s=191, max_batch=32)


class Site(Section):
    name: str
    tier: Literal["central", "edge"] = Field("edge", description="central GPU region or edge site")
    roles: list[Literal["prefill", "decode", "kvstore"]] | None = Field(
        None, description="default: the roles that have an address")
    hardware: str = Field("default", description="a profile under `hardware:`")
    capacity: int | None = Field(None, gt=0, description="concurrent decode sequences; default: the profile's "
                                                         "max_batch")
    host: str | None = Field(None, description="sites naming the same host share one machine: the router prices "
                                               "colocated against disaggregated prefill there, engine.cpus auto "
                                               "splits its cores, and the simulator runs each busy engine on it "
                                               "at 1/k of its speed while k are busy; unset: a site whose every "
                                               "address is a loopback one shares `localhost` (ember up's one-host "
                                               "clusters; not in the simulator), else its own hardware")
    kvstore: str | None = Field(None, description="HOST:PORT of the site's kvstore (gRPC)")
    kvstore_data: str | None = Field(None, description="HOST:PORT of its TCP data plane for bulk block moves")
    prefill: list[str] = Field([], description="HOST:PORT of each prefill worker of the site (one, or a list)")
    decode: list[str] = Field([], description="HOST:PORT of each decode worker of the site (one, or a list)")

    _check = field_validator("kvstore", "kvstore_data")(lambda cls, v: v if v is None else _address(v))

    @field_validator("prefill", "decode", mode="before")
    @classmethod
    def _workers(cls, v):
        workers = [v] if isinstance(v, str) else v
        if isinstance(workers, list):
            for w in workers:
                if isinstance(w, str):
                    _address(w)
            if len(set(workers)) != len(workers):
                raise ValueError(f"worker addresses must be unique, got {workers}")
        return workers

    @model_validator(mode="after")
    def _roles_have_addresses(self):
        if self.roles is None:
            self.roles = [r for r in ROLES if getattr(self, r)]
        for role in self.roles:
            if not getattr(self, role):
                raise ValueError(f"site {self.name!r} has role {role!r} but no {role!r} address: add "
                                 f"`{role}: HOST:PORT` or drop the role")
        if ("prefill" in self.roles or "decode" in self.roles) and "kvstore" not in self.roles:
            raise ValueError(f"site {self.name!r} runs prefill/decode without a kvstore: add `kvstore: HOST:PORT` "
                             "(KV blocks move through each site's kvstore)")
        return self

    def has(self, role: str) -> bool:
        return role in self.roles

    def workers(self, role: str) -> list[str]:
        """The addresses of the site's `role` workers (prefill, decode), in order."""
        return list(getattr(self, role))


class Link(Section):
    a: str
    b: str
    rtt_ms: float = Field(ge=0)
    bandwidth_gbps: float = Field(gt=0, description="gigabits per second")


class Reach(Section):
    site: str
    rtt_ms: float = Field(ge=0)


class UserRegion(Section):
    name: str
    reach: list[Reach] = Field(min_length=1)


class SLOSection(Section):
    """The latency objectives every engine of the cluster plans its steps against (ember.engine.step_policy)."""
    ttft_s: float = Field(1.0, gt=0, description="time to first token: a waiting prompt this close to it gets "
                                                 "its whole chunk even when decodes are due (agents wait for "
                                                 "first tokens: TTFT first)")
    tpot_s: float = Field(0.25, gt=0, description="time per output token: decodes may be skipped for prefill "
                                                  "while they stay within it; past it, prefill chunks are cut "
                                                  "to fit it unless a prompt's TTFT is at risk")


class RouterTLSFiles(Section):
    cert: str = Field(description="the router's server certificate chain (PEM), relative to this file")
    key: str = Field(description="its private key (PEM), relative to this file")
    ca: str | None = Field(None, description="the CA file clients trust for it (`ember up` checks the router's "
                                             "health with it and prints it); default: cert (self-signed)")


class RouterSection(Section):
    listen: str = Field("127.0.0.1:50051", description="HOST:PORT of the public gRPC API")
    http: str | None = Field(None, description="HOST:PORT of the OpenAI-compatible HTTP API; unset: off")
    site: str | None = Field(None, description="where the router runs (for emulated links); default: "
                                               "placement.decode_site, else the first site")
    max_inflight: int = Field(256, gt=0, description="requests admitted at once; past it: RESOURCE_EXHAUSTED with "
                                                     "grpc-retry-pushback-ms (HTTP 429 with Retry-After)")
    retry_after_s: float = Field(1.0, gt=0, description="the pushback a refused request is given")
    max_migrations: int = Field(2, ge=0, description="times one decode stream may move to another worker after "
                                                     "its worker failed")
    stall_timeout_s: float = Field(30.0, gt=0, description="a decode stream silent this long counts as failed "
                                                           "(its worker or link is stalled or blackholed): it moves")
    internal: str = Field("127.0.0.1:50052", description="HOST:PORT of the router's cluster-internal gRPC port "
                                                         "(mTLS like every internal hop): the in-memory block "
                                                         "directory the kvstores publish to")
    api_keys_file: str | None = Field(None, description="YAML mapping each API key to its tenant's name, relative "
                                                        "to this file; EMBER_API_KEY adds one key (tenant "
                                                        "`default`). Any key configured: every route but health "
                                                        "needs one")
    require_api_key: bool = Field(False, description="refuse to start when no API key is configured")
    reflection: bool | None = Field(None, description="gRPC server reflection on the public port; unset: on "
                                                      "when no API key is configured, off when keys are (then "
                                                      "only callers with a key may use it)")
    tls: Literal["auto"] | RouterTLSFiles | None = Field(
        None, description="TLS on the public gRPC and HTTP ports; unset: plaintext; auto: `ember up` makes a server "
                          "certificate from the cluster CA (RUN_DIR/certs/ca.crt is what clients trust); "
                          "{cert, key[, ca]}: files, re-read on SIGHUP and when they change")
    shared_prefixes: list[str] = Field([], description="texts (system prompts) whose KV blocks every tenant "
                                                       "shares; every other block is salted per tenant")
    slo: SLOSection = SLOSection()

    _check = field_validator("listen", "http", "internal")(lambda cls, v: v if v is None else _address(v))

    @field_validator("tls", mode="before")
    @classmethod
    def _tls(cls, v):
        if isinstance(v, str) and v != "auto":
            raise ValueError(f"{v!r}: say `auto` (a certificate `ember up` makes) or {{cert: FILE, key: FILE}}; "
                             "omit it for plaintext")
        return v


class PlacementSection(Section):
    policy: Literal["ember", "central", "edge", "fixed"] = Field(
        "ember", description="ember: link-priced; central/edge: baselines; fixed: prefill_site/decode_site "
                             "(always, when no regions are configured)")
    prefill_site: str | None = Field(None, description="fixed placement, or the fallback for requests with no "
                                                       "region")
    decode_site: str | None = None
    session_affinity: bool = Field(True, description="keep a conversation's decode where its KV is")
    codec_saving: float | None = Field(None, ge=0, lt=1, description="fraction of KV bytes the link codec saves; "
                                       "unset: the planes codec's measured saving on each link where the "
                                       "kvstores use it (kvstore.codec planes, or auto on links below its "
                                       "break-even)")
    decode_heavy_ratio: float = Field(1.0, gt=0, description="expected output/input above this: a decode-heavy "
                                                             "request")
    pool_slack_ms: float = Field(10.0, ge=0, description="RTT a request gives up to land on a pool of its shape")
    default_output_tokens: int = Field(256, gt=0, description="expected output when a request does not say")
    kv_bytes_per_token: int | None = Field(None, gt=0, description="KV bytes per token the link cost is priced "
                                                                   "at; unset: derived from the model and dtype")
    emulate_links: bool = Field(False, description="`ember up` relays every inter-site hop through an emulated "
                                                   "link (RTT, bandwidth)")
    shared_host: Literal["auto", "colocated", "disaggregated"] = Field(
        "disaggregated", description="fixed prefill and decode sites on one host (site.host): auto prices, per "
                                     "request, the decode worker prefilling itself against the prefill worker (the "
                                     "shipped local configs); colocated or disaggregated (the default: a config "
                                     "that names two sites means two) always take that one")


class RoleEngineSettings(Section):
    """Per-role overrides of engine settings; unset: the `engine:` value."""
    kv_cache_mb: int | None = Field(None, gt=0)
    memory_utilization: float | None = Field(None, gt=0, le=0.95)
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    threads: int | None = Field(None, ge=0)
    cpus: str | None = None
    tensor_parallel: int | None = Field(None, ge=1)
    pipeline_parallel: int | None = Field(None, ge=1)
    expert_parallel: int | None = Field(None, ge=1)


assert set(RoleEngineSettings.model_fields) == set(ROLE_SETTINGS) <= set(EngineSettings.model_fields)


class EngineSection(EngineSettings):
    prefill: RoleEngineSettings = RoleEngineSettings()
    decode: RoleEngineSettings = RoleEngineSettings()

    def for_role(self, role: str) -> EngineSettings:
        """The settings an engine of `role` runs: the section's, with the role's overrides."""
        if role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {ENGINE_ROLES}, got {role!r}")
        values = {name: getattr(self, name) for name in EngineSettings.model_fields}
        override = getattr(self, role)
        values.update({name: getattr(override, name) for name in ROLE_SETTINGS if getattr(override, name) is not None})
        return EngineSettings(**values)


class KVStoreSection(Section):
    capacity_mb: int = Field(1024, gt=0, description="block bytes each site's kvstore holds (LRU beyond)")
    codec: Literal["auto", "raw", "planes"] = Field("auto", description="asked of peers on pulls; auto compresses "
                                                                        "only on links slow enough for it to pay")
    shared_memory: bool = Field(True, description="same-host readers (decode) map the store's block arena; off: "
                                                  "they stream over gRPC")
    shm_socket: str | None = Field(None, description="Unix socket handing out the arena: a path (containers "
                                                     "sharing a volume) or @NAME; unset: an abstract socket "
                                                     "named after the store")
    on_transfer_failure: Literal["recompute", "fail"] = Field(
        "recompute", description="a failed or partial pull (or prefill's write to its store): the engine computes "
                                 "what is missing, or fails the request")
    recompute_max_tokens: int | None = Field(None, gt=0, description="recompute at most this many prompt tokens "
                                                                     "after a failed transfer; unset: any")
    stream_prefill: bool = Field(True, description="a remote prefill across a link of the links table pushes its "
                                                   "blocks to the decode site's kvstore chunk by chunk while later "
                                                   "chunks compute (its last chunk is small); off, or sites without "
                                                   "a link: decode pulls them after the prefill")
    max_lease_s: float = Field(30.0, gt=0, le=3600, description="longest lease a kvstore grants on blocks; a longer "
                                                                "request is granted this (holders renew within "
                                                                "it), so a dead holder's blocks free within it")
    chunks_dir: str | None = Field(None, description="where each kvstore keeps model weight chunks at rest (a "
                                                     "folder per site inside it); unset: the user cache's "
                                                     "chunks/<site>")
    chunks_capacity_mb: int = Field(4096, gt=0, description="stored (compressed) chunk bytes each kvstore holds on "
                                                            "disk; beyond it, least recently used models no worker "
                                                            "of the site holds are evicted")
    chunks_codec: Literal["auto", "raw"] = Field("auto", description="model chunks at rest and on the wire: auto "
                                                                     "keeps the smallest lossless coding per chunk, "
                                                                     "raw stores and sends them uncompressed")


class RedisUserSection(Section):
    """A Redis ACL user (ember.kv.redis_acl gives each role only the commands and keys it needs)."""
    username: str = Field(min_length=1, description="the role's Redis user")
    password_file: str | None = Field(None, description="a file holding its password, relative to this file; "
                                                        "`{name}` stands for the service's name")
    password_env: str | None = Field(None, description="or: the environment variable holding it")

    @model_validator(mode="after")
    def _one_password_source(self):
        if (self.password_file is None) == (self.password_env is None):
            raise ValueError("give exactly one of password_file (a file holding the password) or password_env "
                             "(a variable holding it): a password is never written in the config")
        return self


class RedisUsersSection(Section):
    router: RedisUserSection | None = Field(None, description="the routers' user (directory lookups, the shared "
                                                              "worker view)")
    kvstore: RedisUserSection | None = Field(None, description="the kvstores' user (they publish their blocks)")


class DirectorySection(Section):
    url: str | None = Field(None, description="redis://HOST:PORT/DB shared by all sites (rediss:// for TLS, "
                                              "required unless security.tls is plaintext); unset: the in-memory "
                                              "directory the router hosts")
    ttl_s: float = Field(60.0, gt=0, description="entries expire unless the kvstore refreshes them")
    tls_ca: str | None = Field(None, description="rediss: the CA file that signed redis-server's certificate, "
                                                 "relative to this file; unset: the cluster CA (each service's "
                                                 "ca.crt)")
    client_cert: bool = Field(True, description="rediss: each service presents its cluster certificate when "
                                                "redis-server asks (tls-auth-clients)")
    users: RedisUsersSection = Field(RedisUsersSection(), description="the Redis ACL user of each role; unset: "
                                                                      "Redis's default user")

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v):
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{v!r} is not a Redis URL (e.g. rediss://127.0.0.1:6379/0); omit it for the "
                             "in-memory directory")
        if v is not None:
            from urllib.parse import urlsplit
            if urlsplit(v).password is not None or "password=" in v:
                raise ValueError("a password in the URL would sit in the config in clear: give each role a user "
                                 "under directory.users (password_file or password_env)")
        return v

    @model_validator(mode="after")
    def _options_need_redis(self):
        if self.url is None:
            for key in ("tls_ca", "users"):
                value = getattr(self, key)
                if key in self.model_fields_set and (value.model_fields_set if key == "users" else value):
                    # (a dumped config's empty `users: {}` names nobody)
                    raise ValueError(f"directory.{key}: set only with directory.url (a Redis); the in-memory "
                                     "directory is reached over the cluster's mTLS")
        elif self.tls_ca is not None and not self.url.startswith("rediss://"):
            raise ValueError(f"directory.tls_ca: only for a rediss:// (TLS) url, got {self.url!r}")
        return self


class MetricsAuthSection(Section):
    """Who may read a service's Prometheus /metrics (ember.rpc.metrics_http)."""
    auth: Literal["auto", "mtls", "token", "none"] = Field(
        "auto", description="mtls: HTTPS, and only a cluster certificate of the operator role (`ember status`, "
                            "Prometheus) is served; token: a bearer token (`Authorization: Bearer ...`), over "
                            "HTTPS unless security.tls is plaintext; none: open plain HTTP; auto: mtls, or none "
                            "when security.tls is plaintext")
    token_file: str | None = Field(None, description="token: a file holding the bearer token, relative to this "
                                                     "file; `{name}` stands for the service's name")

    def mode(self, tls: str) -> str:
        """The effective auth under security.tls `tls`: auto resolved."""
        return ("none" if tls == "plaintext" else "mtls") if self.auth == "auto" else self.auth


class SecuritySection(Section):
    tls: Literal["auto", "files", "plaintext"] = Field(
        "auto", description="auto: `ember up` makes a throwaway CA and one certificate per service in the run "
                            "folder; files: mounted certificates under tls_dir; plaintext: no TLS, no peer "
                            "authorization, no KV frame MAC (only when said here)")
    tls_dir: str | None = Field(None, description="files: each service's folder of ca.crt, tls.crt, tls.key (and "
                                                  "kv-mac.key for prefill and decode); `{name}` stands for the "
                                                  "service's name; EMBER_TLS_DIR overrides it")
    kv_mac: Literal["required", "off"] = Field(
        "required", description="with TLS on, prefill and decode sign and verify every KV frame with the "
                                "kv-mac.key in their TLS folder (`ember up` and `ember certs` write it); required: "
                                "a missing one is a start-up error; off: run without it, KV frames unsigned and "
                                "imported unchecked (a warning at start). plaintext never signs")
    metrics: MetricsAuthSection = Field(MetricsAuthSection(), description="who may scrape each service's "
                                                                          "/metrics")

    @model_validator(mode="after")
    def _files_need_a_dir(self):
        if self.tls == "files" and not self.tls_dir:
            raise ValueError("security.tls_dir: required with `tls: files` (e.g. /etc/ember/tls/{name}), or use "
                             "`tls: auto` to let `ember up` make certificates")
        return self

    @model_validator(mode="after")
    def _metrics_auth(self):
        m = self.metrics
        if m.auth == "mtls" and self.tls == "plaintext":
            raise ValueError("security.metrics.auth: mtls needs the cluster's certificates, but security.tls is "
                             "plaintext; use token (with token_file) or none")
        if m.auth == "token" and m.token_file is None:
            raise ValueError("security.metrics.token_file: required with `auth: token` (a file holding the bearer "
                             "token)")
        if m.auth != "token" and m.token_file is not None:
            raise ValueError(f"security.metrics.token_file: set only with `auth: token` (auth is {m.auth!r})")
        return self


class ClusterConfig(Section):
    model: str = Field(DEFAULT_MODEL, description="a named model (fetched into the user cache on first use) or "
                                                  "a GGUF file / HF folder, relative to this file")
    router: RouterSection = RouterSection()
    placement: PlacementSection = PlacementSection()
    sites: list[Site] = Field(min_length=1)
    links: list[Link] = []
    regions: list[UserRegion] = []
    hardware: dict[str, HardwareProfile] = {}
    engine: EngineSection = EngineSection()
    kvstore: KVStoreSection = KVStoreSection()
    directory: DirectorySection = DirectorySection()
    security: SecuritySection = SecuritySection()

    _by_name: dict[str, Site] = PrivateAttr(default_factory=dict)
    _links: dict[tuple[str, str], Link] = PrivateAttr(default_factory=dict)
    _base: Path = PrivateAttr(default_factory=Path.cwd)  # relative paths resolve against it (the file's folder)

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
        p = self.placement
        for field, role in (("prefill_site", "prefill"), ("decode_site", "decode")):
            value = getattr(p, field)
            if value is not None and (value not in self._by_name or not self._by_name[value].has(role)):
                raise ValueError(f"placement.{field}: {value!r} must name a site with the {role} role; {known}")
        if not self.regions:  # nothing to choose between: placement is fixed
            fixed = {"policy": "fixed"}
            for field, role in (("prefill_site", "prefill"), ("decode_site", "decode")):
                having = [s.name for s in self.sites if s.has(role)]
                if getattr(p, field) is None and len(having) > 1:
                    raise ValueError(f"placement.{field}: required when no `regions` are configured and several "
                                     f"sites have the {role} role ({', '.join(having)}): name one")
                if getattr(p, field) is None and having:
                    fixed[field] = having[0]
            self.placement = p = p.model_copy(update=fixed)
        if self.router.site is None:
            self.router = self.router.model_copy(update={"site": p.decode_site or names[0]})
        elif self.router.site not in self._by_name:
            raise ValueError(f"router.site: unknown site {self.router.site!r}; {known}")
        self._links = {}
        for link in self.links:
            self._links[(link.a, link.b)] = self._links[(link.b, link.a)] = link
        return self

    @model_validator(mode="after")
    def _no_plaintext_redis(self):
        url = self.directory.url
        if url is not None and url.startswith("redis://") and self.security.tls != "plaintext":
            raise ValueError(f"directory.url: {url!r} is a plaintext hop in a cluster whose security.tls is "
                             f"{self.security.tls!r}: use rediss:// (redis-server's TLS, `--tls-port`) with "
                             "directory.users, or a unix:// socket; docs/deploy.md, Security")
        return self

    # -- lookups ---------------------------------------------------------------------------
    def site(self, name: str) -> Site:
        if name not in self._by_name:
            raise ValueError(f"unknown site {name!r}; known sites: {', '.join(self._by_name)}")
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

    def model_path(self) -> Path:
        """The model's file or folder: a named model's cache path, else relative to the config file."""
        return resolve_model(self.model, self._base)

    def directory_url(self) -> str:
        """What kvstores publish to: Redis, or the router's in-memory directory."""
        return self.directory.url or f"grpc://{self.router.internal}"

    def host_of(self, site: str) -> str | None:
        """The machine `site` runs on: its `host`; unset, `localhost` when every address it has is a
        loopback one (a one-host cluster `ember up` runs); else None (a machine of its own)."""
        s = self.site(site)
        if s.host is not None:
            return s.host
        from ember.util.cpus import is_loopback
        addresses = [a for a in (s.kvstore, s.kvstore_data, *s.prefill, *s.decode) if a]
        return "localhost" if addresses and all(is_loopback(a) for a in addresses) else None

    def shares_host(self, a: str, b: str) -> bool:
        """Whether sites a and b run on one machine (their engines share its cores)."""
        host = self.host_of(a)
        return a == b or (host is not None and host == self.host_of(b))

    def engine_sites(self, role: str) -> list[Site]:
        """Sites that run an engine of `role`: every site with the role when placement can choose,
        else only the fixed one."""
        fixed = getattr(self.placement, f"{role}_site")
        return [s for s in self.sites if s.has(role) and (self.regions or s.name == fixed)]
