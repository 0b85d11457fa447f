"""Protobuf <-> engine dataclasses (only ember/rpc and services touch generated stubs)."""
from __future__ import annotations

from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import NO_TENANT, Tenant
from ember.rpc import validate
from ember.v1 import common_pb2


def sampling_from_pb(pb: common_pb2.SamplingParams, vocab_size: int | None = None,
                     max_model_len: int | None = None) -> SamplingParams:
    """Validated SamplingParams; InvalidRequestError (-> INVALID_ARGUMENT) names the bad field.
    The checks and caps are ember.rpc.validate.sampling's."""
    return validate.sampling(pb, vocab_size, max_model_len)


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                   stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        pb.seed = p.seed
    if p.constraint is not None:
        c = p.constraint
        setattr(pb.constraint, c.kind, True if c.kind == "json_object" else c.spec)
    if p.logprobs is not None:
        pb.logprobs = p.logprobs
    pb.presence_penalty, pb.frequency_penalty = p.presence_penalty, p.frequency_penalty
    pb.logit_bias.update(dict(p.logit_bias))
    if p.speculative is not None:
        pb.speculative = p.speculative
    return pb


def logprobs_to_pb(logprobs) -> list[common_pb2.TokenLogprob]:
    """ember.engine.outputs.TokenLogprob entries (None: none) as protobufs."""
    return [common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=lp.top_ids,
                                    top_logprobs=lp.top_logprobs) for lp in logprobs or ()]


def tenant_of(request) -> Tenant:
    """A Prefill/DecodeRequest's tenant and weight (0: 1) for the engine's fair queue."""
    return Tenant(request.tenant, request.tenant_weight or 1.0) if request.tenant else NO_TENANT
