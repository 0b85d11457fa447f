"""Per-request sampling and stopping parameters, validated when built (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class Constraint:
    """The language a request's output must belong to (compiled by ember.engine.constraints).
    `kind`: json_schema (spec: the schema as JSON text), json_object (spec unused), regex, lark."""
    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"a {self.kind} constraint needs its text")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None  # None: a random seed is drawn per request
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    constraint: Constraint | None = None  # grammar-constrained decoding
    logprobs: int | None = None  # None: off; N: each token's logprob and the N most likely alternatives
    presence_penalty: float = 0.0  # OpenAI's, over the output tokens
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, sorted by id
    speculative: bool | None = None  # prompt-lookup speculation (exact); None: the engine's default

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        for token, b in self.logit_bias:
            if token < 0 or not -100 <= b <= 100:
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {b}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def can_speculate(self) -> bool:
        """Whether drafts can be verified as plain samples: no processor whose state moves with each
        token (penalties over the output so far, a grammar) and no logit bias (kept simple)."""
        return self.speculative is not False and self.constraint is None and not self.penalized \
            and not self.logit_bias

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)
