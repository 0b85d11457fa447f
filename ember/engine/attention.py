"""Attention over the paged KV cache for one engine step (pure torch, CPU-friendly).

The step's tokens are laid out sequence after sequence. Decoding sequences (one new
token) are batched: their context is gathered through the block tables and attended
with grouped queries. Prefill chunks run one sequence at a time; a chunk with no cached
context attends only to itself (no gather).

Two ways to compute it:
- fp32 activations (the reference path): torch's SDPA, causal flash over a fresh chunk.
  Its per-query result depends on the chunk (query and key block sizes follow the
  sequence length), which fp32 tolerates: it matches transformers token for token.
- bf16 activations (the served path, weights="q4"): `batch_invariant`, in fp32, with one
  recipe for every query, so a token's output is the same bits whether it was computed
  alone or batched, in a whole prompt, a chunk, a cached-prefix tail or a decode step.
  Scores are a matmul of the token's queries with its context keys, masked past its
  position, softmaxed, times the values. The recipe holds three facts measured on torch's
  CPU matmul and softmax (checked in tests/test_paged_attention.py): a matmul row is the
  same for any number of rows >= 4 (fewer take another kernel) and any number of output
  columns, but not for any reduction length (past ~128 it is split by length);
  softmax over a row padded with -inf is the same bits if the row length is a multiple of
  the vector width. So calls get at least MIN_ROWS query rows, key counts are padded to a
  multiple of KEY_ALIGN, and probabilities meet values one KEY_ALIGN block at a time.

Chunked local attention (Llama 4's rope layers, `chunks`): in such a layer a query at position p
sees only the keys of its own chunk, positions [p - p % n, p], in prefill, chunked prefill and
decode alike. Both recipes mask the keys outside (the same key blocks as a full layer, so the
batch-invariant recipe keeps its facts); the C++ kernel and the Triton decode do not take the mask,
so a model with chunked layers runs the torch recipes.

KV groups (hybrid allocation, ember.engine.block_manager): each group has its own block tables and
slots, so a step runs one PagedAttention per group (`GroupedAttention` sends each layer to its
group's). A chunked group's tables hold page 0 where its pages were given back: only keys before
the query's chunk sit there, and both recipes mask those.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from ember.engine.kv_cache import PagedKVCache
from ember.kernels import cpu_attention

MIN_ROWS = 8  # query rows per matmul (zero rows pad up to it)
KEY_ALIGN = 128  # keys are padded (masked) to whole blocks of this, and reduced block by block
QUERY_TILE = 256  # prefill queries per matmul: bounds the scores tensor (and skips keys past the tile)
# Decode attention over at most this many keys (all sequences together) runs on the calling
# thread: it is tiny (~1 MFLOP a layer at batch 1), and with OMP_WAIT_POLICY=PASSIVE each
# parallel op wakes the workers for ~0.1 ms (batch-1 q4 decode 52 -> 42 ms a step). The
# results are the same bits either way (tests/test_paged_attention.py).
SERIAL_KEYS = 2048


@dataclass
class PrefillChunk:
    token_start: int  # offset of this chunk in the step's flattened tokens
    num_tokens: int
    context_start: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_needed] long


@dataclass
class DecodeBatch:
    """Decoding sequences, batched. Each has one new token, or (a speculative verify step) its last
    token and its drafts: `query_lens` consecutive tokens from its offset."""
    token_indices: torch.Tensor  # [B] offset in the step's tokens of each sequence's first new token
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    context_lens: torch.Tensor  # [B] long, including its new tokens
    query_lens: torch.Tensor | None = None  # [B] new tokens each; None: one each

    def __post_init__(self):
        if self.query_lens is None:
            self.query_lens = torch.ones_like(self.token_indices)

    # The row layout below is only the torch recipes' (the C++ kernel takes query_lens as they are):
    # derived on first use, not on every step.
    @cached_property
    def valid(self) -> torch.Tensor:
        """[B, T]: which of each sequence's T = max(query_lens) rows are real."""
        steps = torch.arange(int(self.query_lens.max()), device=self.query_lens.device)
        return steps[None, :] < self.query_lens[:, None]

    @cached_property
    def rows(self) -> torch.Tensor:
        """[B, T]: each sequence's rows in the step (a shorter one repeats its last)."""
        steps = torch.arange(self.valid.shape[1], device=self.valid.device)
        return self.token_indices[:, None] + torch.minimum(steps[None, :], self.query_lens[:, None] - 1)

    @cached_property
    def positions(self) -> torch.Tensor:
        """[B, T]: each row's position (its token sees the keys up to it)."""
        return self.context_lens[:, None] - self.query_lens[:, None] + self.rows - self.token_indices[:, None]

    @cached_property
    def flat_rows(self) -> torch.Tensor:
        """The step's decode rows, in order."""
        return self.rows[self.valid]

    @cached_property
    def dense(self) -> bool:
        """Every sequence has T new tokens (plain decode: 1)."""
        return bool(self.valid.all())


