"""A pipeline-parallel engine: its decoder layers split into stages, each a process (ember.parallel.group:
stage 0 is the driver, which also embeds; the last stage applies the final norm and the output
layer). Only the driver schedules, hashes and samples. A step's sequences are split into
micro-batches of disjoint sequences; the driver runs stage 0 of each and sends its hidden states on,
so while stage 1 works on micro-batch 1 the driver computes micro-batch 2; the last stage sends each
micro-batch's logits back to the driver.

The partition comes from a measured cost profile (`measure_costs`: the embedding, one decoder layer,
and the norm + output layer, timed at the decode batch size on random weights of the model's
shape): the contiguous split that minimises the slowest stage (`partition`). The output layer
weighs several layers at decode, so the last stage gets fewer layers. `engine.pipeline_partition`
forces a split.

KV blocks stay whole-model: each stage holds its layers of every block, an export gathers them
(tensor_parallel.ShardedKVCache), an import hands the block to every stage (from the kvstore's shared
memory when it lies there), which takes its layers.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ember.engine.device import rank_device
from ember.engine.kv_cache import PagedKVCache
from ember.engine.model_runner import ModelRunner, StepInputs
from ember.engine.scheduler import ScheduledBatch
from ember.kv.block_hash import KVLayout
from ember.parallel import group
from ember.parallel.shard import plan, plan_experts
from ember.parallel.tensor_parallel import ParallelRunner, RankPart, ShardedKVCache, model_args
from ember.parallel.tensor_parallel import measure_costs as tp_costs
from ember.util.timing import median_time


def partition(num_layers: int, stages: int, layer: float, first_extra: float, last_extra: float) -> list[int]:
    """Layers per stage (contiguous, each at least one) minimising the slowest stage, where a stage
    costs `layer` a layer, the first stage `first_extra` more and the last `last_extra` more."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"pipeline_parallel must be between 1 and the model's {num_layers} layers, got {stages}")
    best: tuple[float, list[int]] | None = None

    def cost(stage: int, count: int) -> float:
        return count * layer + (first_extra if stage == 0 else 0.0) + (last_extra if stage == stages - 1 else 0.0)

    def search(stage: int, left: int, counts: list[int], worst: float) -> None:
        nonlocal best
        if best is not None and worst >= best[0]:
            return
        if stage == stages - 1:
            total = max(worst, cost(stage, left))
            if best is None or total < best[0]:
                best = (total, counts + [left])
            return
        for count in range(1, left - (stages - stage - 1) + 1):
            search(stage + 1, left - count, counts + [count], max(worst, cost(stage, count)))
    search(0, num_layers, [], 0.0)
    return best[1]


def stage_costs(counts: list[int], layer: float, first_extra: float, last_extra: float) -> list[float]:
    return [c * layer + (first_extra if i == 0 else 0.0) + (last_extra if i == len(counts) - 1 else 0.0)
            for i, c in enumerate(counts)]


def measure_costs(args, dtype: torch.dtype, rows: int, reps: int = 5) -> dict[str, float]:
    """Milliseconds of the embedding, one decoder layer and the norm + output layer for a step of
    `rows` tokens, on random weights of the model's shape (attention over the rows themselves)."""
    from ember.model.llama import DecoderLayer, RMSNorm
    torch.manual_seed(0)
    layer = DecoderLayer(args).to(dtype).eval()
    norm = RMSNorm(args.hidden_size, args.rms_norm_eps).to(dtype)
    embedding = torch.randn(args.vocab_size, args.hidden_size, dtype=dtype)
    ids = torch.randint(0, args.vocab_size, (rows,))
    x = torch.randn(rows, args.hidden_size, dtype=dtype)
    cos, sin = torch.ones(rows, args.head_dim), torch.zeros(rows, args.head_dim)

    def attend(_, q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)

    def best(fn) -> float:
        return 1000 * median_time(fn, reps=reps)
    with torch.inference_mode():
        return {"embedding": best(lambda: F.embedding(ids, embedding)),
                "layer": best(lambda: layer(x, cos, sin, attend, 0)),
                "head": best(lambda: F.linear(norm(x), embedding).float())}


