"""Int4 linear layers for CPU over the GGUF's Q4_1 codes, batch-invariant.

Decode on CPU is bound by reading weights: a batch-1 step reads every weight once. Int4
codes with group-32 scales read a quarter of bf16's bytes; measured for all SmolLM2
linears at batch 1: bf16 15.6 ms, int4 5.8 ms.

Two kernels, chosen once per layer at load: Ember's C++ kernel (ember.kernels.cpu_q4:
the GGUF's float16 scales as stored, int8 activations, exact integer dot products) where
it builds, else torch's packed int4 kernel (bf16 scales; wants bf16 activations, fp32
ones fall onto a path 6-20x slower). Either way every step, whatever its size, takes
the layer's one kernel, so a token's numbers do not depend on how many rows share its
step (alone or batched, chunked or not, cached prefix or cold): both compute each row
on its own, the same bits in a step of 1 row or 2,048 (checked in tests/test_int4.py).
A faster bf16 GEMM for big steps (oneDNN) rounds differently and its per-row result
changes with the row count, which made greedy answers depend on batching.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels import cpu_q4, cpu_step
from ember.model.llama import apply_rope

# Steps of at most this many rows skip the module calls (decode_layer) on torch's int4 kernel.
# Both ways run the same kernels in the same order, so results do not depend on it. On the C++
# kernels every step takes decode_layer (see there).
INT4_MAX_ROWS = 12


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _pack_int4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [out, in] in 0..15, scale and low [out, in / group] -> (packed codes, scales_and_zeros)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    # torch's int4 kernels are zero-point-centred: w = (q - 8) * scale + zero, so zero = m + 8 d
    scales_and_zeros = torch.stack([scale.T, (low + 8 * scale).T], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros


def _int4_mm(x: torch.Tensor, layer: Int4Linear | Int4Logits) -> torch.Tensor:
    if layer.native is not None:
        return cpu_q4.q4_matmul(x, layer.native)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, layer.group_size, layer.scales_and_zeros)


def _kernel_bytes(layer: Int4Linear | Int4Logits) -> int:
    """Bytes of the layer's int4 weights as its kernel reads them (codes and scales)."""
    if layer.native is not None:
        return layer.native.nbytes
    return layer.packed.numel() * layer.packed.element_size() + layer.scales_and_zeros.numel() * 2


class Int4Linear(nn.Module):
    """y = x @ W.T with W = codes * scale + low per group of 32 inputs (bf16 in and out).

    Every step takes the layer's int4 kernel (batch-invariant), so no dense copy is kept."""

    def __init__(self, codes: np.ndarray, scale: np.ndarray, low: np.ndarray, group_size: int = 32,
                 native: bool | None = None):
        """native: the C++ kernel (None: where it builds and fits the shape), else torch's."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        if native is None:
            native = group_size == 32 and cpu_q4.fits(self.out_features, self.in_features)
        self.native = cpu_q4.Q4Pack(codes, scale, low) if native else None
        if self.native is None:
            self.packed, self.scales_and_zeros = _pack_int4(*(torch.from_numpy(a) for a in (codes, scale, low)))

    @classmethod
    def from_pack(cls, pack: cpu_q4.Q4Pack) -> Int4Linear:
        """The layer over weights already in the C++ kernel's layout (ember.model.q4_cache)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features, layer.group_size = pack.out_features, pack.in_features, 32
        layer.native = pack
        return layer

    weight_bytes = property(lambda self: _kernel_bytes(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return _int4_mm(x.reshape(-1, self.in_features), self).view(*lead, self.out_features)


def quantize_logits(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output layer's int4 codes [out, in] and float16-exact scale, min [out, in / group] (the C++
    kernel's format; codes rounded against the rounded scale and min)."""
    groups = weight.float().view(weight.shape[0], -1, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale, low = ((high - low) / 15).clamp_min(1e-4).half().float(), low.half().float()
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).view(weight.shape[0], -1)
    return codes, scale, low


class Int4Logits(nn.Module):
    """The output layer: int4 logits, then each row's top candidates re-scored exactly.

    Int4 codes of the (Q8_0) output weights read 0.87 ms per token against 2.8 ms for bf16,
    but int4 rounding alone changes answers. So the int4 pass only nominates: each row's
    `candidates` best entries are recomputed in fp32 from the bf16 weights, and those exact
    logits replace the approximate ones. Greedy picks the same token as the dense layer
    unless the winner is not among the nominees; sampling sees exact logits for the
    nominees and int4 ones for the far tail. Every row is computed the same way whatever
    the batch size (a dense GEMM for batches would round differently from the 1-row path).
    """

    def __init__(self, weight: torch.Tensor, candidates: int = 64, group_size: int = 32, native: bool | None = None,
                 pack: cpu_q4.Q4Pack | None = None):
        """pack: the C++ kernel's codes of `weight`, made already (ember.model.q4_cache)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size, self.candidates = group_size, candidates
        self.weight = weight.to(torch.bfloat16)  # rows for the exact re-score
        if pack is not None:
            self.native = pack
            return
        codes, scale, low = quantize_logits(self.weight, group_size)
        if native is None:
            native = group_size == 32 and cpu_q4.fits(self.out_features, self.in_features)
        self.native = cpu_q4.Q4Pack(codes.numpy(), scale.numpy(), low.numpy()) if native else None
        if self.native is None:
            self.packed, self.scales_and_zeros = _pack_int4(codes, scale, low)

    weight_bytes = property(lambda self: _kernel_bytes(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = _int4_mm(x, self).float()
        nominees = logits.topk(self.candidates, dim=-1).indices  # [rows, candidates]
        # elementwise product and a sum per output: each dot product is reduced on its own,
        # the same bits for any number of rows (a batched GEMM would not promise that)
        exact = (x.float()[:, None, :] * self.weight[nominees].float()).sum(-1)
        return logits.scatter_(1, nominees, exact)


def decode_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, layer_idx: int) -> torch.Tensor:
    """One decoder layer straight onto the int4 kernels, op by op.

    The same arithmetic as DecoderLayer.forward with Int4Linear layers, minus the module
    calls: at batch 1 those cost ~130 us per layer (47.8 -> 59 tok/s when removed). On the C++
    kernels, RoPE and SiLU * up are C++ calls too (the captured step's own, ember.kernels.cpu_step:
    its SiLU's exp is not torch's, so every step of a C++-kernel model takes this path, whatever
    its size, and a token's bits never depend on which path computed it).
    """
    attn, mlp = layer.self_attn, layer.mlp
    rows, heads, kv_heads = x.shape[0], attn.num_heads, attn.num_kv_heads
    native = mlp.gate_up_proj.native is not None
    h = layer.input_layernorm.forward(x)
    qkv = _int4_mm(h, attn.qkv_proj).view(rows, -1, attn.head_dim)
    if native:
        q, k, v = cpu_step.rope_store(qkv, cos, sin, heads, kv_heads)
    else:
        qk = apply_rope(qkv[:, :heads + kv_heads], cos, sin).to(x.dtype)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
    out = _int4_mm(attend(layer_idx, q, k, v).reshape(rows, -1), attn.o_proj)
    x = x + (out if attn.reduce is None else attn.reduce(out))  # (tensor parallel: the partial sums joined)
    gate_up = _int4_mm(layer.post_attention_layernorm.forward(x), mlp.gate_up_proj)
    if native:
        act = cpu_step.silu_mul(gate_up)
    else:
        gate, up = gate_up.split(mlp.intermediate_size, -1)
        act = F.silu(gate) * up
    out = _int4_mm(act, mlp.down_proj)
    return x + (out if mlp.reduce is None else mlp.reduce(out))
