"""Jump-forward decoding (LLMEngine._jump_forward): the tokens a grammar forces are appended at once and
computed together in the next step, on the default q4 path; the tokens are plain constrained
decoding's, greedy and seeded, alone and batched, cut by max_tokens or a stop string inside a forced run."""
from __future__ import annotations

import json

import pytest

from ember.engine.sampling_params import Constraint, SamplingParams
from ember.rpc import metrics
from ember.services.router import tools as T
from ember.serving.messages import Snapshot

TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The weather in a city",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
         {"type": "function", "function": {
             "name": "get_time", "description": "The time in a time zone",
             "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
           "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
TOOL_CALL = Constraint("lark", T.grammar(TOOLS, "required"))
SCHEMA = Constraint("json_schema", json.dumps(WEATHER))
SAMPLINGS = [dict(), dict(temperature=0.8, seed=0), dict(temperature=0.8, seed=1), dict(temperature=0.8, seed=7)]


@pytest.fixture(scope="module")
def engines(q4_engine):
    """(jump-forward on, off): the same q4 model, each its own pool and cache."""
    return q4_engine(), q4_engine(jump_forward=False)


def prompt_of(engine, constraint: Constraint) -> list[int]:
    if constraint is TOOL_CALL:
        messages, _ = T.render([{"role": "user", "content": "What is the weather in Paris?"}], TOOLS, False)
    else:
        messages = [{"role": "user", "content": "What will the weather be in Lisbon? Reply in JSON."}]
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))


def run(engine, prompts, params):
    """generate(), and the steps and forced tokens it took."""
    steps, forced = engine.stats.num_steps, engine.stats.num_forced_tokens
    outs = engine.generate(prompts, params)
    return outs, engine.stats.num_steps - steps, engine.stats.num_forced_tokens - forced


def finish_steps(engine, prompts, params) -> list[int]:
    """The engine step in which each request finished."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, step = {}, 0
    while engine.has_unfinished():
        step += 1
        done.update((o.request_id, step) for o in engine.step() if o.finished)
    return [done[i] for i in ids]


def same(a, b) -> None:
    assert [(o.token_ids, o.text, o.finish_reason) for o in a] == [(o.token_ids, o.text, o.finish_reason) for o in b]


@pytest.mark.parametrize("constraint", [TOOL_CALL, SCHEMA], ids=["tool-call", "json-schema"])
def test_the_tokens_equal_plain_constrained_decoding_greedy_and_seeded_alone_and_batched(engines, constraint):
    on, off = engines
    prompt = prompt_of(on, constraint)
    for sampling in SAMPLINGS:  # alone
        params = SamplingParams(max_tokens=80, constraint=constraint, **sampling)
        (a,), _, forced = run(on, [prompt], params)
        (b,), _, _ = run(off, [prompt], params)
        same([a], [b])
        assert a.finish_reason == "stop" and forced > 0, (sampling, a.text)
    # batched: every sampling at once, with an unconstrained request among them
    tok = on.tokenizer
    free = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}]))
    prompts = [free] + [prompt] * len(SAMPLINGS)
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=5)] + \
             [SamplingParams(max_tokens=80, constraint=constraint, **s) for s in SAMPLINGS]
    a, _, forced = run(on, prompts, params)
    b, _, _ = run(off, prompts, params)
    same(a, b)
    assert forced > 0
    if constraint is TOOL_CALL:
        for out in a[1:]:
            assert T.parse(out.text)[1], out.text  # calls that parse
    # the constrained ones finish in fewer steps (the free one's count is the step policy's: a
    # step may compute forced tokens without the decodes, ember.engine.step_policy)
    assert max(finish_steps(on, prompts, params)[1:]) < max(finish_steps(off, prompts, params)[1:])


def test_each_forced_token_saves_a_step(engines):
    on, off = engines
    prompt = prompt_of(on, TOOL_CALL)
    params = SamplingParams(max_tokens=80, constraint=TOOL_CALL)
    (a,), steps_on, forced = run(on, [prompt], params)
    (b,), steps_off, forced_off = run(off, [prompt], params)
    same([a], [b])
    assert forced_off == 0 and forced >= 20, "a tool call's fixed text is mostly forced"
    # one request: a step per sampled token, plain decoding one per token
    assert steps_off == len(b.token_ids) and steps_on == steps_off - forced


def test_max_tokens_and_a_stop_string_inside_a_forced_run(engines):
    on, off = engines
    prompt = prompt_of(on, TOOL_CALL)
    # '<' is sampled at prefill and "tool_call>{"name": "get_" follows it forced: max_tokens cuts that run
    params = SamplingParams(max_tokens=5, constraint=TOOL_CALL)
    rid = on.add_request(prompt, params)
    forced = on.stats.num_forced_tokens
    outs = []
    while on.has_unfinished():
        outs += on.step()
    assert len(outs) == 1 and outs[0].request_id == rid, "the forced tokens come with the token that led to them"
    assert len(outs[0].new_token_ids) == 5 and outs[0].finish_reason == "length"
    assert on.stats.num_forced_tokens - forced == 4
    (b,), _, _ = run(off, [prompt], params)
    assert outs[0].new_token_ids == b.token_ids and outs[0].new_text == b.text
    # a stop string met inside forced text ends the request there, as plain decoding does
    params = SamplingParams(max_tokens=80, constraint=TOOL_CALL, stop=['"name"'])
    (a,), _, forced = run(on, [prompt], params)
    (b,), _, _ = run(off, [prompt], params)
    same([a], [b])
    assert a.finish_reason == "stop" and a.text == "<tool_call>{" and forced > 0


def test_a_request_asking_for_logprobs_is_not_jumped(engines):
    on, off = engines
    prompt = prompt_of(on, SCHEMA)
    params = SamplingParams(max_tokens=60, constraint=SCHEMA, logprobs=2)
    (a,), _, forced = run(on, [prompt], params)
    (b,), _, _ = run(off, [prompt], params)
    same([a], [b])
    assert forced == 0 and len(a.logprobs) == len(a.token_ids)


def test_a_tight_pool_preempts_and_still_gives_the_same_tokens(q4_engine, engines):
    """Sequences waiting to compute forced tokens grow only into blocks the pool has (they cannot
    preempt); decoders preempt them. 6 tool calls (288-token prompts, shared) in 26 blocks of 16 tokens."""
    _, off = engines
    tight = q4_engine(num_kv_blocks=26)
    prompt = prompt_of(tight, TOOL_CALL)
    params = [SamplingParams(max_tokens=80, constraint=TOOL_CALL, temperature=0.8, seed=s) for s in range(6)]
    a, _, forced = run(tight, [prompt] * 6, params)
    b, _, _ = run(off, [prompt] * 6, params)
    same(a, b)
    assert forced > 0 and tight.scheduler.num_preemptions > 0


def test_forced_tokens_are_a_prometheus_counter():
    counters = metrics._EngineCounters()
    counters.client = type("Client", (), {"snapshot": Snapshot(forced_tokens=7)})()
    values = {f.name: f.samples[0].value for f in counters.collect()}
    assert values["ember:jump_forward_tokens"] == 7
