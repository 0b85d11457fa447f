"""`ember bench simulate`: the simulator's speed and the policies on the shipped example.

1. The shipped example (configs/edge-example.yaml) with a 30-minute agentic trace: p95 TTFT
   of Ember's link-priced policy against central-only and nearest-edge-only, same hardware.
2. Speed: ~1M requests over a 300-site topology (285 edge sites, 15 central regions) through
   the same placement code, wall time of the simulation (trace generation reported apart).
"""
from __future__ import annotations

import time

from ember.bench.measure import progress, write_result
from ember.config.load import load_config
from ember.config.schema import ClusterConfig
from ember.placement import trace as traces
from ember.placement.examples import region_weights, topology
from ember.placement.simulate import Simulator

EXAMPLE = "configs/edge-example.yaml"


def main(args) -> int:
    result: dict = {}
    config = load_config(EXAMPLE)
    regions = [r.name for r in config.regions]
    trace = traces.agentic(regions, region_weights(len(regions)), sessions_per_s=2.0, duration_s=1800, seed=0)
    progress(f"{EXAMPLE}: {len(trace)} requests, three policies")
    reports = {p: Simulator(config, p).run(trace) for p in ("central", "edge", "ember")}
    result["example"] = {p: r.as_dict() for p, r in reports.items()}
    ember = reports["ember"].ttft["p95"]
    gains = {p: 1 - ember / reports[p].ttft["p95"] for p in ("central", "edge")}

    num_edges, num_central = (95, 5) if args.quick else (285, 15)
    big = ClusterConfig.model_validate(topology(num_edges, num_central))
    regions = [r.name for r in big.regions]
    start = time.perf_counter()
    big_trace = traces.agentic(regions, region_weights(len(regions)), sessions_per_s=46 if not args.quick else 5,
                               duration_s=3600, seed=2)
    trace_s = time.perf_counter() - start
    progress(f"{len(big.sites)} sites: {len(big_trace)} requests (trace made in {trace_s:.1f} s), simulating")
    report = Simulator(big, "ember").run(big_trace)
    result["scale"] = {"sites": len(big.sites), "requests": report.requests, "trace_s": trace_s,
                       "simulate_s": report.wall_s, "ttft": report.ttft}
    result["targets"] = {
        "p95_ttft_gain_over_central": {"value": round(gains["central"], 3), "target": 0.2,
                                       "met": gains["central"] >= 0.2},
        "p95_ttft_gain_over_edge": {"value": round(gains["edge"], 3), "target": 0.2, "met": gains["edge"] >= 0.2},
        "simulate_1M_requests_300_sites_s": {"value": round(report.wall_s, 1), "target": 60,
                                             "met": report.wall_s <= 60 and report.requests >= 950_000
                                             and len(big.sites) >= 300},
    }
    write_result(result, args.output)
    return 0
