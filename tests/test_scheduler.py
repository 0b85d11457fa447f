"""Scheduler: token budget, chunked prefill, admission and preemption (torch-free)."""
from ember.engine.block_manager import BlockManager
from ember.engine.sampling_params import SamplingParams
from ember.engine.scheduler import Scheduler
from ember.engine.sequence import SeqStatus, Sequence

ROOT = b"\x00" * 16


def seq(n, rid, start=0):
    tokens = list(range(start, start + n))
    return Sequence(rid, tokens, n, SamplingParams(), seed=0)


def finish_step(sched, batch, sample=True):
    """Pretend the model ran: advance computed counts and append a token where sampled."""
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        sched.block_manager.register_computed(s)
        if sample and s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


def test_long_prompt_is_chunked_under_the_budget():
    sched = Scheduler(BlockManager(64, 16, ROOT), max_num_seqs=8, max_num_batched_tokens=100)
    s = seq(250, "a")
    sched.add(s)
    chunks = []
    while s.num_computed_tokens < 250:
        batch = sched.schedule()
        chunks.append(batch.num_new_tokens[0])
        finish_step(sched, batch)
    assert chunks == [100, 100, 50]


def test_decodes_and_prefill_share_a_step_within_budget():
    sched = Scheduler(BlockManager(64, 16, ROOT), max_num_seqs=8, max_num_batched_tokens=64)
    a = seq(10, "a")
    sched.add(a)
    finish_step(sched, sched.schedule())
    sched.add(seq(200, "b", start=1000))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "b"]
    assert batch.num_new_tokens == [1, 63]
    assert sum(batch.num_new_tokens) <= 64


def test_admission_waits_when_blocks_run_out():
    sched = Scheduler(BlockManager(4, 16, ROOT), max_num_seqs=8, max_num_batched_tokens=512)
    sched.add(seq(40, "a"))
    sched.add(seq(40, "b", start=500))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_growth_preempts_the_newest_and_it_resumes_from_cache():
    bm = BlockManager(4, 4, ROOT)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512)
    a, b = seq(8, "a"), seq(8, "b", start=100)
    sched.add(a)
    sched.add(b)
    finish_step(sched, sched.schedule())  # both prefilled: 4 blocks used, one token each appended
    batch = sched.schedule()  # both need a third block: b is preempted for a
    assert batch.preempted == [b] and b.status is SeqStatus.WAITING
    assert [s.request_id for s in batch.seqs] == ["a"]
    assert bm.num_free_blocks + sum(x.ref_count > 0 for x in bm.blocks) == 4
    sched.finish(a, "length")
    batch = sched.schedule()
    assert batch.seqs == [b]
    # a's growth evicted one of b's parked blocks: the tail goes first, the head survives
    assert b.num_computed_tokens == 4, "b's first block comes back from the prefix cache"
    assert batch.num_new_tokens == [5]


def test_finish_frees_blocks():
    bm = BlockManager(8, 16, ROOT)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512)
    s = seq(20, "a")
    sched.add(s)
    sched.schedule()
    assert bm.num_free_blocks == 6
    sched.finish(s, "abort")
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()
