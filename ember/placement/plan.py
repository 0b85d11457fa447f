"""`ember plan` (torch-free): a deployment, as small as one worker at a time can make it, of
prefill and decode workers per site that meets the SLO for a target share of a trace's
requests, found by simulating candidate deployments. (A greedy search: no single worker can
go, which is not a proof that no smaller deployment of another shape exists.)

A deployment is the config's sites with a number of prefill workers and decode workers each
(a site's decode capacity scales with its decode workers; a role a site lacks stays absent).
The search:
1. Grow: double every site's workers until the simulator says the SLO share is met (or the
   ceiling is reached: then the trace cannot be served by these sites, and the plan says so).
2. Shrink: take one worker away wherever the SLO share still holds, the biggest counts first
   (a worker whose removal missed is not tried again until the end), until no single worker
   can go: every one-smaller deployment of the final plan is simulated and misses. They are
   reported with the plan, so a reader sees how close each site runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ember.config.schema import ClusterConfig
from ember.placement.simulate import Report, Simulator
from ember.placement.trace import TraceRequest

ROLES = ("prefill", "decode")
Counts = dict[tuple[str, str], int]  # (site, role) -> workers


@dataclass
class Plan:
    counts: Counts
    report: Report
    share: float
    met: bool
    simulations: int
    smaller: list[tuple[tuple[str, str], float]] = field(default_factory=list)  # (site, role) - 1 -> attainment

    def workers(self) -> int:
        return sum(self.counts.values())


def _addresses(base: list[str], n: int, taken: set[str]) -> list[str]:
    """`n` worker addresses: the configured ones, then new ports on the first one's host."""
    out = list(base[:n])
    host, port = base[0].rsplit(":", 1)
    candidate = int(port)
    while len(out) < n:
        candidate = candidate + 1 if candidate < 65535 else 1024
        address = f"{host}:{candidate}"
        if address not in taken:
            taken.add(address)
            out.append(address)
    return out


def sized(config: ClusterConfig, counts: Counts) -> ClusterConfig:
    """The config with `counts` workers per site and role (a valid config: it can be written out)."""
    taken = {a for s in config.sites for a in (*s.prefill, *s.decode, s.kvstore or "", s.kvstore_data or "")}
    data = config.model_dump(mode="json", exclude_none=True)
    for site, original in zip(data["sites"], config.sites):
        for role in ROLES:
            n = counts.get((original.name, role), 0)
            if n:
                site[role] = _addresses(original.workers(role), n, taken)
        n, configured = counts.get((original.name, "decode"), 0), len(original.decode)
        if n and n != configured:  # the site's decode capacity scales with its workers
            site["capacity"] = math.ceil(config.decode_capacity(original.name) * n / max(1, configured))
    return ClusterConfig.model_validate(data)


def current(config: ClusterConfig) -> Counts:
    return {(s.name, role): len(s.workers(role)) for s in config.sites for role in ROLES if s.has(role)}


class Planner:
    def __init__(self, config: ClusterConfig, trace: list[TraceRequest], slo_ttft_s: float, slo_tpot_s: float,
                 share: float = 0.95, policy: str = "ember", max_workers: int = 64):
        self.config, self.trace, self.share, self.policy = config, trace, share, policy
        self.slo_ttft_s, self.slo_tpot_s, self.max_workers = slo_ttft_s, slo_tpot_s, max_workers
        self.simulations = 0

    def simulate(self, counts: Counts) -> Report:
        self.simulations += 1
        return Simulator(sized(self.config, counts), self.policy, self.slo_ttft_s, self.slo_tpot_s).run(self.trace)

    def meets(self, report: Report) -> bool:
        return report.slo_attainment >= self.share

    def _one_fewer(self, counts: Counts, key: tuple[str, str]) -> tuple[Counts, Report]:
        fewer = {**counts, key: counts[key] - 1}
        return fewer, self.simulate(fewer)

    def plan(self) -> Plan:
        counts = current(self.config)
        report = self.simulate(counts)
        while not self.meets(report):  # 1. grow
            grown = {k: min(self.max_workers, 2 * n) for k, n in counts.items()}
            if grown == counts:  # every site and role at the ceiling
                return Plan(counts, report, self.share, False, self.simulations)
            counts = grown
            report = self.simulate(counts)
        missed: set[tuple[str, str]] = set()  # workers whose removal missed the SLO share (since re-checked)
        while True:  # 2. shrink, the biggest counts first
            for key in sorted((k for k, n in counts.items() if n > 1 and k not in missed), key=lambda k: -counts[k]):
                fewer, attempt = self._one_fewer(counts, key)
                if self.meets(attempt):
                    counts, report = fewer, attempt
                    break
                missed.add(key)
            else:  # none could go: check each against the final deployment (a miss earlier may hold now)
                smaller = []
                for key in sorted(k for k, n in counts.items() if n > 1):
                    fewer, attempt = self._one_fewer(counts, key)
                    if self.meets(attempt):
                        counts, report, missed = fewer, attempt, set()
                        break
                    smaller.append((key, attempt.slo_attainment))
                else:
                    return Plan(counts, report, self.share, True, self.simulations, smaller)
