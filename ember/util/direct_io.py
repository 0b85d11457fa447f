"""Writing big files around the page cache (O_DIRECT), torch-free: fetched models and stored chunks.

On a host where fresh memory is slow to fault in (this Firecracker VM: new page-cache pages cost
~10 ms of system time per MB, ~100 MB/s, while direct writes to its disk run at ~1.7 GB/s with no
CPU to speak of), writing a fetched model through the page cache costs seconds per gigabyte, and
most of those pages are never read again (a q4 worker reads the embedding and norms of its
dequantized checkpoint, not its layer weights; a kvstore only relays its chunks). `DirectWriter`
writes each byte range's whole aligned blocks directly and its unaligned edges buffered (the two
never share a page, so the page cache stays coherent); where O_DIRECT is refused (tmpfs, some
filesystems) every write is buffered.
"""
from __future__ import annotations

import mmap
import os

BLOCK = 4096
MIN_DIRECT = 64 * 1024  # smaller ranges: buffered (not worth a copy into the aligned buffer)


class DirectWriter:
    def __init__(self, path: str | os.PathLike, size: int | None = None, mode: int = 0o644):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        if size:
            os.ftruncate(self.fd, size)
        self.dfd = None
        if hasattr(os, "O_DIRECT"):
            try:
                self.dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                self.dfd = None
        self._buf: mmap.mmap | None = None  # page-aligned staging for direct writes, reused

    def pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        start = -(-offset // BLOCK) * BLOCK
        end = (offset + len(view)) // BLOCK * BLOCK
        if self.dfd is None or end - start < MIN_DIRECT:
            _pwrite_all(self.fd, view, offset)
            return
        if offset < start:
            _pwrite_all(self.fd, view[:start - offset], offset)
        if offset + len(view) > end:
            _pwrite_all(self.fd, view[end - offset:], end)
        n = end - start
        if self._buf is None or len(self._buf) < n:
            if self._buf is not None:
                self._buf.close()
            self._buf = mmap.mmap(-1, max(n, 8 << 20))
        self._buf[:n] = view[start - offset:end - offset]
        with memoryview(self._buf) as staged:
            try:
                done = os.pwrite(self.dfd, staged[:n], start)
            except OSError:  # refused after all: buffered from now on
                os.close(self.dfd)
                self.dfd, done = None, 0
            if done < n:
                _pwrite_all(self.fd, staged[done:n], start + done)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd is not None:
                os.close(fd)
        self.fd = self.dfd = None
        if self._buf is not None:
            self._buf.close()
            self._buf = None


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_file(path: str | os.PathLike, data) -> None:
    """`data` as the whole of `path` (created or truncated), its aligned blocks written directly."""
    writer = DirectWriter(path, len(data))
    try:
        writer.pwrite(data, 0)
    finally:
        writer.close()


def read_file(path: str | os.PathLike) -> bytes:
    """The whole of `path`, its aligned blocks read directly (no page-cache pages made for them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        body = size // BLOCK * BLOCK
        dfd = None
        if body >= MIN_DIRECT and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                dfd = None
        if dfd is None:
            return _pread_all(fd, size, 0)
        try:
            with mmap.mmap(-1, body) as buf:
                with memoryview(buf) as view:
                    got = 0
                    try:
                        while got < body and (n := os.preadv(dfd, [view[got:]], got)) > 0:
                            got += n
                    except OSError:
                        pass  # refused after all: the rest buffered
                    return bytes(view[:got]) + _pread_all(fd, size - got, got)
        finally:
            os.close(dfd)
    finally:
        os.close(fd)


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    parts = []
    while n > 0 and (part := os.pread(fd, n, offset)):
        parts.append(part)
        n, offset = n - len(part), offset + len(part)
    return b"".join(parts)
