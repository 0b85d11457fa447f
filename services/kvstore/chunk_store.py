"""A kvstore's model chunks at rest: a content-addressed folder, bounded, LRU over unpinned models.

Layout under `root` (kvstore.chunks_dir, default <user cache>/chunks/<site>):
- `chunks/<hash[:2]>/<hash>.<codec>`: a chunk's bytes as stored (encoded by ember.model.weight_codec;
  the codec id is in the name), written to a temporary name and renamed, so a file is whole or absent;
- `manifests/<id>.json`: the manifests of the models this store holds (their bytes hash to their id).

The store's capacity counts stored (encoded) bytes. Adding beyond it evicts whole models, least
recently used first, never a pinned one (a worker of the site holds a lease on the model it runs, or
one being pulled here): their chunks that no other held model shares, then their manifest. Chunks of
no manifest (left by a pull that failed) go first. Nothing here verifies bytes: the service does (on
arrival, and on request when a reader found one bad), and `drop` removes a chunk found bad.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ember.errors import CapacityError
from ember.model.weight_chunks import Chunk, Manifest, ManifestError
from ember.util import direct_io


class ModelLeaseError(LookupError):
    """A model lease that expired or never existed."""


@dataclass
class ModelLease:
    lease_id: int
    model_id: str
    expires_at: float


@dataclass
class _Held:
    manifest: Manifest
    last_used: float
    leases: set[int] = field(default_factory=set)


class ChunkStore:
    def __init__(self, root: str | Path, capacity_bytes: int, clock=time.monotonic):
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.clock = clock
        (self.root / "chunks").mkdir(parents=True, exist_ok=True)
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)
        self.chunks: dict[str, tuple[int, int]] = {}  # hash -> (codec, stored bytes)
        self.models: dict[str, _Held] = {}            # manifest id -> held model
        self.leases: dict[int, ModelLease] = {}
        self._lease_ids = itertools.count(1)
        self.bytes = 0
        self.evictions = 0
        self._scan()

    # --- what is here ---
    def _scan(self) -> None:
        for path in (self.root / "chunks").glob("*/*"):
            stem, _, codec = path.name.partition(".")
            if not codec.isdigit() or path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write that never finished
                continue
            size = path.stat().st_size
            self.chunks[stem] = (int(codec), size)
            self.bytes += size
        for path in (self.root / "manifests").glob("*.json"):
            try:
                manifest = Manifest.from_json(path.read_bytes(), expect_id=path.stem)
            except (OSError, ManifestError):
                path.unlink(missing_ok=True)
                continue
            self.models[path.stem] = _Held(manifest, path.stat().st_mtime - time.time() + self.clock())

    def has(self, chunk_hash: str) -> bool:
        return chunk_hash in self.chunks

    def missing(self, manifest: Manifest) -> list[Chunk]:
        seen, out = set(), []
        for _, c in manifest.chunks():
            if c.hash not in self.chunks and c.hash not in seen:
                seen.add(c.hash)
                out.append(c)
        return out

    def manifest(self, model_id: str) -> Manifest | None:
        held = self.models.get(model_id)
        return held.manifest if held is not None else None

    def by_name(self, name: str) -> Manifest | None:
        """The most recently used model called `name`."""
        named = [h for h in self.models.values() if h.manifest.name == name]
        return max(named, key=lambda h: h.last_used).manifest if named else None

    def touch(self, model_id: str) -> None:
        if model_id in self.models:
            self.models[model_id].last_used = self.clock()

    # --- writing ---
    def add_manifest(self, manifest: Manifest) -> None:
        model_id = manifest.id
        if model_id not in self.models:
            path = self.root / "manifests" / f"{model_id}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(manifest.to_json())
            tmp.replace(path)
            self.models[model_id] = _Held(manifest, self.clock())
        self.touch(model_id)

    def _path(self, chunk_hash: str, codec: int) -> Path:
        return self.root / "chunks" / chunk_hash[:2] / f"{chunk_hash}.{codec}"

    def put(self, chunk_hash: str, codec: int, data: bytes, for_model: str | None = None) -> bool:
        """File a chunk (already verified by the caller); False when it was here. Makes room first
        (CapacityError when only pinned models are left to evict)."""
        if chunk_hash in self.chunks:
            return False
        self.make_room(len(data), keep=for_model)
        path = self._path(chunk_hash, codec)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        direct_io.write_file(tmp, data)  # (around the page cache: a store holds and relays, it does not read)
        tmp.replace(path)
        self.chunks[chunk_hash] = (codec, len(data))
        self.bytes += len(data)
        return True

    def read(self, chunk_hash: str) -> tuple[int, bytes]:
        """(codec, stored bytes); KeyError when absent (or gone from disk)."""
        codec, _ = self.chunks[chunk_hash]
        try:
            return codec, direct_io.read_file(self._path(chunk_hash, codec))
        except FileNotFoundError:
            self._forget(chunk_hash)
            raise KeyError(chunk_hash) from None

    def drop(self, chunk_hash: str) -> None:
        """Remove a chunk (found bad, or evicted)."""
        if chunk_hash in self.chunks:
            codec, _ = self.chunks[chunk_hash]
            self._path(chunk_hash, codec).unlink(missing_ok=True)
            self._forget(chunk_hash)

    def _forget(self, chunk_hash: str) -> None:
        _, size = self.chunks.pop(chunk_hash)
        self.bytes -= size

    # --- eviction ---
    def pinned(self) -> set[str]:
        self.expire_leases()
        return {h.manifest.id for h in self.models.values() if h.leases}

    def make_room(self, nbytes: int, keep: str | None = None) -> None:
        if self.bytes + nbytes <= self.capacity_bytes:
            return
        referenced = {c.hash for h in self.models.values() for _, c in h.manifest.chunks()}
        for orphan in [h for h in self.chunks if h not in referenced]:
            self.drop(orphan)
            if self.bytes + nbytes <= self.capacity_bytes:
                return
        pinned = self.pinned() | ({keep} if keep else set())
        for held in sorted(self.models.values(), key=lambda h: h.last_used):
            if self.bytes + nbytes <= self.capacity_bytes:
                return
            if held.manifest.id not in pinned:
                self.evict(held.manifest.id)
        if self.bytes + nbytes > self.capacity_bytes:
            raise CapacityError(f"no room for {nbytes} more chunk bytes: {self.bytes} of {self.capacity_bytes} "
                                f"held by models in use (kvstore.chunks_capacity_mb)")

    def evict(self, model_id: str) -> None:
        held = self.models.pop(model_id)
        shared = {c.hash for h in self.models.values() for _, c in h.manifest.chunks()}
        for _, c in held.manifest.chunks():
            if c.hash not in shared:
                self.drop(c.hash)
        (self.root / "manifests" / f"{model_id}.json").unlink(missing_ok=True)
        self.evictions += 1

    # --- leases (pins) ---
    def acquire(self, model_id: str, lease_s: float) -> ModelLease:
        lease = ModelLease(next(self._lease_ids), model_id, self.clock() + lease_s)
        self.leases[lease.lease_id] = lease
        self.models[model_id].leases.add(lease.lease_id)
        self.touch(model_id)
        return lease

    def renew(self, lease_id: int, lease_s: float) -> ModelLease:
        self.expire_leases()
        lease = self.leases.get(lease_id)
        if lease is None:
            raise ModelLeaseError(f"model lease {lease_id} expired or never existed: fetch the manifest again")
        lease.expires_at = self.clock() + lease_s
        self.touch(lease.model_id)
        return lease

    def release(self, lease_id: int) -> None:
        self.expire_leases()
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            raise ModelLeaseError(f"model lease {lease_id} expired or never existed")
        held = self.models.get(lease.model_id)
        if held is not None:
            held.leases.discard(lease_id)

    def expire_leases(self) -> None:
        now = self.clock()
        for lease_id in [i for i, lease in self.leases.items() if lease.expires_at <= now]:
            lease = self.leases.pop(lease_id)
            held = self.models.get(lease.model_id)
            if held is not None:
                held.leases.discard(lease_id)
