"""Paged decode attention as a Triton kernel (GPU), with grouped-query heads.

One program per (sequence, KV head): it walks the sequence's block table, attends the
group of query heads sharing that KV head with an online softmax, and never materialises
the gathered context (the torch path in ember.engine.attention gathers it every step).
Products are done with broadcasting rather than tl.dot: decode is memory-bound, and bf16
tl.dot is wrong under Triton's CPU interpreter, which is how CI checks this kernel
(TRITON_INTERPRET=1, fp32). The engine runs it for one-token decode steps on CUDA (ember.engine.device),
and on CPU under the interpreter when attention_backend is triton (tests/test_gpu_path.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
                         BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_PAD: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_SIZE)
    g_mask = offs_g < GROUP
    q_rows = seq * stride_qb + (kv_head * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_rows, mask=g_mask[:, None], other=0.0).to(tl.float32)  # [G, D]
    ctx = tl.load(lens_ptr + seq)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for b in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
        block_id = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)  # (offsets past 2**31 in big pools)
        kv_rows = block_id * stride_kb + offs_s[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + kv_rows).to(tl.float32)  # [S, D]
        v = tl.load(v_ptr + kv_rows).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, S]
        s = tl.where((b * BLOCK_SIZE + offs_s)[None, :] < ctx, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + q_rows, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; context_lens: [B] int32. Returns [B, H, D]."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=triton.next_power_of_2(group))
    return out
