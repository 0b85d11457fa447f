"""TTFT first (issue 31): the step policy against the TTFT/TPOT objectives, the placer's choice
between colocated and disaggregated prefill on a shared host, and engines' disjoint CPU sets."""
from pathlib import Path

import pytest

from ember.config.load import load_config
from ember.config.services import engine_settings, host_cpu_sets
from ember.engine.block_manager import BlockManager
from ember.engine.sampling_params import SamplingParams
from ember.engine.scheduler import Scheduler
from ember.engine.sequence import Sequence
from ember.engine.step_policy import SLO, StepCosts, plan_step
from ember.placement.policy import Load, Placer, Request
from ember.util.cpus import parse_cpus, split_cores

ROOT = b"\x00" * 16
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


# -- the step policy ----------------------------------------------------------------------------
def costs(decode_step_s=0.05, token_s=0.002) -> StepCosts:
    c = StepCosts()
    c.observe(8, 0, decode_step_s)
    c.observe(0, 100, 100 * token_s)
    return c


def test_plan_step_choices():
    slo, c = SLO(ttft_s=1.0, tpot_s=0.25), costs()
    assert plan_step(slo, c, 0, 0.0, 0, False, 16).choice == "decode"
    assert plan_step(slo, c, 0, 0.0, 300, False, 16).choice == "prefill"
    # decoders just got a token and 100 tokens fit in their TPOT: prefill alone, decodes skipped
    p = plan_step(slo, c, 8, 0.0, 100, False, 16)
    assert (p.choice, p.serve_decodes) == ("prefill_first", False)
    # a 300-token chunk would make them late: decodes ride along, the chunk cut to the TPOT ...
    p = plan_step(slo, c, 8, 0.0, 300, False, 16)
    assert (p.choice, p.serve_decodes, p.prefill_cap) == ("mixed_tpot", True, int((0.25 - 0.05) / 0.002))
    # ... unless a prompt's TTFT is at risk: its whole chunk
    p = plan_step(slo, c, 8, 0.0, 300, True, 16)
    assert (p.choice, p.prefill_cap) == ("mixed_ttft", None)
    # decoders that already waited their TPOT get their token whatever the chunk
    assert plan_step(slo, c, 8, 0.3, 16, False, 16).serve_decodes
    # a cap never starves prefill: at least a block
    assert plan_step(SLO(1.0, 0.01), c, 8, 0.0, 300, False, 16).prefill_cap == 16


def test_step_costs_learn_from_steps():
    c = StepCosts()
    assert c.prefill_s(100) == 0.0 and c.tokens_within(1.0, 4) is None  # unknown: optimistic
    c.observe(4, 0, 0.04)
    c.observe(4, 200, 0.44)  # decode part 0.04, 200 tokens 0.4 s
    assert c.decode_step_s == pytest.approx(0.04) and c.token_s == pytest.approx(0.002)
    assert c.tokens_within(0.24, 4) in (99, 100)  # (float rounding)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def seq(n, rid, start):
    return Sequence(rid, list(range(start, start + n)), n, SamplingParams(), seed=0)


