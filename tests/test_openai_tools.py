"""Tool calls, structured output, logprobs and n > 1 through the official `openai` client against a
real cluster (router HTTP -> prefill -> KV -> decode): the session's default cluster (configs/local.yaml,
the GGUF's Q4_1 codes), its tokens checked against an in-process engine on the same weights."""
from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from ember.engine.sampling_params import SamplingParams
from ember.services.router import tools

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["timezone"],
        "properties": {"timezone": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
SAMPLES = 20


@pytest.fixture(scope="module")
def cluster(default_cluster):
    return default_cluster.as_dict()


@pytest.fixture(scope="module")
def api(cluster):
    from tests.conftest import openai_client
    return openai_client(cluster["router_http"])


@pytest.fixture(scope="module")
def engine(q4_engine):
    """The reference: an engine on the cluster's own weights and settings (the q4 path)."""
    return q4_engine()


def many(fn, seeds):
    """fn(seed) for every seed, concurrently (they share the decode batch)."""
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(fn, seeds))


def assert_valid_calls(message, names=tuple(SCHEMAS)):
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls_validate_for_20_seeded_samples_at_temperature_1(api, choice):
    """A named function is called exactly once; "required" without parallel calls (SmolLM2 offered
    another call after the first repeats it until max_tokens: see test_parallel_calls)."""
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    extra = {} if choice == "named" else {"parallel_tool_calls": False}

    def call(seed):
        return api.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                           temperature=1.0, seed=seed, max_tokens=160, **extra)
    outs = many(call, list(range(SAMPLES)))
    for out in outs:
        choice0 = out.choices[0]
        assert choice0.finish_reason == "tool_calls" and len(choice0.message.tool_calls) == 1
        assert_valid_calls(choice0.message, ("get_weather",) if choice == "named" else tuple(SCHEMAS))
    args = {out.choices[0].message.tool_calls[0].function.arguments for out in outs}
    assert len(args) > 3, "seeded samples differ"


def agent_history(cities=("Paris", "Berlin", "Madrid")) -> list[dict]:
    """An agent's conversation: earlier turns that called get_weather, then a new question."""
    history = []
    for i, city in enumerate(cities):
        history += [{"role": "user", "content": f"What is the weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": f"call_{i}", "type": "function", "function": {
                            "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"temperature": 18 + i})},
                    {"role": "assistant", "content": f"It is {18 + i} degrees in {city}."}]
    return history + [{"role": "user", "content": "What is the weather in London?"}]


def test_auto_tool_choice_calls_or_answers_and_every_call_validates(api):
    """SmolLM2-135M never elects to call on a first turn; with an agent's history of calls it does about
    half the time at temperature 1."""
    def call(seed):
        return api.chat.completions.create(model="", messages=agent_history(), tools=TOOLS, temperature=1.0,
                                           seed=seed, max_tokens=160, parallel_tool_calls=False)
    outs = many(call, list(range(SAMPLES)))
    calls = 0
    for out in outs:
        c = out.choices[0]
        if c.message.tool_calls:
            calls += 1
            assert c.finish_reason == "tool_calls"
            assert_valid_calls(c.message)
        else:
            assert c.finish_reason in ("stop", "length") and "<tool_call>" not in (c.message.content or "")
    assert calls >= 1, "the model given tools and a weather question calls one at least sometimes"


def test_parallel_calls_each_parse(api):
    """With parallel calls allowed (OpenAI's default) an answer holds up to one call per offered function,
    each whole (SmolLM2 left free repeats its calls until max_tokens cuts one)."""
    ask = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]
    for seed in range(4):
        out = api.chat.completions.create(model="", messages=ask, tools=TOOLS, tool_choice="required",
                                          temperature=0 if seed == 0 else 1.0, seed=seed, max_tokens=300)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls" and 1 <= len(c.message.tool_calls) <= len(TOOLS)
        assert_valid_calls(c.message)
        assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(api):
    kw = dict(model="", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=7, max_tokens=160,
              parallel_tool_calls=False)
    whole = api.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(api.chat.completions.create(stream=True, **kw))
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in chunks:
        for c in chunk.choices:
            reasons += [c.finish_reason] if c.finish_reason else []
            for d in c.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert entry["id"] is None, "a call's id comes once"
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += d.function.arguments or ""
    assert reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(t.function.name, t.function.arguments)
                                                                      for t in whole]
    assert sum(1 for ch in chunks for c in ch.choices for d in c.delta.tool_calls or ()) > 2, "arguments stream"


def test_a_two_turn_tool_round_trip_renders_the_call_and_its_result(api, engine):
    first = api.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                        max_tokens=160).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    answer = api.chat.completions.create(model="", messages=history, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=24)
    # what the router must have rendered: the documented format through SmolLM2's template
    messages, extra = tools.render(history, None, tools.template_knows_tools(engine.tokenizer.chat_template))
    prompt = engine.tokenizer.apply_chat_template(messages, **extra)
    assert "<tool_response>" in prompt and call.function.arguments in prompt
    want = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    assert answer.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert answer.choices[0].message.content == want.text and answer.choices[0].message.tool_calls is None


