"""Lossless codecs for KV blocks and weights (torch-free): `raw` and `planes`.

`planes` splits 16-bit floats (and the top half of 32-bit ones) into byte planes, as
ZipNN, DFloat11 and Cloudflare's Unweight do: the high byte (sign + 7 exponent bits)
carries ~3 bits of information in real KV and weights, the low byte is noise. zstd
(fast strategy, long minimum match: in effect Huffman-coded literals) codes the high
plane; the rest travels raw. Measured on SmolLM2's real data: bf16 KV 31% smaller, bf16
weights 32% smaller, fp32 KV 15% smaller; decode ~2 GB/s per core, encode ~0.7 GB/s.
`ember bench kv` reports the current figures.

Encoded `planes` layout: uint32 n (length of the zstd frame), the zstd frame of the high
plane, then the remaining planes raw (for 32-bit elements: the low 16-bit halves, then
the low byte plane of the high halves).
"""
from __future__ import annotations

import functools
import struct
import threading

import numpy as np
import zstandard

RAW, PLANES = 0, 1
NAMES = {RAW: "raw", PLANES: "planes"}
CODES = {v: k for k, v in NAMES.items()}

_LEN = struct.Struct("<I")
# zstd's fast strategy with long minimum matches: the plane is mostly literals, so this
# is nearly pure Huffman coding; it beat levels 1 and 3 on both size and speed here.
_PARAMS = zstandard.ZstdCompressionParameters(strategy=1, window_log=17, hash_log=12, chain_log=12, min_match=7,
                                              search_log=1, target_length=0)
class _PerThread(threading.local):
    """zstd (de)compressor objects are not safe to share between threads (the data plane encodes in
    worker threads): each thread gets its own."""

    def __init__(self):
        self.compressor = zstandard.ZstdCompressor(compression_params=_PARAMS)
        self.decompressor = zstandard.ZstdDecompressor()


_zstd = _PerThread()


class CodecError(ValueError):
    """An encoded payload that cannot be decoded (corrupt or truncated)."""


def encode(codec: int, payload, element_bytes: int) -> bytes | memoryview:
    if codec == RAW:
        return memoryview(payload)
    if codec != PLANES:
        raise CodecError(f"unknown codec {codec}")
    hi16 = _high_halves(payload, element_bytes)
    high_plane = (hi16 >> 8).astype(np.uint8)
    parts = [b"", _zstd.compressor.compress(high_plane)]
    parts[0] = _LEN.pack(len(parts[1]))
    if element_bytes == 4:
        parts.append(np.frombuffer(payload, np.uint32).astype(np.uint16).tobytes())
    parts.append(hi16.astype(np.uint8).tobytes())
    return b"".join(parts)


def decode_into(codec: int, encoded, element_bytes: int, out: memoryview) -> None:
    """Decode into `out` (exactly the raw length); CodecError if `encoded` does not fit."""
    if codec == RAW:
        if len(encoded) != len(out):
            raise CodecError(f"raw payload is {len(encoded)} bytes, expected {len(out)}")
        out[:] = encoded
        return
    if codec != PLANES:
        raise CodecError(f"unknown codec {codec}")
    if element_bytes not in (2, 4) or len(out) % element_bytes:
        raise CodecError(f"planes codec needs 2- or 4-byte elements, got {element_bytes} for {len(out)} bytes")
    count = len(out) // element_bytes
    encoded = memoryview(encoded)
    if len(encoded) < _LEN.size:
        raise CodecError("planes payload is shorter than its length prefix")
    (zlen,) = _LEN.unpack(encoded[:_LEN.size])
    frame = encoded[_LEN.size:_LEN.size + zlen]
    rest = encoded[_LEN.size + zlen:]
    low_bytes = count * (element_bytes - 1)
    if len(frame) != zlen or len(rest) != low_bytes:
        raise CodecError(f"planes payload has {len(encoded)} bytes, inconsistent with {count} elements")
    try:  # check the declared size first: a forged header must not make zstd allocate gigabytes
        if zstandard.frame_content_size(frame) != count:
            raise CodecError("high plane does not declare the expected size")
        high = np.frombuffer(_zstd.decompressor.decompress(frame, max_output_size=count), np.uint8)
    except zstandard.ZstdError as e:
        raise CodecError(f"high plane does not decode: {e}") from e
    if len(high) != count:
        raise CodecError("high plane decoded to the wrong size")
    low = np.frombuffer(rest[-count:], np.uint8)
    if element_bytes == 2:
        out16 = np.frombuffer(out, np.uint16)
        np.left_shift(high, 8, out=out16, dtype=np.uint16)
        np.bitwise_or(out16, low, out=out16)
    else:
        hi16 = np.left_shift(high, 8, dtype=np.uint16)
        np.bitwise_or(hi16, low, out=hi16)
        out32 = np.frombuffer(out, np.uint32)
        np.left_shift(hi16, 16, out=out32, dtype=np.uint32)
        np.bitwise_or(out32, np.frombuffer(rest[:2 * count], np.uint16), out=out32)