def _visible(keys: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[..., n, S] bool: True where the query at query_pos [..., n, 1] sees the key at keys [S] (at or
    before it; window > 0: also in its own chunk of `window` positions)."""
    seen = keys <= query_pos
    return seen & (keys >= query_pos - query_pos % window) if window else seen


def _align(n: int) -> int:
    return -(-n // KEY_ALIGN) * KEY_ALIGN


def _exact_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: [B, Hkv, M, D] fp32 (M >= MIN_ROWS), keys/values: [B, Hkv, S, D] fp32 (S a multiple of
    KEY_ALIGN), hidden: bool [.., M, W], True where a query must not see a key among the last W
    (the keys before those are seen by every query). Returns [B, Hkv, M, D]."""
    batch, kv_heads, rows, _ = q.shape
    blocks = keys.shape[2] // KEY_ALIGN
    scores = torch.matmul(q * scale, keys.transpose(-1, -2))
    scores[..., scores.shape[-1] - hidden.shape[-1]:].masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, rows, blocks, KEY_ALIGN).transpose(2, 3)
    # probs @ values, reduced over keys one block of KEY_ALIGN at a time: a single matmul
    # over all S keys splits its reduction differently as S grows.
    partial = torch.matmul(probs, values.view(batch, kv_heads, blocks, KEY_ALIGN, -1))  # [B, Hkv, blocks, M, D]
    return _sum_blocks(partial)


