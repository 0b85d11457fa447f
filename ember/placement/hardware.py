"""What the simulated hardware really takes (torch-free): the simulator's ground truth, kept apart
from the placer's estimates (ember.placement.policy), which see only what a router sees.

- Prefill: each site runs `len(site.prefill)` workers. A worker's engine schedules prefill
  chunks FIFO under a token budget, which is a work-conserving FIFO in tokens: one server per
  worker, a request going to the worker that frees first. Service time is the profile's
  `prefill_s(new, cached)` with the site's *actual* cache, times lognormal noise of the
  profile's `service_cv`.
- Decode: each site's sequences form a continuous batch spread over its `len(site.decode)`
  workers. Every running sequence gains one token per step and a step takes
  `step_s(sequences per worker)` (noisy), so a sequence's TPOT follows the batch as others
  join and leave. Tracked with a step clock: a sequence joining at step S with n tokens to go
  leaves at step S + n, whatever the batch does in between.
- Links: one wire per direction; a transfer takes RTT + bytes / (bandwidth x what the kvstores'
  codec really saves there), in the first stretch of the wire left idle by the transfers
  booked before it. With KV streaming (kvstore.stream_prefill: what the engine does by default)
  the bytes leave as the prefill's chunks finish: only the last chunk's share (`tail_bytes`)
  and whatever the link cannot keep up with trail the prefill.
- Shared hosts: sites that name the same `host` share one machine (a one-host lab cluster);
  an engine there runs at 1/k of its speed while k engines of that host are busy (k taken
  when a prefill starts and at every decode batch change: a first-order processor share).
"""
from __future__ import annotations

import bisect
import heapq
import math
import random

import numpy as np

from ember.config.schema import HardwareProfile


class Noise:
    """Multiplicative noise factors with mean 1 and coefficient of variation `cv` (lognormal),
    drawn in batches (the simulator draws one per event, a few million a run) that start small
    and double (most of a big topology's links carry a few transfers)."""

    MAX_BATCH = 4096

    def __init__(self, cv: float, rng: random.Random):
        sigma2 = math.log1p(cv * cv)
        self.mu, self.sigma = -sigma2 / 2, math.sqrt(sigma2)
        self.generator = np.random.default_rng(rng.getrandbits(64))  # seeded from the run's seed
        self.draws: list[float] = []
        self.batch = 8

    def __call__(self) -> float:
        if not self.sigma:
            return 1.0
        if not self.draws:
            self.draws = np.exp(self.generator.normal(self.mu, self.sigma, self.batch)).tolist()
            self.batch = min(self.MAX_BATCH, self.batch * 2)
        return self.draws.pop()


class SharedHost:
    """The engines of the sites on one machine: which prefills run when, which batches decode."""

    def __init__(self):
        self.prefills: list[tuple[float, float]] = []
        self.batches: list[DecodeBatch] = []

    def forget(self, before: float) -> None:
        """Drop prefills that ended before `before` and before any batch's clock (none can ask)."""
        oldest = min([before] + [b.t for b in self.batches])
        self.prefills = [(start, end) for start, end in self.prefills if end >= oldest]

    def busy(self, t: float, but: DecodeBatch | None = None) -> int:
        """Engines busy at `t` (a batch's state as of its last event; `but` left out)."""
        return sum(1 for start, end in self.prefills if start <= t < end) + \
            sum(1 for b in self.batches if b is not but and b.running)


class PrefillWorkers:
    def __init__(self, profile: HardwareProfile, workers: int, rng: random.Random, host: SharedHost | None = None):
        self.host = host
        self.tps, self.context, self.noise = profile.prefill_tokens_per_s, profile.prefill_context_tokens, \
            Noise(profile.service_cv, rng)
        self.free_at = [0.0] * max(1, workers)  # a heap of when each worker frees

    def serve(self, now: float, arrive: float, new_tokens: int, cached_tokens: int) -> tuple[float, float]:
        """(start, end) of a prefill placed at `now`, reaching the site at `arrive`."""
        if self.host is not None and len(self.host.prefills) > 64:
            self.host.forget(now)
        free = heapq.heappop(self.free_at)
        start = max(arrive, free)
        # HardwareProfile.prefill_s, inlined (the simulator's hot loop)
        work = new_tokens / self.tps * (1 + (cached_tokens + new_tokens / 2) / self.context)
        if self.host is not None:
            work *= 1 + self.host.busy(start)
        end = start + work * self.noise()
        if self.host is not None:
            self.host.prefills.append((start, end))
        heapq.heappush(self.free_at, end)
        return start, end


