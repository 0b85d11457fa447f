"""A tensor-parallel engine's ranks (ember.parallel.group: rank 0 is the driver). Only the driver
schedules, hashes and samples: every step it sends the step's inputs (model_runner.StepInputs) to
the ranks, every rank runs its shard of the model (ember.parallel.shard) over its own slice of the
paged KV cache (its KV heads, the same block ids), the all-reduces inside the layers join them, and
the logits' vocabulary slices are gathered to the driver.

KV blocks stay whole-model: `ShardedKVCache` gives the engine the export/import of one whole-model
cache. An export gathers every rank's heads of the block into the driver's buffer in the
whole-model layout (layer, K/V, token, head, dim), so frames do not depend on the parallel layout
and engines of different degrees exchange blocks; an import sends the block to every rank, which
takes its heads. A latent-attention model's cache (one latent row per token and layer) is whole on
every rank: each rank computes the same latent from the same hidden state, an export is the driver's
copy and an import goes whole to every rank.

The model families' parts split as shard.py says: grouped-query or latent attention by heads, dense
MLPs and every routed and shared expert by width (or, with `expert_parallel` equal to the degree, whole
experts spread over the ranks), each layer's partial sums joined by one all-reduce.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ember.engine.device import rank_device
from ember.engine.kv_cache import PagedKVCache
from ember.engine.model_runner import ModelRunner, StepInputs
from ember.kv.block_hash import KVLayout
from ember.parallel import group
from ember.parallel.shard import ALIGN, RankShard, ShardCosts, plan
from ember.util.timing import median_time


def model_args(config):
    from ember.model.args import read_model_args
    from ember.model.files import model_folder
    return read_model_args(model_folder(config.model))


class RankPart:
    """What every rank's part does alike; its `import_block(block_id, payload)` is its own."""

    _arenas: dict = {}  # socket path -> ArenaReader: the site kvstore this rank maps (one per path)

    def import_shared(self, block_id: int, path: str, store_id: bytes, offset: int, length: int) -> None:
        """Import a block straight from a same-host kvstore's shared memory (the driver verified it),
        then say whether it could: a kvstore restarted since the driver's lease (another store id) or
        out of reach makes the driver send the bytes instead (`shared_import_ok`)."""
        ok = 1
        try:
            reader = self._arenas.get(path)
            if reader is None or reader.store_id != store_id:
                from ember.kv.shm import ArenaReader
                if reader is not None:
                    reader.close()
                reader = self._arenas[path] = ArenaReader(path, store_id)
            self.import_block(block_id, reader.frame(offset, length))
        except (OSError, ValueError) as e:  # ConnectionError, IntegrityError (a ValueError): not fatal
            import logging
            logging.getLogger("ember.parallel").warning("rank could not read block %d from shared memory (%s): "
                                                        "the driver sends it", block_id, e)
            ok = 0
        shared_import_ok(ok)


def shared_import_ok(ok: int) -> bool:
    """Every rank's word on a shared-memory import (all ranks call it, the driver too): True when all
    read the block. Also the point after which the caller may release the kvstore's lease."""
    flag = torch.tensor([ok], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class TensorRank(RankPart):
    """One rank's model shard, its slice of the KV cache and its runner; its methods are the commands."""

    def __init__(self, config, shard: RankShard, layout: KVLayout, num_blocks: int):
        from ember.kernels import optimize
        from ember.model.loader import load_model
        self.shard, self.whole = shard, layout
        device = rank_device(torch.device(config.device), shard.rank, shard.degree)
        self.loaded = load_model(config.model, config.dtype, config.weights, shard=shard)
        self.loaded.model.set_tensor_parallel(group.all_reduce, shard.vocab[0])
        self.kernels = optimize(self.loaded.model) if config.optimize and device.type == "cpu" else []
        self.loaded.model.to(device)
        self.cache = PagedKVCache(replace(layout, num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0]), num_blocks,
                                  device)
        # never captured: its layers all-reduce
        self.runner = ModelRunner(self.loaded.model, self.cache, attention_backend=config.attention_backend)

    def step(self, inputs: StepInputs, logits_width: int) -> list[torch.Tensor] | None:
        return group.gather_padded(self.runner.execute(inputs), {1: logits_width})

    def export(self, block_ids: list[int], heads_width: int) -> list[torch.Tensor] | None:
        return group.gather_padded(self.cache.kv[:, :, block_ids], {4: heads_width})  # [L, 2, n, bs, heads, D]

    def import_block(self, block_id: int, payload: bytes) -> None:
        w = self.whole
        as_int = group.int_view(self.cache.kv.element_size())
        full = torch.frombuffer(bytearray(payload), dtype=as_int).view(
            w.num_layers, w.planes, w.block_size, w.num_kv_heads, w.head_dim)  # (a copy to the device where it lives)
        self.cache.kv[:, :, block_id].view(as_int).copy_(full[:, :, :, self.shard.kv_heads[0]:self.shard.kv_heads[1]])


