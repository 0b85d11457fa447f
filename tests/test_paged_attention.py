"""Paged attention equals dense causal attention; chunked prefill equals one-shot prefill."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.engine.attention import DecodeBatch, PagedAttention, PrefillChunk
from ember.engine.kv_cache import PagedKVCache
from ember.engine.sampling_params import SamplingParams
from ember.kv.block_hash import KVLayout
from tests.conftest import LONG_TEXT

H, HKV, D, BS = 9, 3, 64, 16


def dense(q, k, v):
    """Reference: plain causal attention with K/V heads repeated. q: [T, H, D]."""
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True).transpose(0, 1)


def make_cache(num_blocks=32):
    return PagedKVCache(KVLayout("test", "float32", BS, 1, HKV, D), num_blocks)


def slots_for(table, start, n):
    return torch.tensor([table[p // BS] * BS + p % BS for p in range(start, start + n)])


def test_paged_prefill_then_decode_equals_dense():
    torch.manual_seed(0)
    T = 53
    q, k, v = torch.randn(T, H, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)
    want = dense(q, k, v)
    cache = make_cache()
    table = [7, 3, 12, 0]  # scattered, out-of-order blocks
    # prefill 30 tokens in two chunks (the second attends to cached context), then decode one by one
    got = torch.empty_like(q)
    for start, n in ((0, 20), (20, 10)):
        attn = PagedAttention(cache, slots_for(table, start, n),
                              [PrefillChunk(0, n, start, torch.tensor(table))], None, D ** -0.5)
        got[start:start + n] = attn(0, q[start:start + n], k[start:start + n], v[start:start + n])
    for pos in range(30, T):
        decode = DecodeBatch(torch.tensor([0]), torch.tensor([table]), torch.tensor([pos + 1]))
        attn = PagedAttention(cache, slots_for(table, pos, 1), [], decode, D ** -0.5)
        got[pos:pos + 1] = attn(0, q[pos:pos + 1], k[pos:pos + 1], v[pos:pos + 1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_batched_decode_with_ragged_contexts_equals_dense():
    torch.manual_seed(1)
    cache = make_cache()
    lens, tables = [5, 40, 17], [[1], [2, 9, 4], [30, 31]]
    seqs = [(torch.randn(n, H, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)) for n in lens]
    for (q, k, v), table, n in zip(seqs, tables, lens):  # fill the cache with all but the last token
        attn = PagedAttention(cache, slots_for(table, 0, n - 1),
                              [PrefillChunk(0, n - 1, 0, torch.tensor(table))], None, D ** -0.5)
        attn(0, q[:-1], k[:-1], v[:-1])
    width = max(len(t) for t in tables)
    decode = DecodeBatch(torch.arange(3), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                         torch.tensor(lens))
    slots = torch.cat([slots_for(t, n - 1, 1) for t, n in zip(tables, lens)])
    attn = PagedAttention(cache, slots, [], decode, D ** -0.5)
    out = attn(0, torch.stack([s[0][-1] for s in seqs]), torch.stack([s[1][-1] for s in seqs]),
               torch.stack([s[2][-1] for s in seqs]))
    for row, (q, k, v) in enumerate(seqs):
        torch.testing.assert_close(out[row], dense(q, k, v)[-1], rtol=1e-5, atol=1e-5)


def test_chunked_prefill_gives_the_same_tokens_as_one_shot(make_engine):
    one_shot = make_engine(kv_cache_bytes=128 * 2**20, max_num_batched_tokens=2048)
    chunked = make_engine(kv_cache_bytes=128 * 2**20, max_num_batched_tokens=100)
    ids = one_shot.tokenizer.encode(LONG_TEXT[:2500] + "\nSummary:")
    params = SamplingParams(max_tokens=12)
    [a] = one_shot.generate([ids], params)
    [b] = chunked.generate([ids], params)
    assert len(ids) > 300 and chunked.stats.num_steps >= len(ids) // 100 + 11
    assert a.token_ids == b.token_ids
