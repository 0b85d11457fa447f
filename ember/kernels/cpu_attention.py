"""Paged attention on CPU in a small C++ kernel (csrc/attention.cpp, built by ember.kernels.native),
batch-invariant by construction: every query row is computed by one fixed sequence of IEEE
operations, whatever shares its call, so prefill, chunked prefill, cached-prefix tails, decode and
speculative verify steps give a token the same bits. It reads K/V straight from the paged cache (no
gather), shares each key between the query heads of its group, and never pads queries. ctypes
releases the GIL: big calls are split over `torch.get_num_threads()` Python threads.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ember.kernels.native import available, library  # noqa: F401  (available: re-exported)

TILE_ROWS = 16  # query rows of one sequence per kernel tile (their keys are loaded once)
PARALLEL_WORK = 1 << 14  # rows x keys above which a call is split over threads (a batch-1 decode is not)

_pool: ThreadPoolExecutor | None = None


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
        # rough cost of each tile (rows x keys): to split a big call evenly over threads
        self.costs = [t[1] * (t[3] + t[1]) for t in tiles]
        self.work = sum(self.costs)
        self._plan: tuple | None = None  # (group, head_dim) -> thread ranges and scratch, made once a step

    def plan(self, group: int, head_dim: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """Tile ranges, one per thread, and their scratch: the same for every layer of the step."""
        if self._plan is None or self._plan[0] != (group, head_dim):
            padded = -(-self.max_keys // 16) * 16
            floats = self.max_rows * group * (padded + head_dim) + head_dim * (16 + padded) + 64
            threads = torch.get_num_threads() if self.work > PARALLEL_WORK else 1
            ranges = self.split(threads) if threads > 1 else [(0, self.num_tiles)]
            self._plan = ((group, head_dim), ranges, torch.empty(len(ranges), floats, dtype=torch.float32))
        return self._plan[1], self._plan[2]

    def split(self, parts: int) -> list[tuple[int, int]]:
        """[begin, end) tile ranges of about equal cost."""
        bounds, acc, begin = [], 0, 0
        share = self.work / parts
        for i, cost in enumerate(self.costs):
            acc += cost
            if acc >= share * (len(bounds) + 1) and len(bounds) < parts - 1:
                bounds.append((begin, i + 1))
                begin = i + 1
        bounds.append((begin, self.num_tiles))
        return [b for b in bounds if b[0] < b[1]]


def fits(head_dim: int) -> bool:
    """Whether heads of this size can run in the kernel here."""
    return head_dim % 16 == 0 and head_dim <= 512 and available()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tiles: Tiles,
                    scale: float) -> torch.Tensor:
    """q [N, H, D] (bf16 or fp32); k_cache, v_cache [num_blocks, block_size, Hkv, D] (bf16 or fp32).
    Returns [N, H, D] in q's dtype (the tiles cover every row)."""
    global _pool
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
    ranges, scratch = tiles.plan(group, head_dim)
    args = (q.data_ptr(), int(q.dtype == torch.bfloat16), k_cache.data_ptr(), v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16), tiles.tiles.data_ptr())

    def run(part: int) -> int:
        begin, end = ranges[part]
        return lib.ember_paged_attention(*args, begin, end, tiles.tables.data_ptr(), tiles.tables.shape[1],
                                         out.data_ptr(), heads, kv_heads, head_dim, block_size, scale,
                                         scratch[part].data_ptr())

    if len(ranges) == 1:
        codes = [run(0)]
    else:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="ember-attention")
        codes = list(_pool.map(run, range(len(ranges))))
    if any(codes):
        raise ValueError(f"paged_attention: shape not supported (head_dim {head_dim}, group {group})")
    return out