class StageRank(RankPart):
    """One rank of a stage: the stage's layers (its tensor-parallel shard of them when the stage is a
    group of `tp` ranks; under expert parallelism, its experts of them and a replica of the rest),
    those layers of the KV cache; its methods are the commands. Rank r is stage r // tp, rank r % tp
    of its stage's group (`tp`: the group's size, tensor- or expert-parallel); each talks to the same
    rank of the next stage (all of a stage's ranks hold the whole hidden state after its all-reduces).
    Under expert parallelism only the last stage's first rank computes and sends the logits."""

    def __init__(self, config, rank: int, tp: int, bounds: list[tuple[int, int]], shards: list,
                 layout: KVLayout, num_blocks: int):
        from ember.kernels import optimize
        from ember.model.loader import load_model
        self.rank, self.tp, self.bounds, self.whole = rank, tp, bounds, layout
        self.stage, tp_rank = divmod(rank, tp)
        self.first, self.last = self.stage == 0, self.stage == len(bounds) - 1
        self.shard = shards[tp_rank]
        experts = self.shard is not None and hasattr(self.shard, "experts")  # an ExpertShard, not a RankShard
        self.sends_logits = self.last and (not experts or tp_rank == 0)
        # every rank makes every stage's tensor-parallel group, in the same order (dist.new_group's rule)
        stage_groups = [dist.new_group([s * tp + t for t in range(tp)]) for s in range(len(bounds))] if tp > 1 \
            else []
        device = rank_device(torch.device(config.device), rank, len(bounds) * tp)
        self.loaded = load_model(config.model, config.dtype, config.weights, shard=self.shard,
                                 layers=bounds[self.stage])
        self.model = self.loaded.model
        if experts:
            from ember.model.moe import MoE
            for module in self.model.modules():
                if isinstance(module, MoE):
                    module.set_expert_parallel(partial(group.all_reduce, ranks=stage_groups[self.stage]))
        elif self.shard is not None:
            self.model.set_tensor_parallel(partial(group.all_reduce, ranks=stage_groups[self.stage]),
                                           self.shard.vocab[0])
        self.kernels = optimize(self.model) if config.optimize and device.type == "cpu" else []
        if not self.sends_logits:
            self.model.lm_head = None  # (a packed copy of a tied embedding for logits this rank never computes)
        count = bounds[self.stage][1] - bounds[self.stage][0]
        self.heads = (0, layout.num_kv_heads) if self.shard is None or experts else self.shard.kv_heads
        heads = self.heads[1] - self.heads[0]
        self.model.to(device)
        self.cache = PagedKVCache(replace(layout, num_layers=count, num_kv_heads=heads), num_blocks, device)
        # its attention() and tensor() serve the stage; prepare() is the driver's
        self.runner = ModelRunner(self.model, self.cache, attention_backend=config.attention_backend)

    def _stage(self, inputs: StepInputs, x: torch.Tensor | None) -> torch.Tensor:
        """This stage's part of a micro-batch (the last stage's: its logits, of its vocabulary rows); the
        result where collectives want it (group.comm_device)."""
        attend, tensor = self.runner.attention(inputs), self.runner.tensor
        x = self.model.embed(tensor(inputs.input_ids)) if self.first else x.to(self.cache.device)
        x = self.model.forward_layers(x, tensor(inputs.positions), attend)
        if self.sends_logits:
            if inputs.sample_rows:
                x = self.model.compute_logits(self.model.norm(x)[tensor(inputs.sample_rows)])
            else:
                x = x.new_empty(0, self.model.args.vocab_size, dtype=torch.float32)
        return x.to(group.comm_device()).contiguous()

    def step(self, micro_batches: list[StepInputs]) -> None:
        """A rank other than the driver: each micro-batch's hidden states from the previous stage (the
        first stage embeds), computed, sent on (the last stage: its logits, to the driver)."""
        hidden, dtype = self.model.args.hidden_size, self.model.norm.weight.dtype
        sends = []
        for inputs in micro_batches:
            x = None
            if not self.first:
                x = torch.empty(len(inputs.input_ids), hidden, dtype=dtype, device=group.comm_device())
                dist.recv(x, src=self.rank - self.tp)
            out = self._stage(inputs, x)
            if self.last and not self.sends_logits:
                continue  # (another expert-parallel rank of the last stage sends them)
            sends.append((dist.isend(out, dst=0 if self.last else self.rank + self.tp), out))
        for work, _ in sends:
            work.wait()

    def export(self, block_ids: list[int], layers_width: int, heads_width: int) -> list[torch.Tensor] | None:
        return group.gather_padded(self.cache.kv[:, :, block_ids], {0: layers_width, 4: heads_width})

    def import_block(self, block_id: int, payload: bytes) -> None:
        first, last = self.bounds[self.stage]
        w = self.whole
        heads = self.heads
        as_int = group.int_view(self.cache.kv.element_size())
        full = torch.frombuffer(bytearray(payload), dtype=as_int).view(w.num_layers, w.planes, w.block_size,
                                                                         w.num_kv_heads, w.head_dim)
        self.cache.kv[:, :, block_id].view(as_int).copy_(full[first:last, :, :, heads[0]:heads[1]])


def _stage_main(rank: int, world: int, port: int, config, tp: int, bounds, shards, layout, num_blocks: int,
                threads: int) -> None:
    group.serve(rank, world, port, threads, lambda: StageRank(config, rank, tp, bounds, shards, layout, num_blocks),
                torch.device(config.device))


