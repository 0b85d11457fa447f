"""KV frames nobody can forge, end to end on a real mTLS cluster (issue 15): a frame with a real
block hash, the real root hash and a valid XXH3 checksum, but no valid MAC, that a writer puts
into the edge kvstore is refused by decode (never imported), and the request whose prefix it is
still gets the reference tokens. Frames signed with the cluster's key are imported, so the
refusal is the MAC's doing. On the session's exact cluster (its prompts are this module's own)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ember.client import RouterClient
from ember.cluster.launcher import credentials
from ember.engine.sampling_params import SamplingParams
from ember.kv import wire
from ember.kv.block_hash import chain_hashes
from ember.kv.chunks import split
from ember.rpc import security
from ember.rpc.server import CHANNEL_OPTIONS
from ember.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from tests.cluster_fixture import wait_until
from tests.conftest import LONG_TEXT


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    run_dir = Path(shared_cluster["run_dir"])
    as_ = {name: credentials(run_dir, name) for name in ("operator", "router", "prefill-central")}
    assert all(as_.values()), f"the cluster (tls: auto, the default) made no certificates under {run_dir / 'certs'}"
    mac_key = (run_dir / "certs" / "prefill-central" / "kv-mac.key").read_bytes()
    assert not (run_dir / "certs" / "kvstore-edge" / "kv-mac.key").exists(), "kvstores never hold the key"
    return shared_cluster | {"creds": as_, "mac_key": mac_key}


def put(cluster, frames: list[tuple[bytes, bytes]]) -> int:
    """KVStore.Put into the edge kvstore as a KV producer may (the role authorization lets write)."""
    with security.dial(cluster["kv_edge"], cluster["creds"]["prefill-central"], options=CHANNEL_OPTIONS) as ch:
        chunks = (kvstore_pb2.BlockChunk(block_hash=h, block_bytes=n, offset=o, data=d) for h, n, o, d in split(frames))
        return kvstore_pb2_grpc.KVStoreStub(ch).Put(chunks, timeout=30).blocks_stored


def decode(cluster, request_id: str, ids: list[int], hashes: list[bytes], max_tokens: int = 6):
    """A Decode call as the router makes it (first token forced to 5); its messages."""
    request = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=ids, first_token=5,
                                       block_hashes=hashes, source_kvstore=cluster["kv_central"],
                                       sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    with security.dial(cluster["decode"], cluster["creds"]["router"]) as ch:
        return list(decode_pb2_grpc.DecodeStub(ch).Decode(request, timeout=120))


def reference(engine, ids: list[int], max_tokens: int = 6) -> list[int]:
    rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens), output_prefix=[5])
    got = []
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    return got


def kv_edge_leases(cluster) -> int:
    with security.dial(cluster["kv_edge"], cluster["creds"]["operator"]) as ch:
        return kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=10).leases


def decode_log(cluster) -> str:
    return (Path(cluster["run_dir"]) / "decode-edge.log").read_text(errors="replace")


def wait_logged(cluster, text: str, timeout_s: float = 10) -> None:
    wait_until(lambda: text in decode_log(cluster), timeout_s, f"decode logging {text!r}")


def real_frames(engine, ids: list[int], blocks: int) -> list[tuple[bytes, bytes]]:
    """(hash, raw unsigned frame) of the prompt's first `blocks` blocks, the KV this model computes."""
    engine.generate([ids], SamplingParams(max_tokens=1))
    hashes = chain_hashes(ids, 16, engine.block_manager.root_hash)[:blocks]
    return list(zip(hashes, engine.export_frames(hashes)))


def forged(frame: bytes, payload: bytes) -> bytes:
    """`frame`'s header (real block hash, real root hash) over `payload`, with a valid XXH3 and a
    zero MAC: everything a writer without the key can get right."""
    header = replace(wire.parse_header(frame), nonce=bytes(wire.NONCE_BYTES), mac=bytes(wire.MAC_BYTES))
    header = replace(header, checksum=wire._checksum(header, payload))
    return header.pack() + payload


def prompt(engine, topic: str) -> list[int]:
    return engine.tokenizer.encode(f"On {topic}: " + LONG_TEXT[:420])


def test_frames_signed_with_the_cluster_key_are_imported(cluster, engine):
    """The control: the same path with frames a KV producer signed takes the blocks from L2."""
    ids = prompt(engine, "signed blocks")
    frames = [(h, wire.sign_frame(f, cluster["mac_key"])) for h, f in real_frames(engine, ids, 4)]
    assert put(cluster, frames) == 4
    out = decode(cluster, "signed", ids, [h for h, _ in frames])
    assert [t for m in out for t in m.token_ids] == reference(engine, ids)
    assert out[0].recomputed_tokens == len(ids) - 4 * 16 + 1, "the 4 signed blocks were imported"
    assert kv_edge_leases(cluster) == 0


@pytest.mark.parametrize("kind", ["another block's KV", "the right KV, unsigned"])
def test_a_forged_frame_with_real_hashes_and_a_valid_xxh3_is_refused(cluster, engine, kind):
    ids = prompt(engine, f"forgery with {kind}")
    frames = real_frames(engine, ids, 4)
    decoy = real_frames(engine, prompt(engine, f"a decoy for {kind}"), 4)
    fakes = [(h, forged(f, (d if kind.startswith("another") else f)[wire.HEADER_BYTES:]))
             for (h, f), (_, d) in zip(frames, decoy)]
    for h, f in fakes:  # what a kvstore checks holds: the block hash it is filed under, layout, checksum
        assert bytes(wire.decode_frame(f, engine.frame_template, block_hash=h)) == f[wire.HEADER_BYTES:]
        with pytest.raises(wire.ForgedFrame):
            wire.decode_frame(f, engine.frame_template, block_hash=h, mac_key=cluster["mac_key"])
    assert put(cluster, fakes) == 4, "the kvstore stores the bytes: it holds no key"
    out = decode(cluster, f"forged-{kind[:7]}", ids, [h for h, _ in fakes])
    assert [t for m in out for t in m.token_ids] == reference(engine, ids), "the prompt was computed instead"
    assert out[0].recomputed_tokens == len(ids) + 1 and out[0].blocks_pulled == 0, "nothing was imported"
    wait_logged(cluster, f"block {fakes[0][0].hex()} fails its MAC")
    assert kv_edge_leases(cluster) == 0, "the refused load released its lease"


def test_the_next_request_with_a_forged_prefix_gets_the_reference_tokens(cluster, engine):
    """Through the router: the forged blocks wait at the edge before anyone asked for this prompt;
    prefill computes it at central, decode's pull finds the edge already 'holding' them, refuses
    them on the MAC, and computes the prompt itself."""
    ids = engine.tokenizer.encode("A request whose prefix someone forged: " + LONG_TEXT[600:1300])
    frames = real_frames(engine, ids, len(ids) // 16)
    decoy = real_frames(engine, engine.tokenizer.encode("Decoy KV. " + LONG_TEXT[1400:2100]), len(frames))
    fakes = [(h, forged(f, d[wire.HEADER_BYTES:])) for (h, f), (_, d) in zip(frames, decoy)]
    assert put(cluster, fakes) == len(fakes)
    with RouterClient(cluster["router"]) as client:
        out = client.complete(token_ids=ids, max_tokens=12, ignore_eos=True, timeout=180)
    [want] = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))
    assert out.token_ids == want.token_ids
    wait_logged(cluster, f"block {fakes[0][0].hex()} fails its MAC")
