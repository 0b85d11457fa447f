"""Ember's greedy tokens equal Hugging Face transformers' on the same GGUF weights."""
from __future__ import annotations

import pytest

from ember.engine.sampling_params import SamplingParams
from tests.conftest import PROMPTS

MAX_NEW = 24


def _ids(engine, text):
    return engine.tokenizer.encode(text)


@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"p{i}" for i in range(len(PROMPTS))])
def test_single_prompt_matches_transformers(engine, hf_greedy, prompt):
    ids = _ids(engine, prompt)
    [out] = engine.generate([ids], SamplingParams(max_tokens=MAX_NEW))
    assert out.token_ids == hf_greedy(ids, MAX_NEW)[:len(out.token_ids)]
    assert len(out.token_ids) == MAX_NEW or out.finish_reason == "stop"


def test_long_prompt_is_over_1000_tokens(engine):
    assert len(_ids(engine, PROMPTS[-1])) > 1000


def test_chat_prompt_matches_transformers(engine, hf_model, hf_greedy):
    tok, _ = hf_model
    messages = [{"role": "user", "content": "Name three planets of the solar system."}]
    hf_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ours = engine.tokenizer.apply_chat_template(messages)
    assert ours == hf_text
    ids = _ids(engine, ours)
    assert ids == tok.encode(hf_text, add_special_tokens=False)
    [out] = engine.generate([ids], SamplingParams(max_tokens=MAX_NEW))
    assert out.token_ids == hf_greedy(ids, MAX_NEW)[:len(out.token_ids)]


def test_batch_of_8_mixed_lengths_runs_concurrently_and_matches(make_engine, hf_greedy):
    engine = make_engine(kv_cache_mb=256, max_num_batched_tokens=512)
    prompts = [_ids(engine, p) for p in PROMPTS] + [
        _ids(engine, "List the days of the week:"), _ids(engine, "Water boils at"),
    ]
    assert len(prompts) == 8
    batch_sizes = []
    orig_step = engine.runner.run

    def spy(batch):
        batch_sizes.append(len(batch.seqs))
        return orig_step(batch)
    engine.runner.run = spy
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))
    assert max(batch_sizes) == 8, "all 8 sequences should share steps"
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ids, 16)[:len(out.token_ids)]
