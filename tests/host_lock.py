"""The host to itself, for a measurement that compares a system with itself over time.

A test that measures a ratio between two phases (B alone, then B under A's burst) reads the host's
load as well as the system's: on CI's 2 cores the other xdist worker's tests land in one phase and not
the other. Every test item holds the host shared (conftest's pytest_runtest_protocol); a measurement
takes it whole with `host_to_itself()`, which waits until the other worker's current test ends and
keeps the other worker from starting its next until the measurement is done.

Two flock(2) files per test run (both xdist workers share PYTEST_XDIST_TESTRUNUID): `host`, held
shared by every running item and exclusively by a measurement, and `gate`, which a measurement holds
exclusively while it waits and measures, so items starting meanwhile queue behind it (flock has no
writer preference: without the gate, the other worker's next item could always slip in first).
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_files: dict[str, int] = {}


def _fd(name: str) -> int:
    if name not in _files:
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
        path = Path(tempfile.gettempdir()) / f"ember-pytest-{run}.{name}"
        _files[name] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    return _files[name]


@contextmanager
def shared() -> Iterator[None]:
    """Held around each test item: waits while a measurement has the host."""
    fcntl.flock(_fd("gate"), fcntl.LOCK_SH)
    fcntl.flock(_fd("gate"), fcntl.LOCK_UN)
    fcntl.flock(_fd("host"), fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(_fd("host"), fcntl.LOCK_UN)


@contextmanager
def host_to_itself() -> Iterator[None]:
    """Within the block no other test item runs (inside an item that holds the host shared: this
    item's share is given up first, so two measurements on two workers queue instead of deadlocking)."""
    host, gate = _fd("host"), _fd("gate")
    fcntl.flock(host, fcntl.LOCK_UN)
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(host, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(host, fcntl.LOCK_SH)  # this item's share again, until it ends
    finally:
        fcntl.flock(gate, fcntl.LOCK_UN)
