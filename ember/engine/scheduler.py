"""Continuous batching with TTFT-aware chunked prefill under a per-step token budget (torch-free).

Each step has `max_num_batched_tokens` tokens to give out:

1. Decoding sequences first (one token each, plus its speculative drafts when the budget and
   its blocks allow; in admission order), so a prefill never delays the next token of a
   running stream: the budget is sized (`ember bench budget`)
   so that a step carrying a full budget still meets the decode TPOT SLO. A budget smaller
   than the decode batch serves the decoders round-robin (never the same ones left out).
2. What is left goes to prefill work *one prompt at a time*: the head of the prefill queue
   takes all it still needs up to the remaining budget, the next one only what is left, and
   so on. Prompts of a burst therefore finish one after another (the first one's TTFT is
   its own prefill, not the whole burst's) instead of all finishing together at the end.
3. A waiting sequence is admitted (its KV blocks allocated) only when it gets prefill
   tokens in this very step, so queued prompts do not hold blocks they will not use for
   many steps. A prompt that is fully cached still gets its one last token computed.

Prefill queue order: shortest remaining (uncached) prefill first, with a starvation bound.
Why not plain FCFS: TTFT is queueing plus own prefill, and running the shortest job first
minimises the mean (and p50) of it. In agentic traffic the difference is large: a follow-up
turn whose context is mostly in the prefix cache needs ~100 new tokens, and under FCFS it
would wait behind a cold 2,500-token first turn that arrived a moment earlier. "Remaining"
is counted after prefix-cache hits (estimated once when the sequence is first seen waiting,
exact once admitted), so cached turns jump ahead. A prompt already being prefilled only
gets shorter, so it stays at the head unless a shorter one arrives. Starvation bound: a
sequence that was passed over in `starvation_steps` steps (it got no prefill tokens while
one that arrived after it did) is promoted; promoted sequences go first, in arrival
order (FCFS), ahead of every unpromoted one. With the budget sized to the TPOT SLO, that
bounds how long a long prompt can be overtaken to about starvation_steps x SLO.

Tenants: ahead of the remaining-prefill order, a fair queue across tenants (the router's, on each
request: `Sequence.tenant`): a sequence whose tenant has fewer sequences running, per unit of its
weight, goes first. One tenant's burst queued here therefore never holds back another tenant's
request: it goes in the next step. When the batch is full (`max_num_seqs`), a waiting sequence
whose tenant holds fewer seats than another, per weight, even after taking one, preempts that
tenant's newest sequence (as below: its blocks stay cached; it comes back when its tenant's turn
does), so a burst that filled the batch while it was alone gives seats back as others arrive.
With one tenant (no API keys) none of this changes anything.

Preemption: only decoding sequences grow (admission allocates blocks for the whole prompt,
so a prefill never stalls midway). One that cannot grow preempts the most recently admitted
sequence, which gives its blocks back (they stay cached) and later recomputes, mostly from
the prefix cache. No sequence is admitted in a step that preempted.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from ember.engine.block_manager import BlockManager
from ember.engine.sequence import SeqStatus, Sequence
from ember.engine.step_policy import PACK_TOKENS, SLO, StepCosts, StepPlan, plan_step


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_decodes: int = 0  # of seqs, the decoders (one token and its drafts each); the rest prefill

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class _QueueState:
    arrival: int  # order of add(): FCFS tie-break and the reference for "passed over"
    passes: int = 0  # steps in which a later arrival got prefill tokens and this one got none
    estimate: int | None = None  # uncached prefill tokens while waiting (None: look it up)
    last_served: int = 0  # when it was last given tokens (a count of grants)
    arrived_at: float = 0.0  # monotonic seconds: its TTFT runs from here
    token_at: float = 0.0  # when its last step ended (a decoder's TPOT runs from here)


STREAM_TAIL_TOKENS = 128  # a streamed prompt's last chunk: what crosses the link after its prefill ends
STREAM_RATIO = 8  # each chunk leaves at least 1/8 of what is left for later (see streamed_chunk)


def streamed_chunk(left: int, block_size: int, tail: int = STREAM_TAIL_TOKENS, ratio: int = STREAM_RATIO) -> int:
    """A streamed prompt's next chunk (the step's budget caps it too). Each chunk's KV crosses the
    link while the chunks after it compute; only the last one's crosses after the prefill ends, so
    that one is `tail` tokens, and each chunk leaves at least 1/`ratio` of what is left (whole
    blocks) for later, so its transfer hides under the next chunk's compute wherever the link moves
    KV at least `ratio` times faster than prefill makes it (here 1 Gbit/s moves ~5,400 tokens/s of
    bf16 KV; a CPU prefills ~500). 2,048 tokens under a 1,024 budget: 1,024, 896, 128."""
    if left <= tail:
        return left
    leave = max(tail, -(-left // ratio))
    leave = -(-leave // block_size) * block_size if leave > tail else tail
    return left - leave if left - leave >= block_size else left  # (no chunk of less than a block)


def _decoding(seq: Sequence) -> bool:
    """One token left to compute, or past its prompt with several (tokens a grammar forced:
    jump-forward): decode work (a prompt's recomputation after a preemption is not)."""
    left = seq.num_tokens - seq.num_computed_tokens
    return left == 1 or (left > 1 and seq.num_computed_tokens >= seq.prompt_len)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 *, starvation_steps: int = 8, slo: SLO | None = None, clock=time.monotonic):
        if starvation_steps < 0:
            raise ValueError(f"starvation_steps must be >= 0, got {starvation_steps}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.starvation_steps = starvation_steps  # 0: plain FCFS
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._state: dict[int, _QueueState] = {}  # by id(seq): Sequence compares by value, not identity
        self._arrivals = itertools.count()
        self._served = 0
        self._running_by_tenant: Counter[str] = Counter()  # at the start of this step (the fair queue)
        # the TTFT/TPOT step policy (ember.engine.step_policy); None: every step serves the decodes
        # first and fills the budget with prefill, one prompt after another (no clock read)
        self.slo, self.clock = slo, clock
        self.costs = StepCosts()
        self.choices: Counter[str] = Counter()  # steps by the policy's choice
        self.last_plan: StepPlan | None = None

    def add(self, seq: Sequence) -> None:
        now = self.clock() if self.slo is not None else 0.0
        self._state[id(seq)] = _QueueState(next(self._arrivals), arrived_at=now, token_at=now)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        self._running_by_tenant = Counter(s.tenant.name for s in self.running)
        # 1. decodes (one token left to compute) first, in admission order; should the budget
        # not cover them all, the ones left out go first next step (longest since last served)
        decoders = [s for s in self.running if _decoding(s)]
        plan = self._plan(decoders)
        if plan is None or plan.serve_decodes:
            budget = self._serve_decodes(batch, decoders, budget)

        # 2. prefill work, one prompt at a time in queue order; admit only who gets tokens now
        candidates = [s for s in self.running if not _decoding(s)]
        candidates += self.waiting
        candidates.sort(key=self._queue_key)
        admitting = not batch.preempted
        admitted: set[int] = set()
        served: set[int] = set()
        if plan is not None and plan.prefill_cap is not None:
            budget = min(budget, plan.prefill_cap)
        prefill_tokens = 0
        for seq in candidates:
            if budget == 0 or (plan is not None and prefill_tokens >= PACK_TOKENS):
                break  # (under the policy a step finishes one prompt, small ones packed: TTFT first)
            if seq.status is SeqStatus.WAITING:
                if not admitting:
                    continue
                if len(self.running) >= self.max_num_seqs:
                    victim = self._fair_victim(seq)
                    if victim is None:
                        continue
                    budget += self._preempt(victim, batch)
                hits = bm.match_prefix(seq)
                if not bm.can_allocate(seq, hits):
                    # Head of line: nothing behind it may take blocks first, or a long prompt
                    # could wait forever for a pool that shorter ones keep refilling.
                    admitting = False
                    continue
                bm.allocate(seq, hits)
                if not seq.admitted_once:
                    seq.num_cached_tokens = seq.num_computed_tokens
                    seq.admitted_once = True
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                self._running_by_tenant[seq.tenant.name] += 1
                admitted.add(id(seq))
            left = seq.num_tokens - seq.num_computed_tokens
            num_new = min(streamed_chunk(left, bm.block_size) if seq.streamed else left, budget)
            if not bm.can_grow(seq, num_new):  # cannot happen: admission allocated the whole prompt
                continue
            bm.grow(seq, num_new)
            self._put(batch, seq, num_new)
            served.add(id(seq))
            budget -= num_new
            prefill_tokens += num_new
        if admitted:
            self.waiting = deque(s for s in self.waiting if id(s) not in admitted)
        if plan is not None and not plan.serve_decodes and not batch.seqs and decoders:
            # no prompt could start after all (no blocks, no seat): the decodes' step, not an empty one
            self.choices[plan.choice] -= 1
            self.choices["decode"] += 1
            self._serve_decodes(batch, decoders, self.max_num_batched_tokens)

        # 3. starvation bookkeeping: passed over = got nothing while a later arrival got tokens
        if served:
            latest = max(self._st(s).arrival for s in batch.seqs if id(s) in served)
            for seq in candidates:
                st = self._st(seq)
                if id(seq) not in served and st.arrival < latest:
                    st.passes += 1
        return batch

    def _serve_decodes(self, batch: ScheduledBatch, decoders: list[Sequence], budget: int) -> int:
        """Give each decoder its token (and drafts), preempting the newest when blocks run out;
        returns the budget left."""
        bm = self.block_manager
        if len(decoders) > budget:
            decoders.sort(key=lambda s: self._st(s).last_served)
        for seq in decoders:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not bm.can_grow(seq, 1):
                victim = self.running[-1]
                budget += self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            pending = seq.num_tokens - seq.num_computed_tokens  # > 1: tokens a grammar forced (jump-forward)
            num_new = pending + len(seq.draft_token_ids)  # its drafts ride along when budget and blocks allow
            if num_new > 1 and (num_new > budget or not bm.can_grow(seq, num_new)):
                seq.draft_token_ids = []
                num_new = min(pending, budget) if bm.can_grow(seq, min(pending, budget)) else 1
            bm.grow(seq, num_new)
            self._put(batch, seq, num_new)
            batch.num_decodes += 1
            budget -= num_new
        return budget

    def _plan(self, decoders: list[Sequence]) -> StepPlan | None:
        """This step's choice under the TTFT/TPOT policy (None: no policy), counted in `choices`."""
        if self.slo is None:
            return None
        candidates = [s for s in self.running if not _decoding(s)]
        if len(self.running) < self.max_num_seqs:
            candidates += self.waiting
        now = self.clock()
        head_tokens, at_risk = 0, False
        if candidates:
            head = min(candidates, key=self._queue_key)
            head_tokens = min(self._remaining(head), self.max_num_batched_tokens)
            at_risk = any(now - self._st(s).arrived_at + self.costs.prefill_s(self._remaining(s)) >= self.slo.ttft_s
                          for s in candidates)
        waited = max((now - self._st(s).token_at for s in decoders), default=0.0)
        plan = plan_step(self.slo, self.costs, len(decoders), waited, head_tokens, at_risk,
                         self.block_manager.block_size)
        self.choices[plan.choice] += 1
        self.last_plan = plan
        return plan

    def _remaining(self, seq: Sequence) -> int:
        """Prefill tokens `seq` still needs (a waiting one's after its prefix-cache hits)."""
        key = self._queue_key(seq)
        return key[2] if key[0] == 1 else seq.num_tokens - seq.num_computed_tokens

    def step_done(self, batch: ScheduledBatch, seconds: float) -> None:
        """The engine ran `batch` in `seconds`: learn its cost, stamp its sequences' token time."""
        if self.slo is None:
            return
        now = self.clock()
        decode_tokens = sum(batch.num_new_tokens[:batch.num_decodes])  # (decoders come first)
        self.costs.observe(batch.num_decodes, sum(batch.num_new_tokens) - decode_tokens, seconds)
        for seq in batch.seqs:
            self._st(seq).token_at = now

    def _st(self, seq: Sequence) -> _QueueState:
        st = self._state.get(id(seq))
        if st is None:  # put in the queues without add(): it arrives now
            st = self._state[id(seq)] = _QueueState(next(self._arrivals))
        return st

    def _queue_key(self, seq: Sequence) -> tuple:
        st = self._st(seq)
        if st.passes >= self.starvation_steps:
            return (0, st.arrival)  # promoted: FCFS among the starved, ahead of everyone else
        if seq.status is SeqStatus.WAITING:
            if st.estimate is None:  # once per stay in the queue: match_prefix hashes the prompt
                hits = self.block_manager.match_prefix(seq)
                st.estimate = seq.num_tokens - len(hits) * self.block_manager.block_size
            remaining = st.estimate
        else:
            remaining = seq.num_tokens - seq.num_computed_tokens
        share = self._running_by_tenant[seq.tenant.name] / seq.tenant.weight  # its tenant's use (fair queue)
        return (1, share, remaining, st.arrival)

    def _put(self, batch: ScheduledBatch, seq: Sequence, num_new: int) -> None:
        self._served += 1
        self._st(seq).last_served = self._served
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)

    def _fair_victim(self, seq: Sequence) -> Sequence | None:
        """With the batch full: the newest running sequence of the tenant holding the most seats per
        weight, when that is more than `seq`'s tenant would hold with one more; else None."""
        by = self._running_by_tenant

        def held(s: Sequence) -> float:
            return by[s.tenant.name] / s.tenant.weight
        mine = (by[seq.tenant.name] + 1) / seq.tenant.weight
        victim = None
        for s in reversed(self.running):  # newest first: the least work to redo
            if s.tenant.name != seq.tenant.name and held(s) > mine and (victim is None or held(s) > held(victim)):
                victim = s
        return victim

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> int:
        """Preempt seq; return the tokens it had been given this step (back to the budget)."""
        self.running.remove(seq)
        self._running_by_tenant[seq.tenant.name] -= 1
        refund = 0
        for i, s in enumerate(batch.seqs):
            if s is seq:  # already scheduled this step: unschedule it
                refund = batch.num_new_tokens[i]
                del batch.seqs[i], batch.num_new_tokens[i]
                if i < batch.num_decodes:
                    batch.num_decodes -= 1
                break
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._st(seq).estimate = None  # what is still cached is looked up again
        batch.preempted.append(seq)
        return refund

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and give its blocks back (they stay cached until evicted)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._state.pop(id(seq), None)
