"""Protobuf <-> engine dataclasses (only ember/rpc and services touch generated stubs)."""
from __future__ import annotations

from ember.engine.sampling_params import SamplingParams
from ember.errors import InvalidRequestError
from ember.v1 import common_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Validated SamplingParams; InvalidRequestError (-> INVALID_ARGUMENT) names the bad field."""
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
        )
    except ValueError as e:
        raise InvalidRequestError(f"sampling: {e}") from e


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                   stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        pb.seed = p.seed
    return pb
