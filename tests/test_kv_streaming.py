"""Layer-wise KV streaming at chunk grain (issue 19, item 1): a remote prefill's blocks leave for
the decode site's kvstore chunk by chunk while later chunks compute. In-process here (the engine
core's part); across real processes and an emulated link in test_kv_streaming_cluster.py."""
from __future__ import annotations

from ember.engine.sampling_params import SamplingParams
from ember.engine.scheduler import STREAM_TAIL_TOKENS, streamed_chunk
from ember.kv.block_hash import chain_hashes
from ember.serving.engine_core import EngineCore
from ember.serving.messages import AddRequest, KVPlan
from tests.conftest import LONG_TEXT
from tests.test_engine_core import LoopbackConnector, drive


def chunks(prompt_tokens: int, budget: int = 1024, block_size: int = 16) -> list[int]:
    out, left = [], prompt_tokens
    while left:
        out.append(min(budget, streamed_chunk(left, block_size)))
        left -= out[-1]
    return out


def test_a_streamed_prompt_ends_with_a_small_chunk_each_hidden_by_the_next():
    assert chunks(2048) == [1024, 896, 128]
    assert chunks(4096) == [1024, 1024, 1024, 896, 128]
    assert chunks(1000) == [872, 128]
    assert chunks(100) == [100] and chunks(STREAM_TAIL_TOKENS + 10) == [STREAM_TAIL_TOKENS + 10]
    for n in (17, 129, 300, 2500, 9000):
        parts = chunks(n)
        assert sum(parts) == n and parts[-1] <= STREAM_TAIL_TOKENS + 16, parts
        # each chunk's transfer hides under the next one's compute when the link is >= 8x prefill
        assert all(a <= 8 * b for a, b in zip(parts, parts[1:])), parts


class StreamingConnector(LoopbackConnector):
    """Records what leaves when: each stream() call (a chunk's blocks, stored and sent on) and the
    prefill's final write-back."""

    def __init__(self, template):
        super().__init__({}, template)
        self.streamed: list[list[bytes]] = []  # hashes per call, in order
        self.sent_to: set[str] = set()
        self.prefetched: list[bytes] = []

    def stream(self, frames, to, prefetch=(), after=(), trace_context=None):
        self.streamed.append([h for h, _ in frames])
        self.sent_to.add(to)
        self.prefetched += list(prefetch)
        return self.store(frames)


def run_prefill(engine, prompt: list[int], stream_to: str, connector: StreamingConnector | None = None
                ) -> tuple[list[int], StreamingConnector]:
    connector = connector or StreamingConnector(engine.frame_template)
    core = EngineCore(engine, connector)
    plan = KVPlan(read_through=False, write_back="sync", stream_to=stream_to)
    tokens = drive(core, [AddRequest("r", prompt, SamplingParams(max_tokens=1), plan=plan)])["r"]
    assert not core.live and not core.pending
    return tokens, connector


def test_streamed_and_unstreamed_prefills_give_identical_frames_and_tokens(q4_engine):
    """The default (q4) path, whose KV does not depend on how the prompt is chunked: the frames that
    stream chunk by chunk are the very frames the one-shot write-back stores."""
    streamed_engine, plain_engine = q4_engine(), q4_engine()
    prompt = streamed_engine.tokenizer.encode(LONG_TEXT)[:1000]
    hashes = chain_hashes(prompt, 16, streamed_engine.block_manager.root_hash)
    tokens, streamed = run_prefill(streamed_engine, prompt, "127.0.0.1:1")
    plain_tokens, plain = run_prefill(plain_engine, prompt, "")
    assert tokens == plain_tokens
    assert not plain.streamed and plain.frames.keys() == set(hashes)
    # 872 tokens' 54 full blocks left as they completed; the last chunk's 8 with the write-back,
    # which streams too
    assert [len(s) for s in streamed.streamed] == [54, 8] and streamed.sent_to == {"127.0.0.1:1"}
    assert [h for s in streamed.streamed for h in s] == hashes  # each block once, in order
    assert streamed.frames == plain.frames  # byte for byte


def test_a_cached_prefix_the_site_store_holds_is_only_pulled_to_the_decode_site(q4_engine):
    engine = q4_engine()
    prompt = engine.tokenizer.encode(LONG_TEXT)[:700]
    hashes = chain_hashes(prompt, 16, engine.block_manager.root_hash)
    engine.generate([prompt[:320]], SamplingParams(max_tokens=1))  # 20 blocks in the pool (L1) ...
    connector = StreamingConnector(engine.frame_template)
    connector.frames.update(zip(hashes[:20], engine.export_frames(hashes[:20])))  # ... and the site store
    _, connector = run_prefill(engine, prompt, "127.0.0.1:1", connector)
    assert connector.prefetched == hashes[:20]
    assert [h for s in connector.streamed for h in s] == hashes[20:]


def test_a_cached_prefix_the_site_store_lacks_is_stored_and_sent_with_the_write_back(q4_engine):
    engine = q4_engine()
    prompt = engine.tokenizer.encode(LONG_TEXT)[:700]
    hashes = chain_hashes(prompt, 16, engine.block_manager.root_hash)
    engine.generate([prompt[:320]], SamplingParams(max_tokens=1))  # in the pool only
    _, connector = run_prefill(engine, prompt, "127.0.0.1:1")
    assert connector.prefetched == []  # (not asked of the decode site: the site store lacks them)
    assert sorted(h for s in connector.streamed for h in s) == sorted(hashes)
    assert set(connector.streamed[-1]) >= set(hashes[:20])
