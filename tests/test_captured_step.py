"""The captured decode step (ember.kernels.cpu_step): one C++ call per step over a plan made at start,
per batch-size bucket, giving the same bits as the op-by-op path for every size."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.engine.sampling_params import SamplingParams
from ember.kernels import cpu_step
from ember.kernels.native import available
from ember.model.llama import apply_rope

pytestmark = pytest.mark.skipif(not available(), reason="the C++ kernels do not build here "
                                "(test_paged_attention.py's build test fails instead)")

STORY = "Write a short story about a robot named Bob who learns to paint. Story number {}:"


def _generate(engine, prompts: list, tokens: int, **params) -> list[tuple[list[int], list]]:
    """Greedy tokens and their logprobs (exact floats: a changed bit in the logits shows) per prompt,
    every prompt decoding in the same steps."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=2, **params))
           for p in prompts]
    out = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend((lp.logprob, lp.top_logprobs) for lp in o.logprobs or ())
    return [out[i] for i in ids]


def test_the_default_q4_engine_captures_its_step_and_enforce_eager_turns_it_off(q4_engine):
    captured = q4_engine(speculative_tokens=0).runner.captured
    assert captured is not None and captured.max_rows == 64
    assert [captured.bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    with pytest.raises(ValueError, match="bigger than the largest capture size"):
        captured(torch.zeros(65, 576, dtype=torch.bfloat16), None, None, None, 1.0)
    assert q4_engine(enforce_eager=True).runner.captured is None


def test_the_fp32_exact_path_is_not_captured(make_engine):
    engine = make_engine()
    assert engine.runner.captured is None
    assert "bf16" in cpu_step.unsupported(engine.loaded.model, engine.cache)


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7, 8, 16])
def test_captured_and_eager_steps_give_the_same_tokens_and_logprobs_at_every_bucket_and_between(q4_engine, batch):
    """A batch between buckets (3, 7) runs in the next bucket up with its real rows; the prompts'
    prefill (bigger than any bucket) runs op by op in both engines."""
    prompts = [STORY.format(i) for i in range(batch)]
    eager_engine, captured_engine = q4_engine(enforce_eager=True, speculative_tokens=0), q4_engine(speculative_tokens=0)
    for e in (eager_engine, captured_engine):  # steps shaped by the budget alone, not the TTFT policy's clock:
        e.scheduler.slo = None  # (on a loaded host it mixed a decode into a prefill step: 10 captured, not 11)
    eager = _generate(eager_engine, prompts, 12)
    assert _generate(captured_engine, prompts, 12) == eager
    steps = captured_engine.runner.captured.steps
    assert steps[captured_engine.runner.captured.bucket(batch)] >= 11  # the decode steps ran captured


def test_speculative_verify_steps_and_prefill_chunks_in_a_bucket_are_the_same_bits(q4_engine):
    """Verify steps (several rows per sequence) and a small prefill chunk (a cached prefix's tail, or a
    chunk under the token budget) also run captured: the same tokens and logprobs as op by op."""
    text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"
    prompts = [text, STORY.format(1)]
    settings = dict(speculative_tokens=3, max_num_batched_tokens=24)  # prefill in chunks of <= 24 rows
    eager = _generate(q4_engine(enforce_eager=True, **settings), prompts, 24)
    engine = q4_engine(**settings)
    assert _generate(engine, prompts, 24) == eager
    assert engine.stats.num_accepted_tokens > 0  # verify steps ran, and some drafts were taken
    assert engine.runner.captured.steps[32] > 0  # steps of 17-32 rows: prefill chunks, captured


def test_steps_bigger_than_the_largest_bucket_run_op_by_op(q4_engine):
    prompts = [STORY.format(i) for i in range(3)]
    small = q4_engine(speculative_tokens=0, capture_sizes=[1, 2])
    assert small.runner.captured.max_rows == 2
    assert _generate(small, prompts, 6) == _generate(q4_engine(enforce_eager=True, speculative_tokens=0), prompts, 6)
    assert small.runner.captured.steps == {1: 0, 2: 0}  # three rows a step: all op by op


def test_rope_store_is_the_models_rope_bit_for_bit():
    torch.manual_seed(0)
    rows, heads, kv_heads, dim = 5, 9, 3, 64
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim).bfloat16()
    positions = torch.tensor([0, 7, 100, 2047, 31])
    from ember.model.llama import rope_cos_sin
    cos, sin = (t[positions] for t in rope_cos_sin(dim, 100000.0, 2048))
    q, k, v = cpu_step.rope_store(qkv, cos, sin, heads, kv_heads)
    ref = apply_rope(qkv[:, :heads + kv_heads], cos, sin).to(torch.bfloat16)
    assert torch.equal(q, ref[:, :heads]) and torch.equal(k, ref[:, heads:])
    assert torch.equal(v, qkv[:, heads + kv_heads:])


def test_silu_mul_is_within_a_bf16_rounding_of_torch_and_each_row_stands_alone():
    torch.manual_seed(0)
    gate_up = (torch.randn(40, 2 * 1536) * 4).bfloat16()
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -200.0, 200.0, 3.0]).bfloat16()
    out = cpu_step.silu_mul(gate_up)
    gate, up = gate_up.float().split(1536, -1)
    ref = F.silu(gate).bfloat16().float() * up
    assert torch.isfinite(out.float()).all()
    # silu rounded to bf16 may differ by one bf16 step from torch's (another exp), then times up
    assert ((out.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-30).all()
    alone = torch.cat([cpu_step.silu_mul(gate_up[i:i + 1]) for i in range(40)])
    assert torch.equal(alone, out)
