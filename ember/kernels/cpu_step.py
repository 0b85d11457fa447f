"""The captured decode step: every decoder layer of a step in one C++ call (csrc/decoder_step.cpp).

On a GPU, vLLM captures the decode step as a CUDA graph per batch-size bucket so a step is one
launch instead of hundreds. The CPU analogue here: at engine start the model is resolved once into
a plan (every layer's weight and cache pointers, the shapes) and a static workspace is allocated per
bucket (`capture_sizes`); a step of n rows then runs in the smallest bucket that holds it, as one
native call that does what the op-by-op path (ember.kernels.cpu_int4.decode_layer) does, kernel for
kernel in the same order, so both give the same bits. What it removes is dispatch: ~15 Python and
torch calls a layer, about 0.3 ms a layer at batch 1 (measured by `ember bench decode`). Steps
bigger than the largest bucket (prefill chunks, where dispatch is noise) run op by op.

It serves the batch-invariant bf16 path whose every layer runs on the C++ kernels (q4 weights); the
fp32 reference path and the torch-kernel fallback stay op by op.
"""
from __future__ import annotations

import torch

from ember.kernels import cpu_attention, cpu_q4
from ember.kernels.native import library

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
               kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, heads + 2 kv_heads, D] bf16, cos/sin [T, D] fp32 -> q [T, heads, D], k, v [T, kv_heads, D]
    (q and k rotated as the model's apply_rope does, the same bits)."""
    rows, _, head_dim = qkv.shape
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    q = torch.empty(rows, heads, head_dim, dtype=torch.bfloat16)
    k = torch.empty(rows, kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    if library().ember_rope_store(qkv.data_ptr(), rows, heads, kv_heads, head_dim, None, cos.data_ptr(),
                                  sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr()):
        raise ValueError(f"rope: head_dim {head_dim} is odd")
    return q, k, v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] bf16 -> silu(gate) * up [T, I] bf16, each element on its own."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=torch.bfloat16)
    if library().ember_silu_mul(gate_up.data_ptr(), rows, width // 2, out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"silu_mul: width {width // 2} is not a multiple of 16")
    return out


def unsupported(model, cache) -> str | None:
    """Why the step of this model over this cache cannot be captured, or None when it can."""
    from ember.kernels.cpu_int4 import Int4Linear
    if library() is None:
        return "the C++ kernels did not build"
    if model.args.family != "llama":
        return f"the captured step is the dense Llama layer's ({model.args.family} is not)"
    if cache.dtype != torch.bfloat16 or model.norm.weight.dtype != torch.bfloat16:
        return "not the bf16 path"
    if model.args.intermediate_size % 16:
        return f"intermediate size {model.args.intermediate_size} is not a multiple of 16"
    if not cpu_attention.fits(model.args.head_dim):
        return f"head_dim {model.args.head_dim} does not fit the attention kernel"
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if not isinstance(linear, Int4Linear) or linear.native is None:
                return "a layer linear is not on the C++ int4 kernel"
    return None


class CapturedStep:
    """The decoder layers of one model over one paged cache, as one call per step."""

    def __init__(self, model, cache, sizes=DEFAULT_CAPTURE_SIZES):
        reason = unsupported(model, cache)
        if reason:
            raise ValueError(f"cannot capture the decode step: {reason}")
        args = model.args
        self.model, self.cache = model, cache  # the plan points into both: keep them alive
        self.eps = args.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        header = [args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim,
                  args.intermediate_size, cache.layout.block_size, model.rope_cos.data_ptr(), model.rope_sin.data_ptr()]
        rows = []
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = cache.layer(i)
            rows += [layer.input_layernorm.weight.data_ptr(), *_pack(attn.qkv_proj), *_pack(attn.o_proj),
                     layer.post_attention_layernorm.weight.data_ptr(), *_pack(mlp.gate_up_proj), *_pack(mlp.down_proj),
                     k_cache.data_ptr(), v_cache.data_ptr()]
        self.plan = torch.tensor(header + rows, dtype=torch.int64)
        per_row = (args.hidden_size + (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
                   + 2 * args.num_heads * args.head_dim + 3 * args.intermediate_size)
        # the static buffers, one per bucket, allocated (and touched) now, not on the serving path
        self.workspaces = {size: torch.zeros(size * per_row, dtype=torch.bfloat16) for size in sorted(set(sizes))}
        self.max_rows = max(self.workspaces)
        self.steps = dict.fromkeys(self.workspaces, 0)  # steps run, per bucket

    def bucket(self, rows: int) -> int:
        """The capture size a step of `rows` rows runs in."""
        return next(size for size in self.workspaces if size >= rows)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tiles: cpu_attention.Tiles,
                 scale: float) -> torch.Tensor:
        """x [rows, hidden] bf16 (the embeddings; rows <= max_rows) -> the last layer's output, in place."""
        rows = x.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"a step of {rows} rows is bigger than the largest capture size ({self.max_rows})")
        x, positions, slots = x.contiguous(), positions.contiguous(), slots.contiguous()
        bucket = self.bucket(rows)
        threads = torch.get_num_threads()
        attention_threads = threads if tiles.work >= cpu_attention.PARALLEL_WORK else 1
        scratch = tiles.scratch_floats(self.heads // self.kv_heads, self.head_dim)
        if library().ember_decoder_step(self.plan.data_ptr(), x.data_ptr(), rows, positions.data_ptr(),
                                        slots.data_ptr(), tiles.tiles.data_ptr(), tiles.num_tiles,
                                        tiles.tables.data_ptr(), tiles.tables.shape[1], scale, self.eps, scratch,
                                        self.workspaces[bucket].data_ptr(), threads, attention_threads):
            raise ValueError("captured step: a shape the kernels do not take")
        self.steps[bucket] += 1
        return x


def _pack(linear) -> tuple[int, int]:
    pack: cpu_q4.Q4Pack = linear.native
    return pack.codes.data_ptr(), pack.dm.data_ptr()
