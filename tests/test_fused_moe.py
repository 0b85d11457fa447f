"""The fused MoE kernel (ember.kernels.cpu_moe, csrc/moe.cpp): one C++ call over a step's active experts.

Dense experts (fp32, bf16) against the per-expert torch loop it replaces, int4 experts against their own
per-expert reference (bits) and a plain dequantize-then-matmul (int8-activation tolerance), batch
invariance, and expert parallelism's zero slots."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ember.kernels import cpu_moe
from ember.kernels.native import library
from ember.model.args import MoEArgs
from ember.model.moe import MoE

pytestmark = pytest.mark.skipif(library() is None, reason="the C++ kernels do not build here")

HIDDEN, INTER, EXPERTS, TOP_K = 128, 64, 8, 2


def make_moe(dtype=torch.float32, router="softmax", local=None, seed=0) -> MoE:
    torch.manual_seed(seed)
    args = SimpleNamespace(hidden_size=HIDDEN, moe=MoEArgs(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=INTER,
                                                           layers=(True,), router=router, local_experts=local))
    moe = MoE(args)
    first, last = moe.first, moe.last
    with torch.no_grad():
        moe.router.copy_(torch.randn(EXPERTS, HIDDEN) / HIDDEN ** 0.5)
        moe.gate_up.copy_((torch.randn(EXPERTS, 2 * INTER, HIDDEN) / HIDDEN ** 0.5)[first:last])
        moe.down.copy_((torch.randn(EXPERTS, HIDDEN, INTER) / INTER ** 0.5)[first:last])
    return moe.to(dtype)


DENSE_EXPERTS = cpu_moe.dense_experts


def forward(moe: MoE, x: torch.Tensor, fused: bool, monkeypatch) -> torch.Tensor:
    """moe(x) on the fused kernel or the per-expert loop (checked: the fused kernel ran, or did not)."""
    calls = []
    monkeypatch.setattr(cpu_moe, "ENABLED", fused)
    monkeypatch.setattr(cpu_moe, "dense_experts", lambda *a: calls.append(1) or DENSE_EXPERTS(*a))
    with torch.no_grad():
        y = moe(x)
    assert bool(calls) == (fused and moe.fused is None)
    return y


def ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in bf16 steps (a's and b's bit patterns, same sign)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    same_sign = (ia < 0) == (ib < 0)
    return int(torch.where(same_sign, (ia - ib).abs(), (ia - ib).abs() * 0 + 2 ** 15).max())


@pytest.mark.parametrize("router", ["softmax", "llama4"])
def test_fp32_fused_equals_the_per_expert_loop_within_summation_order(router, monkeypatch):
    """fp32: the loop's (F.linear) numbers up to summation order, ~1e-6 relative, the same promise the
    dense layers' oneDNN packing makes (transformers' greedy tokens: tests/test_model_families.py)."""
    moe, x = make_moe(router=router), torch.randn(16, HIDDEN)
    fused, loop = forward(moe, x, True, monkeypatch), forward(moe, x, False, monkeypatch)
    assert not torch.equal(fused, torch.zeros_like(fused))
    torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-5)
    exact = forward(make_moe(torch.float64, router), x.double(), False, monkeypatch)  # the float64 truth
    assert (fused.double() - exact).abs().max() <= 2 * (loop.double() - exact).abs().max() + 1e-6


def test_bf16_fused_rounds_where_the_loop_rounds(monkeypatch):
    """bf16: gate, up, silu(gate), the product and the output rounded to bf16 as the loop rounds them; the
    dot products' order (and the SiLU's exp) differ, so an output may sit a rounding step or two away
    (documented tolerance: 4 bf16 steps on the expert outputs, most equal)."""
    moe, rows = make_moe(torch.bfloat16), torch.randn(16, HIDDEN).to(torch.bfloat16)
    counts = torch.tensor([2, 3, 0, 4, 1, 2, 0, 4])
    monkeypatch.setattr(cpu_moe, "ENABLED", True)
    fused = cpu_moe.dense_experts(rows, counts, 0, moe.gate_up.data, moe.down.data, torch.empty_like(rows))
    monkeypatch.setattr(cpu_moe, "ENABLED", False)
    loop = torch.empty_like(rows)
    moe.run_experts(rows, counts, loop)
    assert ulps_bf16(fused, loop) <= 4
    assert (fused == loop).float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int4"])
def test_a_token_gets_the_same_bits_alone_and_among_others(dtype, monkeypatch):
    moe = make_moe(torch.bfloat16 if dtype == "int4" else dtype)
    if dtype == "int4":
        cpu_moe.use_int4_experts(moe, quantized_experts(moe_weights(seed=1)))
    x = torch.randn(16, HIDDEN).to(moe.router.dtype)
    batch = forward(moe, x, True, monkeypatch)
    for rows in (slice(0, 1), slice(5, 8), slice(9, 10)):
        assert torch.equal(forward(moe, x[rows], True, monkeypatch), batch[rows])


def moe_weights(experts=EXPERTS, hidden=HIDDEN, inter=INTER, seed=0):
    torch.manual_seed(seed)
    return [(torch.randn(inter, hidden) / hidden ** 0.5, torch.randn(inter, hidden) / hidden ** 0.5,
             torch.randn(hidden, inter) / inter ** 0.5) for _ in range(experts)]


def quantized_experts(weights):
    """Per expert ((codes, scale) for gate, up, down) as numpy, symmetric int4 with bf16 scales (Kimi's)."""
    out = []
    for expert in weights:
        pairs = []
        for w in expert:
            codes, scale = cpu_moe.quantize_symmetric(w)
            pairs.append((codes.numpy(), scale.float().numpy()))
        out.append(tuple(pairs))
    return out


def dequantized(codes: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    q = torch.from_numpy(codes).float().view(codes.shape[0], -1, 32) - 8
    return (q * torch.from_numpy(scale)[..., None]).view(codes.shape)


@pytest.mark.parametrize("counts", [[1, 0, 0, 0, 0, 0, 0, 0], [0, 2, 0, 0, 0, 1, 0, 0], [3, 1, 0, 5, 2, 0, 4, 1],
                                    [0, 70, 0, 0, 1, 0, 0, 9]], ids=["1-row", "3-rows", "16-rows", "80-rows"])
def test_int4_fused_is_its_reference_bits_and_the_dequantized_matmul_within_int8_tolerance(counts):
    experts = quantized_experts(moe_weights())
    pack = cpu_moe.int4_experts(experts)
    counts = torch.tensor(counts)
    offsets = cpu_moe.offsets_of(counts, 0, EXPERTS)
    rows = torch.randn(int(counts.sum()), HIDDEN).to(torch.bfloat16)
    fused = pack(rows, counts, 0, torch.zeros_like(rows))
    assert torch.equal(fused, cpu_moe.int4_reference(rows, offsets, experts))
    # plain torch: w = scale * (q - 8) in fp32, x @ w.T, silu * up, @ down.T (no int8 activations)
    for e, ((gc, gs), (uc, us), (dc, ds)) in enumerate(experts):
        start, end = int(offsets[e]), int(offsets[e + 1])
        if start == end:
            continue
        x = rows[start:end].float()
        h = F.silu(x @ dequantized(gc, gs).T) * (x @ dequantized(uc, us).T)
        want = h @ dequantized(dc, ds).T
        # int8 activations (a 1/254 step of each group's max) and the bf16 intermediates: ~1% of the scale
        err = (fused[start:end].float() - want).abs().max()
        assert err <= 0.03 * want.abs().max(), (e, float(err), float(want.abs().max()))


def test_int4_pack_takes_kimi_style_inputs_and_replaces_the_moes_dense_experts(monkeypatch):
    """bf16 torch scales and uint8 torch codes (as a checkpoint reader hands them); the MoE serves from
    the pack, reports its bytes, and frees its dense copies."""
    moe = make_moe(torch.bfloat16)
    weights = [(moe.gate_up.data[e, :INTER].float(), moe.gate_up.data[e, INTER:].float(), moe.down.data[e].float())
               for e in range(EXPERTS)]
    experts = [tuple(cpu_moe.quantize_symmetric(w) for w in expert) for expert in weights]
    assert experts[0][0][0].dtype == torch.uint8 and experts[0][0][1].dtype == torch.bfloat16
    with torch.no_grad():  # the dense experts as the int4 codes say (rounded to bf16): what int4 should give
        for e, ((gc, gs), (uc, us), (dc, ds)) in enumerate(experts):
            moe.gate_up[e] = torch.cat([dequantized(gc.numpy(), gs.float().numpy()),
                                        dequantized(uc.numpy(), us.float().numpy())])
            moe.down[e] = dequantized(dc.numpy(), ds.float().numpy())
    x = torch.randn(6, HIDDEN).to(torch.bfloat16)
    dense = forward(moe, x, True, monkeypatch)
    cpu_moe.use_int4_experts(moe, experts)
    assert moe.gate_up.numel() == 0 and moe.expert_bytes() == moe.fused.nbytes
    assert moe.fused.nbytes == EXPERTS * 3 * HIDDEN * INTER * (1 / 2 + 2 * 2 / 32)  # codes, float16 scale and low
    int4 = forward(moe, x, True, monkeypatch)
    assert (int4.float() - dense.float()).abs().max() <= 0.03 * dense.float().abs().max()
    with pytest.raises(ValueError, match="int4 experts"):
        cpu_moe.use_int4_experts(make_moe(torch.bfloat16, local=(0, 4)), experts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int4"])
def test_expert_parallel_ranks_leave_other_experts_slots_zero_and_sum_to_one_rank(dtype, monkeypatch):
    """Each rank computes its experts' slots and leaves the rest zero (MoE.reduce sums them): the two
    ranks' slots add up to the single rank's, bit for bit."""
    real = torch.bfloat16 if dtype == "int4" else dtype
    full, ranks = make_moe(real), [make_moe(real, local=(0, 3)), make_moe(real, local=(3, EXPERTS))]
    if dtype == "int4":
        experts = quantized_experts(moe_weights(seed=2))
        cpu_moe.use_int4_experts(full, experts)
        cpu_moe.use_int4_experts(ranks[0], experts[:3])
        cpu_moe.use_int4_experts(ranks[1], experts[3:])
    seen = {}
    for name, moe in [("full", full), ("rank0", ranks[0]), ("rank1", ranks[1])]:
        moe.set_expert_parallel(lambda slots, name=name: seen.setdefault(name, slots.clone()))
    x = torch.randn(16, HIDDEN).to(real)
    outputs = [forward(m, x, True, monkeypatch) for m in (full, *ranks)]
    zero_rows = [(seen[r] == 0).all(-1) for r in ("rank0", "rank1")]
    assert zero_rows[0].any() and zero_rows[1].any() and not (zero_rows[0] & zero_rows[1]).any()
    assert torch.equal(seen["rank0"] + seen["rank1"], seen["full"])
    assert not torch.equal(outputs[1], outputs[0])  # (a rank alone has half the answer)


def test_pack_experts_keeps_the_stacked_experts_for_the_fused_kernel():
    from ember.kernels.cpu_linear import PackedLinear
    moe = make_moe()
    moe.pack_experts(PackedLinear)
    assert moe.packed is None and moe.gate_up.numel() == EXPERTS * 2 * INTER * HIDDEN


def test_int4_pack_streams_experts_and_takes_scale_low_pairs():
    """A loader may hand experts one at a time (an iterator and a count) and asymmetric codes as
    (scale, low) pairs: low = -8 scale is the symmetric pack exactly; a short iterator is refused."""
    experts = quantized_experts(moe_weights(experts=3))
    symmetric = cpu_moe.int4_experts(experts)
    pairs = [tuple((codes, (scale, -8 * scale)) for codes, scale in expert) for expert in experts]
    streamed = cpu_moe.int4_experts(iter(pairs), count=3)
    for name in ("gate_up_codes", "gate_up_dm", "down_codes", "down_dm"):
        assert torch.equal(getattr(streamed, name), getattr(symmetric, name))
    with pytest.raises(ValueError, match="2 experts given, 3 expected"):
        cpu_moe.int4_experts(iter(pairs[:2]), count=3)
    (gc, gs), (uc, us), (dc, ds) = experts[0]
    with pytest.raises(ValueError, match="intermediate 48"):  # (the kernel's quads take 32 activations)
        cpu_moe.int4_experts([((gc[:48], gs[:48]), (uc[:48], us[:48]), (dc[:, :48], ds[:, :1]))])
