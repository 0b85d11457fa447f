"""Input limits and checks every RPC applies before it does any work (torch-free).

Each check raises ember.errors.InvalidRequestError (INVALID_ARGUMENT at the service edge)
naming the field and the limit. The limits bound what one request may make a service hold or
scan: counts of stop strings, token ids and block hashes, lengths of names and texts. They are
far above what a real request needs (a prompt is bounded by the context length anyway), so
they refuse only garbage and abuse, and they refuse it before the work it would cost.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from ember.engine.sampling_params import Constraint, SamplingParams
from ember.errors import InvalidRequestError
from ember.kv.block_hash import HASH_BYTES, MAX_SALT_BYTES

MAX_STOP_STRINGS = 64          # per request (OpenAI allows 4)
MAX_STOP_STRING_BYTES = 256    # each, UTF-8
MAX_STOP_TOKEN_IDS = 256
MAX_ID_BYTES = 256             # request_id, session_id, user_region, site names, model names
MAX_ADDRESS_BYTES = 256        # HOST:PORT of a peer
MAX_BLOCK_HASHES = 65536       # per call: 1M tokens of 16-token blocks, more than any context
MAX_PUBLISHED_BLOCKS = 2**22   # per directory publish (a full refresh lists a store's every block)
MAX_SITES = 256                # per directory lookup
MAX_CHAT_MESSAGES = 4096
MAX_LOGIT_BIAS = 300           # entries (OpenAI allows 300)
MAX_CONSTRAINT_BYTES = 2**20   # a grammar, schema or regex, UTF-8
MIN_LEASE_S = 0.01             # a shorter lease would expire before its blocks are even pinned
# Text is capped before it is tokenized: at most this, and at most what could still fit the
# context (RouterService: max_model_len x the vocabulary's longest token, in bytes).
MAX_TEXT_BYTES = 4 * 2**20

_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}$")


def invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(message)


def count(items: Sequence, field: str, limit: int) -> None:
    if len(items) > limit:
        raise invalid(f"{field} has {len(items)} entries; at most {limit} are accepted")


def utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def text_size(text: str, field: str, limit: int, why: str = "") -> None:
    """`text` is at most `limit` UTF-8 bytes (checked by length first: no copy of a huge text)."""
    if len(text) > limit or utf8_bytes(text) > limit:
        size = len(text) if len(text) > limit else utf8_bytes(text)
        raise invalid(f"{field} is {size} bytes or more; at most {limit} bytes are accepted" +
                      (f" ({why})" if why else ""))


def name(value: str, field: str, limit: int = MAX_ID_BYTES) -> str:
    text_size(value, field, limit)
    return value


def address(value: str, field: str, required: bool = False) -> str:
    """"" (when not required) or HOST:PORT."""
    if not value and not required:
        return value
    text_size(value, field, MAX_ADDRESS_BYTES)
    match = _ADDRESS.match(value)
    if match is None or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        raise invalid(f"{field} must be HOST:PORT, got {value[:80]!r}")
    return value


def token_ids(ids: Sequence[int], vocab_size: int, field: str, max_len: int | None = None) -> list[int]:
    """Every id in [0, vocab_size), at most `max_len` of them."""
    if max_len is not None and len(ids) > max_len:
        raise invalid(f"{field} has {len(ids)} tokens; the context length is {max_len}")
    ids = list(ids)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def block_hashes(hashes: Iterable[bytes], field: str = "block_hashes", limit: int = MAX_BLOCK_HASHES) -> list[bytes]:
    hashes = list(hashes)
    count(hashes, field, limit)
    for i, h in enumerate(hashes):
        if len(h) != HASH_BYTES:
            raise invalid(f"{field}[{i}] is {len(h)} bytes; a block hash is {HASH_BYTES}")
    return hashes


def tenant_chain(request, prompt_len: int, block_size: int) -> None:
    """A Prefill/DecodeRequest's `cache_salt` and `shared_blocks` (ember.kv.block_hash): a salt of at
    most MAX_SALT_BYTES, shared blocks no more than the prompt's full blocks."""
    if len(request.cache_salt) > MAX_SALT_BYTES:
        raise invalid(f"cache_salt is {len(request.cache_salt)} bytes; at most {MAX_SALT_BYTES} are accepted")
    if request.shared_blocks > prompt_len // max(1, block_size):
        raise invalid(f"shared_blocks is {request.shared_blocks}; the prompt has only "
                      f"{prompt_len // max(1, block_size)} full blocks")
    name(request.tenant, "tenant")
    if not (math.isfinite(request.tenant_weight) and request.tenant_weight >= 0):
        raise invalid(f"tenant_weight must be a finite number >= 0 (0: 1), got {request.tenant_weight}")


