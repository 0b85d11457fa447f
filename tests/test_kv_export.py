"""KV seams: export blocks as bytes, import them into another engine, resume decode there."""
from __future__ import annotations

import pytest

from ember.engine.detokenizer import streamed_text
from ember.engine.errors import IntegrityError
from ember.engine.sampling_params import SamplingParams
from tests.conftest import LONG_TEXT


def test_prefill_export_import_resume_equals_colocated(make_engine):
    prefill, decode, colocated = (make_engine(kv_cache_mb=64) for _ in range(3))
    ids = prefill.tokenizer.encode(LONG_TEXT[:1500])
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7)
    [want] = colocated.generate([ids], params)

    first = prefill.prefill(ids, params)
    assert first.token_ids == want.token_ids[:1]
    assert len(first.block_hashes) == len(ids) // 16
    payloads = prefill.export_blocks(first.block_hashes)
    assert all(len(p) == prefill.layout.block_bytes for p in payloads)

    assert decode.import_blocks(ids, first.block_hashes, payloads) == len(payloads)
    before = decode.stats.num_computed_tokens
    [rest] = decode.generate([ids + first.token_ids], SamplingParams(max_tokens=15, temperature=0.8, seed=7))
    assert rest.cached_tokens == len(payloads) * 16
    # only the partial tail block (+ the first token) and the decode steps were computed
    assert decode.stats.num_computed_tokens - before == len(ids) % 16 + 1 + 14
    assert first.token_ids + rest.token_ids == want.token_ids


def test_import_rejects_mismatched_hashes_and_sizes(make_engine):
    src, dst = make_engine(num_kv_blocks=32), make_engine(num_kv_blocks=32)
    ids = src.tokenizer.encode(LONG_TEXT[:400])
    first = src.prefill(ids)
    payloads = src.export_blocks(first.block_hashes)
    tampered = list(ids)
    tampered[3] += 1
    with pytest.raises(IntegrityError):
        dst.import_blocks(tampered, first.block_hashes, payloads)
    with pytest.raises(IntegrityError):
        dst.import_blocks(ids, first.block_hashes, [p[:-4] for p in payloads])
    assert dst.block_manager.num_free_blocks == 32 and not dst.block_manager.cached


def test_export_of_an_unknown_block_is_not_found(engine):
    from ember.errors import NotFoundError
    with pytest.raises(NotFoundError):
        engine.export_blocks([b"\x01" * 16])


def test_resume_with_output_prefix_streams_the_same_text_as_colocated(make_engine):
    prefill, decode, colocated = (make_engine(kv_cache_mb=32) for _ in range(3))
    prompt = prefill.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with three emoji and the word 'café' in Japanese: 🎉"}])
    ids = prefill.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3)
    [want] = colocated.generate([ids], params)

    rid = prefill.add_request(ids, SamplingParams(max_tokens=1, temperature=0.7, seed=3))
    [first] = prefill.step()
    assert first.request_id == rid and first.finished
    payloads = prefill.export_blocks(first.block_hashes)
    decode.import_blocks(ids, first.block_hashes, payloads)
    decode.add_request(ids, params, output_prefix=first.new_token_ids)
    texts = [streamed_text(first.new_token_ids, params, prefill.tokenizer.decode)]  # what prefill sends
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            texts.append(out.new_text)
            tokens += out.new_token_ids
            final = out
    assert tokens == want.token_ids
    assert "".join(texts) == want.text
    assert final.completion_tokens == len(want.token_ids)
