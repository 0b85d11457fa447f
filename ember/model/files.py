"""Where model files live (torch-free, so the router can find the tokenizer)."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

CONVERTER_VERSION = 2  # of the GGUF load cache (ember.model.gguf_convert); 2: ember.json records layer_types


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_stamped(path: Path) -> str:
    """sha256_file of `path`, remembered beside it (PATH.sha256: the digest with the file's size and
    mtime) so that a start does not hash an unchanged file again (~0.3 s for 100 MB, more for big models)."""
    path = Path(path)
    stamp = path.with_name(path.name + ".sha256")
    stat = path.stat()
    key = f"{stat.st_size} {stat.st_mtime_ns}"
    try:
        digest, seen = stamp.read_text().split(" ", 1)
        if seen.strip() == key:
            return digest
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    try:
        stamp.write_text(f"{digest} {key}\n")
    except OSError:
        pass  # a read-only cache: hash every time
    return digest


def cache_dir_for(gguf_path: Path) -> Path:
    """The HF-layout folder a GGUF is converted into, beside it."""
    return gguf_path.with_name(gguf_path.stem + ".ember")


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
    from ember.model.gguf_convert import convert_gguf  # torch and gguf: only to convert
    fingerprint = "sha256:" + sha256_file(gguf_path)
    convert_gguf(gguf_path, cache, fingerprint)
    meta = json.loads(meta_path.read_text())
    meta.update(source_size=stat.st_size, source_mtime_ns=stat.st_mtime_ns)
    meta_path.write_text(json.dumps(meta))
    return cache


def prepare_gguf(gguf_path: Path) -> Path:
    """Every load cache of a GGUF, made once (before engines start, so none of them races another
    to make it): the HF-layout folder, and for a Q4_1 file the int4 kernel's packed weights
    (ember.model.q4_cache). Checking costs no torch import; making them does."""
    folder = ensure_gguf_cache(gguf_path)
    if is_q4_1_gguf(gguf_path):
        from ember.model import q4_cache
        q4_cache.ensure(gguf_path)
    return folder


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
DTYPES = ("float32", "bfloat16")


def resolve_serving(path: str | Path, dtype: str = "auto", weights: str = "auto") -> tuple[str, str]:
    """The (dtype, weights) a model serves with; "auto" picks the default for the file.

    A GGUF whose layers are Q4_1 serves its own codes on int4 kernels with bf16 activations
    and KV, as llama.cpp serves the file (lossless with respect to it), and so does a checkpoint of
    int4 group-32 weights (Kimi K2.5's routed experts; the rest of it bf16); any other GGUF, and
    `weights="dense"`, dequantizes to fp32 (the exact path, equal to transformers). An HF
    folder serves dense in its checkpoint's dtype (bf16 stays bf16, anything else fp32).
    """
    path = Path(path)
    if weights == "auto":
        int4 = is_q4_1_gguf(path) or int4_folder(path)
        weights = "q4" if dtype in ("auto", "bfloat16") and int4 else "dense"
    if dtype == "auto":
        if weights == "q4":
            dtype = "bfloat16"
        elif path.suffix != ".gguf" and (path / "config.json").exists():
            cfg = json.loads((path / "config.json").read_text())
            dtype = "bfloat16" if (cfg.get("torch_dtype") or cfg.get("dtype")) == "bfloat16" else "float32"
        else:
            dtype = "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {DTYPES}, got {dtype!r}")
    check_weights(path, dtype, weights)
    return dtype, weights


def checkpoint_scheme(path: Path):
    """An HF folder's published quantization (ember.model.quant_config; None: unquantized or a GGUF);
    raises QuantizationError for a format Ember does not serve."""
    if path.suffix == ".gguf" or not (path / "config.json").exists():
        return None
    from ember.model.quant_config import parse_quantization
    return parse_quantization(json.loads((path / "config.json").read_text()))


def int4_folder(path: Path) -> bool:
    """Whether an HF folder's routed experts are stored int4 in groups of 32 (Kimi K2.5's), which Ember's
    int4 MoE kernels serve as they are (weights "q4"). Other int4 linears (a W4A16 dense model) are
    dequantized: not this."""
    from ember.model.quant_config import PackedInt
    scheme = checkpoint_scheme(path)
    if not (isinstance(scheme, PackedInt) and scheme.num_bits == 4 and scheme.group_size == 32):
        return False
    return any(".experts." in name and name.endswith(".weight_packed") for name in stored_tensor_names(path))


def stored_tensor_names(folder: Path) -> list[str]:
    """The tensor names a safetensors checkpoint folder stores (its index, or its files' headers)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    names = []
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            names += [n for n in json.loads(f.read(length)) if n != "__metadata__"]
    return names


def is_q4_1_gguf(path: Path) -> bool:
    if path.suffix != ".gguf":
        return False
    if not path.exists():
        return True  # the default model's file, not fetched yet; loading will say so
    meta_path = cache_dir_for(path) / "ember.json"  # the converter records the layer types
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        stat = path.stat()
        if "layer_types" in meta and (meta.get("source_size"), meta.get("source_mtime_ns")) == (
                stat.st_size, stat.st_mtime_ns):
            return meta["layer_types"] == ["Q4_1"]
    from gguf import GGUFReader  # reads the whole header: seconds
    return gguf_layer_types(GGUFReader(path)) == ["Q4_1"]


def gguf_layer_types(reader) -> list[str]:
    """The quantization types of a GGUF's decoder-layer matrices (what `weights="auto"` decides on)."""
    return sorted({t.tensor_type.name for t in reader.tensors
                   if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2})


def check_pair(dtype: str, weights: str) -> None:
    """The one rule between the two settings: int4 kernels take bf16 ("auto" defers to the file)."""
    if weights == "q4" and dtype not in ("bfloat16", "auto"):
        raise ValueError(f"weights 'q4' needs dtype 'bfloat16' or 'auto' (torch's int4 CPU kernels take bf16 "
                         f"activations); got dtype {dtype!r}")


def check_weights(path: str | Path, dtype: str, weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    check_pair(dtype, weights)
    path = Path(path)
    scheme = checkpoint_scheme(path)  # (refuses an unserved quantization_config whatever the weights)
    if weights == "q4" and path.suffix != ".gguf" and not int4_folder(path):
        from ember.model.quant_config import describe
        raise ValueError(f"weights 'q4' serves a file's own 4-bit codes (a Q4_1 GGUF, or a checkpoint of "
                         f"int4 group-32 weights); {str(path)!r} is {describe(scheme)}")


def layout_of(args, fingerprint: str, dtype: str, block_size: int):
    """The KV layout an engine serving a model of shape `args` (ember.model.args.ModelArgs) writes."""
    from ember.kv.block_hash import KVLayout
    return KVLayout(fingerprint, dtype, block_size, args.num_layers, args.kv_cache_heads, args.kv_cache_dim,
                    planes=args.kv_planes)
