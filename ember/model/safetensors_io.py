"""Read a .safetensors file into tensors that own their memory.

safetensors' own loader memory-maps the file; every tensor then pins the whole map, so
after the engine repacks its linear weights the unpacked originals stay resident and
peak RSS nearly doubles. Reading each tensor straight into its own buffer keeps one copy.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_safetensors(path: Path, dtype: torch.dtype | None = None, mapped: tuple[str, ...] = (),
                     skip=None) -> dict[str, torch.Tensor]:
    """All tensors of the file (but those `skip(name)` is true for), each in its own memory, cast to
    `dtype` when given.

    Tensors named in `mapped` that need no cast are instead private copy-on-write views
    of the file: only the pages actually read become resident (an embedding table used
    for row lookups, say), and `drop_resident_pages` gives them back.
    """
    tensors = {}
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__" or (skip is not None and skip(name)):
                continue
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            file_dtype = _DTYPES[info["dtype"]]
            if name in mapped and (dtype is None or file_dtype == dtype) and end > start:
                tensors[name] = _map(f, base + start, end - start, file_dtype, info["shape"])
                continue
            t = torch.empty(info["shape"], dtype=file_dtype)
            if end > start:
                f.seek(base + start)
                view = memoryview(t.view(-1).view(torch.uint8).numpy())
                if f.readinto(view) != end - start:
                    raise ValueError(f"{path.name}: tensor {name!r} is truncated")
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            tensors[name] = t
    return tensors


def read_header(path: Path) -> dict[str, dict]:
    """A .safetensors file's tensors (name -> dtype, shape, data_offsets), from its header only."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header


def tensor_names(path: Path) -> list[str]:
    """The tensors a .safetensors file holds (its header only)."""
    return list(read_header(path))


class _MappedBytes:
    """Keeps a page-aligned private mapping alive for the tensor viewing it."""

    def __init__(self, fileno: int, offset: int, length: int):
        self.skip = offset % mmap.ALLOCATIONGRANULARITY
        self.map = mmap.mmap(fileno, length + self.skip, access=mmap.ACCESS_COPY, offset=offset - self.skip)


# Keyed by data pointer: tensors are re-wrapped (nn.Parameter, load_state_dict) but keep
# their memory. Entries hold their mapping for the life of the process, so an address here
# can never be reused by other memory (madvise on that would zero it).
_MAPS: dict[int, _MappedBytes] = {}


def _map(f, offset: int, length: int, dtype: torch.dtype, shape) -> torch.Tensor:
    mapped = _MappedBytes(f.fileno(), offset, length)
    t = torch.frombuffer(mapped.map, dtype=dtype, count=length // dtype.itemsize, offset=mapped.skip).view(shape)
    _MAPS[t.data_ptr()] = mapped
    return t


def drop_resident_pages(t: torch.Tensor) -> bool:
    """For a tensor from `mapped`: return its read pages to the OS (re-read on next use)."""
    mapped = _MAPS.get(t.data_ptr())
    if mapped is None:
        return False
    mapped.map.madvise(mmap.MADV_DONTNEED)
    return True