class PipelineParallelRunner(ParallelRunner):
    """The driver's side: ModelRunner's `run` over `pipeline_parallel` stages, each a group of
    `tensor_parallel` ranks (TP x PP: the stage's layers split Megatron style, tensor_parallel.py)."""

    def __init__(self, config, layout: KVLayout, num_blocks: int):
        args = model_args(config)
        self.ep = config.expert_parallel  # > 1: each stage a group of expert-parallel ranks (not TP)
        self.stages, self.tp = config.pipeline_parallel, config.tensor_parallel if self.ep == 1 else self.ep
        world = self.stages * self.tp
        dtype = getattr(torch, config.dtype)
        threads = max(1, config.torch_threads() // world)
        torch.set_num_threads(threads)
        # the cost profile times a Llama layer; another family's stages are balanced by layer count
        self.costs = measure_costs(args, dtype, rows=min(16, config.max_num_seqs)) if args.family == "llama" \
            else {"embedding": 0.0, "layer": 1.0, "head": 0.0}
        if config.pipeline_partition:
            counts = list(config.pipeline_partition)
            if len(counts) != self.stages or sum(counts) != args.num_layers or min(counts) < 1:
                raise ValueError(f"pipeline_partition {counts} must give each of the {self.stages} stages at "
                                 f"least one layer, {args.num_layers} in all")
        else:
            counts = partition(args.num_layers, self.stages, self.costs["layer"], self.costs["embedding"],
                               self.costs["head"])
        self.counts = counts
        self.predicted_ms = stage_costs(counts, self.costs["layer"], self.costs["embedding"], self.costs["head"])
        starts = [sum(counts[:i]) for i in range(len(counts))]
        self.bounds = [(s, s + c) for s, c in zip(starts, counts)]
        self.shards = [None]
        if self.ep > 1:
            self.shards = plan_experts(args, self.ep)
        elif self.tp > 1:
            uneven = self.tp < args.num_kv_heads and args.num_kv_heads % self.tp
            self.shard_costs = tp_costs(args, dtype, min(16, config.max_num_seqs)) if uneven else None
            self.shards = plan(args, self.tp, self.shard_costs)
        self.layout = layout
        self.micro_batches = config.pipeline_microbatches or self.stages
        self._start(world, _stage_main, lambda r: (config, self.tp, self.bounds, self.shards, layout, num_blocks,
                                                   threads), "pp",
                    config.device, lambda: StageRank(config, 0, self.tp, self.bounds, self.shards, layout, num_blocks))
        self.cache = ShardedKVCache(self)
        self._layers_width = max(counts)
        tensor_parallel = self.tp > 1 and self.ep == 1
        self._heads_width = max(s.kv_heads[1] - s.kv_heads[0] for s in self.shards) if tensor_parallel \
            else layout.num_kv_heads
        self._vocab = [s.vocab[1] - s.vocab[0] for s in self.shards] if tensor_parallel else [args.vocab_size]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        n = len(batch.seqs)
        parts = min(self.micro_batches, n)
        cuts = [n * i // parts for i in range(parts + 1)]
        micro, sampled = [], []
        for a, b in zip(cuts, cuts[1:]):
            inputs, rows = self.me.runner.prepare(ScheduledBatch(batch.seqs[a:b], batch.num_new_tokens[a:b]))
            micro.append(inputs)
            sampled += [a + i for i in rows]
        last_stage = (self.stages - 1) * self.tp
        with self.group.failing():
            self.group.send("step", micro)
            sends = []
            for inputs in micro:  # stage 0 of each micro-batch, sent on while the next one is computed
                hidden = self.me._stage(inputs, None)
                sends.append((dist.isend(hidden, dst=self.tp), hidden))
            logits = []
            for inputs in micro:  # each of the last stage's ranks sends its vocabulary rows
                slices = []
                for t, width in enumerate(self._vocab):
                    out = torch.empty(len(inputs.sample_rows), width, dtype=torch.float32, device=group.comm_device())
                    dist.recv(out, src=last_stage + t)
                    slices.append(out.cpu())
                logits.append(torch.cat(slices, dim=1))
            for work, _ in sends:
                work.wait()
        return torch.cat(logits), sampled

    @torch.inference_mode()
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[L, 2, n, block_size, Hkv, D]: the blocks in the whole-model layout."""
        with self.group.failing():
            self.group.send("export", block_ids, self._layers_width, self._heads_width)
            parts = self.me.export(block_ids, self._layers_width, self._heads_width)
        whole = parts[0].new_empty(self.layout.num_layers, *parts[0].shape[1:4], self.layout.num_kv_heads,
                                   self.layout.head_dim)
        for rank, part in enumerate(parts):
            stage, tp_rank = divmod(rank, self.tp)
            first, last = self.bounds[stage]
            shard = self.shards[tp_rank]
            h0, h1 = shard.kv_heads if hasattr(shard, "kv_heads") else (0, self.layout.num_kv_heads)
            whole[first:last, :, :, :, h0:h1] = part[:last - first, :, :, :, :h1 - h0]  # (replicas: the same values)
        return whole
