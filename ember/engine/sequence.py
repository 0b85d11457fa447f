"""One request's tokens and bookkeeping inside the engine (torch-free)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ember.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"



@dataclass(frozen=True)
class Tenant:
    """Whose request a sequence is, for the scheduler's fair queue: waiting sequences of the tenant
    with the fewest running per unit of `weight` go first (ember.engine.scheduler)."""
    name: str = ""
    weight: float = 1.0


NO_TENANT = Tenant()

@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    params: SamplingParams
    seed: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    block_table: list[int] = field(default_factory=list)
    # the other KV groups' tables (hybrid allocation: ember.engine.block_manager)
    group_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, in order
    finish_reason: str | None = None
    output_text: str = ""
    num_text_emitted: int = 0
    num_preemptions: int = 0
    admitted_once: bool = False
    # its tenant's hash chain (ember.kv.block_hash.parent_of): b"" is the plain, shared chain
    cache_salt: bytes = b""
    shared_blocks: int = 0
    tenant: Tenant = field(default_factory=lambda: NO_TENANT)  # whose: the scheduler's fair queue
    matcher: object | None = None  # its constraint's grammar state (ember.engine.constraints), if any
    drafter: object | None = None  # its prompt-lookup index (ember.engine.speculation), when it speculates
    draft_token_ids: list[int] = field(default_factory=list)  # this step's drafts, after token_ids
    streamed: bool = False  # its KV leaves chunk by chunk while it prefills: its chunks halve (scheduler)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len
