"""A small synchronous client for the router's public gRPC API.

`api_key`: the router's API key (sent as `authorization: Bearer KEY` metadata on every call),
needed when the router has keys configured.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from ember.v1 import common_pb2, router_pb2, router_pb2_grpc


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    final: router_pb2.GenerateResponse  # finish reason, usage, timings, placement


class RouterClient:
    def __init__(self, address: str, api_key: str | None = None):
        self.channel = grpc.insecure_channel(address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stream(self, text: str | None = None, *, messages: list[dict] | None = None,
               token_ids: list[int] | None = None, max_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
               ignore_eos: bool = False, user_region: str = "", session_id: str = "", request_id: str = "",
               cache_salt: str = "", timeout: float | None = None) -> Iterator[router_pb2.GenerateResponse]:
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                             top_k=top_k, stop=stop or [], ignore_eos=ignore_eos)
        if seed is not None:
            sampling.seed = seed
        request = router_pb2.GenerateRequest(sampling=sampling, user_region=user_region, session_id=session_id,
                                             request_id=request_id, cache_salt=cache_salt)
        if messages is not None:
            request.chat.messages.extend(router_pb2.ChatMessage(**m) for m in messages)
        elif token_ids is not None:
            request.tokens.token_ids.extend(token_ids)
        elif text is not None:
            request.text = text
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def models(self, timeout: float | None = None) -> list[router_pb2.ModelInfo]:
        return list(self.stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout,
                                         metadata=self.metadata).models)

    def complete(self, *args, **kwargs) -> Completion:
        token_ids, parts, final = [], [], None
        for msg in self.stream(*args, **kwargs):
            token_ids.extend(msg.token_ids)
            parts.append(msg.text)
            final = msg
        return Completion(token_ids, "".join(parts), final)
