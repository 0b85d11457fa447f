"""Model weights as content-addressed chunks: the manifest and the codecs (bit-exact, a corrupted chunk
found), the chunk store's bounds, and real kvstores (real gRPC, mTLS, the emulated-links relay) moving a
model to an edge site whose host has none: a link cut midway fails clearly and leaves no half file; a
chunk corrupted on a store's disk is refused by its hash and fetched again; a fetched GGUF's load caches
arrive verified and are used as they are (nothing rebuilt), a corrupted one refused and fetched again; a
decode worker with an empty model cache fetches the model and serves the same tokens as one loaded from
disk."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from ember.cluster.chaos import Cluster
from ember.cluster.staged import Staged
from ember.model import derived, weight_codec
from ember.model.fetch import DEFAULT_MODEL, MODELS
from ember.model.weight_chunks import Manifest, ManifestError, build_manifest, chunk_ranges, file_regions
from ember.rpc import security
from ember.rpc.model_fetch import ModelFetchError, ensure_model_file
from ember.services.kvstore.chunk_store import ChunkStore
from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.cluster_fixture import wait_until, write_config

FILENAME = MODELS[DEFAULT_MODEL].filename


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- manifest and codecs ------------------------------------------------------------------------

def test_the_gguf_manifest_tiles_the_file_by_kind_and_reassembles_bit_exactly(model_path):
    if model_path.suffix != ".gguf":
        pytest.skip("needs the default GGUF")
    encoded = {}

    def keep(chunk, data):
        encoded[chunk.hash] = weight_codec.encode(chunk.kind, data)
    manifest = build_manifest(model_path, on_chunk=keep)
    [entry] = manifest.files
    assert entry.sha256 == MODELS[DEFAULT_MODEL].sha256
    kinds = {c.kind for c in entry.chunks}
    assert {"meta", "q4_1", "q8_0", "f32"} <= kinds
    assert max(c.length for c in entry.chunks) <= 1.25 * 4 * 2**20
    whole = hashlib.sha256()
    for c in entry.chunks:
        codec, data = encoded[c.hash]
        whole.update(weight_codec.decode(codec, c.kind, data, c.length))
    assert whole.hexdigest() == entry.sha256
    stored = sum(len(d) for _, d in encoded.values())
    print(f"GGUF {entry.size} bytes -> {stored} stored ({1 - stored / entry.size:.1%} saved), "
          f"{len(entry.chunks)} chunks")
    assert stored < entry.size
    again = Manifest.from_json(manifest.to_json(), expect_id=manifest.id)
    assert again == manifest
    tampered = manifest.to_json().replace(entry.chunks[3].hash.encode(), b"0" * 64)
    with pytest.raises(ManifestError):
        Manifest.from_json(tampered, expect_id=manifest.id)


@pytest.mark.parametrize("kind", ["bf16", "f16", "f32", "q4_1", "q8_0", "meta"])
def test_every_codec_is_bit_exact_and_a_corrupted_chunk_is_found(kind):
    rng = np.random.default_rng(1)
    weights = (rng.standard_normal(300_001) * 0.02).astype(np.float32)
    data = {"bf16": (weights.view(np.uint32) >> 16).astype(np.uint16).tobytes(),
            "f16": weights.astype(np.float16).tobytes(), "f32": weights.tobytes(),
            "q4_1": _blocks(rng, 20, 4, 5000), "q8_0": _blocks(rng, 34, 2, 3000),
            "meta": b"tokenizer.ggml.tokens" * 5000}[kind] + b"\x07\x01\x02"  # a tail of no whole element or block
    for codec in (weight_codec.RAW, *weight_codec.candidates(kind)):
        encoded = weight_codec.encode_with(codec, kind, data)
        assert weight_codec.decode(codec, kind, encoded, len(data)) == data, weight_codec.NAMES[codec]
    codec, encoded = weight_codec.encode(kind, data)
    assert len(encoded) <= len(data)
    broken = bytearray(encoded)
    broken[len(broken) // 2] ^= 0x40
    try:
        out = weight_codec.decode(codec, kind, bytes(broken), len(data))
    except weight_codec.WeightCodecError:
        return  # refused as undecodable
    assert hashlib.sha256(out).digest() != hashlib.sha256(data).digest()  # or found by its hash


def _blocks(rng, block: int, scale: int, n: int) -> bytes:
    out = np.empty((n, block), np.uint8)
    out[:, :scale] = np.frombuffer((rng.standard_normal(n * scale // 2) * 0.01).astype(np.float16).tobytes(),
                                   np.uint8).reshape(n, scale)
    out[:, scale:] = rng.integers(0, 256, (n, block - scale), dtype=np.uint8)
    return out.tobytes()


def test_a_safetensors_file_is_cut_along_its_tensors(tmp_path):
    tensors = {"a.weight": ("BF16", (1000, 700)), "b.norm": ("F32", (700,)), "c.weight": ("BF16", (3000, 800))}
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape) in tensors.items():
        nbytes = int(np.prod(shape)) * (2 if dtype == "BF16" else 4)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        blobs.append(os.urandom(nbytes))
        offset += nbytes
    text = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    regions = file_regions(path)
    assert [k for _, _, k in regions] == ["meta", "bf16", "f32", "bf16"]
    chunks = chunk_ranges(regions, target=1 << 20)
    assert all((end - start) % 2 == 0 for start, end, kind in chunks if kind == "bf16")
    assert chunks[0][1] == 8 + len(text) and chunks[-1][1] == path.stat().st_size
    (tmp_path / "config.json").write_text("{}")
    folder = build_manifest(tmp_path)
    assert folder.folder and [f.path for f in folder.files] == ["config.json", "model.safetensors"]


def test_the_chunk_store_evicts_least_recently_used_models_never_a_pinned_one(tmp_path):
    store = ChunkStore(tmp_path, capacity_bytes=3000)
    models = []
    for i in range(3):
        src = tmp_path / f"m{i}.bin"
        src.write_bytes(os.urandom(1000))
        m = build_manifest(src)
        store.add_manifest(m)
        for _, c in m.chunks():
            store.put(c.hash, 0, src.read_bytes()[c.offset:c.offset + c.length], for_model=m.id)
        models.append(m)
    lease = store.acquire(models[0].id, 60)  # m0 is in use; m1 is the least recently used unpinned
    extra = tmp_path / "m3.bin"
    extra.write_bytes(os.urandom(1000))
    m3 = build_manifest(extra)
    store.add_manifest(m3)
    store.put(m3.files[0].chunks[0].hash, 0, extra.read_bytes(), for_model=m3.id)
    assert store.manifest(models[0].id) is not None and store.manifest(models[1].id) is None
    assert store.evictions == 1 and store.bytes <= 3000
    store.release(lease.lease_id)
    again = ChunkStore(tmp_path, capacity_bytes=3000)  # what is on disk is found again
    assert set(again.models) == set(store.models) and again.bytes == store.bytes


# --- kvstores over an emulated link ---------------------------------------------------------------

LINK_GBPS = 1.0  # the edge link (a cut midway slows it to 1/100 first: time to cut it)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, model_path):
    """The two-site cluster's kvstores and links relay (central's host has the model and its load caches
    in its cache, edge's an empty cache), central <-> edge an emulated 20 ms, 1 Gbit/s link, mTLS."""
    if model_path.suffix != ".gguf":
        pytest.skip("needs the default GGUF")
    run_dir = tmp_path_factory.mktemp("weights")
    addr = write_config(run_dir / "cluster.yaml", overrides={
        "model": DEFAULT_MODEL, "placement": {"emulate_links": True},
        "links": [{"a": "central", "b": "edge", "rtt_ms": 20, "bandwidth_gbps": LINK_GBPS}],
        "kvstore": {"chunks_dir": str(run_dir / "chunks"), "chunks_capacity_mb": 1024}})
    staged = Staged(run_dir / "cluster.yaml", run_dir)
    central_cache = str(model_path.parent.parent)  # the host that has the model
    try:
        staged.start("links")
        staged.start("kvstore-central", {"EMBER_CACHE_DIR": central_cache})
        staged.start("kvstore-edge", {"EMBER_CACHE_DIR": str(run_dir / "edge-cache")})
        yield staged, addr, central_cache
    finally:
        staged.close()


