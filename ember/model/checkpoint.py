"""A Hugging Face model folder's tensors as the model sees them: one or many safetensors files (with
their `model.safetensors.index.json`), memory-mapped, each stored tensor read once, and the published
quantized formats (ember.model.quant_config) turned back into the weights they stand for.

The model asks for logical names (`...q_proj.weight`); a quantized Linear is stored under others:
compressed-tensors' `weight_packed` + `weight_scale` + `weight_shape`, or DeepSeek-V3's float8
`weight` + `weight_scale_inv`. `Checkpoint` hides that: `keys()` lists logical names, `get_slice(name)`
indexes like safetensors' slices (a tensor-parallel rank reads its rows or columns), `read_all` is the
single-rank path. Dequantization follows each format's reference: compressed-tensors multiplies the
int4 values by their scale in the scale's dtype (bf16 for Kimi K2.5: the weights its own decompressor
gives); DeepSeek-V3 multiplies the float8 values by their float32 block scale in float32. Where the
engine keeps int4 weights as int4 (`packed_int4`), it reads the codes and scales themselves."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.model.quant_config import BlockFP8, PackedInt, QuantizationError, parse_quantization
from ember.model.safetensors_io import read_header, read_safetensors

PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


class MissingTensorError(ValueError):
    """The checkpoint lacks a tensor the model needs (a truncated download, or another model's folder)."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Stored:
    """Where a logical tensor lives: its file and stored form ("dense", "int4" or "fp8")."""
    file: Path
    form: str
    shape: tuple[int, ...]
    dtype: str  # the stored dtype (of the packed words / float8 values for a quantized one)


class Checkpoint:
    def __init__(self, folder: Path, config: dict | None = None):
        self.folder = Path(folder)
        if config is None:
            config = json.loads((self.folder / "config.json").read_text())
        self.scheme = parse_quantization(config)
        self.files = _weight_files(self.folder)
        self.headers = {file: read_header(file) for file in self.files}
        self.tensors: dict[str, Stored] = {}
        self._handles: dict[Path, object] = {}  # safetensors' open maps, one per file
        self._index(config)

    def _index(self, config: dict) -> None:
        stored = {name: (file, info) for file, header in self.headers.items() for name, info in header.items()}
        self._where = {name: file for name, (file, _) in stored.items()}
        for name, (file, info) in stored.items():
            base, _, part = name.rpartition(".")
            if part in PACKED_PARTS[1:] and base + ".weight_packed" in stored:
                continue  # a packed weight's companion
            if part == "weight_scale_inv" and stored.get(base + ".weight", (None, {}))[1].get("dtype") in FP8_DTYPES:
                continue
            if part == "weight_packed":
                self._check_packed(base, stored)
                shape = _packed_shape(file, base, stored)
                self.tensors[base + ".weight"] = Stored(file, "int4", shape, info["dtype"])
            elif info["dtype"] in FP8_DTYPES:
                self._check_fp8(name, info, stored)
                self.tensors[name] = Stored(file, "fp8", tuple(info["shape"]), info["dtype"])
            else:
                self.tensors[name] = Stored(file, "dense", tuple(info["shape"]), info["dtype"])

    def _check_packed(self, module: str, stored: dict) -> None:
        if not isinstance(self.scheme, PackedInt):
            raise QuantizationError(f"{module}.weight_packed is stored but the config declares "
                                    f"{type(self.scheme).__name__ if self.scheme else 'no quantization'}")
        if not self.scheme.quantizes(module):
            raise QuantizationError(f"{module} is stored packed but the config's ignore list keeps it unquantized")
        if module + ".weight_zero_point" in stored:
            raise QuantizationError(f"{module} has a zero point (asymmetric)")
        for part in ("weight_scale", "weight_shape"):
            if f"{module}.{part}" not in stored:
                raise MissingTensorError(f"checkpoint is missing tensor '{module}.{part}' (the int4 weight "
                                         f"{module}.weight_packed needs it)")

    def _check_fp8(self, name: str, info: dict, stored: dict) -> None:
        if not isinstance(self.scheme, BlockFP8):
            raise QuantizationError(f"{name} is stored as {info['dtype']} but the config declares "
                                    f"{type(self.scheme).__name__ if self.scheme else 'no quantization'}")
        if info["dtype"] != "F8_E4M3":
            raise QuantizationError(f"{name} is stored as {info['dtype']} (e4m3 is served)")
        module = name.removesuffix(".weight")
        if module + ".weight_scale_inv" not in stored:
            raise MissingTensorError(f"checkpoint is missing tensor '{module}.weight_scale_inv' (the fp8 weight "
                                     f"{name} needs its block scales)")

    def __enter__(self) -> Checkpoint:  # (safe_open's form, for code that reads through slices)
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()  # (the maps close with their handles)

    def _open(self, file: Path):
        if file not in self._handles:
            from safetensors import safe_open
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    # -- what the model asks --------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def form(self, name: str) -> str:
        return self._stored(name).form

    def _stored(self, name: str) -> Stored:
        if name not in self.tensors:
            raise self.missing(name)
        return self.tensors[name]

    def missing(self, name: str) -> MissingTensorError:
        """The error for a tensor the model needs and the checkpoint lacks, saying in which form it was
        looked for."""
        module = name.removesuffix(".weight")
        if isinstance(self.scheme, PackedInt) and name.endswith(".weight") and self.scheme.quantizes(module):
            hint = f" (nor '{module}.weight_packed': the quantization_config's targets quantize {module})"
        else:
            hint = ""
        return MissingTensorError(f"checkpoint {self.folder.name} is missing tensor '{name}'{hint}", name)

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, name)

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """The logical tensor (or its rows/columns `index`), dequantized to the format's own dtype."""
        s = self._stored(name)
        f = self._open(s.file)
        if s.form == "dense":
            return f.get_slice(name)[index] if index else f.get_tensor(name)
        first, second = (self._open(self._where[p]).get_tensor(p) for p in self._parts(name))
        if s.form == "fp8":
            return _index(dequantize_fp8(first, second, self.scheme.block), index)
        return _index(dequantize_int4(first, second, s.shape), index)

    def read_all(self, dtype: torch.dtype | None = None, mapped: tuple[str, ...] = (), skip=None,
                 keep_int4=None) -> dict[str, torch.Tensor]:
        """Every logical tensor (but those `skip(name)` is true for), dense tensors cast to `dtype`; the
        ones in `mapped` memory-mapped (ember.model.safetensors_io.read_safetensors). Quantized weights
        are dequantized, except those `keep_int4(name)` is true for, returned as `PackedInt4` instead."""
        out: dict[str, torch.Tensor] = {}
        for file in self.files:
            dense = {n for n, s in self.tensors.items() if s.file == file and s.form == "dense"}
            out.update(read_safetensors(file, dtype, mapped=mapped,
                                        skip=lambda n, d=dense: n not in d or (skip is not None and skip(n))))
        wanted = [n for n, s in self.tensors.items() if s.form != "dense" and (skip is None or not skip(n))]
        parts = {p for n in wanted for p in self._parts(n)}  # (a module's parts may lie in different shards)
        raw: dict[str, torch.Tensor] = {}
        for file in self.files:
            if parts & self.headers[file].keys():
                raw.update(read_safetensors(file, None, skip=lambda n, p=parts: n not in p))
        for name in wanted:
            module = name.removesuffix(".weight")
            if self.tensors[name].form == "fp8":
                w = dequantize_fp8(raw.pop(name), raw.pop(module + ".weight_scale_inv"), self.scheme.block)
            else:
                packed, scale = raw.pop(module + ".weight_packed"), raw.pop(module + ".weight_scale")
                if keep_int4 is not None and keep_int4(name):
                    out[name] = PackedInt4(unpack_int4(packed, self.tensors[name].shape), scale,
                                           self.scheme.group_size)
                    continue
                w = dequantize_int4(packed, scale, self.tensors[name].shape)
            out[name] = w.to(dtype) if dtype is not None else w
        return out

    def _parts(self, name: str) -> tuple[str, ...]:
        """The stored tensors a quantized logical weight is made of."""
        module = name.removesuffix(".weight")
        if self.tensors[name].form == "int4":
            return module + ".weight_packed", module + ".weight_scale"
        return name, module + ".weight_scale_inv"


