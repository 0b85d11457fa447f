"""Prefix caching: shared prefixes are computed once; eviction never changes outputs."""
from __future__ import annotations

from ember.engine.sampling_params import SamplingParams
from tests.conftest import LONG_TEXT, PROMPTS


def test_second_request_computes_only_uncached_tokens(make_engine):
    engine = make_engine(kv_cache_mb=128)
    system = engine.tokenizer.encode(LONG_TEXT[:1200])
    first = system + engine.tokenizer.encode("\nQuestion one: how many boats?")
    second = system + engine.tokenizer.encode("\nQuestion two: what rose higher?")
    params = SamplingParams(max_tokens=8)
    engine.generate([first], params)
    before = engine.stats.num_computed_tokens
    [out] = engine.generate([second], params)
    computed = engine.stats.num_computed_tokens - before
    shared_blocks = len(system) // 16  # the common prefix may end mid-block
    assert out.cached_tokens == shared_blocks * 16
    # only the uncached prompt tail plus one token per decode step
    assert computed == len(second) - out.cached_tokens + len(out.token_ids) - 1
    fresh = make_engine(kv_cache_mb=128)
    [cold] = fresh.generate([second], params)
    assert cold.cached_tokens == 0 and cold.token_ids == out.token_ids


def test_4x_oversubscribed_pool_never_changes_outputs(q4_engine):
    """On the shipped q4 path (batch-invariant: a sequence preempted and recomputed, or served from what
    the cache kept, gets the bits it would have alone)."""
    roomy = q4_engine(kv_cache_mb=256)
    tight_blocks = 12  # 192 token slots for 10 sequences
    tight = q4_engine(num_kv_blocks=tight_blocks, max_num_batched_tokens=256)
    prompts = [tight.tokenizer.encode(p) for p in PROMPTS[:5]]
    prompts += [tight.tokenizer.encode(LONG_TEXT[i * 300:(i + 1) * 300]) for i in range(5)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    demand = sum(-(-(len(p) + 40) // 16) for p in prompts)
    assert demand >= 4 * tight_blocks, f"only {demand} blocks of demand"
    want = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert tight.scheduler.num_preemptions > 0 and tight.block_manager.num_evictions > 0
    assert tight.block_manager.num_free_blocks == tight_blocks, "every block is back in the pool"
    # a repeat run is served from whatever the cache kept and still matches
    again = tight.generate(prompts, params)
    assert [g.token_ids for g in again] == [w.token_ids for w in want]
