"""KV block data plane over plain TCP (torch-free): kvstore to kvstore bulk moves.

gRPC in Python tops out near 0.5-0.6 GiB/s here for 720 KiB blocks moved between
distinct memory (raw loopback TCP: ~2.5 GiB/s), so block payloads travel on a socket of
their own; the typed gRPC API still decides what moves.

Request:  b"EKV1", uint32 count, count x 16-byte block hashes
Response: per block, in order: 16-byte hash, uint64 length, payload.
          A missing block is answered with length 2**64-1 and the connection closes.
"""
from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable

from ember.kv.block_hash import HASH_BYTES

MAGIC = b"EKV1"
MISSING = 2**64 - 1
MAX_BLOCK_BYTES = 256 * 2**20
_HEADER = struct.Struct(f"<{HASH_BYTES}sQ")


class BlockMissing(KeyError):
    """The peer does not hold a requested block (evicted, or never stored)."""


async def serve(host: str, port: int, pinned: Callable) -> asyncio.AbstractServer:
    """`pinned(hashes)` is a context manager giving payloads (None if missing) that stay
    valid while it is held (BlockStore.pinned)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            head = await reader.readexactly(8)
            if head[:4] != MAGIC:
                return
            (count,) = struct.unpack("<I", head[4:])
            raw = await reader.readexactly(count * HASH_BYTES)
            hashes = [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]
            with pinned(hashes) as payloads:  # no slot is reused while its bytes go out
                for h, payload in zip(hashes, payloads):
                    if payload is None:
                        writer.write(_HEADER.pack(h, MISSING))
                        break
                    writer.write(_HEADER.pack(h, len(payload)))
                    writer.write(payload)
                    await writer.drain()
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
    return await asyncio.start_server(handle, host, port)


def _fresh(num_bytes: int) -> tuple[None, memoryview]:
    return None, memoryview(bytearray(num_bytes))


async def fetch(address: str, hashes: list[bytes], timeout: float | None = None,
                alloc: Callable[[int], tuple[object, memoryview]] = _fresh,
                release: Callable[[object], None] = lambda token: None,
                ) -> AsyncIterator[tuple[bytes, object, memoryview]]:
    """Yield (hash, token, payload) for each block in order, each received straight from
    the socket into `alloc(length) -> (token, writable view)` (a store slot, say); a block
    cut short is handed to `release(token)`. Raises BlockMissing, ConnectionError,
    TimeoutError."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await _within(deadline, loop.sock_connect(sock, (host, int(port))))
        await _within(deadline, loop.sock_sendall(sock, MAGIC + struct.pack("<I", len(hashes)) + b"".join(hashes)))
        header = bytearray(_HEADER.size)
        for expected in hashes:
            await _within(deadline, _recv_exactly(loop, sock, memoryview(header)))
            block_hash, length = _HEADER.unpack(header)
            if block_hash != expected:
                raise ConnectionError("data plane returned blocks out of order")
            if length == MISSING:
                raise BlockMissing(f"block {expected.hex()} is not held by {address}")
            if length > MAX_BLOCK_BYTES:
                raise ConnectionError(f"block of {length} bytes exceeds the limit")
            token, view = alloc(length)
            try:
                await _within(deadline, _recv_exactly(loop, sock, view))
            except BaseException:
                release(token)
                raise
            yield block_hash, token, view
    finally:
        sock.close()


async def _recv_exactly(loop, sock: socket.socket, view: memoryview) -> None:
    while view:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            raise ConnectionError("data plane connection closed mid-block")
        view = view[n:]


async def _within(deadline: float | None, aw):
    if deadline is None:
        return await aw
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        raise TimeoutError("deadline exceeded during block transfer")
    return await asyncio.wait_for(aw, remaining)
