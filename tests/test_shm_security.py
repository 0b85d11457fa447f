"""The kvstore's shared-memory arena (ember/kv/shm.py): sealed so only the store writes, handed
out read-only, and only to processes of the store's own uid (torch-free)."""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import socket

import pytest

from ember.kv import shm
from ember.kv.shm import ArenaReader, ArenaServer
from ember.services.kvstore.store import BlockStore
from tests.test_kvstore_unit import frame

SIZE = len(frame(0)[1])


@pytest.fixture()
def served(tmp_path):
    """(store, socket name, store id, server) with two blocks stored."""
    store = BlockStore(4 * SIZE)
    store_id = os.urandom(16)
    for i in range(2):
        store.put(*frame(i))
    name = f"@ember-test-shm-{store_id.hex()}"
    server = ArenaServer(name, store.fd, store.capacity_bytes, store_id)
    try:
        yield store, name, store_id, server
    finally:
        server.close()


def received_fd(name: str) -> int:
    """The fd a reader receives (what ArenaReader maps), kept open for the test."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect("\0" + name[1:])
        _msg, fds, _flags, _addr = socket.recv_fds(sock, 64, 1)
    assert len(fds) == 1
    return fds[0]


def test_the_arena_is_sealed_and_the_fd_handed_out_is_read_only(served):
    store, name, _, _ = served
    fd = received_fd(name)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & shm.F_SEAL_FUTURE_WRITE and seals & shm.F_SEAL_SHRINK and seals & shm.F_SEAL_GROW
        assert seals & shm.F_SEAL_SEAL, "nobody can add or change seals afterwards"
        with pytest.raises(PermissionError):
            mmap.mmap(fd, store.capacity_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError) as e:
            os.write(fd, b"forged")
        assert e.value.errno == errno.EBADF
        # the same file reopened for writing (as any same-uid process could through /proc): the seal holds
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(rw, store.capacity_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            for attempt in (lambda: os.write(rw, b"forged"), lambda: os.pwrite(rw, b"forged", 100),
                            lambda: os.ftruncate(rw, 0), lambda: os.ftruncate(rw, 2 * store.capacity_bytes)):
                with pytest.raises(PermissionError):
                    attempt()
        finally:
            os.close(rw)
        # a private (copy-on-write) map may scribble on its own pages; the arena does not change
        private = mmap.mmap(fd, store.capacity_bytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        private[:6] = b"forged"
        h, f = frame(0)
        assert bytes(store.get(h)) == f
        # the store still writes through its own mapping, and readers see it
        store.put(*frame(5))
        shared = mmap.mmap(fd, store.capacity_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        h5, f5 = frame(5)
        assert shared[store.offset(h5):store.offset(h5) + SIZE] == f5
        shared.close()
        private.close()
    finally:
        os.close(fd)


def test_no_fd_of_the_arena_writes_not_even_the_one_python_s_mmap_keeps(served):
    """The store's own fd is read-only; CPython's mmap keeps a dup of the writable fd it mapped
    (3.11 has no trackfd=False), and the seal makes that one useless for writing too."""
    store = served[0]
    assert fcntl.fcntl(store.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    inode = os.fstat(store.fd).st_ino
    same = [n for n in map(int, os.listdir("/proc/self/fd")) if _inode(n) == inode]
    assert len(same) >= 2  # store.fd, the mmap module's dup (and the server's, if it made one)
    for fd in same:
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"forged", 0)
        assert e.value.errno in (errno.EPERM, errno.EBADF)
        with pytest.raises(OSError):
            mmap.mmap(fd, store.capacity_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _inode(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:") else None
    except OSError:
        return None


def test_a_writable_fd_given_to_the_server_is_sent_read_only(tmp_path):
    fd = os.memfd_create("ember-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    store_id = os.urandom(16)
    name = f"@ember-test-rw-{store_id.hex()}"
    server = ArenaServer(name, fd, 4096, store_id)
    try:
        got = received_fd(name)
        assert fcntl.fcntl(got, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        os.close(got)
    finally:
        server.close()
        os.close(fd)


def test_a_same_uid_reader_maps_the_frames(served):
    store, name, store_id, server = served
    reader = ArenaReader(name, store_id)
    for i in range(2):
        h, f = frame(i)
        assert bytes(reader.frame(store.offset(h), SIZE)) == f
    with pytest.raises(TypeError):
        reader.view[0] = 0  # the reader's map is read-only too
    assert server.refused == 0


def test_a_process_of_another_uid_is_refused_without_a_byte(served):
    """A forked child that becomes `nobody` connects to the (abstract, so unpermissioned) socket:
    the store closes on it without sending the hello or the fd."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid (os.setuid)")
    _, name, store_id, server = served
    nobody = 65534
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        status = b"?"
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(nobody)
            os.setuid(nobody)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5)
            sock.connect("\0" + name[1:])
            msg, fds, _flags, _addr = socket.recv_fds(sock, 64, 1)
            status = b"refused" if not msg and not fds else b"GOT %d bytes %d fds" % (len(msg), len(fds))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            status = f"error {type(e).__name__}: {e}".encode()
        finally:
            os.write(write_end, status)
            os._exit(0)
    os.close(write_end)
    try:
        result = b""
        while chunk := os.read(read_end, 256):
            result += chunk
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    assert result == b"refused", result
    assert server.refused == 1
    # and the store's own uid is still served
    assert ArenaReader.try_open(name, store_id) is not None
