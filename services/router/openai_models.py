"""The OpenAI request bodies the router's HTTP API accepts, as pydantic v2 models.

Validation is strict on types (a string is not a number, `true` is not 1) and JSON-mode:
`ChatCompletionRequest.model_validate_json(body)`. Fields OpenAI clients send that Ember does
not use (`user`, `logprobs`, `frequency_penalty`, ...) are accepted and ignored (`extra="allow"`).
Ember's extensions (`extra_body` in the openai client): `user_region`, `session_id`, `top_k`,
`ignore_eos`, `cache_salt` (vLLM's: a secret salting this request's prefix cache). Sizes are
capped (stop strings, messages, tools, logit_bias entries, names; the text itself by the router,
before tokenizing): ember.rpc.validate. `invalid_request` turns a
`ValidationError` into OpenAI's error fields: a message
and `param`, the dotted path of the first offending field (`messages.0.content`, `max_tokens`).

To extend (tool calls, response_format): add a typed field to the model, keeping types out of
unions where a bad value should name one field (a union's errors carry its members' names).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from ember.rpc import validate

DEFAULT_MAX_TOKENS = 256
UINT32 = 2**32
MAX_LOGIT_BIAS = 300   # entries (accepted and ignored: Ember does not bias logits)
MAX_TOOLS = 128
Name = Annotated[str, Field(max_length=validate.MAX_ID_BYTES)]


class OpenAIModel(BaseModel):
    """Strict types, unknown fields kept (and ignored)."""
    model_config = ConfigDict(strict=True, extra="allow")


class ContentPart(OpenAIModel):
    """One part of a message's content: `{"type": "text", "text": ...}`; other parts (images)
    contribute no text."""
    type: str = "text"
    text: str = ""


def _content_parts(value: Any) -> Any:
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    raise PydanticCustomError("content_type", "must be a string or a list of content parts")


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # a string arrives as one text part, so a bad value names this field, not a union member
    content: Annotated[list[ContentPart] | None, BeforeValidator(_content_parts)] = None
    name: Name | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


class StreamOptions(OpenAIModel):
    include_usage: bool = False


def _stop_list(value: Any) -> Any:
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, str):
        return [value]
    raise PydanticCustomError("stop_type", "must be a string or a list of strings")


class GenerationRequest(OpenAIModel):
    """What /v1/chat/completions and /v1/completions share: model, sampling, streaming."""
    model: Name | None = None
    max_tokens: int | None = Field(None, gt=0, lt=UINT32)
    max_completion_tokens: int | None = Field(None, gt=0, lt=UINT32)
    n: int = 1
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=validate.MAX_STOP_STRING_BYTES)]] | None,
                    Field(max_length=validate.MAX_STOP_STRINGS), BeforeValidator(_stop_list)] = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # Ember's extensions
    top_k: int | None = Field(None, ge=0, lt=UINT32)
    ignore_eos: bool = False
    user_region: Name | None = None
    session_id: Name | None = None
    cache_salt: Name | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise PydanticCustomError("unsupported", "only n=1 is supported")
        return n

    @property
    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=validate.MAX_CHAT_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None


def _one_prompt(value: Any) -> Any:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise PydanticCustomError("prompt_type", "must be a string (or a list of one string)")
    return value


class CompletionRequest(GenerationRequest):
    prompt: Annotated[str, BeforeValidator(_one_prompt)]


def invalid_request(error: ValidationError) -> tuple[str, str | None]:
    """OpenAI's `message` and `param` for a validation error."""
    problems = error.errors(include_url=False)
    first = problems[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['ctx'].get('error', first['msg'])}", None
    if not first["loc"]:
        return f"the request body must be a JSON object ({first['msg']})", None

    def where(problem) -> str:
        return ".".join(str(part) for part in problem["loc"])
    message = "; ".join(f"{where(p) or 'body'}: {p['msg']}" for p in problems[:4])
    return message, where(first)
