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
