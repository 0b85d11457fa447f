"""KV block data plane over plain TCP (torch-free): kvstore to kvstore bulk moves.

gRPC in Python tops out near 0.5-1.1 GiB/s here for 720 KiB blocks moved between
distinct memory (raw loopback TCP: ~2.5 GiB/s), so block frames travel on a socket of
their own; the typed gRPC API still decides what moves.

Request:  b"EKV2", uint8 codec the puller wants (ember.kv.codec), 3 zero bytes,
          uint32 count, count x 16-byte block hashes
Response: per block, in order: 16-byte hash, uint64 length, then a wire frame
          (ember.kv.wire) of that length, encoded with the wanted codec where that makes
          it smaller, else raw. A missing block is answered with length 2**64-1 and the
          connection closes.
The receiver verifies every frame (layout, lengths, checksum) before handing it on and
stores it raw, so a damaged block is never filed. With the cluster's credentials
(ember.rpc.security) the connection is mutual TLS and the server serves only peers whose
certificate names an allowed role (kvstores); without, it is plain TCP. The sender pins the blocks for the life of
the connection, and abandons a receiver that takes nothing for `stall_s` (a blackholed or
frozen peer), so no pin outlives a dead transfer by more than that. Every connection the server
drops is logged with its peer and reason and reported to `refused(reason)` (the kvstore counts
them: ember:kv_frames_refused_total{reason}); REFUSALS lists the reasons.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from ember.errors import NotFoundError
from ember.kv import codec, wire
from ember.kv.block_hash import HASH_BYTES

MAGIC = b"EKV2"
MISSING = 2**64 - 1
MAX_BLOCK_BYTES = 256 * 2**20
_REQUEST = struct.Struct("<4sBxxxI")
_HEADER = struct.Struct(f"<{HASH_BYTES}sQ")


log = logging.getLogger("ember.kv")

REFUSALS = {
    "unauthorized": "the peer's certificate names no role allowed here",
    "bad_magic": "not an EKV2 request",
    "unknown_codec": "a codec this kvstore does not know",
    "truncated": "the request was cut short",
    "bad_frame": "a stored frame could not be re-encoded",
    "stalled": "the receiver took nothing for stall_s",
}


class BlockMissing(NotFoundError):
    """The peer does not hold a requested block (evicted, or never stored)."""


STALL_S = 60.0


async def serve(host: str, port: int, pinned: Callable, stall_s: float = STALL_S,
                tls: ssl.SSLContext | None = None, authorize: Callable[[dict], bool] = lambda peercert: True,
                refused: Callable[[str], None] = lambda reason: None) -> asyncio.AbstractServer:
    """`pinned(hashes)` is a context manager giving frames (None if missing) that stay
    valid while it is held (BlockStore.pinned). A receiver that accepts no bytes for
    `stall_s` is cut off (its pins released). With `tls` (a server context that requires
    client certificates), only peers whose certificate `authorize(peercert)` accepts are served.
    Each connection dropped for one of REFUSALS is logged (peer, reason) and passed to `refused`."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        def refuse(reason: str, detail: str = "") -> None:
            log.warning("data plane: dropped %s: %s (%s)%s", _peer(writer), reason, REFUSALS[reason],
                        f": {detail}" if detail else "")
            refused(reason)
        if tls is not None and not authorize(writer.get_extra_info("peercert")):
            refuse("unauthorized")
            writer.transport.abort()
            return
        async def drained():  # TimeoutError once the receiver takes nothing for stall_s
            while True:
                queued = writer.transport.get_write_buffer_size()
                try:
                    return await asyncio.wait_for(writer.drain(), stall_s)
                except TimeoutError:
                    if writer.transport.get_write_buffer_size() >= queued:
                        raise
        head = b""
        try:
            head = await reader.readexactly(_REQUEST.size)
            magic, codec_id, count = _REQUEST.unpack(head)
            if magic != MAGIC:
                return refuse("bad_magic", repr(magic))
            if codec_id not in codec.NAMES:
                return refuse("unknown_codec", str(codec_id))
            raw = await reader.readexactly(count * HASH_BYTES)
            hashes = [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]
            with pinned(hashes) as frames:  # no slot is reused while its bytes go out
                encoded = _Encoder(asyncio.get_running_loop(), frames, codec_id)
                try:
                    for i, (h, frame) in enumerate(zip(hashes, frames)):
                        if frame is None:
                            writer.write(_HEADER.pack(h, MISSING))
                            break
                        header, body = await encoded.get(i)  # (the next block's encode starts meanwhile)
                        writer.write(_HEADER.pack(h, wire.HEADER_BYTES + len(body)) + header.pack())
                        writer.write(body)
                        await drained()
                finally:
                    await encoded.close()  # no encode outlives the pins it reads
                await drained()
        except TimeoutError:
            refuse("stalled", f"{stall_s:g} s")
            writer.transport.abort()  # drop what is still queued: it may be a view of a slot unpinned now
        except asyncio.IncompleteReadError as e:
            if head or e.partial:  # (closed before its first byte: a port probe, not refused)
                refuse("truncated", f"{len(head) + len(e.partial)} of {len(head) + e.expected} bytes")
        except wire.FrameError as e:
            refuse("bad_frame", str(e))
        except ConnectionError as e:  # the receiver left (it gave up, or died): not a refusal
            log.debug("data plane: %s left mid-transfer: %s", _peer(writer), e)
        finally:
            writer.close()
    return await asyncio.start_server(handle, host, port, ssl=tls)


