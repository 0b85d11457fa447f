"""OpenAI tool calling: prompt rendering, the decoding grammar, and the streaming call parser.

Model-free and torch-free (the router imports it); the grammar is returned as Lark text in
llguidance's dialect, which the engine compiles and applies as a token mask every step.

The call format
---------------
A model answers a tool call as one line of text::

    <tool_call>{"name": "NAME", "arguments": ARGS}</tool_call>

where NAME is the function's name and ARGS its arguments, a JSON object, written the way
`json.dumps` writes by default: a single space after every `:` and `,`, and no other whitespace.
When parallel calls are allowed an answer may hold several calls, separated by "\\n", each in
its own tags::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
    <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>

An answer is either calls or plain text, never both (under the grammar; see `grammar`).

The grammar (`grammar`)
-----------------------
Lark text in llguidance's dialect for the whole answer. "required": one call (or several,
"\n"-separated, when parallel calls are allowed) of any offered function; "function": the
same, of the named function only; "none": no grammar (and no tools offered). "auto": either
that, or plain text -- and the text may not contain "<tool_call>" anywhere. That is the
restriction: a model that starts answering in text has chosen text and cannot call a function
later in the same answer (text may still start with "<", e.g. "<b>", or with "<tool"). Inside a
call the header `{"name": "NAME", "arguments": ` is forced literally and ARGS is JSON matching
the function's `parameters` schema, laid out exactly as json.dumps does (see JSON_OPTIONS).

Rendering (`render`)
--------------------
A chat template that knows tools (its source mentions `tools`, as Hugging Face tool-calling
templates do) gets `tools=` and the messages as-is, with each tool call's `arguments` parsed
into a dict (what those templates expect). For a template that knows no tools (SmolLM2's plain
ChatML), the tools are written into the system prompt (appended to the first message when that
is a system/developer message, else in a new system message first) as::

    # Tools

    You may call functions to help with the user's request. Their signatures, one JSON
    object per line:
    <tools>
    {"type": "function", "function": {"name": "get_weather", ...}}
    </tools>

    To call a function, answer with exactly this, and nothing else:
    <tool_call>{"name": "FUNCTION_NAME", "arguments": ARGUMENTS_AS_A_JSON_OBJECT}</tool_call>
    To call several functions, write one such line per call. Function results come back in
    <tool_response></tool_response> tags. When no function is needed, answer in plain text.

(the text is `TOOLS_PROMPT`; `<tools>` holds `json.dumps(tool)` of each OpenAI tool definition,
non-ASCII characters unescaped). An assistant message with `tool_calls` becomes text: its
content (if any), then each call in the call format, joined by "\\n". A `tool` message becomes a
`user` message::

    <tool_response>
    {"tool_call_id": "call_...", "name": "get_weather", "content": "..."}
    </tool_response>

(its `name`, when the message lacks one, is the name of the call it answers); consecutive tool
messages become one user message, their blocks joined by "\\n".

Parsing (`ToolCallParser`, `parse`)
-----------------------------------
The parser reads the answer text as it streams and splits it into content and tool-call deltas
(`Delta`, which mirrors router_pb2.ToolCallDelta). It accepts the call format above and is
lenient about whitespace around the JSON (`<tool_call>\\n{...}\\n</tool_call>`, as Hermes-style
models write without the grammar); the "name" key must come before "arguments". It also finds
a call that follows text (the grammar never produces one; a model without it may). Whitespace
before the first call, between calls and after the last is part of the call syntax, not content.
Text that does not turn out to be a well-formed call is content: with the grammar on that never
happens, but without it a malformed or unfinished call's raw text is returned as content (at
`finish()` for an unfinished one), so no text is ever lost -- deltas already streamed for such a
call (once its name was complete) are not retracted, it is not in `calls`, and its index is not
reused by the next call.
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ember.errors import InvalidRequestError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"

TOOLS_PROMPT = """# Tools

You may call functions to help with the user's request. Their signatures, one JSON object per line:
<tools>
{tools}
</tools>

