"""A worker whose model file is missing fetches it through its site's kvstore (WeightStore RPCs).

`ensure_model_file(path, kvstore, creds)`: when `path` exists, nothing happens (no network). Else the
site kvstore is asked for the manifest of a model of that name (it asks its peers when it lacks it),
pulls and pins every chunk (from the cheapest peer site that has them), and streams them here; each
chunk is decoded and checked against its sha256, then written at its offset into a temporary file
beside `path` (a folder for an HF model). Only when every chunk verified and each whole file's sha256
equals the manifest's (and, for a named model, the sha256 its spec pins) is it renamed into place:
a half-fetched model is never found at `path`, and a failure removes the temporary file. The site
store pulls in the background and streams each chunk here as it arrives there; files are written
around the page cache (ember.util.direct_io). A fetched GGUF's load caches (ember.model.derived) follow
the same way, tied to the fetched file and renamed into place before it (not published anywhere, or not
fetched whole: the engine builds them).

Failures raise ModelFetchError with the gRPC status that caused them (UNAVAILABLE: no source could
deliver; NOT_FOUND: no kvstore of the cluster has the model; DATA_LOSS: chunks kept failing their
hash). A fetched model stays pinned in the site store while this process lives (`ModelPin` renews
the lease), so other workers of the site find it there.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import grpc

from ember.model import weight_codec
from ember.model.weight_chunks import Chunk, FileEntry, Manifest, ManifestError, chunk_hash
from ember.rpc import security
from ember.util.direct_io import DirectWriter
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc

LEASE_S = 30.0
ATTEMPTS = 3
RETRY_S = 0.5
TIMEOUT_S = 600.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS)
log = logging.getLogger("ember.model_fetch")


class ModelFetchError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code


def ensure_model_file(path: str | Path, kvstore_address: str | None, creds: security.Credentials | None = None,
                      codec: str | None = None, pin: bool = True, load_caches: bool = True) -> Path:
    """`path`, fetched through the kvstore at `kvstore_address` first when it does not exist.
    `codec` "raw" asks for uncompressed chunks on every hop (`ember bench weights`' baseline; None: the
    environment's EMBER_MODEL_FETCH_CODEC, else chunks as the stores hold them). With `load_caches`, a
    fetched GGUF's load caches (ember.model.derived) are fetched too when a site publishes them (else
    the engine builds them, as it does for a file on disk)."""
    codec = os.environ.get("EMBER_MODEL_FETCH_CODEC", "") if codec is None else codec
    path = Path(path)
    if path.exists():
        return path
    if not kvstore_address:
        raise FileNotFoundError(f"model not found: {path} (and no kvstore to fetch it from)")
    start = time.perf_counter()
    _build_kernels_meanwhile()
    with security.dial(kvstore_address, creds) as ch:
        stub = kvstore_pb2_grpc.WeightStoreStub(ch)
        manifest = _manifest(stub, path.name)
        caches = None

        def fetch_caches(model_tmp: Path) -> None:  # the model verified, not yet in place
            nonlocal caches
            if load_caches and path.suffix == ".gguf" and not manifest.folder:
                caches = _fetch_caches(stub, path, model_tmp, manifest.files[0].sha256, codec)
        held = [(manifest, _fetch(stub, manifest, path, codec, fetch_caches)), *([caches] if caches else [])]
        if not pin:
            for _, lease in held:
                _release(stub, lease.lease_id)
    log.info("fetched model %s (%s, %d bytes%s) through %s in %.2f s", path.name, manifest.id[:16], manifest.size,
             f", and its load caches: {caches[0].size} bytes" if caches else "", kvstore_address,
             time.perf_counter() - start)
    if pin:
        for m, lease in held:
            ModelPin(kvstore_address, creds, m.id, lease.lease_id, lease.expires_in_s).start()
    return path


def _build_kernels_meanwhile() -> None:
    """A host whose cache is empty also compiles the engine's C++ kernels (ember.kernels.native: seconds
    of g++) on the engine's first use: started now, in a thread, it overlaps the model's transfer."""
    def build() -> None:
        with contextlib.suppress(Exception):
            from ember.kernels import native
            native.library()
    threading.Thread(target=build, name="kernels-build", daemon=True).start()


def _fetch(stub, manifest: Manifest, path: Path, codec: str, before_rename=None):
    """`manifest` fetched to `path` through the site store, which pulls what it lacks in the background
    while each chunk is streamed here as it arrives there; returns the lease pinning it in that store."""
    leases: list = []
    try:
        _download(stub, manifest, path, codec, leases, before_rename)
    except BaseException:
        for lease in leases:
            _release(stub, lease.lease_id)
        raise
    lease = leases.pop()
    for old in leases:
        _release(stub, old.lease_id)
    return lease


def _fetch_caches(stub, path: Path, model_tmp: Path, sha256: str, codec: str):
    """The GGUF's load caches (ember.model.derived) fetched into its cache folder, tied to the fetched
    file at `model_tmp` (content `sha256`): (manifest, lease), or None when no site publishes them or
    they could not be fetched whole (the engine then builds them)."""
    from ember.model import derived
    from ember.model.files import cache_dir_for
    name = derived.derived_name(path.name, sha256)
    start = time.perf_counter()

    def adopt(tmp: Path) -> None:
        try:
            derived.adopt(tmp, model_tmp, sha256)
        except (OSError, derived.DerivedCacheError) as e:
            raise ModelFetchError(grpc.StatusCode.DATA_LOSS, f"load caches of {path.name}: {e}") from None
    try:
        manifest = _manifest(stub, name)
        if not manifest.folder or manifest.name != name:
            raise ModelFetchError(grpc.StatusCode.DATA_LOSS, f"asked for {name}, the store answered {manifest.name}")
        lease = _fetch(stub, manifest, cache_dir_for(path), codec, adopt)
    except ModelFetchError as e:
        (log.info if e.code == grpc.StatusCode.NOT_FOUND else log.warning)(
            "load caches of %s not fetched (%s): the engine builds them", path.name, e)
        return None
    log.info("fetched the load caches of %s (%s, %d bytes) in %.2f s: not built here", path.name, manifest.id[:16],
             manifest.size, time.perf_counter() - start)
    return manifest, lease


def _manifest(stub, name: str) -> Manifest:
    try:
        reply = stub.GetManifest(kvstore_pb2.ManifestRequest(name=name), timeout=TIMEOUT_S)
    except grpc.RpcError as e:
        raise ModelFetchError(e.code(), f"manifest of {name}: {e.details()}") from None
    try:
        manifest = Manifest.from_json(reply.manifest, expect_id=reply.model_id)
    except ManifestError as e:
        raise ModelFetchError(grpc.StatusCode.DATA_LOSS, f"manifest of {name}: {e}") from None
    expected = _named_sha256(name)
    if expected is not None and (manifest.folder or manifest.files[0].sha256 != expected):
        raise ModelFetchError(grpc.StatusCode.DATA_LOSS, f"the cluster's {name} is not the named model's file "
                                                         f"(sha256 {manifest.files[0].sha256}, want {expected})")
    return manifest


def _named_sha256(filename: str) -> str | None:
    from ember.model.fetch import MODELS
    return next((spec.sha256 for spec in MODELS.values() if spec.filename == filename), None)


def _pull(stub, manifest: Manifest, codec: str):
    """The site store pins the model and pulls what it lacks in the background (GetWeightChunks then
    streams each chunk as it arrives there): its PullModel, tried ATTEMPTS times."""
    for attempt in range(ATTEMPTS):
        try:
            return stub.PullModel(kvstore_pb2.PullModelRequest(model_id=manifest.id, lease_s=LEASE_S, codec=codec,
                                                               background=True), timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE or attempt == ATTEMPTS - 1:
                raise ModelFetchError(e.code(), f"pulling {manifest.name} into the site kvstore "
                                                f"({attempt + 1} attempt(s)): {e.details()}") from None
            log.warning("pulling %s: %s %s; again", manifest.name, e.code().name, e.details())
            time.sleep(RETRY_S * (attempt + 1))
    raise AssertionError("unreachable")


def _release(stub, lease_id: int) -> None:
    with contextlib.suppress(grpc.RpcError):
        stub.RenewModel(kvstore_pb2.ModelLeaseRequest(lease_id=lease_id, lease_s=0), timeout=10)


def _download(stub, manifest: Manifest, path: Path, codec: str, leases: list, before_rename=None) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    _remove(tmp)
    try:
        targets = {}  # file -> its writer (whole blocks around the page cache: ember.util.direct_io)
        places: dict[str, list[tuple[FileEntry, Chunk]]] = {}
        for f, c in manifest.chunks():
            places.setdefault(c.hash, []).append((f, c))
        for f in manifest.files:
            target = tmp / f.path if manifest.folder else tmp
            target.parent.mkdir(parents=True, exist_ok=True)
            targets[f.path] = DirectWriter(target, f.size)
        hashing = {f.path: _InOrder(f, tmp / f.path if manifest.folder else tmp) for f in manifest.files}
        try:
            _receive(stub, manifest, places, targets, codec, leases, hashing)
            for out in targets.values():
                out.fsync()
        finally:
            for out in targets.values():
                out.close()
        for f in manifest.files:
            actual = hashing[f.path].digest() or _sha256(tmp / f.path if manifest.folder else tmp)
            if actual != f.sha256:
                raise ModelFetchError(grpc.StatusCode.DATA_LOSS, f"{f.path}: reassembled sha256 {actual}, "
                                                                 f"manifest says {f.sha256}")
        if before_rename is not None:
            before_rename(tmp)
        path.parent.mkdir(parents=True, exist_ok=True)
        if manifest.folder and path.is_dir():  # (a stale folder of load caches: set aside, then removed)
            old = path.with_name(f".{path.name}.{os.getpid()}.old")
            _remove(old)
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)  # (a folder: renamed whole)
        if not manifest.folder:  # its sha256 remembered beside it (ember.model.files.sha256_stamped): not hashed again
            with contextlib.suppress(OSError):
                stat = path.stat()
                path.with_name(path.name + ".sha256").write_text(
                    f"{manifest.files[0].sha256} {stat.st_size} {stat.st_mtime_ns}\n")
    except BaseException:
        _remove(tmp)
        raise


class _InOrder:
    """A file's sha256 computed while its chunks are written (in file order: a chunk written ahead of
    the next one hashed waits; a duplicate chunk's bytes are read back from the file)."""

    def __init__(self, entry: FileEntry, path: Path):
        self.chunks, self.path, self.next = sorted(entry.chunks, key=lambda c: c.offset), path, 0
        self.written: set[int] = set()
        self.sha = hashlib.sha256()

    def wrote(self, chunk: Chunk, data: bytes) -> None:
        self.written.add(chunk.offset)
        while self.next < len(self.chunks) and self.chunks[self.next].offset in self.written:
            c = self.chunks[self.next]
            self.sha.update(data if c.offset == chunk.offset else _read_at(self.path, c.offset, c.length))
            self.next += 1

    def digest(self) -> str | None:
        return self.sha.hexdigest() if self.next == len(self.chunks) else None