class DecodeBatch:
    """One site's continuous batch on a step clock (see the module docstring). Joins may be
    scheduled in any order; `advance(t)` plays them and the finishes up to time t in order."""

    def __init__(self, profile: HardwareProfile, workers: int, rng: random.Random, host: SharedHost | None = None):
        self.host = host
        if host is not None:
            host.batches.append(self)
        self.workers, self.noise = max(1, workers), Noise(profile.service_cv, rng)
        self.single_s, self.per_sequence_s = 1 / profile.decode_tokens_per_s, 1 / profile.decode_batch_tokens_per_s
        self.t, self.steps = 0.0, 0.0
        self.step_s = 0.0                            # the current step time (noisy), 0 when idle
        self.pending: list[tuple[float, int, int]] = []   # (join time, sequence, tokens to go)
        self.running: list[tuple[float, int]] = []        # (leaving step, sequence)
        self.finished: list[tuple[int, float]] = []       # (sequence, time it left), drained by the caller

    def join(self, at: float, sequence: int, tokens: int) -> None:
        heapq.heappush(self.pending, (at, sequence, tokens))

    def _restep(self) -> None:
        n = len(self.running)
        # HardwareProfile.step_s, inlined (the simulator's hot loop)
        self.step_s = 0.0 if n == 0 else \
            max(self.single_s, -(-n // self.workers) * self.per_sequence_s) * self.noise()
        if n and self.host is not None:
            self.step_s *= 1 + self.host.busy(self.t, but=self)

    def advance(self, to: float) -> None:
        while True:
            leave_t = self.t + (self.running[0][0] - self.steps) * self.step_s if self.running else math.inf
            join_t = self.pending[0][0] if self.pending else math.inf
            t = min(leave_t, join_t)
            if t > to or t == math.inf:
                break
            if self.running:
                self.steps += (t - self.t) / self.step_s
            self.t = t
            if leave_t <= join_t:
                leaves, sequence = heapq.heappop(self.running)
                self.steps = max(self.steps, leaves)
                self.finished.append((sequence, t))
            else:
                _, sequence, tokens = heapq.heappop(self.pending)
                heapq.heappush(self.running, (self.steps + tokens, sequence))
            self._restep()
        if self.running and to > self.t and to != math.inf:
            self.steps += (to - self.t) / self.step_s
        self.t = max(self.t, to) if to != math.inf else self.t


class Link:
    """One direction of a link: transfers at its bandwidth (codec included), each in the first
    idle stretch of the wire at or after it is ready (not behind transfers placed earlier but
    ready later)."""

    def __init__(self, rtt_s: float, bytes_per_s: float, cv: float, rng: random.Random):
        self.rtt_s, self.bytes_per_s, self.noise = rtt_s, bytes_per_s, Noise(cv, rng)
        self.busy: list[tuple[float, float]] = []  # the wire's booked stretches, by start

    def _book(self, earliest: float, wire: float) -> float:
        """Book `wire` seconds from the first idle stretch at or after `earliest`; its start."""
        at = earliest
        i = bisect.bisect_left(self.busy, (earliest,))
        if i and self.busy[i - 1][1] > at:
            at = self.busy[i - 1][1]
        while i < len(self.busy) and self.busy[i][0] < at + wire:
            at = max(at, self.busy[i][1])
            i += 1
        self.busy.insert(i, (at, at + wire))
        return at

    def forget(self, before: float) -> None:
        """Drop stretches that ended before `before` (no later transfer can be ready earlier)."""
        i = 0
        while i < len(self.busy) and self.busy[i][1] < before:
            i += 1
        if i:
            del self.busy[:i]

    def transfer(self, now: float, ready: float, nbytes: int) -> float:
        """When `nbytes` of KV, ready at `ready` (when the decode side asks for them: a pull), have
        landed: a request leg, the wire time, the data leg (one RTT in all)."""
        if nbytes <= 0:
            return ready
        self.forget(now)
        wire = nbytes / self.bytes_per_s * self.noise()
        return self._book(ready, wire) + wire + self.rtt_s

    def stream(self, now: float, start: float, done: float, nbytes: int, tail_bytes: int) -> float:
        """When a streamed prefill's KV (kvstore.stream_prefill) has landed: pushed as its chunks
        finish from `start` until `done`, one way (half the RTT); only the last chunk's
        `tail_bytes`, and whatever the link cannot keep up with, trail `done`."""
        if nbytes <= 0:
            return done
        self.forget(now)
        wire = nbytes / self.bytes_per_s * self.noise()
        end = max(self._book(start, wire) + wire, done + wire * min(1.0, tail_bytes / nbytes))
        return end + self.rtt_s / 2
