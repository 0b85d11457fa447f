"""The memory a step needs beside the weights and the KV pool, computed from the step's shapes at the
engine's limits (torch-free). One model, two callers: the engine sizes its KV pool with it
(ember.engine.engine) and `ember plan memory` prints it term by term (ember.placement.memory_plan),
so the plan's workspace is the engine's.

What a step holds. The model runs its ops eagerly, layer after layer (the same torch code on CPU
and CUDA), and a layer's temporaries are freed before the next layer runs: the peak is what stays
live through the step (the residual stream and its norm, the rope tables) plus the largest of the
phases: one attention block, one dense-MLP or MoE block, or the logits at the end. A phase's figure
is the sum of the tensors it creates, a slight over-count (a few of them die before the others are
born). Beside that peak, and not reusing it: the captured step's buffers (CPU) or the CUDA-graph
pool (GPU), and the all-reduce buffers of a parallel step. Widths are one rank's: heads, MLP widths
and the vocabulary split TP ways (the fullest rank's share), routed experts whole under EP.

Attention comes in two kinds. "paged": a kernel that reads the paged cache in place and keeps no
score matrix (Ember's C++ CPU kernel and Triton decode; FlashAttention and FlashMLA on a GPU engine,
what Infire and vLLM run). "torch": Ember's torch recipes (ember.engine.attention: SDPA, the
batch-invariant tiles), which gather a prefill chunk's cached context and build its mask, tokens x
context; where q and v differ in width (MLA's absorbed form: 576 against 512) torch's SDPA takes its
math path and holds the scores and their softmax, heads x tokens x context in fp32. "exact": the
batch-invariant bf16 recipe where the C++ kernel does not serve (chunked layers): the context in
fp32 and score tiles of 256 queries x context. Those grow with the context (`context_tokens`: the
engine sizes for max_model_len).

`gpu_runtime` is the other part of a GPU's memory that is neither weights nor KV: the CUDA context,
the collectives' buffers, the allocator's slack; `GPU_MEMORY_MIB` is what CUDA reports a GPU holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MIB, GIB = 1 << 20, 1 << 30

# What CUDA reports as the device's total memory (cudaMemGetInfo's total, torch.cuda.mem_get_info()[1],
# get_device_properties().total_memory), MiB. It is less than nvidia-smi's total (H100 SXM 81,559 MiB,
# H200 143,771 MiB, B200 183,359 MiB, L40S 46,068 MiB): the driver keeps the difference. Sources: public
# printouts of torch's _CudaDeviceProperties (H100 80GB HBM3: 81,082 / 81,089 / 81,090 MiB across drivers;
# H200: 143,156 MiB; B200: 182,631 / 182,642 MiB; L40S: 45,589 MiB; A100-SXM4-80GB: 81,920 MiB) and vLLM's
# memory-profile logs (H100 "total_gpu_memory 79.22GiB", H200 "139.81GiB"). The lowest seen is taken.
GPU_MEMORY_MIB = {"H100": 81_082, "H200": 143_156, "A100": 81_920, "L40S": 45_589, "B200": 182_631}

# A GPU's memory that no tensor of the engine holds, per GPU, stated rather than a fraction:
# - the CUDA context with the kernels' code and cuBLAS/cuBLASLt workspaces: torch's context takes about
#   0.5 GiB on a Hopper GPU, the kernel images and library workspaces loaded by a serving step ~0.5 more;
# - the communicators' buffers when ranks talk (NCCL keeps a few MiB per channel and peer; with NVLS or a
#   custom all-reduce more): vLLM's profile of Llama-3-8B on H100 measured 1.79 GiB of non-torch memory at
#   TP=1 and 3.58 GiB at TP=2 (vllm-project/vllm#10511), so 1 GiB here is a floor, not a ceiling;
# - the caching allocator's slack: blocks rounded up and split segments it keeps but cannot reuse.
CUDA_CONTEXT_BYTES = 1 * GIB
COMMUNICATOR_BYTES = 1 * GIB
ALLOCATOR_SLACK_BYTES = GIB // 2


@dataclass(frozen=True)
class Term:
    """One part of a step's memory: its bytes and the arithmetic that gives them."""
    name: str
    nbytes: int
    formula: str
    phase: str  # "step" (live through the step), "attention", "mlp", "moe", "logits" (one at a time),
    # or "beside" (held apart from the step's peak: captured buffers, collectives)


