"""Agentic traces (torch-free): sessions of growing context, as JSON lines.

A session opens with a system prompt and tool schemas plus a user message; every later turn
adds the previous answer, a tool output (sizes heavy-tailed: a file listing or a whole file)
and a short instruction, after a think time. One line per request:

  {"t": arrival s, "session": "s17", "turn": 2, "region": "users-fra",
   "prompt_tokens": whole context, "new_tokens": added this turn, "output_tokens": answer}
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    t: float
    session: str
    turn: int
    region: str
    prompt_tokens: int
    new_tokens: int
    output_tokens: int


def agentic(regions: list[str], weights: list[float] | None = None, sessions_per_s: float = 1.0,
            duration_s: float = 600.0, mean_turns: float = 6.0, system_tokens: tuple[int, int] = (2000, 6000),
            max_context: int = 32000, max_output: int = 1500, tool_scale: float = 1.0,
            seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t, n = 0.0, 0
    while True:
        t += rng.expovariate(sessions_per_s)
        if t >= duration_s:
            break
        session, region = f"s{n}", rng.choices(regions, weights)[0]
        n += 1
        context = rng.randint(*system_tokens) + rng.randint(30, 300)
        arrival, turn = t, 1
        new = context
        while True:
            output = max(2, int(min(max_output, rng.lognormvariate(4.8, 0.7))))  # median ~120 tokens
            out.append(TraceRequest(round(arrival, 4), session, turn, region, context, new, output))
            if rng.random() < 1 / mean_turns or turn >= 40:
                break
            tool = int(min(12000, rng.lognormvariate(5.8, 1.1)) * tool_scale)  # median ~330, heavy tail
            new = output + tool + rng.randint(10, 80)
            if context + new + max_output > max_context:  # room for the answer
                break
            context += new
            arrival += output / 40 + rng.expovariate(1 / 4.0) + 0.5            # generation + think/tool time
            turn += 1
    out.sort(key=lambda r: r.t)
    return out


def write(trace: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps(asdict(r)) + "\n")


def read(path: str | Path) -> Iterator[TraceRequest]:
    with open(path) as f:
        for line in f:
            if line.strip():
                yield TraceRequest(**json.loads(line))
