"""Paged attention on CPU in a small C++ kernel (csrc/attention.cpp, built by ember.kernels.native),
batch-invariant by construction: every query row is computed by one fixed sequence of IEEE
operations, whatever shares its call, so prefill, chunked prefill, cached-prefix tails, decode and
speculative verify steps give a token the same bits. It reads K/V straight from the paged cache (no
gather), shares each key between the query heads of its group, and never pads queries. A call is
split by (tile, KV head) over the kernels' own C++ worker threads (csrc/thread_pool.h) unless it is
too small to pay for the hand-off.
"""
from __future__ import annotations

import torch

from ember.kernels.native import available, library  # noqa: F401  (available: re-exported)

TILE_ROWS = 16  # query rows of one sequence per kernel tile (their keys are loaded once)
PARALLEL_WORK = 256  # rows x keys from which a call is split over threads


class Tiles:
    """A step's query rows as kernel tiles: [T, 4] (first row, rows, sequence, first position)
    with each sequence's block table as a row of `tables` [S, W]. Made once per step."""

    def __init__(self, spans: list[tuple[int, int, int, list[int] | torch.Tensor]]):
        """spans: (first row, rows, first position, block table) per sequence element."""
        tiles, tables = [], []
        for seq, (row, rows, position, table) in enumerate(spans):
            tables.append(table.tolist() if isinstance(table, torch.Tensor) else list(table))
            for start in range(0, rows, TILE_ROWS):
                tiles.append((row + start, min(TILE_ROWS, rows - start), seq, position + start))
        width = max((len(t) for t in tables), default=1) or 1
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables] or [[0]], dtype=torch.int64)
        self.tiles = torch.tensor(tiles or [(0, 0, 0, 0)], dtype=torch.int64)[:len(tiles)]
        self.num_tiles = len(tiles)
        self.max_rows = max((t[1] for t in tiles), default=0)
        self.max_keys = max((t[3] + t[1] for t in tiles), default=0)
        self.work = sum(t[1] * (t[3] + t[1]) for t in tiles)  # rows x keys: whether to split a call
        self._scratch: tuple[tuple[int, int], int] | None = None

    def scratch_floats(self, group: int, head_dim: int) -> int:
        """Scratch floats one (tile, KV head) pair needs: the same for every layer of the step."""
        if self._scratch is None or self._scratch[0] != (group, head_dim):
            padded = -(-self.max_keys // 16) * 16
            floats = self.max_rows * group * (padded + head_dim) + head_dim * (16 + padded) + 64
            self._scratch = ((group, head_dim), floats)
        return self._scratch[1]


def fits(head_dim: int) -> bool:
    """Whether heads of this size can run in the kernel here."""
    return head_dim % 16 == 0 and head_dim <= 512 and available()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: Tiles,
                    scale: float) -> torch.Tensor:
    """q [N, H, D] (bf16 or fp32); k_cache, v_cache [num_blocks, block_size, Hkv, D] (bf16 or fp32).
    Returns [N, H, D] in q's dtype (the tiles cover every row)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the C++ kernels are unavailable here (see the log): use the torch recipe")
    num_rows, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if (q.dtype not in (torch.bfloat16, torch.float32) or k_cache.dtype not in (torch.bfloat16, torch.float32)
            or not q.is_contiguous() or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        raise ValueError("paged_attention wants contiguous bf16/fp32 q and caches")
    out = torch.empty_like(q)
    if tiles.num_tiles == 0:
        return out
    threads = torch.get_num_threads() if tiles.work >= PARALLEL_WORK else 1
    if lib.ember_paged_attention(q.data_ptr(), int(q.dtype == torch.bfloat16), k_cache.data_ptr(),
                                 v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), tiles.tiles.data_ptr(),
                                 tiles.num_tiles, tiles.tables.data_ptr(), tiles.tables.shape[1], out.data_ptr(),
                                 heads, kv_heads, head_dim, block_size, scale,
                                 tiles.scratch_floats(group, head_dim), threads):
        raise ValueError(f"paged_attention: shape not supported (head_dim {head_dim}, group {group})")
    return out
