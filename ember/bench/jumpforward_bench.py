"""`ember bench jumpforward`: what jump-forward decoding saves on a tool call, on the shipped default engine.

One request, greedy: a user question with two tools offered, the answer constrained to a call of
one of them (a JSON schema of the call). Run with jump-forward on and off on one
in-process engine (the switch flipped between runs, ABAB, the prompt's blocks cached by the warm-up
so both runs prefill the same few tokens): engine steps, forced tokens, wall time to the complete
call, and whether the tokens are the same.

What a forced token costs: a decode step's time is measured on the off runs (their time after the
first token over their steps after it); jump-forward saves (t_off - t_on) of the forced tokens'
forced x step time. `saved_steps_per_forced_token` is that ratio (1.0: each forced token saved a
whole step), and `forced_token_cost_steps` = 1 - it: what a forced token still costs, in decode
steps (its row in the next step's chunk, its mask check). Medians over the reps (a run's wall
time on a shared 2-core CPU varies by ~10%).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from ember.bench.measure import progress, write_result

TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The weather in a city",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string"},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
         {"type": "function", "function": {
             "name": "get_time", "description": "The current time in a time zone",
             "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
QUESTION = "What is the weather in Paris, and what time is it there?"
# a call of one of TOOLS, as a JSON schema (the router's own tool grammar lives in services/, which
# ember/ never imports: same fixed parts, the name and "arguments" keys, forced the same way)
CALL_SCHEMA = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                          "properties": {"name": {"const": t["function"]["name"]},
                                         "arguments": t["function"]["parameters"]}} for t in TOOLS]}


def default_engine(model: str):
    from ember.cluster.launcher import default_config
    from ember.config.load import load_config
    from ember.config.services import engine_settings
    from ember.engine.engine import LLMEngine
    config = load_config(default_config())
    config.model = model
    site = next(s.name for s in config.sites if s.has("decode"))
    return LLMEngine(engine_settings(config, "decode", site)[1])


def one_call(engine, prompt: list[int], params) -> dict:
    """Run the request alone: its tokens, steps, forced tokens, total and after-first-token seconds."""
    steps, forced = engine.stats.num_steps, engine.stats.num_forced_tokens
    start = time.perf_counter()
    engine.add_request(prompt, params)
    first, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            first = first or time.perf_counter()
    end = time.perf_counter()
    return {"tokens": tokens, "steps": engine.stats.num_steps - steps,
            "forced": engine.stats.num_forced_tokens - forced, "wall_s": end - start, "decode_s": end - first}


def main(args) -> int:
    import json

    from ember.engine.sampling_params import Constraint, SamplingParams
    reps = 2 if args.quick else 7
    engine = default_engine(str(Path(args.model).resolve()))
    progress(f"engine: weights={engine.config.weights} dtype={engine.config.dtype} (the shipped default config)")
    messages = [{"role": "system", "content": "Answer with one tool call as JSON, "
                 '{"name": ..., "arguments": {...}}. Tools: ' + json.dumps(TOOLS)},
                {"role": "user", "content": QUESTION}]
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    params = SamplingParams(max_tokens=120, constraint=Constraint("json_schema", json.dumps(CALL_SCHEMA)))
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for rep in range(reps + 1):
        for mode in ("on", "off"):
            engine.jump_forward = mode == "on"
            run = one_call(engine, prompt, params)
            if rep:  # the first pair warms up (and caches the prompt's blocks)
                runs[mode].append(run)
    on, off = runs["on"], runs["off"]
    identical = all(r["tokens"] == off[0]["tokens"] for r in on + off)
    med = {mode: {key: statistics.median(r[key] for r in rs) for key in ("steps", "forced", "wall_s", "decode_s")}
           for mode, rs in runs.items()}
    step_s = med["off"]["decode_s"] / (med["off"]["steps"] - 1)  # (the first step prefills the uncached tail)
    forced = med["on"]["forced"]
    saved = (med["off"]["wall_s"] - med["on"]["wall_s"]) / (forced * step_s) if forced else 0.0
    text = engine.tokenizer.decode(on[0]["tokens"])
    progress(f"call: {text!r}")
    progress(f"on: {med['on']['steps']:.0f} steps, {forced:.0f} forced, {med['on']['wall_s'] * 1e3:.0f} ms; "
             f"off: {med['off']['steps']:.0f} steps, {med['off']['wall_s'] * 1e3:.0f} ms; decode step "
             f"{step_s * 1e3:.1f} ms; saved steps per forced token {saved:.2f}; identical tokens {identical}")
    result = {"engine": {"weights": engine.config.weights, "dtype": engine.config.dtype},
              "prompt_tokens": len(prompt), "output_tokens": len(on[0]["tokens"]), "call": text, "reps": reps,
              "on": {k: round(v, 4) for k, v in med["on"].items()},
              "off": {k: round(v, 4) for k, v in med["off"].items()},
              "decode_step_ms": round(step_s * 1e3, 2),
              "saved_steps_per_forced_token": round(saved, 3), "forced_token_cost_steps": round(1 - saved, 3),
              "runs": {mode: [{k: round(v, 4) for k, v in r.items() if k != "tokens"} for r in rs]
                       for mode, rs in runs.items()},
              "targets": {
                  "identical tokens": {"value": identical, "target": True, "met": identical},
                  "steps on / off": {"value": round(med["on"]["steps"] / med["off"]["steps"], 3), "target": 1.0,
                                     "met": med["on"]["steps"] < med["off"]["steps"]},
                  "wall time on / off": {"value": round(med["on"]["wall_s"] / med["off"]["wall_s"], 3),
                                         "target": 1.0, "met": med["on"]["wall_s"] < med["off"]["wall_s"]}}}
    write_result(result, args.output)
    return 0 if identical else 1
