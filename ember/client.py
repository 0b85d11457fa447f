"""A small synchronous client for the router's public gRPC API.

`api_key`: the router's API key (sent as `authorization: Bearer KEY` metadata on every call),
needed when the router has keys configured. `ca`: a CA file (PEM) to trust for a router serving TLS
(router.tls; `ember up` prints the file, RUN_DIR/certs/ca.crt for `auto`), else plaintext;
EMBER_ROUTER_CA gives the same default to `ember generate`.

Constrained output: `json_schema` (a dict or its JSON text), `json_object=True`, `regex` or `lark`
(llguidance's Lark dialect). Tools: `messages` as OpenAI writes them (assistant `tool_calls`, `tool`
messages with `tool_call_id`), `tools` (OpenAI's list), `tool_choice` ("auto", "none", "required" or a
function's name), `parallel_tool_calls`; the answer's calls are in `Completion.tool_calls`.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ember.v1 import common_pb2, router_pb2, router_pb2_grpc


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    final: router_pb2.GenerateResponse  # finish reason, usage, timings, placement
    tool_calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments"} (arguments: JSON text)
    logprobs: list = field(default_factory=list)  # common_pb2.TokenLogprob per token, when asked for


def router_channel(address: str, ca: str | Path | bytes | None = None, options=None) -> grpc.Channel:
    """A channel to a router's public gRPC port: TLS trusting the CA `ca` (a PEM file or its bytes;
    the server's certificate must name the address's host), plaintext when `ca` is None."""
    if ca is None:
        return grpc.insecure_channel(address, options=options)
    pem = ca if isinstance(ca, bytes) else Path(ca).read_bytes()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=pem), options=options)


class RouterClient:
    def __init__(self, address: str, api_key: str | None = None, ca: str | Path | bytes | None = None):
        self.channel = router_channel(address, ca)
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
               cache_salt: str = "", timeout: float | None = None, json_schema: dict | str | None = None,
               json_object: bool = False, regex: str | None = None, lark: str | None = None,
               logprobs: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               logit_bias: dict[int, float] | None = None, tools: list[dict] | None = None,
               tool_choice: str | None = None, parallel_tool_calls: bool | None = None,
               speculative: bool | None = None) -> Iterator[router_pb2.GenerateResponse]:
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                             top_k=top_k, stop=stop or [], ignore_eos=ignore_eos,
                                             presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                             logit_bias=logit_bias or {})
        if seed is not None:
            sampling.seed = seed
        if speculative is not None:
            sampling.speculative = speculative
        if logprobs is not None:
            sampling.logprobs = logprobs
        if json_schema is not None:
            sampling.constraint.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        elif json_object:
            sampling.constraint.json_object = True
        elif regex is not None:
            sampling.constraint.regex = regex
        elif lark is not None:
            sampling.constraint.lark = lark
        request = router_pb2.GenerateRequest(sampling=sampling, user_region=user_region, session_id=session_id,
                                             request_id=request_id, cache_salt=cache_salt)
        if messages is not None:
            request.chat.messages.extend(_message(m) for m in messages)
            if tools:
                request.chat.tools_json = json.dumps(tools)
            if tool_choice in ("auto", "none", "required"):
                request.chat.tool_choice = tool_choice
            elif tool_choice:
                request.chat.tool_choice, request.chat.tool_choice_name = "function", tool_choice
            if parallel_tool_calls is not None:
                request.chat.parallel_tool_calls = parallel_tool_calls
        elif token_ids is not None:
            request.tokens.token_ids.extend(token_ids)
        elif text is not None:
            request.text = text
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def models(self, timeout: float | None = None) -> list[router_pb2.ModelInfo]:
        return list(self.stub.ListModels(router_pb2.ListModelsRequest(), timeout=timeout,
                                         metadata=self.metadata).models)

    def complete(self, *args, **kwargs) -> Completion:
        token_ids, parts, final, calls, logprobs = [], [], None, {}, []
        for msg in self.stream(*args, **kwargs):
            token_ids.extend(msg.token_ids)
            parts.append(msg.text)
            logprobs.extend(msg.logprobs)
            for d in msg.tool_calls:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
                call["arguments"] += d.arguments
            final = msg
        return Completion(token_ids, "".join(parts), final, [calls[i] for i in sorted(calls)], logprobs)


def _message(m: dict) -> router_pb2.ChatMessage:
    """An OpenAI-style message dict as the router's ChatMessage."""
    return router_pb2.ChatMessage(role=m["role"], content=m.get("content") or "",
                                  tool_calls_json=json.dumps(m["tool_calls"]) if m.get("tool_calls") else "",
                                  tool_call_id=m.get("tool_call_id", ""), name=m.get("name", ""))
