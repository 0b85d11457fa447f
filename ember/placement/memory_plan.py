"""Memory plans for real checkpoints: the weight bytes on each GPU, the KV bytes per token and the
context that fits beside them, for every TP x PP x EP layout of a GPU count (torch-free: arithmetic
over a Hugging Face config.json; no weights are read).

What a rank holds. Tensor parallelism (TP) splits attention heads, MLP widths and the vocabulary
TP ways (the fullest rank holds ceil(n / TP) of n); what no head owns is replicated: norms, the
router, and MLA's down-projections q_a and kv_a, whose outputs are latents every head reads.
Expert parallelism (EP is 1 or TP, over the TP group) gives each rank ceil(E / EP) whole routed
experts; with EP = 1 every expert is split TP ways by width instead. Pipeline parallelism (PP)
cuts the layers into contiguous stages as even as possible (the first `layers mod PP` stages one
layer more), the embedding on the first stage, the final norm and lm_head on the last (a tied
lm_head is a second copy there when PP > 1).

The KV cache. MLA caches one latent plane, kv_lora_rank + qk_rope_head_dim values per token and
layer, whole on every TP rank (the latent is not split by heads). GQA caches K and V, 2 x KV heads
x head_dim, split TP ways up to the KV heads and replicated beyond. A stage caches its own layers.

What fits, per GPU of a stage: capacity (what CUDA reports the GPU holds, ember.engine.workspace's
GPU_MEMORY_MIB) - runtime (CUDA context, communicators, allocator slack: stated, ember.engine.workspace)
- weights - workspace (the step's memory at the engine's limits, ember.engine.workspace.step_workspace:
the same code the engine sizes its KV pool with) = the KV pool. Context tokens = KV pool / KV bytes per
token, on the rank where that is least. A context token is one slot of the KV pool that all running
sequences share, held by every layer. A layout fits when at least `min_context_tokens` fit.

Hybrid KV (Llama 4's chunked local attention, a hybrid allocator as vLLM's): a chunked layer holds per
running sequence only its current chunk (chunk_size rounded up to blocks) plus, once per step, the
blocks of a prefill chunk crossing into the next attention chunk (max_num_batched_tokens rounded up);
the full-attention layers hold every context token. So for `sequences` concurrent sequences, the
context tokens = (KV pool - chunked layers' windows) / the full layers' bytes per token.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ember.engine import workspace as ws

GIB = 1 << 30
MIB = 1 << 20
GPU_MEMORY_MIB = ws.GPU_MEMORY_MIB
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1}
DEFAULT_MIN_CONTEXT_TOKENS = 4096
DEFAULT_SEQUENCES = 8  # concurrent sequences the hybrid-KV figure is stated for
BLOCK_SIZE = 16  # the engine's default KV block (engine.block_size)
GPU_COUNTS_SEARCHED = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class WeightDtype:
    """Bytes per parameter of each kind of weight under one checkpoint format."""
    name: str
    projections: float  # attention, dense-MLP and shared-expert projections
    experts: float  # routed experts
    note: str
    other: float = 2.0  # embedding, lm_head, router, norms: bf16 in every format here


WEIGHT_DTYPES = {
    "bf16": WeightDtype("bf16", 2.0, 2.0, "every weight bf16"),
    "fp8": WeightDtype("fp8", 1 + 4 / 128 ** 2, 1 + 4 / 128 ** 2,
                       "projections and experts fp8 with an fp32 scale per 128x128 block (DeepSeek-V3's format); "
                       "embedding, lm_head, router and norms bf16"),
    "int4": WeightDtype("int4", 2.0, 0.5 + 2 / 32,
                        "routed experts int4 with a bf16 scale per 32 weights (0.5625 B), everything else bf16: "
                        "the format Kimi K2.5 ships (its attention, shared experts, dense MLP and lm_head stay bf16)"),
}


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameter counts, grouped by how TP and EP split them."""
    attention_by_heads: int  # q (or MLA's q_b), MLA's kv_b, o: split TP ways by head
    attention_by_kv_heads: int  # GQA's k and v: split TP ways up to the KV heads, replicated beyond
    attention_replicated: int  # MLA's q_a and kv_a down-projections: on every TP rank
    norms: int  # replicated
    dense_mlp: int  # split TP ways by width
    shared_experts: int  # split TP ways by width
    routed_experts: int  # all experts: EP ways by expert, or TP ways by width when EP = 1
    router: int  # replicated
    chunked: bool = False  # chunked local attention: its KV holds at most chunk_size tokens a sequence

    @property
    def attention(self) -> int:
        return self.attention_by_heads + self.attention_by_kv_heads + self.attention_replicated


