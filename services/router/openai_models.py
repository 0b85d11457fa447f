"""The OpenAI request bodies the router's HTTP API accepts, as pydantic v2 models.

Validation is strict on types (a string is not a number, `true` is not 1) and JSON-mode:
`ChatCompletionRequest.model_validate_json(body)`. `invalid_request` turns a `ValidationError`
into OpenAI's error fields: a message and `param`, the dotted path of the first offending field
(`messages.0.content`, `max_tokens`); `invalid_request_code` gives its `code`.

Every top-level field is one of three kinds:
- supported: the fields below (and `null` wherever OpenAI allows it);
- defined by OpenAI but not supported by Ember (`audio`, `prediction`, `functions`, `store: true`,
  `best_of` > n, ...): 400 naming the field, code `unsupported_parameter` (any value but null is
  refused) or `unsupported_value` (only the no-op values are accepted: `modalities: ["text"]`,
  `store: false`, `metadata: {}`, `service_tier: "auto" | "default"`, `echo: false`, ...);
- anything else: 400 `Unrecognized request argument supplied: NAME`, param NAME (OpenAI's words).
Nested objects (messages, content parts, tools, response_format) ignore keys they do not know:
clients echo an answer's message back with fields of newer API versions (`refusal`,
`annotations`); a content part other than text (image_url, input_audio, file) is refused, since
the model reads text only.

Ember's extensions (`extra_body` in the openai client): `user_region`, `session_id`, `top_k`,
`ignore_eos`, `cache_salt` (vLLM's: a secret salting this request's prefix cache), `speculative`
(prompt-lookup speculation on or off for this request; unset: the server's default). `user` is
recorded on the request's span and log line. Accepted and not used: `safety_identifier`,
`prompt_cache_key` (the prefix cache needs no hint).
Sizes are capped (stop strings, messages, tools, logit_bias entries, names; the text itself by the
router, before tokenizing): ember.rpc.validate.

What the engine gets, read off the models: `new_tokens`, `engine_logprobs` (None: off; else how
many top alternatives), `logit_bias_ids` ({token id: bias}), `presence_penalty` and
`frequency_penalty` (floats, 0 when unset); chat: `constraint` (("json_schema", schema text) |
("json_object", "") | None), `tools_json`, `tool_choice_mode`, `tool_choice_name`,
`parallel_tool_calls`, and per message `text`, `tool_calls_json`, `tool_call_id`, `name`.

To extend: add a typed field to the model, keeping types out of unions where a bad value should
name one field (a union's errors carry its members' names): a BeforeValidator can bring the
shapes OpenAI allows to one (a string content to a list of parts).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from ember.rpc import validate

DEFAULT_MAX_TOKENS = 256
UINT32 = 2**32
MAX_N = 16             # choices per request
MAX_LOGIT_BIAS = 300   # entries (OpenAI's limit)
MAX_TOOLS = 128
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's logprobs
Name = Annotated[str, Field(max_length=validate.MAX_ID_BYTES)]
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
UNSUPPORTED = ("unsupported_parameter", "unsupported_value")  # the custom error types that are OpenAI codes


def _null_is(default: Any) -> BeforeValidator:
    """A field OpenAI lets be null: null reads as its default."""
    return BeforeValidator(lambda value: default if value is None else value)


class OpenAIModel(BaseModel):
    """A request body: strict types, unknown fields refused."""
    model_config = ConfigDict(strict=True, extra="forbid")


class Nested(BaseModel):
    """An object inside a request: strict types, unknown keys ignored (module docstring)."""
    model_config = ConfigDict(strict=True, extra="ignore")


def problem(kind: str, message: str) -> PydanticCustomError:
    """A validation error of type `kind` with this message (taken as it is: no placeholders)."""
    return PydanticCustomError(kind, message)


def unsupported_parameter(why: str) -> PydanticCustomError:
    return problem("unsupported_parameter", f"not supported: {why}")


def unsupported_value(why: str) -> PydanticCustomError:
    return problem("unsupported_value", f"unsupported value: {why}")


# -- messages ---------------------------------------------------------------------------------------
TEXT_PARTS = frozenset({"text", "refusal"})
OTHER_PARTS = frozenset({"image_url", "input_audio", "file", "image", "audio", "input_image", "input_file"})


class ContentPart(Nested):
    """One part of a message's content: `{"type": "text", "text": ...}` (an assistant's
    `{"type": "refusal", "refusal": ...}` counts as its text); any other kind is refused."""
    type: str = "text"
    text: str = ""
    refusal: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind in OTHER_PARTS:
            raise problem("unsupported_value", f"{kind!r} content is not supported: this model reads text only")
        if kind not in TEXT_PARTS:
            raise problem("content_part_type", f"unknown content part type {kind[:64]!r}: expected 'text'")
        return kind

    @property
    def content(self) -> str:
        return (self.refusal or "") if self.type == "refusal" else self.text


def _content_parts(value: Any) -> Any:
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    raise problem("content_type", "must be a string or a list of content parts")


class FunctionCall(Nested):
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Nested):
    """A call an assistant message made (OpenAI's `tool_calls` entries)."""
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Nested):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # a string arrives as one text part, so a bad value names this field, not a union member
    content: Annotated[list[ContentPart] | None, BeforeValidator(_content_parts)] = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: Name | None = Field(None, validate_default=True)
    # what an assistant's message echoed back may carry: null, or refused
    function_call: Any = None
    audio: Any = None

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, calls: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if calls and info.data.get("role", "assistant") != "assistant":
            raise problem("tool_calls_role", "only assistant messages carry tool_calls")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _tool_answers_a_call(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not call_id:
            raise problem("missing_tool_call_id", "a tool message needs the tool_call_id it answers")
        return call_id

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if value is not None:
            raise unsupported_parameter("the deprecated function_call; use tool_calls")
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value: Any) -> Any:
        if value is not None:
            raise unsupported_parameter("this model reads and writes text only")
        return value

    @property
    def text(self) -> str:
        return "".join(part.content for part in self.content or ())

    @property
    def tool_calls_json(self) -> str:
        """The calls as OpenAI's JSON list (ChatMessage.tool_calls_json); "" when none."""
        return json.dumps([c.model_dump(mode="json") for c in self.tool_calls]) if self.tool_calls else ""


