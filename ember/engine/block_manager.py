"""Paged KV block allocation with prefix caching (torch-free).

Every block has a reference count. A full block whose KV has been computed gets its
chain hash registered, so later sequences with the same prefix share it. When its last
reference goes, a registered block is not freed but parked in an LRU of evictable
blocks: it stays a cache hit until the space is needed. Only blocks with no references
are ever evicted, so a running sequence never reads a block someone else overwrote.
Hashes follow each sequence's tenant chain (`Sequence.cache_salt`, ember.kv.block_hash), so
tenants never hit each other's blocks.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from ember.engine.sequence import Sequence
from ember.kv.block_hash import block_hash, parent_of


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once registered in the prefix cache
    token_ids: tuple[int, ...] | None = None  # verified on every hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, root_hash: bytes):
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.root_hash = root_hash
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # unreferenced, not cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced, cached; LRU first
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by sequences (cached-but-unreferenced ones count as free)."""
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, hash_: bytes, token_ids) -> int | None:
        block_id = self.cached.get(hash_)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None  # a hash collision must never serve someone else's KV
        return block_id

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a prefix of seq, leaving at least one token to compute."""
        bs, tokens = self.block_size, seq.token_ids
        max_blocks = (len(tokens) - 1) // bs  # the last token must be computed to get logits
        hits, parent = [], self.root_hash
        for i in range(max_blocks):
            block_tokens = tokens[i * bs:(i + 1) * bs]
            parent = block_hash(parent_of(i, parent, seq.cache_salt, seq.shared_blocks), block_tokens)
            block_id = self.lookup(parent, block_tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # -- allocation ------------------------------------------------------------
    def can_allocate(self, seq: Sequence, hits: list[int]) -> bool:
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # leave the evictable set
        needed = self.blocks_needed(seq.num_tokens) - len(hits)
        return self.num_free_blocks - revived >= needed

    def allocate(self, seq: Sequence, hits: list[int]) -> None:
        """Give seq the hit blocks plus fresh blocks for the rest of its tokens."""
        assert not seq.block_table, "sequence already holds blocks"
        for block_id in hits:
            self._ref(block_id)
        seq.block_table = list(hits)
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_fresh())

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        missing = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return missing <= self.num_free_blocks

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Ensure seq has slots for its next `num_new_tokens` tokens."""
        while len(seq.block_table) < self.blocks_needed(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._take_fresh())

    def register_computed(self, seq: Sequence) -> None:
        """Hash and publish seq's blocks that became full with computed KV."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            parent = seq.block_hashes[-1] if seq.block_hashes else self.root_hash
            h = block_hash(parent_of(i, parent, seq.cache_salt, seq.shared_blocks), tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached:  # a twin computed concurrently stays private
                block.hash, block.token_ids = h, tuple(tokens)
                self.cached[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        # Tail blocks are the least likely to be shared: park them first so they go first.
        for block_id in reversed(seq.block_table):
            self.release(block_id)
        seq.block_table = []  # block_hashes stay: they name the KV the sequence produced
        seq.num_computed_tokens = 0

    # -- import of blocks computed elsewhere -----------------------------------------
    def reserve_for_import(self, hash_: bytes) -> int:
        """A fresh block to receive imported KV for `hash_` (not yet cached).

        The block is returned referenced (ref_count 1); call `publish_import` once its
        bytes are written, or `release` to give it back.
        """
        assert hash_ not in self.cached, "block is already cached"
        return self._take_fresh()

    def publish_import(self, block_id: int, hash_: bytes, token_ids, keep_ref: bool = False) -> None:
        block = self.blocks[block_id]
        block.hash, block.token_ids = hash_, tuple(token_ids)
        self.cached[hash_] = block_id
        if not keep_ref:
            self.release(block_id)

    def pin(self, block_id: int) -> None:
        """Hold a cached block (an extra reference) so it cannot be evicted; `release` ends it."""
        self._ref(block_id)

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} released while unreferenced"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)

    # -- internals -------------------------------------------------------------------
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
            del self.cached[block.hash]
            block.hash = block.token_ids = None
            self.num_evictions += 1
        else:
            raise RuntimeError("KV pool exhausted: caller must check can_allocate/can_grow first")
        self.blocks[block_id].ref_count = 1
        return block_id
