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


def serving_dtype(weights: str) -> str:
    """The default serving dtype for a weights mode: int4 kernels take bf16 activations."""
    return "bfloat16" if weights == "q4" else "float32"


WEIGHTS = ("dense", "q4")


def check_weights(path: str | Path, dtype: str, weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "q4" and (dtype != "bfloat16" or Path(path).suffix != ".gguf"):
        raise ValueError("weights='q4' serves a GGUF's Q4_1 codes and needs dtype='bfloat16' "
                         f"(torch's int4 CPU kernels take bf16 activations); got dtype={dtype!r}, model={str(path)!r}")