def _receive(stub, manifest: Manifest, places: dict, targets: dict, codec: str, leases: list,
             hashing: dict) -> None:
    todo = set(places)
    verify = False

    def place(h: str, codec_id: int, encoded: bytes) -> bool:
        """Decode, check and write one chunk (in a worker thread, while the next one arrives)."""
        _, first = places[h][0]
        try:
            data = weight_codec.decode(codec_id, first.kind, encoded, first.length)
        except weight_codec.WeightCodecError:
            return False
        if chunk_hash(data) != h:
            return False
        for f, c in places[h]:
            targets[f.path].pwrite(data, c.offset)
            hashing[f.path].wrote(c, data)
        return True
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-fetch") as pool:
        for attempt in range(ATTEMPTS):
            leases.append(_pull(stub, manifest, codec))  # pinned there, and its missing chunks on their way
            request = kvstore_pb2.WeightChunksRequest(model_id=manifest.id, codec=codec, verify=verify,
                                                      chunk_hashes=[bytes.fromhex(h) for h in places if h in todo])
            placing: list[tuple[str, concurrent.futures.Future]] = []
            bad = 0

            def settle(keep: int, placing=placing) -> None:
                nonlocal bad
                while len(placing) > keep:
                    h, done = placing.pop(0)
                    if done.result():
                        todo.discard(h)
                    else:
                        bad += 1
                        log.warning("chunk %s of %s failed its hash: refused, asked again", h[:16], manifest.name)
            try:
                parts: list[bytes] = []
                for piece in stub.GetWeightChunks(request, timeout=TIMEOUT_S):
                    parts.append(piece.data)
                    if piece.offset + len(piece.data) < piece.encoded_bytes:
                        continue
                    h, encoded, parts = piece.chunk_hash.hex(), b"".join(parts), []
                    if h in todo:
                        placing.append((h, pool.submit(place, h, piece.codec, encoded)))
                        settle(2)
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE or attempt == ATTEMPTS - 1:
                    raise ModelFetchError(e.code(), f"streaming {manifest.name} from the site kvstore: "
                                                    f"{e.details()}") from None
                time.sleep(RETRY_S)
            finally:
                settle(0)
            if not todo:
                return
            verify = verify or bad > 0  # the store checks (and repairs) its copies before sending them again
    raise ModelFetchError(grpc.StatusCode.DATA_LOSS, f"{len(todo)} chunk(s) of {manifest.name} kept failing "
                                                     f"their hash after {ATTEMPTS} attempts")