To call a function, answer with exactly this, and nothing else:
<tool_call>{{"name": "FUNCTION_NAME", "arguments": ARGUMENTS_AS_A_JSON_OBJECT}}</tool_call>
To call several functions, write one such line per call. Function results come back in \
<tool_response></tool_response> tags. When no function is needed, answer in plain text."""

TOOL_CHOICES = ("auto", "none", "required", "function")


# ---------------------------------------------------------------------------------------------
# Rendering


def template_knows_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools itself (its source mentions `tools`)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def function_of(tool: dict) -> dict:
    """The function definition of an OpenAI tool ({"type": "function", "function": {...}});
    a bare function definition ({"name": ..., "parameters": ...}) is accepted too."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequestError(f"a tool needs a function with a name: {tool!r}")
    return fn


def format_call(name: str, arguments: str | dict) -> str:
    """One call in Ember's call format; `arguments` is JSON text (normalised to json.dumps'
    layout when it parses) or a dict."""
    return f'{TOOL_CALL_OPEN}{_call_head(name)}{_arguments_text(arguments)}}}{TOOL_CALL_CLOSE}'


def tools_prompt(tools: list[dict]) -> str:
    """The system-prompt block that offers `tools` to a template that knows no tools."""
    for tool in tools:
        function_of(tool)
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def render(messages: list[dict], tools: list[dict] | None, knows_tools: bool) -> tuple[list[dict], dict]:
    """OpenAI-style messages (role, content (str, None or text parts), tool_calls, tool_call_id,
    name) -> (the messages the chat template gets, each with 'role' and string 'content';
    extra keyword arguments for the template). See the module docstring for the formats."""
    tools = tools or None
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or ()):
            _check_call(call, f"messages[{i}].tool_calls[{j}]")
    if knows_tools:
        out = []
        for m in messages:
            rendered = {**m, "content": _content_text(m.get("content"))}
            if m.get("tool_calls"):
                rendered["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _parse_arguments(c["function"].get("arguments"))}}
                    for c in m["tool_calls"]]
            out.append(rendered)
        return out, ({"tools": tools} if tools else {})

    out: list[dict] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for tool messages without one
    last_was_tool = False
    for m in messages:
        role = m.get("role")
        if role == "tool":
            call_id = m.get("tool_call_id") or ""
            block = "<tool_response>\n" + json.dumps(
                {"tool_call_id": call_id, "name": m.get("name") or call_names.get(call_id, ""),
                 "content": _content_text(m.get("content"))}, ensure_ascii=False) + "\n</tool_response>"
            if last_was_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            last_was_tool = True
            continue
        last_was_tool = False
        if role == "assistant" and m.get("tool_calls"):
            parts = [text] if (text := _content_text(m.get("content"))) else []
            for c in m["tool_calls"]:
                fn = c.get("function") or {}
                if c.get("id"):
                    call_names[c["id"]] = fn.get("name", "")
                parts.append(format_call(fn.get("name", ""), fn.get("arguments") or "{}"))
            out.append({"role": "assistant", "content": CALL_SEPARATOR.join(parts)})
            continue
        rendered = {**m, "content": _content_text(m.get("content"))}
        if "tool_calls" in rendered:  # present but empty
            del rendered["tool_calls"]
        out.append(rendered)
    if tools:
        block = tools_prompt(tools)
        if out and out[0].get("role") in ("system", "developer"):
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, {}


def _check_call(call, where: str) -> None:
    """InvalidRequestError unless `call` is a past tool call as OpenAI defines one: an object whose
    `function` is an object with a string `name` (its `arguments` are kept whatever they are)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"{where} needs a function object with a string name, got {call!r:.200}")


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts carry over
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError(f"only text content parts are supported, not {part!r}")
            texts.append(part.get("text") or "")
        return "".join(texts)
    raise InvalidRequestError(f"message content must be a string, null or a list of text parts, not {content!r}")


def _parse_arguments(arguments):
    """A call's arguments as HF templates expect them (a dict); JSON text that does not parse
    stays text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


def _arguments_text(arguments) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments  # kept verbatim: the history says what it says
    return json.dumps(arguments, ensure_ascii=False)


def _call_head(name: str) -> str:
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


# ---------------------------------------------------------------------------------------------
# The grammar

