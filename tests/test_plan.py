"""The honest simulator (hardware apart from the placer) and `ember plan` (torch-free)."""
from __future__ import annotations

import json
import random

import pytest

from ember.config.schema import ClusterConfig, HardwareProfile
from ember.placement.cli import main_for_tests
from ember.placement.examples import region_weights, topology
from ember.placement.hardware import DecodeBatch, Link, PrefillWorkers, SharedHost
from ember.placement.plan import Planner, sized
from ember.placement.policy import Load, Request
from ember.placement.simulate import Simulator
from ember.placement.trace import TraceRequest, agentic, write

PROFILE = HardwareProfile(prefill_tokens_per_s=1000, prefill_context_tokens=1e9, decode_tokens_per_s=50,
                          decode_batch_tokens_per_s=200, max_batch=16, service_cv=0.0)


def test_prefill_workers_queue_fifo_and_share_the_load():
    one, two = PrefillWorkers(PROFILE, 1, random.Random(0)), PrefillWorkers(PROFILE, 2, random.Random(0))
    assert [t for _ in range(3) for t in one.serve(0.0, 0.0, 1000, 0)] == pytest.approx([0, 1, 1, 2, 2, 3])
    assert [t for _ in range(3) for t in two.serve(0.0, 0.0, 1000, 0)] == pytest.approx([0, 1, 0, 1, 1, 2])


def test_a_decode_sequence_slows_while_others_share_its_batch():
    batch = DecodeBatch(PROFILE, 1, random.Random(0))
    batch.join(0.0, 0, 100)                 # alone: 50 tokens/s -> 2 s
    batch.advance(float("inf"))
    assert batch.finished == [(0, pytest.approx(2.0))]
    batch = DecodeBatch(PROFILE, 1, random.Random(0))
    for i in range(8):                      # 8 together: step = max(1/50, 8/200) = 40 ms
        batch.join(0.0, i, 100)
    batch.join(1.0, 8, 10)                  # joins at step 25, leaves at step 35, 9 running: 45 ms steps
    batch.advance(float("inf"))
    done = dict(batch.finished)
    assert done[8] == pytest.approx(1.0 + 10 * 0.045)
    assert done[0] == pytest.approx(1.0 + 10 * 0.045 + 65 * 0.040)
    assert batch.running == [] and batch.pending == []


def test_engines_on_a_shared_host_split_it():
    host = SharedHost()
    a, b = PrefillWorkers(PROFILE, 1, random.Random(0), host), PrefillWorkers(PROFILE, 1, random.Random(0), host)
    assert a.serve(0.0, 0.0, 1000, 0)[1] == pytest.approx(1.0)   # alone: full speed
    assert b.serve(0.5, 0.5, 1000, 0)[1] == pytest.approx(2.5)   # starts while a runs: half speed
    batch = DecodeBatch(PROFILE, 1, random.Random(0), host)
    batch.join(1.1, 0, 10)                                  # b still prefilling: steps take twice as long
    batch.advance(float("inf"))
    assert batch.finished == [(0, pytest.approx(1.1 + 10 * 2 / 50))]


