"""80 concurrent streams against the shipped default cluster (configs/local.yaml) with
router.max_inflight 8: the excess is refused at once with RESOURCE_EXHAUSTED and
grpc-retry-pushback-ms, every admitted stream is correct and no slower than 8 streams alone at
once, and the router's memory stays put. (`ember bench overload` runs the same measurement and
reports the absolute times; here only ratios measured side by side are asserted.)"""
from __future__ import annotations

import json

import pytest

from ember.bench.overload import measure, with_capacity
from ember.cluster.launcher import default_config, running

pytestmark = pytest.mark.slow
CAPACITY, CLIENTS = 8, 80


@pytest.fixture(scope="module")
def capped(tmp_path_factory, model_path):
    run_dir = tmp_path_factory.mktemp("overload")
    with_capacity(default_config(), run_dir / "cluster.yaml", str(model_path), CAPACITY)
    with running(run_dir / "cluster.yaml", run_dir, timeout_s=300):
        yield run_dir


def test_past_capacity_the_excess_is_refused_at_once_and_the_admitted_streams_are_unharmed(capped, engine):
    pids = json.loads((capped / "pids.json").read_text())
    router = json.loads((capped / "services.json").read_text())["router"]["address"]
    got = measure(router, pids["router"], engine.tokenizer, CAPACITY, CLIENTS, rounds=1, max_tokens=12)
    [r] = got["rounds"]
    print(json.dumps(r, indent=1))  # the figures, with -s
    assert r["other_errors"] == 0 and r["accepted"] + r["refused"] == CLIENTS, r["other_error_details"]
    # counted at admission: a burst cannot slip past (a few more only if an admitted stream ended mid-burst)
    assert r["refused"] >= CLIENTS - CAPACITY - 2 and r["accepted"] >= CAPACITY
    assert r["refused_with_pushback"] == r["refused"] and r["pushback_ms"] == ["1000"]
    assert r["at_capacity_ok"] and r["accepted_correct"], "every admitted stream has its tokens of a run alone"
    # refused at once: every refusal came back before any admitted stream's first token (none of
    # them waited behind the admitted work)
    assert r["refusal_s"]["max"] < min(r["accepted_ttft_s"]), (r["refusal_s"], r["accepted_ttft_s"])
    # the refused 72 cost the admitted 8 little: their p99 TTFT against 8 streams alone at once
    assert r["accepted_p99_over_at_capacity_p99"] <= 2.0, r
    assert got["router_rss_growth_mb"] < 50, got


def test_over_http_the_excess_gets_429_with_retry_after_at_once(capped):
    """The OpenAI API's burst: the same admission limit answers 429 in OpenAI's error shape with a
    Retry-After header, before any admitted request's answer."""
    import time
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    import yaml
    http = yaml.safe_load((capped / "cluster.yaml").read_text())["router"]["http"]
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Name three rivers."}]}

    def one(_):
        request = urllib.request.Request(f"http://{http}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
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
