"""Turns a scheduled batch into tensors, runs the model, returns logits of sampled rows."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ember.engine.attention import DecodeBatch, GroupedAttention, PagedAttention, PrefillChunk
from ember.engine.kv_cache import PagedKVCache
from ember.engine.scheduler import ScheduledBatch
from ember.kernels import cpu_step
from ember.model.llama import LlamaModel


@dataclass
class GroupStep:
    """One more KV group's slots and block tables for a step (hybrid allocation: the step's first group
    is StepInputs' own fields); its tables hold page 0 where the group's pages were given back."""
    slots: list[int]
    prefills: list[PrefillChunk]
    decode: DecodeBatch | None


@dataclass
class StepInputs:
    """One step as plain tensors (what tensor-parallel ranks receive from the driver)."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    prefills: list[PrefillChunk]
    decode: DecodeBatch | None
    sample_rows: list[int]  # rows whose logits are returned
    groups: list[GroupStep] = field(default_factory=list)  # KV groups after the first (none: one group)


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, capture_sizes: tuple[int, ...] = (),
                 attention_backend: str = "auto"):
        """capture_sizes: the batch-size buckets of the captured step (ember.kernels.cpu_step), where
        the model's step can be captured; empty: every step op by op. attention_backend: as resolved by
        ember.engine.device ("auto": what PagedAttention picks for the cache's dtype)."""
        self.model = model
        self.cache = cache
        self.device = cache.kv.device
        self.attention_backend = attention_backend
        self.block_size = cache.layout.block_size
        self.scale = model.args.attention_scale
        self.num_groups = len(cache.groups.layers) if cache.groups is not None else 1
        self.captured = None
        if capture_sizes and self.device.type == "cpu" and self.num_groups == 1 and \
                cpu_step.unsupported(model, cache) is None:
            self.captured = cpu_step.CapturedStep(model, cache, capture_sizes)

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Compute the batch's tokens; return (logits [S, V], for each logits row its index into
        batch.seqs). A decoding sequence with drafts (its last token, then seq.draft_token_ids)
        gets a row per position, in order: the verify step of speculative decoding."""
        inputs, sampled = self.prepare(batch)
        return self.execute(inputs), sampled

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[int]]:
        """The step's inputs, and for each sampled row its index into batch.seqs."""
        input_ids, positions = [], []
        groups = range(self.num_groups)
        slots = [[] for _ in groups]
        prefill_spans, prefill_tables = [], [[] for _ in groups]
        decode_rows, decode_tables, decode_lens, decode_queries = [], [[] for _ in groups], [], []
        sample_rows, sampled = [], []
        bs = self.block_size
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            offset = len(input_ids)
            new = seq.token_ids[start:start + n]
            input_ids.extend((new + seq.draft_token_ids)[:n] if seq.draft_token_ids else new)
            positions.extend(range(start, start + n))
            tables = [seq.block_table, *seq.group_tables] if self.num_groups > 1 else [seq.block_table]
            used = -(-(start + n) // bs)
            for g, table in enumerate(tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if self.num_groups > 1:  # (a chunked group's given-back entries: page 0, masked)
                if min(min(s[-n:]) for s in slots) < 0:
                    raise RuntimeError(f"{seq.request_id}: a token's KV slot is in a page given back")
                tables = [[max(b, 0) for b in t[:used]] for t in tables]
            if start > 0 and (n == 1 or seq.draft_token_ids):
                # a decode, batched with the others; a verify step's tokens too (each sees the
                # keys up to its own position: all are written before attention)
                decode_rows.append(offset)
                for g, table in enumerate(tables):
                    decode_tables[g].append(table[:used])
                decode_lens.append(start + n)
                decode_queries.append(n)
            else:
                prefill_spans.append((offset, n, start))
                for g, table in enumerate(tables):
                    prefill_tables[g].append(torch.tensor(table[:used]))
            if seq.draft_token_ids:  # verify: every position is sampled
                sample_rows.extend(range(offset, offset + n))
                sampled.extend([i] * n)
            elif start + n == seq.num_tokens:  # chunk reaches the end: sample the next token
                sample_rows.append(offset + n - 1)
                sampled.append(i)
        per_group = []
        for g in groups:
            prefills = [PrefillChunk(*span, table) for span, table in zip(prefill_spans, prefill_tables[g])]
            decode = None
            if decode_rows:
                width = max(len(t) for t in decode_tables[g])
                tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables[g]])
                decode = DecodeBatch(torch.tensor(decode_rows), tables, torch.tensor(decode_lens),
                                     torch.tensor(decode_queries))
            per_group.append(GroupStep(slots[g], prefills, decode))
        first = per_group[0]
        return StepInputs(input_ids, positions, first.slots, first.prefills, first.decode, sample_rows,
                          per_group[1:]), sampled

    def attention(self, inputs: StepInputs) -> PagedAttention | GroupedAttention:
        """The step's attention over this runner's cache, its tensors on the cache's device."""
        first = GroupStep(inputs.slots, inputs.prefills, inputs.decode)
        per_group = [self._group_attention(step) for step in [first, *inputs.groups]]
        return per_group[0] if len(per_group) == 1 else GroupedAttention(self.cache, per_group)

    def _group_attention(self, step: GroupStep) -> PagedAttention:
        prefills, decode, device = step.prefills, step.decode, self.device
        if device.type != "cpu":
            prefills = [replace(c, block_table=c.block_table.to(device)) for c in prefills]
            if decode is not None:
                decode = DecodeBatch(decode.token_indices.to(device), decode.block_tables.to(device),
                                     decode.context_lens.to(device), decode.query_lens.to(device))
        backend = self.attention_backend
        return PagedAttention(self.cache, self.tensor(step.slots), prefills, decode, self.scale,
                              kernel=False if backend == "torch" else None, triton=backend == "triton",
                              chunks=self.model.args.attention_chunks)

    def tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, device=self.device)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [len(sample_rows), V] on the CPU (this rank's vocabulary rows under tensor parallelism)."""
        attend = self.attention(inputs)
        input_ids, positions = self.tensor(inputs.input_ids), self.tensor(inputs.positions)
        if self.captured is not None and len(input_ids) <= self.captured.max_rows and attend.tiles is not None:
            hidden = self.model.norm(self.captured(self.model.embed(input_ids), positions, attend.slot_mapping,
                                                   attend.tiles, self.scale))
        else:
            hidden = self.model(input_ids, positions, attend)
        if not inputs.sample_rows:
            return torch.empty(0, self.model.args.vocab_size, dtype=torch.float32)
        return self.model.compute_logits(hidden[self.tensor(inputs.sample_rows)]).cpu()
