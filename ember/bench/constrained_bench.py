"""`ember bench constrained`: what grammar-constrained decoding costs, on the shipped default engine.

1. Decode steps at batch 1 and 16, every row free vs every row under a JSON schema (an array of
   objects long enough that no row finishes inside the measured steps), same prompts, seeds and
   temperature, alternated ABAB. The per-token overhead is measured inside the step: the time of
   the logit processing (mask computation and application) and of appending the tokens (which
   advances each grammar), constrained minus free, per row. The whole steps' medians are reported
   too; on this shared 2-core machine their noise (a forward pass varies by +-20%) is larger than
   the overhead itself.
2. Schema compile time (llguidance, ember.engine.constraints.Grammars): cold (a fresh cache each
   time) and cached (a request for a schema compiled before: a matcher copy), and the one-time
   tokenizer preparation.
"""
from __future__ import annotations

import json
import statistics
import time

from ember.bench.measure import progress, write_result
from ember.engine.constraints import Grammars
from ember.engine.sampling_params import Constraint, SamplingParams

ROWS = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score"],
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                       "tags": {"type": "array", "items": {"type": "string"}},
                       "score": {"type": "number"}}}
LONG = {"type": "array", "minItems": 100, "items": ROWS}  # nothing completes within the measured steps
SCHEMAS = {
    "tool arguments (2 fields, enum)": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                                        "properties": {"city": {"type": "string"},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}}},
    "record array (nested, 4 fields)": LONG,
    "json_object": None,
}


def default_engine(threads: int | None):
    from ember.cluster.launcher import default_config
    from ember.config.load import load_config
    from ember.config.services import engine_settings
    from ember.engine.engine import LLMEngine
    config = load_config(default_config())
    site = next(s.name for s in config.sites if s.has("decode"))
    _, engine_config = engine_settings(config, "decode", site)
    if threads:
        engine_config = engine_config.model_copy(update={"threads": threads})
    engine = LLMEngine(engine_config)
    # this bench steps a fixed batch and times each step's mask work: every step one token per request
    # (no prefill-first step skipping the decodes, no grammar-forced runs computed in one step)
    engine.scheduler.slo, engine.jump_forward = None, False
    return engine


class _Timed:
    """Seconds spent in the engine's logit processing and token appending, per step."""

    def __init__(self, engine):
        self.engine, self.spent = engine, 0.0
        for name in ("_process_logits", "_append_token"):
            setattr(engine, name, self._timed(getattr(type(engine), name).__get__(engine)))

    def _timed(self, method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start
        return run

    def close(self) -> None:
        for name in ("_process_logits", "_append_token"):
            delattr(self.engine, name)


def step_times(engine, batch: int, constrained: bool, steps: int) -> tuple[list[float], list[float]]:
    """Seconds per decode step of `batch` rows after their prefill, and of it the seconds spent
    processing logits and appending tokens."""
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List the records as JSON."}]))
    constraint = Constraint("json_schema", json.dumps(LONG)) if constrained else None
    for i in range(batch):
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.7, seed=i, ignore_eos=True,
                                                  constraint=constraint))
    done = 0
    while done < batch:  # prefills and first tokens
        done += len(engine.step())
    times, inside = [], []
    timer = _Timed(engine)
    try:
        for _ in range(steps):
            timer.spent = 0.0
            start = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - start)
            inside.append(timer.spent)
            assert len(outs) == batch and not any(o.finished for o in outs)
    finally:
        timer.close()
    while engine.has_unfinished():
        engine.step()
    return times, inside


def decode_overhead(engine, batch: int, steps: int, rounds: int) -> dict:
    free, constrained, free_in, constrained_in = [], [], [], []
    for _ in range(rounds):  # ABAB: the machine's drift lands on both
        times, inside = step_times(engine, batch, False, steps)
        free, free_in = free + times, free_in + inside
        times, inside = step_times(engine, batch, True, steps)
        constrained, constrained_in = constrained + times, constrained_in + inside
    f, c = statistics.median(free), statistics.median(constrained)
    extra = statistics.median(constrained_in) - statistics.median(free_in)
    return {"batch": batch, "free_step_ms": f * 1e3, "constrained_step_ms": c * 1e3,
            "overhead_per_step_ms": extra * 1e3, "overhead_per_token_us": extra / batch * 1e6,
            "overhead_pct_of_free_step": extra / f * 100, "whole_step_difference_ms": (c - f) * 1e3,
            "steps_measured": len(free)}


def compile_times(engine, reps: int) -> dict:
    source = (engine.tokenizer.backend.to_str(), engine.loaded.args.vocab_size, engine.eos_token_id)
    start = time.perf_counter()
    Grammars(*source).tokenizer  # noqa: B018 - the one-time preparation
    prepare_s = time.perf_counter() - start
    shared = Grammars(*source).tokenizer
    rows = {}
    for name, schema in SCHEMAS.items():
        constraint = Constraint("json_object") if schema is None else Constraint("json_schema", json.dumps(schema))
        cold, cached = [], []
        for _ in range(reps):
            grammars = Grammars(*source)
            grammars._tokenizer = shared  # a new schema on a warm engine: the tokenizer is prepared once
            start = time.perf_counter()
            grammars.matcher(constraint)
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            grammars.matcher(constraint)
            cached.append(time.perf_counter() - start)
        rows[name] = {"cold_ms": statistics.median(cold) * 1e3, "cached_ms": statistics.median(cached) * 1e3}
    return {"tokenizer_prepare_s": prepare_s, "schemas": rows}


def main(args) -> int:
    quick = getattr(args, "quick", False)
    engine = default_engine(getattr(args, "threads", None))
    progress(f"engine: weights={engine.config.weights} dtype={engine.config.dtype} (the shipped default config)")
    compile_result = compile_times(engine, reps=3 if quick else 10)
    decode = []
    for batch in (1, 16):
        progress(f"decode steps at batch {batch}: free vs constrained")
        decode.append(decode_overhead(engine, batch, steps=8 if quick else 24, rounds=2 if quick else 3))
    result = {"engine": {"weights": engine.config.weights, "dtype": engine.config.dtype},
              "compile": compile_result, "decode": decode,
              "targets": {f"batch {d['batch']} overhead per token (us)": round(d["overhead_per_token_us"], 1)
                          for d in decode} | {"cold compile, tool arguments (ms)": round(
                              compile_result["schemas"]["tool arguments (2 fields, enum)"]["cold_ms"], 2)}}
    write_result(result, args.output)
    return 0


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-out/constrained.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int)
    raise SystemExit(main(parser.parse_args()))