@dataclass(frozen=True)
class ModelShape:
    """What a memory plan needs of a checkpoint, read from its config.json."""
    model_type: str
    attention: str  # "MLA" or "GQA"
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # GQA's KV heads (MLA: 1, its latent)
    kv_dim: int  # cached values per KV head, token and layer (MLA: kv_lora_rank + qk_rope_head_dim)
    kv_planes: int  # 2 (K and V) or 1 (MLA's latent)
    tied_embeddings: bool
    layers: tuple[LayerParams, ...]
    dense_intermediate: int
    shared_intermediate: int
    expert_intermediate: int
    num_experts: int
    experts_per_token: int
    chunk_size: int | None = None  # chunked local attention's window (Llama 4)
    step: ws.StepShape | None = None  # what shapes a step's tensors (the workspace)

    @property
    def embedding(self) -> int:
        return self.vocab_size * self.hidden_size

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by part (a tied lm_head counts once, under embedding)."""
        total = {name: sum(getattr(layer, name) for layer in self.layers)
                 for name in ("attention", "norms", "dense_mlp", "shared_experts", "routed_experts", "router")}
        return {"embedding": self.embedding, "lm_head": 0 if self.tied_embeddings else self.embedding,
                **total, "norms": total["norms"] + self.hidden_size}

    @property
    def total_parameters(self) -> int:
        return sum(self.parameter_counts().values())

    @property
    def active_parameters(self) -> int:
        """What one token computes with: all but the routed experts it is not sent to."""
        routed = self.parameter_counts()["routed_experts"]
        unused = routed * (1 - self.experts_per_token / self.num_experts) if self.num_experts else 0
        return round(self.total_parameters - unused)

    def kv_values_per_token_layer(self, tp: int = 1) -> int:
        """KV values one rank caches per token and layer under TP = `tp`."""
        if self.attention == "MLA":
            return self.kv_dim
        return self.kv_planes * math.ceil(self.num_kv_heads / tp) * self.kv_dim

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """The whole model's KV bytes per token (TP = 1, every layer)."""
        return self.kv_values_per_token_layer() * len(self.layers) * KV_DTYPE_BYTES[kv_dtype]


# ---------------------------------------------------------------------------------------------
# config.json -> ModelShape


class _Fields:
    """A config object read field by field; a field that is missing or not a count is named by its
    path in config.json (text_config.kv_lora_rank), so a refusal says what to fix."""

    def __init__(self, values: dict, prefix: str):
        self.values, self.prefix = values, prefix

    def count(self, key: str, default: int | None = None, zero_ok: bool = False) -> int:
        value = self.values.get(key, default)
        if value is None:
            raise ValueError(f"config.json lacks {self.prefix}{key}")
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_ok else 1):
            kind = "a non-negative integer" if zero_ok else "a positive integer"
            raise ValueError(f"config.json's {self.prefix}{key} is {value!r}, not {kind}")
        return value

    def optional_count(self, key: str) -> int | None:
        return None if self.values.get(key) is None else self.count(key)

    def int_list(self, key: str, default: list[int]) -> list[int]:
        value = self.values.get(key)
        if value is None:
            return default
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"config.json's {self.prefix}{key} is {value!r}, not a list of integers")
        return value


