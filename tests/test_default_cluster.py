"""The shipped configs/local.yaml as a user runs it (default weights: the GGUF's Q4_1 codes):
disaggregated tokens equal the in-process engine's, sent alone or together, cold or cached, with
speculation (the default there) or without. On the session's default cluster."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ember.client import RouterClient
from ember.engine.sampling_params import SamplingParams
from tests.conftest import LONG_TEXT, PROMPTS

pytestmark = pytest.mark.slow
NEW_TOKENS = 16


def test_the_default_cluster_serves_the_default_engines_tokens_however_requests_arrive(default_cluster, model_path):
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    # plain decoding: the cluster speculates by default, and must give these very tokens
    engine = LLMEngine(EngineConfig(model=str(model_path), threads=1, kv_cache_mb=128, speculative_tokens=0))
    assert (engine.config.weights, engine.config.dtype) == ("q4", "bfloat16")  # what the cluster serves too
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    chats.append([{"role": "user", "content": LONG_TEXT[:1500] + "\n\nWhat did the keeper write down?"}])
    chats.append([{"role": "user", "content": "Repeat this text word for word:\n\n" + LONG_TEXT[:600]}])
    prompts = [engine.tokenizer.encode(engine.tokenizer.apply_chat_template(c)) for c in chats]
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
              SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.8, seed=7)] * 2
    params.append(SamplingParams(max_tokens=4 * NEW_TOKENS, ignore_eos=True))  # quotes its context
    expected = [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    del engine

    def ask(client, i, **extra):
        sp = params[i]
        return client.complete(token_ids=prompts[i], max_tokens=sp.max_tokens, ignore_eos=True,
                               temperature=sp.temperature, seed=sp.seed, timeout=300, **extra)

    accepted = "ember:spec_decode_num_accepted_tokens_total"
    before = _decode_metrics(default_cluster.run_dir).get(accepted, 0)
    with RouterClient(default_cluster.cluster.router) as client:
        with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: batched prefill and decode
            together = list(pool.map(lambda i: ask(client, i), range(len(prompts))))
        again = [ask(client, i) for i in range(len(prompts))]  # one at a time, prefixes cached now
        plain = ask(client, len(prompts) - 1, speculative=False)  # the per-request switch
    assert _decode_metrics(default_cluster.run_dir)[accepted] - before > NEW_TOKENS, "drafts were kept"
    assert plain.token_ids == expected[-1]
    assert [r.token_ids for r in together] == expected
    assert [r.token_ids for r in again] == expected
    assert all(r.final.usage.cached_tokens >= len(p) // 16 * 16 - 16 for r, p in zip(again, prompts))


def _decode_metrics(run_dir) -> dict[str, float]:
    import json

    from ember.cluster.status import scrape
    services = json.loads((run_dir / "services.json").read_text())
    [decode] = [s for name, s in services.items() if name.startswith("decode")]
    return scrape(decode["metrics"])


def test_colocated_and_disaggregated_placements_give_the_same_tokens(default_cluster, tmp_path):
    """The shipped cluster's two sites share this host: a router forced to each shared-host placement
    (placement.shared_host) serves the same tokens, and says where prefill ran."""
    prompt = [{"role": "user", "content": LONG_TEXT[:900] + "\n\nSummarise it in one line."}]
    answers = {}
    for mode in ("disaggregated", "colocated"):
        with default_cluster.cluster.second_router(tmp_path / mode, placement={"shared_host": mode}) as (r, _), \
                RouterClient(r["listen"]) as client:
            out = client.complete(messages=prompt, max_tokens=NEW_TOKENS, ignore_eos=True, timeout=300)
        placement = out.final.placement
        assert mode in placement.reason, placement.reason
        assert placement.prefill_site == ("edge" if mode == "colocated" else "central")
        answers[mode] = out.token_ids
    assert answers["colocated"] == answers["disaggregated"]
