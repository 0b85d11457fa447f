"""Content-addressed block store: preallocated slots, byte capacity, LRU eviction, pins, leases.

Holds bytes only (no torch): each block is a raw wire frame (ember.kv.wire). Frames live
in one arena of the capacity's size, cut into slots of the first frame size seen, so a block
arriving from the network is received straight into its slot. The arena is not populated up
front (that cost ~0.5 s per GiB at start and held the whole capacity resident): a slot's pages
become resident at its first write, so the store holds what its blocks use. The arena is a memfd, so a reader on
the same host can map it and copy blocks out without a socket (ember/kv/shm.py): sealed, so
this mapping is the only one that writes, and handed read-only to same-uid readers only.

A block is pinned while anyone reads it: a transfer in flight (`pinned`) or a lease
(`acquire` ... `release_lease`). Eviction is LRU over unpinned blocks only. A lease
expires unless renewed; expiry unpins its blocks, and the holder then gets LeaseError
instead of a silent success, so it never trusts bytes that may have been reused.

A lease's time to live is bounded: a request above `max_lease_s` is granted `max_lease_s`
(the holder learns the granted time and renews within it), so a holder that dies strands
its blocks for at most that long. While a call of this process still fills a lease (a
Pull across a slow link), `held` keeps it from expiring; its TTL runs from the call's end.
"""
from __future__ import annotations

import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from ember.errors import InvalidRequestError
from ember.kv.shm import sealed_arena


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    blocks_put: int = 0
    blocks_served: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    bytes_put: int = 0      # stored by writers (put, bulk put)
    bytes_served: int = 0   # read out (streams, data plane, leases)
    leases_expired: int = 0
    leases_renewed: int = 0


@dataclass
class Lease:
    lease_id: int
    block_hashes: list[bytes]
    expires_at: float
    ttl_s: float  # as granted (bounded by the store's max_lease_s)
    slots: list[int] = field(default_factory=list)
    holds: int = 0  # calls of this process still filling it: it does not expire meanwhile


class LeaseError(KeyError):
    """The lease is unknown, or it expired (its blocks may since have been reused)."""

    def __str__(self) -> str:
        return self.args[0]


DEFAULT_MAX_LEASE_S = 30.0


