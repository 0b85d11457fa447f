"""Expert parallelism (ember.parallel.expert_parallel): each rank holds its share of the routed
experts and a replica of the rest; the tokens are EP = 1's (and transformers') bit for bit."""
from __future__ import annotations

import pytest
import torch

from ember.engine.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.sampling_params import SamplingParams
from ember.model.args import read_model_args
from ember.parallel.expert_parallel import expert_weight_bytes
from ember.parallel.shard import ExpertShard, plan_experts
from ember.rpc import metrics
from ember.serving.engine_core import EngineCore
from tests.conftest import PROMPTS
from tests.families import build
from tests.parallel_kill import assert_a_killed_rank_fails_the_engine

pytestmark = pytest.mark.timeout(600)
KINDS = ("deepseek_v3", "qwen3_moe", "llama4")
STEPS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_path):
    from ember.model.files import model_folder
    root = tmp_path_factory.mktemp("ep-families")
    return {kind: build(kind, root / kind, model_folder(str(model_path))) for kind in KINDS}


def engine(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", weights="dense", threads=2, kv_cache_mb=32) | overrides
    return LLMEngine(EngineConfig(**config))


def prompts(eng: LLMEngine) -> list[list[int]]:
    return [eng.tokenizer.encode(p) for p in PROMPTS[:4]]


def test_experts_split_contiguously_and_a_dense_model_or_too_many_ranks_is_refused(checkpoints, model_path):
    args = read_model_args(checkpoints["deepseek_v3"])  # 8 routed experts
    assert [s.experts for s in plan_experts(args, 3)] == [(0, 3), (3, 6), (6, 8)]
    with pytest.raises(ValueError, match="exceeds the model's 8 routed experts"):
        plan_experts(args, 9)
    from ember.model.files import model_folder
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        plan_experts(read_model_args(model_folder(str(model_path))), 2)
    shard = ExpertShard(1, 2, (4, 8))
    assert shard.reads("model.layers.1.mlp.experts.5.gate_proj.weight")
    assert not shard.reads("model.layers.1.mlp.experts.3.gate_proj.weight")
    assert shard.reads("model.layers.1.mlp.shared_experts.gate_proj.weight")
    assert shard.stacked_rows("model.layers.1.mlp.experts.gate_up_proj") == (4, 8)
    assert shard.stacked_rows("model.layers.1.mlp.gate.weight") is None


@pytest.mark.parametrize("kind", KINDS)
def test_expert_parallel_2_gives_ep1_tokens_and_each_rank_holds_half_the_experts(kind, checkpoints):
    one = engine(checkpoints[kind])
    ids = prompts(one)
    want = one.generate(ids, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    all_experts = expert_weight_bytes(one.loaded.model)
    routed = sum(int(m.expert_tokens.sum()) for m in one.loaded.model.modules() if hasattr(m, "expert_tokens"))
    two = engine(checkpoints[kind], expert_parallel=2)
    try:
        assert "expert-parallel-2" in two.kernels
        got = two.generate(ids, SamplingParams(max_tokens=STEPS, ignore_eos=True))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        stats = two.runner.expert_stats()
        snapshot = EngineCore(two).snapshot()
    finally:
        two.close()
    assert [s["experts"] for s in stats] == [[0, 4], [4, 8]]
    for s in stats:  # each rank reads only its own experts from the checkpoint and keeps only them
        assert s["expert_bytes"] == all_experts // 2, s
    assert sum(s["routed_tokens"] for s in stats) == routed  # every routed slot was computed by one rank
    # the load per expert and rank, as the service exports it: ember:moe_expert_tokens_total{expert,rank}
    assert sum(snapshot.expert_tokens) == routed and snapshot.expert_ranks == (0,) * 4 + (1,) * 4
    counters = metrics._EngineCounters()
    counters.client = type("Client", (), {"snapshot": snapshot})
    [family] = [f for f in counters.collect() if f.name == "ember:moe_expert_tokens"]
    samples = {(s.labels["expert"], s.labels["rank"]): s.value for s in family.samples}
    assert samples[("5", "1")] == snapshot.expert_tokens[5] and sum(samples.values()) == routed
    per_rank = [sum(v for (_, r), v in samples.items() if r == str(rank)) for rank in (0, 1)]
    assert per_rank == [s["routed_tokens"] for s in stats]


def test_a_batched_request_gives_its_tokens_alone_under_expert_parallel(checkpoints):
    two = engine(checkpoints["deepseek_v3"], expert_parallel=2, max_num_batched_tokens=64)
    try:
        ids = prompts(two)
        [alone] = two.generate([ids[0]], SamplingParams(max_tokens=STEPS, ignore_eos=True))
        among = two.generate([ids[0], *[p[:30 + 9 * i] for i, p in enumerate(ids[1:] * 2)]],
                             SamplingParams(max_tokens=STEPS, ignore_eos=True))[0]
        assert among.token_ids == alone.token_ids
    finally:
        two.close()


def test_blocks_are_whole_model_so_ep1_and_ep2_engines_exchange_them(checkpoints):
    """An EP = 1 engine's blocks go into every EP = 2 rank's cache; its tokens from them are EP = 1's,
    and it exports the same bytes back."""
    from ember.kv import wire
    from ember.kv.block_hash import chain_hashes
    one = engine(checkpoints["deepseek_v3"])
    ids = prompts(one)[-1]
    [want] = one.generate([ids], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    bs = one.config.block_size
    hashes = chain_hashes(ids[:len(ids) // bs * bs], bs, one.block_manager.root_hash)
    frames = one.export_frames(hashes)
    two = engine(checkpoints["deepseek_v3"], expert_parallel=2)
    try:
        payloads = [wire.decode_frame(f, two.frame_template, block_hash=h) for h, f in zip(hashes, frames)]
        assert two.import_blocks(ids, hashes, payloads) == len(hashes)
        [got] = two.generate([ids], SamplingParams(max_tokens=STEPS, ignore_eos=True))
        assert got.cached_tokens == len(hashes) * bs and got.token_ids == want.token_ids
        assert two.export_frames(hashes) == frames
    finally:
        two.close()


def test_a_killed_expert_rank_fails_the_engine_within_its_timeout_not_a_hang(checkpoints):
    assert_a_killed_rank_fails_the_engine(engine(checkpoints["qwen3_moe"], expert_parallel=2), PROMPTS[0])


@pytest.mark.parametrize("kind, layout", [("deepseek_v3", dict(expert_parallel=2, pipeline_parallel=2)),
                                          ("llama4", dict(pipeline_parallel=2))])
def test_expert_parallel_x_pipeline_parallel_gives_ep1_tokens_and_exchanges_blocks(kind, layout, checkpoints):
    """Each stage a group of expert-parallel ranks (DeepSeek-V3's structure: its dense first layer in
    stage 0, latent KV layers split over the stages), or a family's stages alone (Llama 4: its NoPE
    and chunked layers renumbered per stage): EP = 1's tokens, and the same blocks' bytes."""
    from ember.kv import wire
    from ember.kv.block_hash import chain_hashes
    one = engine(checkpoints[kind])
    ids = prompts(one)
    want = one.generate(ids, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    bs = one.config.block_size
    hashes = chain_hashes(ids[-1][:len(ids[-1]) // bs * bs], bs, one.block_manager.root_hash)
    fresh = ids[0] + ids[1]  # a prompt only `one` has seen: its blocks go into every stage
    [fresh_want] = one.generate([fresh], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    fresh_hashes = chain_hashes(fresh[:len(fresh) // bs * bs], bs, one.block_manager.root_hash)
    split = engine(checkpoints[kind], **layout)
    try:
        assert "pipeline-parallel-2" in split.kernels[-1]
        got = split.generate(ids, SamplingParams(max_tokens=STEPS, ignore_eos=True))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert split.export_frames(hashes) == one.export_frames(hashes)  # whole-model blocks, every stage's layers
        payloads = [wire.decode_frame(f, split.frame_template, block_hash=h)
                    for h, f in zip(fresh_hashes, one.export_frames(fresh_hashes))]
        assert split.import_blocks(fresh, fresh_hashes, payloads) == len(fresh_hashes)
        [from_blocks] = split.generate([fresh], SamplingParams(max_tokens=STEPS, ignore_eos=True))
        assert from_blocks.cached_tokens == len(fresh_hashes) * bs and from_blocks.token_ids == fresh_want.token_ids
    finally:
        split.close()


def test_expert_parallel_inside_tensor_parallel_must_equal_its_degree(checkpoints):
    """EP with TP spreads whole experts over the TP ranks (tests/test_tensor_parallel_families.py runs it):
    another degree is refused before any rank starts."""
    with pytest.raises(ValueError, match="must equal tensor_parallel"):
        engine(checkpoints["qwen3_moe"], expert_parallel=4, tensor_parallel=2)
    assert torch.distributed.is_available()