def _high_halves(payload, element_bytes: int) -> np.ndarray:
    if element_bytes == 2:
        return np.frombuffer(payload, np.uint16)
    if element_bytes == 4:
        return (np.frombuffer(payload, np.uint32) >> 16).astype(np.uint16)
    raise CodecError(f"planes codec needs 2- or 4-byte elements, got {element_bytes}")


# Conservative per-core speeds (GB/s of raw bytes) and savings measured by `ember bench kv`
# on SmolLM2's KV; used to decide whether compressing a transfer pays.
ENCODE_GBPS, DECODE_GBPS = 0.5, 1.5
SAVING = {2: 0.29, 4: 0.14}


def worth_it(link_GBps: float, element_bytes: int, pipelined: bool = True, encode_GBps: float = ENCODE_GBPS,
             decode_GBps: float = DECODE_GBPS) -> bool:
    """True when sending a transfer encoded beats sending it raw over a link of `link_GBps`, with the
    codec running at `encode_GBps` / `decode_GBps` (default: the figures above; a kvstore passes
    what it measured on its own cores, `measured_speeds`).

    pipelined (the data plane, ember.kv.transfer): the sender encodes the next block in a worker
    thread while one is on the wire, and the receiver decodes a block while the next one lands in
    its socket buffer, so per raw byte the transfer takes the slowest of the three stages:
    max(1/enc, (1 - s)/link, 1/dec) < 1/link  <=>  link < min(enc, dec) (with any saving s > 0),
    asked with a 20% margin (a wash is not worth the CPU): about 0.4 GB/s (3 Gbit/s) on a quiet
    core, a WAN link, never loopback (~2.5 GB/s).
    Not pipelined (one block at a time): 1/enc + (1 - s)/link + 1/dec < 1/link
    <=>  link < s / (1/enc + 1/dec), about 0.15 GB/s for bf16."""
    saving = SAVING.get(element_bytes, 0.0)
    if saving <= 0:
        return False
    if pipelined:
        return link_GBps < 0.8 * min(encode_GBps, decode_GBps)
    return link_GBps < saving / (1 / encode_GBps + 1 / decode_GBps)


@functools.cache
def measured_speeds(reps: int = 3) -> tuple[float, float]:
    """(encode, decode) GB/s of raw bytes on one core of this host, measured once per process on a
    512 KiB bf16-like payload (~20 ms): the codec's speed varies several times between hosts, and a
    busy host's is what its transfers get."""
    import time
    rng = np.random.default_rng(0)
    payload = (rng.standard_normal(256 * 1024).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    out = memoryview(bytearray(len(payload)))
    best_encode = best_decode = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        encoded = encode(PLANES, payload, 2)
        middle = time.perf_counter()
        decode_into(PLANES, encoded, 2, out)
        best_encode, best_decode = min(best_encode, middle - start), min(best_decode, time.perf_counter() - middle)
    return len(payload) / best_encode / 1e9, len(payload) / best_decode / 1e9
