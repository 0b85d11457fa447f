"""Hybrid KV allocation (ember.engine.block_manager.KVGroups): Llama 4's chunked-attention layers keep
only the pages of each sequence's current chunk, its global layers every page; pages given back at a
chunk boundary are reused; prefix hits are cut back where a chunked group lacks what it reads; greedy
tokens equal transformers' (fp32) and the allocator switched off's, alone, batched, in chunks, from a
cached prefix and through preemption; nothing leaks; blocks still cross between engines whole."""
from __future__ import annotations

import pytest
import torch

from ember.engine.block_manager import FREED, BlockManager, GroupHits, kv_groups
from ember.engine.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.errors import CapacityError
from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import Sequence
from ember.errors import NotFoundError
from ember.kv.block_hash import chain_hashes
from tests.conftest import PROMPTS
from tests.families import build

ROOT = b"\x00" * 16
CHUNK, BS = 32, 16  # tests/families.py's llama4: attention_chunk_size 32; layers 0-2 chunked, 3 global
STEPS = 16


def held(table: list[int]) -> int:
    return sum(1 for b in table if b != FREED)


def evict(bm: BlockManager, pages: list[int]) -> None:
    """Evict these cached, unreferenced pages (first in the LRU, then the pool taken and given back)."""
    for page in pages:
        assert bm.blocks[page].ref_count == 0 and bm.blocks[page].hash is not None
        bm.evictable.move_to_end(page, last=False)
    evictions = bm.num_evictions
    taken = [bm._take_fresh() for _ in range(len(bm.free_ids) + len(pages))]
    assert bm.num_evictions == evictions + len(pages)
    assert all(bm.blocks[p].hash is None for p in pages)
    for page in taken:
        bm.release(page)


def assert_no_leak(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks) and bm._reserved_total == 0 and not bm._reserved


# -- the grouping ----------------------------------------------------------------------------------
def test_llama4_layers_group_by_kind_in_equal_groups():
    scout = tuple(0 if i % 4 == 3 else 8192 for i in range(48))  # Scout: a NoPE layer every 4th
    groups = kv_groups(scout)
    assert groups.windows == (0, 8192, 8192, 8192) and groups.layers_per_group == 12
    assert groups.layers[0] == tuple(range(3, 48, 4)) and sorted(sum(groups.layers, ())) == list(range(48))
    tiny = kv_groups((CHUNK, CHUNK, CHUNK, 0))
    assert tiny.windows == (0, CHUNK, CHUNK, CHUNK) and tiny.layers == ((3,), (0,), (1,), (2,))
    assert kv_groups(None) is None and kv_groups((0, 0)) is None and kv_groups((CHUNK, CHUNK)) is None


# -- the block manager alone (torch-free) -----------------------------------------------------------
def manager(pages: int, max_step: int | None = None) -> BlockManager:
    return BlockManager(pages, BS, ROOT, kv_groups((CHUNK, CHUNK, CHUNK, 0)), max_step_tokens=max_step)


def seq(tokens, rid="r") -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(), seed=0)


def admit(bm: BlockManager, s: Sequence) -> GroupHits:
    hits = bm.match_prefix(s)
    assert bm.can_allocate(s, hits)
    bm.allocate(s, hits)
    return hits


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """One step of n tokens for s, as the scheduler and engine run it."""
    assert bm.can_grow(s, n)
    bm.grow(s, n)
    s.num_computed_tokens += n
    bm.register_computed(s)


def decode(bm: BlockManager, s: Sequence, token: int) -> None:
    s.token_ids.append(token)
    compute(bm, s, 1)