def _peer(writer: asyncio.StreamWriter) -> str:
    """host:port, and the SAN URIs of its certificate on a TLS connection."""
    name = writer.get_extra_info("peername")
    where = f"{name[0]}:{name[1]}" if isinstance(name, tuple) and len(name) >= 2 else str(name)
    uris = [v for k, v in (writer.get_extra_info("peercert") or {}).get("subjectAltName", ()) if k == "URI"]
    return where + (f" ({', '.join(uris)})" if uris else "")


class _Encoder:
    """Frames in the wanted codec, in order. Raw frames pass through; encoded ones are made in a
    worker thread one block ahead, so the encode of block i + 1 overlaps the send of block i
    (zstd and numpy release the GIL). codec.worth_it prices this pipeline."""

    def __init__(self, loop: asyncio.AbstractEventLoop, frames: list, codec_id: int):
        self.loop, self.frames, self.codec_id = loop, list(frames), codec_id
        self.ahead: dict[int, asyncio.Future] = {}

    def _start(self, i: int) -> None:
        if i < len(self.frames) and i not in self.ahead and self.frames[i] is not None:
            self.ahead[i] = self.loop.run_in_executor(None, wire.reencode, self.frames[i], self.codec_id)

    async def close(self) -> None:
        """Wait out encodes still running (they read pinned slots) and drop their results."""
        for future in self.ahead.values():
            try:
                await future
            except Exception:  # noqa: BLE001  (a block abandoned: its result is not wanted)
                pass
        self.ahead.clear()

    async def get(self, i: int):
        if self.codec_id == codec.RAW:
            return wire.reencode(self.frames[i], self.codec_id)  # (no work: the frame as it is)
        self._start(i)
        self._start(i + 1)
        return await self.ahead.pop(i)


def _fresh(num_bytes: int) -> tuple[None, memoryview]:
    return None, memoryview(bytearray(num_bytes))


