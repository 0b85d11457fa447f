"""Parallel shard maths, torch-free. Tensor parallelism (Megatron style): which heads, MLP columns and vocabulary
rows each rank owns, and which slice of each checkpoint tensor that is.

- Attention is split by KV group: a rank owns whole groups (its KV heads and all their query
  heads), so grouped-query attention needs no communication. QKV is column-parallel (the rank's
  rows of q/k/v), o_proj row-parallel (the rank's input columns), then one all-reduce.
- When the degree exceeds the KV heads (SmolLM2: 3 KV heads, TP = 9), each rank takes an equal
  share of one group's query heads and a replica of that group's KV head.
- When groups do not divide evenly (TP = 2 over 3 groups), ranks get whole groups as evenly as
  possible and the MLP's columns (gate/up column-parallel, down row-parallel, one all-reduce)
  even out the difference: each rank's cost is as equal as `ALIGN`-column steps allow. The cost of
  a KV group and of `ALIGN` MLP columns is measured when the engine starts
  (tensor_parallel.measure_costs: at decode, attention's share is more than its weights, as it also
  reads the group's KV); without a measurement, the weights a token reads stand in for it.
- The embedding and the (tied) output layer are vocab-parallel: a rank holds a contiguous range of
  rows; lookups outside it give zeros (then one all-reduce), logits are gathered to the driver.

The other families (`plan_family`) split the same way where their parts are the same (grouped-query
attention, dense MLPs, the vocabulary) and by their own parts elsewhere, as vLLM and SGLang do:
- Latent attention (DeepSeek-V3, Kimi K2.5): the query heads split evenly (q_b_proj / q_proj rows and
  kv_b_proj's W_UK / W_UV per head, o_proj's input columns per head, then one all-reduce); q_a_proj,
  kv_a_proj and their norms are replicated, and so is the latent cache: every rank computes and keeps
  the whole (kv_lora_rank + rope) row of every token, so a block is whole-model on every rank.
- Mixture of experts: every routed expert and the shared expert split by width (gate/up rows, down
  input columns); a rank's slots and its shared expert's output are partial sums, combined locally in
  the fixed slot order and all-reduced once. With expert parallelism inside the group
  (`expert_parallel` = the degree) each rank holds whole experts instead (`local_experts`). The
  router is replicated. Widths are split evenly (in steps of ALIGN where they allow): measured
  balancing is the Llama family's (its uneven KV groups).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ember.model.args import ModelArgs

ALIGN = 64  # MLP columns move between ranks in steps of this (int4 groups of 32, kernel quads of 64)


@dataclass(frozen=True)
class RankShard:
    rank: int
    degree: int
    q_heads: tuple[int, int]  # [first, last) global query heads
    kv_heads: tuple[int, int]  # [first, last) global KV heads (a replica when shared with other ranks)
    columns: tuple[int, int]  # [first, last) of the MLP's intermediate columns
    vocab: tuple[int, int]  # [first, last) rows of the embedding / output layer
    # a mixture of experts (plan_family; None: no MoE): [first, last) of each routed expert's columns and
    # of the shared expert's; with expert parallelism inside the group, the whole experts this rank holds
    expert_columns: tuple[int, int] | None = None
    shared_columns: tuple[int, int] | None = None
    local_experts: tuple[int, int] | None = None

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The shape of this rank's part of the model. (For latent attention `kv_heads` counts the
        cache's one latent "head", held whole by every rank; num_kv_heads is not used there.)"""
        moe = args.moe
        if moe is not None and self.expert_columns is not None:
            moe = replace(moe, intermediate_size=_width(self.expert_columns),
                          shared_intermediate_size=_width(self.shared_columns) if self.shared_columns else 0,
                          local_experts=self.local_experts)
        return replace(args, num_heads=_width(self.q_heads),
                       num_kv_heads=args.num_kv_heads if args.mla is not None else _width(self.kv_heads),
                       intermediate_size=_width(self.columns), vocab_size=_width(self.vocab), moe=moe)


