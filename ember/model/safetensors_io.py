"""Read a .safetensors file into tensors that own their memory.

safetensors' own loader memory-maps the file; every tensor then pins the whole map, so
after the engine repacks its linear weights the unpacked originals stay resident and
peak RSS nearly doubles. Reading each tensor straight into its own buffer keeps one copy.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the file, each in its own memory, cast to `dtype` when given."""
    tensors = {}
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            if end > start:
                f.seek(base + start)
                view = memoryview(t.view(-1).view(torch.uint8).numpy())
                if f.readinto(view) != end - start:
                    raise ValueError(f"{path.name}: tensor {name!r} is truncated")
            if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            tensors[name] = t
    return tensors
