"""Random checkpoints in the mission models' published formats, written from a dense one (for the tests
and `ember bench moe`; needs compressed-tensors, in the test and bench extras):

- Kimi K2.5's: routed experts int4, compressed-tensors `pack-quantized` (symmetric, group 32, bf16
  `weight_scale`), written by compressed-tensors' own compressor; attention, shared experts, the dense
  MLP and lm_head unquantized per its `ignore` list;
- DeepSeek-V3's (and Kimi K2's): every layer Linear but the router float8 e4m3 with a float32
  `weight_scale_inv` per 128x128 block, as the DeepSeek-V3 checkpoint stores it.

Each is saved sharded (two files and a `model.safetensors.index.json`), and beside it the dense folder of
the weights the format stands for (the format's own dequantization), which transformers loads as the
reference."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_MAX = 448.0


def int4_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))


def int4_quantization_config() -> dict:
    from compressed_tensors.quantization import QuantizationConfig
    config = QuantizationConfig(config_groups={"group_0": int4_scheme()}, format="pack-quantized",
                                ignore=KIMI_IGNORE, quantization_status="compressed")
    return config.model_dump(mode="json") | {"quant_method": "compressed-tensors"}


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj.weight")


def is_fp8_linear(name: str) -> bool:
    """DeepSeek-V3's fp8 weights: every decoder-layer projection (attention, dense MLP, experts, shared
    experts); the router (`mlp.gate`), norms, embedding and lm_head stay as they are."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight") or \
        name.endswith("kv_a_proj_with_mqa.weight")


def quantize_int4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' packed form of w and the weight it decompresses to."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    scale = (w.view(w.shape[0], -1, 32).abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
    packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, int4_scheme())
    back = PackedQuantizationCompressor.decompress(dict(packed), int4_scheme())["weight"]
    return packed, back


def quantize_fp8(w: torch.Tensor, block: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """w as float8 e4m3 with a float32 scale_inv per block x block block, and the weight it stands for."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(br, block, bc, block)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale_inv[:, None, :, None]).view(br * block, bc * block)[:rows, :cols].to(torch.float8_e4m3fn)
    full = scale_inv.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return {"weight": q, "weight_scale_inv": scale_inv.float()}, q.float() * full


def write_published(dense: Path, out: Path, fmt: str) -> tuple[Path, Path]:
    """(the checkpoint in `fmt`: "int4" Kimi K2.5's or "fp8" DeepSeek-V3's, the dense folder of the weights
    it stands for), made once from the dense checkpoint folder `dense`."""
    quantized, reference = out / fmt, out / f"{fmt}-dequantized"
    if (quantized / "config.json").exists() and (reference / "config.json").exists():
        return quantized, reference
    tensors = {}
    for file in sorted(dense.glob("*.safetensors")):
        tensors.update(load_file(file))
    stored, equal = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if fmt == "int4" and is_routed_expert(name):
            packed, back = quantize_int4(w.float())
        elif fmt == "fp8" and is_fp8_linear(name):
            packed, back = quantize_fp8(w.float())
        else:
            stored[name], equal[name] = w, w
            continue
        stored |= {f"{module}.{k}": v.contiguous() for k, v in packed.items()}
        equal[name] = back.to(w.dtype)
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = int4_quantization_config() if fmt == "int4" else FP8_CONFIG
    _save_sharded(stored, quantized, config, dense)
    save_file(equal, str(_fresh(reference) / "model.safetensors"))
    _copy_beside(dense, reference, json.loads((dense / "config.json").read_text()))
    return quantized, reference


def _fresh(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def _save_sharded(tensors: dict[str, torch.Tensor], folder: Path, config: dict, dense: Path) -> None:
    """Two shards split at the middle layer and their index, as save_pretrained shards a big model."""
    _fresh(folder)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map |= {n: file for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _copy_beside(dense, folder, config)


def _copy_beside(dense: Path, folder: Path, config: dict) -> None:
    """config.json, and the tokenizer and generation files of the dense folder."""
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for f in dense.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, folder / f.name)
