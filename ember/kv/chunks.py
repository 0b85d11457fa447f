"""Split KV block payloads into ~1 MiB stream chunks and put them back together (torch-free)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from ember.errors import InvalidRequestError

CHUNK_BYTES = 1 << 20


def split(blocks: Iterable[tuple[bytes, bytes]], chunk_bytes: int = CHUNK_BYTES
          ) -> Iterator[tuple[bytes, int, int, bytes]]:
    """(hash, payload) pairs -> (hash, block_bytes, offset, data) chunks, blocks back to back."""
    for block_hash, payload in blocks:
        view = memoryview(payload)
        total = len(view)
        for offset in range(0, max(total, 1), chunk_bytes):
            yield block_hash, total, offset, bytes(view[offset:offset + chunk_bytes])


class Assembler:
    """Feed chunks in order; completed (hash, payload) blocks come out of `add`."""

    def __init__(self, max_block_bytes: int = 64 * 2**20):
        self.max_block_bytes = max_block_bytes
        self._hash: bytes | None = None
        self._buf: bytearray | None = None

    def add(self, block_hash: bytes, block_bytes: int, offset: int, data: bytes) -> tuple[bytes, bytes] | None:
        if self._buf is None:
            if offset != 0:
                raise InvalidRequestError("stream starts mid-block")
            if not 0 < block_bytes <= self.max_block_bytes:
                raise InvalidRequestError(f"block size {block_bytes} out of range")
            self._hash, self._buf = block_hash, bytearray()
        if block_hash != self._hash or offset != len(self._buf):
            raise InvalidRequestError("chunks out of order or interleaved")
        self._buf += data
        if len(self._buf) > block_bytes:
            raise InvalidRequestError("block longer than announced")
        if len(self._buf) < block_bytes:
            return None
        done = (self._hash, bytes(self._buf))
        self._hash = self._buf = None
        return done

    def finish(self) -> None:
        if self._buf is not None:
            raise InvalidRequestError("stream ended mid-block")
