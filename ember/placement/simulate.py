"""Discrete-event simulation of a geo-distributed agentic trace (torch-free), through the same
`Placer` the router runs, with the config's hardware profiles and links.

Model, per site: prefill is one FIFO server at the profile's speed (a request waits for the
work queued before it); decode runs a continuous batch whose step time follows the profile
(a sequence's TPOT is fixed by the batch it joins); KV is cached per session prefix in an
LRU of the site's `kv_cache_tokens`. The router sits at the decode site, so
TTFT = user RTT + (router -> prefill site RTT if remote) + queue wait + prefill time;
the KV transfer then delays the second token; e2e = TTFT + transfer + (n - 1) x TPOT.
Goodput (DistServe): requests per second that meet both the TTFT and the TPOT target.
"""
from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from ember.config.schema import ClusterConfig
from ember.placement.policy import Load, NoCapacity, Placer, Request
from ember.placement.trace import TraceRequest


class _QueueView:
    """Seconds of prefill work queued at each site at `now` (a Load.prefill_queue_s stand-in
    computed on demand: 300 sites x 1M requests is too many to refresh eagerly)."""

    def __init__(self, busy_until: dict[str, float]):
        self.busy_until, self.now = busy_until, 0.0

    def get(self, site: str, default: float = 0.0) -> float:
        return max(0.0, self.busy_until.get(site, 0.0) - self.now)


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
                 slo_tpot_s: float = 0.05, kv_cache_tokens: int = 4_000_000):
        if policy is not None:
            config = config.model_copy(update={"placement": config.placement.model_copy(update={"policy": policy})})
        self.config, self.policy = config, config.placement.policy
        self.placer = Placer(config)
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.block_size = config.engine.block_size
        self.busy_until: dict[str, float] = {}
        self.queue = _QueueView(self.busy_until)
        self.load = Load(prefill_queue_s=self.queue, decode_running={})  # type: ignore[arg-type]
        self.decode_ends: list[tuple[float, str]] = []
        self.user_rtt = {(r.name, x.site): x.rtt_ms / 1e3 for r in config.regions for x in r.reach}
        self.site_cache: dict[str, OrderedDict[str, int]] = {s.name: OrderedDict() for s in config.sites}
        self.site_used: dict[str, int] = {s.name: 0 for s in config.sites}
        self.session_sites: dict[str, dict[str, int]] = {}  # session -> site -> cached prefix tokens
        self.kv_cache_tokens = kv_cache_tokens

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

    def run(self, trace: Iterable[TraceRequest]) -> Report:
        start_wall = time.perf_counter()
        ttft, tpot, e2e = [], [], []
        rejected = link_bytes = remote = 0
        first_t = last_t = None
        bs, placer, load, running = self.block_size, self.placer, self.load, self.load.decode_running
        for r in trace:
            now = r.t
            first_t = now if first_t is None else first_t
            last_t = now
            while self.decode_ends and self.decode_ends[0][0] <= now:
                _, site = heapq.heappop(self.decode_ends)
                running[site] -= 1
            held = self.session_sites.get(r.session, {})
            cached = {s: min(tokens, r.prompt_tokens) // bs for s, tokens in held.items()}
            self.queue.now = now
            try:
                d = placer.place(Request(r.prompt_tokens, r.output_tokens, r.region, cached, r.session), load,
                                 keep_candidates=False)
            except NoCapacity:
                rejected += 1
                continue
            p, decode, est = d.prefill_site, d.decode_site, d.estimate
            begin = max(now, self.busy_until.get(p, 0.0))
            self.busy_until[p] = begin + est.prefill_s
            hop = 0.0 if p == decode else self.placer.routes[(p, decode)].rtt_s
            first = self.user_rtt.get((r.region, decode), 0.0) + hop + (begin - now) + est.prefill_s
            step = placer.profiles[decode].step_s(running.get(decode, 0) + 1)
            total = first + est.link_s + max(0, r.output_tokens - 1) * step
            running[decode] = running.get(decode, 0) + 1
            heapq.heappush(self.decode_ends, (now + total, decode))
            ttft.append(first)
            tpot.append(step)
            e2e.append(total)
            if p != decode:
                remote += 1
                link_bytes += est.kv_bytes
            self._cache(p, r.session, r.prompt_tokens)
            self._cache(decode, r.session, r.prompt_tokens + r.output_tokens)
        ttft_a, tpot_a, e2e_a = np.array(ttft), np.array(tpot), np.array(e2e)
        duration = max(1e-9, (last_t or 0) - (first_t or 0))
        good = int(np.count_nonzero((ttft_a <= self.slo_ttft_s) & (tpot_a <= self.slo_tpot_s)))
        n = len(ttft)
        return Report(self.policy, n, rejected, duration, time.perf_counter() - start_wall, _percentiles(ttft_a),
                      _percentiles(tpot_a), _percentiles(e2e_a), good / duration, good / max(1, n + rejected),
                      link_bytes, remote / max(1, n))
