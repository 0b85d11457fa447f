"""The GPU's quantized linears (ember.kernels.triton_quant_linear) equal dequantize-then-matmul in fp32:
the W4A16 group-quantized kernel over Kimi K2.5's int4 codes and the fp8 block-scaled kernel over
DeepSeek-V3's e4m3 weights, on shapes with partial edge tiles and blocks. Run under Triton's CPU
interpreter always (this file as a script in a subprocess with TRITON_INTERPRET=1, set before Triton is
imported; fp32 and fp16: bf16 tl.dot is wrong in the interpreter) and on a GPU when there is one (bf16
too). Tolerances, as a fraction of the reference's largest output: fp32 1e-5, fp16 1e-3 (the output's
rounding, 2^-11), bf16 8e-3 (2^-8)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def int4_weight(out_features: int, in_features: int, group: int, seed: int = 0):
    """A PackedInt4 as ember.model.checkpoint reads it from compressed-tensors' int32 words (eight
    codes a word, low nibble first), with bf16 scales of Kimi K2.5's magnitude."""
    from ember.model.checkpoint import PackedInt4, unpack_int4
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2 ** 31, 2 ** 31, (out_features, -(-in_features // 8)), generator=g, dtype=torch.int64)
    codes = unpack_int4(words.to(torch.int32), (out_features, in_features))
    scale = (torch.rand(out_features, in_features // group, generator=g) * 0.02 + 0.002).bfloat16()
    return PackedInt4(codes, scale, group)


def fp8_weight(out_features: int, in_features: int, block=(128, 128), seed: int = 0):
    """An e4m3 weight [N, K] and its float32 scale per block, as DeepSeek-V3 stores them."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = (-(-out_features // block[0]), -(-in_features // block[1]))
    return weight, torch.rand(blocks, generator=g) * 1e-3 + 1e-4


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def check(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    assert got.dtype == dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
    err = relative_error(got.cpu(), want)
    assert err <= TOLERANCE[dtype], f"{name} {dtype}: relative error {err:.2e} > {TOLERANCE[dtype]:.0e}"
    return err


# -- the kernels (run as a script: under the interpreter on CPU, or on a GPU) --------------------------
def check_kernels(device: str) -> list[str]:
    from ember.kernels.triton_quant_linear import BlockFP8Linear, Int4GroupLinear, fp8_block_matmul
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    small = device == "cpu"  # the interpreter is ~1000x slower than torch: small shapes, every edge
    lines = []
    g = torch.Generator().manual_seed(1)
    # int4: K a tile and a half (BK 64), N past a 64-column tile, rows past a 16- and a 32-row tile
    int4_shapes = [(5, 72, 96, 32), (20, 40, 80, 16), (1, 64, 192, 64)] if small else \
        [(1, 7168, 2048, 32), (7, 2048, 7168, 32), (300, 1000, 7168, 32), (33, 200, 96, 32)]
    for rows, out_features, in_features, group in int4_shapes:
        weight = int4_weight(out_features, in_features, group)
        layer = Int4GroupLinear.from_packed(weight).to(device)
        want_w = weight.dequantize().float()
        assert torch.equal(layer.dequantize().cpu(), weight.dequantize()), "the GPU layout round trip"
        for dtype in dtypes:
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            err = check(f"int4 {rows}x{in_features}->{out_features} g{group}", layer(x.to(device)),
                        x.float() @ want_w.T, dtype)
            lines.append(f"int4 M={rows} N={out_features} K={in_features} group={group} {dtype}: {err:.1e}")
    # a 3-D input through the module, and a fused gate/up
    gate, up = int4_weight(48, 64, 32, seed=2), int4_weight(24, 64, 32, seed=3)
    fused = Int4GroupLinear.concat([Int4GroupLinear.from_packed(gate), Int4GroupLinear.from_packed(up)]).to(device)
    x = torch.randn(2, 3, 64, generator=g)
    want = torch.cat([gate.dequantize(), up.dequantize()]).float()
    check("int4 fused 3-D", fused(x.to(device)), x @ want.T, torch.float32)
    # fp8: rows not a multiple of 128 (a partial block of rows), K past a 128-column block and a 64-column tile
    fp8_shapes = [(3, 200, 160, (128, 128)), (17, 72, 96, (64, 32))] if small else \
        [(1, 7168, 2048, (128, 128)), (7, 1000, 7168, (128, 128)), (300, 1536, 7168, (128, 128))]
    for rows, out_features, in_features, block in fp8_shapes:
        weight, scale = fp8_weight(out_features, in_features, block)
        layer = BlockFP8Linear(weight, scale, block).to(device)
        want_w = layer.dequantize().cpu()
        for dtype in dtypes:
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            want = x.float() @ want_w.T
            err = check(f"fp8 {rows}x{in_features}->{out_features}", layer(x.to(device)), want, dtype)
            bits = fp8_block_matmul(x.to(device), layer.weight, layer.scale_inv, block, decode_bits=True)
            check(f"fp8 bits {rows}x{in_features}->{out_features}", bits, want, dtype)
            lines.append(f"fp8 M={rows} N={out_features} K={in_features} block={block} {dtype}: {err:.1e}")
    q, kv = fp8_weight(256, 160, seed=4), fp8_weight(40, 160, seed=5)
    fused = BlockFP8Linear.concat([BlockFP8Linear(*q), BlockFP8Linear(*kv)]).to(device)
    x = torch.randn(4, 160, generator=g)
    want = torch.cat([BlockFP8Linear(*q).dequantize(), BlockFP8Linear(*kv).dequantize()])
    check("fp8 fused", fused(x.to(device)), x @ want.T, torch.float32)
    rows = torch.randperm(200, generator=g)[:150]  # reordered rows, as latent attention's rope rows
    picked = BlockFP8Linear(*fp8_weight(200, 160, seed=6))
    check("fp8 rows", picked.select_rows(rows).to(device)(x.to(device)), x @ picked.dequantize()[rows].T, torch.float32)
    return lines


def timed(fn, x: torch.Tensor, n: int = 50) -> float:
    """Microseconds a call, on the GPU, after a warm-up."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def experts_reference(rows: torch.Tensor, counts: list[int], first: int, weights, out: torch.Tensor) -> torch.Tensor:
    """MoE's per-expert loop in fp32 over dequantized (gate, up, down) weights, one per local expert."""
    out = out.float().clone()
    ends = torch.tensor(counts).cumsum(0).tolist()
    for local, (gate, up, down) in enumerate(weights):
        e = first + local
        start, end = (ends[e - 1] if e else 0), ends[e]
        x = rows[start:end].float()
        out[start:end] = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    return out


def check_experts(device: str) -> list[str]:
    """The grouped experts (one launch per matmul over every local expert's row tiles) against the loop:
    an expert with no rows, one with more rows than a tile, a rank holding experts 1..5 of 7 (the
    others' rows of `out` untouched)."""
    from ember.kernels.triton_quant_linear import BlockFP8Experts, Int4GroupExperts
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    counts, first, local = [3, 0, 17, 1, 5, 2, 4], 1, 5
    if device == "cuda":
        counts = [c * 37 for c in counts]  # past 64-row tiles
    g = torch.Generator().manual_seed(6)
    lines = []
    hidden, inter = 96, 64
    parts = [[int4_weight(inter, hidden, 32, seed=10 * e + i) for i in range(2)] + [int4_weight(hidden, inter, 32,
                                                                                                seed=10 * e + 2)]
             for e in range(local)]
    int4 = Int4GroupExperts(parts).to(device)
    int4_w = [[p.dequantize().float() for p in expert] for expert in parts]
    hidden8, inter8 = 96, 128
    parts8 = [[fp8_weight(inter8, hidden8, seed=10 * e + i) for i in range(2)] + [fp8_weight(hidden8, inter8,
                                                                                             seed=10 * e + 2)]
              for e in range(local)]
    fp8 = BlockFP8Experts(parts8).to(device)
    from ember.model.checkpoint import dequantize_fp8
    fp8_w = [[dequantize_fp8(w, s, (128, 128)) for w, s in expert] for expert in parts8]
    for name, experts, weights, width in (("int4", int4, int4_w, hidden), ("fp8", fp8, fp8_w, hidden8)):
        for dtype in dtypes:
            rows = torch.randn(sum(counts), width, generator=g).to(dtype)
            out = torch.full_like(rows, 7.0)
            want = experts_reference(rows, counts, first, weights, out)
            got = experts(rows.to(device), torch.tensor(counts, device=device), first, out.to(device))
            err = check(f"{name} experts", got, want, dtype)
            outside = torch.cat([got[:counts[0]], got[sum(counts[:first + local]):]]).cpu()
            assert bool((outside == 7).all()), f"{name} experts wrote rows of experts they do not hold"
            lines.append(f"{name} experts rows={sum(counts)} {dtype}: {err:.1e}")
    return lines


def quantized_moe(local=(1, 6), hidden=96, inter=64, experts=7):
    """ember.model.moe.MoE holding experts [local) of `experts` as int4 (Int4GroupExperts), and the
    (gate, up, down) weights they stand for in fp32."""
    from types import SimpleNamespace

    from ember.kernels.triton_quant_linear import Int4GroupExperts, use_quantized_experts
    from ember.model.args import MoEArgs
    from ember.model.moe import MoE
    args = SimpleNamespace(hidden_size=hidden, moe=MoEArgs(num_experts=experts, top_k=2, intermediate_size=inter,
                                                           layers=(True,), router="softmax", local_experts=local))
    moe = MoE(args)
    with torch.no_grad():
        moe.router.copy_(torch.randn(experts, hidden, generator=torch.Generator().manual_seed(7)) / hidden ** 0.5)
    parts = [[int4_weight(inter, hidden, 32, seed=10 * e + i) for i in range(2)] + [int4_weight(hidden, inter, 32,
                                                                                                seed=10 * e + 2)]
             for e in range(*local)]
    use_quantized_experts(moe, Int4GroupExperts(parts))
    return moe, [[p.dequantize().float() for p in expert] for expert in parts]


def moe_reference(moe, weights, x: torch.Tensor) -> torch.Tensor:
    """The same MoE (router, slots, combine) with its experts computed by experts_reference in fp32."""
    from ember.model.moe import MoE
    ref = MoE(SimpleNamespace(hidden_size=moe.router.shape[1], moe=moe.spec))
    ref.router = moe.router
    ref.fused = lambda rows, counts, first, out: out.copy_(
        experts_reference(rows, counts.tolist(), first, weights, out).to(out.dtype))
    with torch.no_grad():
        return ref(x)


def check_moe(device: str) -> list[str]:
    """MoE.forward on the grouped int4 experts (the hook's path: MoE.fused) against its fp32 loop."""
    moe, weights = quantized_moe()
    moe = moe.to(device)
    assert moe.fused.gate_up_packed.device.type == torch.device(device).type, "the experts move with the model"
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got = moe(x.to(device))
    err = check("MoE on int4 experts", got, moe_reference(moe.cpu(), weights, x), torch.float32)
    return [f"MoE forward on int4 experts (5 of 7 local) float32: {err:.1e}"]


def bench(device: str) -> list[str]:
    """Decode-step (1 row) and prefill (512 rows) times on the GPU against bf16 F.linear of the dequantized
    weight: what the quantized layers save in bytes and what they cost or gain in time."""
    from ember.kernels.triton_quant_linear import BlockFP8Linear, Int4GroupLinear
    lines = []
    for kind, layer in (("int4", Int4GroupLinear.from_packed(int4_weight(7168, 2048, 32))),
                        ("int4", Int4GroupLinear.from_packed(int4_weight(4096, 7168, 32))),
                        ("fp8", BlockFP8Linear(*fp8_weight(7168, 2048))),
                        ("fp8", BlockFP8Linear(*fp8_weight(4096, 7168)))):
        layer = layer.to(device)
        dense = layer.dequantize().to(device, torch.bfloat16)
        for rows in (1, 512):
            x = torch.randn(rows, layer.in_features, device=device, dtype=torch.bfloat16)
            times = [timed(layer, x), timed(lambda t, w=dense: F.linear(t, w), x)]
            lines.append(f"bench {kind} {layer.out_features}x{layer.in_features} M={rows}: {times[0]:.1f} us "
                         f"({layer.weight_bytes / 2 ** 20:.1f} MiB) vs bf16 F.linear {times[1]:.1f} us "
                         f"({dense.numel() * 2 / 2 ** 20:.1f} MiB)")
    return lines


def run_script(device: str, interpret: bool, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="2")
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # read when kernels are defined: set before import
    return subprocess.run([sys.executable, __file__, device, *extra], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def test_quant_kernels_under_the_triton_interpreter():
    proc = run_script("cpu", interpret=True)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the interpreter twin runs on CPU")
def test_quant_kernels_on_gpu():
    proc = run_script("cuda", interpret=False)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


# -- the modules on CPU (torch's fallback; no interpreter) ---------------------------------------------
@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_int4_layer_keeps_two_codes_a_byte_and_falls_back_to_torch_on_cpu(no_interpreter):
    from ember.kernels.triton_quant_linear import Int4GroupLinear, pack_int4, runs_triton, unpack_int4
    weight = int4_weight(48, 96, 32)
    layer = Int4GroupLinear.from_packed(weight)
    assert layer.packed.dtype == torch.uint8 and layer.packed.shape == (48, 48)  # [K/2, N]
    assert layer.weight_bytes == 48 * 96 // 2 + 48 * 3 * 2  # codes at half a byte, bf16 scales
    assert torch.equal(unpack_int4(pack_int4(weight.codes)), weight.codes)
    assert int(layer.packed[0, 0]) == int(weight.codes[0, 0]) | int(weight.codes[0, 1]) << 4
    x = torch.randn(2, 5, 96)
    assert not runs_triton(x)
    assert torch.equal(layer(x), F.linear(x, weight.dequantize().float()))
    assert {n for n, _ in layer.named_buffers()} == {"packed", "scale"}  # (moved by .to(device) with the model)


def test_fp8_layer_keeps_the_stored_weight_and_falls_back_to_torch_on_cpu(no_interpreter):
    from ember.kernels.triton_quant_linear import BlockFP8Linear
    from ember.model.checkpoint import dequantize_fp8
    weight, scale = fp8_weight(200, 160)
    layer = BlockFP8Linear(weight, scale)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_bytes == 200 * 160 + 4 * 4
    x = torch.randn(3, 160)
    assert torch.equal(layer(x), F.linear(x, dequantize_fp8(weight, scale, (128, 128))))
    rows = torch.tensor([199, 3, 130, 127, 128])  # across blocks, out of order
    picked = layer.select_rows(rows)
    assert picked.block == (1, 128) and picked.scale_inv.shape == (5, 2)
    assert torch.equal(picked.dequantize(), layer.dequantize()[rows])


def test_expert_tiles_cover_each_local_row_once():
    from ember.kernels.triton_quant_linear import expert_tiles
    counts = torch.tensor([3, 0, 40, 1, 0, 5, 2])
    tiles = expert_tiles(counts, 1, 6, int(counts.sum()))
    assert tiles.block_m == 16 and tiles.count == 51 // 16 + 5
    covered = torch.zeros(int(counts.sum()), dtype=torch.int64)
    for expert, start, end in tiles.table.tolist():
        if start < end:
            assert 0 <= expert < 5
            rows = slice(start, min(end, start + tiles.block_m))
            covered[rows] += 1
            owner = torch.repeat_interleave(torch.arange(7), counts)[rows]
            assert bool((owner == expert + 1).all()), "a tile crosses experts"
    # experts 1..5 hold rows 3..48 (0, 40, 1, 0 and 5 rows); expert 0's and 6's are not this rank's
    assert covered[3:49].tolist() == [1] * 46 and covered[:3].sum() == covered[49:].sum() == 0
    assert sum(1 for _, start, end in tiles.table.tolist() if start < end) == 3 + 1 + 1  # ceil(rows / 16) each


def test_experts_fall_back_to_torch_on_cpu(no_interpreter):
    from ember.kernels.triton_quant_linear import Int4GroupExperts
    parts = [[int4_weight(64, 96, 32, seed=3 * e + i) for i in range(2)] + [int4_weight(96, 64, 32, seed=3 * e + 2)]
             for e in range(2)]
    experts = Int4GroupExperts(parts)
    assert experts.nbytes == 2 * (128 * 96 // 2 + 128 * 3 * 2 + 96 * 64 // 2 + 96 * 2 * 2)
    counts, rows = [2, 4, 1], torch.randn(7, 96)
    out = torch.full_like(rows, 7.0)
    want = experts_reference(rows, counts, 1, [[p.dequantize().float() for p in e] for e in parts], out)
    got = experts(rows, torch.tensor(counts), 1, out)
    assert got is out and relative_error(got, want) < 1e-6


def test_moe_serves_from_quantized_experts_outside_its_state_dict(no_interpreter):
    """The hook's path on CPU (the torch fallback): MoE.fused set by use_quantized_experts, its dense
    experts freed, its bytes reported, and the experts' buffers outside the state dict (a strict load
    by name, as LlamaModel.load_hf_state_dict does, is unchanged)."""
    moe, weights = quantized_moe()
    assert moe.gate_up.numel() == moe.down.numel() == 0
    assert moe.expert_bytes() == moe.fused.nbytes == 5 * (128 * 96 // 2 + 128 * 3 * 2 + 96 * 64 // 2 + 96 * 2 * 2)
    assert not any("fused" in k for k in moe.state_dict())
    moe.load_state_dict(moe.state_dict(), strict=True)
    x = torch.randn(9, 96)
    with torch.no_grad():
        got = moe(x)
    assert relative_error(got, moe_reference(moe, weights, x)) < 1e-6
    with pytest.raises(ValueError, match="quantized experts"):
        from ember.kernels.triton_quant_linear import use_quantized_experts
        use_quantized_experts(quantized_moe(local=(0, 7))[0], moe.fused)


def test_the_loader_takes_a_blocks_quantized_experts_by_their_checkpoint_names():
    from ember.kernels.triton_quant_linear import BlockFP8Experts, Int4GroupExperts, take_quantized_experts
    prefix = "language_model.model.layers.3.mlp."
    names = lambda e: [f"{prefix}experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]  # noqa: E731
    int4 = {n: int4_weight(64 if "down" not in n else 96, 96 if "down" not in n else 64, 32, seed=i)
            for e in range(4) for i, n in enumerate(names(e))}
    int4["other"] = torch.zeros(1)
    experts = take_quantized_experts(int4, prefix, 1, 3)
    assert isinstance(experts, Int4GroupExperts) and experts.num_experts == 2
    assert sorted(int4) == sorted(names(0) + names(3) + ["other"])  # the other ranks' experts stay
    fp8 = {n: fp8_weight(128 if "down" not in n else 96, 96 if "down" not in n else 128) for n in names(0)}
    assert isinstance(take_quantized_experts(fp8, prefix, 0, 1), BlockFP8Experts) and not fp8
    dense = {n: torch.zeros(2, 2) for n in names(0)}
    assert take_quantized_experts(dense, prefix, 0, 1) is None and len(dense) == 3


def test_quantized_layers_refuse_what_they_cannot_serve():
    from ember.kernels.triton_quant_linear import BlockFP8Linear, Int4GroupLinear
    weight = int4_weight(8, 64, 32)
    with pytest.raises(ValueError, match="scales"):
        Int4GroupLinear(weight.codes, weight.scale[:, :1], 32)
    with pytest.raises(ValueError, match="group"):
        Int4GroupLinear.concat([Int4GroupLinear.from_packed(weight),
                                Int4GroupLinear.from_packed(int4_weight(8, 64, 16))])
    w, s = fp8_weight(200, 160)
    with pytest.raises(ValueError, match="scale_inv"):
        BlockFP8Linear(w, s[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        BlockFP8Linear(w.float(), s)
    with pytest.raises(ValueError, match="whole 128-row blocks"):  # a block would mix two layers' scales
        BlockFP8Linear.concat([BlockFP8Linear(w, s), BlockFP8Linear(w, s)])


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    torch.manual_seed(0)
    report = check_kernels(where) + check_experts(where) + check_moe(where)
    if "--bench" in sys.argv:
        report += bench(where)
    print("\n".join(report))
    print("ok")
