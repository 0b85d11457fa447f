"""Read a GGUF's Q4_1 linear weights as they are stored: 4-bit codes, scale d, min m.

A Q4_1 block holds 32 weights as w = d * q + m (q in 0..15; d, m float16). That is exactly
asymmetric int4 with group size 32, so the weights can be served as int4 without a
second rounding (ember.kernels.cpu_int4). Names and row order follow the HF layout
ember.model.gguf_convert writes: llama.cpp's rotary row permutation of Q and K is undone.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from ember.model.gguf_convert import _LAYER_NAMES, _unpermute, read_args

GROUP = 32
_BLOCK_BYTES = 20  # d f16, m f16, 16 bytes of packed 4-bit codes


@dataclass
class Q4Weight:
    codes: np.ndarray  # [out, in] uint8 in 0..15
    scale: np.ndarray  # [out, in / 32] float32 (d)
    low: np.ndarray    # [out, in / 32] float32 (m: the value of code 0)

    def dequantize(self) -> np.ndarray:
        out, inp = self.codes.shape
        w = self.codes.reshape(out, inp // GROUP, GROUP) * self.scale[..., None] + self.low[..., None]
        return w.reshape(out, inp).astype(np.float32)

    @staticmethod
    def concat(parts: list[Q4Weight]) -> Q4Weight:
        """Stack along the output dimension (fused QKV, gate/up)."""
        return Q4Weight(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("codes", "scale", "low")))


def _split_blocks(raw: np.ndarray, out: int, inp: int) -> Q4Weight:
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, _BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(out, inp // GROUP)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(out, inp // GROUP)
    packed = blocks[:, 4:]  # low nibbles: weights 0..15 of the block; high nibbles: 16..31
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1).reshape(out, inp)
    return Q4Weight(codes, d, m)


def read_q4_1(gguf_path: str | Path) -> dict[str, Q4Weight]:
    """Every Q4_1 layer weight of a llama GGUF, keyed by its HF name."""
    reader = GGUFReader(str(gguf_path))
    args = read_args(reader)
    weights = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in _LAYER_NAMES or t.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        inp, out = (int(d) for d in t.shape)  # GGUF shapes are innermost-first
        w = _split_blocks(t.data, out, inp)
        heads = {"attn_q": args.num_heads, "attn_k": args.num_kv_heads}.get(parts[2])
        if heads:  # the same row permutation applies to codes and to per-row group scales
            w = Q4Weight(*(np.ascontiguousarray(_unpermute(a, heads)) for a in (w.codes, w.scale, w.low)))
        weights[f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"] = w
    return weights