def test_links_queue_transfers_and_streaming_hides_all_but_the_tail():
    link = Link(0.06, 125e6, 0.0, random.Random(0))  # 1 Gbit/s, 60 ms RTT
    assert link.transfer(0.0, 1.0, 125_000_000) == pytest.approx(2.06)
    assert link.transfer(0.0, 1.5, 125_000_000) == pytest.approx(3.06)  # waits its turn
    # one ready earlier than those booked before it takes the idle wire ahead of them
    assert link.transfer(0.0, 0.1, 12_500_000) == pytest.approx(0.26)
    assert link.transfer(0.0, 0.5, 125_000_000) == pytest.approx(4.06)  # no gap fits
    streamed = Link(0.06, 125e6, 0.0, random.Random(0))  # pushed one way; the last chunk's 1/16 trails
    assert streamed.stream(0.0, 0.0, 1.0, 62_500_000, 62_500_000 // 16) == pytest.approx(1.0 + 0.5 / 16 + 0.03)
    slow = Link(0.06, 12.5e6, 0.0, random.Random(0))  # a link slower than the prefill: the rest trails too
    assert slow.stream(0.0, 0.0, 1.0, 62_500_000, 62_500_000 // 16) == pytest.approx(5.0 + 0.03)


def _config(**placement) -> ClusterConfig:
    data = topology(3, 1)
    data["placement"].update(placement)
    return ClusterConfig.model_validate(data)


def test_service_times_come_from_the_hardware_and_streaming_as_the_engine_does_it():
    """One long uncached prompt prefilled centrally, decoded at the edge: what it takes follows
    from the profiles and the link; streamed (the default), the wire hides under the prefill but
    for the last chunk's share or what the link cannot keep up with, as the placer prices it."""
    data = topology(3, 1)
    for profile in data["hardware"].values():
        profile["service_cv"] = 0.0
    request = TraceRequest(0.0, "s0", 1, "users-edge-00", 20_000, 20_000, 11)
    results, estimates = {}, {}
    for stream in (False, True):
        data["kvstore"] = {"stream_prefill": stream}
        config = ClusterConfig.model_validate(data)
        sim = Simulator(config, "ember")
        results[stream] = sim.run([request])
        decision = sim.placer.place(Request(20_000, 11, "users-edge-00"), Load())
        assert (decision.prefill_site, decision.decode_site) == ("central-0", "edge-00")
        estimates[stream] = decision.estimate
    central, edge = config.profile("central-0"), config.profile("edge-00")
    link = config.link("central-0", "edge-00")
    prefill = central.prefill_s(20_000)
    kv = 20_000 // 16 * 16 * 160 * 1024
    rtt, wire = link.rtt_ms / 1e3, kv / (link.bandwidth_gbps * 1e9 / 8)
    user = next(x.rtt_ms for x in config.region("users-edge-00").reach if x.site == "edge-00") / 1e3
    for stream in (False, True):
        assert results[stream].ttft["p50"] == pytest.approx(user + rtt + prefill)
    # the router (at the decode site) has the first token; decode then pulls: request leg, wire, data leg
    assert results[False].tpot["p50"] == pytest.approx((rtt + wire + 10 * edge.step_s(1)) / 10)
    # pushed one way as the chunks finish: the last 128-token chunk's share, or the link's backlog
    exposed = rtt / 2 + max(wire * 128 * 160 * 1024 / kv, wire - prefill)
    # (the Decode call reaches the edge router-side at once: the decode waits for the KV from there)
    assert results[True].tpot["p50"] == pytest.approx((max(0.0, exposed - rtt / 2) + 10 * edge.step_s(1)) / 10,
                                                       rel=0.02)
    assert estimates[False].link_s == pytest.approx(rtt + wire) and estimates[True].link_s == pytest.approx(exposed)


def _small_trace() -> tuple[ClusterConfig, list[TraceRequest]]:
    config = _config()
    regions = [r.name for r in config.regions]
    return config, agentic(regions, region_weights(len(regions)), sessions_per_s=3.0, duration_s=120, seed=7)


def test_plan_meets_the_slo_and_no_single_worker_less_does():
    config, trace = _small_trace()
    planner = Planner(config, trace, slo_ttft_s=1.0, slo_tpot_s=0.05, share=0.85)
    plan = planner.plan()
    assert plan.met and plan.smaller, "this load needs more than one worker somewhere"
    confirmed = Simulator(sized(config, plan.counts), "ember", 1.0, 0.05).run(trace)
    assert confirmed.slo_attainment >= 0.85
    for (site, role), _ in plan.smaller:      # each one-smaller plan, simulated again here, misses
        fewer = {**plan.counts, (site, role): plan.counts[(site, role)] - 1}
        assert Simulator(sized(config, fewer), "ember", 1.0, 0.05).run(trace).slo_attainment < 0.85
    assert sum(n for (_, role), n in plan.counts.items() if role == "prefill") > 4, "more prefill than one per site"


def test_ember_plan_prints_and_writes_the_plan(tmp_path, capsys):
    config, trace = _small_trace()
    (tmp_path / "sites.yaml").write_text(json.dumps(config.model_dump(mode="json", exclude_none=True)))
    write(trace, tmp_path / "trace.jsonl")
    assert main_for_tests(["plan", "--config", str(tmp_path / "sites.yaml"), "--trace", str(tmp_path / "trace.jsonl"),
                           "--share", "0.85", "--output", str(tmp_path / "plan.json"),
                           "--write-config", str(tmp_path / "plan.yaml")]) == 0
    out = capsys.readouterr().out
    assert "prefill workers" in out and "one worker fewer misses" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["report"]["slo_attainment"] >= 0.85 and plan["one_fewer"]
    assert all(f["slo_attainment"] < 0.85 for f in plan["one_fewer"])
    from ember.config.load import load_config
    planned = load_config(tmp_path / "plan.yaml")   # a valid config, with the planned workers
    assert sum(len(s.prefill) + len(s.decode) for s in planned.sites) == plan["workers"]
    # an SLO nothing can meet (TTFT below the links' RTT) is said, not planned
    assert main_for_tests(["plan", "--config", str(tmp_path / "sites.yaml"), "--trace", str(tmp_path / "trace.jsonl"),
                           "--slo-ttft", "0.001", "--max-workers", "2"]) == 1
    assert "no plan" in capsys.readouterr().out
