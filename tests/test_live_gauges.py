"""Engine gauges that are live under load (issue 35), on the shipped configs/local-ha.yaml (two prefill
workers): during a burst of long uncached prompts each prefill worker's running + waiting, scraped every
SCRAPE_EVERY_S, is non-zero within 1 s of the burst reaching it, and the workers' sum equals what the
router has in flight at prefill (its `ember:worker_running{role="prefill"}`), +-1, while it runs.

On this 2-core host a 1,200-token prefill takes ~20 s on a worker's one thread (a step of 1,024 tokens
~17 s), so the whole burst would take minutes: the test watches its first OBSERVE_S (every request
arrives, each worker runs long steps), then cancels the rest. A cancelled request was seen computing
on at its prefill worker (the router's cancel did not reach it): when the workers are not idle within
DRAIN_S, the test restarts them, so the next module finds an idle cluster.

On a loaded host a scrape can take a while, and the router's count moves while the workers' are read:
each sample scrapes the router, both workers, then the router again, and is compared only when the four
scrapes landed within WINDOW_S (the router's two reads bracket the truth; what qualified is printed)."""
from __future__ import annotations

import time
import uuid

import grpc
import pytest

from ember.client import RouterClient
from ember.cluster.status import scrape
from tests.cluster_fixture import AT_ONCE_S, wait_until
from tests.conftest import LONG_TEXT

pytestmark = pytest.mark.slow
BURST, PROMPT_TOKENS = 16, 1200
SCRAPE_EVERY_S = 0.25
WINDOW_S = 0.25  # a sample's four scrapes within this: compared
REACH_S = 1.0  # a worker's gauges non-zero within this of the router sending it the burst
MIN_COMPARED = 4  # samples compared while the burst ran, at least
OBSERVE_S = 30.0  # of the burst watched
DRAIN_S = 25.0  # cancelled: the workers idle within this (a step in progress ends first), else restarted


def _gauge(values: dict, name: str) -> float:
    return values.get(name, 0.0)


