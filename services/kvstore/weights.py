"""WeightStore servicer: a kvstore's model chunks (ember/model/weight_chunks.py) at rest and in flight.

- Seeding: a store whose host has the config's model file builds its manifest and files its chunks,
  encoded (`kvstore.chunks_codec`), on the first request for a model it does not hold (never at start:
  stores nobody asks for a model cost nothing; chunks already on disk are not encoded again); for a GGUF
  whose load caches are current on this host, those next (ember.model.derived: a folder manifest named
  after the file's sha256 and the caches' versions), so workers fetch them instead of building them.
- GetManifest: here, else asked of the peers (cheapest site first; they answer from what they hold).
- PullModel: pins the model (a lease, or for the pull's duration), then fetches every chunk it lacks
  from the peers in order of cost, one stream per peer, filing each as it arrives: a store relays bytes,
  it does not decode them (the worker that uses a chunk checks its hash; a repair checks here). A peer
  that fails gives way to the next. Concurrent pulls of one model share one fetch. With `background`
  it answers once pinned and the pull runs on in a task: GetWeightChunks streams each chunk as soon as
  it is filed, so the site's worker receives the model while it crosses the link. Whatever could not be
  fetched: UNAVAILABLE, never half a model counted as here (the chunks that did arrive stay).
- GetWeightChunks: chunks as stored (or decoded to raw when asked), in 1 MiB pieces; with `verify`
  each is checked first, and one found bad (counted refused) is dropped and fetched again from the seed
  file, else from the peers, asked to verify theirs and checked on arrival here.
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
from ember.model import derived, weight_codec
from ember.model.files import cache_dir_for
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
        self._seeding_derived: asyncio.Future | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._pulls: dict[str, asyncio.Task] = {}
        self._filed = asyncio.Condition()  # notified when a chunk is filed and when a pull ends
        self.counts = dict(pulled=0, refused=0, repaired=0, served=0, wire=0)

    # --- seeding -----------------------------------------------------------------------------
    def start_seeding(self) -> None:
        if self.seed_path is not None and self._seeding is None:
            self._seeding = asyncio.get_running_loop().create_task(self._seed())

    async def _seed(self) -> None:
        start = time.perf_counter()
        try:
            manifest = await asyncio.to_thread(build_manifest, self.seed_path)
            await self._file_from_source(manifest)
            self.seed_manifest = manifest
            log.info("seeded %s (%s) from %s in %.2f s", manifest.name, manifest.id[:16], self.seed_path,
                     time.perf_counter() - start)
        except (OSError, CapacityError, ManifestError) as e:
            log.warning("could not seed model chunks from %s: %s", self.seed_path, e)
            return
        if self.seed_path.suffix == ".gguf":  # its load caches next, in a task of their own
            self._seeding_derived = asyncio.ensure_future(self._seed_derived(manifest.files[0].sha256))

    async def _seed_derived(self, sha256: str) -> None:
        """The GGUF's load caches (ember.model.derived), when this host holds them current: published so
        that a worker with an empty cache fetches them instead of building them."""
        start = time.perf_counter()
        try:
            manifest = await asyncio.to_thread(derived.build_derived_manifest, self.seed_path, sha256)
            if manifest is None:
                log.info("no current load caches beside %s: workers fetching it build their own", self.seed_path)
                return
            await self._file_from_source(manifest)
            log.info("seeded the load caches of %s (%s, %d bytes) in %.2f s", self.seed_path.name, manifest.id[:16],
                     manifest.size, time.perf_counter() - start)
        except (OSError, CapacityError, ManifestError) as e:
            log.warning("could not seed the load caches of %s: %s", self.seed_path, e)

    async def _file_from_source(self, manifest: Manifest) -> None:
        self.chunks.add_manifest(manifest)
        pin = self.chunks.acquire(manifest.id, PULL_LEASE_S)
        try:
            for file_entry, chunk in manifest.chunks():
                if not self.chunks.has(chunk.hash):
                    codec, data = await asyncio.to_thread(self._encode_from_source, manifest, file_entry.path, chunk)
                    self.chunks.put(chunk.hash, codec, data, for_model=manifest.id)
        finally:
            self.chunks.release(pin.lease_id)

    def _source(self, manifest: Manifest) -> Path | None:
        """Where this host holds the manifest's files: the seed model, or its load caches' folder."""
        if self.seed_path is None:
            return None
        if manifest.name == self.seed_path.name:
            return self.seed_path
        if derived.is_derived_name(manifest.name) and manifest.name.startswith(cache_dir_for(self.seed_path).name):
            return cache_dir_for(self.seed_path)
        return None

    def _seed_bytes(self, manifest: Manifest, rel: str, chunk: Chunk) -> bytes | None:
        """The chunk's raw bytes read from this host's copy of the model, when they still hash right."""
        source = self._source(manifest)
        if source is None:
            return None
        path = source / rel if manifest.folder else source
        try:
            with open(path, "rb") as f:
                f.seek(chunk.offset)
                data = f.read(chunk.length)
        except OSError:
            return None
        return data if chunk_hash(data) == chunk.hash else None

    def _encode_from_source(self, manifest: Manifest, rel: str, chunk: Chunk) -> tuple[int, bytes]:
        data = self._seed_bytes(manifest, rel, chunk)
        if data is None:
            raise OSError(f"{self._source(manifest)} changed while it was seeded")
        return weight_codec.encode(chunk.kind, data, self.codec_mode)

    async def _seeded(self, derived_too: bool = True) -> None:
        """Seeded from the local model, once, on the first request that finds a model missing (and its
        load caches after it, which only requests for them wait for)."""
        self.start_seeding()
        if self._seeding is not None:
            await asyncio.shield(self._seeding)
        if derived_too and self._seeding_derived is not None:
            await asyncio.shield(self._seeding_derived)

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
            await self._seeded(derived_too=not name or derived.is_derived_name(name))
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

    async def _repair(self, manifest: Manifest, rel: str, chunk: Chunk, timeout: float, damaged: bool = True
                      ) -> None:
        """Replace a chunk found bad (or gone): from the local model file, else from the peers. What no
        peer could deliver: DATA_LOSS for a damaged chunk, UNAVAILABLE for a missing one."""
        self.chunks.drop(chunk.hash)
        data = await asyncio.to_thread(self._seed_bytes, manifest, rel, chunk)
        failure = ""
        if data is not None:
            codec, encoded = await asyncio.to_thread(weight_codec.encode, chunk.kind, data, self.codec_mode)
            self.chunks.put(chunk.hash, codec, encoded, for_model=manifest.id)
        else:
            try:  # (peers asked to check theirs; what arrives is checked here)
                await self._fetch(manifest, [chunk], "", timeout, check=True)
            except PullFailed as e:
                failure = f": {e}"
        if not self.chunks.has(chunk.hash):
            if damaged:
                raise RpcError(grpc.StatusCode.DATA_LOSS, f"chunk {chunk.hash} is damaged here and could not be "
                                                          f"fetched again{failure}")
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"chunk {chunk.hash} is not here and could not be "
                                                        f"fetched{failure}")
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
            await self._arrival(manifest.id, chunk.hash)  # (a background pull bringing it: sent once filed)
            if not self.chunks.has(chunk.hash):
                await self._repair(manifest, rel, chunk, remaining(context), damaged=False)  # (gone: again)
            elif request.verify and not await asyncio.to_thread(self._verified, chunk):
                self.counts["refused"] += 1  # (relayed unchecked, or damaged at rest: a reader found it bad)
                log.warning("chunk %s of %s failed its hash here: fetched again", chunk.hash[:16], manifest.name)
                await self._repair(manifest, rel, chunk, remaining(context))
            try:
                codec, data = await asyncio.to_thread(self.chunks.read, chunk.hash)
            except KeyError:  # gone from the disk under us
                await self._repair(manifest, rel, chunk, remaining(context), damaged=False)
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
    async def _fetch(self, manifest: Manifest, wanted: list[Chunk], codec: str, timeout: float,
                     check: bool = False) -> dict:
        """Fetch `wanted` from the peers, cheapest first; returns what it moved. Raises PullFailed
        naming each peer's failure when chunks remain missing. Chunks are filed as they arrive, as
        relayed bytes (a store only holds and moves them: the worker that decodes them checks each
        one's hash, and asks with `verify` when one is bad); `check` (a repair): each is decoded and
        checked here first, and the peers are asked to check theirs."""
        todo = {c.hash: c for c in wanted if not self.chunks.has(c.hash)}
        moved = dict(chunks=0, raw=0, wire=0, refused=0, sources=[])
        failures = []
        for peer in self.peers:
            verify = check
            for _ in range(ATTEMPTS_PER_PEER):
                if not todo:
                    break
                try:
                    bad = await self._stream_from(peer, manifest, todo, codec, verify, timeout, moved, check)
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
                           timeout: float, moved: dict, check: bool = False) -> int:
        stub = kvstore_pb2_grpc.WeightStoreStub(self._channel(peer))
        request = kvstore_pb2.WeightChunksRequest(model_id=manifest.id, codec=codec, verify=verify,
                                                  chunk_hashes=[bytes.fromhex(h) for h in todo])
        bad = 0
        parts: list[bytes] = []
        checking: list[tuple[str, int, bytes, Chunk, asyncio.Future]] = []  # decoded and hashed in threads

        async def file_next() -> None:
            nonlocal bad
            h, codec, encoded, chunk, checked = checking.pop(0)
            if checked is not None and not await checked:
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
            await self._notify()  # a GetWeightChunks stream waiting for it sends it on now
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
                # (checked: the next chunk arrives while this one is decoded and hashed in a thread)
                checking.append((h, piece.codec, encoded, chunk, asyncio.ensure_future(
                    asyncio.to_thread(_check, piece.codec, chunk, encoded)) if check else None))
                while len(checking) > 2 or (checking and (checking[0][4] is None or checking[0][4].done())):
                    await file_next()
        finally:
            while checking:  # what arrived whole is filed, even when the stream then broke
                await file_next()
        return bad

    async def _notify(self) -> None:
        async with self._filed:
            self._filed.notify_all()

    def _start_pull(self, manifest: Manifest, codec: str, timeout: float) -> asyncio.Task:
        """A task fetching the model's missing chunks, pinning the model while it runs (whoever asked may
        go: a background pull runs on; its failure is kept on the task for the streams waiting on it)."""
        async def run() -> dict:
            pin = self.chunks.acquire(manifest.id, PULL_LEASE_S)
            try:
                return await self._fetch(manifest, self.chunks.missing(manifest), codec, timeout)
            finally:
                with contextlib.suppress(ModelLeaseError):
                    self.chunks.release(pin.lease_id)
                if self._pulls.get(manifest.id) is task:
                    del self._pulls[manifest.id]
                await self._notify()
        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (retrieved: no "never retrieved")
        self._pulls[manifest.id] = task
        return task

    async def _pull(self, manifest: Manifest, codec: str, timeout: float) -> dict:
        """One fetch of a model's missing chunks at a time; concurrent pulls wait for it, then fetch
        whatever it did not deliver themselves."""
        running = self._pulls.get(manifest.id)
        if running is not None:
            with contextlib.suppress(PullFailed, RpcError, grpc.aio.AioRpcError, CapacityError):
                await asyncio.shield(running)
        return await asyncio.shield(self._start_pull(manifest, codec, timeout))

    async def _arrival(self, model_id: str, chunk_hash: str) -> None:
        """Wait while a pull of the model runs and the chunk is not here yet; the chunk still missing
        after a pull that failed: that failure (UNAVAILABLE, RESOURCE_EXHAUSTED when full)."""
        last = None
        while not self.chunks.has(chunk_hash) and (task := self._pulls.get(model_id)) is not None:
            last = task
            async with self._filed:
                await self._filed.wait_for(lambda task=task: self.chunks.has(chunk_hash) or task.done())
        if self.chunks.has(chunk_hash) or last is None or last.cancelled() or last.exception() is None:
            return
        error = last.exception()
        code = grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, CapacityError) else grpc.StatusCode.UNAVAILABLE
        raise RpcError(code, f"chunk {chunk_hash} did not arrive here: {error}")

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
        if request.background:  # pinned; the missing chunks come in a task of their own (streamed on arrival)
            if manifest.id not in self._pulls and self.chunks.missing(manifest):
                self._start_pull(manifest, request.codec, PEER_TIMEOUT_S)
            if not request.lease_s:
                self.chunks.release(lease.lease_id)
            return kvstore_pb2.PullModelResponse(
                model_id=manifest.id, chunks_present=present, seconds=time.perf_counter() - start,
                lease_id=lease.lease_id if request.lease_s else 0,
                expires_in_s=lease.expires_at - self.chunks.clock() if request.lease_s else 0.0)
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
        for task in (self._seeding, self._seeding_derived):
            if task is not None and not task.done():
                task.cancel()
        for ch in self._channels.values():
            await ch.close()


def _check(codec: int, chunk: Chunk, encoded: bytes) -> bool:
    try:
        return chunk_hash(weight_codec.decode(codec, chunk.kind, encoded, chunk.length)) == chunk.hash
    except weight_codec.WeightCodecError:
        return False