def run_step(sched, clock, batch, seconds):
    """The model 'runs' the batch in `seconds` of the fake clock; sampled rows get a token."""
    clock.now += seconds
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        sched.block_manager.register_computed(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
    sched.step_done(batch, seconds)


def step_seconds(batch, decode_step_s=0.05, token_s=0.002):
    prefill = sum(batch.num_new_tokens) - batch.num_decodes
    return (decode_step_s if batch.num_decodes else 0.0) + prefill * token_s


@pytest.mark.parametrize("tpot_s", [10.0, 0.06])
def test_burst_of_follow_ups_against_running_decodes(tpot_s):
    """8 streams decode; 8 prompts of 100 tokens arrive at once. With TPOT room, every prompt's first
    token comes before the decoders' next 4 tokens (prefill-first steps); with a tight TPOT the decoders
    get a token every step and the prompts are cut to fit it. Either way no decoder waits much past
    its TPOT (by at most one step's estimate error)."""
    clock = Clock()
    sched = Scheduler(BlockManager(512, 16, ROOT), max_num_seqs=32, max_num_batched_tokens=1024,
                      slo=SLO(ttft_s=5.0, tpot_s=tpot_s), clock=clock)
    decoders = [seq(32, f"d{i}", 1000 * (i + 1)) for i in range(8)]
    for d in decoders:
        sched.add(d)
    while any(len(d.token_ids) == d.prompt_len for d in decoders):  # their prompts
        batch = sched.schedule()
        run_step(sched, clock, batch, step_seconds(batch))
    start_tokens = {d.request_id: len(d.token_ids) for d in decoders}
    sched.choices.clear()  # (the decoders' own prompts were steps too)
    prompts = [seq(100, f"p{i}", 50_000 + 1000 * i) for i in range(8)]
    for p in prompts:
        sched.add(p)
    first_token_after = {}  # prompt -> decoder tokens the slowest decoder had gained by then
    last_token_at = {d.request_id: clock.now for d in decoders}
    worst_gap = 0.0
    for _ in range(200):
        batch = sched.schedule()
        run_step(sched, clock, batch, step_seconds(batch))
        for s in batch.seqs:
            if s.request_id in last_token_at:
                worst_gap = max(worst_gap, clock.now - last_token_at[s.request_id])
                last_token_at[s.request_id] = clock.now
        gained = max(len(d.token_ids) - start_tokens[d.request_id] for d in decoders)
        for p in prompts:
            if len(p.token_ids) > p.prompt_len and p.request_id not in first_token_after:
                first_token_after[p.request_id] = gained
        if len(first_token_after) == len(prompts):
            break
    assert len(first_token_after) == 8
    if tpot_s == 10.0:
        assert max(first_token_after.values()) < 4, first_token_after
        assert sched.choices["prefill_first"] >= 8
    else:
        assert sched.choices["mixed_tpot"] > sched.choices["prefill_first"]  # (a short remainder may fit)
        assert max(first_token_after.values()) >= 8  # the decoders kept going meanwhile
    assert worst_gap <= tpot_s + max(0.05 + 100 * 0.002, 0.05), (worst_gap, dict(sched.choices))


def test_no_policy_keeps_the_budget_filling_scheduler():
    sched = Scheduler(BlockManager(64, 16, ROOT), max_num_seqs=8, max_num_batched_tokens=512)
    sched.add(seq(10, "a", 0))
    sched.add(seq(40, "b", 500))
    batch = sched.schedule()
    assert batch.num_new_tokens == [10, 40] and not sched.choices


# -- engines' CPU sets ---------------------------------------------------------------------------
def test_cpu_lists_and_splits():
    assert parse_cpus("0,2,4-5") == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpus("0-x")
    with pytest.raises(ValueError, match="range must go up"):
        parse_cpus("3-1")
    assert split_cores([0, 1], [1, 1]) == [[0], [1]]
    assert split_cores([0, 1, 2, 3, 4], [1, 1]) == [[0, 1, 2], [3, 4]]
    assert split_cores([0, 1], [2, 1]) is None  # more ranks than cores: not pinned


def shipped(tmp_path, pinned=False):
    """configs/local.yaml as shipped, or with `cpus: auto` in place of its 2 threads per engine."""
    text = (CONFIGS / "local.yaml").read_text()
    if pinned:
        text = "\n".join("  cpus: auto" if line.startswith("  threads:") else line for line in text.splitlines())
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return load_config(path)


def test_cpus_auto_gives_engines_on_one_host_disjoint_sets(tmp_path, monkeypatch):
    monkeypatch.setattr("ember.util.cpus.host_cpus", lambda: [0, 1, 2, 3])
    config = shipped(tmp_path, pinned=True)
    sets = host_cpu_sets(config)
    assert sets == {("prefill", "central", 0): "0,1", ("decode", "edge", 0): "2,3"}
    _, engine = engine_settings(config, "decode", "edge")
    assert engine.pinned_cpus() == [2, 3] and engine.torch_threads() == 2


# -- colocated or disaggregated on a shared host ---------------------------------------------------
def test_placer_prices_the_shared_host(tmp_path):
    config = shipped(tmp_path)
    assert config.shares_host("central", "edge")
    placer = Placer(config)
    # a follow-up turn: the decode site holds the whole history (answers too), the prefill site less
    follow_up = Request(2800, 32, None, {"central": 150, "edge": 170})
    d = placer.place(follow_up, Load())
    assert d.colocated and d.prefill_site == "edge" and "colocated" in d.reason
    # the decode worker busy with queued prefill work: the prefill worker is cheaper now
    d = placer.place(follow_up, Load(prefill_queue_s={"edge": 5.0}, decode_running={"edge": 8}))
    assert not d.colocated and d.prefill_site == "central" and "disaggregated" in d.reason
    assert {e.site for e in d.candidates} == {"central", "edge"}


def test_sites_across_a_link_are_not_a_shared_host():
    config = load_config(CONFIGS / "edge-example.yaml")
    names = [s.name for s in config.sites]
    assert not any(config.shares_host(a, b) for a in names for b in names if a != b)
    placer = Placer(config)
    region = config.regions[0].name
    d = placer.place(Request(4000, 32, region, {}), Load())
    assert not d.colocated