# JSON layout inside the arguments. llguidance's default lets JSON whitespace be anything
# anywhere ([ \t\n\r]+ between every token), and a small model under a mask wanders into it:
# newlines and runs of spaces that it never saw in the prompt, sometimes never closing. So the
# layout is fixed to exactly json.dumps' default -- no whitespace except one space after `:`
# and after `,` -- the same text the prompt shows for past calls (format_call) and the call
# header the grammar forces (`{"name": "X", "arguments": `), so the model continues a pattern
# it has in context. (The separators are regexes to llguidance; ": " and ", " are literal.)
# `lenient`: schema keywords llguidance does not implement (exotic `format`s, ...) are ignored
# rather than failing the request; the arguments then satisfy every keyword it does implement.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", ", "lenient": True}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _lark_string(text: str) -> str:
    return json.dumps(text)  # llguidance reads Lark string literals with JSON escapes


def _arguments_schema(fn: dict) -> dict:
    params = fn.get("parameters")
    params = params if isinstance(params, dict) and params else NO_PARAMETERS
    if not isinstance(params.get("x-guidance") or {}, dict):
        raise InvalidRequestError(f"function {fn['name']!r}: parameters.x-guidance must be an object of "
                                  f"llguidance options, got {params['x-guidance']!r:.200}")
    schema = {"x-guidance": {**(params.get("x-guidance") or {}), **JSON_OPTIONS}}  # ours win
    schema.update((k, v) for k, v in params.items() if k != "x-guidance")
    schema.setdefault("type", "object")  # ARGS is always an object
    return schema


def _not_containing(needle: str) -> str:
    """A Lark terminal body: any text that does not contain `needle`. (`~` is llguidance's
    negation; intersecting with /(?s:.*)/ keeps it to valid UTF-8, as its docs advise.)"""
    return f"/(?s:.*)/ & ~/(?s:.*){re.escape(needle)}(?s:.*)/"


