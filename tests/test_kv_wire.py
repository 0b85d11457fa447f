"""The KV block wire format and the lossless codec: round trips, rejections, fuzzing (torch-free)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.kv import codec, wire
from ember.kv.block_hash import KVLayout

LAYOUT = KVLayout("fp-test", "bfloat16", block_size=4, num_layers=2, num_kv_heads=2, head_dim=16)
ROOT = b"\x11" * 16
TEMPLATE = wire.layout_header(LAYOUT, ROOT)
BLOCK_HASH = b"\x22" * 16


def kv_like(num_bytes: int, element_bytes: int, seed: int = 0) -> bytes:
    """Gaussian values as bf16 or fp32 bytes (activations and KV look like this)."""
    values = np.random.default_rng(seed).normal(0, 1.5, num_bytes // element_bytes).astype(np.float32)
    if element_bytes == 2:
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return values.tobytes()


PAYLOAD = kv_like(LAYOUT.block_bytes, 2)
FRAME = wire.encode_frame(TEMPLATE, BLOCK_HASH, PAYLOAD)


def planes_frame() -> bytes:
    header, body = wire.reencode(FRAME, codec.PLANES)
    assert header.codec == codec.PLANES
    return header.pack() + bytes(body)


def test_raw_frame_round_trip_is_a_view_and_checks_everything():
    assert len(FRAME) == wire.frame_bytes(LAYOUT.block_bytes) == wire.HEADER_BYTES + LAYOUT.block_bytes
    payload = wire.decode_frame(FRAME, TEMPLATE, block_hash=BLOCK_HASH)
    assert bytes(payload) == PAYLOAD and payload.obj is not None


@pytest.mark.parametrize("dtype, element_bytes", [("bfloat16", 2), ("float32", 4)])
def test_planes_codec_is_bit_exact_and_smaller(dtype, element_bytes):
    layout = replace(LAYOUT, dtype=dtype, block_size=64)
    template = wire.layout_header(layout, ROOT)
    payload = kv_like(layout.block_bytes, element_bytes, seed=3)
    frame = wire.encode_frame(template, BLOCK_HASH, payload)
    header, body = wire.reencode(frame, codec.PLANES)
    assert header.codec == codec.PLANES and header.checksum == wire.parse_header(frame).checksum
    saving = 1 - len(body) / len(payload)
    assert saving > (0.25 if element_bytes == 2 else 0.10), saving
    decoded = wire.decode_frame(header.pack() + bytes(body), template, block_hash=BLOCK_HASH)
    assert bytes(decoded) == payload
    out = bytearray(wire.frame_bytes(layout.block_bytes))
    raw_header = wire.write_raw(header.pack() + bytes(body), memoryview(out))
    assert raw_header.codec == codec.RAW and bytes(out) == frame, "stored raw again, byte for byte"


def test_incompressible_payload_stays_raw():
    noise = np.random.default_rng(1).integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8).tobytes()
    header, body = wire.reencode(wire.encode_frame(TEMPLATE, BLOCK_HASH, noise), codec.PLANES)
    assert header.codec == codec.RAW and bytes(body) == noise


@pytest.mark.parametrize("field, value", [
    ("root_hash", b"\x33" * 16), ("dtype", wire.DTYPES["float32"]), ("block_size", 8), ("num_layers", 3),
])
def test_a_frame_for_another_model_or_layout_is_invalid_argument(field, value):
    other = replace(TEMPLATE, **{field: value})
    frame = wire.encode_frame(other, BLOCK_HASH, kv_like(2 * other.num_layers * other.num_kv_heads * other.head_dim
                                                           * other.block_size * wire.ELEMENT_BYTES[other.dtype], 2))
    with pytest.raises(wire.LayoutMismatch, match=field) as e:
        wire.decode_frame(frame, TEMPLATE)
    assert e.value.status == "INVALID_ARGUMENT"


def test_a_latent_frame_carries_one_plane_and_a_two_plane_reader_refuses_it():
    """MLA's blocks hold one latent plane a layer (the LATENT flag): half a two-plane block of the
    same width; they round-trip, signed and re-encoded, and never pass for a K/V layout."""
    latent = replace(LAYOUT, num_kv_heads=1, head_dim=48, planes=1)
    template = wire.layout_header(latent, ROOT)
    payload = kv_like(latent.block_bytes, 2, seed=5)
    assert latent.block_bytes == 2 * 4 * 48 * 2  # layers x tokens x values x bf16, one plane
    key = b"k" * 32
    frame = wire.sign_frame(wire.encode_frame(template, BLOCK_HASH, payload), key)
    assert wire.parse_header(frame).planes == 1 and frame[7] == wire.LATENT
    assert bytes(wire.decode_frame(frame, template, block_hash=BLOCK_HASH, mac_key=key)) == payload
    header, body = wire.reencode(frame, codec.PLANES)
    assert bytes(wire.decode_frame(header.pack() + bytes(body), template, mac_key=key)) == payload
    two_planes = wire.layout_header(replace(latent, num_kv_heads=1, head_dim=24, planes=2), ROOT)
    with pytest.raises(wire.LayoutMismatch, match="planes=1, this server needs 2"):
        wire.decode_frame(frame, two_planes)
    unknown = bytearray(frame)
    unknown[7] |= 0x02
    with pytest.raises(wire.LayoutMismatch, match="flags 0x3"):
        wire.parse_header(unknown)


def test_a_frame_filed_under_another_hash_is_refused():
    with pytest.raises(wire.LayoutMismatch, match="carries hash"):
        wire.decode_frame(FRAME, TEMPLATE, block_hash=b"\x44" * 16)


@pytest.mark.parametrize("make", [planes_frame, lambda: FRAME])
def test_any_flipped_byte_is_data_loss_or_invalid(make):
    frame = make()
    for position in range(0, len(frame), 7):
        damaged = bytearray(frame)
        damaged[position] ^= 0x40
        with pytest.raises(wire.FrameError):
            wire.decode_frame(damaged, TEMPLATE, block_hash=BLOCK_HASH)
    with pytest.raises(wire.CorruptFrame) as e:
        wire.decode_frame(frame[:-1], TEMPLATE)
    assert e.value.status == "DATA_LOSS"


def test_bad_magic_and_future_versions_are_invalid_argument():
    with pytest.raises(wire.LayoutMismatch, match="not a KV block frame"):
        wire.decode_frame(b"XXXX" + FRAME[4:])
    with pytest.raises(wire.LayoutMismatch, match="version 9"):
        wire.decode_frame(FRAME[:4] + bytes([9]) + FRAME[5:])


def test_version_1_frames_from_before_the_mac_are_refused():
    """Version 2 added the nonce and MAC (header 72 -> 104 bytes): an older engine's frame is not read."""
    assert wire.VERSION == 2 and wire.HEADER_BYTES == 104
    with pytest.raises(wire.LayoutMismatch, match="version 1 is not supported .this build reads 2"):
        wire.decode_frame(FRAME[:4] + bytes([1]) + FRAME[5:], TEMPLATE)


FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_arbitrary_bytes_never_crash(data):
    for blob in (data, FRAME[:wire.HEADER_BYTES] + data, planes_frame()[:wire.HEADER_BYTES] + data):
        try:
            wire.decode_frame(blob, TEMPLATE)
        except wire.FrameError:
            pass


@FUZZ
@given(st.data())
def test_fuzz_mutated_frames_are_rejected_or_exact(data):
    frame = bytearray(data.draw(st.sampled_from([FRAME, planes_frame()])))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "header"]))
        if kind == "flip" and frame:
            i = data.draw(st.integers(0, len(frame) - 1))
            frame[i] = data.draw(st.integers(0, 255))
        elif kind == "truncate":
            del frame[data.draw(st.integers(0, len(frame))):]
        elif kind == "insert":
            i = data.draw(st.integers(0, len(frame)))
            frame[i:i] = data.draw(st.binary(min_size=1, max_size=16))
        else:  # rewrite one header field with anything
            i = data.draw(st.integers(0, min(len(frame), wire.HEADER_BYTES) - 1)) if frame else 0
            frame[i:i + 8] = data.draw(st.binary(min_size=8, max_size=8))
    try:
        payload = wire.decode_frame(frame, TEMPLATE, block_hash=BLOCK_HASH)
    except wire.FrameError:
        return
    assert bytes(payload) == PAYLOAD, "a frame that decodes must give exactly the original bytes"


@FUZZ
@given(st.binary(max_size=400), st.sampled_from([2, 4]))
def test_fuzz_codec_decoder_only_raises_codec_errors(encoded, element_bytes):
    out = memoryview(bytearray(256))
    try:
        codec.decode_into(codec.PLANES, encoded, element_bytes, out)
    except codec.CodecError:
        pass


def test_forged_huge_content_size_is_refused_without_allocating():
    zstd_frame = bytearray(codec._zstd.compressor.compress(b"\x01" * 128))
    forged = codec._LEN.pack(len(zstd_frame)) + bytes(zstd_frame)
    with pytest.raises(codec.CodecError):
        codec.decode_into(codec.PLANES, forged + b"\x00" * 128, 2, memoryview(bytearray(512)))  # says 128, needs 256


def test_codec_only_pays_on_slow_links():
    assert codec.worth_it(0.05, 2) and codec.worth_it(0.1, 2)  # ~0.4-0.8 Gbit/s WAN
    assert not codec.worth_it(2.5, 2) and not codec.worth_it(1.0, 2)  # loopback, LAN
