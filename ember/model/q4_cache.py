"""The int4 kernel's packed weights of a Q4_1 GGUF, cached on disk once per file.

Serving a GGUF's Q4_1 codes means reading them through the `gguf` package (its metadata parse
alone takes ~3.6 s for SmolLM2: it builds a Python object per vocabulary string) and repacking
every layer into the C++ kernel's layout (ember.kernels.cpu_q4.Q4Pack), on every engine start.
This module does both once, into `q4/packed.safetensors` in the HF-layout load cache folder
(ember.model.files.cache_dir_for; a subfolder, so the folder's own *.safetensors stay the
checkpoint), keyed by the source file's size and mtime, the layout version and the kernel's quad
width. Engines then memory-map it: a private mapping they only read, so engines on one host share
one copy of the packed weights in the page cache instead of each holding its own.

Tensor names: `model.layers.{i}.{target}.codes` / `.dm` per fused int4 linear (targets as
ember.model.loader.Q4_FUSED: qkv_proj, o_proj, gate_up_proj, down_proj), and `logits.codes` /
`logits.dm` for the int4 nominating pass of the output layer (ember.kernels.cpu_int4.Int4Logits).
The file is written whole under a temporary name and renamed into place, so a reader never sees
half of it and two engines building it at once both end with a complete one.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ember.model.files import cache_dir_for

VERSION = 1
QUAD = 64  # the C++ kernel's outputs per quad (ember.kernels.cpu_q4.QUAD, held equal by a test): torch-free here
FILE = "q4/packed.safetensors"
META = "q4/meta.json"


def _key(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"version": VERSION, "quad": QUAD, "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}


def cached(gguf_path: str | Path) -> Path | None:
    """The packed-weights file of `gguf_path` when it is there and current, else None (no torch)."""
    gguf_path = Path(gguf_path)
    folder = cache_dir_for(gguf_path)
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    return folder / FILE if meta == _key(gguf_path) and (folder / FILE).is_file() else None


def ensure(gguf_path: str | Path) -> Path | None:
    """The packed-weights file, built first when missing or stale (the source changed). None where the
    C++ int4 kernel does not build or does not fit the model's shapes (the engine then packs for
    torch's kernel at every start, as before)."""
    gguf_path = Path(gguf_path)
    if (path := cached(gguf_path)) is not None:
        return path
    from ember.kernels import cpu_q4
    if cpu_q4.library() is None:
        return None
    tensors = _pack_all(gguf_path)
    if tensors is None:
        return None
    from safetensors.torch import save_file
    folder = cache_dir_for(gguf_path)
    (folder / FILE).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=(folder / FILE).parent) as work:
        save_file(tensors, str(Path(work) / "packed"))
        (Path(work) / "meta").write_text(json.dumps(_key(gguf_path)))
        os.replace(Path(work) / "packed", folder / FILE)
        os.replace(Path(work) / "meta", folder / META)  # last: the meta vouches for the file beside it
    return folder / FILE


def _pack_all(gguf_path: Path) -> dict | None:
    """Every packed tensor of the model (codes uint8, dm int16), or None if a layer does not fit."""
    import torch

    from ember.kernels import cpu_q4
    from ember.kernels.cpu_int4 import quantize_logits
    from ember.model.gguf_quant import Q4Weight, read_q4_1
    from ember.model.loader import Q4_FUSED, ensure_gguf_cache
    from ember.model.safetensors_io import read_safetensors
    q4 = read_q4_1(gguf_path)
    tensors = {}
    layers = sorted({int(name.split(".")[2]) for name in q4})
    for i in layers:
        for target, sources in Q4_FUSED.items():
            w = Q4Weight.concat([q4.pop(f"model.layers.{i}.{s}.weight") for s in sources])
            if not cpu_q4.fits(*w.codes.shape):
                return None
            pack = cpu_q4.Q4Pack(w.codes, w.scale, w.low)
            tensors[f"model.layers.{i}.{target}.codes"], tensors[f"model.layers.{i}.{target}.dm"] = pack.codes, pack.dm
    folder = ensure_gguf_cache(gguf_path)
    dense = read_safetensors(folder / "model.safetensors", torch.bfloat16, mapped=("model.embed_tokens.weight",))
    output = dense.get("lm_head.weight", dense["model.embed_tokens.weight"])
    if not cpu_q4.fits(*output.shape):
        return None
    pack = cpu_q4.Q4Pack(*(a.numpy() for a in quantize_logits(output.to(torch.bfloat16))))
    tensors["logits.codes"], tensors["logits.dm"] = pack.codes, pack.dm
    return tensors


def load(path: Path) -> dict:
    """name -> Q4Pack for every packed tensor pair of the file, memory-mapped (private, read-only use)."""
    from ember.kernels.cpu_q4 import Q4Pack
    from ember.model.safetensors_io import read_safetensors, tensor_names
    tensors = read_safetensors(path, mapped=tuple(tensor_names(path)))
    return {name[:-len(".codes")]: Q4Pack.from_packed(tensors[name], tensors[name[:-len(".codes")] + ".dm"])
            for name in tensors if name.endswith(".codes")}
