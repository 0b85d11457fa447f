"""Where model files live (torch-free, so the router can find the tokenizer)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir_for(gguf_path: Path) -> Path:
    """The HF-layout folder a GGUF is converted into, beside it."""
    return gguf_path.with_name(gguf_path.stem + ".ember")


def model_folder(path: str | Path) -> Path:
    """The HF-layout folder serving `path` (a GGUF's cache folder, or the folder itself)."""
    path = Path(path)
    return cache_dir_for(path) if path.suffix == ".gguf" else path


def folder_fingerprint(folder: Path) -> str:
    meta_path = folder / "ember.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())["fingerprint"]
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        digest.update(path.name.encode())
        digest.update(sha256_file(path).encode())
    return "sha256:" + digest.hexdigest()


def weights_fingerprint(fingerprint: str, weights: str) -> str:
    """The fingerprint KV blocks are hashed under: int4 serving ("q4") computes different KV."""
    return fingerprint if weights == "dense" else f"{fingerprint}+{weights}"
