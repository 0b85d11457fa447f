"""The prefill work this router has sent to each site and not yet seen answered, in seconds (the
placer's estimates), by tenant.

`totals` is the placer's `Load.prefill_queue_s`: every tenant's work at a site. A request does not
wait for all of it: the engines serve prefill fairly across tenants (a tenant holding fewer seats
per weight goes first, ember/engine/scheduler.py), so `ahead_of` prices a site's queue as what a
new request of a tenant waits for under weighted fair queueing:

    ahead(t) = q_t + sum over the other tenants u of min(q_u, q_t * w_u / w_t) + half a step

(its tenant's own queued work; what the others are served meanwhile at their weights; what is
left, on average, of a step that has begun, which is not preempted: at most the rest). A tenant
alone at a site waits for its whole queue, as before: one tenant's burst no longer prices every
other tenant off a site.
"""
from __future__ import annotations

from collections.abc import Callable


class PrefillQueues:
    def __init__(self, totals: dict[str, float]):
        self.totals = totals
        self._tenants: dict[str, dict[str, list[float]]] = {}  # site -> tenant -> [seconds, weight]

    def add(self, site: str, tenant: str, weight: float, seconds: float) -> None:
        self.totals[site] = self.totals.get(site, 0.0) + seconds
        entry = self._tenants.setdefault(site, {}).setdefault(tenant, [0.0, weight])
        entry[0] += seconds
        entry[1] = weight

    def remove(self, site: str, tenant: str, seconds: float) -> None:
        self.totals[site] = max(0.0, self.totals.get(site, 0.0) - seconds)
        at = self._tenants.get(site, {})
        entry = at.get(tenant)
        if entry is not None:
            entry[0] -= seconds
            if entry[0] <= 1e-9:
                del at[tenant]

    def ahead_of(self, tenant: str, weight: float, step_s: Callable[[str], float]) -> dict[str, float]:
        """Per site, the seconds of queued prefill a new request of `tenant` waits for; `step_s(site)`:
        the longest step there (one the engine has begun is not preempted: half of it is left on average)."""
        view = {}
        for site, total in self.totals.items():
            at = self._tenants.get(site)
            if not at or (len(at) == 1 and tenant in at):
                view[site] = total
                continue
            mine = at[tenant][0] if tenant in at else 0.0
            fair = mine + sum(min(q, mine * w / max(weight, 1e-9)) for u, (q, w) in at.items() if u != tenant)
            view[site] = min(total, fair + min(total - fair, step_s(site) / 2))
        return view
