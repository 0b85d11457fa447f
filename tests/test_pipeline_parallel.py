"""Pipeline parallelism (ember.parallel.pipeline_parallel): the partition maths, then real stages
(spawned processes, gloo) on the exact fp32 path of the real model."""
from __future__ import annotations

import pytest

from ember.engine.sampling_params import SamplingParams
from ember.parallel.pipeline_parallel import partition, stage_costs
from tests.parallel_kill import assert_a_killed_rank_fails_the_engine

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def add(a, b):"]


def test_the_partition_minimises_the_slowest_stage_and_weighs_the_output_layer():
    # the output layer weighing 8 layers (decode, measured): 19 + 11 layers, each side 19 layers' cost
    assert partition(30, 2, 1.0, 0.0, 8.0) == [19, 11]
    assert partition(30, 2, 1.0, 0.0, 0.0) == [15, 15]
    counts = partition(30, 3, 1.0, 0.5, 8.0)
    assert sum(counts) == 30 and min(counts) >= 1
    costs = stage_costs(counts, 1.0, 0.5, 8.0)
    assert max(costs) <= 13.5  # (30 + 8.5) / 3 = 12.83, rounded up to whole layers
    with pytest.raises(ValueError, match="pipeline_parallel"):
        partition(30, 31, 1.0, 0.0, 0.0)


def _engine(**overrides):
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    config = dict(dtype="float32", weights="dense", kv_cache_mb=64, threads=2, pipeline_parallel=2) | overrides
    return LLMEngine(EngineConfig(**config))


def _run(engine, prompts, tokens=12):
    outs = engine.generate(prompts, SamplingParams(max_tokens=tokens, logprobs=2))
    return [(o.token_ids, [(lp.logprob, lp.top_logprobs) for lp in o.logprobs]) for o in outs]


def test_a_forced_partition_that_does_not_cover_the_layers_is_refused():
    with pytest.raises(ValueError, match="pipeline_partition"):
        _engine(pipeline_partition=[10, 10])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("partition_", [None, [19, 11]], ids=["measured", "forced-19-11"])
def test_pipeline_tokens_and_logprobs_are_tp1s_bit_for_bit(make_engine, hf_greedy, partition_):
    """One sequence: every stage runs TP=1's kernels on the same rows, so the logits are the same bits.
    Batched (three sequences in micro-batches): the same greedy tokens."""
    single = make_engine(kv_cache_mb=64)
    engine = _engine(pipeline_partition=partition_)
    try:
        assert "pipeline-parallel-2" in engine.kernels
        assert sum(engine.runner.counts) == 30
        if partition_ is None:  # the output layer weighs several layers at decode: fewer layers on the last
            assert engine.runner.counts[0] > engine.runner.counts[1]
        for prompt in PROMPTS[:2]:
            assert _run(engine, [prompt]) == _run(single, [prompt])
        batched = _run(engine, PROMPTS)
        assert [t for t, _ in batched] == [t for t, _ in _run(single, PROMPTS)]
        ids = engine.tokenizer.encode(PROMPTS[1])
        assert batched[1][0] == hf_greedy(ids, 12)
    finally:
        engine.close()
    assert not any(p.is_alive() for p in engine.runner.procs), "a stage outlived close()"


