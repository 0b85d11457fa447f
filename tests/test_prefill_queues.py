"""The router's prefill queues by tenant (services/router/prefill_queues.py): a site's queue priced as a
new request of a tenant waits in it under the engines' fair queue, and what that changes in placement
on the shipped configs/local.yaml (issue 34: B's first request went to the decode worker running A's
burst, because the prefill worker's queue of A's prompts was priced whole)."""
from __future__ import annotations

import pytest

from ember.config.schema import ClusterConfig
from ember.placement.policy import Load, Placer, Request
from ember.services.router.prefill_queues import PrefillQueues
from tests.test_placement import three_sites

STEP = {"central": 1.0, "edge": 1.0}.__getitem__  # (half a step is left on average: 0.5 s)


def test_a_tenant_alone_waits_for_its_whole_queue_and_totals_stay_the_sum():
    totals: dict[str, float] = {}
    q = PrefillQueues(totals)
    for _ in range(8):
        q.add("central", "a", 1.0, 0.4)
    assert totals["central"] == pytest.approx(3.2)
    assert q.ahead_of("a", 1.0, STEP)["central"] == pytest.approx(3.2)
    for _ in range(8):
        q.remove("central", "a", 0.4)
    assert totals["central"] == pytest.approx(0.0) and q.ahead_of("b", 1.0, STEP)["central"] == pytest.approx(0.0)
    q.remove("central", "a", 0.4)  # (a second answer for the same work never takes the total below 0)
    assert totals["central"] == 0.0


def test_another_tenant_waits_for_the_step_in_progress_and_its_fair_share_only():
    q = PrefillQueues({})
    for _ in range(8):
        q.add("central", "a", 1.0, 0.4)  # A's burst: 3.2 s queued
    assert q.ahead_of("b", 1.0, STEP)["central"] == pytest.approx(0.5), "B: only the step A has begun"
    q.add("central", "b", 1.0, 0.3)  # B has 0.3 s queued itself: A is served as much meanwhile
    assert q.ahead_of("b", 1.0, STEP)["central"] == pytest.approx(0.3 + 0.3 + 0.5)
    assert q.ahead_of("b", 3.0, STEP)["central"] == pytest.approx(0.3 + 0.1 + 0.5), "a heavier tenant waits less"
    assert q.ahead_of("a", 1.0, STEP)["central"] == pytest.approx(3.5), "A waits for its own queue and B's"
    q.add("edge", "a", 1.0, 0.2)  # less than a step queued: at most what is there
    assert q.ahead_of("b", 1.0, STEP)["edge"] == pytest.approx(0.2)


def test_another_tenants_burst_at_the_fast_site_does_not_send_b_to_the_slow_one():
    """central prefills at 10,000 tokens/s, west at 3,000. A's burst queues 5 s at central: priced
    whole, B's 3,000-token prompt goes to west (as A's own next one should); priced as B waits in it
    (half a step of A's, then B's), B prefills at central."""
    config = ClusterConfig.model_validate(three_sites())
    placer = Placer(config)
    step_s = {s.name: placer.profiles[s.name].prefill_s(config.engine.max_num_batched_tokens)
              for s in config.sites}.__getitem__
    q = PrefillQueues({})
    for _ in range(10):
        q.add("central", "a", 1.0, 0.5)
    b = Request(3000, region="west")
    assert placer.place(b, Load(q.ahead_of("a", 1.0, step_s))).prefill_site == "west", "A's own: the whole queue"
    fair = placer.place(b, Load(q.ahead_of("b", 1.0, step_s)))
    assert fair.prefill_site == "central" and fair.estimate.queue_s == pytest.approx(step_s("central") / 2)
