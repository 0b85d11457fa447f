"""Exact speculative decoding (prompt lookup): drafts from the request's own context, verified in
one step, change no token: greedy or seeded, alone or batched, on the default (q4) path."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from ember.engine.block_manager import BlockManager
from ember.engine.sampler import sample
from ember.engine.sampling_params import Constraint, SamplingParams
from ember.engine.scheduler import Scheduler
from ember.engine.sequence import Sequence
from ember.engine.speculation import NgramIndex, accepted_prefix
from tests.conftest import LONG_TEXT


def _brute_force(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    for n in range(min(ngram_max, len(tokens)), ngram_min - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # latest earlier occurrence first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_ngram_index_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 3)
    assert index.propose([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]  # "5 6" seen before: what followed it
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 3) == []  # no earlier "3 4"
    assert NgramIndex(1, 3).propose([9, 1, 2, 9, 3, 1, 2], 2) == [9, 3]  # "1 2": latest occurrence, longest n
    # grown one token at a time (as a sequence decodes) it says what a fresh look-up says
    rng = random.Random(0)
    for trial in range(200):
        tokens, index = [], NgramIndex(2, 4)
        for _ in range(60):
            tokens.append(rng.randrange(4))
            assert index.propose(tokens, 5) == _brute_force(tokens, 5, 2, 4), (trial, tokens)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_accepted_prefix_stops_at_the_first_draft_that_differs():
    assert accepted_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted_prefix([1, 2, 3], [1, 9, 3, 4]) == 1
    assert accepted_prefix([1, 2, 3], [7, 2, 3, 4]) == 0


def test_seeded_verification_keeps_the_target_distribution():
    """On a 6-token vocabulary: the token a verify step emits first (the draft when the target's draw
    equals it, else the draw) follows the target distribution, and the draft stands with probability
    p(draft) (rejection sampling's rate for a deterministic draft). Chi-square over 20,000 seeds."""
    probs = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    logits = probs.log()[None].repeat(1, 1)
    params = SamplingParams(temperature=1.0)
    draft, trials = 3, 20000
    emitted, accepted = Counter(), 0
    for seed in range(trials):
        [target] = sample(logits.clone(), [params], [seed], [100])
        kept = accepted_prefix([draft], [target, -1])
        accepted += kept
        emitted[draft if kept else target] += 1
    expected = probs * trials
    chi2 = sum((emitted[t] - float(expected[t])) ** 2 / float(expected[t]) for t in range(6))
    assert chi2 < 20.5, (chi2, emitted)  # 5 degrees of freedom: p < 0.001
    assert abs(accepted / trials - float(probs[draft])) < 0.015


def test_a_decoder_takes_its_drafts_only_when_budget_and_blocks_allow():
    bm = BlockManager(num_blocks=4, block_size=4, root_hash=b"r" * 16)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    seq = Sequence("a", list(range(7)), 7, SamplingParams(max_tokens=20), seed=0)
    sched.add(seq)
    batch = sched.schedule()  # the prompt
    assert batch.num_new_tokens == [7]
    seq.num_computed_tokens = 7
    seq.token_ids.append(7)
    seq.draft_token_ids = [1, 2, 3]
    batch = sched.schedule()
    assert batch.num_new_tokens == [4] and len(seq.block_table) == 3  # slots for the drafts too
    seq.num_computed_tokens = 8
    seq.token_ids.append(8)
    seq.draft_token_ids = list(range(10))  # more than the budget: it decodes plainly
    assert sched.schedule().num_new_tokens == [1] and seq.draft_token_ids == []


def _copy_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this text word for word:\n\n{text}"}]))


@pytest.mark.slow
def test_speculative_tokens_equal_plain_decoding_greedy_and_seeded_alone_and_batched(q4_engine):
    plain, spec = q4_engine(speculative_tokens=0), q4_engine(speculative_tokens=3)
    tok = plain.tokenizer
    sections = ["Section " + s.strip() for s in LONG_TEXT.split("Section ")[1:]]
    prompts = [_copy_prompt(tok, " ".join(sections[:2])), _copy_prompt(tok, sections[2]),
               tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a story about a fox."}]))]
    params = [SamplingParams(max_tokens=160, ignore_eos=True),
              SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.7, seed=7),
              SamplingParams(max_tokens=80, ignore_eos=True, logprobs=2)]
    want = plain.generate(prompts, params)
    alone = [spec.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    drafted, kept, steps = spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens, spec.stats.num_steps
    batched = spec.generate(prompts, params)
    for w, a, b in zip(want, alone, batched):
        assert a.token_ids == w.token_ids and b.token_ids == w.token_ids
        assert a.text == w.text and a.finish_reason == w.finish_reason == "length"
    assert [lp.token_id for lp in alone[2].logprobs] == want[2].token_ids
    assert [round(lp.logprob, 4) for lp in alone[2].logprobs] == [round(lp.logprob, 4) for lp in want[2].logprobs]
    assert plain.stats.num_draft_tokens == 0
    assert kept > 100 and drafted - kept > 10, "many drafts accepted and many rejected"
    assert spec.stats.num_steps - steps < plain.stats.num_steps, "batched, it took fewer steps than plain decoding"
    # the cache it left is the same: a follow-up turn hits the same blocks
    assert alone[0].block_hashes == want[0].block_hashes


@pytest.mark.slow
def test_per_request_switch_and_requests_that_never_speculate(q4_engine, make_engine):
    engine = q4_engine()  # default: speculates on the batch-invariant path
    assert engine.speculative_tokens > 0 and make_engine().speculative_tokens == 0  # fp32: off by default
    tok = engine.tokenizer
    prompt = _copy_prompt(tok, LONG_TEXT[:400])
    for params in (SamplingParams(max_tokens=40, ignore_eos=True, speculative=False),
                   SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=0.5),
                   SamplingParams(max_tokens=40, constraint=Constraint("regex", "[a-z ]{1,40}"))):
        engine.generate([prompt], params)
        assert engine.stats.num_draft_tokens == 0, params
    engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))
    assert engine.stats.num_accepted_tokens > 0
    # an engine off by default speculates for a request that asks
    off = q4_engine(speculative_tokens=0)
    off.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True, speculative=True))
    assert off.stats.num_accepted_tokens > 0
