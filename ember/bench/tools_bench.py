"""`ember bench tools`: time to a complete tool call, agents through the OpenAI HTTP API.

S agent sessions x T turns, two tools offered with `tool_choice: required`, each call's result
fed back as a `tool` message: the time from sending a turn to holding its complete call (the
non-streamed response) and whether the call is valid (an offered function, arguments that parse
and carry the required keys). Systems, one after another on the same cores: the shipped local
cluster (jump-forward on, its default), the same cluster with `engine.jump_forward: false`, and
llama.cpp's `llama-server --jinja` on the same GGUF.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ember.bench.measure import progress, write_result

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the tests matching a selector.",
                                      "parameters": {"type": "object",
                                                     "properties": {"selector": {"type": "string"}},
                                                     "required": ["selector"]}}},
]
REQUIRED = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}
TASKS = ["The scheduler test fails after the last change; find out why.",
         "Check that the kvstore lease code handles expiry.",
         "Find where the router hashes prompt blocks.",
         "The decode service leaks a stream on cancel; look into it."]


def valid(message: dict) -> bool:
    calls = message.get("tool_calls") or []
    if not calls:
        return False
    for call in calls:
        fn = call.get("function", {})
        try:
            args = json.loads(fn.get("arguments") or "")
        except ValueError:
            return False
        if fn.get("name") not in REQUIRED or not isinstance(args, dict) or set(REQUIRED[fn["name"]]) - set(args):
            return False
    return True


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def session(base_url: str, index: int, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a software engineering agent. Use the tools."},
                {"role": "user", "content": TASKS[index % len(TASKS)]}]
    records = []
    for turn in range(turns):
        began = time.perf_counter()
        out = post(f"{base_url}/v1/chat/completions", {"model": "", "messages": messages, "tools": TOOLS,
                                                        "tool_choice": "required", "max_tokens": max_tokens,
                                                        "temperature": 0})
        seconds = time.perf_counter() - began
        message = out["choices"][0]["message"]
        ok = valid(message)
        records.append({"session": index, "turn": turn + 1, "seconds": seconds, "valid": ok,
                        "completion_tokens": out.get("usage", {}).get("completion_tokens")})
        messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
        if ok:
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""),
                                 "content": f"(output of {call['function']['name']}: 12 lines, 1 failure)"})
        else:
            messages.append({"role": "user", "content": "Call one of the tools."})
    return records


def run_sessions(base_url: str, sessions: int, turns: int, max_tokens: int) -> dict:
    began = time.perf_counter()
    with ThreadPoolExecutor(sessions) as pool:
        records = [r for rs in pool.map(lambda i: session(base_url, i, turns, max_tokens), range(sessions))
                   for r in rs]
    times = sorted(r["seconds"] for r in records)
    return {"requests": len(records), "valid": sum(r["valid"] for r in records),
            "p50_s": statistics.median(times), "p90_s": times[int(0.9 * (len(times) - 1))],
            "wall_s": time.perf_counter() - began, "records": records}


def ember_cluster(model: str, overrides: dict, sessions: int, turns: int, max_tokens: int) -> dict:
    import yaml

    from ember.cluster.launcher import default_config, running
    from ember.cluster.ports import on_free_ports
    from ember.config.load import load_config
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        on_free_ports(default_config(), run_dir / "cluster.yaml", model)
        data = yaml.safe_load((run_dir / "cluster.yaml").read_text())
        data.setdefault("engine", {}).update(overrides)
        (run_dir / "cluster.yaml").write_text(yaml.safe_dump(data))
        http = load_config(run_dir / "cluster.yaml").router.http
        with running(run_dir / "cluster.yaml", run_dir, timeout_s=300):
            session(f"http://{http}", 0, 1, max_tokens)  # warm: the grammar's first compile, the kernels
            return run_sessions(f"http://{http}", sessions, turns, max_tokens)


def main(args) -> int:
    from ember.bench.agentic_systems import LLAMA_SERVER, start_llama_server
    sessions, turns = (2, 1) if args.quick else (4, 4)
    max_tokens = 48 if args.quick else 100
    out = Path(args.output)
    result = {"model": Path(args.model).name, "sessions": sessions, "turns": turns, "tool_choice": "required",
              "systems": {}}
    progress("ember (shipped config, jump-forward on)")
    result["systems"]["ember"] = ember_cluster(args.model, {}, sessions, turns, max_tokens)
    if not args.quick:
        progress("ember (engine.jump_forward: false)")
        result["systems"]["ember-no-jump-forward"] = ember_cluster(args.model, {"jump_forward": False}, sessions,
                                                                   turns, max_tokens)
    if LLAMA_SERVER.exists() and not args.quick:
        progress("llama-server --jinja")
        log = out.with_suffix(".llama-server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        proc, url = start_llama_server(args.model, sessions, args.threads or 2, 4096, log, extra=["--jinja"])
        try:
            result["systems"]["llama-server"] = run_sessions(url, sessions, turns, max_tokens)
        finally:
            proc.kill()
            proc.wait()
    else:
        result["systems"]["llama-server"] = {"skipped": "not built" if not LLAMA_SERVER.exists() else "--quick"}
    for name, s in result["systems"].items():
        if "p50_s" in s:
            progress(f"{name}: {s['valid']}/{s['requests']} valid calls, p50 {s['p50_s']:.2f} s, "
                     f"p90 {s['p90_s']:.2f} s, whole run {s['wall_s']:.1f} s")
    s = result["systems"]
    result["targets"] = {"ember p50 time to a complete call / jump-forward off": {
        "value": s["ember"]["p50_s"] / s["ember-no-jump-forward"]["p50_s"] if "ember-no-jump-forward" in s else None,
        "target": 0.5}}
    write_result(result, args.output)
    return 0
