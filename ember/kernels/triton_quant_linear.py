"""Quantized linears for the GPU: the published int4 and fp8 weights stay quantized in device memory and
are dequantized in registers, tile by tile, inside a Triton matmul (fp32 accumulation).

- `Int4GroupLinear` (W4A16; Kimi K2.5's routed experts, compressed-tensors pack-quantized: symmetric
  int4, one scale per `group` inputs, w = scale * (code - 8)). Layout on the device: `packed`
  [K/2, N] uint8, two codes a byte (input 2j in the low nibble, 2j + 1 in the high one), and `scale`
  [K/group, N] as stored (bf16). Why transposed, output dimension contiguous: K is the loop of the
  matmul and N is what a program's lanes spread over, so each K step loads a [BK/2, BN] tile whose
  rows are BN contiguous bytes (coalesced, vectorised), and a scale row is read once for a whole
  group of K; the checkpoint's [N, K/8] int32 words would put the contiguous run along K instead.
  Two a byte halves the bytes a decode step reads (memory-bound) against one code a byte. The kernel
  splits the activations' even and odd inputs and does two dots (low nibbles, high nibbles), so each
  packed byte is loaded once and never interleaved in registers. A code times its scale is rounded
  to the scale's dtype, as compressed-tensors' decompressor computes it: the kernel multiplies the
  exact weights of the dequantized (dense) model.
- `BlockFP8Linear` (DeepSeek-V3 / Kimi K2's fp8: e4m3 weight [N, K] with a float32 scale per
  (128 x 128) block). The weight stays as stored (K contiguous: the dot's B operand in the K-major
  order tensor cores want). A K step never crosses a scale block (BK divides the block's columns), so
  the tile's fp8 values are widened exactly to the activations' dtype, multiplied in one dot, and
  the [BM, BN] partial sum is scaled by each column's block scale (the block-scaled GEMM's order, as
  DeepSeek's fp8_gemm does; the arithmetic of the dequantized model up to fp32 rounding). On GPUs
  without fp8 conversions (compute capability < 8.9, e.g. A100) the kernel decodes the e4m3 bits
  itself. Activations are never quantized to fp8 (the published config's `dynamic` activations are
  computed in the serving dtype: ember.model.quant_config).

- `Int4GroupExperts` / `BlockFP8Experts`: a MoE layer's routed experts in the same layouts, stacked,
  as ember.model.moe.MoE's `fused` experts (the interface of ember.kernels.cpu_moe.Int4Experts): the
  same kernels in a grouped mode, one launch for every active expert's gate/up and one for down,
  over row tiles of one expert each, computed on the device from the step's expert counts.

On CPU the modules fall back to torch (dequantize, then F.linear; exact, slow: the CPU path serves
these checkpoints dequantized or through ember.kernels.cpu_int4 instead). Under Triton's interpreter
(TRITON_INTERPRET=1, set before Triton is imported) the kernels run on CPU tensors too: how CI checks
them (tests/test_triton_quant_linear.py; bf16 tl.dot is wrong in the interpreter, so it checks fp32
and fp16). Block sizes are fixed heuristics, not autotuned (decode's few rows take 16-row tiles).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

FP8_BLOCK = (128, 128)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a module's forward takes its Triton kernel for `x` (on CUDA, or under the interpreter)."""
    return x.is_cuda or _interpreting()


@dataclass(frozen=True)
class Tiles:
    """A grouped matmul's row tiles (expert_tiles): `table` [count, 3] int32 of (local expert, first
    row, end row), each tile at most `block_m` rows of one expert; spare tiles have no rows."""
    table: torch.Tensor
    block_m: int

    @property
    def count(self) -> int:
        return self.table.shape[0]