def test_prefill_gauges_are_live_during_a_burst_of_long_prompts(ha_cluster, engine):
    ha = ha_cluster.cluster
    services = ha.services
    workers = ha.names("prefill")
    assert len(workers) == 2
    for n in workers:  # (a cluster just started: its router may not count a worker live yet)
        ha.wait_router_sees(n, live=True, timeout_s=60)
    router_metrics = services["router"]["metrics"]
    at_router = {n: f'{{address="{services[n]["address"]}",role="prefill",site="{services[n]["site"]}"}}'
                 for n in workers}
    nonce = uuid.uuid4().hex[:12]  # every prompt differs from its first block: nothing cached anywhere
    ids = [engine.tokenizer.encode(f"Burst {nonce}, prompt {i}. " + LONG_TEXT * 2)[:PROMPT_TOKENS]
           for i in range(BURST)]
    assert all(len(p) == PROMPT_TOKENS for p in ids)

    def in_flight(values: dict) -> dict[str, float]:
        return {n: _gauge(values, "ember:worker_running" + at_router[n]) for n in workers}

    samples = []  # (start, end, router before, {worker: (running + waiting, step s, state age)}, router after)

    def sample() -> None:
        start = time.monotonic()
        before = in_flight(scrape(router_metrics, AT_ONCE_S))
        seen = {}
        for n in workers:
            m = scrape(services[n]["metrics"], AT_ONCE_S)
            seen[n] = (_gauge(m, "ember:num_requests_running") + _gauge(m, "ember:num_requests_waiting"),
                       _gauge(m, "ember:engine_step_running_seconds"), _gauge(m, "ember:engine_state_age_seconds"),
                       time.monotonic())
        after = in_flight(scrape(router_metrics, AT_ONCE_S))
        samples.append((start, time.monotonic(), before, seen, after))

    with RouterClient(ha.router) as client:
        # prefill only (1 token each); the calls start at once, their answers wait in their streams
        calls = [client.stream(token_ids=p, max_tokens=1, ignore_eos=True, timeout=600) for p in ids]
        sent = time.monotonic()
        while time.monotonic() - sent < OBSERVE_S and not all(c.done() for c in calls):
            next_at = time.monotonic() + SCRAPE_EVERY_S
            sample()
            time.sleep(max(0.0, next_at - time.monotonic()))
        finished = [c for c in calls if c.done()]
        for c in calls:
            c.cancel()
        assert all(c.code() == grpc.StatusCode.OK for c in finished), [c.code() for c in finished]
    print(f"{len(finished)} of {BURST} prompts prefilled in the {OBSERVE_S:.0f} s watched; the rest cancelled")
    wait_until(lambda: not any(in_flight(scrape(router_metrics, AT_ONCE_S)).values()), AT_ONCE_S,
               "the router has nothing in flight at prefill once the burst is cancelled")
    load, began = {}, time.monotonic()
    while time.monotonic() - began < DRAIN_S:
        for n in workers:
            m = scrape(services[n]["metrics"], AT_ONCE_S)
            load[n] = _gauge(m, "ember:num_requests_running") + _gauge(m, "ember:num_requests_waiting")
        if not any(load.values()):
            print(f"prefill workers idle {time.monotonic() - began:.1f} s after the cancel")
            break
        time.sleep(SCRAPE_EVERY_S)
    else:
        print(f"prefill workers still busy {DRAIN_S:.0f} s after the cancel ({load}): the cancel did not reach "
              f"them; restarting them")
        for n in workers:
            ha.kill(n)
        for n in workers:
            ha.restart(n)

    # 1. each worker: non-zero within REACH_S of the router first having sent it the burst
    for n in workers:
        reached = next((start for start, _, before, _, after in samples if before[n] or after[n]), None)
        assert reached is not None, f"the router never sent {n} any of the burst"
        later = [(seen[n][3], seen[n][0]) for start, _, _, seen, _ in samples if seen[n][3] >= reached]
        first_busy = next((t for t, load in later if load > 0), None)
        assert first_busy is not None, f"{n}'s running + waiting never left 0 during the burst"
        # (a host that stalled this process past REACH_S: the first sample after the burst reached it counts)
        in_time = [load for t, load in later if t <= reached + REACH_S] or [later[0][1]]
        print(f"{n}: running + waiting non-zero {first_busy - reached:.2f} s after the router first had it in flight")
        assert any(in_time), f"{n}: still 0 more than {REACH_S} s after the burst reached it"

    # 2. the sum over the workers equals the router's count at prefill, +-1, whenever the scrapes were close
    busy = [s for s in samples if any(s[2].values()) or any(s[4].values())]
    compared = [s for s in busy if s[1] - s[0] <= WINDOW_S]
    windows = sorted(s[1] - s[0] for s in busy)
    print(f"{len(busy)} samples during the burst, {len(compared)} compared (scrapes within {WINDOW_S} s; windows "
          f"p50 {windows[len(windows) // 2]:.3f} s, max {windows[-1]:.3f} s)")
    assert len(compared) >= MIN_COMPARED, f"only {len(compared)} samples with their scrapes within {WINDOW_S} s"
    wrong = []
    for start, _, before, seen, after in compared:
        total = sum(seen[n][0] for n in workers)
        low, high = sorted((sum(before.values()), sum(after.values())))
        if not low - 1 <= total <= high + 1:
            wrong.append((round(start - samples[0][0], 2), total, low, high))
    assert not wrong, f"the prefill workers' running + waiting vs the router's count at prefill " \
                      f"(seconds in, workers', router's before and after): {wrong}"

    # 3. that was during long steps: a worker's gauges said a step had run for a while, and stayed fresh
    mid_step = max(seen[n][1] for _, _, _, seen, _ in busy for n in workers)
    oldest = max(seen[n][2] for _, _, _, seen, _ in busy for n in workers)
    print(f"longest step in progress seen {mid_step:.2f} s, oldest engine state scraped {oldest:.2f} s")
    assert mid_step > 0, "no scrape landed during a step: the gauges were never read mid-step"