@pytest.mark.timeout(300)
def test_pipeline_blocks_are_whole_model_and_equal_tp1s_bytes(make_engine):
    from ember.kv.block_hash import chain_hashes
    prompt = PROMPTS[1] + " there lived an old fisherman who every morning went down to the harbour"
    single = make_engine(kv_cache_mb=64)
    single.prefill(prompt)
    ids = single.tokenizer.encode(prompt)
    hashes = chain_hashes(ids, single.config.block_size, single.block_manager.root_hash)
    ref = [o.token_ids for o in single.generate([prompt], SamplingParams(max_tokens=10))][0]
    engine = _engine()
    try:
        assert engine.block_manager.root_hash == single.block_manager.root_hash
        engine.prefill(prompt)
        assert engine.export_frames(hashes) == single.export_frames(hashes)  # same bits, same frames
        with pytest.raises(RuntimeError, match="one parallel engine per process"):
            _engine()
    finally:
        engine.close()
    fresh = _engine()  # a decode at PP=2 from TP=1's blocks
    try:
        assert fresh.import_blocks(ids, hashes, single.export_blocks(hashes)) == len(hashes)
        out = fresh.generate([prompt], SamplingParams(max_tokens=10))[0]
        assert out.cached_tokens == len(hashes) * single.config.block_size and out.token_ids == ref
    finally:
        fresh.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mid_step", [False, True], ids=["between-steps", "mid-step"])
def test_a_killed_stage_fails_the_engine_within_its_timeout_not_a_hang(mid_step):
    assert_a_killed_rank_fails_the_engine(_engine(), PROMPTS[0], mid_step=mid_step)


@pytest.mark.timeout(300)
def test_three_stages_and_chunked_prefill_give_tp1s_tokens(make_engine):
    """A middle stage holds neither the embedding nor the output layer; 64-token prefill chunks make
    micro-batches that sample nothing."""
    from tests.conftest import PROMPTS as LONG
    prompts = [LONG[-1], LONG[0]]
    reference = [t for t, _ in _run(make_engine(kv_cache_mb=256, max_num_batched_tokens=64), prompts, 6)]
    engine = _engine(pipeline_parallel=3, kv_cache_mb=256, max_num_batched_tokens=64)
    try:
        assert len(engine.runner.counts) == 3
        assert engine.runner.me.model.lm_head is None  # stage 0 computes no logits and keeps no output layer
        assert [t for t, _ in _run(engine, prompts, 6)] == reference
    finally:
        engine.close()


@pytest.mark.timeout(400)
def test_tensor_and_pipeline_parallel_together(make_engine, hf_greedy):
    """TP=2 x PP=2: two stages, each two tensor-parallel ranks (four processes). Greedy tokens equal
    TP=1's and transformers'; its blocks are whole-model (TP=1 continues from them, and it from TP=1's,
    imported); a killed rank fails it."""
    from ember.kv.block_hash import chain_hashes
    single = make_engine(kv_cache_mb=64)
    reference = [t for t, _ in _run(single, PROMPTS, 10)]
    prompt = PROMPTS[1] + " there lived an old fisherman who every morning went down to the harbour"
    ids = single.tokenizer.encode(prompt)
    hashes = chain_hashes(ids, single.config.block_size, single.block_manager.root_hash)
    ref = single.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids
    engine = _engine(tensor_parallel=2)
    try:
        assert "tensor-parallel-2-x-pipeline-parallel-2" in engine.kernels
        assert len(engine.runner.procs) == 3 and len(engine.runner.shards) == 2
        assert [t for t, _ in _run(engine, PROMPTS, 10)] == reference
        assert reference[1] == hf_greedy(engine.tokenizer.encode(PROMPTS[1]), 10)
        engine.prefill(prompt)
        payloads = engine.export_blocks(hashes)
        # another layout of the same blocks: TP=1 continues from them to the same tokens
        decode1 = make_engine(kv_cache_mb=64)
        assert decode1.import_blocks(ids, hashes, payloads) == len(hashes)
        assert decode1.generate([prompt], SamplingParams(max_tokens=8))[0].token_ids == ref
    finally:
        engine.close()
    fresh = _engine(tensor_parallel=2)
    try:
        assert fresh.import_blocks(ids, hashes, single.export_blocks(hashes)) == len(hashes)
        out = fresh.generate([prompt], SamplingParams(max_tokens=8))[0]
        assert out.cached_tokens == len(hashes) * single.config.block_size and out.token_ids == ref
    except BaseException:
        fresh.close()
        raise
    assert_a_killed_rank_fails_the_engine(fresh, PROMPTS[0])
