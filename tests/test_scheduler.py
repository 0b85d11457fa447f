"""Scheduler: token budget, chunked prefill, admission and preemption (torch-free)."""
from ember.engine.block_manager import BlockManager
from ember.engine.sampling_params import SamplingParams
from ember.engine.scheduler import Scheduler
from ember.engine.sequence import SeqStatus, Sequence, Tenant

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


# -- TTFT-aware prefill: decodes first, prompts one at a time, starvation bound ------------------

def run_burst(sched, seqs, max_steps=200):
    """Step until every prompt is prefilled; per step: prompts mid-prefill, blocks used."""
    done, partial, used = {}, [], []
    for step in range(1, max_steps + 1):
        batch = sched.schedule()
        finish_step(sched, batch)
        for s in seqs:
            if s.request_id not in done and s.num_computed_tokens >= s.prompt_len:
                done[s.request_id] = step
        partial.append(sum(0 < s.num_computed_tokens < s.prompt_len for s in seqs))
        used.append(sched.block_manager.num_used_blocks)
        if len(done) == len(seqs):
            return done, partial, used
    raise AssertionError(f"burst not done after {max_steps} steps: {done}")


BURST = [900, 2500, 300, 1200, 450, 2000, 600, 1500]  # agentic-sized prompts, arriving together


def test_burst_prompts_finish_one_after_another():
    bm = BlockManager(2048, 16, ROOT)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512, starvation_steps=100)
    seqs = [seq(n, f"p{i}", start=10_000 * i) for i, n in enumerate(BURST)]
    for s in seqs:
        sched.add(s)
    done, partial, used = run_burst(sched, seqs)
    first, last = min(done, key=done.get), max(done, key=done.get)
    # the first prompt's TTFT is its own prefill, not the burst's: done in step 1 of ~20
    assert done[first] == 1 and done[last] >= 19
    # the last one has not even started its final chunk when the first one is done
    final_chunk_start = done[last]
    assert done[first] < final_chunk_start - 10
    # shortest first, and completions are spread out: never more than two in one step
    assert [s.request_id for s in sorted(seqs, key=lambda s: done[s.request_id])] == \
        [s.request_id for s in sorted(seqs, key=lambda s: s.prompt_len)]
    assert max(list(done.values()).count(v) for v in done.values()) <= 2
    # one prompt at a time: at most one is left half-prefilled at the end of a step...
    assert max(partial) == 1
    # ...and queued prompts hold no KV blocks: step 1 has 300 + 212 of 450 tokens admitted
    assert used[0] == bm.blocks_needed(300) + bm.blocks_needed(450)
    assert len(sched.running) == 8 and not sched.waiting


