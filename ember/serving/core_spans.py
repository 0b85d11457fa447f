"""The engine core's spans of each request, in the request's own trace.

The engine core runs in a process of its own; each AddRequest carries the W3C context of the
service's SERVER span (`trace_context`), and the spans made here are its children, exported by the
core's own tracer (ember.rpc.tracing.setup(service, "engine-core")). Times are measured in the
loop (time.time_ns(), one clock for every process of a host) and the spans made once a phase is
over, so nothing here runs while a step computes:

- `engine.queue`: from the request's admission to the scheduler until its first step
  (`ember.queue_wait_s`; `ember.waiting_ahead`, `ember.running` as it was admitted);
- `engine.prefill_chunk`: one per step that computed some of its prompt (`ember.chunk`,
  `ember.tokens`, `ember.prompt_tokens_done` of `ember.prompt_tokens`, the step's
  `ember.batch_seqs` and `ember.batch_tokens`); a preempted request's recomputation counts again;
- `engine.decode`: one span for the request's whole decode phase, however long it runs (from its
  first decode step to its last: `ember.steps`, `ember.tokens`, `ember.step_s_mean`,
  `ember.step_s_max`, `ember.batch_seqs_max`, `ember.finish_reason`), so a long answer is one span,
  not one per step;
- `kv.import`: the verified frames copied into the pool (`ember.blocks`, `ember.bytes`).

Bookkeeping costs nothing unless this process exports spans (`ember.rpc.tracing.exporting`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class _Request:
    parent: object  # the opentelemetry Context of the service's SERVER span
    prompt_tokens: int
    admitted_ns: int
    waiting_ahead: int
    running: int
    queued: bool = True  # until its first step
    chunks: int = 0
    decode_from: int = 0  # the decode phase: its first step's start, its last step's end
    decode_to: int = 0
    steps: int = 0
    step_ns: int = 0
    step_ns_max: int = 0
    batch_max: int = 0


class CoreSpans:
    def __init__(self):
        from ember.rpc import tracing
        self.tracing = tracing
        self.requests: dict[str, _Request] = {}
        self._step: tuple[int, list[tuple[str, int, int, int]], int, int] | None = None

    @staticmethod
    def wanted() -> bool:
        """Whether this process exports spans (else the core keeps no bookkeeping at all)."""
        try:
            from ember.rpc import tracing
        except ImportError:  # (a core without the gRPC stack traces nothing)
            return False
        return tracing.exporting

    def admitted(self, request, waiting_ahead: int, running: int) -> None:
        """The request joined the scheduler's queue (after its KV loaded, if it had any to load)."""
        parent = self.tracing.context_of(request.trace_context)
        if parent is not None:
            self.requests[request.request_id] = _Request(parent, len(request.prompt_token_ids), time.time_ns(),
                                                         waiting_ahead, running)

    def imported(self, request, start_ns: int, blocks: int, nbytes: int) -> None:
        parent = self.tracing.context_of(request.trace_context)
        if parent is not None:
            self.tracing.span_between("kv.import", parent, start_ns, time.time_ns(), blocks=blocks, bytes=nbytes)

    def batch(self, batch) -> None:
        """A step's batch, before the model runs it: who computes what."""
        self._step = None
        if not self.requests:
            return
        seqs = [(s.request_id, n, s.num_computed_tokens, s.prompt_len)
                for s, n in zip(batch.seqs, batch.num_new_tokens) if s.request_id in self.requests]
        self._step = (time.time_ns(), seqs, sum(batch.num_new_tokens), len(batch.seqs)) if seqs else None

    def step_done(self) -> None:
        """The step of the last `batch` is over: its chunks' spans, its decoders' counts."""
        if self._step is None:
            return
        (start, seqs, batch_tokens, batch_seqs), end = self._step, time.time_ns()
        self._step = None
        for rid, n, done, prompt_len in seqs:
            r = self.requests.get(rid)
            if r is None:
                continue
            if r.queued:
                r.queued = False
                self.tracing.span_between("engine.queue", r.parent, r.admitted_ns, start,
                                          queue_wait_s=round((start - r.admitted_ns) / 1e9, 6),
                                          waiting_ahead=r.waiting_ahead, running=r.running)
            if done < prompt_len:  # (a step that finishes the prompt also samples: still its chunk)
                tokens = min(prompt_len, done + n) - done
                self.tracing.span_between("engine.prefill_chunk", r.parent, start, end, chunk=r.chunks,
                                          tokens=tokens, prompt_tokens_done=done + tokens,
                                          prompt_tokens=prompt_len, batch_seqs=batch_seqs,
                                          batch_tokens=batch_tokens)
                r.chunks += 1
            else:
                r.decode_from = r.decode_from or start
                r.decode_to = end
                r.steps += 1
                r.step_ns += end - start
                r.step_ns_max = max(r.step_ns_max, end - start)
                r.batch_max = max(r.batch_max, batch_seqs)

    def finished(self, request_id: str, completion_tokens: int | None = None, finish_reason: str | None = None,
                 aborted: bool = False) -> None:
        """The request is done here (finished, failed or aborted): its decode phase's one span."""
        r = self.requests.pop(request_id, None)
        if r is None or not r.steps:
            return
        self.tracing.span_between("engine.decode", r.parent, r.decode_from, r.decode_to, steps=r.steps,
                                  tokens=completion_tokens, step_s_mean=round(r.step_ns / r.steps / 1e9, 6),
                                  step_s_max=round(r.step_ns_max / 1e9, 6), batch_seqs_max=r.batch_max,
                                  finish_reason=finish_reason, aborted=True if aborted else None)
