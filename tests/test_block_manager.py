"""Block manager: prefix hits, refcounts, LRU eviction of unreferenced blocks only (torch-free)."""
import pytest

from ember.engine.block_manager import BlockManager
from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import Sequence

ROOT = b"\x00" * 16


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(), seed=0)


def admit(bm, s):
    hits = bm.match_prefix(s)
    assert bm.can_allocate(s, hits)
    bm.allocate(s, hits)
    return hits


def compute_all(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.register_computed(s)


def test_shared_prefix_hits_and_is_refcounted():
    bm = BlockManager(10, 4, ROOT)
    a = seq(range(10), "a")
    admit(bm, a)
    compute_all(bm, a)
    b = seq(list(range(8)) + [50, 51, 52], "b")
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert all(bm.blocks[i].ref_count == 2 for i in hits)


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(10, 4, ROOT)
    a = seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    b = seq(range(8), "b")
    hits = admit(bm, b)
    assert len(hits) == 1 and b.num_computed_tokens == 4


def test_hash_hit_with_different_tokens_is_a_miss():
    bm = BlockManager(10, 4, ROOT)
    a = seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    bm.blocks[a.block_table[0]].token_ids = (9, 9, 9, 9)  # simulate a colliding hash
    assert bm.match_prefix(seq(range(9), "b")) == []


def test_referenced_blocks_are_never_evicted():
    bm = BlockManager(4, 4, ROOT)
    a = seq(range(8), "a")
    admit(bm, a)
    compute_all(bm, a)
    held = set(a.block_table)
    b = seq(range(100, 108), "b")
    admit(bm, b)
    assert not (set(b.block_table) & held)
    c = seq(range(200, 208), "c")
    assert not bm.can_allocate(c, [])
    with pytest.raises(RuntimeError):
        bm.allocate(c, [])  # refuses rather than stealing a referenced block
    assert all(bm.blocks[i].ref_count == 1 for i in held)


def test_lru_evicts_least_recently_freed_and_counts():
    bm = BlockManager(4, 4, ROOT)
    a, b = seq(range(8), "a"), seq(range(100, 108), "b")
    for s in (a, b):
        admit(bm, s)
        compute_all(bm, s)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 4
    c = seq(range(200, 208), "c")
    admit(bm, c)  # needs 2 blocks: evicts a's, not b's
    assert bm.num_evictions == 2
    assert bm.match_prefix(seq(range(9))) == []
    assert len(bm.match_prefix(seq(list(range(100, 108)) + [1]))) == 2


def test_free_returns_pool_to_baseline():
    bm = BlockManager(12, 4, ROOT)
    seqs = [seq(range(i, i + 9), str(i)) for i in range(3)]
    for s in seqs:
        admit(bm, s)
    assert bm.num_free_blocks == 12 - 9
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == 12
    assert all(b.ref_count == 0 for b in bm.blocks)
