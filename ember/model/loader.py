"""Load a model for serving: a GGUF file (converted once to a cached HF folder) or an HF folder."""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ember.model.files import cache_dir_for, folder_fingerprint, sha256_file
from ember.model.gguf_convert import CONVERTER_VERSION, convert_gguf
from ember.model.llama import LlamaModel, ModelArgs
from ember.model.safetensors_io import read_safetensors
from ember.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    args: ModelArgs
    model: LlamaModel
    tokenizer: Tokenizer
    fingerprint: str  # content hash of the weights; part of every KV block hash
    name: str
    weights_bytes: int  # of the checkpoint in the serving dtype


def ensure_gguf_cache(gguf_path: Path) -> Path:
    """The HF-layout cache folder for a GGUF, (re)built when missing or stale."""
    cache = cache_dir_for(gguf_path)
    stat = gguf_path.stat()
    meta_path = cache / "ember.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if (meta.get("converter_version") == CONVERTER_VERSION and meta.get("source_size") == stat.st_size
                and meta.get("source_mtime_ns") == stat.st_mtime_ns):
            return cache
    fingerprint = "sha256:" + sha256_file(gguf_path)
    convert_gguf(gguf_path, cache, fingerprint)
    meta = json.loads(meta_path.read_text())
    meta.update(source_size=stat.st_size, source_mtime_ns=stat.st_mtime_ns)
    meta_path.write_text(json.dumps(meta))
    return cache


def load_model(path: str | Path, dtype: str = "float32") -> LoadedModel:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (run `make setup` to fetch the default model)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    folder = ensure_gguf_cache(path) if path.suffix == ".gguf" else path
    args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    torch_dtype = DTYPES[dtype]
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        # the embedding is only looked up by row: map it, don't load it (113 MB for SmolLM2)
        tensors.update(read_safetensors(file, torch_dtype, mapped=("model.embed_tokens.weight",)))
    weights_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    with _skip_weight_init():
        model = LlamaModel(args)
    model.load_hf_state_dict(tensors)
    model.eval().requires_grad_(False)
    return LoadedModel(args, model, Tokenizer.from_folder(folder), folder_fingerprint(folder), path.stem,
                       weights_bytes)


@contextmanager
def _skip_weight_init():
    """Build modules without random init: every weight is overwritten by the checkpoint.

    (Random init of 135M parameters costs ~0.7 s; the meta device costs ~1 s on first use.)
    """
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved
