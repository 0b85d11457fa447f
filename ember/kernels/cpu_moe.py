"""A MoE step's routed experts in one C++ call (csrc/moe.cpp, built by ember.kernels.native).

ember.model.moe.MoE groups a step's (token, slot) rows by expert; looping over the active experts in
Python cost a linear, a chunk, a SiLU, a multiply, a linear and a copy per expert per layer. Here one
call runs every active expert's gate/up -> silu * up -> down over its rows, each expert's weights
streamed once. `ember bench moe` (bf16, 2 threads, this AVX2 host): a batch-1 decode step 110 ms on
the loop, 36 ms fused, against 30-33 ms for a dense model of the same active size.

Two weight formats:
- dense (fp32 or bf16, the MoE's own stacked gate_up [E, 2I, H] and down [E, H, I], read in place):
  per output a fixed-order fp32 dot product; bf16 rounds where the torch loop rounds (gate, up,
  silu(gate), the product, the output). Not the loop's bits (torch's GEMM sums in another order, its
  SiLU's exp is not this one), within bf16 rounding of it; fp32 keeps what the dense layers promise
  (oneDNN's packed layers already differ from F.linear by summation order): transformers' greedy tokens.
- int4 (`Int4Experts`, built from per-expert codes and scales by `int4_experts`): csrc/q4_linear.cpp's
  format and arithmetic, an expert's outputs the bits of Int4Linear on it, then cpu_step.silu_mul, then
  Int4Linear on the down projection (the reference `int4_reference` computes exactly that).

Either way every output is one fixed sequence of operations over its own row: a token's output does
not depend on which other tokens share its step, nor on the row count.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from ember.kernels.cpu_q4 import QUAD, Q4Pack
from ember.kernels.native import library

log = logging.getLogger("ember.kernels")

# switched off by `ember bench moe` to time the per-expert loop it replaces (and by tests comparing the two)
ENABLED = True


def weights_fit(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the fused kernel can run these stacked dense experts here (CPU, fp32 or bf16, widths % 16)."""
    return (ENABLED and gate_up.device.type == "cpu" and gate_up.dtype in (torch.float32, torch.bfloat16)
            and down.dtype == gate_up.dtype and gate_up.shape[0] > 0 and gate_up.shape[-1] % 16 == 0
            and down.shape[-1] % 16 == 0 and gate_up.is_contiguous() and down.is_contiguous()
            and library() is not None)


def dense_fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the fused kernel can run these dense experts on these rows here."""
    return x.device.type == "cpu" and x.dtype == gate_up.dtype and weights_fit(gate_up, down)


def offsets_of(counts: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Row offsets [last - first + 1] of the local experts first .. last - 1 in rows grouped by expert
    (`counts` per expert, all experts), as the kernel derives them (for references and tests)."""
    ends = counts.cumsum(0)
    start = ends[first - 1:first] if first else ends.new_zeros(1)
    return torch.cat([start, ends[first:last]])