def _rank_main(rank: int, world: int, port: int, config, shard: RankShard, layout: KVLayout, num_blocks: int,
               threads: int) -> None:
    group.serve(rank, world, port, threads, lambda: TensorRank(config, shard, layout, num_blocks),
                torch.device(config.device))


def measure_costs(args, dtype: torch.dtype, rows: int, context: int = 512, reps: int = 5) -> ShardCosts:
    """Milliseconds, for a decode step of `rows` sequences of `context` tokens, of one KV group (its
    QKV rows, attention over its keys and values, its o_proj columns) and of ALIGN MLP columns
    (gate/up rows, SiLU, down columns), on random weights of the model's shape."""
    torch.manual_seed(0)
    group_size, d, h = args.num_heads // args.num_kv_heads, args.head_dim, args.hidden_size
    x = torch.randn(rows, h, dtype=dtype)
    qkv, o = torch.randn((group_size + 2) * d, h, dtype=dtype), torch.randn(h, group_size * d, dtype=dtype)
    keys, values = torch.randn(2, rows, 1, context, d, dtype=dtype)
    gate_up, down = torch.randn(2 * ALIGN, h, dtype=dtype), torch.randn(h, ALIGN, dtype=dtype)
    repeat = 10  # each part takes microseconds: time ten in a row

    def attention_group():
        for _ in range(repeat):
            q = F.linear(x, qkv)[:, :group_size * d].view(rows, group_size, 1, d)
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
            F.linear(out.reshape(rows, group_size * d), o)

    def mlp_step():
        for _ in range(repeat):
            gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
            F.linear(F.silu(gate) * up, down)
    with torch.inference_mode():
        return ShardCosts(1000 * median_time(attention_group, reps=reps) / repeat,
                          1000 * median_time(mlp_step, reps=reps) / repeat)


class ParallelRunner:
    """What the tensor- and pipeline-parallel drivers share: `group` (group.RankGroup), `me` (rank 0)."""

    shared_imports = 0  # blocks the ranks took straight from a kvstore's shared memory

    def _start(self, world: int, rank_main, args_of_rank, name: str, device: str, make_driver) -> None:
        """Spawn ranks 1..world-1 (`rank_main(rank, world, port, *args_of_rank(rank))`), join the group,
        build the driver's own part (`make_driver()`: rank 0) and wait for every rank's; a failure on
        the way aborts the group (no rank is left behind)."""
        self.group = group.RankGroup(world, rank_main, args_of_rank, name, torch.device(device))
        self.procs = self.group.procs
        try:
            self.group.join()
            self.me = make_driver()
            self.group.ready()
        except BaseException:
            self.group.abort()
            raise
        self.kernels = self.me.kernels
        self.captured = None

    @torch.inference_mode()
    def import_block(self, block_id: int, payload: bytes) -> None:
        """Every rank takes its part of the block: from the same-host kvstore's shared memory when the
        payload lies there (each rank maps the arena; no bytes through the driver), else sent to them."""
        from ember.kv.shm import ArenaReader
        where = ArenaReader.locate(payload)
        with self.group.failing():
            if where is None:
                payload = bytes(payload)
                self.group.send("import_block", block_id, payload)
                self.me.import_block(block_id, payload)
                return
            self.group.send("import_shared", block_id, *where, len(payload))
            self.me.import_block(block_id, payload)
            if not shared_import_ok(1):  # (every rank has read it, or tried, before the lease can go)
                payload = bytes(payload)
                self.group.send("import_block", block_id, payload)
                return
            self.shared_imports += 1

    def close(self) -> None:
        self.group.close()


