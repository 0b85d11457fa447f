"""The base of every config section: unknown keys are errors, and reads can be recorded.

`record_reads()` lets a test see which settings the services actually read (a key nobody
reads is a key the docs promise in vain). Recording costs one check per attribute read and
is off unless a test turns it on.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel, ConfigDict

_reads: set[tuple[str, str]] | None = None


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def __getattribute__(self, name: str):
        if _reads is not None and not name.startswith("_"):
            fields = type(self).model_fields
            if name in fields:
                _reads.add((type(self).__name__, name))
        return super().__getattribute__(name)


@contextmanager
def record_reads() -> Iterator[set[tuple[str, str]]]:
    """Within the block, every field read of any section lands in the yielded set as (class, field)."""
    global _reads
    previous, _reads = _reads, set()
    try:
        yield _reads
    finally:
        _reads = previous