# -- tools and structured output -------------------------------------------------------------------
def _empty_object() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


class FunctionDefinition(Nested):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=_empty_object)  # a JSON Schema
    strict: bool | None = None


class Tool(Nested):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Nested):
    name: FunctionName


TOOL_CHOICE_MODES = ("none", "auto", "required")
NAMED_CHOICE = '{"type": "function", "function": {"name": ...}}'


def _tool_choice(value: Any) -> Any:
    """"none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}: a string
    becomes {"type": mode}, so one model (ToolChoice) reads them all."""
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise problem("tool_choice", f"must be 'none', 'auto', 'required' or {NAMED_CHOICE}, got {value[:64]!r}")
        return {"type": value}
    if isinstance(value, dict) and value.get("type") in TOOL_CHOICE_MODES:
        raise problem("tool_choice", f"the object form names a function: {NAMED_CHOICE}")
    return value


class ToolChoice(Nested):
    type: Literal["none", "auto", "required", "function"]
    function: ToolChoiceFunction | None = Field(None, validate_default=True)

    @field_validator("function")
    @classmethod
    def _named(cls, function: ToolChoiceFunction | None, info: ValidationInfo) -> ToolChoiceFunction | None:
        if function is None and info.data.get("type") == "function":
            raise problem("missing", "Field required")
        return function


class JSONSchemaFormat(Nested):
    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Nested):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_given(cls, schema: JSONSchemaFormat | None, info: ValidationInfo) -> JSONSchemaFormat | None:
        if schema is None and info.data.get("type") == "json_schema":
            raise problem("missing", "Field required with type json_schema")
        return schema


class StreamOptions(Nested):
    include_usage: bool = False


def _stop_list(value: Any) -> Any:
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, str):
        return [value]
    raise problem("stop_type", "must be a string or a list of strings")


Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False), _null_is(0.0)]