def test_tools_reach_the_template_through_http(api, engine):
    """The tools are in the prompt the router builds (SmolLM2's template knows none: the system prompt)."""
    out = api.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=1,
                                      temperature=0)
    messages, extra = tools.render(ASK, TOOLS, False)
    prompt = engine.tokenizer.apply_chat_template(messages, **extra)
    assert "get_weather" in prompt and out.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))


def test_json_schema_strict_outputs_validate_for_20_seeded_samples(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}

    def call(seed):
        # (room for a sample that rambles inside the city string: seed 15 on the q4 weights takes 190 tokens)
        return api.chat.completions.create(model="", messages=[{"role": "user", "content": "Weather in Rome?"}],
                                           response_format=fmt, temperature=1.0, seed=seed, max_tokens=400)
    for out in many(call, list(range(SAMPLES))):
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), WEATHER)
    obj = api.chat.completions.create(model="", messages=ASK, response_format={"type": "json_object"},
                                      temperature=0.7, seed=1, max_tokens=200)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_an_unconstrained_request_beside_a_constrained_one_equals_its_solo_run(api):
    free = dict(model="", messages=[{"role": "user", "content": "Tell me about rivers."}], temperature=0.8, seed=3,
                max_tokens=24)
    solo = api.chat.completions.create(**free).choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    both = many(lambda i: api.chat.completions.create(**free) if i == 0 else api.chat.completions.create(
        model="", messages=ASK, response_format=fmt, temperature=1.0, seed=i, max_tokens=80), [0, 1, 2])
    assert both[0].choices[0].message.content == solo
    for out in both[1:]:
        jsonschema.validate(json.loads(out.choices[0].message.content), WEATHER)


def test_logprobs_are_the_engines(api, engine):
    out = api.chat.completions.create(model="", messages=ASK, logprobs=True, top_logprobs=3, temperature=0.9,
                                      seed=5, max_tokens=10)
    content = out.choices[0].logprobs.content
    prompt = engine.tokenizer.apply_chat_template(ASK)
    want = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.9, seed=5, logprobs=3))[0]
    assert [bytes(t.bytes) for t in content] == [engine.tokenizer.token_bytes(i) for i in want.token_ids]
    assert b"".join(bytes(t.bytes) for t in content).decode() == out.choices[0].message.content
    for got, lp in zip(content, want.logprobs):
        assert got.logprob == pytest.approx(lp.logprob, abs=1e-3)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(lp.top_logprobs, abs=1e-3)
        assert [bytes(t.bytes) for t in got.top_logprobs] == [engine.tokenizer.token_bytes(i) for i in lp.top_ids]
    text = api.completions.create(model="", prompt="The capital of France is", logprobs=2, max_tokens=4)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(alts) == 2 for alts in lp.top_logprobs)


def test_n_3_with_a_seed_gives_three_reproducible_samples_sharing_the_prompt(api):
    fresh = f"[{uuid.uuid4().hex}] "  # first block never seen before: what `a` reuses, its own choices made
    kw = dict(model="", messages=[{"role": "user", "content": fresh + "Write a word about the sea, " * 8}], n=3,
              temperature=1.0, seed=42, max_tokens=12)
    a, b = api.chat.completions.create(**kw), api.chat.completions.create(**kw)
    texts = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1, "three samples, not one three times"
    assert a.usage.completion_tokens >= 3, "summed over the choices"
    assert a.usage.prompt_tokens < 150, "the prompt counts once (three times would be ~300)"
    assert a.usage.prompt_tokens_details.cached_tokens >= 16, "choices 1 and 2 reuse choice 0's prompt KV"
    assert b.usage.prompt_tokens_details.cached_tokens >= 16, "and the next request reuses it too"
    streamed = list(api.chat.completions.create(stream=True, **kw))
    joined = {i: "".join(c.delta.content or "" for ch in streamed for c in ch.choices if c.index == i)
              for i in range(3)}
    assert [joined[i] for i in range(3)] == texts


def test_penalties_and_logit_bias_reach_the_engine(api, engine):
    prompt = engine.tokenizer.apply_chat_template(ASK)
    greedy = engine.generate([prompt], SamplingParams(max_tokens=4))[0]
    banned = greedy.token_ids[0]
    out = api.chat.completions.create(model="", messages=ASK, logit_bias={str(banned): -100}, temperature=0,
                                      max_tokens=4, presence_penalty=0.5, frequency_penalty=0.5, user="alice")
    want = engine.generate([prompt], SamplingParams(max_tokens=4, logit_bias={banned: -100.0}, presence_penalty=0.5,
                                                    frequency_penalty=0.5))[0]
    assert out.choices[0].message.content == want.text != greedy.text


def test_malformed_tool_parameters_are_a_400_not_a_500(api):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"x-guidance": "abc"}}}]
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="", messages=ASK, tools=bad, tool_choice="required", max_tokens=8)