def grammar(tools: list[dict], choice: str, name: str | None = None, parallel: bool = True) -> str | None:
    """The Lark grammar (llguidance's dialect) the whole answer must match, or None (choice
    "none": unconstrained, and the caller offers no tools).

    "required": one call (when `parallel`, up to one per offered function, separated by "\\n") of any
    offered function;
    "function": exactly one call, of function `name` (as vLLM does for a named tool_choice: a small
    model offered "\\n" and another call tends to repeat the call until max_tokens cuts it, and a
    cut call does not parse); "auto": either what "required" allows, or plain text, which
    must not contain "<tool_call>" anywhere (so text never starts a call, and a model that
    begins to answer in text cannot call later in that answer). Each call is the literal
    `<tool_call>{"name": "NAME", "arguments": ` + JSON matching that function's `parameters`
    (an embedded `%json` schema; none given: `{}` only) + `}</tool_call>`.
    """
    if choice == "none":
        return None
    if choice not in TOOL_CHOICES:
        raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, not {choice!r}")
    functions = [function_of(t) for t in tools or []]
    if choice == "function":
        functions = [fn for fn in functions if fn["name"] == name][:1]
        if not functions:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")
    if not functions:
        raise ValueError("tool calling needs at least one tool")
    by_name: dict[str, dict] = {}
    for fn in functions:
        by_name.setdefault(fn["name"], fn)  # a repeated name: the first definition counts
    functions = list(by_name.values())

    # Parallel calls: at most one per offered function. SmolLM2, even greedy, follows a call with
    # "\n" (p ~ 0.9) and then another call, repeating its calls until max_tokens cuts one in half;
    # the cap ends the answer whole. (A named function: exactly one call, as vLLM does.)
    most = len(functions) if parallel and choice != "function" else 1
    more = ""
    for _ in range(most - 1):
        more = f" ({_lark_string(CALL_SEPARATOR)} call{more})?"
    lines = ["start: calls | TEXT" if choice == "auto" else "start: calls",
             f"calls: call{more}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        lines.append(f"call_{i}: {_lark_string(TOOL_CALL_OPEN + _call_head(fn['name']))} args_{i} "
                     f"{_lark_string('}' + TOOL_CALL_CLOSE)}")
        lines.append(f"args_{i}: %json {json.dumps(_arguments_schema(fn))}")
    if choice == "auto":
        lines.append(f"TEXT: {_not_containing(TOOL_CALL_OPEN)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Parsing


@dataclass
class Delta:
    """A piece of a tool call, as router_pb2.ToolCallDelta: `id` and `name` on a call's first
    delta, then `arguments` fragments; concatenated per index they are the call's ARGS text."""
    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # the ARGS JSON text, exactly as the model wrote it


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_WS = " \t\n\r"
_CONTENT, _HEAD, _ARGS, _TAIL = range(4)


class ToolCallParser:
    """Splits an answer's text, fed incrementally, into content and tool-call deltas.

    feed(text) -> (content, deltas): the content that is certain by now (text is held back only
    while it could still be the start of "<tool_call>", or is whitespace that may yet separate
    calls), and the deltas: a call's first delta (fresh id, name) as soon as its
    `{"name": "X", "arguments": ` is complete, then its argument text as it arrives (the ARGS
    object is tracked by its JSON structure, so none of it is held back). Deltas of one call
    within one feed are merged into one. finish() flushes the rest. `calls`: the completed
    calls. See the module docstring for the format and the handling of malformed calls.
    """

    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self._new_id = new_id
        self._state = _CONTENT
        self._buf = ""            # content state: text not yet emitted
        self._raw = ""            # inside a call: its text so far, from "<tool_call>"
        self._lead = ""           # the whitespace held before it
        self._hold_ws = True      # at the start or after a call: whitespace may be a separator
        self._calls: list[ToolCall] = []
        self._index = 0           # the next call's index (a failed call that streamed deltas uses one)
        self._id = self._name = ""
        self._args: list[str] = []
        self._depth = 0
        self._in_string = self._escape = False
        self._tail = ""
        self._streamed = False

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        content: list[str] = []
        deltas: list[Delta] = []
        self._run(text, content, deltas)
        return "".join(content), _merge(deltas)

    def finish(self) -> tuple[str, list[Delta]]:
        content: list[str] = []
        deltas: list[Delta] = []
        if self._state != _CONTENT and self._streamed:
            # cut short (max_tokens, a stop string) after its deltas went out: the call stays, with the
            # arguments as far as they got (as OpenAI returns a call cut by finish_reason "length")
            self._calls.append(ToolCall(self._id, self._name, "".join(self._args)))
            self._index += 1
            self._state = _CONTENT
            self._raw = self._lead = self._buf = ""
            self._streamed = False
        elif self._state != _CONTENT:  # an unfinished call before its name: its raw text is content
            content.append(self._lead + self._raw)
            self._abandon_call()
        elif self._buf and not (self._hold_ws and self._calls and not self._buf.strip(_WS)):
            content.append(self._buf)  # trailing whitespace after calls is a separator
        self._buf = ""
        self._hold_ws = False
        return "".join(content), deltas

    # -- the state machine

    def _run(self, text: str, content: list[str], deltas: list[Delta]) -> None:
        pending = text
        while pending:
            if self._state == _CONTENT:
                pending = self._scan_content(pending, content)
            elif self._state == _HEAD:
                pending = self._scan_head(pending, content, deltas)
            elif self._state == _ARGS:
                pending = self._scan_args(pending, content, deltas)
            else:
                pending = self._scan_tail(pending, content)

    def _scan_content(self, text: str, content: list[str]) -> str:
        buf = self._buf + text
        at = buf.find(TOOL_CALL_OPEN)
        if at >= 0:
            before = buf[:at]
            separator = self._hold_ws and not before.strip(_WS)
            if before and not separator:
                content.append(before)
            self._buf = ""
            self._start_call()
            self._lead = before if separator else ""  # content after all, should the call fail
            return buf[at + len(TOOL_CALL_OPEN):]
        keep = _partial_suffix(buf, TOOL_CALL_OPEN)
        ready = buf[:len(buf) - keep]
        if self._hold_ws and not ready.strip(_WS):
            self._buf = buf  # only whitespace so far: it may still precede a call
            return ""
        content.append(ready)
        self._hold_ws = False
        self._buf = buf[len(ready):]
        return ""

    def _start_call(self) -> None:
        self._state = _HEAD
        self._raw = TOOL_CALL_OPEN
        self._id = self._name = ""
        self._args = []
        self._depth = 0
        self._in_string = self._escape = False
        self._tail = ""
        self._streamed = False

    def _scan_head(self, text: str, content: list[str], deltas: list[Delta]) -> str:
        self._raw += text
        head = self._raw[len(TOOL_CALL_OPEN):]
        result = _match_head(head)
        if result is None:  # needs more text
            return ""
        if result is False:
            return self._fail(content)
        name, end = result
        self._name, self._id = name, self._new_id()
        self._streamed = True
        deltas.append(Delta(self._index, self._id, name, ""))
        self._state = _ARGS
        self._raw = TOOL_CALL_OPEN + head[:end]
        return head[end:]  # the ARGS (the head was incomplete before this feed, so this is new text)

    def _scan_args(self, text: str, content: list[str], deltas: list[Delta]) -> str:
        fragment_start = None
        for i, ch in enumerate(text):
            if not self._args and fragment_start is None:
                if ch in _WS:
                    self._raw += ch
                    continue
                if ch != "{":
                    return self._fail(content, rest=text[i:])
            if fragment_start is None:
                fragment_start = i
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    fragment = text[fragment_start:i + 1]
                    self._args.append(fragment)
                    self._raw += fragment
                    deltas.append(Delta(self._index, arguments=fragment))
                    self._state = _TAIL
                    return text[i + 1:]
        if fragment_start is not None:
            fragment = text[fragment_start:]
            self._args.append(fragment)
            self._raw += fragment
            deltas.append(Delta(self._index, arguments=fragment))
        return ""

    def _scan_tail(self, text: str, content: list[str]) -> str:
        for i, ch in enumerate(text):
            self._tail += ch
            self._raw += ch
            state = _match_tail(self._tail)
            if state is False:
                return self._fail(content, rest=text[i + 1:])
            if state is True:
                self._calls.append(ToolCall(self._id, self._name, "".join(self._args)))
                self._index += 1
                self._state = _CONTENT
                self._raw = self._lead = ""
                self._hold_ws = True
                return text[i + 1:]
        return ""

    def _fail(self, content: list[str], rest: str = "") -> str:
        """Not a call after all: the opening tag is content, and the text after it is scanned
        again as content (it may hold another call)."""
        content.append(self._lead + TOOL_CALL_OPEN)
        again = self._raw[len(TOOL_CALL_OPEN):] + rest
        self._abandon_call()
        self._hold_ws = False
        return again

    def _abandon_call(self) -> None:
        if self._streamed:
            self._index += 1  # its deltas went out under this index: never reuse it
        self._state = _CONTENT
        self._raw = self._lead = self._buf = ""


def parse(text: str, new_id: Callable[[], str] = new_call_id) -> tuple[str, list[ToolCall]]:
    """A whole answer -> (its content, its tool calls)."""
    parser = ToolCallParser(new_id)
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    return content + rest, parser.calls


def _merge(deltas: list[Delta]) -> list[Delta]:
    merged: list[Delta] = []
    for d in deltas:
        if merged and merged[-1].index == d.index and not d.id:
            merged[-1].arguments += d.arguments
        else:
            merged.append(Delta(d.index, d.id, d.name, d.arguments))
    return merged


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _match_head(head: str):
    """Match `{"name": "X", "arguments":` (any JSON whitespace between tokens) at the start of
    `head`: (name, end) when complete, None when `head` may still become it, False when not."""
    pos = 0
    n = len(head)

    def skip_ws(p):
        while p < n and head[p] in _WS:
            p += 1
        return p

    def literal(p, lit):
        got = head[p:p + len(lit)]
        if not lit.startswith(got):
            return False
        return p + len(lit) if len(got) == len(lit) else None

    name = None
    for step in ("{", '"name"', ":", "STRING", ",", '"arguments"', ":"):
        pos = skip_ws(pos)
        if pos >= n:
            return None
        if step == "STRING":
            if head[pos] != '"':
                return False
            p, escape = pos + 1, False
            while p < n and (escape or head[p] != '"'):
                escape = not escape and head[p] == "\\"
                p += 1
            if p >= n:
                return None
            try:
                name = json.loads(head[pos:p + 1])
            except ValueError:
                return False
            pos = p + 1
        else:
            end = literal(pos, step)
            if end is None or end is False:
                return end
            pos = end
    return name, pos


def _match_tail(tail: str):
    """Whether `tail` (the text after a call's ARGS) is `}</tool_call>` with optional whitespace
    before and after the `}`: True when complete, None when it may still become it, else False."""
    stripped = tail.lstrip(_WS)
    if not stripped:
        return None
    if stripped[0] != "}":
        return False
    rest = stripped[1:].lstrip(_WS)
    if not rest:
        return None
    if not TOOL_CALL_CLOSE.startswith(rest[:len(TOOL_CALL_CLOSE)]):
        return False
    return True if len(rest) >= len(TOOL_CALL_CLOSE) else None