def _width(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    """[0, total) into `parts` contiguous ranges, sizes differing by at most one (bigger first)."""
    bounds = [total * i // parts for i in range(parts + 1)]
    sizes = sorted((bounds[i + 1] - bounds[i] for i in range(parts)), reverse=True)
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def attention_params(args: ModelArgs, q_heads: int, kv_heads: int) -> int:
    """Weights a token reads in q/k/v/o for this many heads."""
    return (2 * q_heads + 2 * kv_heads) * args.head_dim * args.hidden_size


def mlp_params(args: ModelArgs, columns: int) -> int:
    return 3 * columns * args.hidden_size


@dataclass(frozen=True)
class ShardCosts:
    """What a step costs a rank (any unit): per KV group (its query heads, attention and projections),
    and per ALIGN columns of the MLP."""
    group: float
    mlp_step: float

    @staticmethod
    def by_weights(args: ModelArgs) -> ShardCosts:
        group = args.num_heads // args.num_kv_heads
        return ShardCosts(attention_params(args, group, 1), mlp_params(args, ALIGN))


def plan(args: ModelArgs, degree: int, costs: ShardCosts | None = None, expert_parallel: int = 1
         ) -> list[RankShard]:
    """Every rank's shard at tensor-parallel `degree`, balanced by `costs` (None: by the weights a
    token reads; a latent-attention or mixture-of-experts model splits evenly, `plan_family`, where
    `expert_parallel` may spread whole experts over the ranks). Raises ValueError for a degree that
    cannot split this model (its reason in the message)."""
    if degree < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {degree}")
    if args.mla is not None or args.moe is not None:
        return plan_family(args, degree, expert_parallel)
    if expert_parallel > 1:
        plan_experts(args, expert_parallel)  # (refuses a dense model by name)
    q_ranges, kv_ranges = _gqa_heads(args, degree)
    if args.intermediate_size % ALIGN:
        raise ValueError(f"intermediate size {args.intermediate_size} is not a multiple of {ALIGN}")
    if degree > args.intermediate_size // ALIGN:
        raise ValueError(f"tensor_parallel {degree} exceeds the {args.intermediate_size // ALIGN} steps of {ALIGN} "
                         "MLP columns every rank needs one of")
    costs = costs or ShardCosts.by_weights(args)
    group = args.num_heads // args.num_kv_heads
    attention = [costs.group * (b - a) / group for a, b in q_ranges]
    columns = _balanced_columns(attention, costs.mlp_step, args.intermediate_size // ALIGN)
    vocab = _split(args.vocab_size, degree)
    return [RankShard(r, degree, q_ranges[r], kv_ranges[r], columns[r], vocab[r]) for r in range(degree)]


def _gqa_heads(args: ModelArgs, degree: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Each rank's query heads and KV heads: whole KV groups, or (degree > KV heads) an equal share of
    one group's query heads with a replica of its KV head."""
    heads, kv, group = args.num_heads, args.num_kv_heads, args.num_heads // args.num_kv_heads
    if degree <= kv:
        kv_ranges = _split(kv, degree)
        return [(a * group, b * group) for a, b in kv_ranges], kv_ranges
    if degree % kv or group % (degree // kv):
        raise ValueError(f"tensor_parallel {degree} does not split {heads} query heads in {kv} KV groups: "
                         f"use a divisor of {kv}, or a multiple of {kv} that divides {heads}")
    per = heads // degree
    q_ranges = [(r * per, (r + 1) * per) for r in range(degree)]
    return q_ranges, [(a // group, a // group + 1) for a, _ in q_ranges]


def _split_width(total: int, parts: int, what: str) -> list[tuple[int, int]]:
    """[0, total) columns into `parts` contiguous ranges as even as steps of ALIGN allow (of the largest
    power of two under it that divides `total` into at least `parts` steps, for narrow experts)."""
    step = ALIGN
    while step > 1 and (total % step or total // step < parts):
        step //= 2
    if total < parts:
        raise ValueError(f"tensor_parallel {parts} exceeds the {total} columns of {what}")
    return [(a * step, b * step) for a, b in _split(total // step, parts)]


def plan_family(args: ModelArgs, degree: int, expert_parallel: int = 1) -> list[RankShard]:
    """Every rank's shard of a latent-attention or mixture-of-experts model at tensor-parallel `degree`
    (the module docstring says how each part splits). expert_parallel: 1, or `degree` for whole experts
    spread over the group's ranks (EP inside the TP group) in place of every expert split by width."""
    if args.mla is not None:
        if degree > args.num_heads:
            raise ValueError(f"tensor_parallel {degree} exceeds the model's {args.num_heads} attention heads")
        q_ranges = _split(args.num_heads, degree)
        kv_ranges = [(0, args.kv_cache_heads)] * degree  # the latent cache, whole on every rank
    else:
        q_ranges, kv_ranges = _gqa_heads(args, degree)
    columns = _split_width(args.intermediate_size, degree, "the dense MLP")
    vocab = _split(args.vocab_size, degree)
    moe = args.moe
    experts, shared, local = [None] * degree, [None] * degree, [None] * degree
    if moe is not None:
        if expert_parallel not in (1, degree):
            raise ValueError(f"expert_parallel {expert_parallel} inside tensor_parallel {degree}: the experts "
                             f"spread over the tensor-parallel ranks, so expert_parallel must be 1 or {degree}")
        if expert_parallel > 1:
            local = plan_experts(args, expert_parallel)
            local = [s.experts for s in local]
            experts = [(0, moe.intermediate_size)] * degree
        else:
            experts = _split_width(moe.intermediate_size, degree, "a routed expert")
        if moe.shared_intermediate_size:
            shared = _split_width(moe.shared_intermediate_size, degree, "the shared expert")
    elif expert_parallel > 1:
        plan_experts(args, expert_parallel)  # (refuses a dense model by name)
    return [RankShard(r, degree, q_ranges[r], kv_ranges[r], columns[r], vocab[r], experts[r], shared[r], local[r])
            for r in range(degree)]


def _balanced_columns(attention: list[float], per_step: float, steps: int) -> list[tuple[int, int]]:
    """MLP columns per rank (`steps` of ALIGN in all) so that attention + MLP costs are as equal as
    ALIGN steps allow."""
    degree = len(attention)
    target = (sum(attention) + steps * per_step) / degree
    # every rank keeps at least one step: a rank with no MLP columns would need a zero-width MLP
    counts = [max(1, round((target - a) / per_step)) for a in attention]
    while sum(counts) > steps:  # take from the heaviest rank that has more than one, give to the lightest
        heavy = max((r for r in range(degree) if counts[r] > 1),
                    key=lambda r: (attention[r] + counts[r] * per_step, -r))
        counts[heavy] -= 1
    while sum(counts) < steps:
        light = min(range(degree), key=lambda r: (attention[r] + counts[r] * per_step, r))
        counts[light] += 1
    out, start = [], 0
    for c in counts:
        out.append((start, start + c * ALIGN))
        start += c * ALIGN
    return out


def rank_cost(args: ModelArgs, shard: RankShard, costs: ShardCosts) -> float:
    """A rank's cost under `costs` (per layer)."""
    group = args.num_heads // args.num_kv_heads
    return costs.group * (shard.q_heads[1] - shard.q_heads[0]) / group \
        + costs.mlp_step * (shard.columns[1] - shard.columns[0]) / ALIGN


def rank_params(args: ModelArgs, shard: RankShard) -> int:
    """Weights a token reads on this rank in its decoder layers."""
    local = shard.local_args(args)
    return args.num_layers * (attention_params(args, local.num_heads, local.num_kv_heads)
                              + mlp_params(args, local.intermediate_size))


Span = tuple[int, int]  # [first, last)


@dataclass(frozen=True)
class TensorPart:
    """What a rank reads of one checkpoint tensor: `pieces`, each a span per leading dimension (None:
    all of it; dimensions past the tuple whole), joined along `dim` (a stacked gate/up tensor's rank
    part is its gate columns and its up columns, two pieces)."""
    pieces: tuple[tuple[Span | None, ...], ...]
    dim: int = 0

    @staticmethod
    def of(*spans: Span | None) -> TensorPart:
        return TensorPart((tuple(spans),))


WHOLE = TensorPart(((),))


def tensor_part(name: str, args: ModelArgs, shard: RankShard) -> TensorPart | None:
    """The part of the Hugging Face checkpoint tensor `name` (without a wrapper's `weights_prefix`) a
    rank reads; None: none of it (another rank's expert under expert parallelism). Per-layer names are
    matched on what follows the layer's attention or MLP prefix."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return TensorPart.of(shard.vocab)
    attention, mlp = ".self_attn.", f".{args.mlp_name}."
    if attention in name:
        return _attention_part(name.split(attention, 1)[1], args, shard)
    if mlp in name:
        return _mlp_part(name.split(mlp, 1)[1], args, shard)
    return WHOLE  # norms: whole on every rank


def _attention_part(rest: str, args: ModelArgs, shard: RankShard) -> TensorPart:
    a, b = shard.q_heads
    m = args.mla
    if m is not None:  # latent attention: per head rows of the query and kv_b_proj, o_proj's columns
        if rest in ("q_b_proj.weight", "q_proj.weight"):
            return TensorPart.of((a * m.qk_head_dim, b * m.qk_head_dim))
        if rest == "kv_b_proj.weight":
            per = m.qk_nope_head_dim + m.v_head_dim
            return TensorPart.of((a * per, b * per))
        if rest == "o_proj.weight":
            return TensorPart.of(None, (a * m.v_head_dim, b * m.v_head_dim))
        return WHOLE  # q_a_proj, kv_a_proj_with_mqa, their norms: replicated
    d = args.head_dim
    if rest == "q_proj.weight":
        return TensorPart.of((a * d, b * d))
    if rest in ("k_proj.weight", "v_proj.weight"):
        return TensorPart.of((shard.kv_heads[0] * d, shard.kv_heads[1] * d))
    if rest == "o_proj.weight":
        return TensorPart.of(None, (a * d, b * d))
    return WHOLE  # q_norm / k_norm (per head_dim)


def _mlp_part(rest: str, args: ModelArgs, shard: RankShard) -> TensorPart | None:
    """A dense MLP's, a shared expert's or a routed expert's part: gate/up rows, down's input columns."""
    parts = rest.split(".")
    if parts[0] in ("shared_experts", "shared_expert"):
        return _linear_part(parts[-2], shard.shared_columns)
    if parts[0] != "experts":
        return _linear_part(parts[0], shard.columns)  # a dense MLP (or the router: not a projection)
    experts, columns = shard.local_experts, shard.expert_columns
    if parts[1].isdigit():  # one expert's own tensors
        if experts is not None and not experts[0] <= int(parts[1]) < experts[1]:
            return None
        return _linear_part(parts[2], columns)
    width = args.moe.intermediate_size
    whole = columns is None or columns == (0, width)
    # Llama 4 stacks them x @ w, [E, H, 2I] / [E, I, H]; the others as F.linear rows, [E, 2I, H] / [E, H, I]
    x_at_w = args.moe.router == "llama4"
    if parts[1] == "gate_up_proj":
        if whole:
            return TensorPart.of(experts)
        gate, up = columns, (width + columns[0], width + columns[1])
        if x_at_w:
            return TensorPart(((experts, None, gate), (experts, None, up)), dim=2)
        return TensorPart(((experts, gate), (experts, up)), dim=1)
    if parts[1] == "down_proj":
        if whole:
            return TensorPart.of(experts)
        return TensorPart.of(experts, columns) if x_at_w else TensorPart.of(experts, None, columns)
    return TensorPart.of(experts)  # (another stacked tensor of the experts)


def _linear_part(projection: str, columns: Span | None) -> TensorPart:
    if columns is None or projection not in ("gate_proj", "up_proj", "down_proj"):
        return WHOLE
    return TensorPart.of(None, columns) if projection == "down_proj" else TensorPart.of(columns)


def tensor_slice(name: str, args: ModelArgs, shard: RankShard) -> tuple[Span | None, Span | None]:
    """(rows, columns) of a 2-D checkpoint tensor a rank takes, each a [first, last) or None for all
    (tensor_part's single piece; the int4 path slices the GGUF's codes with it)."""
    top = args.weights_prefix
    part = tensor_part(name[len(top):] if top and name.startswith(top) else name, args, shard)
    [piece] = part.pieces
    rows, cols = (tuple(piece) + (None, None))[:2]
    return rows, cols


@dataclass(frozen=True)
class ExpertShard:
    """One expert-parallel rank's part: [first, last) of every MoE layer's routed experts, and all
    of everything else."""
    rank: int
    degree: int
    experts: tuple[int, int]

    def local_args(self, args: ModelArgs) -> ModelArgs:
        return replace(args, moe=replace(args.moe, local_experts=self.experts))

    def reads(self, name: str) -> bool:
        """False for another rank's expert stored on its own (`...experts.{e}.gate_proj.weight`)."""
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part == "experts" and parts[i + 1].isdigit():
                return self.experts[0] <= int(parts[i + 1]) < self.experts[1]
        return True

    def stacked_rows(self, name: str) -> tuple[int, int] | None:
        """This rank's rows of a stacked expert tensor (`experts.gate_up_proj`, [E, ...]); None: all."""
        return self.experts if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else None


def plan_experts(args: ModelArgs, degree: int) -> list[ExpertShard]:
    """The routed experts over `degree` ranks, contiguous, sizes differing by at most one (bigger first)."""
    if args.moe is None or not any(args.moe.layers):
        raise ValueError(f"expert_parallel {degree} needs a mixture-of-experts model; this {args.family} "
                         "model is dense")
    if degree > args.moe.num_experts:
        raise ValueError(f"expert_parallel {degree} exceeds the model's {args.moe.num_experts} routed experts")
    return [ExpertShard(r, degree, span) for r, span in enumerate(_split(args.moe.num_experts, degree))]
