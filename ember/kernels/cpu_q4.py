"""Int4 linear layers in the C++ kernel (csrc/q4_linear.cpp, built by ember.kernels.native).

The weights are the GGUF's Q4_1 blocks exactly (4-bit codes, float16 d and m per 32 inputs); each
row's activations are quantized per 32 to int8 as llama.cpp does for Q4_1 x Q8_1, so a group's dot
product is an exact integer sum (AVX-512 VNNI) scaled once. Every output is one fixed sequence of
operations over its own row: batch-invariant by construction, and the same bits from any x86 build.
The kernel splits a call over its own small C++ thread pool (a decode step's 121 calls are too short
for Python threads). Measured on SmolLM2's linears against torch's int4 kernel, see BENCHMARKS.md.
"""
from __future__ import annotations

import numpy as np
import torch

from ember.kernels.native import library

QUAD = 64  # outputs per kernel quad: N must be a multiple


def fits(out_features: int, in_features: int) -> bool:
    """Whether a layer of this shape can run in the kernel here."""
    return out_features % QUAD == 0 and in_features % 32 == 0 and library() is not None


class Q4Pack:
    """Codes and float16 (d, m) in the kernel's layout (see csrc/q4_linear.cpp)."""

    def __init__(self, codes: np.ndarray, scale: np.ndarray, low: np.ndarray):
        """codes [N, K] in 0..15, scale d and low m [N, K / 32] (float16-exact: the GGUF's own)."""
        n, k = codes.shape
        if n % QUAD or k % 32:
            raise ValueError(f"int4 kernel: shape {n}x{k} is not a multiple of {QUAD}x32")
        self.out_features, self.in_features = n, k
        c = codes.astype(np.uint8).reshape(n // QUAD, 4, 16, k // 8, 2, 4)  # input 8t + 4h + b
        packed = (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(0, 3, 1, 2, 4)  # [N/64, K/8, 4, 16, 4]
        self.codes = torch.from_numpy(np.ascontiguousarray(packed))
        dm = np.stack([scale, low], 1).astype(np.float16)  # [N, 2, G]
        dm = dm.reshape(n // QUAD, QUAD, 2, k // 32).transpose(0, 3, 2, 1)  # [N/64, G, 2, 64]
        self.dm = torch.from_numpy(np.ascontiguousarray(dm).view(np.int16))

    @classmethod
    def from_packed(cls, codes: torch.Tensor, dm: torch.Tensor) -> Q4Pack:
        """A pack from tensors already in the kernel's layout (codes [N/64, K/8, 4, 16, 4] uint8,
        dm [N/64, K/32, 2, 64] int16), e.g. memory-mapped from ember.model.q4_cache."""
        pack = cls.__new__(cls)
        pack.codes, pack.dm = codes, dm
        pack.out_features, pack.in_features = codes.shape[0] * QUAD, codes.shape[1] * 8
        return pack

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.dm.numel() * 2


def q4_matmul(x: torch.Tensor, pack: Q4Pack) -> torch.Tensor:
    """x [rows, K] bf16 -> [rows, N] bf16."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"int4 kernel wants bf16 activations, got {x.dtype}")
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, pack.out_features, dtype=torch.bfloat16)
    if rows and library().ember_q4_linear(x.data_ptr(), rows, pack.in_features, pack.codes.data_ptr(),
                                          pack.dm.data_ptr(), pack.out_features, y.data_ptr(),
                                          torch.get_num_threads()):
        raise ValueError(f"int4 kernel: shape {pack.out_features}x{pack.in_features} not supported")
    return y
