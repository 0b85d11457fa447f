"""A client that cancels its request while the prompt is being prefilled stops that prefill: the
router's Prefill call is cancelled with it (the tracing interceptor used to wait on the call's
status and leave the call running when its caller was cancelled), the prefill worker logs the
abort and its engine frees the sequence, on the session's exact cluster (real processes)."""
from __future__ import annotations

import json
import random
import time

import grpc
import pytest

from ember.cluster.status import scrape
from ember.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.cluster_fixture import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
PROMPT_TOKENS = 1800  # uncached: seconds of prefill on the exact (fp32) path here


def busy(endpoint) -> float:
    m = scrape(endpoint)
    return m.get("ember:num_requests_running", 0.0) + m.get("ember:num_requests_waiting", 0.0)


def test_cancelling_a_request_during_its_prefill_stops_the_prefill(exact_cluster):
    services = json.loads((exact_cluster.run_dir / "services.json").read_text())
    [prefill] = [n for n, s in services.items() if s["role"] == "prefill"]
    metrics = services[prefill]["metrics"]
    log = exact_cluster.run_dir / f"{prefill}.log"
    rng = random.Random(time.time_ns())
    prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
    request_id = f"cancel-{time.time_ns()}"
    with grpc.insecure_channel(exact_cluster.cluster.router) as channel:
        stream = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
            request_id=request_id, tokens=router_pb2.TokenInput(token_ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=120)
        wait_until(lambda: busy(metrics) >= 1, 30, "the prefill worker computing the prompt")
        stream.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
        assert e.value.code() == grpc.StatusCode.CANCELLED
    cancelled = time.monotonic()

    def aborted() -> bool:
        return any(request_id in line and "aborted (cancelled)" in line for line in log.read_text().splitlines())
    wait_until(aborted, 30, "the prefill worker aborting the cancelled request")
    wait_until(lambda: busy(metrics) == 0, 30, "the prefill worker idle again")
    print(f"prefill aborted and idle {time.monotonic() - cancelled:.2f} s after the cancel")