# -- the requests ----------------------------------------------------------------------------------
class GenerationRequest(OpenAIModel):
    """What /v1/chat/completions and /v1/completions share: model, sampling, streaming."""
    model: Name | None = None
    max_tokens: int | None = Field(None, gt=0, lt=UINT32)
    max_completion_tokens: int | None = Field(None, gt=0, lt=UINT32)
    n: Annotated[int, Field(ge=1, le=MAX_N), _null_is(1)] = 1
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=validate.MAX_STOP_STRING_BYTES)]] | None,
                    Field(max_length=validate.MAX_STOP_STRINGS), BeforeValidator(_stop_list)] = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # Ember's extensions
    top_k: int | None = Field(None, ge=0, lt=UINT32)
    ignore_eos: bool = False
    speculative: bool | None = None  # prompt-lookup speculation (exact); unset: the server's default
    user_region: Name | None = None
    session_id: Name | None = None
    cache_salt: Name | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or ():
            if not (key.isascii() and key.isdigit() and int(key) < UINT32):
                raise problem("logit_bias_key", f"keys must be token ids (non-negative integers as strings), "
                                                f"got {key[:64]!r}")
        return bias

    @property
    def new_tokens(self) -> int:
        for limit in (self.max_completion_tokens, self.max_tokens):
            if limit is not None:
                return limit  # > 0 (validated): 0 is refused, never read as "unset"
        return DEFAULT_MAX_TOKENS

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    @property
    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off) or how many top alternatives per token."""
        return None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=validate.MAX_CHAT_MESSAGES)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # `tools: []` is read as no tools
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Annotated[ToolChoice | None, BeforeValidator(_tool_choice)] = None
    parallel_tool_calls: Annotated[bool, _null_is(True)] = True
    response_format: ResponseFormat | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    # defined by OpenAI, not supported by Ember
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and info.data.get("logprobs", True) is not True:
            raise problem("top_logprobs", "is only allowed when logprobs is true")
        return top

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if choice is None or "tools" not in info.data:  # (tools itself invalid: that error is the one)
            return choice
        names = [t.function.name for t in info.data["tools"] or ()]
        if choice.type != "none" and not names:
            raise problem("tool_choice", "is only allowed when tools are specified")
        if choice.function is not None and choice.function.name not in names:
            raise problem("tool_choice", f"function {choice.function.name!r} is not one of the tools "
                                         f"({', '.join(names)})")
        return choice

    @field_validator("audio", "prediction", "web_search_options", "functions", "function_call", "reasoning_effort")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        why = {"audio": "this model reads and writes text only",
               "prediction": "predicted outputs are not supported",
               "web_search_options": "Ember does not search the web",
               "functions": "the deprecated functions; use tools",
               "function_call": "the deprecated function_call; use tool_choice",
               "reasoning_effort": "this model does not reason before answering"}[info.field_name]
        if value is not None:
            raise unsupported_parameter(why)
        return value

    @field_validator("modalities", "verbosity", "store", "metadata", "service_tier")
    @classmethod
    def _no_op_only(cls, value: Any, info: ValidationInfo) -> Any:
        allowed, why = {"modalities": ((["text"],), 'only ["text"]: this model writes text only'),
                        "verbosity": (("medium",), "only the default, medium"),
                        "store": ((False,), "only false: Ember does not store completions"),
                        "metadata": (({},), "only {}: metadata goes with stored completions; Ember stores none"),
                        "service_tier": (("auto", "default"), "only auto or default")}[info.field_name]
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise unsupported_value(why)
        return value

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tools_json(self) -> str:
        """The tools as OpenAI's JSON list (ChatInput.tools_json, `parameters` defaulted); "" when none."""
        return json.dumps([t.model_dump(mode="json", exclude_none=True) for t in self.tools]) if self.tools else ""

    @property
    def tool_choice_mode(self) -> str:
        """ChatInput.tool_choice: "none" | "auto" | "required" | "function" (unset: auto with
        tools, none without)."""
        if self.tool_choice is not None:
            return self.tool_choice.type
        return "auto" if self.tools else "none"

    @property
    def tool_choice_name(self) -> str | None:
        """With tool_choice_mode "function": the function that must be called."""
        choice = self.tool_choice
        return choice.function.name if choice is not None and choice.function is not None else None

    @property
    def constraint(self) -> tuple[str, str] | None:
        """The output's constraint from response_format, as SamplingParams.constraint's (kind,
        text): ("json_schema", the schema as JSON), ("json_object", ""), or None (text)."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return "json_object", ""
        return "json_schema", json.dumps(fmt.json_schema.schema_)


def _one_prompt(value: Any) -> Any:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise problem("prompt_type", "must be a string (or a list of one string)")
    return value


class CompletionRequest(GenerationRequest):
    prompt: Annotated[str, BeforeValidator(_one_prompt)]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)  # that many top alternatives
    # defined by OpenAI, not supported by Ember
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, best_of: Any, info: ValidationInfo) -> Any:
        n = info.data.get("n", 1)
        if best_of is None or (type(best_of) is int and best_of == n):
            return best_of  # n of n: a no-op
        if type(best_of) is int and 1 <= best_of < n:
            raise problem("best_of", f"must be at least n ({n})")
        raise unsupported_value("only best_of = n: Ember returns every choice it generates")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: Any) -> Any:
        if echo is not None and echo is not False:
            raise unsupported_value("only false: the prompt is not echoed")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: Any) -> Any:
        if suffix is not None and suffix != "":
            raise unsupported_parameter("Ember does not insert text (suffix)")
        return suffix

    @property
    def engine_logprobs(self) -> int | None:
        return self.logprobs


# -- errors ----------------------------------------------------------------------------------------
def _where(problem) -> str:
    return ".".join(str(part) for part in problem["loc"])


def _unrecognized(problems) -> list[str]:
    return [str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden" and len(p["loc"]) == 1]


def invalid_request(error: ValidationError) -> tuple[str, str | None]:
    """OpenAI's `message` and `param` for a validation error. Unrecognized top-level fields come
    first, in OpenAI's words."""
    problems = error.errors(include_url=False)
    first = problems[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['ctx'].get('error', first['msg'])}", None
    if not first["loc"]:
        return f"the request body must be a JSON object ({first['msg']})", None
    if unknown := _unrecognized(problems):
        plural = "s" if len(unknown) > 1 else ""
        return f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}", unknown[0]
    message = "; ".join(f"{_where(p) or 'body'}: {p['msg']}" for p in problems[:4])
    return message, _where(first) or None


def invalid_request_code(error: ValidationError) -> str | None:
    """OpenAI's `code` for a validation error: unsupported_parameter / unsupported_value when the
    error `invalid_request` reports is a field Ember does not support, else None."""
    problems = error.errors(include_url=False)
    if not problems or not problems[0]["loc"] or _unrecognized(problems):
        return None
    return problems[0]["type"] if problems[0]["type"] in UNSUPPORTED else None
