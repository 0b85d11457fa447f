"""KV frames nobody can forge (ember/kv/wire.py): the keyed MAC, unit level and through a real
kvstore over gRPC (torch-free, no cluster; tests/test_kv_forgery.py does it end to end)."""
from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest

from ember.kv import codec, wire
from ember.rpc.errors import status_for
from ember.rpc.kv_connector import KVConnector
from ember.rpc.site_kv import SiteKV
from tests.test_kv_wire import BLOCK_HASH, LAYOUT, PAYLOAD, TEMPLATE, kv_like

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
SIGNED = wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD, mac_key=KEY)


def forge(frame: bytes, payload: bytes | None = None, **fields) -> bytes:
    """`frame` with header fields and/or payload replaced and a *valid* checksum recomputed:
    what anyone can make without the key (XXH3 is public)."""
    header = replace(wire.parse_header(frame), **fields)
    payload = frame[wire.HEADER_BYTES:] if payload is None else payload
    header = replace(header, checksum=wire._checksum(header, payload))
    return header.pack() + payload


def test_a_signed_frame_verifies_with_the_key_and_is_exactly_the_payload():
    header = wire.parse_header(SIGNED)
    assert header.mac != bytes(wire.MAC_BYTES) and header.nonce != bytes(wire.NONCE_BYTES)
    assert len(SIGNED) == wire.HEADER_BYTES + len(PAYLOAD) and wire.HEADER_BYTES == 104
    assert bytes(wire.decode_frame(SIGNED, TEMPLATE, block_hash=BLOCK_HASH, mac_key=KEY)) == PAYLOAD
    # a kvstore (no key) checks the checksum only, and it covers nonce and MAC too
    assert bytes(wire.decode_frame(SIGNED, TEMPLATE, block_hash=BLOCK_HASH)) == PAYLOAD


def test_every_frame_gets_a_fresh_nonce_and_mac():
    again = wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD, mac_key=KEY)
    a, b = wire.parse_header(SIGNED), wire.parse_header(again)
    assert a.nonce != b.nonce and a.mac != b.mac and SIGNED[wire.HEADER_BYTES:] == again[wire.HEADER_BYTES:]


def test_sign_frame_signs_what_the_engine_exported():
    exported = wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD)  # engine.export_frames: unsigned
    signed = wire.sign_frame(exported, KEY)
    assert signed[wire.HEADER_BYTES:] == exported[wire.HEADER_BYTES:]
    assert bytes(wire.decode_frame(signed, TEMPLATE, block_hash=BLOCK_HASH, mac_key=KEY)) == PAYLOAD
    header, body = wire.reencode(exported, codec.PLANES)
    with pytest.raises(ValueError, match="only raw"):
        wire.sign_frame(header.pack() + bytes(body), KEY)


@pytest.mark.parametrize("name, forged", [
    ("unsigned (zero MAC)", lambda: wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD)),
    ("signed with another key", lambda: wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD, mac_key=OTHER_KEY)),
    ("payload replaced", lambda: forge(SIGNED, payload=kv_like(LAYOUT.block_bytes, 2, seed=7))),
    ("one payload bit", lambda: forge(SIGNED, payload=bytes([PAYLOAD[0] ^ 1]) + PAYLOAD[1:])),
    ("moved to another block hash", lambda: forge(SIGNED, block_hash=b"\x55" * 16)),
    ("nonce changed", lambda: forge(SIGNED, nonce=b"\x01" * 16)),
    ("MAC changed", lambda: forge(SIGNED, mac=bytes(a ^ 0x80 for a in wire.parse_header(SIGNED).mac))),
    ("MAC of another frame", lambda: forge(SIGNED, mac=wire.parse_header(
        wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD, mac_key=KEY)).mac)),
])
def test_a_forged_frame_with_a_valid_checksum_is_refused_as_data_loss(name, forged):
    frame = forged()
    block_hash = wire.parse_header(frame).block_hash
    wire.decode_frame(frame, TEMPLATE, block_hash=block_hash)  # well formed, valid XXH3: a kvstore keeps it
    with pytest.raises(wire.ForgedFrame, match="fails its MAC") as e:
        wire.decode_frame(frame, TEMPLATE, block_hash=block_hash, mac_key=KEY)
    assert isinstance(e.value, wire.CorruptFrame) and e.value.status == "DATA_LOSS"
    assert status_for(e.value)[0].name == "DATA_LOSS"


def test_a_header_field_the_layout_allows_cannot_be_changed_either():
    """root_hash is checked against the reader's layout first; were a reader to accept it, the MAC
    still binds every invariant field (here: a frame forged for another root hash)."""
    other = forge(SIGNED, root_hash=b"\x66" * 16)
    with pytest.raises(wire.ForgedFrame):
        wire.decode_frame(other, mac_key=KEY)  # no layout to compare against: the MAC alone refuses it


def test_any_flipped_byte_of_a_signed_frame_is_refused():
    for position in range(0, len(SIGNED), 5):
        damaged = bytearray(SIGNED)
        damaged[position] ^= 0x08
        with pytest.raises(wire.FrameError):
            wire.decode_frame(damaged, TEMPLATE, block_hash=BLOCK_HASH, mac_key=KEY)


def test_re_encoded_in_flight_and_stored_raw_again_the_frame_still_verifies():
    frame = wire.encode_frame(TEMPLATE, BLOCK_HASH, kv_like(LAYOUT.block_bytes, 2, seed=3), mac_key=KEY)
    header, body = wire.reencode(frame, codec.PLANES)  # what a pull sends over a slow link
    assert header.codec == codec.PLANES and header.mac == wire.parse_header(frame).mac
    planes = header.pack() + bytes(body)
    assert bytes(wire.decode_frame(planes, TEMPLATE, mac_key=KEY)) == frame[wire.HEADER_BYTES:]
    out = bytearray(len(frame))
    wire.write_raw(planes, memoryview(out))  # what the receiving kvstore files
    assert bytes(out) == frame
    assert bytes(wire.decode_frame(out, TEMPLATE, mac_key=KEY)) == frame[wire.HEADER_BYTES:]


