"""WeightStore servicer: a kvstore's model chunks (ember/model/weight_chunks.py) at rest and in flight.

- Seeding: a store whose host has the config's model file builds its manifest and files its chunks,
  encoded (`kvstore.chunks_codec`), on the first request for a model it does not hold (never at start:
  stores nobody asks for a model cost nothing; chunks already on disk are not encoded again).
- GetManifest: here, else asked of the peers (cheapest site first; they answer from what they hold).
- PullModel: pins the model (a lease, or for the pull's duration), then fetches every chunk it lacks
  from the peers in order of cost, one stream per peer, decoding and checking each chunk against its
  hash on arrival. A bad chunk is refused and asked again with `verify` (the peer checks its own copy
  and repairs it); a peer that fails or keeps sending bad bytes gives way to the next. Concurrent
  pulls of one model share one fetch. Whatever could not be fetched: UNAVAILABLE, never half a model
  counted as here (the chunks that did arrive stay, verified, for the next try).
- GetWeightChunks: chunks as stored (or decoded to raw when asked), in 1 MiB pieces; with `verify`
  each is checked first, and one found bad is dropped and fetched again (from the seed file or peers).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from pathlib import Path

import grpc

from ember.errors import CapacityError, InvalidRequestError
from ember.model import weight_codec
from ember.model.weight_chunks import HASH_BYTES, Chunk, Manifest, ManifestError, build_manifest, chunk_hash
from ember.rpc.errors import RpcError
from ember.rpc.server import channel, remaining
from ember.services.kvstore.chunk_store import ChunkStore, ModelLeaseError
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc

PIECE_BYTES = 1 << 20
PULL_LEASE_S = 3600.0       # the internal pin while a pull runs (released at its end)
ATTEMPTS_PER_PEER = 2       # a peer that sends a bad chunk is asked again once (verify), then the next one
PEER_TIMEOUT_S = 600.0
_MODEL_ID = re.compile(r"^[0-9a-f]{64}$")
log = logging.getLogger("ember.kvstore.weights")


class PullFailed(Exception):
    pass


class WeightStoreService(kvstore_pb2_grpc.WeightStoreServicer):
    def __init__(self, chunks: ChunkStore, peers: tuple[str, ...] = (), routes: dict[str, str] | None = None,
                 codec_mode: str = "auto", seed_model: str | None = None, max_lease_s: float = 30.0):
        self.chunks, self.peers, self.routes = chunks, list(peers), routes or {}
        self.codec_mode, self.max_lease_s = codec_mode, max_lease_s
        self.seed_path = Path(seed_model) if seed_model else None
        self.seed_manifest: Manifest | None = None
        self._seeding: asyncio.Task | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._pulls: dict[str, asyncio.Future] = {}
        self.counts = dict(pulled=0, refused=0, repaired=0, served=0, wire=0)

    # --- seeding -----------------------------------------------------------------------------
    def start_seeding(self) -> None:
        if self.seed_path is not None and self._seeding is None:
            self._seeding = asyncio.get_running_loop().create_task(self._seed())

    async def _seed(self) -> None:
        start = time.perf_counter()
        try:
            manifest = await asyncio.to_thread(build_manifest, self.seed_path)
            self.chunks.add_manifest(manifest)
            pin = self.chunks.acquire(manifest.id, PULL_LEASE_S)
            try:
                for file_entry, chunk in manifest.chunks():
                    if not self.chunks.has(chunk.hash):
                        codec, data = await asyncio.to_thread(self._encode_from_seed, file_entry.path, chunk)
                        self.chunks.put(chunk.hash, codec, data, for_model=manifest.id)
            finally:
                self.chunks.release(pin.lease_id)
            self.seed_manifest = manifest
            log.info("seeded %s (%s) from %s in %.2f s", manifest.name, manifest.id[:16], self.seed_path,
                     time.perf_counter() - start)
        except (OSError, CapacityError, ManifestError) as e:
            log.warning("could not seed model chunks from %s: %s", self.seed_path, e)

    def _seed_bytes(self, rel: str, chunk: Chunk) -> bytes | None:
        """The chunk's raw bytes read from the local model, when they still hash right."""
        if self.seed_path is None:
            return None
        path = self.seed_path / rel if self.seed_path.is_dir() else self.seed_path
        try:
            with open(path, "rb") as f:
                f.seek(chunk.offset)
                data = f.read(chunk.length)
        except OSError:
            return None
        return data if chunk_hash(data) == chunk.hash else None

    def _encode_from_seed(self, rel: str, chunk: Chunk) -> tuple[int, bytes]:
        data = self._seed_bytes(rel, chunk)
        if data is None:
            raise OSError(f"{self.seed_path} changed while it was seeded")
        return weight_codec.encode(chunk.kind, data, self.codec_mode)

    async def _seeded(self) -> None:
        """Seeded from the local model, once, on the first request that finds a model missing."""
        self.start_seeding()
        if self._seeding is not None:
            await asyncio.shield(self._seeding)

    # --- manifests ---------------------------------------------------------------------------
    def _channel(self, peer: str) -> grpc.aio.Channel:
        if peer not in self._channels:
            self._channels[peer] = channel(self.routes.get(peer, peer))
        return self._channels[peer]

    def _local(self, name: str, model_id: str) -> Manifest | None:
        return self.chunks.manifest(model_id) if model_id else self.chunks.by_name(name)

    async def manifest(self, name: str, model_id: str, local_only: bool, timeout: float) -> Manifest:
        if model_id and not _MODEL_ID.match(model_id):
            raise InvalidRequestError(f"model_id must be 64 lowercase hex digits (a sha256), got {model_id!r}")
        if not name and not model_id:
            raise InvalidRequestError("name or model_id is required")
        if len(name) > 256:
            raise InvalidRequestError("name is longer than 256 bytes")
        found = self._local(name, model_id)
        if found is None:
            await self._seeded()
            found = self._local(name, model_id)
        if found is not None or local_only:
            if found is None:
                raise RpcError(grpc.StatusCode.NOT_FOUND, f"model {name or model_id} is not in this kvstore")
            return found
        unreachable = []
        for peer in self.peers:
            stub = kvstore_pb2_grpc.WeightStoreStub(self._channel(peer))
            try:
                reply = await stub.GetManifest(kvstore_pb2.ManifestRequest(name=name, model_id=model_id,
                                                                           local_only=True), timeout=timeout)
                manifest = Manifest.from_json(reply.manifest, expect_id=reply.model_id)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    unreachable.append(f"{peer}: {e.code().name} {e.details()}")
                continue
            except ManifestError as e:
                unreachable.append(f"{peer}: bad manifest ({e})")
                continue
            if model_id and manifest.id != model_id:
                unreachable.append(f"{peer}: answered another model")
                continue
            self.chunks.add_manifest(manifest)
            return manifest
        if unreachable:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"model {name or model_id} is not here and not every peer "
                                                        f"answered: {'; '.join(unreachable)}")
        raise RpcError(grpc.StatusCode.NOT_FOUND, f"no kvstore of the cluster holds model {name or model_id}")

    async def GetManifest(self, request, context):
        m = await self.manifest(request.name, request.model_id, request.local_only, remaining(context))
        return kvstore_pb2.ManifestResponse(model_id=m.id, manifest=m.to_json())

    # --- serving chunks ----------------------------------------------------------------------
    def _chunk_of(self, manifest: Manifest, h: str) -> tuple[str, Chunk]:
        for f, c in manifest.chunks():
            if c.hash == h:
                return f.path, c
        raise RpcError(grpc.StatusCode.NOT_FOUND, f"chunk {h} is not part of model {manifest.id}")

    def _verified(self, chunk: Chunk) -> bool:
        """Whether the stored copy decodes to bytes of its hash (in a worker thread)."""
        try:
            codec, data = self.chunks.read(chunk.hash)
            return chunk_hash(weight_codec.decode(codec, chunk.kind, data, chunk.length)) == chunk.hash
        except (KeyError, weight_codec.WeightCodecError):
            return False

    async def _repair(self, manifest: Manifest, rel: str, chunk: Chunk, timeout: float) -> None:
        """Replace a chunk found bad (or gone): from the local model file, else from the peers."""
        self.chunks.drop(chunk.hash)
        data = await asyncio.to_thread(self._seed_bytes, rel, chunk)
        if data is not None:
            codec, encoded = await asyncio.to_thread(weight_codec.encode, chunk.kind, data, self.codec_mode)
            self.chunks.put(chunk.hash, codec, encoded, for_model=manifest.id)
        else:
            with contextlib.suppress(PullFailed):
                await self._fetch(manifest, [chunk], "", timeout)
        if not self.chunks.has(chunk.hash):
            raise RpcError(grpc.StatusCode.DATA_LOSS, f"chunk {chunk.hash} is damaged here and could not be "
                                                      "fetched again")
        self.counts["repaired"] += 1

    async def GetWeightChunks(self, request, context):
        if not _MODEL_ID.match(request.model_id):
            raise InvalidRequestError(f"model_id must be 64 lowercase hex digits, got {request.model_id!r}")
        if request.codec not in ("", "raw"):
            raise InvalidRequestError(f"codec must be '' (as stored) or 'raw', got {request.codec!r}")
        for h in request.chunk_hashes:
            if len(h) != HASH_BYTES:
                raise InvalidRequestError(f"chunk hashes are {HASH_BYTES}-byte sha256 digests, got {len(h)} bytes")
        manifest = self.chunks.manifest(request.model_id)
        if manifest is None:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"model {request.model_id} is not in this kvstore")
        wanted = [self._chunk_of(manifest, h.hex()) for h in request.chunk_hashes]
        self.chunks.touch(manifest.id)
        for rel, chunk in wanted:
            if not self.chunks.has(chunk.hash) or (request.verify and not await asyncio.to_thread(self._verified,
                                                                                                   chunk)):
                await self._repair(manifest, rel, chunk, remaining(context))  # (gone, or found bad: again)
            try:
                codec, data = await asyncio.to_thread(self.chunks.read, chunk.hash)
            except KeyError:  # gone from the disk under us
                await self._repair(manifest, rel, chunk, remaining(context))
                codec, data = await asyncio.to_thread(self.chunks.read, chunk.hash)
            if request.codec == "raw" and codec != weight_codec.RAW:
                try:
                    data = await asyncio.to_thread(weight_codec.decode, codec, chunk.kind, data, chunk.length)
                except weight_codec.WeightCodecError as e:
                    raise RpcError(grpc.StatusCode.DATA_LOSS, f"stored chunk {chunk.hash}: {e}") from e
                codec = weight_codec.RAW
            view = memoryview(data)
            for offset in range(0, max(1, len(view)), PIECE_BYTES):
                yield kvstore_pb2.WeightChunk(chunk_hash=bytes.fromhex(chunk.hash), codec=codec,
                                              encoded_bytes=len(view), offset=offset,
                                              data=bytes(view[offset:offset + PIECE_BYTES]))
            self.counts["served"] += 1

    # --- pulling -----------------------------------------------------------------------------
    async def _fetch(self, manifest: Manifest, wanted: list[Chunk], codec: str, timeout: float) -> dict:
        """Fetch `wanted` from the peers, cheapest first; returns what it moved. Raises PullFailed
        naming each peer's failure when chunks remain missing."""
        todo = {c.hash: c for c in wanted if not self.chunks.has(c.hash)}
        moved = dict(chunks=0, raw=0, wire=0, refused=0, sources=[])
        failures = []
        for peer in self.peers:
            verify = False
            for _ in range(ATTEMPTS_PER_PEER):
                if not todo:
                    break
                try:
                    bad = await self._stream_from(peer, manifest, todo, codec, verify, timeout, moved)
                except grpc.aio.AioRpcError as e:
                    failures.append(f"{peer}: {e.code().name} {e.details()}")
                    break
                if not bad:
                    break
                failures.append(f"{peer}: {bad} chunk(s) failed their hash")
                verify = True  # ask again, the peer checking (and repairing) its own copies first
        if todo:
            raise PullFailed(f"{len(todo)} of {len(wanted)} chunks of model {manifest.name} ({manifest.id[:16]}) "
                             f"could not be fetched: {'; '.join(failures) or 'no peer kvstore configured'}")
        return moved

    async def _stream_from(self, peer: str, manifest: Manifest, todo: dict[str, Chunk], codec: str, verify: bool,
                           timeout: float, moved: dict) -> int:
        stub = kvstore_pb2_grpc.WeightStoreStub(self._channel(peer))
        request = kvstore_pb2.WeightChunksRequest(model_id=manifest.id, codec=codec, verify=verify,
                                                  chunk_hashes=[bytes.fromhex(h) for h in todo])
        bad = 0
        parts: list[bytes] = []
        checking: list[tuple[str, int, bytes, Chunk, asyncio.Future]] = []  # decoded and hashed in threads

        async def file_next() -> None:
            nonlocal bad
            h, codec, encoded, chunk, check = checking.pop(0)
            if not await check:
                bad += 1
                moved["refused"] += 1
                self.counts["refused"] += 1
                log.warning("chunk %s from %s failed its hash: refused", h[:16], peer)
                return
            if self.chunks.put(h, codec, encoded, for_model=manifest.id):
                moved["chunks"] += 1
                moved["raw"] += chunk.length
                self.counts["pulled"] += 1
            todo.pop(h, None)
            if peer not in moved["sources"]:
                moved["sources"].append(peer)
        try:
            async for piece in stub.GetWeightChunks(request, timeout=timeout):
                parts.append(piece.data)
                if piece.offset + len(piece.data) < piece.encoded_bytes:
                    continue
                h = piece.chunk_hash.hex()
                encoded, parts = b"".join(parts), []
                chunk = todo.get(h)
                if chunk is None:
                    continue  # not asked for (or already here): ignored
                moved["wire"] += len(encoded)
                self.counts["wire"] += len(encoded)
                # the next chunk arrives while this one is checked: decoding overlaps the link
                checking.append((h, piece.codec, encoded, chunk,
                                 asyncio.ensure_future(asyncio.to_thread(_check, piece.codec, chunk, encoded))))
                while len(checking) > 2 or (checking and checking[0][4].done()):
                    await file_next()
        finally:
            while checking:  # what arrived whole is filed, even when the stream then broke
                await file_next()
        return bad

    async def _pull(self, manifest: Manifest, codec: str, timeout: float) -> dict:
        """One fetch of a model's missing chunks at a time; concurrent pulls wait for it, then fetch
        whatever it did not deliver themselves."""
        running = self._pulls.get(manifest.id)
        if running is not None:
            with contextlib.suppress(PullFailed, RpcError, grpc.aio.AioRpcError, CapacityError):
                await asyncio.shield(running)
        task = asyncio.ensure_future(self._fetch(manifest, self.chunks.missing(manifest), codec, timeout))
        self._pulls[manifest.id] = task
        try:
            return await asyncio.shield(task)
        finally:
            if self._pulls.get(manifest.id) is task:
                del self._pulls[manifest.id]

    async def PullModel(self, request, context):
        if request.codec not in ("", "raw"):
            raise InvalidRequestError(f"codec must be '' (as stored) or 'raw', got {request.codec!r}")
        if not request.lease_s >= 0:
            raise InvalidRequestError(f"lease_s must be >= 0 (0: no lease), got {request.lease_s}")
        start = time.perf_counter()
        manifest = await self.manifest(request.name, request.model_id, False, remaining(context))
        present = len(manifest.chunks()) - len(self.chunks.missing(manifest))
        lease = self.chunks.acquire(manifest.id, min(request.lease_s, self.max_lease_s) if request.lease_s
                                    else PULL_LEASE_S)
        try:
            moved = await self._pull(manifest, request.codec, remaining(context))
        except PullFailed as e:
            self.chunks.release(lease.lease_id)
            raise RpcError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except BaseException:
            self.chunks.release(lease.lease_id)
            raise
        if not request.lease_s:
            self.chunks.release(lease.lease_id)
        return kvstore_pb2.PullModelResponse(
            model_id=manifest.id, chunks_pulled=moved["chunks"], chunks_present=present, bytes_pulled=moved["raw"],
            wire_bytes=moved["wire"], seconds=time.perf_counter() - start, sources=",".join(moved["sources"]),
            lease_id=lease.lease_id if request.lease_s else 0,
            expires_in_s=lease.expires_at - self.chunks.clock() if request.lease_s else 0.0,
            chunks_refused=moved["refused"])

    async def RenewModel(self, request, context):
        if not request.lease_s >= 0:
            raise InvalidRequestError(f"lease_s must be >= 0 (0: release), got {request.lease_s}")
        try:
            if request.lease_s == 0:
                self.chunks.release(request.lease_id)
                return kvstore_pb2.ModelLeaseResponse(lease_id=request.lease_id)
            lease = self.chunks.renew(request.lease_id, min(request.lease_s, self.max_lease_s))
        except ModelLeaseError as e:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
        return kvstore_pb2.ModelLeaseResponse(lease_id=lease.lease_id,
                                              expires_in_s=lease.expires_at - self.chunks.clock())

    async def WeightStats(self, request, context):
        c, store = self.counts, self.chunks
        return kvstore_pb2.WeightStatsResponse(
            models=len(store.models), chunks=len(store.chunks), bytes_stored=store.bytes,
            capacity_bytes=store.capacity_bytes, chunks_pulled=c["pulled"], chunks_refused=c["refused"],
            chunks_repaired=c["repaired"], chunks_served=c["served"], evictions=store.evictions,
            pinned_models=len(store.pinned()), model_leases=len(store.leases),
            seeded=self.seed_manifest.id if self.seed_manifest else "", wire_bytes_pulled=c["wire"])

    async def close(self) -> None:
        if self._seeding is not None and not self._seeding.done():
            self._seeding.cancel()
        for ch in self._channels.values():
            await ch.close()


def _check(codec: int, chunk: Chunk, encoded: bytes) -> bool:
    try:
        return chunk_hash(weight_codec.decode(codec, chunk.kind, encoded, chunk.length)) == chunk.hash
    except weight_codec.WeightCodecError:
        return False