class TensorSlice:
    """safetensors' slice interface over a logical tensor: `get_shape()`, and `[rows, cols]` reads only
    what it must (a dense tensor's slice from the map; a quantized one dequantized, then sliced)."""

    def __init__(self, checkpoint: Checkpoint, name: str):
        self.checkpoint, self.name = checkpoint, name

    def get_shape(self) -> list[int]:
        return list(self.checkpoint._stored(self.name).shape)

    def get_dtype(self) -> str:
        return self.checkpoint._stored(self.name).dtype

    def __getitem__(self, index) -> torch.Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        return self.checkpoint.read(self.name, index)


@dataclass
class PackedInt4:
    """A symmetric group-quantized int4 weight kept as int4: codes [out, in] as uint8 q + 8 (0..15),
    scale [out, in / group] in the checkpoint's dtype; w = scale * (codes - 8)."""
    codes: torch.Tensor
    scale: torch.Tensor
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        q = self.codes.to(torch.int8) - 8
        return (q.view(q.shape[0], -1, self.group).to(self.scale.dtype)
                * self.scale[..., None]).view(self.codes.shape)


def unpack_int4(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """compressed-tensors' int32 words (eight 4-bit values each, the first in the low nibble, each
    value + 8) to uint8 codes 0..15 of `shape` [out, in]."""
    rows, cols = shape
    nibbles = packed.contiguous().view(torch.uint8)  # little-endian: a word's bytes low first
    codes = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(rows, -1)
    return codes[:, :cols].contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """w = q * scale in the scale's dtype, as compressed-tensors' decompressor computes it."""
    return PackedInt4(unpack_int4(packed, shape), scale, shape[1] // scale.shape[1]).dequantize()


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w = fp8 * scale_inv of its (block rows x block columns) block, in float32 (DeepSeek-V3's
    weight_dequant). Edge blocks are partial."""
    rows, cols = weight.shape
    br, bc = block
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * scale


def _index(t: torch.Tensor, index: tuple) -> torch.Tensor:
    return t[index].contiguous() if index else t


def _weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names (sharded), else every one in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).exists()]
        if missing:
            raise MissingTensorError(f"{index.name} names {len(missing)} file(s) not in {folder.name}: "
                                     f"{', '.join(missing[:3])}")
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def _packed_shape(file: Path, module: str, stored: dict) -> tuple[int, ...]:
    """A packed weight's logical [out, in]: its weight_shape tensor's two values."""
    from safetensors import safe_open
    with safe_open(str(stored[module + ".weight_shape"][0]), framework="pt") as f:
        return tuple(int(v) for v in f.get_tensor(module + ".weight_shape").tolist())