def _sum_blocks(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 2 as a fixed tree (adjacent pairs, an odd last one carried up): the tree over
    a query's context blocks is the same however many all-zero (masked) blocks follow."""
    while x.shape[2] > 1:
        n = x.shape[2]
        pairs = x[:, :, 0:n - 1:2] + x[:, :, 1:n:2]
        x = torch.cat((pairs, x[:, :, n - 1:]), dim=2) if n % 2 else pairs
    return x[:, :, 0]


@contextmanager
def _threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad dim -2 of x up to `rows`."""
    return F.pad(x, (0, 0, 0, rows - x.shape[-2])) if x.shape[-2] < rows else x


def _heads_fp32(kv: torch.Tensor) -> torch.Tensor:
    """[2, B, S, Hkv, D] -> fp32 [2, B, Hkv, S, D], contiguous, in one copy: prefill and decode
    hand matmul the same layout (another one could pick another kernel)."""
    return kv.transpose(-3, -2).to(torch.float32, memory_format=torch.contiguous_format)


class PagedAttention:
    """The `Attend` callable the model runs each layer with."""

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor,
                 prefills: list[PrefillChunk], decode: DecodeBatch | None, scale: float,
                 batch_invariant: bool | None = None, kernel: bool | None = None, triton: bool = False,
                 chunks: tuple[int, ...] | None = None):
        """batch_invariant: None: on the bf16 path; kernel: the C++ kernel (None: when available);
        triton: one-token decodes in the Triton kernel (ember.engine.device), the rest in torch.
        chunks: per layer, 0 (causal attention over the whole context) or n (chunked local attention:
        a query sees only the keys of its own chunk of n positions; ModelArgs.attention_chunks)."""
        self.cache = cache
        self.device = cache.kv.device
        self.slot_mapping = slot_mapping
        self.prefills = prefills
        self.decode = decode
        self.scale = scale
        self.block_size = cache.layout.block_size
        # None: the served bf16 path is batch-invariant, the fp32 reference path keeps SDPA
        # a latent cache (MLA: one plane, values its keys' first columns) takes the torch recipes
        self.latent = cache.layout.planes == 1
        self.value_dim = cache.layout.head_dim  # (a latent layer's calls set theirs: fewer columns)
        if self.latent:
            batch_invariant, kernel, triton = False, False, False
        self.chunks = tuple(chunks) if chunks and any(chunks) else None
        if self.chunks is not None:  # (neither kernel masks by chunk: the torch recipes do)
            kernel, triton = False, False
        if triton or self.device.type != "cpu":  # (the batch-invariant recipes are facts of torch's CPU kernels)
            batch_invariant = False
        self.batch_invariant = cache.dtype != torch.float32 if batch_invariant is None else batch_invariant
        # the batch-invariant path runs in the C++ kernel when it could be built (None: when available)
        use_kernel = self.batch_invariant and (cpu_attention.fits(cache.layout.head_dim) if kernel is None else kernel)
        self.tiles = self._tiles(prefills, decode) if use_kernel else None
        head_dim = cache.layout.head_dim
        # (the kernel's head dimension is a tl.arange: a power of two; another runs the torch path)
        self.triton_decode = (triton and decode is not None and decode.valid.shape[1] == 1
                              and not head_dim & (head_dim - 1))
        if self.triton_decode:  # the kernel's int32 tables and lengths, made once for every layer
            self.triton_tables = decode.block_tables.to(torch.int32)
            self.triton_lens = decode.context_lens.to(torch.int32)
        elif decode is not None and self.tiles is None:  # the torch recipes' padded tables and masks
            self.decode_tables = self._pad_tables(decode.block_tables)
            max_len = self.decode_tables.shape[1] * self.block_size
            # [B, 1, T, max_len]: True where a key is context of a row's token (at or before it)
            keys = torch.arange(max_len, device=self.device)
            self.decode_mask = (keys[None, None, :] <= decode.positions[:, :, None])[:, None]
            self.decode_hidden = ~self.decode_mask
            self._masks: dict = {}
            self._local: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # window -> (mask, hidden)

    @staticmethod
    def _tiles(prefills: list[PrefillChunk], decode: DecodeBatch | None) -> cpu_attention.Tiles:
        spans = [(c.token_start, c.num_tokens, c.context_start, c.block_table) for c in prefills]
        if decode is not None:
            first_pos = decode.context_lens - decode.query_lens
            spans += [(int(r), int(n), int(p), t) for r, n, p, t in
                      zip(decode.token_indices, decode.query_lens, first_pos, decode.block_tables)]
        return cpu_attention.Tiles(spans)

    def _pad_tables(self, tables: torch.Tensor) -> torch.Tensor:
        """Block tables [B, W], padded with block 0 (masked) to whole KEY_ALIGN key blocks."""
        if not self.batch_invariant:
            return tables
        per = max(1, KEY_ALIGN // self.block_size)
        return F.pad(tables, (0, -tables.shape[1] % per))

    def _gather(self, layer_idx: int, tables: torch.Tensor) -> torch.Tensor:
        """K and V of the blocks in `tables` [B, W]: [2, B, W * block_size, Hkv, D] (a latent cache: [1, ...])."""
        kv = self.cache.layer_kv(layer_idx)  # [planes, num_blocks, block_size, Hkv, D]
        # K and V of every context block in one index_select (5x faster than two fancy-index gathers)
        return kv.index_select(1, tables.flatten()).view(kv.shape[0], tables.shape[0], -1, kv.shape[3], kv.shape[4])

    def _keys_values(self, kv: torch.Tensor, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A gather's keys and values (a latent plane's values: its first `value_dim` columns)."""
        return (kv[0], kv[0][..., :value_dim]) if self.latent else (kv[0], kv[1])

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer_idx)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        self.value_dim = v.shape[-1]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self.slot_mapping, k)
        if not self.latent:  # (a latent plane's values are its keys' first columns: v is a view of k)
            v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, self.slot_mapping, v)
        if self.tiles is not None:  # every row of the step, in one kernel call
            return cpu_attention.paged_attention(q.contiguous(), k_cache, v_cache, self.tiles, self.scale)
        decode = self._decode_triton if self.triton_decode else self._decode_exact if self.batch_invariant \
            else self._decode
        window = self.chunks[layer_idx] if self.chunks is not None else 0
        if not self.prefills:  # decode-only step: rows are already in order
            return decode(q, layer_idx, window)
        prefill = self._prefill_exact if self.batch_invariant else self._prefill
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        for chunk in self.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = prefill(q[rows], k[rows], v[rows], chunk, layer_idx, window)
        if self.decode is not None:
            out[self.decode.flat_rows] = decode(q[self.decode.flat_rows], layer_idx, window)
        return out

    def _prefill(self, q, k, v, chunk: PrefillChunk, layer_idx: int, window: int = 0) -> torch.Tensor:
        # q: [n, H, D] -> SDPA wants [1, H, n, D]. With 3-D inputs torch's CPU SDPA falls
        # back to its math path (2.7x slower at 2,048 tokens); 4-D takes the flash kernel.
        if chunk.context_start == 0 and not window:
            keys, values, mask, causal = k, v, None, True
        elif chunk.context_start == 0:  # chunked local attention over the chunk's own keys
            query_pos = torch.arange(chunk.num_tokens, device=self.device)
            keys, values, mask, causal = k, v, _visible(query_pos, query_pos[:, None], window), False
        else:
            total = chunk.context_start + chunk.num_tokens
            keys, values = (x[0, :total] for x in self._keys_values(self._gather(layer_idx, chunk.block_table[None]),
                                                                     v.shape[-1]))
            query_pos = chunk.context_start + torch.arange(chunk.num_tokens, device=self.device)
            mask = _visible(torch.arange(total, device=self.device), query_pos[:, None], window)  # [n, total]
            causal = False
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                             values.transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
                                             scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _prefill_exact(self, q, k, v, chunk: PrefillChunk, layer_idx: int, window: int = 0) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        if chunk.context_start == 0:  # the chunk's own keys, no gather
            kv = F.pad(torch.stack((k, v)), (0, 0, 0, 0, 0, _align(n) - n))[:, None]
        else:
            kv = self._gather(layer_idx, self._pad_tables(chunk.block_table[None]))
        keys, values = _heads_fp32(kv)  # [1, Hkv, S, D] each
        num_kv_heads = keys.shape[1]
        group = num_heads // num_kv_heads
        # [1, Hkv, n * G, D]: row t * G + g is query head g of token t
        qg = q.float().view(n, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(1, num_kv_heads, -1, head_dim)
        out = torch.empty_like(qg)
        for start in range(0, n, QUERY_TILE):
            stop = min(start + QUERY_TILE, n)
            rows = slice(start * group, stop * group)
            first, seen = chunk.context_start + start, _align(chunk.context_start + stop)
            # keys before the tile's first query are seen by all its queries: mask only from there
            query_pos = _pad_rows(torch.arange(first, first + stop - start).repeat_interleave(group)[:, None], MIN_ROWS)
            if window:  # chunked: keys before a query's chunk are hidden too, so mask from the first key
                hidden = ~_visible(torch.arange(seen), query_pos, window)
            else:
                hidden = torch.arange(first, seen)[None, :] > query_pos
            tile = _exact_attention(_pad_rows(qg[:, :, rows], MIN_ROWS), keys[:, :, :seen], values[:, :, :seen],
                                    hidden, self.scale)
            out[:, :, rows] = tile[:, :, :rows.stop - rows.start]
        out = out[0].view(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3)
        return out.reshape(n, num_heads, head_dim).to(q.dtype)

    def _grouped(self, q: torch.Tensor, num_kv_heads: int, min_rows: int = 1) -> torch.Tensor:
        """The decode rows' queries [R, H, D] -> fp32 [B, Hkv, max(T * G, min_rows), D], zero-padded:
        row t * G + g is query head g of the sequence's token t."""
        d = self.decode
        batch, width = d.rows.shape
        _, num_heads, head_dim = q.shape
        group = num_heads // num_kv_heads
        if d.dense:
            per_seq = q.float().view(batch, width, num_heads, head_dim)
        else:
            per_seq = torch.zeros(batch, width, num_heads, head_dim, dtype=torch.float32, device=q.device)
            per_seq[d.valid] = q.float()
        qg = per_seq.view(batch, width, num_kv_heads, group, head_dim).transpose(1, 2)
        qg = qg.reshape(batch, num_kv_heads, width * group, head_dim)
        return _pad_rows(qg, min_rows)

    def _ungrouped(self, out: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, Hkv, >= T * G, D] -> the decode rows [R, H, D] in step order."""
        d = self.decode
        batch, width = d.rows.shape
        num_kv_heads, head_dim = out.shape[1], out.shape[3]
        group = num_heads // num_kv_heads
        out = out[:, :, :width * group].reshape(batch, num_kv_heads, width, group, head_dim).transpose(1, 2)
        out = out.reshape(batch, width, num_heads, head_dim)
        return (out.reshape(-1, num_heads, head_dim) if d.dense else out[d.valid]).to(dtype)

    def _rows_mask(self, mask: torch.Tensor, group: int, rows: int) -> torch.Tensor:
        """[B, 1, T, S] per token -> [B, 1, rows, S] per query row (row t * G + g: token t); padding
        rows repeat the last token's mask (never all hidden: no NaN). With one token each, the
        [B, 1, 1, S] mask broadcasts as it is. Made once per step (every layer asks the same)."""
        if mask.shape[2] == 1:
            return mask
        key = (id(mask), group, rows)
        if key not in self._masks:
            per_row = mask.repeat_interleave(group, dim=2)
            if per_row.shape[2] < rows:
                pad = per_row[:, :, -1:].expand(-1, -1, rows - per_row.shape[2], -1)
                per_row = torch.cat([per_row, pad], dim=2)
            self._masks[key] = per_row
        return self._masks[key]

    def _decode_masks(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' (seen, hidden) masks [B, 1, T, S]; window > 0: chunked local attention (a
        row at position p sees keys [p - p % window, p]). Made once per step and window."""
        if not window:
            return self.decode_mask, self.decode_hidden
        if window not in self._local:
            keys = torch.arange(self.decode_mask.shape[-1], device=self.device)
            seen = _visible(keys, self.decode.positions[:, :, None], window)[:, None]
            self._local[window] = (seen, ~seen)
        return self._local[window]

    def _decode(self, q: torch.Tensor, layer_idx: int, window: int = 0) -> torch.Tensor:
        # Group the query heads by their KV head: [B, Hkv, T * G, D], so one matmul per KV head
        # serves all its query heads (no K/V repeat).
        num_heads = q.shape[1]
        keys, values = self._keys_values(self._gather(layer_idx, self.decode_tables).transpose(2, 3),
                                         self.value_dim)  # [B, Hkv, S, D] each
        num_kv_heads = keys.shape[1]
        qg = self._grouped(q, num_kv_heads).to(q.dtype)
        mask = self._rows_mask(self._decode_masks(window)[0], num_heads // num_kv_heads, qg.shape[2])
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scale)
        return self._ungrouped(out, num_heads, q.dtype)

    def _decode_triton(self, q: torch.Tensor, layer_idx: int, window: int = 0) -> torch.Tensor:
        from ember.kernels.triton_paged_attention import paged_decode_attention  # (imports triton: only here)
        k_cache, v_cache = self.cache.layer(layer_idx)
        return paged_decode_attention(q, k_cache, v_cache, self.triton_tables, self.triton_lens, self.scale)

    def _decode_exact(self, q: torch.Tensor, layer_idx: int, window: int = 0) -> torch.Tensor:
        num_heads = q.shape[1]
        serial = self.decode_mask.numel() <= SERIAL_KEYS
        with _threads(1) if serial else nullcontext():
            keys, values = _heads_fp32(self._gather(layer_idx, self.decode_tables))  # [B, Hkv, S, D] each
            num_kv_heads = keys.shape[1]
            qg = self._grouped(q, num_kv_heads, MIN_ROWS)
            hidden = self._rows_mask(self._decode_masks(window)[1], num_heads // num_kv_heads, qg.shape[2])
            out = _exact_attention(qg, keys, values, hidden, self.scale)
        return self._ungrouped(out, num_heads, q.dtype)


class GroupedAttention:
    """The `Attend` of a step over a cache in KV groups: each layer attends through its group's
    block tables and slots (one PagedAttention per group, all over the one cache)."""

    tiles = None  # (no captured step over groups)

    def __init__(self, cache: PagedKVCache, per_group: list[PagedAttention]):
        self.cache = cache
        self.per_group = per_group
        self.slot_mapping = per_group[0].slot_mapping

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.per_group[self.cache.group_of(layer_idx)](layer_idx, q, k, v)
