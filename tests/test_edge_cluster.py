"""A 3-site local cluster behind emulated WAN links: the router places by region, cache and
link cost; tokens still equal transformers'."""
from __future__ import annotations

import pytest
import yaml

from ember.client import RouterClient
from ember.cluster.launcher import running
from ember.model.fetch import DEFAULT_MODEL_PATH
from tests.cluster_fixture import decode_span, free_port
from tests.conftest import LONG_TEXT


def edge_config(path) -> dict:
    def addr():
        return f"127.0.0.1:{free_port()}"
    sites = [
        {"name": "central", "tier": "central", "hardware": "fast", "prefill": addr(), "kvstore": addr(),
         "kvstore_data": addr()},
        {"name": "west", "tier": "edge", "hardware": "slow", "prefill": addr(), "decode": addr(), "kvstore": addr(),
         "kvstore_data": addr()},
        {"name": "east", "tier": "edge", "hardware": "slow", "decode": addr(), "kvstore": addr(),
         "kvstore_data": addr()},
    ]
    config = {
        "model": str(DEFAULT_MODEL_PATH), "router": {"listen": addr(), "site": "west"},
        "placement": {"emulate_links": True},
        "sites": sites,
        "links": [{"a": "central", "b": "west", "rtt_ms": 60, "bandwidth_gbps": 1.0},
                  {"a": "central", "b": "east", "rtt_ms": 60, "bandwidth_gbps": 1.0},
                  {"a": "west", "b": "east", "rtt_ms": 30, "bandwidth_gbps": 1.0}],
        "regions": [{"name": "users-west", "reach": [{"site": "west", "rtt_ms": 5}, {"site": "east", "rtt_ms": 35}]},
                    {"name": "users-east", "reach": [{"site": "east", "rtt_ms": 5}, {"site": "west", "rtt_ms": 35}]}],
        # declared speeds (what placement prices), not this CPU's: central is the big GPU site
        "hardware": {"fast": {"prefill_tokens_per_s": 5000, "prefill_context_tokens": 3000, "decode_tokens_per_s": 14,
                              "decode_batch_tokens_per_s": 190, "max_batch": 16},
                     "slow": {"prefill_tokens_per_s": 1000, "prefill_context_tokens": 3000, "decode_tokens_per_s": 14,
                              "decode_batch_tokens_per_s": 190, "max_batch": 16}},
        "engine": {"kv_cache_mb": 96, "threads": 1, "dtype": "float32", "weights": "dense"},  # the exact path
        "kvstore": {"capacity_mb": 128},
    }
    path.write_text(yaml.safe_dump(config))
    return config


@pytest.fixture(scope="module")
def edge_cluster(tmp_path_factory, model_path):
    """Private: three sites, their links and hardware profiles are this module's subject."""
    run_dir = tmp_path_factory.mktemp("edge-cluster")
    config = edge_config(run_dir / "cluster.yaml")
    with running(run_dir / "cluster.yaml", run_dir, timeout_s=300):
        yield config, run_dir


def test_long_first_turn_prefills_centrally_short_follow_up_at_the_edge(edge_cluster, engine, hf_greedy):
    config, run_dir = edge_cluster
    turn1 = engine.tokenizer.encode(LONG_TEXT[:4300] + "\nQ: How many boats were counted in year 1707?")
    assert 950 <= len(turn1) <= 1100
    with RouterClient(config["router"]["listen"]) as client:
        first = client.complete(token_ids=turn1, max_tokens=8, ignore_eos=True, user_region="users-west",
                                session_id="s1", timeout=180)
        p = first.final.placement
        assert (p.prefill_site, p.decode_site) == ("central", "west"), p.reason
        assert p.estimated_link_s > 0.06 and p.uncached_tokens == len(turn1)
        assert first.token_ids == hf_greedy(turn1, 8)
        # the KV crossed the emulated 60 ms link while central prefilled (streamed: kvstore.stream_prefill),
        # so decode imported every full block and recomputed only the partial tail
        span = decode_span(run_dir, first.final)
        assert span["ember.blocks_imported"] == len(turn1) // 16 and span["ember.recomputed_tokens"] <= 16, span

        turn2 = turn1 + first.token_ids + engine.tokenizer.encode("\nQ: And in 1714?")
        second = client.complete(token_ids=turn2, max_tokens=8, ignore_eos=True, user_region="users-west",
                                 session_id="s1", timeout=180)
        p = second.final.placement
        assert (p.prefill_site, p.decode_site) == ("west", "west"), p.reason
        # west holds turn 1's prompt blocks (pulled) and the blocks decode filled with its answer
        # (written back when it finished; the last sampled token has no KV yet)
        history_blocks = (len(turn1) + len(first.token_ids) - 1) // 16
        assert history_blocks > len(turn1) // 16
        assert p.cached_blocks["west"] == history_blocks and p.estimated_link_s == 0
        assert second.final.usage.cached_tokens == history_blocks * 16
        assert second.token_ids == hf_greedy(turn2, 8)

        east = client.complete(token_ids=turn1[:200], max_tokens=4, ignore_eos=True, user_region="users-east",
                               timeout=180)
        assert east.final.placement.decode_site == "east", "users decode at their nearest edge site"
        assert east.token_ids == hf_greedy(turn1[:200], 4)
    log = (run_dir / "router.log").read_text()
    assert "prefill@central decode@west" in log and "prefill@west decode@west" in log
