"""Compare the Triton paged decode kernel with the torch path (run by test_triton_kernels)."""
from __future__ import annotations

import sys

import torch

from ember.engine.attention import DecodeBatch, PagedAttention
from ember.engine.kv_cache import PagedKVCache
from ember.kernels.triton_paged_attention import paged_decode_attention
from ember.kv.block_hash import KVLayout


def main(device: str) -> None:
    torch.manual_seed(0)
    H, HKV, D, BS = 9, 3, 64, 16
    cache = PagedKVCache(KVLayout("t", "float32", BS, 1, HKV, D), 24)
    cache.kv.normal_()
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [9, 10, 11, 12]])
    lens = torch.tensor([40, 9, 64])
    q = torch.randn(3, H, D)
    want = PagedAttention(cache, torch.empty(0, dtype=torch.long), [], DecodeBatch(torch.arange(3), tables, lens),
                          D ** -0.5)._decode(q, 0)
    k, v = (t.to(device) for t in cache.layer(0))
    got = paged_decode_attention(q.to(device), k, v, tables.to(device, torch.int32), lens.to(device, torch.int32),
                                 D ** -0.5).cpu()
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"max abs error {err}"
    print(f"ok max_abs_err={err:.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