class TensorParallelRunner(ParallelRunner):
    """The driver's side: ModelRunner's `run`, over `tensor_parallel` ranks."""

    def __init__(self, config, layout: KVLayout, num_blocks: int):
        self.degree = config.tensor_parallel
        args = model_args(config)
        threads = max(1, config.torch_threads() // self.degree)
        torch.set_num_threads(threads)
        # groups that do not split evenly over the ranks: MLP columns balance them, by measured cost (the
        # Llama family's shape; the latent and mixture-of-experts families split evenly, shard.plan_family)
        uneven = self.degree < args.num_kv_heads and args.num_kv_heads % self.degree and \
            args.mla is None and args.moe is None
        self.costs = measure_costs(args, getattr(torch, config.dtype), min(16, config.max_num_seqs)) if uneven \
            else None
        self.shards = plan(args, self.degree, self.costs, expert_parallel=config.expert_parallel)
        self.layout = layout
        # latent attention: every rank holds the whole cache, so the driver's copy is the export
        self.replicated_cache = all(s.kv_heads == (0, layout.num_kv_heads) for s in self.shards)
        self._start(self.degree, _rank_main, lambda r: (config, self.shards[r], layout, num_blocks, threads), "tp",
                    config.device, lambda: TensorRank(config, self.shards[0], layout, num_blocks))
        self.cache = ShardedKVCache(self)
        self._vocab_width = max(s.vocab[1] - s.vocab[0] for s in self.shards)
        self._heads_width = max(s.kv_heads[1] - s.kv_heads[0] for s in self.shards)

    @torch.inference_mode()
    def run(self, batch) -> tuple[torch.Tensor, list[int]]:
        inputs, sampled = self.me.runner.prepare(batch)
        with self.group.failing():
            self.group.send("step", inputs, self._vocab_width)
            parts = self.me.step(inputs, self._vocab_width)
        return torch.cat([p[:, :s.vocab[1] - s.vocab[0]] for p, s in zip(parts, self.shards)], dim=1), sampled

    @torch.inference_mode()
    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[L, 2, n, block_size, Hkv, D]: the blocks in the whole-model layout."""
        if self.replicated_cache:  # (on the host, as the gathered branch's parts are: a CUDA pool's blocks copied)
            return self.me.cache.kv[:, :, block_ids].cpu()
        with self.group.failing():
            self.group.send("export", block_ids, self._heads_width)
            parts = self.me.export(block_ids, self._heads_width)
        whole = parts[0].new_empty(*parts[0].shape[:4], self.layout.num_kv_heads, self.layout.head_dim)
        for part, shard in zip(parts, self.shards):
            first, last = shard.kv_heads
            whole[:, :, :, :, first:last] = part[:, :, :, :, :last - first]  # a replica writes the same values
        return whole


class ShardedKVCache:
    """The engine's view of a parallel engine's cache: whole-model blocks in, whole-model blocks out.
    runner: export_blocks(ids) -> [L, 2, n, bs, Hkv, D], import_block(id, payload), `me` (rank 0)."""

    def __init__(self, runner):
        self.runner = runner
        self.layout = runner.layout
        self.dtype = runner.me.cache.dtype

    @property
    def nbytes(self) -> int:  # rank 0's slice, as every rank holds one like it
        return self.runner.me.cache.nbytes

    def export_block(self, block_id: int) -> bytes:
        whole = self.runner.export_blocks([block_id])[:, :, 0]
        return whole.contiguous().view(group.int_view(whole.element_size())).numpy().tobytes()

    def import_block(self, block_id: int, payload) -> None:
        if len(payload) != self.layout.block_bytes:
            raise ValueError(f"KV block payload is {len(payload)} bytes, layout needs {self.layout.block_bytes}")
        self.runner.import_block(block_id, payload)
