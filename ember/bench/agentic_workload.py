"""The agentic workload of `ember bench agentic` (torch-free, seeded): sessions whose every
turn resubmits the whole conversation.

A session is a system prompt shared by all sessions (instructions + tool schemas as JSON),
a first user task, then turns that each add the assistant's previous answer, a tool result
of varied length (a file listing, a log, a source file) and a short instruction. The
conversation is chat messages; each system renders them with the model's chat template.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {arg: {"type": "string", "description": f"the {arg}"} for arg in args},
        "required": list(args)}}}
    for name, desc, args in [
        ("read_file", "Read a file of the repository and return its text.", ("path",)),
        ("list_dir", "List the entries of a directory.", ("path",)),
        ("run_tests", "Run the test suite (or one test) and return its output.", ("selector",)),
        ("grep", "Search the repository for a pattern; return matching lines.", ("pattern", "path")),
        ("write_file", "Replace a file's contents.", ("path", "content")),
        ("git_diff", "Show the uncommitted changes.", ()),
    ]]

SYSTEM = ("You are a careful software engineering agent working in a Python repository. Think step by step, "
          "call one tool at a time, and keep answers short. Tools available (JSON schema):\n"
          + json.dumps(TOOLS, indent=1))

_WORDS = ("ember kvstore router prefill decode block cache token layer tensor queue config site link "
          "scheduler sequence batch latency throughput request stream channel service lease frame").split()


def _tool_output(rng: random.Random, kind: str, lines: int) -> str:
    if kind == "list_dir":
        return "\n".join(f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}.py  {rng.randint(200, 9000)} bytes"
                         for _ in range(lines))
    if kind == "run_tests":
        return "\n".join(f"tests/test_{rng.choice(_WORDS)}.py::test_{rng.choice(_WORDS)}_{rng.choice(_WORDS)} "
                         f"{rng.choice(['PASSED', 'PASSED', 'PASSED', 'FAILED'])}" for _ in range(lines))
    return "\n".join(f"def {rng.choice(_WORDS)}_{rng.choice(_WORDS)}(self, {rng.choice(_WORDS)}):  "
                     f"# {rng.choice(_WORDS)} {rng.choice(_WORDS)} {rng.choice(_WORDS)}" for _ in range(lines))


@dataclass
class Session:
    session_id: str
    messages: list[dict] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)  # the user/tool messages of the turns to come


def sessions(num_sessions: int, turns: int, seed: int = 0, tool_lines: tuple[int, int] = (4, 40)) -> list[Session]:
    """Sessions with their first message set and `turns - 1` follow-ups queued."""
    rng = random.Random(seed)
    out = []
    for i in range(num_sessions):
        task = f"Task {i}: the {rng.choice(_WORDS)} {rng.choice(_WORDS)} test fails after the last change. " \
               f"Find out why and fix it."
        follow = []
        for _ in range(turns - 1):
            kind = rng.choice(["read_file", "list_dir", "run_tests", "grep"])
            result = _tool_output(rng, kind, rng.randint(*tool_lines))
            follow.append(f"Tool result ({kind}):\n{result}\n\nContinue.")
        out.append(Session(f"agent-{seed}-{i}", [{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": task}], follow))
    return out


def advance(session: Session, answer: str) -> bool:
    """Append the assistant's answer and the next user/tool message; False when done."""
    session.messages.append({"role": "assistant", "content": answer})
    if not session.pending:
        return False
    session.messages.append({"role": "user", "content": session.pending.pop(0)})
    return True