def test_no_key_means_zero_mac_and_no_check():
    plain = wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD)
    header = wire.parse_header(plain)
    assert header.mac == bytes(wire.MAC_BYTES) and header.nonce == bytes(wire.NONCE_BYTES)
    assert bytes(wire.decode_frame(plain, TEMPLATE, block_hash=BLOCK_HASH)) == PAYLOAD
    forged = forge(plain, payload=bytes(len(PAYLOAD)))  # a plaintext cluster takes it: documented
    assert bytes(wire.decode_frame(forged, TEMPLATE, block_hash=BLOCK_HASH)) == bytes(len(PAYLOAD))


def test_keys_too_short_are_refused_and_long_ones_work():
    with pytest.raises(ValueError, match="at least 16"):
        wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD, mac_key=b"short")
    with pytest.raises(ValueError, match="at least 16"):
        KVConnector("127.0.0.1:1", TEMPLATE, mac_key=b"")
    long_key = os.urandom(200)  # more than BLAKE2b's 64 key bytes: hashed down
    frame = wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD, mac_key=long_key)
    assert bytes(wire.decode_frame(frame, TEMPLATE, mac_key=long_key)) == PAYLOAD
    with pytest.raises(wire.ForgedFrame):
        wire.decode_frame(frame, TEMPLATE, mac_key=long_key[:199] + bytes([long_key[199] ^ 1]))


# -- through a real kvstore (one process, real gRPC) --------------------------------------------------

def test_the_engine_side_signs_what_it_stores_and_refuses_what_it_did_not_sign():
    from ember.v1 import kvstore_pb2
    from tests.test_kvstore_service import kvstore, run

    blocks = [((2000 + i).to_bytes(16, "little"), kv_like(LAYOUT.block_bytes, 2, seed=i)) for i in range(3)]
    frames = [(h, wire.encode_frame(TEMPLATE, h, p)) for h, p in blocks]  # as engine.export_frames makes them

    async def go():
        async with kvstore(16) as (service, stub, address):
            connector = KVConnector(address, TEMPLATE, mac_key=KEY)
            try:
                stored, _ = await asyncio.wrap_future(connector.store(frames[:2]))
                assert stored == 2
                for h, p in blocks[:2]:  # the store holds signed frames; it never had the key
                    kept = bytes(service.store.get(h))
                    assert wire.parse_header(kept).mac != bytes(wire.MAC_BYTES)
                    assert bytes(wire.decode_frame(kept, TEMPLATE, block_hash=h, mac_key=KEY)) == p
                # a forgery under a real hash: valid XXH3, no valid MAC; the store accepts the bytes
                h, p = blocks[2]
                assert service.put_frame(h, memoryview(forge(frames[2][1], payload=bytes(len(p)))))
                loaded = await asyncio.wrap_future(connector.load([h for h, _ in blocks[:2]], "", 10))
                assert {k: bytes(v) for k, v in loaded.payloads.items()} == dict(blocks[:2])
                await asyncio.wrap_future(connector.release(loaded.lease_id))
                with pytest.raises(wire.ForgedFrame):
                    await asyncio.wrap_future(connector.load([b for b, _ in blocks], "", 10))
                assert connector.frames_forged == 1
                assert (await stub.Stats(kvstore_pb2.StatsRequest())).leases == 0, "the refused load released its lease"
            finally:
                await asyncio.to_thread(connector.close)
            # a plaintext cluster's engine (no key) reads the same forgery unchecked
            async with _site(address, None) as kv:
                lease = await kv.acquire([h], 10)
                assert bytes((await kv.payloads([h], lease, TEMPLATE, 10))[h]) == bytes(len(p))
                await kv.release(lease.lease_id)
    run(go())


class _site:
    def __init__(self, address: str, mac_key: bytes | None):
        self.address, self.mac_key = address, mac_key

    async def __aenter__(self) -> SiteKV:
        import grpc
        self.kv = SiteKV(grpc.aio.insecure_channel(self.address), use_shm=False, mac_key=self.mac_key)
        return self.kv

    async def __aexit__(self, *exc) -> None:
        await self.kv.channel.close()


def test_a_pull_with_the_planes_codec_keeps_the_mac():
    from ember.v1 import kvstore_pb2
    from tests.test_kvstore_service import kvstore, run

    async def go():
        async with kvstore(16) as (src, _, src_addr), kvstore(16, "planes") as (dst, dst_stub, dst_addr):
            blocks = [((3000 + i).to_bytes(16, "little"), kv_like(LAYOUT.block_bytes, 2, seed=10 + i))
                      for i in range(3)]
            for h, p in blocks:
                src.store.put(h, wire.encode_frame(TEMPLATE, h, p, mac_key=KEY))
            pulled = await dst_stub.Pull(kvstore_pb2.PullRequest(block_hashes=[h for h, _ in blocks], source=src_addr))
            assert pulled.codec == "planes" and pulled.wire_bytes < pulled.bytes_pulled
            async with _site(dst_addr, KEY) as kv:
                lease = await kv.acquire([h for h, _ in blocks], 10)
                got = await kv.payloads([h for h, _ in blocks], lease, TEMPLATE, 10)
                assert {h: bytes(v) for h, v in got.items()} == dict(blocks) and kv.frames_forged == 0
                await kv.release(lease.lease_id)
    run(go())