def seconds(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise invalid(f"{field} must be a finite number of seconds, got {value}")
    return value


def lease_s(value: float, field: str = "lease_s") -> float:
    """A lease's requested time to live: at least MIN_LEASE_S (the store clamps it from above)."""
    if not value >= MIN_LEASE_S:  # NaN too
        raise invalid(f"{field} must be at least {MIN_LEASE_S} s, got {value}")
    return value


def sampling(pb, vocab_size: int | None = None, max_model_len: int | None = None) -> SamplingParams:
    """A validated SamplingParams from its protobuf: the engine's own checks plus the caps above
    (stop strings, stop token ids against the vocabulary, max_tokens against the context)."""
    count(pb.stop, "sampling.stop", MAX_STOP_STRINGS)
    for i, s in enumerate(pb.stop):
        text_size(s, f"sampling.stop[{i}]", MAX_STOP_STRING_BYTES)
    count(pb.stop_token_ids, "sampling.stop_token_ids", MAX_STOP_TOKEN_IDS)
    if vocab_size is not None:
        token_ids(pb.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    for field in ("temperature", "top_p"):
        if not math.isfinite(getattr(pb, field)):
            raise invalid(f"sampling.{field} must be a finite number, got {getattr(pb, field)}")
    if max_model_len is not None and pb.max_tokens > max_model_len:
        raise invalid(f"sampling.max_tokens ({pb.max_tokens}) exceeds the context length {max_model_len}")
    for field in ("presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(pb, field)):
            raise invalid(f"sampling.{field} must be a finite number, got {getattr(pb, field)}")
    count(pb.logit_bias, "sampling.logit_bias", MAX_LOGIT_BIAS)
    if vocab_size is not None:
        token_ids(list(pb.logit_bias), vocab_size, "sampling.logit_bias")
    if any(not math.isfinite(b) for b in pb.logit_bias.values()):
        raise invalid("sampling.logit_bias values must be finite numbers")
    try:
        return SamplingParams(
            max_tokens=pb.max_tokens,
            temperature=pb.temperature,
            top_k=pb.top_k,
            top_p=pb.top_p if pb.top_p != 0 else 1.0,
            seed=pb.seed if pb.HasField("seed") else None,
            stop=tuple(pb.stop),
            stop_token_ids=tuple(pb.stop_token_ids),
            ignore_eos=pb.ignore_eos,
            constraint=constraint(pb.constraint) if pb.HasField("constraint") else None,
            logprobs=pb.logprobs if pb.HasField("logprobs") else None,
            presence_penalty=pb.presence_penalty,
            frequency_penalty=pb.frequency_penalty,
            logit_bias=tuple(pb.logit_bias.items()),
            speculative=pb.speculative if pb.HasField("speculative") else None,
        )
    except ValueError as e:  # SamplingParams' own checks, at the validation point
        raise invalid(f"sampling: {e}") from e


def constraint(pb) -> Constraint:
    """A Constraint from its protobuf (its text capped; whether it compiles is the engine's check)."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise invalid("sampling.constraint is set but names no kind: set json_schema, json_object, regex or lark")
    spec = "" if kind == "json_object" else getattr(pb, kind)
    text_size(spec, f"sampling.constraint.{kind}", MAX_CONSTRAINT_BYTES)
    return Constraint(kind, spec)


def prefill_request(request, info) -> SamplingParams:
    """PrefillRequest against the engine's CoreInfo; returns its SamplingParams."""
    name(request.request_id, "request_id")
    params = sampling(request.sampling, info.vocab_size, info.max_model_len)
    if not request.token_ids:
        raise invalid("token_ids is empty")
    token_ids(request.token_ids, info.vocab_size, "token_ids", info.max_model_len)
    block_hashes(request.block_hashes)
    tenant_chain(request, len(request.token_ids), info.block_size)
    return params


def decode_request(request, info) -> SamplingParams:
    """DecodeRequest against the engine's CoreInfo; returns its SamplingParams."""
    name(request.request_id, "request_id")
    params = sampling(request.sampling, info.vocab_size, info.max_model_len)
    if not request.prompt_token_ids:
        raise invalid("prompt_token_ids is empty")
    token_ids(request.prompt_token_ids, info.vocab_size, "prompt_token_ids", info.max_model_len)
    token_ids(request.output_prefix, info.vocab_size, "output_prefix", info.max_model_len)
    token_ids([request.first_token], info.vocab_size, "first_token")
    block_hashes(request.block_hashes)
    if len(request.block_hashes) > len(request.prompt_token_ids) // max(1, info.block_size):
        raise invalid(f"block_hashes has {len(request.block_hashes)} entries; the prompt has only "
                      f"{len(request.prompt_token_ids) // max(1, info.block_size)} full blocks")
    address(request.source_kvstore, "source_kvstore")
    tenant_chain(request, len(request.prompt_token_ids), info.block_size)
    return params
