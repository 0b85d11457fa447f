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

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The shape of this rank's part of the model."""
        return replace(args, num_heads=self.q_heads[1] - self.q_heads[0],
                       num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                       intermediate_size=self.columns[1] - self.columns[0], vocab_size=self.vocab[1] - self.vocab[0])


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


def plan(args: ModelArgs, degree: int, costs: ShardCosts | None = None) -> list[RankShard]:
    """Every rank's shard at tensor-parallel `degree`, balanced by `costs` (None: by the weights a
    token reads). Raises ValueError for a degree that cannot split this model (its reason in the
    message)."""
    if degree < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {degree}")
    heads, kv, group = args.num_heads, args.num_kv_heads, args.num_heads // args.num_kv_heads
    if degree <= kv:
        kv_ranges = _split(kv, degree)
        q_ranges = [(a * group, b * group) for a, b in kv_ranges]
    else:
        if degree % kv or group % (degree // kv):
            raise ValueError(f"tensor_parallel {degree} does not split {heads} query heads in {kv} KV groups: "
                             f"use a divisor of {kv}, or a multiple of {kv} that divides {heads}")
        per = heads // degree
        q_ranges = [(r * per, (r + 1) * per) for r in range(degree)]
        kv_ranges = [(a // group, a // group + 1) for a, _ in q_ranges]
    if args.intermediate_size % ALIGN:
        raise ValueError(f"intermediate size {args.intermediate_size} is not a multiple of {ALIGN}")
    if degree > args.intermediate_size // ALIGN:
        raise ValueError(f"tensor_parallel {degree} exceeds the {args.intermediate_size // ALIGN} steps of {ALIGN} "
                         "MLP columns every rank needs one of")
    costs = costs or ShardCosts.by_weights(args)
    attention = [costs.group * (b - a) / group for a, b in q_ranges]
    columns = _balanced_columns(attention, costs.mlp_step, args.intermediate_size // ALIGN)
    vocab = _split(args.vocab_size, degree)
    return [RankShard(r, degree, q_ranges[r], kv_ranges[r], columns[r], vocab[r]) for r in range(degree)]


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


# What slice of each Hugging Face checkpoint tensor a rank takes: (rows, columns), each a
# [first, last) range or None for all. Per layer names are matched on their suffix.
def tensor_slice(name: str, args: ModelArgs, shard: RankShard) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    d = args.head_dim
    q = (shard.q_heads[0] * d, shard.q_heads[1] * d)
    kv = (shard.kv_heads[0] * d, shard.kv_heads[1] * d)
    if name.endswith("self_attn.q_proj.weight"):
        return q, None
    if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        return kv, None
    if name.endswith("self_attn.o_proj.weight"):
        return None, q
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return shard.columns, None
    if name.endswith("mlp.down_proj.weight"):
        return None, shard.columns
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return shard.vocab, None
    return None, None  # norms: whole on every rank


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
