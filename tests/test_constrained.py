"""Grammar-constrained decoding, logprobs, penalties and logit bias in the engine (the exact fp32 path)."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ember.engine.constraints import check
from ember.engine.sampling_params import Constraint, SamplingParams
from ember.errors import InvalidRequestError

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
           "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}}}


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_json_schema_outputs_validate_for_20_seeded_samples_at_temperature_1(engine):
    prompt = chat(engine, "What will the weather be in Lisbon? Reply in JSON.")
    constraint = Constraint("json_schema", json.dumps(WEATHER))
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=seed, constraint=constraint) for seed in range(20)]
    outs = engine.generate([prompt] * 20, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), WEATHER)
    assert len({o.text for o in outs}) > 5, "seeded samples differ"
    assert engine.grammars.compiles >= 1 and engine.grammars.hits >= 19, "compiled once, then cached"


def test_regex_and_json_object_constraints(engine):
    prompt = chat(engine, "Give me a date.")
    date = Constraint("regex", r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")
    out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=3, constraint=date))[0]
    assert out.finish_reason == "stop" and len(out.text) == 10 and out.text.startswith("20")
    out = engine.generate([prompt], SamplingParams(max_tokens=200, temperature=0.7, seed=1,
                                                   constraint=Constraint("json_object")))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_an_unconstrained_request_batched_with_a_constrained_one_equals_its_solo_run(engine):
    free = chat(engine, "Tell me about the sea.")
    solo = engine.generate([free], SamplingParams(max_tokens=24, temperature=0.8, seed=5))[0]
    both = engine.generate([free, chat(engine, "Weather in Oslo, as JSON.")],
                           [SamplingParams(max_tokens=24, temperature=0.8, seed=5),
                            SamplingParams(max_tokens=60, temperature=1.0, seed=6,
                                           constraint=Constraint("json_schema", json.dumps(WEATHER)))])
    assert both[0].token_ids == solo.token_ids
    assert json.loads(both[1].text)["unit"] in ("celsius", "fahrenheit")


def test_logprobs_are_the_models_log_softmax(engine, hf_model):
    _, model = hf_model
    prompt = chat(engine, "Name three fruits.")
    out = engine.generate([prompt], SamplingParams(max_tokens=8, logprobs=5, temperature=0.9, seed=11))[0]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    reference = logits[len(prompt) - 1:-1].log_softmax(-1)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(reference[i, token]), abs=2e-3)
        values, ids = reference[i].topk(5)
        assert lp.top_logprobs == pytest.approx(values.tolist(), abs=2e-3)
        assert lp.top_ids[:2] == ids.tolist()[:2] or abs(values[0] - values[1]) < 1e-3
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)


def test_logit_bias_and_penalties_change_what_is_sampled(engine):
    prompt = chat(engine, "Say hello.")
    greedy = engine.generate([prompt], SamplingParams(max_tokens=6))[0]
    banned = greedy.token_ids[0]
    biased = engine.generate([prompt], SamplingParams(max_tokens=6, logit_bias={banned: -100.0}))[0]
    assert biased.token_ids[0] != banned
    forced = engine.generate([prompt], SamplingParams(max_tokens=3, logit_bias={42: 100.0}, ignore_eos=True))[0]
    assert forced.token_ids == [42, 42, 42]
    repeated = engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    penalized = engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=2.0,
                                                         presence_penalty=2.0))[0].token_ids
    assert len(set(penalized)) > len(set(repeated)), "penalties spread the output over more distinct tokens"


def test_decode_continues_the_grammar_after_a_prefix_generated_elsewhere(engine):
    """A decode server (or a worker a broken stream moved to) replays the tokens already sent through
    the grammar: the continuation is the same as one uninterrupted run."""
    prompt = chat(engine, "Weather in Rome, as JSON.")
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=21, constraint=Constraint("json_schema",
                                                                                            json.dumps(WEATHER)))
    whole = engine.generate([prompt], params)[0]
    for cut in (1, 5):
        rid = engine.add_request(prompt, params, output_prefix=whole.token_ids[:cut])
        tokens = list(whole.token_ids[:cut])
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    tokens += out.new_token_ids
        assert tokens == whole.token_ids
    with pytest.raises(InvalidRequestError, match="do not follow"):
        engine.add_request(prompt, params, output_prefix=engine.tokenizer.encode("hello"))


def test_bad_constraints_are_refused_before_any_work(engine):
    with pytest.raises(InvalidRequestError):
        check(Constraint("json_schema", '{"type": "bogus"}'))
    with pytest.raises(InvalidRequestError):
        check(Constraint("json_schema", "not json"))
    with pytest.raises(InvalidRequestError):
        check(Constraint("lark", "start: undefined_rule"))
    with pytest.raises(InvalidRequestError):
        engine.validate([1, 2, 3], SamplingParams(constraint=Constraint("regex", "(unclosed")))
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError):
        SamplingParams(presence_penalty=3)


def test_a_grammar_that_fails_mid_answer_ends_its_request_with_an_error_not_a_token(engine):
    """A matcher in an error state (llguidance's lexer budget exceeded, say) ends its request with
    finish_reason "error" (the engine core turns that into INVALID_ARGUMENT), frees its blocks and
    leaves the batch running."""
    from ember.serving.engine_core import EngineCore
    from ember.serving.messages import AddRequest
    prompt = chat(engine, "Weather in Oslo, as JSON.")
    params = SamplingParams(max_tokens=40, constraint=Constraint("json_schema", json.dumps(WEATHER)))
    core = EngineCore(engine)
    core.add(AddRequest("broken", prompt, params))
    core.add(AddRequest("fine", prompt, SamplingParams(max_tokens=8)))
    while len(engine.seqs["broken"].output_token_ids) < 2:
        core.turn()
    engine.seqs["broken"].matcher.consume_token(engine.eos_token_id)  # not allowed here: error state
    used = engine.block_manager.num_used_blocks
    events = []
    while engine.has_unfinished():
        events += core.turn()
    [(_, rid, error)] = [e for e in events if e[0] == "error"]
    assert rid == "broken" and isinstance(error, InvalidRequestError) and "while decoding" in str(error)
    assert any(e[0] == "out" and e[1].request_id == "fine" and e[1].finished for e in events)
    assert engine.block_manager.num_used_blocks < used and not engine.seqs
