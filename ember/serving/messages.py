"""What a service sends its engine core and what comes back (torch-free, picklable).

Service -> core: ("add", AddRequest), ("abort", request_id), ("stats", call_id), ("shutdown",).
Core -> service, one message per loop turn: (events, Snapshot), each event one of
("out", RequestOutput), ("error", request_id, ErrorInfo), ("stats", call_id, dict); and ([], Snapshot)
from the core's publisher thread at least every PUBLISH_S, also while a long step runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import NO_TENANT, Tenant

MEMORY_REFRESH_S = 5.0  # how old the memory report in an engine's snapshot gets (ember.engine.footprint)
# How often the core's publisher thread sends its state when the loop sent none meanwhile (a long step):
# a service's gauges are never older than about this (the bound is 0.5 s).
PUBLISH_S = 0.25


@dataclass(frozen=True)
class KVPlan:
    """How a request's KV meets the site kvstore (L2), carried out by the core's KV connector.

    - pull_from: a kvstore (another site's) holding blocks this site's store lacks; the
      site store pulls them there first (decode after a remote prefill); see on_kv_failure.
    - read_through: blocks missing from the engine pool (L1) are read from the site store
      before anything is computed; a failure here only means computing them.
    - write_back: "sync" stores the request's new full blocks in the site store before its
      last output is delivered (prefill: decode is about to pull them); "async" stores them
      in the background (decode: the next turn finds them); "none" skips it.
    - max_blocks: load at most the prompt's first N full blocks (those the source holds).
    - stream_to: another site's kvstore (decode's): each chunk's new full blocks are stored in the
      site store and pulled there while later chunks compute (its chunks halve, so the last is
      small); a failed stream costs nothing but the overlap (decode pulls or recomputes the rest).
    - on_kv_failure: a failed or partial pull, or a failed sync write-back: "recompute" computes
      what is missing (at most recompute_max_tokens prompt tokens; None: any number), "fail"
      ends the request with the transfer's error. Never a wrong token either way.
    """
    pull_from: str = ""
    read_through: bool = True
    write_back: str = "async"
    max_blocks: int | None = None
    on_kv_failure: str = "recompute"
    recompute_max_tokens: int | None = None
    stream_to: str = ""

    def __post_init__(self):
        if self.write_back not in ("sync", "async", "none"):
            raise ValueError(f"KVPlan.write_back must be sync, async or none, got {self.write_back!r}")
        if self.on_kv_failure not in ("recompute", "fail"):
            raise ValueError(f"KVPlan.on_kv_failure must be recompute or fail, got {self.on_kv_failure!r}")


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_prefix: list[int] = field(default_factory=list)
    plan: KVPlan | None = None  # None: the pool alone (no kvstore)
    timeout_s: float | None = None  # for the KV transfers this request needs
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C headers: its KV calls join the trace
    cache_salt: bytes = b""  # its tenant's hash chain (ember.kv.block_hash): b"" is the plain chain
    shared_blocks: int = 0   # leading prompt blocks inside a prefix every tenant shares (unsalted)
    tenant: Tenant = NO_TENANT  # whose: the scheduler's fair queue


@dataclass(frozen=True)
class ErrorInfo:
    """An error crossing the process boundary: the gRPC status name it maps to and its message."""
    kind: str  # "invalid" | "capacity" | "integrity" | "status"
    message: str
    status: str = ""  # grpc.StatusCode name when kind == "status"


@dataclass(frozen=True)
class Snapshot:
    """Engine gauges (metrics read these without a round trip): sent after a loop turn, and by the
    core's publisher thread at least every PUBLISH_S while the loop sends none (a long step). The
    counters advance as the work is done: a request's cached prompt tokens at its first step, its
    computed ones chunk by chunk, its generated tokens step by step."""
    running: int = 0  # in the running batch, or finished but its answer waits on its KV write-back (sync)
    waiting: int = 0  # admitted to the scheduler's queue or loading its KV (the client adds the adds on their way)
    used_blocks: int = 0
    total_blocks: int = 1
    tokens_l1: int = 0  # prompt tokens served from the engine pool, since start (at a request's first step)
    tokens_l2: int = 0  # from the site kvstore
    tokens_computed: int = 0  # prompt tokens run through the model, chunk by chunk (a recomputation counts again)
    draft_tokens: int = 0  # speculative drafts verified, since start
    accepted_tokens: int = 0  # of those, kept
    forced_tokens: int = 0  # appended by jump-forward decoding (grammar-forced), since start
    expert_tokens: tuple[int, ...] = ()  # a MoE model's tokens routed to each expert, since start
    expert_ranks: tuple[int, ...] = ()  # the expert-parallel rank holding each expert
    step_choices: tuple[tuple[str, int], ...] = ()  # steps by the step policy's choice, since start
    memory: tuple[tuple[str, int], ...] = ()  # the core process's resident memory by part (ember.util.memory)
    # the live part (EngineCore.live_snapshot): the loop writes it, the publisher thread only reads it
    version: int = 0  # of the core's state: a client keeps the newest it has seen
    at: float = 0.0  # time.monotonic() when the state was read (one clock for every process of the host)
    adds: int = 0  # "add" messages the core has taken in, since start (the client counts those on their way)
    step_since: float = 0.0  # time.monotonic() when the step in progress began; 0.0 between steps
    step_prefill_tokens: int = 0  # prompt tokens the step in progress computes
    queued_prefill_tokens: int = 0  # prompt tokens still to compute, not counting the step in progress's
    generation_tokens: int = 0  # tokens sampled, since start (step by step)
    prefix_queries: int = 0  # tokens of requests looked up in the prefix cache at their first step, since start


@dataclass(frozen=True)
class CoreInfo:
    """What the service learns once the core is warm."""
    pid: int
    block_size: int
    root_hash: bytes
    vocab_size: int
    max_model_len: int
    kernels: list[str] = field(default_factory=list)
    memory: tuple[tuple[str, int], ...] = ()  # its resident memory by part when it became ready