def test_burst_mean_ttft_beats_all_together():
    """Steps to first token, summed over the burst: one at a time vs everyone sharing each step."""
    sched = Scheduler(BlockManager(2048, 16, ROOT), max_num_seqs=8, max_num_batched_tokens=512,
                      starvation_steps=100)
    seqs = [seq(n, f"p{i}", start=10_000 * i) for i, n in enumerate(BURST)]
    for s in seqs:
        sched.add(s)
    done, _, _ = run_burst(sched, seqs)
    total_steps = -(-sum(BURST) // 512)  # give or take decodes: when all would finish together
    assert max(done.values()) <= total_steps + 2
    assert sum(done.values()) / len(done) < 0.6 * total_steps


def test_decodes_are_never_starved_by_prefill():
    sched = Scheduler(BlockManager(1024, 16, ROOT), max_num_seqs=16, max_num_batched_tokens=64)
    decoders = [seq(10, f"d{i}", start=100 * i) for i in range(4)]
    for d in decoders:
        sched.add(d)
    finish_step(sched, sched.schedule())  # all four prefilled, now decoding
    for i in range(6):
        sched.add(seq(700, f"long{i}", start=10_000 * (i + 1)))
    for _ in range(30):
        batch = sched.schedule()
        got = dict(zip((s.request_id for s in batch.seqs), batch.num_new_tokens))
        assert all(got[d.request_id] == 1 for d in decoders), got
        assert batch.seqs[:4] == decoders, "decodes come first"
        assert sum(batch.num_new_tokens) == 64, "prefill takes what decode leaves, no more"
        finish_step(sched, batch)


def test_long_prompt_behind_a_stream_of_short_ones_is_not_starved():
    def run(starvation_steps):
        sched = Scheduler(BlockManager(1024, 16, ROOT), max_num_seqs=64, max_num_batched_tokens=128,
                          starvation_steps=starvation_steps)
        long = seq(1000, "long")
        sched.add(long)
        for step in range(40):
            # every step a short prompt arrives that would take the whole budget
            short = seq(128, f"s{step}", start=10_000 * (step + 1))
            sched.add(short)
            batch = sched.schedule()
            finish_step(sched, batch)
            for s in list(sched.running):
                if s is not long and s.num_computed_tokens >= s.prompt_len:
                    sched.finish(s, "length")  # short ones leave after their first token
            if long.num_computed_tokens >= long.prompt_len:
                return step
        return None

    assert run(starvation_steps=10 ** 9) is None, "without a bound the long prompt never runs"
    bound = 4
    finished = run(starvation_steps=bound)
    assert finished is not None and finished <= bound + -(-1000 // 128)
    assert run(starvation_steps=0) == -(-1000 // 128) - 1, "0 = FCFS: it runs first"


def test_cached_follow_up_jumps_ahead_of_a_cold_long_prompt():
    bm = BlockManager(1024, 16, ROOT)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    history = seq(1600, "turn1")
    sched.add(history)
    while history.num_computed_tokens < history.prompt_len:
        finish_step(sched, sched.schedule())
    sched.finish(history, "stop")
    cold = seq(2000, "cold", start=50_000)
    follow_up = Sequence("turn2", history.token_ids + list(range(90_000, 90_100)), 1701,
                         SamplingParams(), seed=0)
    sched.add(cold)  # arrives first
    sched.add(follow_up)
    batch = sched.schedule()
    assert batch.seqs == [follow_up] + [cold]
    assert follow_up.num_cached_tokens == 1600 and batch.num_new_tokens == [101, 155]


def test_fully_cached_prompt_gets_its_last_token_computed():
    bm = BlockManager(64, 16, ROOT)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=3)
    a = seq(33, "a")
    sched.add(a)
    while a.num_computed_tokens < 33:
        finish_step(sched, sched.schedule())
    decoders = [seq(2, f"d{i}", start=500 + 10 * i) for i in range(2)]
    for d in decoders:
        sched.add(d)
    finish_step(sched, sched.schedule())  # a decodes; d0 takes the other two tokens
    sched.finish(a, "stop")
    finish_step(sched, sched.schedule())  # d0 decodes, d1 prefills
    again = seq(33, "again")
    sched.add(again)
    batch = sched.schedule()  # two decodes, one token left: exactly what `again` needs
    assert batch.seqs == decoders + [again] and batch.num_new_tokens == [1, 1, 1]
    assert again.num_cached_tokens == 32


def test_decode_growth_preempts_a_prefill_admitted_after_it():
    bm = BlockManager(12, 4, ROOT)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6)
    a = seq(4, "a")
    sched.add(a)
    finish_step(sched, sched.schedule())  # a: 1 block, 4 computed + 1 sampled
    b = seq(40, "b", start=100)
    sched.add(b)
    batch = sched.schedule()  # a's decode takes a 2nd block; b admitted with all its 10
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 5] and bm.num_free_blocks == 0
    finish_step(sched, batch)
    for _ in range(3):  # a fills its 2nd block while b prefills 5 tokens a step
        finish_step(sched, sched.schedule())
    assert a.num_computed_tokens == 8 and b.num_computed_tokens == 20
    batch = sched.schedule()  # a needs a 3rd block: b, the newest, is preempted mid-prefill
    assert batch.preempted == [b] and batch.seqs == [a] and b.status is SeqStatus.WAITING
    assert not b.block_table and list(sched.waiting) == [b] and sched.num_preemptions == 1
    finish_step(sched, batch)
    sched.finish(a, "stop")
    batch = sched.schedule()
    # a's block came from b's uncomputed tail: b's computed blocks are still cached
    assert batch.seqs == [b] and b.num_computed_tokens == 20 and batch.num_new_tokens == [6]


