"""A checkpoint's published quantization, read from config.json's `quantization_config` (torch-free:
`ember up` refuses an unserved format before any engine starts).

Two published formats are served, recognised by what the config says, never by the model's name:

- compressed-tensors `pack-quantized` integer weights (Kimi K2.5's routed experts): a group
  strategy, symmetric, 4 bits, weights only. Each quantized Linear `X` is stored as `X.weight_packed`
  (int32, eight 4-bit values a word along the input dimension, each stored as q + 8),
  `X.weight_scale` (one scale per `group_size` inputs) and `X.weight_shape`; w = scale * q, q in
  [-8, 7]. Which Linears are quantized: those the `targets` name (`Linear`, or `re:` patterns over the
  module name) and the `ignore` list (plain names or `re:` patterns) does not.
- FP8 block-scaled (`quant_method: fp8`, DeepSeek-V3 and Kimi K2): `X.weight` in float8 e4m3 with a
  float32 `X.weight_scale_inv` per `weight_block_size` block; w = fp8 * scale_inv. Activations are
  `dynamic` in the published config (DeepSeek's kernels quantize them per step); Ember computes with
  the serving dtype's activations instead, which is the dequantized model's arithmetic.

Anything else (AWQ, GPTQ, MXFP4, NVFP4, bitsandbytes, asymmetric, other bit widths, quantized
activations, static activation scales) is refused with a `QuantizationError` that names what the
config says and what Ember serves."""
from __future__ import annotations

import re
from dataclasses import dataclass

SERVED = ("compressed-tensors pack-quantized int4 (group, symmetric, weights only)",
          "fp8 e4m3 block-scaled (weight_block_size, dynamic activations)")


class QuantizationError(ValueError):
    """A checkpoint format Ember does not serve (the client's input, never a server bug)."""

    def __init__(self, found: str):
        super().__init__(f"quantization_config: {found}; Ember serves unquantized checkpoints, "
                         + " and ".join(SERVED))


@dataclass(frozen=True)
class PackedInt:
    """compressed-tensors pack-quantized: symmetric integer groups along the input dimension."""
    num_bits: int
    group_size: int
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    kind: str = "pack-quantized"

    def quantizes(self, module: str) -> bool:
        """Whether the Linear called `module` (its weight's name without `.weight`) is stored quantized."""
        if any(_matches(rule, module) for rule in self.ignore):
            return False
        return any(rule == "Linear" or _matches(rule, module) for rule in self.targets)


@dataclass(frozen=True)
class BlockFP8:
    """fp8 e4m3 weights with a float32 scale per (rows, columns) block."""
    block: tuple[int, int]
    kind: str = "fp8"


def _matches(rule: str, module: str) -> bool:
    """compressed-tensors' rule for a name: `re:PATTERN` matched from the start (re.match), else the
    module's name itself or its last part."""
    if rule.startswith("re:"):
        return re.match(rule[3:], module) is not None
    return module == rule or module.endswith("." + rule)


def parse_quantization(config: dict) -> PackedInt | BlockFP8 | None:
    """The served format a config.json declares (top level, or a multimodal wrapper's text_config), or
    None for an unquantized checkpoint; raises QuantizationError for any other."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _block_fp8(q)
    raise QuantizationError(f"quant_method {q.get('quant_method')!r}")


def _compressed_tensors(q: dict) -> PackedInt:
    fmt = q.get("format")
    if fmt != "pack-quantized":
        raise QuantizationError(f"compressed-tensors format {fmt!r}")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors with {len(groups)} config groups (one is served)")
    (name, group), = groups.items()
    w = group.get("weights") or {}
    for side in ("input_activations", "output_activations"):
        if group.get(side):
            raise QuantizationError(f"compressed-tensors {name} quantizes {side} ({group[side].get('type')} "
                                    f"{group[side].get('num_bits')}-bit): weight-only schemes are served")
    if w.get("type", "int") != "int":
        raise QuantizationError(f"compressed-tensors {name} weights of type {w.get('type')!r}")
    if w.get("num_bits") != 4:
        raise QuantizationError(f"compressed-tensors {name} weights of {w.get('num_bits')} bits (4 is served)")
    if not w.get("symmetric", False):
        raise QuantizationError(f"compressed-tensors {name} asymmetric weights (a zero point; symmetric is served)")
    if w.get("strategy") != "group" or not w.get("group_size"):
        raise QuantizationError(f"compressed-tensors {name} strategy {w.get('strategy')!r} (group is served)")
    if w.get("dynamic"):
        raise QuantizationError(f"compressed-tensors {name} dynamic weight quantization")
    if w.get("actorder") not in (None, "static"):
        raise QuantizationError(f"compressed-tensors {name} activation-ordered groups ({w['actorder']!r})")
    if q.get("kv_cache_scheme"):
        raise QuantizationError("compressed-tensors kv_cache_scheme (a quantized KV cache)")
    targets = tuple(group.get("targets") or ("Linear",))
    return PackedInt(4, int(w["group_size"]), targets, tuple(q.get("ignore") or ()))


def _block_fp8(q: dict) -> BlockFP8:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fp8 fmt {fmt!r} (e4m3 is served)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantizationError(f"fp8 activation_scheme {q.get('activation_scheme')!r} (static activation "
                                "scales; dynamic is served)")
    block = q.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise QuantizationError(f"fp8 weight_block_size {block!r} (per-tensor or per-channel fp8; "
                                "[rows, columns] blocks are served)")
    return BlockFP8((int(block[0]), int(block[1])))


def describe(scheme: PackedInt | BlockFP8 | None) -> str:
    if scheme is None:
        return "unquantized"
    if isinstance(scheme, PackedInt):
        return f"int{scheme.num_bits} group {scheme.group_size} symmetric (compressed-tensors pack-quantized)"
    return f"fp8 e4m3, {scheme.block[0]}x{scheme.block[1]} blocks"
