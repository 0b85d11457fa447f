"""Values that follow from the model and the engine settings, never configured by hand
(torch-free: read from the model's config.json and the converter's metadata)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ember.config.schema import ClusterConfig
from ember.kv.block_hash import KVLayout
from ember.model.args import read_model_args
from ember.model.files import folder_fingerprint, layout_of, model_folder, resolve_serving, weights_fingerprint


@dataclass(frozen=True)
class ModelFacts:
    path: Path            # the configured file or folder
    folder: Path          # its HF-layout folder (a GGUF's converted cache)
    model_id: str         # what /v1/models lists
    dtype: str            # the engine dtype and weights mode, "auto" resolved
    weights: str
    kv_layout: KVLayout   # what every engine of the cluster writes; its root hash names the blocks
    max_model_len: int
    vocab_size: int


def model_facts(config: ClusterConfig) -> ModelFacts:
    path = config.model_path()
    folder = model_folder(path)
    if not (folder / "config.json").exists():
        hint = "`ember up` fetches and converts it" if path.suffix == ".gguf" else "check `model:` in the config"
        raise FileNotFoundError(f"model not ready: {folder / 'config.json'} is missing ({hint})")
    e = config.engine
    dtype, weights = resolve_serving(path, e.dtype, e.weights)
    args = read_model_args(folder)
    return ModelFacts(path, folder, folder.name.removesuffix(".ember"), dtype, weights,
                      layout_of(args, weights_fingerprint(folder_fingerprint(folder), weights), dtype, e.block_size),
                      min(e.max_model_len or args.max_position, args.max_position), args.vocab_size)


def kv_element_bytes(config: ClusterConfig) -> int:
    """Bytes per KV element on the wire (2: bf16, 4: fp32), what the link codec's saving depends on; a
    simulation of another model (placement.kv_bytes_per_token set) is taken as bf16."""
    if config.placement.kv_bytes_per_token:
        return 2
    return 4 if model_facts(config).dtype == "float32" else 2


def link_codec_saving(config: ClusterConfig, bandwidth_gbps: float, element_bytes: int) -> float:
    """The fraction of KV bytes the link codec saves on a link of this bandwidth: placement.codec_saving
    when set, else the planes codec's measured saving where the kvstores use it on such a link
    (codec: planes, or auto on a link slower than its break-even, ember.kv.codec.worth_it), else 0."""
    if config.placement.codec_saving is not None:
        return config.placement.codec_saving
    return kvstore_codec_saving(config, bandwidth_gbps, element_bytes)


def kvstore_codec_saving(config: ClusterConfig, bandwidth_gbps: float, element_bytes: int) -> float:
    """What the kvstores' codec really saves on a link of this bandwidth (the simulator's truth;
    the placer may be told otherwise by placement.codec_saving)."""
    from ember.kv import codec  # (numpy: the router imports it only where a link is priced)
    mode = config.kvstore.codec
    if mode == "planes" or (mode == "auto" and codec.worth_it(bandwidth_gbps / 8, element_bytes)):
        return codec.SAVING.get(element_bytes, 0.0)
    return 0.0


def kv_bytes_per_token(config: ClusterConfig) -> int:
    """What the placer prices link transfers at: the configured value (a simulation of another
    model), else the model's KV layout in the engine dtype."""
    return config.placement.kv_bytes_per_token or model_facts(config).kv_layout.bytes_per_token
