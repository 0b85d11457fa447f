"""Parallel engines in the real cluster: the prefill site's engine at TP=3 (or PP=2), the decode
site's at TP=1, exchanging whole-model KV blocks through the kvstores (engine.prefill overrides)."""
from __future__ import annotations

import pytest

from ember.client import RouterClient
from ember.engine.sampling_params import SamplingParams
from tests.cluster_fixture import write_config
from tests.conftest import PROMPTS


def _rank_processes() -> list:
    """Processes spawned by an engine core (`python -m ember.serving.core_process`, or forked by the
    engine template: `python -m ember.serving.template`) of this test run."""
    import psutil
    ranks = []
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        try:
            if "spawn_main" in " ".join(proc.info["cmdline"] or []):
                parent = " ".join(psutil.Process(proc.info["ppid"]).cmdline())
                if "ember.serving.core_process" in parent or "ember.serving.template" in parent:
                    ranks.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return ranks


@pytest.mark.timeout(600)
@pytest.mark.parametrize("prefill", [{"tensor_parallel": 3}, {"pipeline_parallel": 2}], ids=["tp3", "pp2"])
def test_a_parallel_prefill_and_a_tp1_decode_give_the_reference_tokens(tmp_path, engine, hf_greedy, prefill):
    """A cluster of its own (restarting a session cluster's prefill worker at TP=3 and back costs more
    than starting one, and its prompt must be one no other module has cached)."""
    from ember.cluster.launcher import running
    config = tmp_path / "cluster.yaml"
    addr = write_config(config, overrides={"engine": {"prefill": prefill}})
    ids = engine.tokenizer.encode(PROMPTS[-1])  # ~1,000 tokens: dozens of blocks cross to the decode site
    reference = engine.generate([ids], SamplingParams(max_tokens=16))[0].token_ids
    with running(config, tmp_path, timeout_s=300):
        assert len(_rank_processes()) == max(prefill.values()) - 1  # the prefill's engine core spawned its ranks
        with RouterClient(addr["router"]) as client:
            out = client.complete(token_ids=ids, max_tokens=16, timeout=240)
    assert out.token_ids == reference == hf_greedy(ids, 16)[:len(reference)]
    final = out.final
    assert final.placement.prefill_site == "central" and final.placement.decode_site == "edge"
    assert final.timings.transfer_s > 0  # the decode site imported the prefill's blocks
    assert _rank_processes() == []  # the cluster's stop took the ranks with it
