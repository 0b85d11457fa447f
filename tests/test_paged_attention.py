"""Paged attention equals dense causal attention; chunked prefill equals one-shot prefill;
the batch-invariant path (bf16) gives every token the same bits however it was computed."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.engine import attention
from ember.engine.attention import KEY_ALIGN, MIN_ROWS, DecodeBatch, PagedAttention, PrefillChunk
from ember.engine.kv_cache import PagedKVCache
from ember.engine.sampling_params import SamplingParams
from ember.kernels import cpu_attention
from ember.kv.block_hash import KVLayout
from tests.conftest import LONG_TEXT

H, HKV, D, BS = 9, 3, 64, 16


def dense(q, k, v):
    """Reference: plain causal attention with K/V heads repeated. q: [T, H, D]."""
    k = k.repeat_interleave(H // HKV, dim=1)
    v = v.repeat_interleave(H // HKV, dim=1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True).transpose(0, 1)


def make_cache(num_blocks=32, dtype="float32"):
    return PagedKVCache(KVLayout("test", dtype, BS, 1, HKV, D), num_blocks)


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


def run_sequence(q, k, v, chunks, decode_from, table, dtype, others=0, attention=None, **kw):
    """Attention outputs of one sequence: prefill in `chunks` up to `decode_from`, then one
    decode step per token, batched with `others` unrelated sequences. attention: more PagedAttention
    keywords (its own `chunks`, say)."""
    kw |= attention or {}
    cache = make_cache(128, dtype)
    out, start, T = torch.empty_like(q), 0, q.shape[0]
    for n in chunks:
        n = min(n, decode_from - start)
        if n == 0:
            break
        attn = PagedAttention(cache, slots_for(table, start, n),
                              [PrefillChunk(0, n, start, torch.tensor(table))], None, D ** -0.5, **kw)
        out[start:start + n] = attn(0, q[start:start + n], k[start:start + n], v[start:start + n])
        start += n
    assert start == decode_from
    other_tables = [[100 + 2 * i, 101 + 2 * i] for i in range(others)]  # ragged 20.. token contexts
    for pos in range(decode_from, T):
        lens = [pos + 1] + [20 + i for i in range(others)]
        tables = [table] + [t + [0] * (len(table) - 2) for t in other_tables]
        slots = torch.cat([slots_for(table, pos, 1)] + [slots_for(t, n - 1, 1) for t, n in zip(other_tables, lens[1:])])
        noise = [torch.randn(others, h, D).to(q.dtype) for h in (H, HKV, HKV)]
        attn = PagedAttention(cache, slots, [], DecodeBatch(torch.arange(1 + others), torch.tensor(tables),
                                                            torch.tensor(lens)), D ** -0.5, **kw)
        out[pos] = attn(0, *(torch.cat([x[pos:pos + 1], n]) for x, n in zip((q, k, v), noise)))[0]
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("decode_threads", ["serial", "parallel"])
@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_batch_invariant_attention_is_the_same_bits_however_computed(dtype, decode_threads, kernel, monkeypatch):
    """One prompt, one chunk vs many chunk sizes vs decode steps batched with others: equal bits.
    300 tokens: more than a query tile (256), keys across many KEY_ALIGN blocks. Decode on
    the calling thread or on all threads (prefill uses all): the same bits too. Both ways of
    computing it: the C++ kernel (ember.kernels.cpu_attention; its calls split over threads or
    not) and the torch recipe."""
    monkeypatch.setattr(attention, "SERIAL_KEYS", 10**9 if decode_threads == "serial" else 0)
    monkeypatch.setattr(cpu_attention, "PARALLEL_WORK", 10**12 if decode_threads == "serial" else 0)
    torch.manual_seed(2)
    T, kw = 300, {"batch_invariant": True, "kernel": kernel == "cpp"}
    q, k, v = (torch.randn(T, h, D).to(getattr(torch, dtype)) for h in (H, HKV, HKV))
    table = list(range(40, 40 + T // BS + 1))[::-1]
    one_shot = run_sequence(q, k, v, [T], T, table, dtype, **kw)
    want = dense(q.float(), k.float(), v.float())
    torch.testing.assert_close(one_shot.float(), want, rtol=1e-2 if dtype == "bfloat16" else 1e-5,
                               atol=1e-2 if dtype == "bfloat16" else 1e-5)
    for chunks, decode_from, others in (([64] * 5, T, 0), ([7, 100, 33] * 4, T, 0), ([250], 250, 0),
                                        ([17], 17, 5), ([1] * 40 + [200], 240, 2)):
        got = run_sequence(q, k, v, chunks, decode_from, table, dtype, others, **kw)
        differ = (got != one_shot).flatten(1).any(-1).nonzero().flatten().tolist()
        assert not differ, f"chunks {chunks[:3]}.., decode from {decode_from}: tokens {differ[:8]} differ"


def test_bf16_cache_takes_the_batch_invariant_path_fp32_keeps_sdpa():
    table = torch.tensor([0])
    assert PagedAttention(make_cache(4, "bfloat16"), table, [], None, 1.0).batch_invariant
    assert not PagedAttention(make_cache(4, "float32"), table, [], None, 1.0).batch_invariant


def test_the_cpp_kernel_builds_here_and_serves_the_bf16_path():
    """CI and every supported machine have a C++ compiler: the kernel must not fall back silently."""
    assert cpu_attention.available()
    assert PagedAttention(make_cache(4, "bfloat16"), torch.tensor([0]), [], None, 1.0).tiles is not None
    assert PagedAttention(make_cache(4, "float32"), torch.tensor([0]), [], None, 1.0).tiles is None


def test_speculative_verify_rows_equal_their_decode_steps():
    """A decode element of several rows (last token + drafts) gives each row the bits a one-row decode
    step at its position gives, batched beside a plain decode and a prefill chunk."""
    torch.manual_seed(4)
    T = 90
    q, k, v = (torch.randn(T, h, D).to(torch.bfloat16) for h in (H, HKV, HKV))
    table = list(range(10, 10 + T // BS + 1))
    want = run_sequence(q, k, v, [80], 80, table, "bfloat16", batch_invariant=True)
    cache = make_cache(128, "bfloat16")
    PagedAttention(cache, slots_for(table, 0, 80), [PrefillChunk(0, 80, 0, torch.tensor(table))], None,
                   D ** -0.5)(0, q[:80], k[:80], v[:80])
    other = list(range(60, 63))
    PagedAttention(cache, slots_for(other, 0, 40), [PrefillChunk(0, 40, 0, torch.tensor(other))], None,
                   D ** -0.5)(0, q[:40], k[:40], v[:40])
    # one step: the other sequence decodes its token 40, ours verifies 80..85, a third prefills 20
    third = list(range(70, 73))
    rows = torch.cat([q[40:41], q[80:86], q[:20]]), torch.cat([k[40:41], k[80:86], k[:20]]), \
        torch.cat([v[40:41], v[80:86], v[:20]])
    slots = torch.cat([slots_for(other, 40, 1), slots_for(table, 80, 6), slots_for(third, 0, 20)])
    tables = torch.tensor([other + [0] * (len(table) - 3), table])
    decode = DecodeBatch(torch.tensor([0, 1]), tables, torch.tensor([41, 86]), torch.tensor([1, 6]))
    out = PagedAttention(cache, slots, [PrefillChunk(7, 20, 0, torch.tensor(third))], decode, D ** -0.5)(0, *rows)
    assert torch.equal(out[1:7], want[80:86])
    assert torch.equal(out[7:], want[:20])  # the prefill rows: the first 20 of a one-shot prompt


def test_torch_facts_the_batch_invariant_attention_relies_on():
    """If torch or the CPU changes these, ember.engine.attention's recipe needs another look."""
    torch.manual_seed(3)
    q, keys, probs = torch.randn(3, 768, D), torch.randn(3, 640, D), torch.rand(3, 768, KEY_ALIGN)
    scores = torch.matmul(q, keys.transpose(-1, -2))
    for rows in (MIN_ROWS, 48, 768):  # a row's scores: the same for any row count >= MIN_ROWS and key count
        for n_keys in (KEY_ALIGN, 320, 640):
            assert torch.equal(torch.matmul(q[:, :rows], keys[:, :n_keys].transpose(-1, -2))[:, :MIN_ROWS],
                               scores[:, :MIN_ROWS, :n_keys])
        # one KEY_ALIGN block of probabilities times values: the same for any row count
        assert torch.equal(torch.matmul(probs[:, :rows], keys[:, :KEY_ALIGN])[:, :MIN_ROWS],
                           torch.matmul(probs[:, :MIN_ROWS], keys[:, :KEY_ALIGN]))
    row = torch.randn(1, 640)
    for seen in (1, 37, 64, 200):  # softmax over -inf padding to whole KEY_ALIGN blocks
        masked = row.clone()
        masked[:, seen:] = float("-inf")
        ref = torch.softmax(masked[:, :-(-seen // KEY_ALIGN) * KEY_ALIGN], -1)
        assert torch.equal(torch.softmax(masked, -1)[:, :ref.shape[1]], ref)


def test_chunked_prefill_gives_the_same_tokens_as_one_shot(make_engine):
    one_shot = make_engine(kv_cache_mb=128, max_num_batched_tokens=2048)
    chunked = make_engine(kv_cache_mb=128, max_num_batched_tokens=100)
    ids = one_shot.tokenizer.encode(LONG_TEXT[:2500] + "\nSummary:")
    params = SamplingParams(max_tokens=12)
    [a] = one_shot.generate([ids], params)
    [b] = chunked.generate([ids], params)
    assert len(ids) > 300 and chunked.stats.num_steps >= len(ids) // 100 + 11
    assert a.token_ids == b.token_ids


def dense_local(q, k, v, window):
    """Reference chunked local attention: a query at p sees the keys at [p - p % window, p]."""
    pos = torch.arange(q.shape[0])
    seen = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= (pos - pos % window)[:, None])
    k, v = (x.repeat_interleave(H // HKV, dim=1).transpose(0, 1) for x in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=seen).transpose(0, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_local_attention_sees_only_its_chunk_in_prefill_chunked_prefill_and_decode(dtype):
    """Llama 4's rope layers (PagedAttention chunks): a query sees only the keys of its own chunk of
    positions, however the sequence was computed: one prefill, chunks of any size (beside the window
    or across it), decode steps batched with others, a verify step's rows. fp32 (SDPA) equals the
    dense reference; bf16 (the batch-invariant torch recipe: the C++ kernel does not take chunks)
    gives the same bits every way. Layer 1 of the same step is a full-attention layer."""
    torch.manual_seed(5)
    T, window = 300, 24  # (not a multiple of the block size)
    kw = {"chunks": (window, 0)}
    q, k, v = (torch.randn(T, h, D).to(getattr(torch, dtype)) for h in (H, HKV, HKV))
    table = list(range(40, 40 + T // BS + 1))[::-1]
    assert PagedAttention(make_cache(4, dtype), torch.tensor([0]), [], None, 1.0, **kw).tiles is None
    want = dense_local(q.float(), k.float(), v.float(), window)
    one_shot = run_sequence(q, k, v, [T], T, table, dtype, attention=kw)
    tol = 1e-2 if dtype == "bfloat16" else 1e-5
    torch.testing.assert_close(one_shot.float(), want, rtol=tol, atol=tol)
    assert not torch.allclose(want, dense(q.float(), k.float(), v.float()), atol=0.1)  # (the mask matters)
    for chunks, decode_from, others in (([64] * 5, T, 0), ([7, 100, 33] * 4, T, 0), ([250], 250, 0),
                                        ([17], 17, 5), ([1] * 40 + [200], 240, 2)):
        got = run_sequence(q, k, v, chunks, decode_from, table, dtype, others, attention=kw)
        if dtype == "bfloat16":
            differ = (got != one_shot).flatten(1).any(-1).nonzero().flatten().tolist()
            assert not differ, f"chunks {chunks[:3]}.., decode from {decode_from}: tokens {differ[:8]} differ"
        else:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # a verify step's rows 70..75 (across the chunk boundary at 72); then layer 1, a full-attention layer
    cache = make_cache(128, dtype)
    PagedAttention(cache, slots_for(table, 0, 70), [PrefillChunk(0, 70, 0, torch.tensor(table))], None, D ** -0.5,
                   **kw)(0, q[:70], k[:70], v[:70])
    decode = DecodeBatch(torch.tensor([0]), torch.tensor([table]), torch.tensor([76]), torch.tensor([6]))
    out = PagedAttention(cache, slots_for(table, 70, 6), [], decode, D ** -0.5, **kw)(0, q[70:76], k[70:76], v[70:76])
    if dtype == "bfloat16":
        assert torch.equal(out, one_shot[70:76])
    else:
        torch.testing.assert_close(out, want[70:76], rtol=tol, atol=tol)
    two_layers = PagedKVCache(KVLayout("test", dtype, BS, 2, HKV, D), 128)
    full = PagedAttention(two_layers, slots_for(table, 0, T), [PrefillChunk(0, T, 0, torch.tensor(table))],
                          None, D ** -0.5, **kw)(1, q, k, v)
    torch.testing.assert_close(full.float(), dense(q.float(), k.float(), v.float()), rtol=tol, atol=tol)
