"""Lossless codecs for chunks of model weights (torch-free), chosen per chunk by size.

A chunk holds one kind of bytes (ember.model.weight_chunks): 16-bit floats, 32-bit floats, quantized
blocks (Q4_1: per 32 weights an f16 scale d, an f16 min m and 16 bytes of nibbles; Q8_0: f16 d and 32
int8) or metadata. Candidates per kind:
- raw;
- planes16 / planes32: ember.kv.codec's byte planes, zstd on the high plane (sign + exponent), as
  ZipNN, DFloat11 and Unweight code BF16 weights;
- zstd: the whole chunk, level 3;
- grouped: quantized blocks regrouped into a scales plane (each f16 split into its low and high bytes)
  and a codes plane, each zstd-coded (the codes kept raw when zstd does not shrink them).
`encode` keeps the smallest; `decode` is exact (tests check every codec bit for bit). Every codec
keeps a tail that is not a whole element or block raw, so any byte range of any kind encodes.

Encoded layouts (after the codec id, which travels beside the bytes):
- planes: ember.kv.codec's PLANES payload of the aligned prefix, then the tail raw;
- grouped: u32 len(scales frame), the scales frame, u8 codes coded (1) or raw (0), u32 len(codes),
  the codes, then the tail raw.
"""
from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from ember.kv import codec as kv_codec

RAW, PLANES16, PLANES32, ZSTD, GROUPED = 0, 1, 2, 3, 4
NAMES = {RAW: "raw", PLANES16: "planes16", PLANES32: "planes32", ZSTD: "zstd", GROUPED: "grouped"}
CODES = {v: k for k, v in NAMES.items()}

# kind -> (block bytes, scale bytes at the start of each block) for quantized block formats
BLOCKS = {"q4_1": (20, 4), "q4_0": (18, 2), "q8_0": (34, 2)}
CANDIDATES = {"bf16": (PLANES16, ZSTD), "f16": (PLANES16, ZSTD), "f32": (PLANES32,),
              **{k: (ZSTD, GROUPED) for k in BLOCKS}}
_U32 = struct.Struct("<I")
ZSTD_LEVEL = 3


class WeightCodecError(ValueError):
    """Encoded bytes that do not decode to the length they claim (corrupt, truncated, unknown codec)."""


class _PerThread(threading.local):
    def __init__(self):
        self.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.decompressor = zstandard.ZstdDecompressor()


_zstd = _PerThread()


def candidates(kind: str) -> tuple[int, ...]:
    """The codecs tried for a chunk of `kind` besides raw (metadata and unknown kinds: zstd)."""
    return CANDIDATES.get(kind, (ZSTD,))


def encode(kind: str, data, mode: str = "auto") -> tuple[int, bytes]:
    """(codec, encoded bytes): the smallest of raw and the kind's candidates (`mode` raw: raw)."""
    data = bytes(data)
    best = (RAW, data)
    if mode == "raw":
        return best
    for codec in candidates(kind):
        encoded = encode_with(codec, kind, data)
        if len(encoded) < len(best[1]):
            best = (codec, encoded)
    return best


def encode_with(codec: int, kind: str, data) -> bytes:
    data = memoryview(bytes(data)) if not isinstance(data, (bytes, memoryview)) else memoryview(data)
    if codec == RAW:
        return bytes(data)
    if codec == ZSTD:
        return _zstd.compressor.compress(data)
    if codec in (PLANES16, PLANES32):
        width = 2 if codec == PLANES16 else 4
        body = len(data) - len(data) % width
        return bytes(kv_codec.encode(kv_codec.PLANES, data[:body], width)) + bytes(data[body:])
    if codec == GROUPED:
        block, scale = BLOCKS[kind]
        n = len(data) // block
        blocks = np.frombuffer(data[:n * block], np.uint8).reshape(n, block)
        # f16 scales: all low bytes, then all high bytes (the high bytes, sign + exponent, repeat a lot)
        scales = blocks[:, :scale].reshape(n, scale // 2, 2).transpose(2, 1, 0).tobytes()
        codes = blocks[:, scale:].tobytes()
        scales_z = _zstd.compressor.compress(scales)
        codes_z = _zstd.compressor.compress(codes)
        coded = len(codes_z) < len(codes)
        codes_out = codes_z if coded else codes
        return b"".join((_U32.pack(len(scales_z)), scales_z, bytes([coded]), _U32.pack(len(codes_out)), codes_out,
                         bytes(data[n * block:])))
    raise WeightCodecError(f"unknown weight codec {codec}")


def decode(codec: int, kind: str, encoded, length: int) -> bytes:
    """The `length` raw bytes of `encoded`; WeightCodecError when they do not come out."""
    encoded = memoryview(encoded)
    try:
        if codec == RAW:
            out = bytes(encoded)
        elif codec == ZSTD:
            out = _unzstd(encoded, length)
        elif codec in (PLANES16, PLANES32):
            width = 2 if codec == PLANES16 else 4
            body = length - length % width
            tail = length - body
            raw = bytearray(length)
            kv_codec.decode_into(kv_codec.PLANES, encoded[:len(encoded) - tail], width, memoryview(raw)[:body])
            raw[body:] = encoded[len(encoded) - tail:]
            out = bytes(raw)
        elif codec == GROUPED:
            out = _ungroup(kind, encoded, length)
        else:
            raise WeightCodecError(f"unknown weight codec {codec}")
    except (kv_codec.CodecError, zstandard.ZstdError, struct.error, ValueError, KeyError) as e:
        if isinstance(e, WeightCodecError):
            raise
        raise WeightCodecError(f"{NAMES.get(codec, codec)} chunk does not decode: {e}") from e
    if len(out) != length:
        raise WeightCodecError(f"{NAMES.get(codec, codec)} chunk decoded to {len(out)} bytes, expected {length}")
    return out


def _unzstd(frame, length: int) -> bytes:
    if zstandard.frame_content_size(frame) not in (length, -1):  # a forged size must not allocate gigabytes
        raise WeightCodecError("zstd frame does not declare the expected size")
    return _zstd.decompressor.decompress(frame, max_output_size=length)


def _ungroup(kind: str, encoded: memoryview, length: int) -> bytes:
    block, scale = BLOCKS[kind]
    n = length // block
    (slen,) = _U32.unpack(encoded[:4])
    pos = 4 + slen
    scales = _unzstd(encoded[4:pos], n * scale)
    coded = encoded[pos]
    (clen,) = _U32.unpack(encoded[pos + 1:pos + 5])
    codes_part = encoded[pos + 5:pos + 5 + clen]
    codes = _unzstd(codes_part, n * (block - scale)) if coded else bytes(codes_part)
    tail = encoded[pos + 5 + clen:]
    if len(scales) != n * scale or len(codes) != n * (block - scale) or len(tail) != length - n * block:
        raise WeightCodecError("grouped chunk's parts do not add up to its length")
    flat = np.empty(length, np.uint8)
    out = flat[:n * block].reshape(n, block)
    # the f16 scales back as little-endian words (low plane | high plane << 8), each into its place: one
    # strided write of 16-bit words, cheaper than scattering bytes
    planes = np.frombuffer(scales, np.uint8).reshape(2, scale // 2, n)
    words = planes[0].astype("<u2")
    words |= planes[1].astype("<u2") << 8
    out.view("<u2")[:, :scale // 2] = words.T
    out[:, scale:] = np.frombuffer(codes, np.uint8).reshape(n, block - scale)
    flat[n * block:] = np.frombuffer(tail, np.uint8)
    return flat.tobytes()
