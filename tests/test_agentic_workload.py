"""The agentic benchmark's workload is seeded, grows every turn and shares its system prompt."""
from __future__ import annotations

import json

from ember.bench.agentic_workload import SYSTEM, TOOLS, advance, sessions


def test_sessions_are_reproducible_and_grow_turn_by_turn():
    a, b = sessions(3, 4, seed=7), sessions(3, 4, seed=7)
    assert [s.pending for s in a] == [s.pending for s in b]
    assert sessions(3, 4, seed=8)[0].pending != a[0].pending
    s = a[0]
    assert s.messages[0] == {"role": "system", "content": SYSTEM} and len(s.pending) == 3
    lengths = [len(json.dumps(s.messages))]
    while advance(s, "I will call read_file."):
        lengths.append(len(json.dumps(s.messages)))
    assert len(lengths) == 4 and lengths == sorted(lengths), "each turn resubmits more context"
    assert s.messages[-1]["role"] == "assistant" and not s.pending
    assert all(x.messages[0]["content"] == SYSTEM for x in a), "one system prompt shared by every session"
    assert {t["function"]["name"] for t in TOOLS} >= {"read_file", "run_tests"}


# --- the harness around the workload: closed loop, arrivals, report, plots -------------------

import asyncio  # noqa: E402
import io  # noqa: E402

import pytest  # noqa: E402

from ember.bench.agentic_bench import run_phase  # noqa: E402
from ember.bench.agentic_report import ProgressBar, plot, summarize, targets  # noqa: E402
from ember.bench.agentic_systems import Record  # noqa: E402


class EchoSystem:
    """A unit-test stand-in: answers after a fixed delay, 4 tokens, and records what it was sent."""
    name = "echo"

    def __init__(self, delay_s: float = 0.01):
        self.delay_s, self.sent = delay_s, []

    async def turn(self, s, max_tokens):
        self.sent.append((s.session_id, len(s.messages)))
        await asyncio.sleep(self.delay_s)
        r = Record(s.session_id, ttft_s=self.delay_s, e2e_s=self.delay_s * 4, gaps_s=[self.delay_s] * 3,
                   output_tokens=4, prompt_tokens=100 * len(s.messages), cached_tokens=50 * len(s.messages))
        return f"answer {len(self.sent)}", r


def test_run_phase_is_closed_loop_per_session():
    system = EchoSystem()
    records, wall = asyncio.run(run_phase(system, "t", num_sessions=3, turns=4, max_tokens=4, seed=1))
    assert len(records) == 12 and wall > 0
    for sid in {r.session for r in records}:
        turns = [r.turn for r in records if r.session == sid]
        assert turns == [1, 2, 3, 4]
        sizes = [n for s, n in system.sent if s == sid]
        assert sizes == sorted(sizes) and len(set(sizes)) == 4  # each turn carries the previous answer


def test_poisson_arrivals_spread_session_starts():
    system = EchoSystem(delay_s=0.001)
    records, _ = asyncio.run(run_phase(system, "t", num_sessions=6, turns=1, max_tokens=4, seed=3, arrival_rate=20.0))
    import random
    rng = random.Random(3)  # the arrivals run_phase plans for seed 3 (a sleep never ends early)
    planned = sum(rng.expovariate(20.0) for _ in range(5))
    starts = sorted(r.start_s for r in records)
    assert planned > 0.05 and starts[-1] - starts[0] >= planned - 0.005, (starts, planned)
    together, _ = asyncio.run(run_phase(EchoSystem(0.001), "t", num_sessions=6, turns=1, max_tokens=4, seed=3))
    spread = max(r.start_s for r in together) - min(r.start_s for r in together)
    assert spread < planned / 2, (spread, planned)  # all at once: within one pass of the event loop


def test_summary_percentiles_goodput_and_targets(tmp_path):
    recs = [Record("a", turn=t, ttft_s=float(t), e2e_s=float(t) + 0.3, gaps_s=[0.1] * 3, output_tokens=4,
                   prompt_tokens=100, cached_tokens=50 if t > 1 else 0) for t in (1, 2, 3, 4)]
    s = summarize(recs, wall_s=10.0, slo_ttft_s=2.5, slo_tpot_s=0.2)
    assert s["ttft_turn2plus"]["p50"] == 3.0 and s["ttft"]["p99"] == 4.0
    assert s["tpot"]["p50"] == pytest.approx(0.1)
    assert s["slo"]["met_fraction"] == 0.5 and s["slo"]["goodput_req_per_s"] == pytest.approx(0.2)
    assert s["prefix_hit_rate"] == pytest.approx(150 / 400) and s["ttft_by_turn"]["3"] == 3.0
    assert s["output_tok_per_s"] == pytest.approx(1.6)
    slow = summarize([Record("b", turn=t, ttft_s=4.0 * t, e2e_s=4.0 * t + 1, output_tokens=4) for t in (1, 2, 3)],
                     10.0, 2.5, 0.2)
    result = {"sessions": 1, "turns": 4, "replay": {"ember-colocated": s, "llama-server": slow},
              "streams16": {"ember-colocated": {"output_tok_per_s": 3.0}, "llama-server": {"output_tok_per_s": 1.0}},
              "single_stream": {}, "prefill_roofline": {"fraction_of_roofline": 0.5}}
    t = targets(result)
    assert t["ember-colocated: turn>=2 TTFT p50 / llama-server (8 sessions)"] == {"value": 0.25, "target": 0.5,
                                                                                   "met": True}
    assert t["ember-colocated: output tok/s / llama-server (16 streams)"]["met"] is True
    assert t["ember-colocated: single-stream decode / llama-server"]["met"] is None  # not run: no verdict
    assert t["ember prefill / matmul roofline"]["met"] is False
    written = plot(result, tmp_path)
    assert len(written) == 2
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_writes_a_line_per_eighth_when_not_a_tty():
    out = io.StringIO()
    bar = ProgressBar("replay ember", 16, stream=out)
    for i in range(16):
        bar.step(f"r{i}")
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("0/16   0.0s ") or "0/16" in lines[0]
    assert "16/16" in lines[-1] and "#" * 24 in lines[-1]
    assert 8 <= len(lines) <= 10
