"""Paged KV block allocation with prefix caching (torch-free).

Every block has a reference count. A full block whose KV has been computed gets its
chain hash registered, so later sequences with the same prefix share it. When its last
reference goes, a registered block is not freed but parked in an LRU of evictable
blocks: it stays a cache hit until the space is needed. Only blocks with no references
are ever evicted, so a running sequence never reads a block someone else overwrote.
Hashes follow each sequence's tenant chain (`Sequence.cache_salt`, ember.kv.block_hash), so
tenants never hit each other's blocks.

Hybrid allocation (`KVGroups`: Llama 4's chunked-attention layers beside its global ones, as vLLM's
hybrid allocator does it): the layers are split into KV groups of equally many layers, each group
a kind of attention (0: every key; n > 0: a query sees only its own n-position chunk). A block id
is then a *page*: one block's KV for one group's layers (the pool is [layers per group, planes,
pages, ...], ember.engine.kv_cache); every group draws pages from the one pool. A sequence has a
block table per group (`Sequence.block_table`: group 0, a full group; `Sequence.group_tables`: the
others). A chunked group holds only the pages from the start of the chunk of the sequence's next
query on: as the computed prefix crosses a chunk boundary the pages before it go back to the pool
(cached ones stay hits until evicted) and the table keeps `FREED` there (those layers mask every key
outside the query's chunk, so they never read it). Prefix hits are per group: a hit of k blocks
needs a full group's pages for all k blocks and a chunked group's from the chunk start of position
k * block_size on; where those were evicted the hit is cut back to where they are present (at worst
the last chunk boundary, which needs none). While a sequence computes what it was admitted with, the
chunked pages its steps will need at most (a chunk plus a step's tokens) stay reserved for it, so a
prefill admitted never stalls midway for want of pages.

Public handles (`lookup`, `pin`, `release`, `reserve_for_import`, `publish_import`, `cached`): a
block id with one group; with several, a tuple of page ids, one per group, and `cached` holds only
hashes whose pages are present in every group (what an export needs: ember.engine.kv_cache).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from math import gcd

from ember.engine.sequence import Sequence
from ember.kv.block_hash import block_hash, parent_of

FREED = -1  # a chunked group's table entry whose page went back to the pool (never read)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once registered in the prefix cache
    token_ids: tuple[int, ...] | None = None  # verified on every hit
    group: int = 0  # the KV group whose cache the hash is registered in


@dataclass(frozen=True)
class KVGroups:
    """Layers grouped by attention kind, the same number in each group (vLLM's KV cache groups).

    windows[g]: 0 (a full group: every key) or n (chunked local attention over n positions);
    layers[g]: the model layers of group g, in order; a layer's slot in the pool is its index there.
    Group 0 is a full group."""
    windows: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]

    @property
    def layers_per_group(self) -> int:
        return len(self.layers[0])

    @property
    def num_layers(self) -> int:
        return sum(len(ls) for ls in self.layers)

    def placement(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a model layer."""
        for g, ls in enumerate(self.layers):
            if layer in ls:
                return g, ls.index(layer)
        raise IndexError(f"layer {layer} is in no KV group")


def kv_groups(attention_chunks: tuple[int, ...] | None) -> KVGroups | None:
    """The hybrid grouping of a model's layers (ModelArgs.attention_chunks), or None where one group
    does: no chunked layer, or no full one (group 0 is full). Each kind's layers are split into
    groups of gcd(layer counts of the kinds) consecutive layers, so no group needs padding (Llama 4
    Scout: 12 NoPE layers, 36 chunked: one full group, three chunked, twelve layers each)."""
    if not attention_chunks or not any(attention_chunks) or all(attention_chunks):
        return None
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(attention_chunks):
        kinds.setdefault(window, []).append(layer)
    size = 0
    for ls in kinds.values():
        size = gcd(size, len(ls))
    windows, layers = [], []
    for window in sorted(kinds):  # 0 (full) first
        ls = kinds[window]
        for i in range(0, len(ls), size):
            windows.append(window)
            layers.append(tuple(ls[i:i + size]))
    return KVGroups(tuple(windows), tuple(layers))


class GroupHits(list):
    """match_prefix's answer with several groups: a list of group 0's hit pages (its len is the hit
    in blocks, as with one group), and `tables`: per group, the hit pages of each block (None where
    a chunked group needs none: before the chunk of the first token to compute)."""

    def __init__(self, tables: list[list[int | None]]):
        super().__init__(tables[0])
        self.tables = tables


class _Complete:
    """`BlockManager.cached` with several groups: the hashes whose pages every group holds (one can
    be exported whole, and need not be imported), each to its tuple of pages."""

    def __init__(self, bm: BlockManager):
        self._bm = bm

    def get(self, hash_: bytes, default=None):
        pages = tuple(c.get(hash_) for c in self._bm.group_cached)
        return default if None in pages else pages

    def __contains__(self, hash_: bytes) -> bool:
        return self.get(hash_) is not None

    def __len__(self) -> int:
        return sum(1 for h in self._bm.group_cached[0] if h in self)

    def __iter__(self):
        return (h for h in list(self._bm.group_cached[0]) if h in self)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, root_hash: bytes, groups: KVGroups | None = None,
                 max_step_tokens: int | None = None):
        """groups: hybrid allocation (see the module's docstring); num_blocks then counts pages.
        max_step_tokens: the most tokens one step computes for a sequence (the scheduler's budget):
        bounds the chunked pages reserved for an admitted prefill (unset: its whole prompt)."""
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.root_hash = root_hash
        self.groups = groups
        self.windows = groups.windows if groups is not None else (0,)
        self.max_step_tokens = max_step_tokens
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # unreferenced, not cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached; LRU first
        self.group_cached: list[dict[bytes, int]] = [{} for _ in self.windows]  # per group: hash -> page
        self.cached = self.group_cached[0] if groups is None else _Complete(self)
        self.num_evictions = 0
        # chunked pages promised to sequences computing what they were admitted with:
        # id(seq) -> [pages left, tokens it was admitted to compute, pages promised at admission]
        self._reserved: dict[int, list[int]] = {}
        self._reserved_total = 0

    # -- queries ---------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks anyone may take (reservations of admitted prefills excluded)."""
        return len(self.free_ids) + len(self.evictable) - self._reserved_total

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by sequences (cached-but-unreferenced ones count as free)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def hybrid(self) -> bool:
        return self.groups is not None

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block table of each group (group 0's is seq.block_table)."""
        return [seq.block_table, *seq.group_tables] if self.groups is not None else [seq.block_table]

    def first_needed(self, position: int, window: int) -> int:
        """The first block a query at `position` reads in a group of `window` (0: full)."""
        return (position - position % window) // self.block_size if window else 0

    def lookup(self, hash_: bytes, token_ids):
        if self.groups is None:
            return self._lookup(0, hash_, token_ids)
        pages = tuple(self._lookup(g, hash_, token_ids) for g in range(len(self.windows)))
        return None if None in pages else pages

    def _lookup(self, group: int, hash_: bytes, token_ids) -> int | None:
        block_id = self.group_cached[group].get(hash_)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None  # a hash collision must never serve someone else's KV
        return block_id

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a prefix of seq, leaving at least one token to compute (with several
        groups: a GroupHits, cut back to where every chunked group holds what it reads)."""
        bs, tokens = self.block_size, seq.token_ids
        max_blocks = (len(tokens) - 1) // bs  # the last token must be computed to get logits
        full = [g for g, w in enumerate(self.windows) if not w]
        chunked = [g for g, w in enumerate(self.windows) if w]
        tables: list[list[int | None]] = [[] for _ in self.windows]
        parent = self.root_hash
        for i in range(max_blocks):
            block_tokens = tokens[i * bs:(i + 1) * bs]
            parent = block_hash(parent_of(i, parent, seq.cache_salt, seq.shared_blocks), block_tokens)
            pages = [self._lookup(g, parent, block_tokens) for g in full]
            if None in pages:
                break
            for g, page in zip(full, pages):
                tables[g].append(page)
            for g in chunked:
                tables[g].append(self._lookup(g, parent, block_tokens))
        if self.groups is None:
            return tables[0]
        hit = len(tables[0])
        while hit and not all(p is not None for g in chunked
                              for p in tables[g][self.first_needed(hit * bs, self.windows[g]):hit]):
            hit -= 1
        for g, table in enumerate(tables):
            start = self.first_needed(hit * bs, self.windows[g])
            tables[g] = [None] * start + table[start:hit]
        return GroupHits(tables)

    # -- allocation ------------------------------------------------------------
    def can_allocate(self, seq: Sequence, hits: list[int]) -> bool:
        revived = sum(1 for b in self._hit_pages(hits) if self.blocks[b].ref_count == 0)  # leave the evictable set
        return self.num_free_blocks - revived >= self._admission_pages(seq, len(hits))

    def allocate(self, seq: Sequence, hits: list[int]) -> None:
        """Give seq the hit blocks plus fresh blocks for the rest of its tokens (a chunked group: only
        its hits now, and a reservation for what its steps will take)."""
        assert not seq.block_table, "sequence already holds blocks"
        if self.groups is None:
            for block_id in hits:
                self._ref(block_id)
            seq.block_table = list(hits)
            seq.block_hashes = [self.blocks[b].hash for b in hits]
            seq.num_computed_tokens = len(hits) * self.block_size
            for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
                seq.block_table.append(self._take_fresh())
            return
        if self.num_free_blocks - sum(1 for b in self._hit_pages(hits) if self.blocks[b].ref_count == 0) \
                < self._admission_pages(seq, len(hits)):
            raise RuntimeError("KV pool exhausted: caller must check can_allocate first")
        reserve = self._admission_pages(seq, len(hits)) - self._full_pages(seq, len(hits))
        assert isinstance(hits, GroupHits) or not hits, "hits of several groups come from match_prefix"
        hit_tables = hits.tables if isinstance(hits, GroupHits) else [[] for _ in self.windows]
        tables = [[FREED if p is None else p for p in table] for table in hit_tables]
        for p in self._hit_pages(hits):  # every group's hits first: taking fresh pages must not evict one
            self._ref(p)
        for window, table in zip(self.windows, tables):
            if not window:
                table += [self._take_fresh() for _ in range(self.blocks_needed(seq.num_tokens) - len(hits))]
        seq.block_table, seq.group_tables = tables[0], tables[1:]
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        if reserve:
            self._reserved[id(seq)] = [reserve, seq.num_tokens, reserve]
            self._reserved_total += reserve

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        missing = self._missing(seq, seq.num_computed_tokens + num_new_tokens)
        return missing <= self.num_free_blocks + self._own_reserve(seq)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Ensure seq has slots for its next `num_new_tokens` tokens (a chunked group: from the chunk
        start of the first of them on)."""
        if self.groups is None:
            while len(seq.block_table) < self.blocks_needed(seq.num_computed_tokens + num_new_tokens):
                seq.block_table.append(self._take_fresh())
            return
        self._trim(seq)
        start, end = seq.num_computed_tokens, self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        for window, table in zip(self.windows, self.tables(seq)):
            if not window:
                while len(table) < end:
                    table.append(self._take(seq, reserved=False))
                continue
            # (a chunked table holds pages from its next query's chunk start to its end: only what is
            # appended needs them)
            first = self.first_needed(start, window)
            while len(table) < end:
                table.append(self._take(seq) if len(table) >= first else FREED)

    def register_computed(self, seq: Sequence) -> None:
        """Hash and publish seq's blocks that became full with computed KV (every group holding a page
        for them), then give back the chunked pages no later query reads."""
        bs = self.block_size
        tables = self.tables(seq)
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            parent = seq.block_hashes[-1] if seq.block_hashes else self.root_hash
            h = block_hash(parent_of(i, parent, seq.cache_salt, seq.shared_blocks), tokens)
            seq.block_hashes.append(h)
            for g, table in enumerate(tables):
                if i < len(table) and table[i] != FREED and h not in self.group_cached[g]:
                    # (a twin computed concurrently stays private)
                    self._register(table[i], g, h, tokens)
        if self.groups is not None:
            self._trim(seq)
            reserved = self._reserved.get(id(seq))
            if reserved is not None and seq.num_computed_tokens >= reserved[1]:
                self._unreserve(seq)

    def free(self, seq: Sequence) -> None:
        # Tail blocks are the least likely to be shared: park them first so they go first.
        for table in reversed(self.tables(seq)):
            for block_id in reversed(table):
                if block_id != FREED:
                    self.release(block_id)
        seq.block_table = []  # block_hashes stay: they name the KV the sequence produced
        seq.group_tables = []
        seq.num_computed_tokens = 0
        self._unreserve(seq)

    # -- import of blocks computed elsewhere -----------------------------------------
    def can_import(self) -> bool:
        """A whole block (a page in every group) can be reserved for an import."""
        return self.num_free_blocks >= len(self.windows)

    def reserve_for_import(self, hash_: bytes):
        """A fresh block to receive imported KV for `hash_` (not yet cached); with several groups a
        page in each.

        The block is returned referenced (ref_count 1); call `publish_import` once its
        bytes are written, or `release` to give it back.
        """
        assert hash_ not in self.cached, "block is already cached"
        if self.groups is None:
            return self._take_fresh()
        return tuple(self._take_fresh() for _ in self.windows)

    def publish_import(self, block_id, hash_: bytes, token_ids, keep_ref: bool = False) -> None:
        pages = (block_id,) if self.groups is None else block_id
        for g, page in enumerate(pages):
            if hash_ not in self.group_cached[g]:  # (a group holding it already keeps its own: this stays private)
                self._register(page, g, hash_, token_ids)
        if not keep_ref:
            self.release(block_id)

    def pin(self, block_id) -> None:
        """Hold a cached block (an extra reference) so it cannot be evicted; `release` ends it."""
        for page in self._pages(block_id):
            self._ref(page)

    def release(self, block_id) -> None:
        for page in self._pages(block_id):
            block = self.blocks[page]
            assert block.ref_count > 0, f"block {page} released while unreferenced"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.evictable[page] = None
                else:
                    self.free_ids.append(page)

    # -- internals -------------------------------------------------------------------
    @staticmethod
    def _pages(handle) -> tuple[int, ...]:
        return handle if isinstance(handle, tuple) else (handle,)

    def _hit_pages(self, hits) -> list[int]:
        if isinstance(hits, GroupHits):
            return [p for table in hits.tables for p in table if p is not None]
        return list(hits)

    def _full_pages(self, seq: Sequence, hit: int) -> int:
        return sum(1 for w in self.windows if not w) * (self.blocks_needed(seq.num_tokens) - hit)

    def _admission_pages(self, seq: Sequence, hit: int) -> int:
        return self._pages_at_once(seq.num_tokens, hit)

    def _pages_at_once(self, num_tokens: int, hit: int) -> int:
        """Fresh pages admission takes or reserves: full groups' for every block past the hit; each
        chunked group's most held at once while the rest is computed (a chunk and a step's tokens)."""
        need = sum(1 for w in self.windows if not w) * (self.blocks_needed(num_tokens) - hit)
        for w in self.windows:
            if w:
                span = self.blocks_needed(num_tokens) - hit  # (chunked pages before it are hits or not needed)
                if self.max_step_tokens is not None:
                    span = min(span, self.blocks_needed(w) + self.blocks_needed(self.max_step_tokens) + 1)
                need += max(span, 0)
        return need

    def pages_needed(self, num_tokens: int) -> int:
        """The most pages one sequence of `num_tokens` tokens holds at once (admitted whole, with nothing
        cached): more than the pool has, and it could never run. Without groups: its blocks."""
        return self._pages_at_once(num_tokens, 0)

    def _missing(self, seq: Sequence, end_tokens: int) -> int:
        """Pages seq lacks to hold KV up to `end_tokens` (a chunked group: from its next query's chunk)."""
        end = self.blocks_needed(end_tokens)
        missing = 0
        for window, table in zip(self.windows, self.tables(seq)):
            # (a chunked table's entries from its next query's chunk start on hold pages: see grow)
            missing += max(0, end - max(len(table), self.first_needed(seq.num_computed_tokens, window)))
        return missing

    def _trim(self, seq: Sequence) -> None:
        """Give back chunked pages before the chunk of seq's next query (num_computed_tokens). While
        seq holds a reservation, each page that becomes free goes back into it (up to what admission
        promised): its later chunks take those, so its pages at once stay within the reservation."""
        reserved = self._reserved.get(id(seq))
        for window, table in zip(self.windows, self.tables(seq)):
            if window:
                first = min(self.first_needed(seq.num_computed_tokens, window), len(table))
                # given back up to here already: entries before a chunk start are FREED from the front
                done = first
                while done > 0 and table[done - 1] != FREED:
                    done -= 1
                for i in range(done, first):
                    if table[i] != FREED:
                        self.release(table[i])
                        if reserved is not None and self.blocks[table[i]].ref_count == 0 and reserved[0] < reserved[2]:
                            reserved[0] += 1
                            self._reserved_total += 1
                        table[i] = FREED

    def _own_reserve(self, seq: Sequence) -> int:
        reserved = self._reserved.get(id(seq))
        return reserved[0] if reserved is not None else 0

    def _unreserve(self, seq: Sequence) -> None:
        reserved = self._reserved.pop(id(seq), None)
        if reserved is not None:
            self._reserved_total -= reserved[0]

    def _take(self, seq: Sequence, reserved: bool = True) -> int:
        """A fresh page for seq: from its reservation while it has one (`reserved`), else from the free
        pages."""
        reserved = self._reserved.get(id(seq)) if reserved else None
        if reserved is not None and reserved[0] > 0:
            reserved[0] -= 1
            self._reserved_total -= 1
        elif self.num_free_blocks <= 0:
            raise RuntimeError("KV pool exhausted: caller must check can_grow first")
        return self._take_fresh()

    def _register(self, block_id: int, group: int, hash_: bytes, token_ids) -> None:
        block = self.blocks[block_id]
        block.hash, block.token_ids, block.group = hash_, tuple(token_ids), group
        self.group_cached[group][hash_] = block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.pop(block_id, None)
        block.ref_count += 1

    def _take_fresh(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.group_cached[block.group][block.hash]
            block.hash = block.token_ids = None
            self.num_evictions += 1
        else:
            raise RuntimeError("KV pool exhausted: caller must check can_allocate/can_grow first")
        self.blocks[block_id].ref_count = 1
        return block_id
