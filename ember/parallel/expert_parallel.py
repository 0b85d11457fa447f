"""Expert parallelism for mixture-of-experts models (`engine.expert_parallel: N`).

Each of N ranks (ember.parallel.group: rank 0 is the driver) holds 1/N of every MoE layer's routed
experts, read from the checkpoint as slices (the others are never loaded), and a replica of
everything else: attention and its KV cache, the router, dense layers, shared experts, the
embedding. Every step the driver sends the step's inputs; every rank runs the whole model over the
same tokens, and in each MoE layer computes only the (token, slot) pairs routed to its experts.
The combine is one all-reduce of the layer's slots ([tokens, top_k, hidden]): each slot is one
rank's value plus zeros, so after it every rank holds exactly the slots one rank would have
computed and sums them in the same fixed order: EP = N gives EP = 1's tokens bit for bit, and a
request's tokens still do not depend on the batch it shares a step with.

With attention replicated, every rank already holds every token: dispatch needs no message, and
the combine moves top_k x hidden values per token (an all-to-all would move the same slots; the
all-reduce also hands them to every rank, which each needs for its next layer's replica). What EP
buys is memory: the experts are most of a MoE model's bytes (Kimi K2.5: 384 routed experts, 97%
of its weights), and each rank reads only its experts' bytes per step. On one host's CPU cores the
ranks share the memory bandwidth they would split: BENCHMARKS.md says what that costs.

KV blocks stay whole-model and every rank's cache holds all of them: an export is the driver's own
copy, an import goes to every rank (ParallelRunner.import_block).
"""
from __future__ import annotations

import torch

from ember.engine.device import rank_device
from ember.engine.kv_cache import PagedKVCache
from ember.engine.model_runner import ModelRunner, StepInputs
from ember.kv.block_hash import KVLayout
from ember.parallel import group
from ember.parallel.shard import ExpertShard, plan_experts
from ember.parallel.tensor_parallel import ParallelRunner, RankPart, model_args


def expert_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the routed experts this rank holds (its MoE layers' gate_up and down)."""
    from ember.model.moe import MoE
    return sum(m.expert_bytes() for m in model.modules() if isinstance(m, MoE))


class ExpertRank(RankPart):
    """One rank: the model with its experts, a whole KV cache, its runner; its methods are the commands."""

    def __init__(self, config, shard: ExpertShard, layout: KVLayout, num_blocks: int):
        from ember.kernels import optimize
        from ember.model.loader import load_model
        from ember.model.moe import MoE
        self.shard = shard
        device = rank_device(torch.device(config.device), shard.rank, shard.degree)
        self.loaded = load_model(config.model, config.dtype, config.weights, shard=shard)
        for module in self.loaded.model.modules():
            if isinstance(module, MoE):
                module.set_expert_parallel(group.all_reduce)
        self.kernels = optimize(self.loaded.model) if config.optimize and device.type == "cpu" else []
        self.loaded.model.to(device)
        self.cache = PagedKVCache(layout, num_blocks, device)
        # never captured: its MoE layers all-reduce
        self.runner = ModelRunner(self.loaded.model, self.cache, attention_backend=config.attention_backend)

    def step(self, inputs: StepInputs) -> torch.Tensor:
        return self.runner.execute(inputs)

    def import_block(self, block_id: int, payload: bytes) -> None:
        self.cache.import_block(block_id, payload)

    def expert_stats(self) -> None:
        """Every rank's resident expert bytes and routed tokens, gathered to the driver."""
        from ember.model.moe import MoE
        tokens = torch.stack([m.expert_tokens for m in self.loaded.model.modules() if isinstance(m, MoE)]).sum(0)
        mine = int(tokens[slice(*self.shard.experts)].sum())
        return group.gather_padded(torch.tensor([expert_weight_bytes(self.loaded.model), mine]), {})


def _rank_main(rank: int, world: int, port: int, config, shard: ExpertShard, layout: KVLayout, num_blocks: int,
               threads: int) -> None:
    group.serve(rank, world, port, threads, lambda: ExpertRank(config, shard, layout, num_blocks),
                torch.device(config.device))


class ExpertParallelRunner(ParallelRunner):
    """The driver's side: ModelRunner's `run`, over `expert_parallel` ranks."""

    def __init__(self, config, layout: KVLayout, num_blocks: int):
        self.degree = config.expert_parallel
        self.shards = plan_experts(model_args(config), self.degree)
        threads = max(1, config.torch_threads() // self.degree)
        torch.set_num_threads(threads)
        self.layout = layout
        self._start(self.degree, _rank_main, lambda r: (config, self.shards[r], layout, num_blocks, threads), "ep",
                    config.device, lambda: ExpertRank(config, self.shards[0], layout, num_blocks))
        self.cache = ReplicatedKVCache(self)

    @torch.inference_mode()
    def run(self, batch) -> tuple[torch.Tensor, list[int]]:
        inputs, sampled = self.me.runner.prepare(batch)
        with self.group.failing():
            self.group.send("step", inputs)
            logits = self.me.step(inputs)
        return logits, sampled

    @torch.inference_mode()
    def expert_stats(self) -> list[dict]:
        """Per rank: its experts, the bytes of them it holds, and the tokens routed to them so far."""
        with self.group.failing():
            self.group.send("expert_stats")
            parts = self.me.expert_stats()
        return [{"rank": s.rank, "experts": list(s.experts), "expert_bytes": int(p[0]), "routed_tokens": int(p[1])}
                for s, p in zip(self.shards, parts)]


class ReplicatedKVCache:
    """The engine's view of an expert-parallel engine's cache: every rank holds every block whole, so
    an export reads the driver's copy and an import goes to every rank."""

    def __init__(self, runner: ExpertParallelRunner):
        self.runner = runner
        self.layout = runner.layout
        self.dtype = runner.me.cache.dtype

    @property
    def nbytes(self) -> int:  # rank 0's, as every rank holds one like it
        return self.runner.me.cache.nbytes

    def export_block(self, block_id: int) -> bytes:
        return self.runner.me.cache.export_block(block_id)

    def import_block(self, block_id: int, payload) -> None:
        if len(payload) != self.layout.block_bytes:
            raise ValueError(f"KV block payload is {len(payload)} bytes, layout needs {self.layout.block_bytes}")
        self.runner.import_block(block_id, payload)
