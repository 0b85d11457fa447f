"""Where model files live (torch-free, so the router can find the tokenizer)."""
from __future__ import annotations

import hashlib
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
