"""Example edge-placement topologies (torch-free): the shipped example and synthetic ones.

Sites sit on a ring (think longitudes, neutral names); RTT grows with distance (about 1 ms per 100 km of fibre,
round trip, plus a fixed hop cost). Central GPU regions run prefill-heavy hardware; edge
sites run smaller mixed hardware. `ember config example` prints one as YAML.
"""
from __future__ import annotations

import math

PROFILES = {
    # a large model on an 8-GPU node: fast prefill, big decode batches
    "gpu-central": {"prefill_tokens_per_s": 12000, "prefill_context_tokens": 32000, "decode_tokens_per_s": 45,
                    "decode_batch_tokens_per_s": 3200, "max_batch": 128, "pool": "prefill-heavy"},
    # the same model on a smaller edge node: a quarter of the prefill speed
    "gpu-edge": {"prefill_tokens_per_s": 3000, "prefill_context_tokens": 32000, "decode_tokens_per_s": 40,
                 "decode_batch_tokens_per_s": 1400, "max_batch": 64, "pool": "mixed"},
}


def _rtt_ms(angle_a: float, angle_b: float, base_ms: float = 4.0) -> float:
    d = abs(angle_a - angle_b) % 360
    km = min(d, 360 - d) / 360 * 40000
    return round(base_ms + km / 100, 1)


def topology(num_edges: int = 12, num_central: int = 3, edge_bandwidth_gbps: float = 10.0) -> dict:
    """A config dict: `num_central` central regions and `num_edges` edge sites, one user region per edge."""
    edges = [(f"edge-{i:02d}", 360 * i / num_edges) for i in range(num_edges)]
    centrals = [(f"central-{i}", 360 * (i + 0.5) / num_central) for i in range(num_central)]
    sites, links, regions = [], [], []
    for n, (name, _) in enumerate(centrals):
        sites.append({"name": name, "tier": "central", "hardware": "gpu-central",
                      "prefill": f"10.0.{n}.1:50061", "decode": f"10.0.{n}.1:50062", "kvstore": f"10.0.{n}.1:50071",
                      "kvstore_data": f"10.0.{n}.1:50081"})
    for n, (name, _) in enumerate(edges):
        ip = f"10.{1 + n // 250}.{n % 250}.1"
        sites.append({"name": name, "tier": "edge", "hardware": "gpu-edge", "prefill": f"{ip}:50061",
                      "decode": f"{ip}:50062", "kvstore": f"{ip}:50071", "kvstore_data": f"{ip}:50081"})
    for name, angle in edges:
        for cname, cangle in centrals:
            links.append({"a": name, "b": cname, "rtt_ms": _rtt_ms(angle, cangle),
                          "bandwidth_gbps": edge_bandwidth_gbps})
    for name, angle in edges:
        near = sorted(edges, key=lambda e: _rtt_ms(angle, e[1]))[:3]
        reach = [{"site": e, "rtt_ms": round(_rtt_ms(angle, a, base_ms=2.0) + 3, 1)} for e, a in near]
        reach += [{"site": c, "rtt_ms": round(_rtt_ms(angle, a, base_ms=2.0) + 3, 1)} for c, a in centrals]
        regions.append({"name": f"users-{name}", "reach": reach})
    return {"router": {"listen": "127.0.0.1:50051"}, "sites": sites, "links": links, "regions": regions,
            "hardware": PROFILES, "placement": {"policy": "ember", "codec_saving": 0.0,
                                                "kv_bytes_per_token": 160 * 1024}}


def region_weights(num_regions: int) -> list[float]:
    """Uneven user populations (busy and quiet regions)."""
    return [1.0 + 0.8 * math.sin(i * 1.7) ** 2 for i in range(num_regions)]