def test_decodes_beyond_the_budget_take_turns():
    sched = Scheduler(BlockManager(64, 16, ROOT), max_num_seqs=8, max_num_batched_tokens=4)
    decoders = [seq(3, f"d{i}", start=100 * i) for i in range(4)]
    for d in decoders:
        sched.add(d)
    finish_step(sched, sched.schedule())  # d0 3 tokens + d1 1 of 3 (one at a time)
    while any(d.num_computed_tokens < d.prompt_len for d in decoders):
        finish_step(sched, sched.schedule())
    sched.max_num_batched_tokens = 3  # now fewer tokens than decoders
    counts = {d.request_id: 0 for d in decoders}
    for _ in range(8):
        batch = sched.schedule()
        assert len(batch.seqs) == 3
        for s in batch.seqs:
            counts[s.request_id] += 1
        finish_step(sched, batch)
    assert sorted(counts.values()) == [6, 6, 6, 6]


def tenant_seq(n, rid, tenant, start, weight=1.0):
    s = seq(n, rid, start)
    s.tenant = Tenant(tenant, weight)
    return s


def test_a_tenants_request_goes_ahead_of_another_tenants_queued_burst():
    sched = Scheduler(BlockManager(256, 16, ROOT), max_num_seqs=64, max_num_batched_tokens=64)
    burst = [tenant_seq(40, f"a{i}", "A", 1000 * i) for i in range(6)]
    for s in burst:
        sched.add(s)
    finish_step(sched, sched.schedule())  # A's first prompt is under way
    late = tenant_seq(40, "b", "B", 90_000)  # longer remaining than nothing, but B runs nothing
    sched.add(late)
    batch = sched.schedule()
    assert "b" in [s.request_id for s in batch.seqs]
    order = [s.request_id for s in batch.seqs if s.num_computed_tokens == 0 and s.request_id != "a0"]
    assert order[0] == "b", order  # ahead of A's queued prompts (all as short as it)


def test_one_tenant_keeps_the_queue_order_it_had():
    sched = Scheduler(BlockManager(256, 16, ROOT), max_num_seqs=8, max_num_batched_tokens=512)
    for i, n in enumerate((60, 20, 40)):
        sched.add(tenant_seq(n, f"s{i}", "only", 1000 * i))
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["s1", "s2", "s0"]  # shortest remaining first, as always


def test_a_full_batch_gives_a_seat_to_a_new_tenant_by_preempting_the_burst():
    sched = Scheduler(BlockManager(256, 16, ROOT), max_num_seqs=4, max_num_batched_tokens=512)
    burst = [tenant_seq(16, f"a{i}", "A", 1000 * i) for i in range(6)]
    for s in burst:
        sched.add(s)
    finish_step(sched, sched.schedule())
    assert len(sched.running) == 4  # A alone fills the batch
    b = tenant_seq(16, "b", "B", 90_000)
    sched.add(b)
    batch = sched.schedule()
    assert b.status is SeqStatus.RUNNING and b in batch.seqs
    assert [s.request_id for s in batch.preempted] == ["a3"]  # A's newest gave its seat back
    assert batch.num_decodes == 3 and len(batch.seqs) == 4  # (its decode token unscheduled)
    finish_step(sched, batch)
    sched.add(tenant_seq(16, "b2", "B", 95_000))  # 3 A > 1 + 1 B: one more seat changes hands
    batch = sched.schedule()
    assert [s.request_id for s in batch.preempted] == ["a2"]
    finish_step(sched, batch)
    b3 = tenant_seq(16, "b3", "B", 97_000)  # 2 A, 2 B: an even split stays (no seat moves back and forth)
    sched.add(b3)
    batch = sched.schedule()
    assert not batch.preempted and b3.status is SeqStatus.WAITING


def test_weights_set_the_seats_a_tenant_keeps():
    sched = Scheduler(BlockManager(256, 16, ROOT), max_num_seqs=4, max_num_batched_tokens=512)
    for i in range(4):
        sched.add(tenant_seq(16, f"a{i}", "A", 1000 * i, weight=3.0))
    finish_step(sched, sched.schedule())
    sched.add(tenant_seq(16, "b", "B", 90_000))
    batch = sched.schedule()
    assert [s.request_id for s in batch.preempted] == ["a3"]  # 4/3 > (0+1)/1
    finish_step(sched, batch)
    sched.add(tenant_seq(16, "b2", "B", 95_000))
    batch = sched.schedule()
    assert not batch.preempted  # A's 3/3 is not more than B's (1+1)/1
