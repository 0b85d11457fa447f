"""Determinism on the default path (weights="q4", bf16): a request gives the same tokens
alone or batched, chunked or not, from a cached prefix or cold, greedy or seeded."""
from __future__ import annotations

import pytest

from ember.engine.sampling_params import SamplingParams
from tests.conftest import LONG_TEXT

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
SECTIONS = ["Section " + s.strip() for s in LONG_TEXT.split("Section ")[1:]]  # ~76 tokens each
QUESTIONS = ["How many fishing boats were counted?", "Where were the records kept?",
             "Which way did storms come from?", "What did the keeper write down?",
             "Summarise the archive in one sentence.", "How high did the tide rise?",
             "Name the town.", "List the merchant ship counts."]


def _requests(tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    """8 chat prompts of ~190-560 tokens, each opening on its own section; even ones greedy,
    odd ones sampled with a fixed seed (each prompt both ways would double the run time)."""
    prompts, params = [], []
    for i, question in enumerate(QUESTIONS):
        text = " ".join(SECTIONS[i:i + 2 + i % 6])
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{text}\n\n{question}"}])))
        seeded = dict(temperature=0.8, seed=1000 + i) if i % 2 else {}
        params.append(SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **seeded))
    return prompts, params


def test_q4_tokens_do_not_depend_on_batching_chunking_or_cache(q4_engine):
    engine = q4_engine()
    prompts, params = _requests(engine.tokenizer)
    assert len(prompts) == 8 and min(map(len, prompts)) > 150 and max(map(len, prompts)) > 500

    # 1. each request alone on a fresh engine: one prefill chunk, then batch-1 decode
    alone = [q4_engine().generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    # 2. all 8 at once: several prompts (and decodes) share each step
    batched = [c.token_ids for c in engine.generate(prompts, params)]
    # 3. again on the same engine: the prompts' blocks are cached, only their tails run
    again = engine.generate(prompts, params)
    assert all(c.cached_tokens >= len(p) - 16 for c, p in zip(again, prompts))
    cached = [c.token_ids for c in again]
    # 4. a 64-token step budget: every prompt is prefilled in chunks beside other requests
    chunked = [c.token_ids for c in q4_engine(max_num_batched_tokens=64).generate(prompts, params)]

    assert all(len(t) == NEW_TOKENS for t in alone)
    for name, got in (("batched", batched), ("cached", cached), ("chunked", chunked)):
        differ = [i for i, (a, b) in enumerate(zip(alone, got)) if a != b]
        assert not differ, f"{name}: requests {differ} differ from running alone"