def expert_tiles(counts: torch.Tensor, first: int, last: int, rows: int) -> Tiles:
    """The tiles of the local experts [first, last)'s rows, for rows grouped by expert (`counts` per
    expert, all of them). Computed on the device from `counts`, without reading it back (no sync, as
    a captured step wants): the grid is a bound on the tiles, rows // block_m + local experts (never
    more than rows), and the tiles past the real ones are empty (their programs return at once)."""
    local = last - first
    block_m = _block_m(max(1, rows // max(1, counts.shape[0])))  # (the rows an expert gets on average)
    count = max(1, min(rows, rows // block_m + local))
    counts = counts.to(torch.int64)
    starts = (torch.cumsum(counts, 0) - counts)[first:last]
    sizes = counts[first:last]
    per_expert = (sizes + block_m - 1) // block_m
    ends = torch.cumsum(per_expert, 0)
    tile = torch.arange(count, device=counts.device)
    expert = torch.searchsorted(ends, tile, right=True).clamp_(max=local - 1)
    real = tile < ends[-1]
    first_row = starts[expert] + (tile - (ends - per_expert)[expert]) * block_m
    end_row = starts[expert] + sizes[expert]
    table = torch.stack([expert, torch.where(real, first_row, 0), torch.where(real, end_row, 0)], dim=1)
    return Tiles(table.to(torch.int32).contiguous(), block_m)


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def _precision(dtype: torch.dtype):
    """fp32 activations: full-precision dots (tf32 would round the inputs to 10 mantissa bits)."""
    return "ieee" if dtype == torch.float32 else None


# -- W4A16: int4 codes two a byte, a scale per group of inputs ------------------------------------------
@triton.jit
def _round_to_bf16(v):
    """fp32 to the nearest bf16 (ties to even), kept in fp32, from the bits: Triton's interpreter
    truncates when it casts fp32 to bf16, the GPU rounds; this gives the rounding in both."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _int4_group_matmul_kernel(x_ptr, packed_ptr, scale_ptr, out_ptr, tiles_ptr, M, N, K, stride_xm, stride_om,
                              stride_we, stride_se, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                              SCALE_BF16: tl.constexpr, GROUPED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:  # one expert's rows (expert_tiles: [expert, first row, end row]); its weights
        expert = tl.load(tiles_ptr + 3 * pid_m).to(tl.int64)
        start = tl.load(tiles_ptr + 3 * pid_m + 1)
        end = tl.load(tiles_ptr + 3 * pid_m + 2)
        packed_ptr += expert * stride_we
        scale_ptr += expert * stride_se
    else:
        start = pid_m * BLOCK_M
        end = M
    if start >= end:  # (a spare tile of the grouped grid's upper bound)
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 2)  # packed rows of a K step: inputs 2j and 2j + 1
    m_mask = offs_m < end
    n_mask = offs_n < N
    half = K // 2
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rows = k0 // 2 + offs_j
        j_mask = rows < half
        w_mask = j_mask[:, None] & n_mask[None, :]
        byte = tl.load(packed_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=w_mask, other=0)
        # one scale row per group: inputs 2j and 2j + 1 share it (groups are even)
        scale = tl.load(scale_ptr + ((2 * rows) // GROUP)[:, None].to(tl.int64) * N + offs_n[None, :],
                        mask=w_mask, other=0.0)
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + 2 * rows[None, :]
        x_mask = m_mask[:, None] & j_mask[None, :]
        x_even = tl.load(x_rows, mask=x_mask, other=0.0)
        x_odd = tl.load(x_rows + 1, mask=x_mask, other=0.0)
        # w = scale * (code - 8), rounded to the scale's dtype (the decompressor's), then to the activations'
        low = ((byte & 0xF).to(tl.int32) - 8).to(tl.float32) * scale.to(tl.float32)
        high = ((byte >> 4).to(tl.int32) - 8).to(tl.float32) * scale.to(tl.float32)
        if SCALE_BF16:
            low, high = _round_to_bf16(low), _round_to_bf16(high)
        low = low.to(scale_ptr.dtype.element_ty).to(x_even.dtype)
        high = high.to(scale_ptr.dtype.element_ty).to(x_even.dtype)
        acc += tl.dot(x_even, low, input_precision=PRECISION)
        acc += tl.dot(x_odd, high, input_precision=PRECISION)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int4_group_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int,
                      tiles: Tiles | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16) @ W.T with W [N, K] given as `packed` [K/2, N] uint8 (pack_int4)
    and `scale` [K/group, N]; returns [M, N] in x's dtype. Grouped (`tiles`, expert_tiles): packed
    [E, K/2, N] and scale [E, K/group, N], each tile's rows times its expert's W, into `out`'s rows
    (the rows of no tile are left as they are)."""
    x = x.contiguous()
    M, K = x.shape
    N = packed.shape[-1]
    if packed.shape[-2] * 2 != K or scale.shape[-2:] != (K // group, N) or K % group or group % 2:
        raise ValueError(f"int4 matmul: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scale "
                         f"{tuple(scale.shape)}, group {group} do not fit (K a multiple of an even group)")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    block_m = _block_m(M) if tiles is None else tiles.block_m
    grid = (triton.cdiv(M, block_m) if tiles is None else tiles.count, triton.cdiv(N, 64))
    per_expert = (packed.stride(0), scale.stride(0)) if tiles is not None else (0, 0)
    _int4_group_matmul_kernel[grid](x, packed, scale, out, x if tiles is None else tiles.table, M, N, K,
                                    x.stride(0), out.stride(0), *per_expert, GROUP=group, BLOCK_M=block_m,
                                    BLOCK_N=64, BLOCK_K=64, PRECISION=_precision(x.dtype),
                                    SCALE_BF16=scale.dtype == torch.bfloat16, GROUPED=tiles is not None)
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] uint8 in 0..15 -> [K/2, N] uint8: input 2j in the low nibble, 2j + 1 in the high."""
    t = codes.to(torch.uint8).t()
    if t.shape[0] % 2:
        raise ValueError(f"int4 codes need an even number of inputs, got {t.shape[0]}")
    return (t[0::2] | (t[1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [K/2, N] -> codes [N, K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=1).reshape(-1, packed.shape[1]).t().contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """W [N, K] in the scale's dtype from the device layout (packed [K/2, N], scale [K/group, N]), as
    ember.model.checkpoint.PackedInt4.dequantize gives it."""
    q = unpack_int4(packed).to(torch.int8) - 8
    s = scale.t()
    return (q.view(q.shape[0], -1, group).to(s.dtype) * s[..., None]).view(q.shape)


class Int4GroupLinear(nn.Module):
    """y = x @ W.T, W = scale * (codes - 8) per group of `group` inputs, kept as int4 codes (two a
    byte) and the checkpoint's scales; `weight_bytes` is what it holds on the device."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, group: int):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if self.in_features % group or group % 2 or scale.shape != (self.out_features, self.in_features // group):
            raise ValueError(f"int4 weight {tuple(codes.shape)} with scale {tuple(scale.shape)}: expected "
                             f"[{self.out_features}, {self.in_features // max(group, 1)}] scales of an even "
                             f"group {group}")
        self.group = group
        self.register_buffer("packed", pack_int4(codes), persistent=False)
        self.register_buffer("scale", scale.t().contiguous(), persistent=False)

    @classmethod
    def from_packed(cls, weight) -> Int4GroupLinear:
        """From ember.model.checkpoint.PackedInt4 (what `read_all(keep_int4=...)` returns)."""
        return cls(weight.codes, weight.scale, weight.group)

    @classmethod
    def concat(cls, layers: list[Int4GroupLinear]) -> Int4GroupLinear:
        """One layer whose outputs are `layers`' in order (a fused gate/up or q/k/v)."""
        if len({(layer.in_features, layer.group, layer.scale.dtype) for layer in layers}) != 1:
            raise ValueError("int4 layers fused along outputs need the same inputs, group and scale dtype")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.group = layers[0].in_features, layers[0].group
        fused.out_features = sum(layer.out_features for layer in layers)
        fused.register_buffer("packed", torch.cat([layer.packed for layer in layers], dim=1), persistent=False)
        fused.register_buffer("scale", torch.cat([layer.scale for layer in layers], dim=1), persistent=False)
        return fused

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale))

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in the scale's dtype, as ember.model.checkpoint.PackedInt4.dequantize gives it."""
        return dequantize_int4(self.packed, self.scale, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not runs_triton(x):
            return F.linear(x, self.dequantize().to(x.dtype))
        y = int4_group_matmul(x.reshape(-1, self.in_features), self.packed, self.scale, self.group)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


# -- FP8 e4m3 with a float32 scale per (rows x columns) block -----------------------------------------
@triton.jit
def _e4m3_bits_to_float(bits):
    """float8 e4m3fn bits (uint8) to float32, for GPUs without the conversion (no NaN: weights hold none)."""
    b = bits.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = (b & 0x7).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.001953125,  # subnormal: m * 2^-9
                         (8.0 + mantissa) * tl.exp2((exponent - 10).to(tl.float32)))
    return tl.where((b & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _fp8_block_matmul_kernel(x_ptr, w_ptr, s_ptr, out_ptr, tiles_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                             stride_om, stride_we, stride_se, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             DECODE_BITS: tl.constexpr, PRECISION: tl.constexpr, GROUPED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:  # one expert's rows (expert_tiles: [expert, first row, end row]); its weights
        expert = tl.load(tiles_ptr + 3 * pid_m).to(tl.int64)
        start = tl.load(tiles_ptr + 3 * pid_m + 1)
        end = tl.load(tiles_ptr + 3 * pid_m + 2)
        w_ptr += expert * stride_we
        s_ptr += expert * stride_se
    else:
        start = pid_m * BLOCK_M
        end = M
    if start >= end:  # (a spare tile of the grouped grid's upper bound)
        return
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < end
    n_mask = offs_n < N
    scale_rows = s_ptr + (offs_n // BLOCK_ROWS).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_at = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BK, BN], K contiguous
        if DECODE_BITS:
            w = _e4m3_bits_to_float(tl.load(w_at, mask=w_mask, other=0))
        else:
            w = tl.load(w_at, mask=w_mask, other=0.0)
        part = tl.dot(x, w.to(x.dtype), input_precision=PRECISION)  # e4m3 is exact in fp16 / bf16 / fp32
        scale = tl.load(scale_rows + k0 // BLOCK_COLS, mask=n_mask, other=0.0)  # one K block per step
        acc += part * scale[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _fp8_needs_bit_decoding(device: torch.device) -> bool:
    """Triton converts float8 e4m3 natively from compute capability 8.9 (Ada, Hopper) and in its
    interpreter; older GPUs get the weight's bits and decode them in the kernel."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block: tuple[int, int] = FP8_BLOCK, decode_bits: bool | None = None,
                     tiles: Tiles | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T with W = weight [N, K] (float8_e4m3fn) times scale_inv [ceil(N/br), ceil(K/bc)]
    (float32) per (br x bc) block; returns [M, N] in x's dtype. decode_bits: decode e4m3 from its bits
    in the kernel (None: where the GPU lacks the conversion). Grouped (`tiles`, expert_tiles): weight
    [E, N, K] and scale_inv [E, ...], each tile's rows times its expert's W, into `out`'s rows."""
    x = x.contiguous()
    M, K = x.shape
    N = weight.shape[-2]
    rows, cols = block
    block_k = 64 if cols % 64 == 0 else 32 if cols % 32 == 0 else 16
    if weight.shape[-1] != K or weight.stride(-1) != 1 or cols % block_k or \
            tuple(scale_inv.shape[-2:]) != (triton.cdiv(N, rows), triton.cdiv(K, cols)):
        raise ValueError(f"fp8 matmul: x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale_inv "
                         f"{tuple(scale_inv.shape)}, block {block} do not fit (block columns a multiple of 16)")
    if decode_bits is None:
        decode_bits = _fp8_needs_bit_decoding(x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    block_m = _block_m(M) if tiles is None else tiles.block_m
    grid = (triton.cdiv(M, block_m) if tiles is None else tiles.count, triton.cdiv(N, 64))
    per_expert = (weight.stride(0), scale_inv.stride(0)) if tiles is not None else (0, 0)
    _fp8_block_matmul_kernel[grid](x, weight.view(torch.uint8) if decode_bits else weight, scale_inv, out,
                                   x if tiles is None else tiles.table, M, N, K, x.stride(0), weight.stride(-2),
                                   scale_inv.stride(-2), out.stride(0), *per_expert, BLOCK_ROWS=rows, BLOCK_COLS=cols,
                                   BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, DECODE_BITS=decode_bits,
                                   PRECISION=_precision(x.dtype), GROUPED=tiles is not None)
    return out


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W [N, K] in float32: each e4m3 value times its block's scale, edge blocks partial (DeepSeek-V3's
    weight_dequant; ember.model.checkpoint's formula, which kernels do not import: the tests compare)."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


class BlockFP8Linear(nn.Module):
    """y = x @ W.T, W = fp8 e4m3 weight [N, K] times a float32 scale per `block`, kept as stored;
    `weight_bytes` is what it holds on the device."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"BlockFP8Linear wants float8_e4m3fn weights, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.block = tuple(block)
        expected = (triton.cdiv(self.out_features, block[0]), triton.cdiv(self.in_features, block[1]))
        if tuple(scale_inv.shape) != expected:
            raise ValueError(f"fp8 weight {tuple(weight.shape)} in {block} blocks needs scale_inv {expected}, "
                             f"got {tuple(scale_inv.shape)}")
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("scale_inv", scale_inv.float().contiguous(), persistent=False)

    @classmethod
    def concat(cls, layers: list[BlockFP8Linear]) -> BlockFP8Linear:
        """One layer whose outputs are `layers`' in order: each but the last must fill whole blocks of
        rows (else a block would mix two layers' scales)."""
        block = layers[0].block
        if any(layer.block != block or layer.in_features != layers[0].in_features for layer in layers) or \
                any(layer.out_features % block[0] for layer in layers[:-1]):
            raise ValueError(f"fp8 layers fused along outputs need the same inputs and blocks, and whole "
                             f"{block[0]}-row blocks: {[layer.out_features for layer in layers]}")
        return cls(torch.cat([layer.weight for layer in layers]), torch.cat([layer.scale_inv for layer in layers]),
                   block)

    def select_rows(self, index: torch.Tensor) -> BlockFP8Linear:
        """The layer of rows `index` (any order: latent attention reorders its rope rows, splits
        kv_b_proj per head), the scales expanded to one per row and column block first (block
        (1, columns): 4 bytes a row a block, 1/32 of the fp8 weight's bytes at 128 columns)."""
        per_row = self.scale_inv.repeat_interleave(self.block[0], 0)[:self.out_features]
        return BlockFP8Linear(self.weight[index], per_row[index], (1, self.block[1]))

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale_inv))

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.scale_inv, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not runs_triton(x):
            return F.linear(x, self.dequantize().to(x.dtype))
        y = fp8_block_matmul(x.reshape(-1, self.in_features), self.weight, self.scale_inv, self.block)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


# -- a MoE layer's routed experts, one grouped launch per matmul ------------------------------------------
def take_quantized_experts(tensors: dict, prefix: str, first: int, last: int,
                           block: tuple[int, int] = FP8_BLOCK) -> _GroupedExperts | None:
    """A MoE block's routed experts [first, last) popped from a checkpoint's tensors
    (`{prefix}experts.{e}.{gate,up,down}_proj.weight`) where the reader kept them quantized, grouped for
    the GPU: ember.model.checkpoint.PackedInt4 (Checkpoint.read_all(keep_int4=...)) gives
    Int4GroupExperts; fp8 ones, each a (weight, scale_inv) pair or anything with those two attributes,
    BlockFP8Experts. None (and `tensors` untouched) where they are dense tensors."""
    names = [[f"{prefix}experts.{e}.{part}_proj.weight" for part in ("gate", "up", "down")] for e in range(first, last)]
    sample = tensors.get(names[0][0])
    if sample is None or isinstance(sample, torch.Tensor):
        return None
    parts = [[tensors.pop(name) for name in expert] for expert in names]
    if hasattr(sample, "codes"):
        return Int4GroupExperts(parts)
    return BlockFP8Experts([[tuple(p) if isinstance(p, (tuple, list)) else (p.weight, p.scale_inv) for p in expert]
                            for expert in parts], block)


def use_quantized_experts(moe, experts: _GroupedExperts) -> None:
    """Serve `moe`'s (ember.model.moe.MoE) routed experts from `experts` (one per local expert, its
    experts [first, last)); its dense expert copies are freed (ember.kernels.cpu_moe.use_int4_experts'
    GPU twin). The experts' tensors are buffers outside the state dict (the loader builds them from
    the checkpoint): a model load with strict names is unchanged, `.to(device)` moves them."""
    if experts.num_experts != moe.last - moe.first or experts.hidden != moe.down.shape[1] or \
            experts.intermediate != moe.intermediate_size:
        raise ValueError(f"{experts.num_experts} quantized experts of {experts.hidden} x {experts.intermediate} for "
                         f"a MoE holding {moe.last - moe.first} of {moe.down.shape[1]} x {moe.intermediate_size}")
    moe.fused = experts
    moe.packed = None
    moe.gate_up = nn.Parameter(moe.gate_up.new_empty(0, *moe.gate_up.shape[1:]), requires_grad=False)
    moe.down = nn.Parameter(moe.down.new_empty(0, *moe.down.shape[1:]), requires_grad=False)


class _GroupedExperts(nn.Module):
    """ember.model.moe.MoE's `fused` experts on the GPU: `self(rows, counts, first, out)` computes
    out[r] = down(silu(gate(rows[r])) * up(rows[r])) with rows[r]'s expert's weights, for the rows of
    this module's experts [first, first + num_experts) (rows grouped by expert, `counts` per expert of
    the whole model); other rows of `out` are left as they are (another rank's experts). Two grouped
    launches a step (gate/up, then down) over every active local expert's row tiles (expert_tiles), as
    vLLM's fused MoE does, rather than one launch per expert. Off the GPU, one expert at a time in torch."""

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, first: int, out: torch.Tensor) -> torch.Tensor:
        if out.dtype != rows.dtype or not out.is_contiguous():
            raise ValueError(f"experts: out must be contiguous in the rows' dtype {rows.dtype}, got {out.dtype}")
        if not runs_triton(rows):
            return self._one_at_a_time(rows, counts, first, out)
        tiles = expert_tiles(counts, first, first + self.num_experts, rows.shape[0])
        gate_up = self._matmul("gate_up", rows.contiguous(), tiles, torch.empty(
            rows.shape[0], 2 * self.intermediate, dtype=rows.dtype, device=rows.device))
        gate, up = gate_up.chunk(2, dim=-1)  # (rows of no local expert hold garbage, never read below)
        self._matmul("down", F.silu(gate) * up, tiles, out)
        return out

    def _one_at_a_time(self, rows, counts, first, out):
        ends = counts.cumsum(0).tolist()
        for local in range(self.num_experts):
            expert = first + local
            start, end = (ends[expert - 1] if expert else 0), ends[expert]
            if start < end:
                gate_up, down = (w.to(rows.dtype) for w in self.dequantize(local))
                gate, up = F.linear(rows[start:end], gate_up).chunk(2, dim=-1)
                out[start:end] = F.linear(F.silu(gate) * up, down)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every local expert's weights as kept (MoE.expert_bytes)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())


class Int4GroupExperts(_GroupedExperts):
    """Routed experts kept as int4 (Kimi K2.5's): `experts` one (gate, up, down) per local expert, each
    an ember.model.checkpoint.PackedInt4 or a (codes [out, in] uint8 0..15, scale [out, in / group])
    pair. Stacked in Int4GroupLinear's layout; gate and up fused along outputs (gate first, as MoE's)."""

    def __init__(self, experts):
        super().__init__()
        layers = [[_int4_layer(part) for part in expert] for expert in experts]
        gate_up = [Int4GroupLinear.concat([gate, up]) for gate, up, _ in layers]
        down = [dn for _, _, dn in layers]
        self.num_experts, self.group = len(layers), down[0].group
        self.hidden, self.intermediate = down[0].out_features, down[0].in_features
        self.register_buffer("gate_up_packed", torch.stack([m.packed for m in gate_up]), persistent=False)
        self.register_buffer("gate_up_scale", torch.stack([m.scale for m in gate_up]), persistent=False)
        self.register_buffer("down_packed", torch.stack([m.packed for m in down]), persistent=False)
        self.register_buffer("down_scale", torch.stack([m.scale for m in down]), persistent=False)

    def _matmul(self, which: str, x: torch.Tensor, tiles: Tiles, out: torch.Tensor) -> torch.Tensor:
        return int4_group_matmul(x, getattr(self, which + "_packed"), getattr(self, which + "_scale"), self.group,
                                 tiles=tiles, out=out)

    def dequantize(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `local`'s (gate_up [2I, H], down [H, I]) in the scales' dtype."""
        return (dequantize_int4(self.gate_up_packed[local], self.gate_up_scale[local], self.group),
                dequantize_int4(self.down_packed[local], self.down_scale[local], self.group))


def _int4_layer(part) -> Int4GroupLinear:
    if isinstance(part, Int4GroupLinear):
        return part
    if isinstance(part, tuple):
        codes, scale = (torch.as_tensor(t) for t in part)
        return Int4GroupLinear(codes, scale, codes.shape[1] // scale.shape[1])
    return Int4GroupLinear.from_packed(part)


class BlockFP8Experts(_GroupedExperts):
    """Routed experts kept as fp8 (DeepSeek-V3's): `experts` one (gate, up, down) per local expert, each
    a (float8_e4m3fn weight [out, in], float32 scale_inv per `block`) pair or a BlockFP8Linear. Gate
    and up fused along outputs (the intermediate size a whole number of blocks of rows)."""

    def __init__(self, experts, block: tuple[int, int] = FP8_BLOCK):
        super().__init__()
        layers = [[p if isinstance(p, BlockFP8Linear) else BlockFP8Linear(*p, block) for p in expert]
                  for expert in experts]
        gate_up = [BlockFP8Linear.concat([gate, up]) for gate, up, _ in layers]
        down = [dn for _, _, dn in layers]
        self.num_experts, self.block = len(layers), down[0].block
        self.hidden, self.intermediate = down[0].out_features, down[0].in_features
        self.register_buffer("gate_up_weight", torch.stack([m.weight for m in gate_up]), persistent=False)
        self.register_buffer("gate_up_scale_inv", torch.stack([m.scale_inv for m in gate_up]), persistent=False)
        self.register_buffer("down_weight", torch.stack([m.weight for m in down]), persistent=False)
        self.register_buffer("down_scale_inv", torch.stack([m.scale_inv for m in down]), persistent=False)

    def _matmul(self, which: str, x: torch.Tensor, tiles: Tiles, out: torch.Tensor) -> torch.Tensor:
        return fp8_block_matmul(x, getattr(self, which + "_weight"), getattr(self, which + "_scale_inv"),
                                self.block, tiles=tiles, out=out)

    def dequantize(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `local`'s (gate_up [2I, H], down [H, I]) in float32."""
        return (dequantize_fp8(self.gate_up_weight[local], self.gate_up_scale_inv[local], self.block),
                dequantize_fp8(self.down_weight[local], self.down_scale_inv[local], self.block))