@dataclass(frozen=True)
class Workspace:
    terms: tuple[Term, ...]

    def phase_bytes(self, phase: str) -> int:
        return sum(t.nbytes for t in self.terms if t.phase == phase)

    @property
    def largest_phase(self) -> str:
        phases = {t.phase for t in self.terms} - {"step", "beside"}
        return max(sorted(phases), key=self.phase_bytes) if phases else "step"

    @property
    def peak_bytes(self) -> int:
        """What the step holds at once: the step's own tensors, its largest phase, and what is held beside."""
        phases = {t.phase for t in self.terms} - {"step", "beside"}
        largest = max((self.phase_bytes(p) for p in phases), default=0)
        return self.phase_bytes("step") + largest + self.phase_bytes("beside")


@dataclass(frozen=True)
class LatentShape:
    """Multi-head Latent Attention's widths (DeepSeek-V3, Kimi K2.5)."""
    q_lora_rank: int  # 0: q is one projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class StepShape:
    """What shapes a step's tensors: the model's widths (whole-model; a rank's share is taken here)."""
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dense_intermediate: int = 0  # the widest dense MLP (0: none)
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    latent: LatentShape | None = None
    qk_norm: bool = False  # Qwen3: q and k normed per head (a copy of both) before rope
    rope: str = "half"  # "half" (rotate-half), "interleaved" (Llama 4's complex form, fp32, then L2 norm)
    router_fp32: bool = False  # DeepSeek-V3's sigmoid router scores a fp32 copy of the input
    experts_scale_input: bool = False  # Llama 4: each dispatched row is scaled (a second copy of the rows)


@dataclass(frozen=True)
class StepLimits:
    """The engine's limits that size a step, and the layout of the rank it runs on."""
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    speculative_tokens: int = 0  # a verify step samples 1 + this many rows per sequence
    activation_bytes: int = 2  # bf16 (fp32: 4)
    tp: int = 1
    ep: int = 1
    first_stage: bool = True  # the embedding runs here
    last_stage: bool = True  # the logits are computed here
    device: str = "cuda"
    cuda_graph_sizes: tuple[int, ...] = ()  # decode steps captured as CUDA graphs: their private pool
    cpu_captured_sizes: tuple[int, ...] = ()  # Ember's captured CPU step (ember.kernels.cpu_step): its buffers
    attention: str = "paged"  # "paged", "torch" or "exact" (module docstring)
    context_tokens: int = 0  # "torch": the longest context a prefill chunk attends to (its own tokens included)
    kv_cache_bytes: int = 2  # the cache's element size (what a gather copies)
    chunked: bool = False  # chunked local attention (Llama 4): the torch recipe's mask is a second bool matrix
    extra: tuple[Term, ...] = field(default=())

    @property
    def logit_rows(self) -> int:
        """Rows sampled in one step at most: one per sequence (1 + drafts in a verify step)."""
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.speculative_tokens))