def test_chunked_groups_hold_one_chunk_while_the_full_group_grows():
    bm = manager(400, max_step=64)
    s = seq(range(40))
    admit(bm, s)
    for start in range(0, 40, 16):  # chunked prefill, 16 tokens a step
        compute(bm, s, min(16, 40 - start))
    limit = -(-CHUNK // BS) + 1
    for t in range(200):
        decode(bm, s, 1000 + t)
        assert len(s.block_table) == bm.blocks_needed(s.num_tokens) and held(s.block_table) == len(s.block_table)
        for table in s.group_tables:
            assert held(table) <= limit
            # exactly the blocks from the chunk start of the next query on
            first = (s.num_computed_tokens - s.num_computed_tokens % CHUNK) // BS
            assert all(b == FREED for b in table[:first]) and all(b != FREED for b in table[first:])
    assert held(s.block_table) == bm.blocks_needed(240)
    bm.free(s)
    assert_no_leak(bm)


def test_pages_given_back_at_a_boundary_are_reused_by_another_sequence():
    bm = manager(12)
    a = seq(range(30), "a")  # 2 blocks: 2 full pages, its chunked pages come with its steps
    admit(bm, a)
    compute(bm, a, 30)
    before = [list(t) for t in a.group_tables]
    assert all(held(t) == 2 for t in before)
    for t in range(3):  # to position 33: the next query's chunk starts at 32, blocks 0-1 go back
        decode(bm, a, 500 + t)
    given_back = {b for t in before for b in t[:2]}
    assert all(t[:2] == [FREED, FREED] for t in a.group_tables)
    assert all(bm.blocks[b].ref_count == 0 for b in given_back)
    assert not bm.free_ids  # what is free is what a gave back
    b = seq(range(700, 710), "b")
    admit(bm, b)
    compute(bm, b, 10)
    taken = {p for t in (b.block_table, *b.group_tables) for p in t if p != FREED}
    reused = taken & given_back
    assert reused, "no page given back at the boundary was reused"
    for p in reused:
        assert bm.blocks[p].ref_count == 1 and all(p not in t for t in (a.block_table, *a.group_tables))
    bm.free(a)
    bm.free(b)
    assert_no_leak(bm)


def test_a_prefix_hit_needs_the_chunked_pages_of_its_last_chunk_and_is_cut_back_without_them():
    bm = manager(200)
    a = seq(range(100), "a")
    admit(bm, a)
    compute(bm, a, 100)
    bm.free(a)
    # every page is cached (given-back chunked ones too): the whole prefix hits
    hits = bm.match_prefix(seq(list(range(90)) + [7] * 20, "b"))
    assert len(hits) == 5  # 90 tokens: 5 whole blocks
    # a hit of 5 blocks (80 tokens) reads chunk 64..: block 4 of every chunked group, none before
    assert all(t[:4] == [None] * 4 and t[4] is not None for t in hits.tables[1:])
    # evict block 4's chunked pages: the hit falls back to the chunk boundary at 64 tokens (4 blocks)
    evict(bm, [t[4] for t in hits.tables[1:]])
    c = seq(list(range(90)) + [7] * 20, "c")
    hits = bm.match_prefix(c)
    assert len(hits) == 4 and all(t == [None] * 4 for t in hits.tables[1:])
    admit(bm, c)
    assert c.num_computed_tokens == 64
    compute(bm, c, c.num_tokens - 64)
    bm.free(c)
    assert_no_leak(bm)


def test_admission_never_evicts_a_hit_of_another_group_for_its_fresh_pages():
    bm = manager(40)
    a = seq(range(20), "a")
    admit(bm, a)
    compute(bm, a, 20)
    bm.free(a)  # block 0's pages: evictable, the LRU's first
    c = seq(range(100, 180), "c")
    admit(bm, c)
    compute(bm, c, 80)
    bm.free(c)  # more evictable pages behind them
    held_free = [bm._take_fresh() for _ in range(len(bm.free_ids))]
    b = seq(list(range(16)) + [9] * 10, "b")  # hits block 0 in every group (chunk 0..31 reads it)
    hits = admit(bm, b)  # its fresh pages come from the LRU: never from its own hits
    assert len(hits) == 1 and all(t == [hits.tables[g][0]] for g, t in enumerate((b.block_table[:1], *b.group_tables)))
    pages = [p for t in (b.block_table, *b.group_tables) for p in t if p != FREED]
    assert len(pages) == len(set(pages)) and all(bm.blocks[p].ref_count == 1 for p in pages)
    bm.free(b)
    for page in held_free:
        bm.release(page)
    assert_no_leak(bm)


def test_an_admitted_prefill_keeps_its_reservation_and_never_stalls():
    bm = manager(40, max_step=32)
    a = seq(range(300), "a")  # 19 full pages + 3 groups x (2 + 2 + 1) reserved = 34
    assert bm.can_allocate(a, []) and bm._admission_pages(a, 0) == 19 + 3 * 5
    admit(bm, a)
    assert bm.num_free_blocks == 40 - 34
    other = seq(range(1000, 1100), "other")
    assert not bm.can_allocate(other, [])  # the reservation is not someone else's to take
    for start in range(0, 300, 32):
        compute(bm, a, min(32, 300 - start))  # never refused midway
    assert bm._reserved_total == 0
    assert held(a.block_table) == 19 and all(held(t) <= 3 for t in a.group_tables)
    bm.free(a)
    assert_no_leak(bm)


# -- the engine: tokens and leaks -------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_path):
    from ember.model.files import model_folder
    return build("llama4", tmp_path_factory.mktemp("hybrid") / "llama4", model_folder(str(model_path)))


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(), {}


@pytest.fixture(scope="module")
def prompts(checkpoint):
    from ember.model.tokenizer import Tokenizer
    return [Tokenizer.from_folder(checkpoint).encode(p) for p in PROMPTS]


def hf_greedy(reference, ids: list[int], steps: int = STEPS) -> list[int]:
    model, memo = reference
    key = (tuple(ids), steps)
    if key not in memo:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        memo[key] = out[0, len(ids):].tolist()
    return memo[key]


def engine_for(checkpoint, **overrides) -> LLMEngine:
    config = dict(model=str(checkpoint), dtype="float32", weights="dense", threads=2, kv_cache_mb=16) | overrides
    return LLMEngine(EngineConfig(**config))


def greedy(steps: int = STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=steps, ignore_eos=True)


def test_the_engine_groups_a_chunked_model_unless_switched_off(checkpoint):
    on, off = engine_for(checkpoint), engine_for(checkpoint, hybrid_kv=False)
    assert on.block_manager.hybrid and not off.block_manager.hybrid
    # the same bytes: four one-layer pages for every four-layer block
    assert on.cache.nbytes == off.cache.nbytes and on.block_manager.num_blocks == 4 * off.block_manager.num_blocks
    assert on.block_manager.root_hash == off.block_manager.root_hash  # blocks are the same on the wire


@pytest.mark.parametrize("budget", [1024, 48])  # whole prompts; chunks of 48 tokens beside the decodes
def test_alone_and_batched_the_tokens_of_transformers_and_of_the_allocator_off(checkpoint, reference, prompts,
                                                                             budget):
    chosen = [prompts[1], prompts[2], prompts[5][:200]]  # 62, 48 and 200 tokens: all cross chunks
    on = engine_for(checkpoint, max_num_batched_tokens=budget)
    off = engine_for(checkpoint, max_num_batched_tokens=budget, hybrid_kv=False)
    alone = [on.generate([ids], greedy())[0].token_ids for ids in chosen]
    batched = [o.token_ids for o in on.generate(chosen, greedy())]
    reference_off = [o.token_ids for o in off.generate(chosen, greedy())]
    for ids, a, b, r in zip(chosen, alone, batched, reference_off):
        assert a == b == r == hf_greedy(reference, ids)
    assert_no_leak(on.block_manager)


def test_on_the_batch_invariant_bf16_path_the_same_tokens_as_the_allocator_off(checkpoint, prompts):
    """bf16 (the served recipe: keys outside a chunk masked, so the page a given-back entry reads changes
    no bit), speculative verify steps included (on by default there)."""
    chosen = [prompts[1], prompts[5][:120]]
    on = engine_for(checkpoint, dtype="bfloat16", max_num_batched_tokens=48)
    off = engine_for(checkpoint, dtype="bfloat16", max_num_batched_tokens=48, hybrid_kv=False)
    assert on.speculative_tokens > 0 and on.block_manager.hybrid
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    assert [o.token_ids for o in on.generate(chosen, params)] == [o.token_ids for o in off.generate(chosen, params)]
    assert on.stats.num_draft_tokens > 0
    assert_no_leak(on.block_manager)


def test_a_long_decode_holds_a_chunk_of_pages_per_chunked_group(checkpoint, reference, prompts):
    engine = engine_for(checkpoint)
    ids = prompts[5][:100]
    rid = engine.add_request(ids, greedy(80))
    seq, limit, tokens = engine.seqs[rid], -(-CHUNK // BS) + 1, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        if seq.group_tables:
            assert all(held(t) <= limit for t in seq.group_tables)
            assert held(seq.block_table) == len(seq.block_table) >= -(-seq.num_computed_tokens // BS)
    assert tokens == hf_greedy(reference, ids, 80)
    assert_no_leak(engine.block_manager)


def test_from_a_cached_prefix_and_from_one_cut_back(checkpoint, reference, prompts):
    engine = engine_for(checkpoint)
    bm = engine.block_manager
    long = prompts[5][:300]
    hashes = chain_hashes(long, BS, bm.root_hash)
    engine.generate([long], greedy(4))  # 18 blocks cached; chunked pages given back as it went
    # without the chunked pages of blocks 0-15 a hit of 17 blocks (272 tokens) still stands: it reads
    # chunk 256.. only (block 16)
    evict(bm, [bm.group_cached[g][h] for g in (1, 2, 3) for h in hashes[:16]])
    [out] = engine.generate([long[:280]], greedy())
    assert out.cached_tokens == 272 and out.token_ids == hf_greedy(reference, long[:280])
    # without block 16's too: cut back to the chunk boundary (256 tokens), which needs none
    evict(bm, [bm.group_cached[g][hashes[16]] for g in (1, 2, 3)])
    assert hashes[15] in bm.group_cached[0] and hashes[16] not in bm.cached
    [out] = engine.generate([long[:280]], greedy())
    assert out.cached_tokens == 256, "the hit was not cut back to the chunk boundary"
    assert out.token_ids == hf_greedy(reference, long[:280])
    assert_no_leak(bm)


def test_preemption_and_cancel_leave_nothing_behind(checkpoint, reference, prompts):
    engine = engine_for(checkpoint, num_kv_blocks=8, kv_cache_mb=None, max_num_batched_tokens=64)
    bm = engine.block_manager
    # 32 pages: a sequence of 160 tokens holds at most 10 full pages + 3 x 7 chunked (a chunk and a step);
    # one of 400 (25 + 21) could never run: refused at once, not queued forever
    assert bm.pages_needed(160) == 31 and bm.pages_needed(400) == 46
    engine.validate(prompts[5][:100], greedy(60))
    with pytest.raises(CapacityError):
        engine.validate(prompts[5][:300], greedy(100))
    chosen = [prompts[1], prompts[2], prompts[3], prompts[4], prompts[0]]
    outs = engine.generate(chosen, greedy(40))
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    for ids, out in zip(chosen, outs):
        assert out.token_ids == hf_greedy(reference, ids, 40)
    assert_no_leak(bm)
    ids = [engine.add_request(p, greedy(40)) for p in chosen[:3]]
    for _ in range(12):  # past a chunk boundary or two, mid-prefill for some
        engine.step()
    for rid in ids:
        engine.abort(rid)
    assert not engine.has_unfinished()
    assert_no_leak(bm)


# -- blocks between engines ---------------------------------------------------------------------------
def test_blocks_cross_between_grouped_and_ungrouped_engines(checkpoint, reference, prompts):
    on, off = engine_for(checkpoint), engine_for(checkpoint, hybrid_kv=False)
    ids = prompts[5][:150]
    hashes = chain_hashes(ids, BS, on.block_manager.root_hash)  # 9 blocks (144 tokens)
    off.generate([ids], greedy(1))
    on.import_blocks(ids, hashes, off.export_blocks(hashes))  # whole blocks into every group's pages
    [out] = on.generate([ids], greedy())  # a hit of 9 blocks reads block 8's imported chunked pages
    assert out.cached_tokens == 144 and out.token_ids == hf_greedy(reference, ids)
    back = engine_for(checkpoint, hybrid_kv=False)
    back.import_blocks(ids, hashes, on.export_blocks(hashes))  # put back together in layer order
    assert back.export_blocks(hashes) == off.export_blocks(hashes)
    # a block whose chunked pages were evicted is not exportable whole: refused as an evicted one is
    bm = on.block_manager
    evict(bm, [bm.group_cached[g][hashes[0]] for g in (1, 2, 3)])
    assert hashes[0] not in bm.cached and hashes[0] in bm.group_cached[0] and hashes[1] in bm.cached
    with pytest.raises(NotFoundError):
        on.export_blocks(hashes[:1])
