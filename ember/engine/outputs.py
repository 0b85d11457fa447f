"""What the engine hands back per step (torch-free, so service processes unpickle it without torch)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVStats:
    """Where a request's prompt KV came from and where its new blocks went (engine-core KV connector)."""
    blocks_l1: int = 0  # full prompt blocks already in the engine's pool (L1)
    blocks_l2: int = 0  # imported from the site kvstore (L2), pulled there first when a plan says so
    blocks_pulled: int = 0  # of those, fetched across sites by the site kvstore
    bytes_pulled: int = 0
    transfer_s: float = 0.0  # from the request's arrival to its KV being ready for admission
    blocks_stored: int = 0  # new full blocks written to the site kvstore when the request finished


@dataclass
class TokenLogprob:
    """A sampled token's log-probability under the model and the most likely tokens at its position."""
    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RequestOutput:
    """What one step produced for one request (streamed); the last one has finished=True."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    block_hashes: list[bytes]  # full blocks whose KV this request left in the cache
    kv: KVStats | None = None  # set on a request's first output (and its last, with blocks_stored)
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when the request asked for them
    error: str | None = None  # finish_reason "error": its constraint failed while decoding (why)
