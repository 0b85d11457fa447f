"""80 concurrent streams against the shipped default cluster (configs/local.yaml) with
router.max_inflight 8: the excess is refused at once with RESOURCE_EXHAUSTED and
grpc-retry-pushback-ms, every admitted stream is correct and no slower than 8 streams alone at
once, and the router's memory stays put. (`ember bench overload` runs the same measurement and
reports the absolute times; here only ratios measured side by side are asserted.) The capped
router is a second one in front of the session's default cluster."""
from __future__ import annotations

import json

import pytest

from ember.bench.overload import measure

pytestmark = pytest.mark.slow
CAPACITY, CLIENTS = 8, 80


@pytest.fixture(scope="module")
def capped(default_cluster, tmp_path_factory):
    with default_cluster.cluster.second_router(tmp_path_factory.mktemp("overload"), max_inflight=CAPACITY) as r:
        yield r


def test_past_capacity_the_excess_is_refused_at_once_and_the_admitted_streams_are_unharmed(capped, engine):
    router, proc = capped
    ratios = []
    for _ in range(3):  # the TTFT ratio is a timing: a stall of a loaded host lands in one round, not three
        got = measure(router["listen"], proc.pid, engine.tokenizer, CAPACITY, CLIENTS, rounds=1, max_tokens=12)
        [r] = got["rounds"]
        print(json.dumps(r, indent=1))  # the figures, with -s
        assert r["other_errors"] == 0 and r["accepted"] + r["refused"] == CLIENTS, r["other_error_details"]
        # counted at admission: a burst cannot slip past (a few more only if an admitted stream ended mid-burst)
        assert r["refused"] >= CLIENTS - CAPACITY - 2 and r["accepted"] >= CAPACITY
        assert r["refused_with_pushback"] == r["refused"] and r["pushback_ms"] == ["1000"]
        assert r["at_capacity_ok"] and r["accepted_correct"], "every admitted stream has its tokens of a run alone"
        # refused at once: a refusal that queued for a slot would wait at least as long as the shortest
        # admitted stream took from call to end (the first to free a slot); every refusal came sooner
        # (the first admitted *token* is no bound: on a loaded host a refusal lost to it at 0.13 s)
        assert r["refusal_s"]["max"] < min(r["accepted_e2e_s"]), (r["refusal_s"], r["accepted_e2e_s"])
        assert got["router_rss_growth_mb"] < 50, got
        # the refused 72 cost the admitted 8 little: their median TTFT against 8 streams alone at once,
        # measured side by side (the p99, i.e. the slowest of 8, is printed: `ember bench overload`
        # reported 0.81-1.33 on a quiet host; a CI host running beside another suite measured 2.23 once)
        ratios.append(r["accepted_p50_over_at_capacity_p50"])
        if ratios[-1] <= 2.0:
            break
    assert min(ratios) <= 2.0, ratios


def test_over_http_the_excess_gets_429_with_retry_after_at_once(capped):
    """The OpenAI API's burst: the same admission limit answers 429 in OpenAI's error shape with a
    Retry-After header, before any admitted request's answer."""
    import threading
    import time
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    http = capped[0]["http"]
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Name three rivers."}]}

    everyone_ready = threading.Barrier(24)

    def one(_):
        request = urllib.request.Request(f"http://{http}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        everyone_ready.wait(timeout=60)  # one burst, however slowly the threads started
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                return r.status, r.headers.get("Retry-After"), json.loads(r.read()), time.monotonic() - start
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Retry-After"), json.loads(e.read()), time.monotonic() - start
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24)))
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == 24 and len(ok) >= CAPACITY and len(refused) >= 24 - CAPACITY - 2, \
        [r[:2] for r in results]
    assert all(r[1] == "1" and r[2]["error"]["type"] == "rate_limit_error" for r in refused), refused[:2]
    assert all(o[2]["choices"][0]["message"]["content"] for o in ok)
    assert max(r[3] for r in refused) < min(o[3] for o in ok), "refused before any admitted answer"
