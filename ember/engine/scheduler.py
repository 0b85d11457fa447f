"""Continuous batching with chunked prefill under a per-step token budget (torch-free).

Each step every running sequence gets the tokens it still needs to compute (one for a
decoding sequence, a chunk for one still prefilling), in admission order, then waiting
sequences are admitted while budget, sequence slots and KV blocks allow. A sequence
that cannot grow preempts the most recently admitted one (which gives its blocks back
and later recomputes, mostly from the prefix cache).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ember.engine.block_manager import BlockManager
from ember.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.can_grow(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            bm.grow(seq, num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            hits = bm.match_prefix(seq)
            if not bm.can_allocate(seq, hits):
                break
            self.waiting.popleft()
            bm.allocate(seq, hits)
            if not seq.admitted_once:
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.admitted_once = True
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        if seq in batch.seqs:  # already scheduled this step: unschedule it
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_new_tokens[i]
        self.block_manager.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and give its blocks back (they stay cached until evicted)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