def dense_experts(rows: torch.Tensor, counts: torch.Tensor, first: int, gate_up: torch.Tensor, down: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """out[r] = its expert's SwiGLU MLP of rows[r], rows grouped by expert (`counts` [all experts] int64),
    for the rows of the local experts first .. first + E - 1 (the other rows of `out` untouched);
    gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]."""
    rows, counts = rows.contiguous(), counts.to(torch.int64).contiguous()
    if not out.is_contiguous() or out.shape != rows.shape or out.dtype != rows.dtype:
        raise ValueError("fused MoE: out must be a contiguous tensor like rows")
    intermediate = down.shape[-1]
    if library().ember_moe_dense(rows.data_ptr(), rows.shape[1], intermediate, counts.data_ptr(), first,
                                 gate_up.shape[0], gate_up.data_ptr(), down.data_ptr(),
                                 int(rows.dtype == torch.bfloat16), out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"fused MoE: hidden {rows.shape[1]} or intermediate {intermediate} not a multiple of 16")
    return out


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[I, ...] gate and up rows as [2I, ...], by 32: gates j .. j + 31 then the ups of the same j (a
    kernel quad of 64 outputs holds both halves of its 32 activations)."""
    i = gate.shape[0]
    return np.stack([gate.reshape(i // 32, 32, -1), up.reshape(i // 32, 32, -1)], 1).reshape(2 * i, -1)


def float16_exact(name: str, values: np.ndarray) -> np.ndarray:
    """`values` as float16 (the int4 kernel's scales), logging when that rounds any (bf16 scales below
    2^-14 lose bits as float16 subnormals; above 65504 / 8 the low overflows)."""
    wide = np.asarray(values, dtype=np.float32)
    half = wide.astype(np.float16)
    inexact = int(np.count_nonzero(half.astype(np.float32) != wide))
    if inexact:
        log.warning("int4 experts: %d of %d %s values are not exact in float16", inexact, wide.size, name)
    return half


class Int4Experts:
    """Every local expert's gate/up and down as int4 packs (csrc/q4_linear.cpp's layout), stacked for
    one kernel call a step, filled one expert at a time (`put`: a loader streaming experts holds one
    expert's unpacked codes at a time). gate_up's outputs are interleaved by 32 (interleave_gate_up)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        if not int4_fits(hidden, intermediate):
            raise ValueError(f"int4 experts: hidden {hidden} (% 64) or intermediate {intermediate} (% 32) "
                             "does not fit the kernel, or it did not build")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        h, i = hidden, intermediate
        self.gate_up_codes = torch.empty(num_experts, 2 * i // QUAD, h // 8, 4, 16, 4, dtype=torch.uint8)
        self.gate_up_dm = torch.empty(num_experts, 2 * i // QUAD, h // 32, 2, QUAD, dtype=torch.int16)
        self.down_codes = torch.empty(num_experts, h // QUAD, i // 8, 4, 16, 4, dtype=torch.uint8)
        self.down_dm = torch.empty(num_experts, h // QUAD, i // 32, 2, QUAD, dtype=torch.int16)

    def put(self, expert: int, gate_up: Q4Pack, down: Q4Pack) -> None:
        """Expert `expert`'s packs (gate_up over interleave_gate_up's rows) into the stack."""
        self.gate_up_codes[expert].copy_(gate_up.codes.view(self.gate_up_codes.shape[1:]))
        self.gate_up_dm[expert].copy_(gate_up.dm)
        self.down_codes[expert].copy_(down.codes.view(self.down_codes.shape[1:]))
        self.down_dm[expert].copy_(down.dm)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for all experts (codes and float16 scales and lows)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.gate_up_codes, self.gate_up_dm, self.down_codes, self.down_dm))

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, first: int, out: torch.Tensor) -> torch.Tensor:
        """As dense_experts over these experts; rows in any float dtype (computed from bf16), out in rows' dtype."""
        x, counts = rows.to(torch.bfloat16).contiguous(), counts.to(torch.int64).contiguous()
        if not out.is_contiguous() or out.shape != rows.shape:
            raise ValueError("fused int4 MoE: out must be a contiguous tensor shaped like rows")
        result = out if out.dtype == torch.bfloat16 else out.to(torch.bfloat16)
        if library().ember_moe_int4(x.data_ptr(), self.hidden, self.intermediate, counts.data_ptr(), first,
                                    self.num_experts, self.gate_up_codes.data_ptr(), self.gate_up_dm.data_ptr(),
                                    self.down_codes.data_ptr(), self.down_dm.data_ptr(), result.data_ptr(),
                                    torch.get_num_threads()):
            raise ValueError(f"fused int4 MoE: hidden {self.hidden} (% 64) or intermediate {self.intermediate} (% 32)")
        if result is not out:
            out.copy_(result)
        return out


def numpy(t) -> np.ndarray:
    """A torch tensor (any dtype numpy lacks, bf16, read as fp32) or an array, as an array."""
    if isinstance(t, torch.Tensor):
        t = t.detach()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return np.asarray(t)


def int4_fits(hidden: int, intermediate: int) -> bool:
    return hidden % QUAD == 0 and intermediate % 32 == 0 and library() is not None


def int4_experts(experts, count: int | None = None) -> Int4Experts:
    """The MoE's int4 expert pack from per-expert ((gate codes, gate scale), (up codes, up scale),
    (down codes, down scale)), in local expert order: codes uint8 0..15 [out, in], scale [out, in / 32]
    (numpy or torch, any float dtype). Symmetric: w = scale * (q - 8) (Kimi K2.5's routed experts), i.e.
    Ember's int4 format with low = -8 scale; pass a (scale, low) pair instead of a scale for asymmetric
    codes (w = scale * q + low). `experts` may be an iterator (a loader reading one expert at a time)
    when `count` says how many it yields."""
    def parts(pair):
        codes, scale = pair
        codes = numpy(codes)
        s, m = (numpy(t).astype(np.float32) for t in scale) if isinstance(scale, tuple) else (None, None)
        if s is None:
            s = numpy(scale).astype(np.float32)
            m = -8 * s
        return codes.astype(np.uint8), float16_exact("scale", s), float16_exact("low", m)

    count = len(experts) if count is None else count
    pack, seen = None, 0
    for e, (gate, up, dn) in enumerate(experts):
        (gc, gs, gm), (uc, us, um), (dc, ds, dm) = parts(gate), parts(up), parts(dn)
        if pack is None:
            pack = Int4Experts(count, dc.shape[0], gc.shape[0])
        pack.put(e, Q4Pack(interleave_gate_up(gc, uc), interleave_gate_up(gs, us), interleave_gate_up(gm, um)),
                 Q4Pack(dc, ds, dm))
        seen = e + 1
    if pack is None or seen != count:
        raise ValueError(f"int4 experts: {seen} experts given, {count} expected")
    return pack


def use_int4_experts(moe, experts) -> None:
    """Give `moe` (ember.model.moe.MoE) int4 experts (`experts`: as int4_experts takes them, one per local
    expert, or an Int4Experts); its dense expert copies are freed."""
    pack = experts if isinstance(experts, Int4Experts) else int4_experts(experts)
    if pack.num_experts != moe.last - moe.first:
        raise ValueError(f"{pack.num_experts} int4 experts for a MoE holding {moe.last - moe.first}")
    moe.fused = pack
    moe.packed = None
    moe.gate_up = torch.nn.Parameter(moe.gate_up.new_empty(0, *moe.gate_up.shape[1:]), requires_grad=False)
    moe.down = torch.nn.Parameter(moe.down.new_empty(0, *moe.down.shape[1:]), requires_grad=False)


def quantize_symmetric(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] as symmetric int4 group-32 (codes uint8 0..15, bf16 scale [out, in / 32]) with
    w ~ scale * (q - 8), as Kimi K2.5's checkpoints hold its experts (for tests and the bench)."""
    groups = weight.detach().float().view(weight.shape[0], -1, 32)
    scale = (groups.abs().amax(-1) / 7).clamp_min(1e-6).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7) + 8
    return q.to(torch.uint8).view(weight.shape), scale


def int4_reference(rows: torch.Tensor, offsets: torch.Tensor, experts) -> torch.Tensor:
    """The per-expert loop the fused int4 kernel equals bit for bit: Int4Linear on gate and up (the
    plain layout), cpu_step.silu_mul, Int4Linear on down (rows as bf16; `experts` as int4_experts takes them)."""
    from ember.kernels.cpu_int4 import Int4Linear
    from ember.kernels.cpu_step import silu_mul
    x = rows.to(torch.bfloat16)
    out = torch.zeros_like(x)
    for e, (gate, up, dn) in enumerate(experts):
        start, end = int(offsets[e]), int(offsets[e + 1])
        if start == end:
            continue
        (gc, gs), (uc, us), (dc, ds) = gate, up, dn
        gate_up = Int4Linear(np.concatenate([gc, uc]), np.concatenate([gs, us]).astype(np.float32),
                             -8 * np.concatenate([gs, us]).astype(np.float32), native=True)
        down = Int4Linear(np.asarray(dc), np.asarray(ds, np.float32), -8 * np.asarray(ds, np.float32), native=True)
        out[start:end] = down(silu_mul(gate_up(x[start:end])))
    return out
