"""What a step carries when prompts wait while streams decode, against the TTFT and TPOT
objectives (torch-free).

Agents wait for first tokens: a follow-up turn is ~350 new tokens over a cached history, and
its TTFT is its queueing plus its own prefill. Decoding streams, meanwhile, only need a token
every `tpot_s`. So, per step (DistServe's goodput framing; Sarathi-Serve's stall-free mixed
steps when decode is what is at risk):

- `prefill_first`: a step of prefill alone, the decodes skipped, while every decoder's wait for
  its next token, plus this step's estimated time, stays within the TPOT objective. Prompts
  then finish as fast as the engine prefills, and no step pays for the decodes meanwhile.
- `mixed_ttft`: decodes are due, and a waiting prompt's TTFT is at risk (its wait plus its own
  estimated prefill reaches `ttft_s`): decodes and the prompt's full chunk in one step.
- `mixed_tpot`: decodes are due and no prompt is at risk: the prefill chunk is cut so the step
  stays within `tpot_s` (at least a block, so prefill always advances).
- `decode` / `prefill`: only one kind of work is there.

Estimates come from the engine's own steps (`StepCosts`, measured as it runs, not configured):
a decode step's time and the seconds per prefill token. Until it has measured either, an
estimate is 0 (optimistic: prefill first).
"""
from __future__ import annotations

from dataclasses import dataclass

CHOICES = ("decode", "prefill", "prefill_first", "mixed_ttft", "mixed_tpot")
PACK_TOKENS = 64  # a step's prefill takes a next prompt only while it has fewer tokens than this


@dataclass(frozen=True)
class SLO:
    """The latency objectives a scheduler plans steps against (router.slo in a cluster config)."""
    ttft_s: float = 2.0
    tpot_s: float = 0.25


class StepCosts:
    """Exponential moving averages of the engine's measured step times: a decode-only step, and
    the seconds each prefill token adds to a step."""

    ALPHA = 0.2
    MIN_PREFILL_TOKENS = 16  # steps with fewer prefill tokens say too little about their cost

    def __init__(self):
        self.decode_step_s: float | None = None
        self.token_s: float | None = None

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_prefill_tokens == 0:
            if num_decodes:
                self.decode_step_s = self._ema(self.decode_step_s, seconds)
            return
        if num_prefill_tokens >= self.MIN_PREFILL_TOKENS:
            decode_part = (self.decode_step_s or 0.0) if num_decodes else 0.0
            self.token_s = self._ema(self.token_s, max(0.0, seconds - decode_part) / num_prefill_tokens)

    def prefill_s(self, num_tokens: int) -> float:
        return num_tokens * (self.token_s or 0.0)

    def step_s(self, num_decodes: int, num_prefill_tokens: int) -> float:
        return ((self.decode_step_s or 0.0) if num_decodes else 0.0) + self.prefill_s(num_prefill_tokens)

    def tokens_within(self, seconds: float, num_decodes: int) -> int | None:
        """Prefill tokens a step with `num_decodes` decodes can carry within `seconds`; None: unknown."""
        if not self.token_s:
            return None
        return int(max(0.0, seconds - self.step_s(num_decodes, 0)) / self.token_s)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.ALPHA * (new - old)


@dataclass(frozen=True)
class StepPlan:
    choice: str
    serve_decodes: bool
    prefill_cap: int | None  # prefill tokens this step may carry at most (besides the budget)


def plan_step(slo: SLO, costs: StepCosts, num_decoders: int, decode_waited_s: float, head_tokens: int,
              ttft_at_risk: bool, block_size: int) -> StepPlan:
    """The step's plan: `decode_waited_s` is the longest any decoder has waited since its last
    token, `head_tokens` what the first prompt in the prefill queue would get this step (0: no
    prefill work)."""
    if head_tokens == 0:
        return StepPlan("decode", True, None)
    if num_decoders == 0:
        return StepPlan("prefill", True, None)
    if decode_waited_s + costs.prefill_s(head_tokens) <= slo.tpot_s:
        return StepPlan("prefill_first", False, None)
    if ttft_at_risk:
        return StepPlan("mixed_ttft", True, None)
    within = costs.tokens_within(slo.tpot_s, num_decoders)
    return StepPlan("mixed_tpot", True, None if within is None else max(block_size, within))
