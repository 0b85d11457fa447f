"""Discrete-event simulation of a geo-distributed agentic trace (torch-free), through the same
`Placer` the router runs.

Two sides, kept apart so that "the policy wins" is never true by construction:
- the **placer** sees what a router sees: the prefill seconds it has sent to each site and not
  yet heard back about (the sum of its own estimates, as RouterService keeps it), the streams
  running at each site, and which site caches which prefix;
- the **hardware** (ember.placement.hardware) decides what everything really takes: FIFO
  prefill workers at the profile's speed with the site's actual cache, a continuous decode
  batch whose step time follows the batch, FIFO links at what the kvstores' codec really
  saves, noise of the profile's `service_cv`, and KV streaming as the engine does it
  (kvstore.stream_prefill: each chunk's KV leaves as it finishes; the last chunk's trails).

The router sits at `router_site` when given (a lab cluster's one router), else at each
request's decode site (an edge router near its users). TTFT = user RTT (with `user_rtt`) +
router -> prefill site and back + queue wait + prefill. Decode begins when the router's
Decode call reaches the decode site after the first token; a remote decode then pulls the KV
over the link (request leg, wire, data leg) and imports it. TPOT = (last token - first
token) / (n - 1) at the router, the router's definition (the transfer gap included);
e2e = TTFT + (n - 1) x TPOT. Goodput (DistServe): requests per second that meet both the
TTFT and the TPOT target.
"""
from __future__ import annotations

import heapq
import random
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from ember.config.derived import kv_bytes_per_token, kv_element_bytes, kvstore_codec_saving
from ember.config.schema import ClusterConfig
from ember.placement.hardware import DecodeBatch, Link, PrefillWorkers, SharedHost
from ember.placement.policy import Load, NoCapacity, Placer, Request
from ember.placement.trace import TraceRequest


class _RouterQueue:
    """Load.prefill_queue_s as the router keeps it: per site, the estimates of the prefills it sent
    there whose answers are not back yet (work it believes queued, not what the hardware holds).
    `total` is the plain dict the placer reads; `advance(now)` takes out the answers back by then."""

    def __init__(self):
        self.now = 0.0
        self.inflight: list[tuple[float, str, float]] = []  # a heap of (answer back, site, estimate)
        self.total: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def add(self, site: str, back: float, estimate_s: float) -> None:
        heapq.heappush(self.inflight, (back, site, estimate_s))
        self.total[site] = self.total.get(site, 0.0) + estimate_s
        self.count[site] = self.count.get(site, 0) + 1

    def advance(self, now: float) -> None:
        self.now = now
        heap, total, count = self.inflight, self.total, self.count
        while heap and heap[0][0] <= now:
            _, site, estimate_s = heapq.heappop(heap)
            count[site] -= 1
            # (none left: exactly nothing queued, whatever the float sums kept)
            total[site] = max(0.0, total[site] - estimate_s) if count[site] else 0.0


class _RouterStreams:
    """Load.decode_running as the router keeps it: streams whose Decode call has begun (the first
    token is back) and not ended (the hardware's decode batch is played up to now to see which have)."""

    def __init__(self, sim: Simulator):
        self.sim, self.count = sim, {}
        self.starting: list[tuple[float, str]] = []  # (first token at the router, decode site)

    def get(self, site: str, default: int = 0) -> int:
        now, starting, count = self.sim.queue.now, self.starting, self.count
        while starting and starting[0][0] <= now:
            s = heapq.heappop(starting)[1]
            count[s] = count.get(s, 0) + 1
        if site in self.sim.decode:
            self.sim.drain(site, now)
        return count.get(site, default)


@dataclass
class Report:
    policy: str
    requests: int
    rejected: int
    duration_s: float
    wall_s: float
    ttft: dict[str, float]
    tpot: dict[str, float]
    e2e: dict[str, float]
    goodput_rps: float
    slo_attainment: float
    link_bytes: int
    remote_prefill_fraction: float

    def as_dict(self) -> dict:
        return asdict(self)


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {k: float("nan") for k in ("p50", "p90", "p95", "p99", "mean")}
    p50, p90, p95, p99 = np.percentile(values, [50, 90, 95, 99])
    return {"p50": float(p50), "p90": float(p90), "p95": float(p95), "p99": float(p99), "mean": float(values.mean())}