def _stats(staged, address) -> kvstore_pb2.WeightStatsResponse:
    with security.dial(address, _creds(staged)) as ch:
        return kvstore_pb2_grpc.WeightStoreStub(ch).WeightStats(kvstore_pb2.StatsRequest(), timeout=10)


def _creds(staged, name: str = "decode-edge") -> security.Credentials:
    return security.Credentials.load(staged.run_dir / "certs" / name)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*")) if folder.exists() else []


def test_a_link_cut_midway_fails_clearly_leaves_no_half_file_and_the_next_fetch_resumes(stores, model_path):
    staged, addr, _ = stores
    dest = staged.run_dir / "worker-a" / "models" / FILENAME
    outcome = {}

    def fetch():
        try:
            outcome["path"] = ensure_model_file(dest, addr["kv_edge"], _creds(staged), pin=False, load_caches=False)
        except ModelFetchError as e:
            outcome["error"] = e
    cluster = Cluster(staged.run_dir)
    cluster.set_faults({cluster.relay_to("kvstore-central"): "slow"})  # 10 Mbit/s: time to cut it midway
    worker = threading.Thread(target=fetch)
    worker.start()
    total = len({c.hash for _, c in build_manifest(model_path).chunks()})
    pulled = wait_until(lambda: (n := _stats(staged, addr["kv_edge"]).chunks_pulled) >= 1 and n, 120,
                        "the edge store pulling its first chunks")
    cluster.set_faults({cluster.relay_to("kvstore-central"): "reset"})
    try:
        worker.join(timeout=120)
        assert not worker.is_alive()
        at_cut = _stats(staged, addr["kv_edge"]).chunks_pulled
        assert at_cut < total, "the whole model crossed before the cut: nothing was cut midway"
        error = outcome.get("error")
        assert error is not None and error.code == grpc.StatusCode.UNAVAILABLE, outcome
        print(f"cut after {pulled} of {total} chunks: {error}")
        assert not dest.exists() and _leftovers(dest.parent) == []  # no half file, no temporary one
    finally:
        cluster.set_faults({})
    path = ensure_model_file(dest, addr["kv_edge"], _creds(staged), pin=False, load_caches=False)
    assert _sha(path) == MODELS[DEFAULT_MODEL].sha256 and _leftovers(dest.parent) == [FILENAME, FILENAME + ".sha256"]
    after = _stats(staged, addr["kv_edge"])
    assert after.chunks_pulled == total  # what crossed before the cut was kept, nothing crossed twice
    assert after.wire_bytes_pulled < path.stat().st_size  # compressed on the wire