def read_model_shape(path: str | Path) -> ModelShape:
    """The ModelShape of a config.json file (or of a model folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from e
    return model_shape(config)


def model_shape(config: dict) -> ModelShape:
    """The ModelShape of a parsed config.json: multimodal wrappers (Kimi K2.5's kimi_k25, Llama 4's
    llama4) are unwrapped to their text_config; vision towers are left out of the plan."""
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError("config.json's text_config is not an object")
    fields = _Fields(text, "text_config.") if text is not None else _Fields(config, "")
    model_type = fields.values.get("model_type") or config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"config.json's model_type {model_type!r} is not one memory plans read "
                         f"({', '.join(sorted(FAMILIES))})")
    tied = fields.values.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return family(fields, str(model_type), bool(tied))


def _mla_shape(f: _Fields, model_type: str, tied: bool) -> ModelShape:
    """DeepSeek-V3 and its descendants (Kimi K2, K2.5): Multi-head Latent Attention, the first
    `first_k_dense_replace` layers dense, the rest routed experts beside shared ones."""
    hidden, heads, num_layers = f.count("hidden_size"), f.count("num_attention_heads"), f.count("num_hidden_layers")
    q_lora, kv_lora = f.optional_count("q_lora_rank"), f.count("kv_lora_rank")
    rope, nope, v_dim = f.count("qk_rope_head_dim"), f.count("qk_nope_head_dim"), f.count("v_head_dim")
    q_out = heads * (nope + rope)
    q_split, q_down, q_norm = (q_lora * q_out, hidden * q_lora, q_lora) if q_lora else (hidden * q_out, 0, 0)
    experts, top_k = f.count("n_routed_experts"), f.count("num_experts_per_tok")
    expert_width, dense_width = f.count("moe_intermediate_size"), f.count("intermediate_size")
    shared_width = f.count("n_shared_experts", default=0, zero_ok=True) * expert_width
    first_dense, every = f.count("first_k_dense_replace", default=0, zero_ok=True), f.count("moe_layer_freq", 1)
    attention = dict(attention_by_heads=q_split + kv_lora * heads * (nope + v_dim) + heads * v_dim * hidden,
                     attention_by_kv_heads=0, attention_replicated=q_down + hidden * (kv_lora + rope),
                     norms=2 * hidden + q_norm + kv_lora)
    dense = LayerParams(**attention, dense_mlp=3 * hidden * dense_width, shared_experts=0, routed_experts=0, router=0)
    moe = LayerParams(**attention, dense_mlp=0, shared_experts=3 * hidden * shared_width,
                      routed_experts=experts * 3 * hidden * expert_width,
                      router=experts * hidden + experts)  # gate weight and its e_score_correction_bias
    layers = tuple(moe if i >= first_dense and i % every == 0 else dense for i in range(num_layers))
    vocab = f.count("vocab_size")
    step = ws.StepShape(hidden, vocab, heads, 1, nope + rope, dense_width if first_dense else 0, experts, top_k,
                        expert_width, shared_width, ws.LatentShape(q_lora or 0, kv_lora, nope, rope, v_dim),
                        router_fp32=True)
    return ModelShape(model_type, "MLA", vocab, hidden, heads, 1, kv_lora + rope, 1, tied, layers,
                      dense_width, shared_width, expert_width, experts, top_k, step=step)


def _gqa_attention(f: _Fields, qk_norm: bool) -> tuple[int, int, int, int, dict]:
    """Grouped-query attention's shape and per-layer parameters (no biases: none of these has them)."""
    hidden, heads = f.count("hidden_size"), f.count("num_attention_heads")
    kv_heads = f.count("num_key_value_heads", default=heads)
    head_dim = f.count("head_dim", default=hidden // heads)
    attention = dict(attention_by_heads=2 * hidden * heads * head_dim,
                     attention_by_kv_heads=2 * hidden * kv_heads * head_dim,
                     attention_replicated=0, norms=2 * hidden + (2 * head_dim if qk_norm else 0))
    return hidden, heads, kv_heads, head_dim, attention


def _llama_qwen_shape(f: _Fields, model_type: str, tied: bool) -> ModelShape:
    """Llama, Qwen3 (QK-norm) and Qwen3-MoE (routed experts on every `decoder_sparse_step`-th layer
    not in `mlp_only_layers`, no shared expert)."""
    hidden, heads, kv_heads, head_dim, attention = _gqa_attention(f, qk_norm=model_type.startswith("qwen3"))
    num_layers, dense_width = f.count("num_hidden_layers"), f.count("intermediate_size")
    dense = LayerParams(**attention, dense_mlp=3 * hidden * dense_width, shared_experts=0, routed_experts=0, router=0)
    experts = top_k = expert_width = 0
    moe_layers: set[int] = set()
    if model_type == "qwen3_moe":
        experts, top_k = f.count("num_experts"), f.count("num_experts_per_tok")
        expert_width = f.count("moe_intermediate_size")
        step, dense_only = f.count("decoder_sparse_step", 1), set(f.int_list("mlp_only_layers", []))
        moe_layers = {i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0}
    moe = LayerParams(**attention, dense_mlp=0, shared_experts=0, routed_experts=experts * 3 * hidden * expert_width,
                      router=experts * hidden)
    layers = tuple(moe if i in moe_layers else dense for i in range(num_layers))
    vocab = f.count("vocab_size")
    step = ws.StepShape(hidden, vocab, heads, kv_heads, head_dim, dense_width if len(moe_layers) < num_layers else 0,
                        experts, top_k, expert_width, qk_norm=model_type.startswith("qwen3"))
    return ModelShape(model_type, "GQA", vocab, hidden, heads, kv_heads, head_dim, 2, tied, layers,
                      dense_width, 0, expert_width, experts, top_k, step=step)


def _llama4_shape(f: _Fields, model_type: str, tied: bool) -> ModelShape:
    """Llama 4's text model: routed experts (plus one shared expert of the routed width) on
    `moe_layers` (or every `interleave_moe_layer_step`-th layer), dense `intermediate_size_mlp`
    MLPs elsewhere; the RoPE layers attend in chunks of `attention_chunk_size`, the NoPE layers
    (every fourth by default) attend to everything. Its QK norm has no weights."""
    hidden, heads, kv_heads, head_dim, attention = _gqa_attention(f, qk_norm=False)
    num_layers = f.count("num_hidden_layers")
    experts, top_k = f.count("num_local_experts"), f.count("num_experts_per_tok")
    expert_width, dense_width = f.count("intermediate_size"), f.count("intermediate_size_mlp")
    step = f.count("interleave_moe_layer_step", 1)
    moe_layers = set(f.int_list("moe_layers", list(range(step - 1, num_layers, step))))
    interval = f.count("no_rope_layer_interval", 4)
    every_fourth_nope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    uses_rope = f.int_list("no_rope_layers", every_fourth_nope) or every_fourth_nope  # [] means the default
    if len(uses_rope) != num_layers:
        raise ValueError(f"config.json's {f.prefix}no_rope_layers has {len(uses_rope)} entries, not one per "
                         f"layer ({num_layers})")
    chunk = f.optional_count("attention_chunk_size")
    layers = tuple(LayerParams(**attention,
                               dense_mlp=0 if i in moe_layers else 3 * hidden * dense_width,
                               shared_experts=3 * hidden * expert_width if i in moe_layers else 0,
                               routed_experts=experts * 3 * hidden * expert_width if i in moe_layers else 0,
                               router=experts * hidden if i in moe_layers else 0,
                               chunked=chunk is not None and bool(uses_rope[i]))
                   for i in range(num_layers))
    vocab = f.count("vocab_size")
    step_shape = ws.StepShape(hidden, vocab, heads, kv_heads, head_dim,
                              dense_width if len(moe_layers) < num_layers else 0, experts, top_k, expert_width,
                              expert_width, rope="interleaved", experts_scale_input=True)
    return ModelShape(model_type, "GQA", vocab, hidden, heads, kv_heads, head_dim, 2, tied, layers,
                      dense_width, expert_width, expert_width, experts, top_k, chunk, step_shape)


FAMILIES = {"deepseek_v3": _mla_shape, "kimi_k2": _mla_shape, "kimi_k25": _mla_shape,
            "llama4_text": _llama4_shape, "llama4": _llama4_shape,
            "llama": _llama_qwen_shape, "qwen3": _llama_qwen_shape, "qwen3_moe": _llama_qwen_shape}


# ---------------------------------------------------------------------------------------------
# hardware and layouts


@dataclass(frozen=True)
class Hardware:
    """`count` GPUs of one kind."""
    gpu: str
    count: int
    memory_mib: int  # each GPU's, as CUDA reports it (ember.engine.workspace.GPU_MEMORY_MIB)

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    def __str__(self) -> str:
        return f"{self.gpu}x{self.count}"


def parse_hardware(text: str) -> Hardware:
    """`<GPU>x<N>` (H100x8, h200x2) with GPU one of GPU_MEMORY_MIB."""
    match = re.fullmatch(r"(\w+?)[xX](\d+)", text.strip())
    gpu = match.group(1).upper() if match else None
    if gpu not in GPU_MEMORY_MIB or int(match.group(2)) < 1:
        raise ValueError(f"hardware {text!r} is not <GPU>x<count> with GPU one of {', '.join(GPU_MEMORY_MIB)}")
    return Hardware(gpu, int(match.group(2)), GPU_MEMORY_MIB[gpu])


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int

    def __str__(self) -> str:
        return f"TP={self.tp} PP={self.pp} EP={self.ep}"


def layouts(gpus: int, shape: ModelShape) -> list[Layout]:
    """Every TP x PP = `gpus` with at least one layer a stage; EP 1, and EP = TP when there are experts."""
    found = []
    for tp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        if gpus // tp <= len(shape.layers):
            found += [Layout(tp, gpus // tp, ep) for ep in sorted({1, tp if shape.num_experts else 1})]
    return found


def stages(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges, as even as possible, the first `num_layers % pp` one longer."""
    base, extra = divmod(num_layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _share(n: int, ways: int) -> float:
    """The fullest rank's fraction of n units split `ways` ways."""
    return math.ceil(n / ways) / n if n else 0.0


def _layer_bytes(shape: ModelShape, layer: LayerParams, layout: Layout, dtype: WeightDtype) -> float:
    """The fullest rank's bytes of one layer under `layout`."""
    tp = layout.tp
    experts = _share(shape.num_experts, layout.ep) if layout.ep > 1 else _share(shape.expert_intermediate, tp)
    projections = (layer.attention_by_heads * _share(shape.num_heads, tp)
                   + layer.attention_by_kv_heads * _share(shape.num_kv_heads, tp) + layer.attention_replicated
                   + layer.dense_mlp * _share(shape.dense_intermediate, tp)
                   + layer.shared_experts * _share(shape.shared_intermediate, tp))
    return (projections * dtype.projections + layer.routed_experts * experts * dtype.experts
            + (layer.norms + layer.router) * dtype.other)


def _stage_bytes(shape: ModelShape, stage: range, layout: Layout, dtype: WeightDtype) -> float:
    """One rank's weight bytes in the stage holding layers `stage`."""
    total = sum(_layer_bytes(shape, shape.layers[i], layout, dtype) for i in stage)
    vocab = shape.embedding * _share(shape.vocab_size, layout.tp) * dtype.other
    first, last = stage.start == 0, stage.stop == len(shape.layers)
    lm_head_here = last and not (shape.tied_embeddings and first)  # a tied lm_head shares the embedding's copy
    return total + vocab * (first + lm_head_here) + (shape.hidden_size * dtype.other if last else 0)


def total_weight_bytes(shape: ModelShape, dtype: str) -> float:
    """All of the model's weight bytes at `dtype`, on one GPU."""
    return _stage_bytes(shape, range(len(shape.layers)), Layout(1, 1, 1), WEIGHT_DTYPES[dtype])


def gpus_for_weights(shape: ModelShape, gpu: str, dtype: str) -> int:
    """The fewest GPUs whose whole memory holds the weights alone: a floor no layout beats."""
    return math.ceil(total_weight_bytes(shape, dtype) / (GPU_MEMORY_MIB[gpu] * MIB))


# ---------------------------------------------------------------------------------------------
# plans


@dataclass(frozen=True)
class LayoutPlan:
    """One layout at one weight dtype: what its tightest rank holds and how much context fits."""
    layout: Layout
    dtype: str
    weight_bytes: float  # on the fullest rank
    kv_bytes_per_token: int  # on the rank caching the most per token
    context_tokens: int  # KV-pool tokens that fit, every layer holding each (0: none)
    reason: str | None  # why it does not fit; None when it does
    hybrid_tokens: int | None = None  # chunked attention: context tokens over `sequences` sequences (hybrid KV)
    sequences: int = DEFAULT_SEQUENCES
    capacity_bytes: int = 0  # one GPU's
    runtime_bytes: int = 0  # one GPU's (CUDA context, communicators, allocator slack)
    workspace: ws.Workspace | None = None  # of the tightest rank's step
    kv_pool_bytes: float = 0  # on the tightest rank
    kv_node_bytes: float = 0  # every rank's KV pool, summed
    chunk_window_bytes: float = 0  # hybrid: the chunked layers' windows on the tightest rank
    tightest_weight_bytes: float = 0  # the weights of the rank whose context is least (a stage's: PP)

    @property
    def fits(self) -> bool:
        return self.reason is None

    @property
    def workspace_bytes(self) -> int:
        return self.workspace.peak_bytes if self.workspace else 0

    def as_dict(self) -> dict:
        return {"tp": self.layout.tp, "pp": self.layout.pp, "ep": self.layout.ep, "dtype": self.dtype,
                "weight_bytes_per_rank": round(self.weight_bytes), "capacity_bytes_per_gpu": self.capacity_bytes,
                "runtime_bytes_per_gpu": self.runtime_bytes, "workspace_bytes_per_rank": self.workspace_bytes,
                "workspace_terms": [{"name": t.name, "phase": t.phase, "bytes": t.nbytes, "formula": t.formula}
                                    for t in (self.workspace.terms if self.workspace else ())],
                "kv_pool_bytes_per_rank": round(self.kv_pool_bytes), "kv_pool_bytes_node": round(self.kv_node_bytes),
                "kv_bytes_per_token_per_rank": self.kv_bytes_per_token,
                "context_tokens": self.context_tokens, "hybrid_tokens": self.hybrid_tokens,
                "hybrid_sequences": self.sequences if self.hybrid_tokens is not None else None,
                "fits": self.fits, "reason": self.reason}


@dataclass(frozen=True)
class Budget:
    """How much of each GPU a plan may use, what it must leave, and the engine limits its step has."""
    memory_fraction: float = 1.0  # of what CUDA reports (the engine's memory_utilization; 1: all of it)
    reserve_bytes: float | None = None  # a flat reserve in place of runtime + workspace (None: the model)
    kv_dtype: str = "bf16"
    min_context_tokens: int = DEFAULT_MIN_CONTEXT_TOKENS
    limits: ws.StepLimits = field(default_factory=lambda: ws.StepLimits(cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64)))
    sequences: int = DEFAULT_SEQUENCES  # concurrent sequences for the hybrid-KV figure
    block_size: int = BLOCK_SIZE

    def usable_bytes(self, hardware: Hardware) -> float:
        return hardware.memory_bytes * self.memory_fraction

    def runtime(self, hardware: Hardware) -> tuple[ws.Term, ...]:
        return () if self.reserve_bytes is not None else ws.gpu_runtime(hardware.count)

    def stage_workspace(self, shape: ModelShape, layout: Layout, stage: range) -> ws.Workspace:
        """The step's workspace on a rank of `stage` (a flat reserve, when one is set, stands in for it)."""
        if self.reserve_bytes is not None:
            return ws.Workspace((ws.Term("reserve", int(self.reserve_bytes), f"{self.reserve_bytes / GIB:g} GiB flat",
                                         "beside"),))
        limits = replace(self.limits, tp=layout.tp, ep=layout.ep, first_stage=stage.start == 0,
                         last_stage=stage.stop == len(shape.layers), activation_bytes=2)
        return ws.step_workspace(shape.step, limits)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def plan_layout(shape: ModelShape, hardware: Hardware, layout: Layout, dtype: str, budget: Budget = Budget()
                ) -> LayoutPlan:
    """Weights, workspace, KV per token and the context that fits, on the tightest rank of `layout`."""
    weights_dtype, kv_bytes = WEIGHT_DTYPES[dtype], KV_DTYPE_BYTES[budget.kv_dtype]
    per_layer_kv = shape.kv_values_per_token_layer(layout.tp) * kv_bytes
    capacity = budget.usable_bytes(hardware)
    runtime = sum(t.nbytes for t in budget.runtime(hardware))
    layer_ranges = stages(len(shape.layers), layout.pp)
    window = 0 if shape.chunk_size is None else (budget.sequences * _round_up(shape.chunk_size, budget.block_size)
                                                 + _round_up(budget.limits.max_num_batched_tokens, budget.block_size))
    rows = []  # per stage: (weights, workspace, free, tokens, hybrid, window bytes)
    for stage in layer_ranges:
        stage_weights = _stage_bytes(shape, stage, layout, weights_dtype)
        workspace = budget.stage_workspace(shape, layout, stage)
        free = capacity - runtime - stage_weights - workspace.peak_bytes
        tokens = max(0, int(free // (per_layer_kv * len(stage))))
        chunked = sum(shape.layers[i].chunked for i in stage)
        windows = chunked * per_layer_kv * window
        full = len(stage) - chunked
        hybrid = None if shape.chunk_size is None or full == 0 else \
            max(0, int((free - windows) // (full * per_layer_kv)))
        rows.append((stage_weights, workspace, free, tokens, hybrid, windows))
    tightest = min(range(len(rows)), key=lambda i: (rows[i][3], -rows[i][0]))
    fullest = max(r[0] for r in rows)
    weights, workspace, free, context, _, windows = rows[tightest]
    worst_free = min(r[2] for r in rows)
    if worst_free <= 0:
        w, s = max(rows, key=lambda r: r[0] + r[1].peak_bytes)[:2]
        reason = (f"weights {w / 1e9:.1f} GB + workspace {s.peak_bytes / GIB:.2f} GiB + runtime {runtime / GIB:.2f} "
                  f"GiB > {capacity / GIB:.2f} GiB on a rank")
    elif context < budget.min_context_tokens:
        reason = f"only {context:,} context tokens fit beside the weights (< {budget.min_context_tokens:,})"
    else:
        reason = None
    bounded = [r[4] for r in rows if r[4] is not None]
    hybrid = min(bounded) if bounded and reason is None else None
    node = sum(max(0.0, r[2]) for r in rows) * layout.tp
    return LayoutPlan(layout, dtype, fullest, per_layer_kv * max(map(len, layer_ranges)),
                      context if reason is None else 0, reason, hybrid, budget.sequences, int(capacity), runtime,
                      workspace, max(0.0, free), node, windows, weights)


def plan_memory(shape: ModelShape, hardware: Hardware, dtype: str, budget: Budget = Budget()) -> list[LayoutPlan]:
    """Every layout of `hardware.count` GPUs at weight dtype `dtype`."""
    return [plan_layout(shape, hardware, layout, dtype, budget) for layout in layouts(hardware.count, shape)]


def best(plans: list[LayoutPlan]) -> LayoutPlan | None:
    """The fitting layout with the most context; layouts within 1% of the most count as tied, and
    of those the one with the fewest pipeline stages wins (each stage adds to every token's latency)."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None
    most = max(p.context_tokens for p in fitting)
    return min((p for p in fitting if p.context_tokens >= 0.99 * most), key=lambda p: (p.layout.pp, -p.context_tokens))


def smallest_fit(shape: ModelShape, gpu: str, dtype: str, budget: Budget = Budget(),
                 counts: tuple[int, ...] = GPU_COUNTS_SEARCHED) -> tuple[int, LayoutPlan] | None:
    """The fewest GPUs of kind `gpu` (among `counts`) with a layout that fits, and its best layout."""
    for count in counts:
        found = best(plan_memory(shape, Hardware(gpu, count, GPU_MEMORY_MIB[gpu]), dtype, budget))
        if found is not None:
            return count, found
    return None
