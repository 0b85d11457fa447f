"""Sampling: seeded reproducibility, top-k/top-p, stops, and clear errors for bad input."""
from __future__ import annotations

import pytest
import torch

from ember.engine.errors import CapacityError, InvalidRequestError
from ember.engine.sampler import apply_top_k_top_p, sample
from ember.engine.sampling_params import SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."


def test_seeded_sampling_is_reproducible_and_seed_sensitive(engine):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    a = engine.generate([PROMPT], params)[0].token_ids
    b = engine.generate([PROMPT, "Unrelated prompt in the same batch"], params)[0].token_ids
    c = engine.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=99))[0]
    assert a == b, "batching with other requests must not change a seeded sample"
    assert a != c.token_ids


def test_top_k_and_top_p_mask_the_right_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(apply_top_k_top_p(logits, 2, 1.0)[2:]).all()
    probs = logits.softmax(-1)  # ~[0.64, 0.24, 0.09, ...]
    kept = ~torch.isinf(apply_top_k_top_p(logits, 0, 0.8))
    assert kept.tolist() == [True, True, False, False, False]
    assert probs[0] < 0.8 <= probs[:2].sum()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(3000, 1)
    params = [SamplingParams(temperature=1.0)] * 3000
    tokens = sample(logits, params, seeds=list(range(3000)), positions=[0] * 3000)
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 3000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04, rtol=0)


def test_stop_string_truncates_text_and_finishes(engine):
    [free] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    word = free.text.split()[1]  # some word the model will produce
    [out] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16, stop=[word]))
    assert out.finish_reason == "stop"
    assert word not in out.text and free.text.startswith(out.text)


def test_stop_token_ids_and_max_tokens(engine):
    [free] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    stop_at = free.token_ids[3]
    [out] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8, stop_token_ids=[stop_at]))
    assert out.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1] and out.finish_reason == "stop"
    [short] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(short.token_ids) == 3 and short.finish_reason == "length"


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_clear_errors(engine, make_engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("")
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([])
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.add_request([5] * 8000, SamplingParams(max_tokens=500))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([1, 2, 10**6])
    small = make_engine(num_kv_blocks=4)
    with pytest.raises(CapacityError, match="kv_cache_mb"):
        small.add_request([5] * 100, SamplingParams(max_tokens=10))
    assert not engine.has_unfinished() and not small.has_unfinished()


def test_abort_frees_blocks(make_engine):
    e = make_engine(num_kv_blocks=64)
    rid = e.add_request(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    e.step()
    e.step()
    assert e.block_manager.num_free_blocks < 64
    e.abort(rid)
    assert e.block_manager.num_free_blocks == 64 and not e.has_unfinished()