def _read_at(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class ModelPin(threading.Thread):
    """Keeps this worker's model pinned in its site store: renews the lease every third of its time to
    live; a lease the store forgot (it restarted) is taken again with PullModel."""

    def __init__(self, address: str, creds, model_id: str, lease_id: int, ttl_s: float):
        super().__init__(name="model-pin", daemon=True)
        self.address, self.creds, self.model_id = address, creds, model_id
        self.lease_id, self.ttl_s = lease_id, max(1.0, ttl_s)
        self.stopped = threading.Event()

    def run(self) -> None:
        with security.dial(self.address, self.creds) as ch:
            stub = kvstore_pb2_grpc.WeightStoreStub(ch)
            while not self.stopped.wait(self.ttl_s / 3):
                try:
                    reply = stub.RenewModel(kvstore_pb2.ModelLeaseRequest(lease_id=self.lease_id, lease_s=LEASE_S),
                                            timeout=10)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        continue  # the store is away: try again next time
                    with contextlib.suppress(grpc.RpcError):
                        reply = stub.PullModel(kvstore_pb2.PullModelRequest(model_id=self.model_id, lease_s=LEASE_S),
                                               timeout=TIMEOUT_S)
                        self.lease_id = reply.lease_id
                    continue
                self.ttl_s = max(1.0, reply.expires_in_s)
            _release(stub, self.lease_id)

    def stop(self) -> None:
        self.stopped.set()
