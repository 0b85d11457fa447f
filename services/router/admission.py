"""Who gets in at the router: a weighted fair share of its capacity per tenant, and each tenant's
quotas (torch-free, no I/O: RouterService calls it, tests drive it with a fake clock).

Capacity (`router.max_inflight`) is shared max-min fairly by weight among the tenants that have
requests in flight: while the router is below capacity anyone is admitted; at capacity a request
is still admitted when its tenant holds less than its share,

    share(t) = max_inflight * weight(t) / sum of the weights of the tenants in flight (t included),

and refused otherwise. So a tenant's burst fills what others leave idle, but once others come it
is the burst that is refused, never a tenant inside its share: one tenant's burst delays another
by at most that tenant's share of the engines. (The router overshoots its capacity by at most the
shares of tenants that arrived while it was full: a request already streaming is never cut to
make room.) With one tenant (no API keys) this is the plain limit it always was.

Quotas, from the keys file (services/router/auth.py), each optional per tenant:
- `max_inflight`: its requests at once;
- `requests_per_s`: a token bucket holding one second of requests (the burst it allows);
- `tokens_per_min`: a bucket of a minute's tokens; a request is charged its prompt plus its
  `max_tokens` when admitted, and refunded what it did not generate when it ends (OpenAI's
  accounting). A request larger than the whole minute is let through when the bucket is full,
  leaving it in debt, so it is slow rather than impossible.

A refusal is `Throttled`: its reason (a metric label) and when to come back. For the two buckets
that is when the bucket will hold what the request needs, computed from the quota (honoured, the
retry succeeds); for concurrency it is the router's `retry_after_s`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

REASONS = ("capacity", "max_inflight", "requests_per_s", "tokens_per_min")


@dataclass(frozen=True)
class TenantPolicy:
    weight: float = 1.0
    max_inflight: int | None = None
    requests_per_s: float | None = None
    tokens_per_min: float | None = None

    def __post_init__(self):
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"weight must be a positive number, got {self.weight!r}")
        if self.max_inflight is not None and not (isinstance(self.max_inflight, int) and self.max_inflight > 0):
            raise ValueError(f"max_inflight must be a positive integer, got {self.max_inflight!r}")
        for name in ("requests_per_s", "tokens_per_min"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")


class Throttled(Exception):
    """A request refused at admission: `reason` (one of REASONS), `retry_after_s`."""

    def __init__(self, reason: str, retry_after_s: float, message: str):
        super().__init__(message)
        self.reason, self.retry_after_s = reason, retry_after_s


class TokenBucket:
    """`rate` units a second, holding at most `capacity`."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float]):
        self.rate, self.capacity, self.clock = rate, capacity, clock
        self.level, self.updated = capacity, clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_s(self, n: float) -> float:
        """Seconds until `n` can be taken (0: now). More than the capacity needs a full bucket."""
        self._refill()
        need = min(n, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, n: float) -> None:
        self._refill()
        self.level -= n  # (may go below zero: a request larger than the capacity leaves a debt)

    def refund(self, n: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + n)


class _Tenant:
    def __init__(self, policy: TenantPolicy, clock):
        self.policy, self.inflight = policy, 0
        self.requests = TokenBucket(policy.requests_per_s, max(1.0, policy.requests_per_s), clock) \
            if policy.requests_per_s else None
        self.tokens = TokenBucket(policy.tokens_per_min / 60, policy.tokens_per_min, clock) \
            if policy.tokens_per_min else None


class Admission:
    """The router's admission: `admit` / `charge` / `refund` / `release` around each request."""

    def __init__(self, capacity: int, policies: dict[str, TenantPolicy] | None = None,
                 default: TenantPolicy = TenantPolicy(), retry_after_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.capacity, self.retry_after_s, self.clock = capacity, retry_after_s, clock
        self.policies, self.default = dict(policies or {}), default
        self._tenants: dict[str, _Tenant] = {}
        self.inflight = 0

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant(self.policies.get(name, self.default), self.clock)
        return t

    def weight(self, name: str) -> float:
        return self.policies.get(name, self.default).weight

    def share(self, name: str) -> float:
        """`name`'s fair share of the capacity among the tenants in flight now (and it)."""
        active = sum(t.policy.weight for n, t in self._tenants.items() if t.inflight > 0 and n != name)
        w = self.weight(name)
        return self.capacity * w / (active + w)

    def inflight_of(self, name: str) -> int:
        t = self._tenants.get(name)
        return t.inflight if t is not None else 0

    def admit(self, name: str) -> None:
        """Count a request of tenant `name` in, or raise Throttled."""
        t = self._tenant(name)
        p = t.policy
        if p.max_inflight is not None and t.inflight >= p.max_inflight:
            raise Throttled("max_inflight", self.retry_after_s,
                            f"tenant at its limit of {p.max_inflight} requests in flight; retry after "
                            f"{self.retry_after_s:g} s")
        if self.inflight >= self.capacity and t.inflight >= self.share(name):
            raise Throttled("capacity", self.retry_after_s,
                            f"the router is at its admission limit ({self.capacity} requests in flight) and this "
                            f"tenant holds its share ({t.inflight} of {self.share(name):.3g}); retry after "
                            f"{self.retry_after_s:g} s")
        if t.requests is not None:
            wait = t.requests.wait_s(1)
            if wait > 0:
                raise Throttled("requests_per_s", wait, f"over the tenant's quota of {p.requests_per_s:g} "
                                                        f"requests/s; retry after {wait:.3g} s")
            t.requests.take(1)
        t.inflight += 1
        self.inflight += 1

    def charge(self, name: str, tokens: int) -> None:
        """Charge an admitted request's tokens (prompt + max_tokens) to its tenant's tokens/min quota,
        or raise Throttled (the request then leaves: `release` it)."""
        t = self._tenant(name)
        if t.tokens is None:
            return
        wait = t.tokens.wait_s(tokens)
        if wait > 0:
            raise Throttled("tokens_per_min", wait,
                            f"over the tenant's quota of {t.policy.tokens_per_min:g} tokens/min (this request "
                            f"needs {tokens}: its prompt and max_tokens); retry after {wait:.3g} s")
        t.tokens.take(tokens)

    def refund(self, name: str, tokens: int) -> None:
        """Give back charged tokens a request did not use (max_tokens it did not generate)."""
        t = self._tenants.get(name)
        if t is not None and t.tokens is not None and tokens > 0:
            t.tokens.refund(tokens)

    def release(self, name: str) -> None:
        t = self._tenants[name]
        t.inflight -= 1
        self.inflight -= 1