def test_a_chunk_corrupted_on_a_stores_disk_is_refused_by_its_hash_and_fetched_again(stores, model_path):
    staged, addr, _ = stores
    manifest = build_manifest(model_path)
    chunks = [c for _, c in manifest.chunks() if c.kind == "q4_1"]
    at_edge, at_central = chunks[5], chunks[9]
    edge_dir, central_dir = staged.run_dir / "chunks" / "edge", staged.run_dir / "chunks" / "central"
    ensure_model_file(staged.run_dir / "warm" / FILENAME, addr["kv_edge"], _creds(staged), pin=False,
                      load_caches=False)
    # one chunk damaged on the edge store's disk (the worker's source); another damaged on central's
    # disk and gone from edge's (the edge store's source)
    _flip(next((edge_dir / "chunks" / at_edge.hash[:2]).glob(at_edge.hash + ".*")))
    _flip(next((central_dir / "chunks" / at_central.hash[:2]).glob(at_central.hash + ".*")))
    next((edge_dir / "chunks" / at_central.hash[:2]).glob(at_central.hash + ".*")).unlink()
    before_edge, before_central = _stats(staged, addr["kv_edge"]), _stats(staged, addr["kv_central"])
    dest = staged.run_dir / "worker-b" / "models" / FILENAME
    path = ensure_model_file(dest, addr["kv_edge"], _creds(staged), pin=False, load_caches=False)
    assert _sha(path) == MODELS[DEFAULT_MODEL].sha256
    edge, central = _stats(staged, addr["kv_edge"]), _stats(staged, addr["kv_central"])
    # the worker refuses edge's bad copy and asks again with verify: the edge store finds it bad (refused)
    # and fetches it again; the chunk gone from edge's disk is fetched from central checked: central is
    # asked to verify, finds its own copy bad and repairs it from its file first
    assert edge.chunks_refused > before_edge.chunks_refused
    assert central.chunks_repaired > before_central.chunks_repaired
    assert edge.chunks_repaired >= before_edge.chunks_repaired + 2


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_bad_requests_get_clear_statuses(stores):
    staged, addr, _ = stores
    with security.dial(addr["kv_edge"], _creds(staged)) as ch:
        stub = kvstore_pb2_grpc.WeightStoreStub(ch)
        cases = [(stub.GetManifest, kvstore_pb2.ManifestRequest(model_id="xyz"), grpc.StatusCode.INVALID_ARGUMENT),
                 (stub.GetManifest, kvstore_pb2.ManifestRequest(name="no-such-model.gguf"), grpc.StatusCode.NOT_FOUND),
                 (stub.GetManifest, kvstore_pb2.ManifestRequest(name=derived.derived_name(FILENAME, "0" * 64)),
                  grpc.StatusCode.NOT_FOUND),  # load caches of a file nobody has: the worker builds its own
                 (stub.PullModel, kvstore_pb2.PullModelRequest(model_id="0" * 64), grpc.StatusCode.NOT_FOUND),
                 (stub.RenewModel, kvstore_pb2.ModelLeaseRequest(lease_id=999, lease_s=5),
                  grpc.StatusCode.FAILED_PRECONDITION)]
        for call, request, code in cases:
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=30)
            assert e.value.code() == code, (request, e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            list(stub.GetWeightChunks(kvstore_pb2.WeightChunksRequest(model_id="0" * 64, chunk_hashes=[b"short"]),
                                      timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with security.dial(addr["kv_edge"], _creds(staged, "router")) as ch:  # not a worker or a store
        with pytest.raises(grpc.RpcError) as e:
            kvstore_pb2_grpc.WeightStoreStub(ch).PullModel(kvstore_pb2.PullModelRequest(name=FILENAME), timeout=30)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_fetched_ggufs_load_caches_arrive_verified_and_are_used_not_rebuilt(stores, model_path):
    from ember.model import q4_cache
    from ember.model.files import cache_dir_for, ensure_gguf_cache, is_q4_1_gguf, sha256_file
    staged, addr, _ = stores
    sha256 = MODELS[DEFAULT_MODEL].sha256
    published = derived.publishable(model_path, sha256)
    if published is None or q4_cache.FILE not in published:
        pytest.skip("the central host's load caches are not current (ember fetch-model makes them)")
    dest = staged.run_dir / "worker-c" / "models" / FILENAME
    path = ensure_model_file(dest, addr["kv_edge"], _creds(staged), pin=False)
    folder, central = cache_dir_for(path), cache_dir_for(model_path)
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == sorted(published)
    for rel in (q4_cache.FILE, "config.json", "tokenizer.json"):  # (every chunk and file was checked on arrival)
        assert sha256_file(folder / rel) == sha256_file(central / rel), rel
    stamps = _stamps(folder)
    assert ensure_gguf_cache(path) == folder and q4_cache.ensure(path) == folder / q4_cache.FILE
    assert is_q4_1_gguf(path)
    assert _stamps(folder) == stamps  # what the loader asks for is current as fetched: nothing was rebuilt
    assert not [name for name in _leftovers(dest.parent) if name.startswith(".")]  # no partial folder left

    # a derived chunk damaged on the edge store's disk: the worker refuses it, the store fetches it again
    manifest = Manifest.from_json(_manifest_bytes(staged, addr, derived.derived_name(FILENAME, sha256)))
    bad = next(c for f, c in manifest.chunks() if f.path == q4_cache.FILE)
    _flip(next((staged.run_dir / "chunks" / "edge" / "chunks" / bad.hash[:2]).glob(bad.hash + ".*")))
    before = _stats(staged, addr["kv_edge"])
    again = ensure_model_file(staged.run_dir / "worker-d" / "models" / FILENAME, addr["kv_edge"], _creds(staged),
                              pin=False)
    after = _stats(staged, addr["kv_edge"])
    assert after.chunks_refused > before.chunks_refused and after.chunks_repaired > before.chunks_repaired
    assert q4_cache.cached(again) is not None
    assert sha256_file(cache_dir_for(again) / q4_cache.FILE) == sha256_file(central / q4_cache.FILE)


def _stamps(folder: Path) -> dict:
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*") if p.is_file()}


def _manifest_bytes(staged, addr, name: str) -> bytes:
    with security.dial(addr["kv_edge"], _creds(staged)) as ch:
        return kvstore_pb2_grpc.WeightStoreStub(ch).GetManifest(kvstore_pb2.ManifestRequest(name=name),
                                                                 timeout=60).manifest


def test_a_decode_worker_with_an_empty_cache_fetches_the_model_and_serves_the_same_tokens(stores, engine):
    from ember.client import RouterClient
    from ember.engine.sampling_params import SamplingParams
    staged, addr, central_cache = stores
    empty = staged.run_dir / "decode-cache"
    start = time.monotonic()
    staged.start("prefill-central", {"EMBER_CACHE_DIR": central_cache}, wait=False)
    staged.start("decode-edge", {"EMBER_CACHE_DIR": str(empty)}, wait=False)
    staged.start("router", {"EMBER_CACHE_DIR": central_cache}, wait=False)
    for name in ("prefill-central", "decode-edge", "router"):
        staged.wait_serving(name, 240)
    print(f"decode worker with an empty cache serving after {time.monotonic() - start:.1f} s")
    assert _sha(empty / "models" / FILENAME) == MODELS[DEFAULT_MODEL].sha256
    ids = engine.tokenizer.encode("The capital of France is")
    with RouterClient(addr["router"]) as client:
        got = wait_until(lambda: _complete(client, ids), 60, "the router placing a request on the new worker")
    want = engine.generate([ids], SamplingParams(max_tokens=12))[0]
    assert got == list(want.token_ids)
    assert _stats(staged, addr["kv_edge"]).pinned_models >= 1  # the worker holds its model in its site store
    if "fetched the load caches" not in (staged.run_dir / "decode-edge.log").read_text():
        assert derived.publishable(Path(central_cache) / "models" / FILENAME, MODELS[DEFAULT_MODEL].sha256) is None


def _complete(client, ids: list[int]):
    try:
        return list(client.complete(token_ids=ids, max_tokens=12, temperature=0.0).token_ids)
    except grpc.RpcError:
        return None
