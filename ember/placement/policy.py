"""Where a request prefills and decodes (torch-free): the code the router and the simulator share.

Decode goes to the edge site nearest the user (lowest RTT from the user's region) that has
room, spilling to the next nearest; session affinity keeps a conversation where its KV is.
Prefill goes to the site that minimises

    queue(S) + prefill_time(uncached tokens at S) + link(S -> D)
    link = RTT + new KV bytes / (bandwidth x 1/(1 - codec saving)); streamed (kvstore.stream_prefill):
           RTT/2 + the last chunk's bytes, or what the link cannot move during the prefill if more

with the decode site itself a candidate (no link): short or mostly cached turns prefill at
the edge, long uncached ones go central. Baselines for the simulator: `central` (prefill and
decode at the best central site), `edge` (both at the nearest edge site); `fixed` uses the
config's prefill_site / decode_site.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain

from ember.config.derived import kv_bytes_per_token, kv_element_bytes, link_codec_saving
from ember.config.schema import ClusterConfig, HardwareProfile
from ember.engine.scheduler import STREAM_TAIL_TOKENS  # (torch-free: the schedule streaming prices)


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    output_tokens: int = 0                 # expected; 0: the policy's default
    region: str | None = None
    cached_blocks: dict[str, int] = field(default_factory=dict)  # leading prompt blocks each site holds
    session_id: str = ""


@dataclass
class Load:
    """A view of every site now: seconds of prefill work queued, decode sequences running."""
    prefill_queue_s: dict[str, float] = field(default_factory=dict)
    decode_running: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimate:
    site: str
    queue_s: float
    prefill_s: float
    link_s: float
    uncached_tokens: int
    kv_bytes: int

    @property
    def total_s(self) -> float:
        return self.queue_s + self.prefill_s + self.link_s


@dataclass(frozen=True)
class Decision:
    prefill_site: str
    decode_site: str
    estimate: Estimate
    candidates: tuple[Estimate, ...]
    reason: str
    colocated: bool = False  # the decode worker prefills itself (sites on one host; no Prefill call)

    def summary(self) -> str:
        e = self.estimate
        return (f"prefill@{self.prefill_site} decode@{self.decode_site} ({self.reason}): "
                f"queue {e.queue_s * 1e3:.0f} ms + prefill {e.prefill_s * 1e3:.0f} ms ({e.uncached_tokens} tokens) "
                f"+ link {e.link_s * 1e3:.0f} ms ({e.kv_bytes / 1e6:.1f} MB)")


_MAX_SESSIONS = 1 << 17
# Moving KV between engines on one host (the shared-memory arena, verify, import), bytes/s: the
# same-host read (~5.4 GB/s, BENCHMARKS.md) halved for the frames' checks and the copy into the pool.
SAME_HOST_BYTES_PER_S = 2.5e9


class NoCapacity(RuntimeError):
    """No reachable site can take the request."""


@dataclass(frozen=True)
class _Route:
    rtt_s: float
    bytes_per_s: float  # effective, codec included


class Placer:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.policy = config.placement
        # read once (settings are pydantic sections; the simulator places a million requests)
        self.kind, self.affinity_on = self.policy.policy, self.policy.session_affinity
        self.default_output, self.heavy_ratio = self.policy.default_output_tokens, self.policy.decode_heavy_ratio
        self.slack_s = self.policy.pool_slack_ms / 1e3
        self.kv_bytes_per_token = kv_bytes_per_token(config)
        # a streamed remote prefill (kvstore.stream_prefill) ships its KV while it computes: only its
        # last chunk's (STREAM_TAIL_TOKENS), or what the link cannot keep up with, trails it
        self.tail_bytes = STREAM_TAIL_TOKENS * self.kv_bytes_per_token if config.kvstore.stream_prefill else None
        self.block_size = config.engine.block_size
        self.profiles: dict[str, HardwareProfile] = {s.name: config.profile(s.name) for s in config.sites}
        self._speed = {name: (p.prefill_tokens_per_s, p.prefill_context_tokens) for name, p in self.profiles.items()}
        self.capacity = {s.name: config.decode_capacity(s.name) for s in config.sites}
        self.tier = {s.name: s.tier for s in config.sites}
        self.pool = {s.name: self.profiles[s.name].pool for s in config.sites}
        self.prefill_sites = [s.name for s in config.sites if s.has("prefill")]
        decode_sites = [s.name for s in config.sites if s.has("decode")]
        # per region: decode sites by RTT from the user
        self.nearest = {r.name: sorted((x.rtt_ms / 1e3, x.site) for x in r.reach if x.site in decode_sites)
                        for r in config.regions}
        self.routes: dict[tuple[str, str], _Route] = {}
        width = kv_element_bytes(config)
        for link in config.links:  # a link's KV bytes shrink by what the codec saves where it is used there
            # (a streamed push crosses raw: the kvstores' codec applies to pulls)
            ratio = 1.0 if self.tail_bytes is not None else 1 / (1 - link_codec_saving(config, link.bandwidth_gbps,
                                                                                        width))
            route = _Route(link.rtt_ms / 1e3, link.bandwidth_gbps * 1e9 / 8 * ratio)
            self.routes[(link.a, link.b)] = self.routes[(link.b, link.a)] = route
        # per decode site: prefill candidates that can ship KV to it (itself first, if it prefills)
        self.feeders = {d: ([d] if d in self.prefill_sites else []) +
                        [p for p in self.prefill_sites if (p, d) in self.routes] for d in decode_sites}
        # the same, flattened for the hot loop and nearest first (the decode site itself leads): site ->
        # (prefill tok/s, context scale, rtt s, s per KV byte, the least its link can cost: a share of the RTT)
        floor = 1.0 if self.tail_bytes is None else 0.5  # pulled: the RTT; streamed: half of it at least
        self._feeder_terms: dict[str, dict[str, tuple[float, float, float, float, float]]] = {
            d: dict(sorted(((p, (self.profiles[p].prefill_tokens_per_s, self.profiles[p].prefill_context_tokens,
                                 0.0 if p == d else self.routes[(p, d)].rtt_s,
                                 0.0 if p == d else 1 / self.routes[(p, d)].bytes_per_s,
                                 0.0 if p == d else self.routes[(p, d)].rtt_s * floor)) for p in feeders),
                           key=lambda item: item[1][2]))
            for d, feeders in self.feeders.items()}
        self._fastest_tps = {d: max((t[0] for t in terms.values()), default=1.0)
                             for d, terms in self._feeder_terms.items()}
        self._widest_context = {d: max((t[1] for t in terms.values()), default=1.0)
                                for d, terms in self._feeder_terms.items()}
        # per region: the decode candidates this policy considers (its tier, if the region reaches one)
        tier = {"central": "central", "edge": "edge", "ember": "edge"}.get(self.kind)
        self._candidates = {r: [c for c in near if self.tier[c[1]] == tier] or near for r, near in self.nearest.items()}
        self.affinity: OrderedDict[str, str] = OrderedDict()  # session -> decode site, most recent last
        # engines sharing a machine (ClusterConfig.shares_host): the share of its cores each one's
        # prefill gets, and whether the decode engine may prefill itself (colocated)
        self.core_share = {s.name: _core_share(config, s.name) for s in config.sites}
        self.pinned = {s.name: _pinned(config, s.name) for s in config.sites}

    # -- decode ----------------------------------------------------------------------------
    def _decode_site(self, request: Request, load: Load) -> tuple[str, str]:
        running = load.decode_running
        if request.region is None or request.region not in self.nearest:
            if self.policy.decode_site is None:
                raise NoCapacity(f"unknown user region {request.region!r}; configured regions: "
                                 f"{', '.join(self.nearest)}")
            return self.policy.decode_site, "no region: the configured decode site"
        candidates = self._candidates[request.region]
        if self.affinity_on and request.session_id in self.affinity:
            home = self.affinity[request.session_id]
            if any(s == home for _, s in candidates) and running.get(home, 0) < self.capacity[home]:
                return home, "session affinity"
        capacity = self.capacity
        nearest_rtt, nearest = next(((rtt, s) for rtt, s in candidates if running.get(s, 0) < capacity[s]),
                                    (None, None))
        if nearest is None:
            raise NoCapacity(f"every decode site reachable from region {request.region!r} is full")
        output = request.output_tokens or self.default_output
        if output / max(1, request.prompt_tokens) > self.heavy_ratio:
            slack = nearest_rtt + self.slack_s
            shaped = [s for rtt, s in candidates if rtt <= slack and self.pool[s] == "decode-heavy"
                      and running.get(s, 0) < capacity[s]]
            if shaped:
                return shaped[0], "nearest decode-heavy pool"
        return nearest, "nearest with room" if nearest == candidates[0][1] else "spilled to next nearest"

    # -- prefill ---------------------------------------------------------------------------
    def estimate(self, site: str, decode_site: str, request: Request, load: Load) -> Estimate | None:
        if site == decode_site:
            route = _Route(0.0, float("inf"))
        else:
            route = self.routes.get((site, decode_site))
            if route is None:
                return None  # no link: KV cannot get there
        bs = self.block_size
        cached = min(request.cached_blocks.get(site, 0) * bs, request.prompt_tokens - 1)
        uncached = request.prompt_tokens - cached
        have_at_decode = request.cached_blocks.get(decode_site, 0)
        kv_bytes = max(0, request.prompt_tokens // bs - have_at_decode) * bs * self.kv_bytes_per_token
        tps, context = self._speed[site]
        prefill_s = uncached / tps * (1 + (cached + uncached / 2) / context)  # HardwareProfile.prefill_s, inlined
        link_s = 0.0 if site == decode_site else \
            self.exposed_s(kv_bytes, 1 / route.bytes_per_s, prefill_s, route.rtt_s)
        return Estimate(site, load.prefill_queue_s.get(site, 0.0), prefill_s, link_s, uncached,
                        0 if site == decode_site else kv_bytes)

    def exposed_s(self, kv_bytes: int, s_per_byte: float, prefill_s: float, rtt_s: float) -> float:
        """How long after its prefill a request's KV is at the decode site: pulled once the first
        token is back, an RTT and all of it; or, streamed (pushed as the chunks finish), half an RTT
        and the last chunk's share or what the link could not move during the prefill, if longer."""
        wire = kv_bytes * s_per_byte
        if self.tail_bytes is None:
            return rtt_s + wire
        return rtt_s / 2 + max(min(kv_bytes, self.tail_bytes) * s_per_byte, wire - prefill_s)

    def _cheapest(self, decode_site: str, feeders: list[str], request: Request, load: Load) -> Estimate | None:
        """The estimate(...) of the feeder with the lowest total_s: the same arithmetic (exposed_s and
        HardwareProfile.prefill_s inlined), for the simulator's million requests. The sites holding
        a prefix are tried first, then the rest nearest first, until not even an RTT's share of the
        link and an uncached prefill at the fastest speed fits under the best so far."""
        bs, prompt, cached_blocks = self.block_size, request.prompt_tokens, request.cached_blocks
        kv_bytes = max(0, prompt // bs - cached_blocks.get(decode_site, 0)) * bs * self.kv_bytes_per_token
        tail = self.tail_bytes
        tail_kv = 0 if tail is None else min(kv_bytes, tail)
        queue = load.prefill_queue_s.get
        best_site, best, parts = None, float("inf"), (0.0, 0.0, 0.0, 0)
        allowed = set(feeders) if len(feeders) != len(self.feeders[decode_site]) else None
        terms = self._feeder_terms[decode_site]
        held = [(site, terms[site]) for site in cached_blocks if site in terms]
        n_held, cut = len(held), best  # cut: the best so far less the least any uncached site computes
        uncached_floor = prompt / self._fastest_tps[decode_site] * (1 + prompt / 2 / self._widest_context[decode_site])
        for i, (site, (tps, context, rtt_s, s_per_byte, least_link)) in enumerate(chain(held, terms.items())):
            if i >= n_held:  # (the rest, nearest first)
                if least_link >= cut:  # no uncached site further on can cost less
                    break
                if site in cached_blocks:
                    continue
            if allowed is not None and site not in allowed:
                continue
            cached = min(cached_blocks.get(site, 0) * bs, prompt - 1)
            new = prompt - cached
            prefill = new / tps * (1 + (cached + new / 2) / context)
            if least_link + prefill >= best:  # (the queue is never negative)
                continue
            if rtt_s or s_per_byte:
                wire = kv_bytes * s_per_byte
                link = rtt_s + wire if tail is None else rtt_s / 2 + max(tail_kv * s_per_byte, wire - prefill)
            else:
                link = 0.0
            queued = queue(site, 0.0)
            total = queued + prefill + link
            if total < best:
                best_site, best, parts = site, total, (queued, prefill, link, new)
                cut = best - uncached_floor
        if best_site is None:
            return None
        return Estimate(best_site, *parts, 0 if best_site == decode_site else kv_bytes)

    # -- one host: colocated or disaggregated ---------------------------------------------------
    def shared_host(self, request: Request, prefill_site: str, decode_site: str, load: Load) -> Decision | None:
        """Prefill and decode sites on one machine: price prefill at the prefill worker (its share of
        the cores, then the KV moved and imported on the host) against the decode worker prefilling
        itself (colocated: its cache holds the whole conversation, answers included; nothing moves;
        its running decodes take steps too); the cheaper for this request, or None when the sites
        do not share a host."""
        if prefill_site == decode_site or not self.config.shares_host(prefill_site, decode_site):
            return None
        apart = self._host_estimate(prefill_site, decode_site, request, load)
        together = self._host_estimate(decode_site, decode_site, request, load)
        forced = self.policy.shared_host
        best = apart if forced == "disaggregated" else together if forced == "colocated" else \
            min((together, apart), key=lambda e: e.total_s)  # (a tie: colocated, nothing moves)
        how = ("colocated on the decode worker" if best is together else "disaggregated") + \
            ("" if forced == "auto" else f" (placement.shared_host: {forced})")
        return Decision(best.site, decode_site, best, (apart, together),
                        f"prefill and decode sites share a host: {how}", colocated=best is together)

    def _host_estimate(self, site: str, decode_site: str, request: Request, load: Load) -> Estimate:
        bs = self.block_size
        cached = min(request.cached_blocks.get(site, 0) * bs, request.prompt_tokens - 1)
        uncached = request.prompt_tokens - cached
        others_busy = sum(1 for s in self.tier if s != site and self.config.shares_host(s, site)
                          and (load.prefill_queue_s.get(s, 0.0) > 0 or load.decode_running.get(s, 0) > 0))
        share = self.core_share[site] / (1 if self.pinned[site] else 1 + others_busy)
        prefill_s = self.profiles[site].prefill_s(uncached, cached) / max(share, 1e-3)
        queue_s = load.prefill_queue_s.get(site, 0.0)
        if site == decode_site:  # its decodes run beside: one decode step per prefill chunk at most
            chunks = -(-uncached // self.config.engine.max_num_batched_tokens)
            queue_s += chunks * self.profiles[site].step_s(load.decode_running.get(site, 0)) \
                if load.decode_running.get(site, 0) else 0.0
            return Estimate(site, queue_s, prefill_s, 0.0, uncached, 0)
        have = request.cached_blocks.get(decode_site, 0)
        kv_bytes = max(0, request.prompt_tokens // bs - have) * bs * self.kv_bytes_per_token
        return Estimate(site, queue_s, prefill_s, kv_bytes / SAME_HOST_BYTES_PER_S, uncached, kv_bytes)

    def place(self, request: Request, load: Load, keep_candidates: bool = True) -> Decision:
        """The decision; `keep_candidates=False` skips building every candidate's Estimate (the
        simulator's hot path), keeping only the winner's."""
        if self.kind == "fixed" or (not self.nearest and request.region is None):
            d, p = self.policy.decode_site, self.policy.prefill_site
            host = self.shared_host(request, p, d, load)
            if host is not None:
                return host
            est = self.estimate(p, d, request, load) or Estimate(p, 0.0, 0.0, 0.0, request.prompt_tokens, 0)
            return Decision(p, d, est, (est,), "fixed placement")
        decode_site, why = self._decode_site(request, load)
        feeders = self.feeders[decode_site]
        if self.kind in ("central", "edge") and decode_site in self.prefill_sites:
            feeders = [decode_site]
        if keep_candidates:
            estimates = tuple(e for s in feeders if (e := self.estimate(s, decode_site, request, load)) is not None)
        else:
            cheapest = self._cheapest(decode_site, feeders, request, load)
            estimates = () if cheapest is None else (cheapest,)
        if not estimates:
            raise NoCapacity(f"no prefill site has a link to decode site {decode_site!r}")
        best = min(estimates, key=lambda e: e.total_s)
        if request.session_id:
            self.affinity[request.session_id] = decode_site
            self.affinity.move_to_end(request.session_id)
            if len(self.affinity) > _MAX_SESSIONS:
                self.affinity.popitem(last=False)
        where = "at the decode site" if best.site == decode_site else "remote"
        return Decision(best.site, decode_site, best, estimates, f"{self.kind}: decode {why}; prefill {where}")


def _engine_cores(config: ClusterConfig, role: str, site: str) -> tuple[int, bool]:
    """(cores one `role` engine of `site` computes on, whether they are its own: pinned)."""
    from ember.config.services import host_cpu_sets
    from ember.util.cpus import host_cpus, parse_cpus
    e = config.engine.for_role(role)
    host = len(host_cpus())
    cpus = e.cpus if e.cpus != "auto" else host_cpu_sets(config).get((role, site, 0))
    if cpus:
        return len(parse_cpus(cpus)), True
    return min(host, e.threads or host), False


def _core_share(config: ClusterConfig, site: str) -> float:
    """The share of its host's cores a site's prefill runs on: its prefill engine's, else (a decode
    site prefilling itself) its decode engine's; 1 for a site on hardware of its own."""
    from ember.util.cpus import host_cpus
    s = config.site(site)
    if config.host_of(site) is None or not (s.has("prefill") or s.has("decode")):
        return 1.0
    cores, _ = _engine_cores(config, "prefill" if s.has("prefill") else "decode", site)
    return cores / len(host_cpus())


def _pinned(config: ClusterConfig, site: str) -> bool:
    s = config.site(site)
    if config.host_of(site) is None or not (s.has("prefill") or s.has("decode")):
        return True
    return _engine_cores(config, "prefill" if s.has("prefill") else "decode", site)[1]
