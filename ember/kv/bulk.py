"""Bulk block transfer over gRPC without protobuf wrapping (torch-free).

Protobuf copies every `bytes` field on parse and serialize; for KV payloads that halves
throughput here (0.54 vs 1.18 GiB/s for 720 KiB messages between two processes). So
kvstores move blocks through one extra method with raw messages:

  /ember.v1.KVStoreBulk/Get
    request:  the block hashes, concatenated (16 bytes each)
    response: a stream, one message per block: 16-byte hash, then the payload

Blocks missing from the store end the call with NOT_FOUND. Everything else (lookup,
put, pull, stats) stays on the typed `ember.v1.KVStore` service.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from ember.kv.block_hash import HASH_BYTES

SERVICE = "ember.v1.KVStoreBulk"
GET = f"/{SERVICE}/Get"


def encode_hashes(hashes: list[bytes]) -> bytes:
    if any(len(h) != HASH_BYTES for h in hashes):
        raise ValueError(f"block hashes must be {HASH_BYTES} bytes")
    return b"".join(hashes)


def decode_hashes(raw: bytes) -> list[bytes]:
    if len(raw) % HASH_BYTES:
        raise ValueError(f"hash list of {len(raw)} bytes is not a multiple of {HASH_BYTES}")
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


def get_handler(pinned: Callable) -> grpc.GenericRpcHandler:
    """The server side; `pinned(hashes)` is a context manager giving payloads (None where
    missing) that stay valid while held (BlockStore.pinned)."""
    async def get(request: bytes, context):
        try:
            hashes = decode_hashes(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with pinned(hashes) as payloads:
            for h, payload in zip(hashes, payloads):
                if payload is None:
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"block {h.hex()} is not in this store")
            for h, payload in zip(hashes, payloads):
                yield b"".join((h, payload))
    return grpc.method_handlers_generic_handler(SERVICE, {"Get": grpc.unary_stream_rpc_method_handler(get)})


async def fetch(channel: grpc.aio.Channel, hashes: list[bytes], timeout: float | None
                ) -> AsyncIterator[tuple[bytes, memoryview]]:
    """Yield (hash, payload) for each requested block, in order; the payload is a view."""
    call = channel.unary_stream(GET)(encode_hashes(hashes), timeout=timeout)
    expected = iter(hashes)
    async for message in call:
        view = memoryview(message)
        block_hash = bytes(view[:HASH_BYTES])
        if block_hash != next(expected, None):
            raise ValueError("bulk stream returned blocks out of order")
        yield block_hash, view[HASH_BYTES:]