class BlockStore:
    def __init__(self, capacity_bytes: int, clock: Callable[[], float] = time.monotonic,
                 max_lease_s: float = DEFAULT_MAX_LEASE_S):
        if not 0 < max_lease_s < math.inf:
            raise ValueError(f"max_lease_s must be a positive number of seconds, got {max_lease_s}")
        self.capacity_bytes = capacity_bytes
        self.max_lease_s = max_lease_s
        # the only writable mapping; self.fd is read-only and the memfd sealed against writes (shm.py)
        self._map, self.fd = sealed_arena("ember-kvstore", capacity_bytes)
        self.arena = memoryview(self._map)
        self.slot_bytes = 0  # fixed by the first block stored
        self.free_slots: list[int] = []
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self.pins: Counter[bytes] = Counter()
        self.leases: dict[int, Lease] = {}
        self._expired: OrderedDict[int, float] = OrderedDict()  # recently expired lease ids, for clear errors
        self.clock = clock
        self.stats = StoreStats()
        # (added hashes, evicted hashes) -> None: the block directory publisher listens here
        self.on_change: Callable[[list[bytes], list[bytes]], None] | None = None

    @property
    def bytes(self) -> int:
        return len(self.blocks) * self.slot_bytes

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return self.arena[start:start + self.slot_bytes]

    def offset(self, block_hash: bytes) -> int:
        return self.blocks[block_hash] * self.slot_bytes

    # -- writing: reserve a slot, fill it, then commit (or abandon) it ---------------------
    def reserve(self, num_bytes: int) -> int:
        """A free slot for one incoming block (evicting the LRU unpinned block if needed).
        Write it through `view(slot)`, then `commit` or `abandon` it. MemoryError if the
        store is full of pinned blocks."""
        if not self.slot_bytes:
            if not 0 < num_bytes <= self.capacity_bytes:
                raise MemoryError(f"block of {num_bytes} bytes does not fit capacity {self.capacity_bytes}")
            self.slot_bytes = num_bytes
            self.free_slots = list(reversed(range(self.capacity_bytes // num_bytes)))
        if num_bytes != self.slot_bytes:
            raise InvalidRequestError(f"block of {num_bytes} bytes does not match this store's block size "
                                      f"{self.slot_bytes}")
        if not self.free_slots:
            self.expire_leases()
            self._evict_one()
        return self.free_slots.pop()

    def commit(self, block_hash: bytes, slot: int) -> bool:
        """File a written slot under its hash; False if the block was already here."""
        if block_hash in self.blocks:
            self.abandon(slot)
            self.blocks.move_to_end(block_hash)
            return False
        self.blocks[block_hash] = slot
        self.stats.blocks_put += 1
        if self.on_change:
            self.on_change([block_hash], [])
        return True

    def abandon(self, slot: int) -> None:
        self.free_slots.append(slot)

    def put(self, block_hash: bytes, payload) -> bool:
        """Copy a payload in; False if the block was already here."""
        if block_hash in self.blocks:
            self.blocks.move_to_end(block_hash)
            return False
        slot = self.reserve(len(payload))
        self.view(slot)[:] = payload
        return self.commit(block_hash, slot)

    # -- reading ---------------------------------------------------------------------------
    def get(self, block_hash: bytes) -> memoryview | None:
        """The payload, valid until the block is evicted: hold a pin or lease while using it."""
        slot = self.blocks.get(block_hash)
        if slot is None:
            self.stats.misses += 1
            return None
        self.blocks.move_to_end(block_hash)
        self.stats.hits += 1
        self.stats.blocks_served += 1
        self.stats.bytes_served += self.slot_bytes
        return self.view(slot)

    @contextmanager
    def pinned(self, block_hashes: list[bytes]):
        """Payloads (None where missing) that stay valid for the duration of the block."""
        payloads = [self.get(h) for h in block_hashes]
        held = [h for h, p in zip(block_hashes, payloads) if p is not None]
        self._pin(held)
        try:
            yield payloads
        finally:
            self._unpin(held)

    # -- leases: pins that outlive a call, held by a remote reader --------------------------
    def granted_ttl(self, requested_s: float) -> float:
        """The time to live a lease asking for `requested_s` gets: at most `max_lease_s`.
        InvalidRequestError unless it is a positive number of seconds."""
        if not requested_s > 0:  # NaN too
            raise InvalidRequestError(f"lease_s must be a positive number of seconds, got {requested_s}")
        return min(requested_s, self.max_lease_s)

    def acquire(self, block_hashes: list[bytes], ttl_s: float) -> Lease:
        """Pin the blocks present (see `Lease.block_hashes`) until release or expiry;
        `ttl_s` is bounded by `max_lease_s` (`Lease.ttl_s` says what was granted)."""
        self.expire_leases()
        ttl_s = self.granted_ttl(ttl_s)
        lease = Lease(self._new_lease_id(), [], self.clock() + ttl_s, ttl_s)
        self.leases[lease.lease_id] = lease
        for h in block_hashes:
            self.add_to_lease(lease.lease_id, h)
        return lease

    def _new_lease_id(self) -> int:
        """Random, not sequential: a caller cannot guess (and release or renew) another's lease."""
        while (lease_id := secrets.randbits(63)) == 0 or lease_id in self.leases:
            pass
        return lease_id

    def add_to_lease(self, lease_id: int, block_hash: bytes) -> bool:
        lease = self._live(lease_id)
        if block_hash not in self.blocks:
            return False
        self.get(block_hash)
        lease.block_hashes.append(block_hash)
        self._pin([block_hash])
        return True

    def renew(self, lease_id: int, ttl_s: float) -> Lease:
        """Extend a live lease to now + the granted `ttl_s`; LeaseError if it is gone."""
        ttl_s = self.granted_ttl(ttl_s)
        lease = self._live(lease_id)
        lease.ttl_s, lease.expires_at = ttl_s, self.clock() + ttl_s
        self.stats.leases_renewed += 1
        return lease

    @contextmanager
    def held(self, lease_id: int):
        """Keep a lease from expiring while a call of this process fills it; when the call
        ends its TTL starts afresh (the remote holder renews from then on)."""
        lease = self._live(lease_id)
        lease.holds += 1
        try:
            yield lease
        finally:
            lease.holds -= 1
            lease.expires_at = max(lease.expires_at, self.clock() + lease.ttl_s)

    def release_lease(self, lease_id: int) -> None:
        """LeaseError if the lease expired first: its blocks may have been overwritten."""
        lease = self._live(lease_id)
        del self.leases[lease_id]
        self._unpin(lease.block_hashes)

    def expire_leases(self) -> int:
        now = self.clock()
        expired = [lease for lease in self.leases.values() if lease.expires_at <= now and not lease.holds]
        for lease in expired:
            del self.leases[lease.lease_id]
            self._unpin(lease.block_hashes)
            self._expired[lease.lease_id] = now
            self.stats.leases_expired += 1
        while len(self._expired) > 4096:
            self._expired.popitem(last=False)
        return len(expired)

    def _live(self, lease_id: int) -> Lease:
        self.expire_leases()
        lease = self.leases.get(lease_id)
        if lease is not None:
            return lease
        if lease_id in self._expired:
            raise LeaseError(f"lease {lease_id} expired {self.clock() - self._expired[lease_id]:.3f} s ago; "
                             "its blocks may have been evicted and reused: fetch them again")
        raise LeaseError(f"lease {lease_id} is unknown to this kvstore (released already, or never granted)")

    def _pin(self, block_hashes: list[bytes]) -> None:
        self.pins.update(block_hashes)

    def _unpin(self, block_hashes: list[bytes]) -> None:
        self.pins.subtract(block_hashes)
        for h in set(block_hashes):
            if self.pins[h] <= 0:
                del self.pins[h]

    def _evict_one(self) -> None:
        victim = next((h for h in self.blocks if h not in self.pins), None)
        if victim is None:
            raise MemoryError(f"all {len(self.blocks)} blocks in the store are pinned by transfers or leases")
        self.abandon(self.blocks.pop(victim))
        self.stats.evictions += 1
        if self.on_change:
            self.on_change([], [victim])