class Simulator:
    def __init__(self, config: ClusterConfig, policy: str | None = None, slo_ttft_s: float = 1.0,
                 slo_tpot_s: float = 0.05, kv_cache_tokens: int = 4_000_000, seed: int = 0,
                 user_rtt: bool = True, router_site: str | None = None):
        if policy is not None:
            config = config.model_copy(update={"placement": config.placement.model_copy(update={"policy": policy})})
        self.config, self.policy = config, config.placement.policy
        self.placer = Placer(config)
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.block_size = config.engine.block_size
        self.kv_bytes_per_token = kv_bytes_per_token(config)
        self.tail_bytes = self.placer.tail_bytes  # (None: the engine does not stream, kvstore.stream_prefill)
        rng = random.Random(seed)
        hosts = {s.host: SharedHost() for s in config.sites if s.host is not None}
        self.prefill = {s.name: PrefillWorkers(config.profile(s.name), len(s.prefill), rng, hosts.get(s.host))
                        for s in config.sites if s.has("prefill")}
        self.decode = {s.name: DecodeBatch(config.profile(s.name), len(s.decode), rng, hosts.get(s.host))
                       for s in config.sites if s.has("decode")}
        width = kv_element_bytes(config)
        self.links: dict[tuple[str, str], Link] = {}
        for link in config.links:
            # a streamed push crosses raw (the kvstores' codec applies to pulls)
            saving = 0.0 if config.kvstore.stream_prefill else kvstore_codec_saving(config, link.bandwidth_gbps, width)
            speed = link.bandwidth_gbps * 1e9 / 8 / (1 - saving)
            cv = config.profile(link.a).service_cv
            self.links[(link.a, link.b)] = Link(link.rtt_ms / 1e3, speed, cv, rng)
            self.links[(link.b, link.a)] = Link(link.rtt_ms / 1e3, speed, cv, rng)
        self.queue = _RouterQueue()
        self.streams = _RouterStreams(self)
        self.load = Load(prefill_queue_s=self.queue.total, decode_running=self.streams)  # type: ignore[arg-type]
        self.user_rtt = {(r.name, x.site): x.rtt_ms / 1e3 for r in config.regions for x in r.reach} \
            if user_rtt else {}
        self.router_site = router_site  # None: at each request's decode site (an edge router near its users)
        self.site_cache: dict[str, OrderedDict[str, int]] = {s.name: OrderedDict() for s in config.sites}
        self.site_used: dict[str, int] = {s.name: 0 for s in config.sites}
        self.session_sites: dict[str, dict[str, int]] = {}  # session -> site -> cached prefix tokens
        self.kv_cache_tokens = kv_cache_tokens
        # per sequence that decodes: (its request's index, first token at the router less the
        # router -> decode leg (so that last_at - this is the router's decode time), tokens after it)
        self.sequences: list[tuple[int, float, int]] = []
        self.ended: dict[int, float] = {}

    def _cache(self, site: str, session: str, tokens: int) -> None:
        lru = self.site_cache[site]
        self.site_used[site] += tokens - lru.get(session, 0)
        lru[session] = tokens
        lru.move_to_end(session)
        self.session_sites.setdefault(session, {})[site] = tokens
        while self.site_used[site] > self.kv_cache_tokens:
            victim, freed = lru.popitem(last=False)
            self.site_used[site] -= freed
            self.session_sites[victim].pop(site, None)

    def _rtt(self, a: str, b: str) -> float:
        link = self.links.get((a, b))
        return link.rtt_s if link is not None else 0.0

    def drain(self, site: str, now: float) -> None:
        """Play `site`'s decode batch up to `now`; the streams that ended leave the router's count."""
        batch = self.decode[site]
        batch.advance(now)
        for sequence, t in batch.finished:
            self.ended[sequence] = t
            self.streams.count[site] -= 1
        batch.finished.clear()

    def run(self, trace: Iterable[TraceRequest]) -> Report:
        start_wall = time.perf_counter()
        ttft, tpot, e2e = [], [], []
        rejected = link_bytes = remote = 0
        first_t = last_t = None
        bs, placer = self.block_size, self.placer
        for r in trace:
            now = r.t
            first_t = now if first_t is None else first_t
            last_t = now
            held = self.session_sites.get(r.session, {})
            cached = {s: min(tokens, r.prompt_tokens) // bs for s, tokens in held.items()}
            self.queue.advance(now)
            try:
                d = placer.place(Request(r.prompt_tokens, r.output_tokens, r.region, cached, r.session), self.load,
                                 keep_candidates=False)
            except NoCapacity:
                rejected += 1
                continue
            p, decode, est = d.prefill_site, d.decode_site, d.estimate
            router = self.router_site or decode
            to_prefill, to_decode = self._rtt(router, p), self._rtt(router, decode)
            have = min(cached.get(p, 0) * bs, r.prompt_tokens - 1)     # what the prefill site really holds
            begin, end = self.prefill[p].serve(now, now + to_prefill / 2, r.prompt_tokens - have, have)
            first_at = end + to_prefill / 2                           # the first token at the router
            self.queue.add(p, first_at, est.prefill_s)                 # what the router adds: its estimate
            ttft.append(self.user_rtt.get((r.region, router), 0.0) + first_at - now)
            tpot.append(0.0)
            e2e.append(ttft[-1])
            landed = asked = first_at + to_decode / 2                  # the Decode call reaches the decode site
            if p != decode:
                remote += 1
                kv = max(0, r.prompt_tokens // bs - cached.get(decode, 0)) * bs * self.kv_bytes_per_token
                link_bytes += kv
                link = self.links[(p, decode)]
                landed = link.transfer(now, asked, kv) if self.tail_bytes is None else \
                    max(asked, link.stream(now, begin, end, kv, self.tail_bytes))
            if r.output_tokens > 1:
                self.decode[decode].join(landed, len(self.sequences), r.output_tokens - 1)
                self.sequences.append((len(ttft) - 1, first_at - to_decode / 2, r.output_tokens - 1))
                heapq.heappush(self.streams.starting, (first_at, decode))
            self._cache(p, r.session, r.prompt_tokens)
            self._cache(decode, r.session, r.prompt_tokens + r.output_tokens)
        self.queue.advance(float("inf"))
        for site in self.decode:  # every stream starts and ends
            self.streams.get(site)
        for sequence, (i, first_at, tokens) in enumerate(self.sequences):
            last_at = self.ended[sequence]
            tpot[i] = (last_at - first_at) / tokens
            e2e[i] += last_at - first_at
        ttft_a, tpot_a, e2e_a = np.array(ttft), np.array(tpot), np.array(e2e)
        duration = max(1e-9, (last_t or 0) - (first_t or 0))
        good = int(np.count_nonzero((ttft_a <= self.slo_ttft_s) & (tpot_a <= self.slo_tpot_s)))
        n = len(ttft)
        return Report(self.policy, n, rejected, duration, time.perf_counter() - start_wall, _percentiles(ttft_a),
                      _percentiles(tpot_a), _percentiles(e2e_a), good / duration, good / max(1, n + rejected),
                      link_bytes, remote / max(1, n))