def _share(n: int, ways: int) -> int:
    return -(-n // ways) if n else 0


def _gib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB" if n < GIB else f"{n / GIB:,.2f} GiB"


def step_workspace(shape: StepShape, limits: StepLimits) -> Workspace:
    """The step's memory at `limits` on the fullest rank, term by term (see the module docstring)."""
    t, b, h = limits.max_num_batched_tokens, limits.activation_bytes, shape.hidden_size
    terms: list[Term] = []

    def add(name: str, nbytes: int, formula: str, phase: str) -> None:
        if nbytes > 0:
            terms.append(Term(name, int(nbytes), f"{formula} = {_gib(nbytes)}", phase))

    add("residual stream and its norm", 2 * t * h * b, f"2 x {t} tokens x {h} hidden x {b} B", "step")
    rope_dim = shape.latent.qk_rope_head_dim if shape.latent else shape.head_dim
    add("rope tables", 2 * t * rope_dim * 4, f"cos, sin: 2 x {t} x {rope_dim} x 4 B", "step")
    _attention(terms, add, shape, limits)
    if shape.dense_intermediate:
        width = _share(shape.dense_intermediate, limits.tp)
        add("MLP gate_up", t * 2 * width * b, f"{t} x 2 x {width} intermediate/rank x {b} B", "mlp")
        add("MLP silu(gate), product", t * 2 * width * b, f"2 x {t} x {width} x {b} B", "mlp")
        add("MLP down output", t * h * b, f"{t} x {h} x {b} B", "mlp")
    if shape.num_experts:
        _moe(add, shape, limits)
    if limits.last_stage:
        _logits(add, shape, limits)
    _beside(add, shape, limits)
    terms.extend(limits.extra)
    return Workspace(tuple(terms))


def _attention(terms, add, shape: StepShape, limits: StepLimits) -> None:
    t, b = limits.max_num_batched_tokens, limits.activation_bytes
    heads = _share(shape.num_heads, limits.tp)
    if shape.latent is not None:
        m = shape.latent
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            add("MLA q_a and its norm", 2 * t * m.q_lora_rank * b, f"2 x {t} x {m.q_lora_rank} q_lora x {b} B",
                "attention")
        add("MLA q", t * heads * qk * b, f"{t} x {heads} heads/rank x {qk} x {b} B", "attention")
        latent = m.kv_lora_rank + m.qk_rope_head_dim
        add("MLA kv_a, latent norm", t * (latent + m.kv_lora_rank) * b,
            f"{t} x ({latent} + {m.kv_lora_rank}) x {b} B", "attention")
        add("MLA rope temporaries", 4 * t * (heads + 1) * m.qk_rope_head_dim * b,
            f"4 x {t} x ({heads} + 1) heads x {m.qk_rope_head_dim} x {b} B", "attention")
        add("MLA absorbed query", t * heads * (m.kv_lora_rank + latent) * b,
            f"{t} x {heads} x ({m.kv_lora_rank} + {latent}) x {b} B", "attention")
        add("MLA attention output, values", t * heads * (m.kv_lora_rank + m.v_head_dim) * b,
            f"{t} x {heads} x ({m.kv_lora_rank} + {m.v_head_dim}) x {b} B", "attention")
        kv_heads, kv_dim, planes = 1, latent, 1
    else:
        d, kv_heads = shape.head_dim, _share(shape.num_kv_heads, limits.tp)
        q, kv = heads * d, kv_heads * d
        add("q, k, v", t * (q + 2 * kv) * b, f"{t} x ({heads} + 2 x {kv_heads}) heads/rank x {d} x {b} B",
            "attention")
        if shape.qk_norm:
            add("q, k normed", t * (q + kv) * b, f"{t} x ({heads} + {kv_heads}) x {d} x {b} B", "attention")
        if shape.rope == "interleaved":  # complex product and L2 norm in fp32: ~4 fp32 copies of q and k
            add("rope, L2-norm temporaries (fp32)", 4 * t * (q + kv) * 4,
                f"4 x {t} x ({heads} + {kv_heads}) x {d} x 4 B", "attention")
        else:  # the rotated copy, x cos, rotated sin and their sum
            add("rope temporaries", 4 * t * (q + kv) * b, f"4 x {t} x ({heads} + {kv_heads}) x {d} x {b} B",
                "attention")
        add("attention output", t * q * b, f"{t} x {heads} x {d} x {b} B", "attention")
        kv_dim, planes = d, 2
    add("o_proj output", t * shape.hidden_size * b, f"{t} x {shape.hidden_size} x {b} B", "attention")
    if limits.attention in ("torch", "exact") and limits.context_tokens:
        c, cb = limits.context_tokens, limits.kv_cache_bytes
        add("context gather", planes * c * kv_heads * kv_dim * cb,
            f"{planes} planes x {c} context x {kv_heads} x {kv_dim} x {cb} B", "attention")
    if limits.attention == "exact" and limits.context_tokens:
        c, d = -(-limits.context_tokens // 128) * 128, kv_dim
        rows = min(t, 256) * (heads // kv_heads)  # a tile's query rows: 256 tokens x the group
        add("context as fp32 heads", planes * c * kv_heads * d * 4, f"{planes} x {c} x {kv_heads} x {d} x 4 B",
            "attention")
        add("queries grouped fp32, output", 2 * t * heads * d * 4, f"2 x {t} x {heads} x {d} x 4 B", "attention")
        add("score tile, softmax, mask", kv_heads * rows * c * 8 + rows * c,
            f"{kv_heads} x {rows} rows x {c} x (2 x 4) B + {rows} x {c} B", "attention")
        add("block partials and their sum", 2 * kv_heads * (c // 128) * rows * d * 4,
            f"2 x {kv_heads} x {c // 128} blocks x {rows} x {d} x 4 B", "attention")
        return
    if limits.attention == "torch" and limits.context_tokens:
        c, masks = limits.context_tokens, 2 if limits.chunked else 1
        add("mask, bool and as fp32", t * c * (masks + 4), f"{t} x {c} x ({masks} + 4) B", "attention")
        if shape.latent is not None:  # SDPA's math path: scores and softmax, fp32
            add("scores, softmax (SDPA math path)", 2 * heads * t * c * 4, f"2 x {heads} x {t} x {c} x 4 B",
                "attention")


def _moe(add, shape: StepShape, limits: StepLimits) -> None:
    t, b, h, k = limits.max_num_batched_tokens, limits.activation_bytes, shape.hidden_size, shape.top_k
    rows = t * k
    if shape.router_fp32:
        add("router input fp32, scores", t * (h + 2 * shape.num_experts) * 4,
            f"{t} x ({h} + 2 x {shape.num_experts} experts) x 4 B", "moe")
    else:
        add("router scores", t * 2 * shape.num_experts * 4, f"{t} x 2 x {shape.num_experts} x 4 B", "moe")
    copies = 2 if shape.experts_scale_input else 1
    add("MoE dispatch rows", copies * rows * h * b,
        f"{copies} x {t} tokens x {k} top_k x {h} x {b} B", "moe")
    add("MoE expert outputs, slots, weighted", 3 * rows * h * b, f"3 x {t} x {k} x {h} x {b} B", "moe")
    width = shape.expert_intermediate if limits.ep > 1 else _share(shape.expert_intermediate, limits.tp)
    busiest = t  # an expert is picked by a token at most once: the busiest takes every token
    add("MoE busiest expert's gate_up, silu, product", busiest * 4 * width * b,
        f"{busiest} rows x 4 x {width} intermediate x {b} B", "moe")
    if shape.shared_intermediate:
        shared = _share(shape.shared_intermediate, limits.tp)
        add("shared expert", t * (4 * shared + h) * b, f"{t} x (4 x {shared} + {h}) x {b} B", "moe")
    add("MoE combined output", 2 * t * h * b, f"2 x {t} x {h} x {b} B", "moe")


def _logits(add, shape: StepShape, limits: StepLimits) -> None:
    t, b, h = limits.max_num_batched_tokens, limits.activation_bytes, shape.hidden_size
    rows, vocab = limits.logit_rows, _share(shape.vocab_size, limits.tp)
    add("final norm", t * h * b, f"{t} x {h} x {b} B", "logits")
    add("sampled rows", rows * h * b, f"{rows} rows x {h} x {b} B", "logits")
    copies = 1 if b == 4 else 2  # lm_head's output, then its fp32 copy
    add("logits", rows * vocab * (b + 4 if copies == 2 else 4),
        f"{rows} rows x {vocab} vocab/rank x ({b} + 4 fp32) B" if copies == 2 else
        f"{rows} rows x {vocab} vocab/rank x 4 B", "logits")
    add("sampling (a row at a time)", 3 * shape.vocab_size * 4, f"3 x {shape.vocab_size} x 4 B", "logits")


def _beside(add, shape: StepShape, limits: StepLimits) -> None:
    t, b, h = limits.max_num_batched_tokens, limits.activation_bytes, shape.hidden_size
    if limits.tp > 1:
        add("all-reduce buffer", t * h * b, f"{t} x {h} x {b} B", "beside")
    if shape.num_experts and (limits.tp > 1 or limits.ep > 1):
        add("MoE slots all-reduce", t * shape.top_k * h * b, f"{t} x {shape.top_k} x {h} x {b} B", "beside")
    if limits.cuda_graph_sizes:
        size = max(limits.cuda_graph_sizes)
        graph = step_workspace(shape, StepLimits(size, min(size, limits.max_num_seqs), 0, b, limits.tp, limits.ep,
                                                 limits.first_stage, False, limits.device))
        add("CUDA-graph pool", graph.peak_bytes, f"the step's activations at {size} tokens (its largest graph)",
            "beside")
    if limits.cpu_captured_sizes:
        d, heads, kv_heads = shape.head_dim, shape.num_heads, shape.num_kv_heads
        per_row = h + (heads + 2 * kv_heads) * d + 2 * heads * d + 3 * shape.dense_intermediate
        total = sum(limits.cpu_captured_sizes)
        add("captured step buffers", total * per_row * 2,
            f"{total} rows over the buckets x {per_row} values x 2 B", "beside")


def gpu_runtime(ranks: int) -> tuple[Term, ...]:
    """A GPU's memory held outside the engine's tensors (see the constants above)."""
    terms = [Term("CUDA context, kernels, cuBLAS workspaces", CUDA_CONTEXT_BYTES, _gib(CUDA_CONTEXT_BYTES), "runtime")]
    if ranks > 1:
        terms.append(Term("communicators (NCCL)", COMMUNICATOR_BYTES, _gib(COMMUNICATOR_BYTES), "runtime"))
    terms.append(Term("allocator slack", ALLOCATOR_SLACK_BYTES, _gib(ALLOCATOR_SLACK_BYTES), "runtime"))
    return tuple(terms)


def step_shape_of(args) -> StepShape:
    """The StepShape of an ember.model.args.ModelArgs (read by attribute: no import of the model)."""
    moe, mla = args.moe, args.mla
    dense = moe is None or not all(moe.layers)
    latent = None if mla is None else LatentShape(mla.q_lora_rank or 0, mla.kv_lora_rank, mla.qk_nope_head_dim,
                                                  mla.qk_rope_head_dim, mla.v_head_dim)
    return StepShape(args.hidden_size, args.vocab_size, args.num_heads, args.num_kv_heads, args.head_dim,
                     dense_intermediate=args.intermediate_size if dense else 0,
                     num_experts=moe.num_experts if moe else 0, top_k=moe.top_k if moe else 0,
                     expert_intermediate=moe.intermediate_size if moe else 0,
                     shared_intermediate=moe.shared_intermediate_size if moe else 0, latent=latent,
                     qk_norm=args.qk_norm, rope="interleaved" if args.rope_interleave else "half",
                     router_fp32=bool(moe and moe.router == "sigmoid"),
                     experts_scale_input=bool(moe and moe.router == "llama4"))


def engine_workspace(args, config, max_model_len: int) -> Workspace:
    """The workspace an engine (ember.engine.config.EngineConfig `config`, model `args`) sizes its KV pool
    around: its limits and activation dtype; its attention's kind (the C++ kernel reads the cache in place;
    the torch recipes, which serve fp32, MLA and chunked attention and every prefill on CUDA, are sized for a
    chunk against max_model_len); on CPU the captured step's buffers."""
    cpu = config.device == "cpu"
    chunked = bool(args.attention_chunks and any(args.attention_chunks))
    if cpu and config.attention_backend == "cpp" and args.mla is None and not chunked:
        attention = "paged"  # the C++ kernel reads the cache in place
    elif cpu and config.dtype != "float32" and args.mla is None:
        attention = "exact"  # the batch-invariant torch recipe (chunked layers: the kernel does not mask them)
    else:
        attention = "torch"  # SDPA: the fp32 reference path, MLA, and every prefill on CUDA
    captured = (cpu and config.weights == "q4" and args.family == "llama" and not config.enforce_eager
                and config.optimize and args.moe is None and args.mla is None)
    batch_invariant = cpu and config.dtype != "float32" and config.attention_backend != "triton"  # (as the engine)
    speculative = config.speculative_tokens if config.speculative_tokens is not None else 3 * batch_invariant
    limits = StepLimits(config.max_num_batched_tokens, config.max_num_seqs, speculative,
                        4 if config.dtype == "float32" else 2, device=config.device,
                        cpu_captured_sizes=tuple(config.capture_sizes) if captured else (),
                        attention=attention, context_tokens=max_model_len,
                        kv_cache_bytes=4 if config.dtype == "float32" else 2, chunked=chunked)
    return step_workspace(step_shape_of(args), limits)


def describe(workspace: Workspace) -> list[str]:
    """The terms as lines, grouped by phase, the peak last."""
    lines = []
    for phase in ("step", "attention", "mlp", "moe", "logits", "beside"):
        terms = [t for t in workspace.terms if t.phase == phase]
        if not terms:
            continue
        lines.append(f"  {phase}: {_gib(workspace.phase_bytes(phase))}")
        lines += [f"    {t.name}: {t.formula}" for t in terms]
    lines.append(f"  peak = step + largest phase ({workspace.largest_phase}) + beside = {_gib(workspace.peak_bytes)}")
    return lines
