"""Tool calling (services/router/tools.py): rendering, the grammar under llguidance, the parser."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import llguidance as llg
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from ember.model.fetch import DEFAULT_MODEL_PATH, fetch_default_model
from ember.model.files import model_folder
from ember.model.tokenizer import Tokenizer
from ember.services.router import tools as T

N_VOCAB, EOS = 49152, 2


def fn_tool(name, parameters=None, description=""):
    fn = {"name": name, "description": description}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


WEATHER = fn_tool("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}, "The weather in a city")
TOOLS = [
    WEATHER,
    fn_tool("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
                    "required": ["a", "b"], "additionalProperties": False}, "a + b"),
    fn_tool("search", {"type": "object",
                       "properties": {"query": {"type": "string", "maxLength": 10},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "maxItems": 2}},
                       "required": ["query"], "additionalProperties": False}),
    fn_tool("ping"),  # no parameters: arguments {} only
]
PARAMS = {t["function"]["name"]: t["function"].get("parameters", T.NO_PARAMETERS) for t in TOOLS}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    folder = model_folder(DEFAULT_MODEL_PATH)
    if not (folder / "tokenizer.json").exists():
        from ember.model.files import ensure_gguf_cache
        folder = ensure_gguf_cache(fetch_default_model(DEFAULT_MODEL_PATH))
    return Tokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def lltok(tok):
    return llg.LLTokenizer(tok.backend.to_str(), n_vocab=N_VOCAB, eos_token=EOS)


# -------------------------------------------------------------------------------------------
# Rendering

SYSTEM_TOOLS = (
    "# Tools\n\n"
    "You may call functions to help with the user's request. Their signatures, one JSON object per line:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, '
    '"unit": {"enum": ["c", "f"]}}, "required": ["city"], "additionalProperties": false}}}\n'
    "</tools>\n\n"
    "To call a function, answer with exactly this, and nothing else:\n"
    '<tool_call>{"name": "FUNCTION_NAME", "arguments": ARGUMENTS_AS_A_JSON_OBJECT}</tool_call>\n'
    "To call several functions, write one such line per call. Function results come back in "
    "<tool_response></tool_response> tags. When no function is needed, answer in plain text.")

HISTORY = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_template_knows_tools(tok):
    assert not T.template_knows_tools(tok.chat_template)  # SmolLM2: plain ChatML
    assert not T.template_knows_tools(None) and not T.template_knows_tools("")
    assert T.template_knows_tools("{% if tools %}{{ tools | tojson }}{% endif %}")


def test_plain_messages_pass_through():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}]
    assert T.render(msgs, None, False) == (msgs, {})
    assert T.render(msgs, [], False) == (msgs, {})


def test_two_turn_history_renders_to_the_documented_text(tok):
    messages, kwargs = T.render(HISTORY, [WEATHER], knows_tools=False)
    assert kwargs == {}
    assert messages == [
        {"role": "system", "content": SYSTEM_TOOLS},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant",
         "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'},
        {"role": "user", "content": '<tool_response>\n{"tool_call_id": "call_1", "name": "get_weather", '
                                    '"content": "18 C, sunny"}\n</tool_response>'},
    ]
    assert tok.apply_chat_template(messages, **kwargs) == (
        "<|im_start|>system\n" + SYSTEM_TOOLS + "<|im_end|>\n"
        "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        "<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"tool_call_id": "call_1", "name": "get_weather", '
        '"content": "18 C, sunny"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")


def test_tools_join_an_existing_system_or_developer_message():
    for role in ("system", "developer"):
        messages, _ = T.render([{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}],
                               [WEATHER], False)
        assert messages == [{"role": role, "content": "Be brief.\n\n" + SYSTEM_TOOLS},
                            {"role": "user", "content": "hi"}]


def test_parallel_calls_and_consecutive_tool_results():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Paris "}, {"type": "text", "text": "and Oslo?"}]},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "18"},
        {"role": "tool", "tool_call_id": "b", "name": "weather", "content": [{"type": "text", "text": "9"}]},
        {"role": "assistant", "content": "Paris 18, Oslo 9."},
    ]
    messages, kwargs = T.render(history, None, False)  # no tools offered now: no system prompt
    assert kwargs == {}
    assert messages == [
        {"role": "user", "content": "Paris and Oslo?"},
        {"role": "assistant", "content": "Checking.\n"
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'},
        {"role": "user", "content":
         '<tool_response>\n{"tool_call_id": "a", "name": "get_weather", "content": "18"}\n</tool_response>\n'
         '<tool_response>\n{"tool_call_id": "b", "name": "weather", "content": "9"}\n</tool_response>'},
        {"role": "assistant", "content": "Paris 18, Oslo 9."},
    ]


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} city={{ c.function.arguments.city }}]"
    "{% endfor %}<|im_end|>\n{% endfor %}")


def test_a_template_that_knows_tools_gets_them(tok):
    assert T.template_knows_tools(TOOLS_TEMPLATE)
    messages, kwargs = T.render(HISTORY, [WEATHER], knows_tools=True)
    assert kwargs == {"tools": [WEATHER]}
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == HISTORY[2]
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'  # input untouched
    rendered = Tokenizer(tok.backend, TOOLS_TEMPLATE, None, None).apply_chat_template(
        messages, add_generation_prompt=False, **kwargs)
    assert rendered == ("<|im_start|>system\nget_weather;<|im_end|>\n"
                        "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n"
                        "<|im_start|>assistant\n[call_1 get_weather city=Paris]<|im_end|>\n"
                        "<|im_start|>tool\n18 C, sunny<|im_end|>\n")


# -------------------------------------------------------------------------------------------
# Grammar


def compiled(g: str) -> str:
    grammar = llg.LLMatcher.grammar_from_lark(g)
    assert llg.LLMatcher.validate_grammar(grammar) == ""
    return grammar


def accepts(lltok, tok, g: str, text: str) -> bool:
    m = llg.LLMatcher(lltok, compiled(g), log_level=0)
    return m.consume_tokens(tok.encode(text)) and m.is_accepting()


CONFIGS = [(choice, parallel) for choice in ("auto", "required", "function") for parallel in (True, False)]


def test_grammar_for_none_is_none():
    assert T.grammar(TOOLS, "none", None, True) is None


@pytest.mark.parametrize("choice,parallel", CONFIGS)
def test_grammars_validate(choice, parallel, lltok):
    g = T.grammar(TOOLS, choice, "add" if choice == "function" else None, parallel)
    grammar = compiled(g)
    assert llg.LLMatcher.validate_grammar(grammar, lltok) == ""
    assert not llg.LLMatcher(lltok, grammar, log_level=0).is_error()


def test_grammar_text_for_one_required_tool():
    assert T.grammar([WEATHER], "required", None, False) == (
        'start: calls\n'
        'calls: call\n'
        'call: call_0\n'
        'call_0: "<tool_call>{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 "}</tool_call>"\n'
        'args_0: %json {"x-guidance": {"whitespace_flexible": false, "key_separator": ": ", '
        '"item_separator": ", ", "lenient": true}, "type": "object", "properties": {"city": {"type": "string", '
        '"maxLength": 12}, "unit": {"enum": ["c", "f"]}}, "required": ["city"], "additionalProperties": false}\n')


def test_grammar_rejects_bad_requests():
    with pytest.raises(ValueError):
        T.grammar(TOOLS, "sometimes", None, True)
    with pytest.raises(ValueError):
        T.grammar(TOOLS, "function", "nope", True)
    with pytest.raises(ValueError):
        T.grammar([], "required", None, True)
    with pytest.raises(ValueError):
        T.grammar([{"type": "function", "function": {}}], "auto", None, True)


def test_grammar_language(lltok, tok):
    paris = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    two = paris + '\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2.5}}</tool_call>'
    required = T.grammar(TOOLS, "required", None, False)
    assert accepts(lltok, tok, required, paris)
    assert accepts(lltok, tok, required, '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    assert not accepts(lltok, tok, required, two)
    assert not accepts(lltok, tok, required, paris.replace('"city": ', '"city":'))  # the layout is fixed
    assert not accepts(lltok, tok, required, paris.replace("{\"city", "{ \"city"))
    assert not accepts(lltok, tok, required, paris.replace("get_weather", "get_weathers"))
    assert not accepts(lltok, tok, required, '<tool_call>{"name": "ping", "arguments": {"x": 1}}</tool_call>')
    assert not accepts(lltok, tok, required, "Hello")
    assert accepts(lltok, tok, T.grammar(TOOLS, "required", None, True), two)
    only_add = T.grammar(TOOLS, "function", "add", True)
    assert not accepts(lltok, tok, only_add, paris)
    assert accepts(lltok, tok, only_add, '<tool_call>{"name": "add", "arguments": {"a": -3, "b": 0}}</tool_call>')
    auto = T.grammar(TOOLS, "auto", None, True)
    for text in ("Hello", "<b>bold</b> text\nand more", "", "<tool", paris, two):
        assert accepts(lltok, tok, auto, text), text
    for text in ("Hi <tool_call>", paris + " and text", "<tool_call>nope"):
        assert not accepts(lltok, tok, auto, text), text


# -------------------------------------------------------------------------------------------
# Random walks under the grammar: every answer it allows parses into valid calls or text


def random_walk(lltok, g: str, rng: random.Random, closers: np.ndarray, prefix: list[int] = (),
                max_tokens: int = 300) -> tuple[list[int], bool]:
    """Tokens sampled at random from the grammar's mask (biased towards EOS and towards tokens
    that close strings/objects, so answers end), after forcing `prefix`; (tokens, ended)."""
    m = llg.LLMatcher(lltok, compiled(g), log_level=0)
    bitmask = allocate_token_bitmask(1, N_VOCAB)
    ids = list(prefix)
    assert m.consume_tokens(ids), m.get_error()
    while len(ids) < max_tokens:
        if m.is_stopped():
            return ids, True
        fill_next_token_bitmask(m, bitmask)
        allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:N_VOCAB])
        assert len(allowed), "the grammar allows no token"
        if EOS in allowed and len(ids) >= 5 and rng.random() < 0.4:
            assert m.consume_token(EOS) and m.is_stopped()
            return ids, True
        closing = allowed[closers[allowed]]
        pool = closing if len(closing) and rng.random() < 0.4 else allowed
        token = int(pool[rng.randrange(len(pool))])
        if token == EOS:
            assert m.consume_token(EOS)
            return ids, True
        assert m.consume_token(token), m.get_error()
        ids.append(token)
    return ids, False


def chunked(parser: T.ToolCallParser, text: str, rng: random.Random) -> tuple[str, list[T.Delta]]:
    content, deltas, at = [], [], 0
    while at < len(text):
        n = rng.randint(1, 9)
        c, d = parser.feed(text[at:at + n])
        content.append(c)
        deltas += d
        at += n
    c, d = parser.finish()
    return "".join(content) + c, deltas + d


def reassemble(deltas: list[T.Delta]) -> list[tuple[str, str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id:
            assert d.index not in calls, "a second first delta for one index"
            calls[d.index] = [d.id, d.name, d.arguments]
        else:
            assert not d.name
            calls[d.index][2] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.fixture(scope="module")
def closers(tok):
    vocab = [tok.decode([i], skip_special_tokens=False) for i in range(N_VOCAB)]
    return np.array([any(ch in text for ch in '"}]') for text in vocab])


@pytest.mark.parametrize("choice,parallel", CONFIGS)
def test_random_walks_parse_into_valid_calls(choice, parallel, lltok, tok, closers):
    name = "search" if choice == "function" else None
    offered = {name} if name else set(PARAMS)
    g = T.grammar(TOOLS, choice, name, parallel)
    call_start = tok.encode(T.TOOL_CALL_OPEN)
    kinds, ended_walks = set(), 0
    for seed in range(6):
        rng = random.Random(f"{choice}-{parallel}-{seed}")
        prefix = call_start if choice == "auto" and seed % 2 else []  # auto: half the walks choose a call
        ids, ended = random_walk(lltok, g, rng, closers, prefix)
        if not ended:
            continue
        ended_walks += 1
        text = tok.decode(ids, skip_special_tokens=False)
        content, calls = T.parse(text)
        if choice == "auto" and not calls:
            assert content == text and T.TOOL_CALL_OPEN not in text
            kinds.add("text")
            continue
        kinds.add("calls")
        assert content == "" and calls, text
        assert len(calls) == 1 or parallel
        assert text == "\n".join(f'<tool_call>{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}</tool_call>'
                                 for c in calls)
        for c in calls:
            assert c.name in offered
            assert re.fullmatch(r"call_[0-9a-f]{24}", c.id)
            assert "\n" not in c.arguments
            jsonschema.validate(json.loads(c.arguments), PARAMS[c.name])
        # streamed in random chunks: the same calls, and no content
        parser = T.ToolCallParser()
        streamed_content, deltas = chunked(parser, text, rng)
        assert streamed_content == ""
        assert [(n, a) for _, n, a in reassemble(deltas)] == [(c.name, c.arguments) for c in calls]
        assert reassemble(deltas) == [tuple(c) for c in parser.calls]
    assert ended_walks >= 4
    assert kinds == ({"text", "calls"} if choice == "auto" else {"calls"})


# -------------------------------------------------------------------------------------------
# The parser

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def counter_ids():
    n = iter(range(1000))
    return lambda: f"call_{next(n)}"


def test_text_then_a_lt_that_is_not_a_tag():
    p = T.ToolCallParser()
    assert p.feed("Hello <") == ("Hello ", [])
    assert p.feed("to") == ("", [])
    assert p.feed("p>") == ("<top>", [])
    assert p.feed(" x <tool_cal") == (" x ", [])
    assert p.finish() == ("<tool_cal", [])
    assert p.calls == []


def test_a_tag_split_across_chunks():
    p = T.ToolCallParser(counter_ids())
    assert p.feed("<tool") == ("", [])
    assert p.feed('_call>{"name": "get_we') == ("", [])
    assert p.feed('ather", "argu') == ("", [])
    assert p.feed('ments": ') == ("", [T.Delta(0, "call_0", "get_weather", "")])
    assert p.feed('{"city": "Pa') == ("", [T.Delta(0, arguments='{"city": "Pa')])
    assert p.feed('ris"}}</tool') == ("", [T.Delta(0, arguments='ris"}')])
    assert p.calls == []
    assert p.feed("_call>") == ("", [])
    assert p.finish() == ("", [])
    assert p.calls == [T.ToolCall("call_0", "get_weather", '{"city": "Paris"}')]


def test_two_parallel_calls_in_one_feed():
    p = T.ToolCallParser(counter_ids())
    second = CALL.replace("Paris", "Oslo")
    assert p.feed(CALL + "\n" + second + "\n") == ("", [
        T.Delta(0, "call_0", "get_weather", '{"city": "Paris"}'),
        T.Delta(1, "call_1", "get_weather", '{"city": "Oslo"}')])
    assert p.finish() == ("", [])  # the trailing separator is not content
    assert [c.arguments for c in p.calls] == ['{"city": "Paris"}', '{"city": "Oslo"}']


HEAD = len('<tool_call>{"name": "get_weather", "arguments": ')


def test_a_call_cut_before_its_name_is_content_after_it_a_partial_call():
    """Cut (max_tokens, a stop string) before the call's first delta: its text is content. After its
    id and name went out: the call stays, with the arguments as far as they got, and no markup
    becomes content."""
    for cut in (5, 11, 20, 48, 60, len(CALL) - 5, len(CALL) - 1):
        p = T.ToolCallParser()
        content, sent = p.feed("Sure. " + CALL[:cut])
        rest, deltas = p.finish()
        if cut < HEAD:
            assert content + rest == "Sure. " + CALL[:cut] and deltas == [] and p.calls == []
        else:
            assert content + rest == "Sure. " and deltas == []
            [call] = p.calls
            assert call.name == "get_weather" and call.arguments == "".join(d.arguments for d in sent)
            assert '{"city": "Paris"}'.startswith(call.arguments)


def test_malformed_calls_are_content_and_later_calls_still_parse():
    for bad in ("<tool_call>oops</tool_call>", '<tool_call>{"name": 1}', '<tool_call>{"name": "f", "arguments": 3}',
                '<tool_call>{"name": "f", "arguments": {}} x</tool_call>',
                '<tool_call>{"name": "f", "arguments": {}}}', "  <tool_call>oops"):
        text = bad + " then " + CALL
        content, calls = T.parse(text)
        assert content == bad + " then ", bad
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
        for seed in range(5):
            assert chunked(T.ToolCallParser(), text, random.Random(seed))[0] == content


def test_lenient_whitespace_and_tags_inside_strings():
    text = '\n<tool_call>\n{ "name" : "f" ,\n "arguments" :\n{"s": "}</tool_call> \\" }"}\n}\n</tool_call>\n'
    assert T.parse(text)[0] == ""
    assert [(c.name, c.arguments) for c in T.parse(text)[1]] == [("f", '{"s": "}</tool_call> \\" }"}')]
    assert T.parse("   ") == ("   ", [])  # whitespace is content unless it borders calls
    content, calls = T.parse(" hi " + CALL + " ")
    assert content == " hi " and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert T.parse("  <tool_call>oops") == ("  <tool_call>oops", [])  # held whitespace comes back
    assert T.parse(" \n" + CALL[:30]) == (" \n" + CALL[:30], [])


def test_chunked_feeding_equals_parse():
    rng = random.Random(7)
    pieces = [CALL, "\n", "text ", "<", "<b>", "<tool_", "<tool_call>", '{"name": "x", "arguments": {"a": [1, {}]}}',
              "}</tool_call>", " ", "é漢", '"']
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        content, calls = T.parse(text, counter_ids())
        parser = T.ToolCallParser(counter_ids())
        streamed, deltas = chunked(parser, text, rng)
        assert streamed == content, text
        assert calls == parser.calls
        ids = {c.id for c in calls}
        assert [r for r in reassemble(deltas) if r[0] in ids] == [tuple(c) for c in calls]
        if not calls:
            assert content == text, text