async def fetch(address: str, hashes: list[bytes], timeout: float | None = None,
                alloc: Callable[[int], tuple[object, memoryview]] = _fresh,
                release: Callable[[object], None] = lambda token: None, codec_id: int = codec.RAW,
                on_wire: Callable[[int], None] = lambda num_bytes: None, tls: ssl.SSLContext | None = None,
                ) -> AsyncIterator[tuple[bytes, object, memoryview]]:
    """Yield (hash, token, frame) for each block in order; each verified raw frame lands
    in `alloc(frame length) -> (token, writable view)` (a store slot, say): raw frames
    straight from the socket, encoded ones through one reused scratch buffer. A block
    cut short or damaged is handed to `release(token)`. Raises BlockMissing,
    ConnectionError, TimeoutError, wire.FrameError (ssl.SSLError, an OSError, when the peer's
    certificate does not verify)."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 2**20)  # room while we verify a block
    scratch = bytearray()
    conn = None
    try:
        await _within(deadline, loop.sock_connect(sock, (host, int(port))))
        request = _REQUEST.pack(MAGIC, codec_id, len(hashes)) + b"".join(hashes)
        conn = _Plain(loop, sock) if tls is None else await _within(deadline, _Tls.connect(sock, tls, host))
        await _within(deadline, conn.send(request))
        # envelope + frame header in one read; a MISSING answer is shorter and ends the stream
        head = bytearray(_HEADER.size + wire.HEADER_BYTES)
        for expected in hashes:
            got = await _within(deadline, _recv_at_least(conn, memoryview(head), _HEADER.size))
            block_hash, length = _HEADER.unpack_from(head)
            if block_hash != expected:
                raise ConnectionError("data plane returned blocks out of order")
            if length == MISSING:
                raise BlockMissing(f"block {expected.hex()} is not held by {address}")
            if not wire.HEADER_BYTES <= length <= MAX_BLOCK_BYTES:
                raise wire.CorruptFrame(f"frame of {length} bytes is out of bounds")
            await _within(deadline, _recv_exactly(conn, memoryview(head)[got:]))
            header = wire.parse_header(memoryview(head)[_HEADER.size:])
            if header.block_hash != expected or length != wire.HEADER_BYTES + header.encoded_len:
                raise wire.CorruptFrame(f"frame for block {expected.hex()} does not match its envelope")
            on_wire(length)
            token, frame = alloc(wire.frame_bytes(header.raw_len))
            try:
                payload = frame[wire.HEADER_BYTES:]
                if header.codec == codec.RAW:
                    await _within(deadline, _recv_exactly(conn, payload))
                else:
                    if len(scratch) < header.encoded_len:
                        scratch = bytearray(header.encoded_len)
                    body = memoryview(scratch)[:header.encoded_len]
                    await _within(deadline, _recv_exactly(conn, body))
                    try:
                        codec.decode_into(header.codec, body, header.element_bytes, payload)
                    except codec.CodecError as e:
                        raise wire.CorruptFrame(f"block {expected.hex()}: {e}") from e
                    header = replace(header, codec=codec.RAW, encoded_len=header.raw_len)
                wire.verify(header, payload)
                frame[:wire.HEADER_BYTES] = header.pack()
            except BaseException:
                release(token)
                raise
            yield block_hash, token, frame
    finally:
        if isinstance(conn, _Tls):
            conn.abort()
        sock.close()


class _Plain:
    """Reads straight into the destination (a store slot) from the socket."""

    def __init__(self, loop, sock: socket.socket):
        self.loop, self.sock = loop, sock

    async def send(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def recv_into(self, view: memoryview) -> int:
        return await self.loop.sock_recv_into(self.sock, view)


class _Tls:
    """A blocking TLS socket driven from a worker thread: OpenSSL decrypts straight into the
    connection's own buffer with the GIL released (asyncio's TLS streams decrypt on the event loop
    and copy three times: measured here, ~2x slower). The thread never writes into the caller's
    memory (a store slot may be released and reused while a thread the caller gave up on still
    reads); one memcpy on the loop moves the bytes. Every blocking call is bounded by the socket
    timeout; `abort` unblocks a thread still reading."""

    def __init__(self, tls_sock: ssl.SSLSocket):
        self.sock = tls_sock
        self.buffer = bytearray()

    @classmethod
    async def connect(cls, sock: socket.socket, tls: ssl.SSLContext, host: str) -> _Tls:
        sock.settimeout(STALL_S)
        tls_sock = tls.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
        await asyncio.to_thread(tls_sock.do_handshake)
        return cls(tls_sock)

    async def send(self, data: bytes) -> None:
        await asyncio.to_thread(self.sock.sendall, data)

    async def recv_into(self, view: memoryview) -> int:
        if len(self.buffer) < len(view):
            self.buffer = bytearray(len(view))
        got = await asyncio.to_thread(self._fill, memoryview(self.buffer)[:len(view)])
        view[:got] = memoryview(self.buffer)[:got]
        return got

    def _fill(self, view: memoryview) -> int:
        """Read until `view` is full or the peer closes (a MISSING answer is followed by a close)."""
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                break
            got += n
        return got

    def abort(self) -> None:
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the raw socket: a reading thread returns
        except OSError:
            pass
        self.sock.close()


async def _recv_at_least(conn, view: memoryview, minimum: int) -> int:
    """Read into `view` until at least `minimum` bytes are in; returns how many."""
    got = 0
    while got < minimum:
        n = await conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("data plane connection closed mid-block")
        got += n
    return got


async def _recv_exactly(conn, view: memoryview) -> None:
    while view:
        n = await conn.recv_into(view)
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
