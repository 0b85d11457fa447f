"""Exact speculative decoding (prompt lookup): decode speed with and without it, same tokens.

Two workloads, greedy, `ignore_eos` off (answers end where the model ends them, capped):
- edit: an agentic edit: a source file in the prompt, "rename this function and give the
  whole file back"; the answer quotes long spans of its context;
- free: free text (a story), where the context holds little to quote.
Modes, one run side by side:
- sweep: the shipped default engine stepped directly, drafts per step k in 0 to 4:
  acceptance and decode tok/s, the measurement behind DEFAULT_SPECULATIVE_TOKENS;
- served: the shipped local cluster (configs/local.yaml on free ports), the same prompts
  through the router, speculation off and on per request (`SamplingParams.speculative`),
  alternating; decode tok/s after the first token, medians, and whether the tokens are equal.
Targets: edit served >= 2x without speculation, free >= 0.95x, identical tokens.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from ember.bench.measure import progress, write_result

SOURCE = "\n".join([
    "import json",
    "from pathlib import Path",
    "",
    "",
    "def load_settings(path):",
    '    """Read the settings file and return a dict."""',
    "    with open(path) as f:",
    "        return json.load(f)",
    "",
    "",
    "def save_settings(path, settings):",
    "    with open(path, 'w') as f:",
    "        json.dump(settings, f, indent=2)",
    "",
    "",
    "def merge_settings(base, override):",
    "    merged = dict(base)",
    "    for key, value in override.items():",
    "        if isinstance(value, dict) and isinstance(merged.get(key), dict):",
    "            merged[key] = merge_settings(merged[key], value)",
    "        else:",
    "            merged[key] = value",
    "    return merged",
    "",
    "",
    "def settings_path(home):",
    "    return Path(home) / '.config' / 'tool' / 'settings.json'",
    "",
    "",
    "def main(home, override):",
    "    path = settings_path(home)",
    "    settings = merge_settings(load_settings(path), override)",
    "    save_settings(path, settings)",
    "    return settings",
])
PROMPTS = {
    "edit": "Here is the file settings.py:\n\n```python\n" + SOURCE + "\n```\n\nRename the function "
            "merge_settings to deep_merge everywhere in the file. Reply with the whole updated file only.",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
SWEEP = (0, 1, 2, 3, 4)
QUICK_SWEEP = (0, 2)  # --quick: a smoke run (each k is an engine built and loaded)


def _chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def sweep(model: str, max_tokens: int, ks: tuple[int, ...] = SWEEP) -> dict:
    from ember.cluster.launcher import default_config
    from ember.config.load import load_config
    from ember.config.services import engine_settings
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    config = load_config(default_config())
    config.model = model
    settings = engine_settings(config, "decode", config.placement.decode_site)[1]
    out = {}
    for k in ks:
        engine = LLMEngine(settings.model_copy(update={"speculative_tokens": k}))
        row = {}
        for name, text in PROMPTS.items():
            ids = _chat_ids(engine.tokenizer, text)
            engine.generate([ids], SamplingParams(max_tokens=8))  # warm
            before = (engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens, engine.stats.num_steps)
            engine.add_request(ids, SamplingParams(max_tokens=max_tokens))
            first, tokens = None, []
            while engine.has_unfinished():
                for o in engine.step():
                    tokens += o.new_token_ids
                    if first is None:
                        first = time.perf_counter()
            elapsed = time.perf_counter() - first
            drafts = engine.stats.num_draft_tokens - before[0]
            accepted = engine.stats.num_accepted_tokens - before[1]
            row[name] = {"decode_tok_per_s": round((len(tokens) - 1) / elapsed, 2), "tokens": len(tokens),
                         "steps": engine.stats.num_steps - before[2] - 1, "drafts": drafts, "accepted": accepted,
                         "acceptance": round(accepted / drafts, 3) if drafts else None, "token_ids": tokens}
        out[k] = row
        progress(f"k={k}: " + ", ".join(f"{n} {r['decode_tok_per_s']} tok/s (accepted {r['accepted']}/{r['drafts']})"
                                        for n, r in row.items()))
    for k in reversed(ks):  # k=0 last: its tokens are the reference
        for name, r in out[k].items():
            r["same_tokens_as_k0"] = r["token_ids"] == out[0][name]["token_ids"]
    for row in out.values():
        for r in row.values():
            del r["token_ids"]
    return out


def served(model: str, max_tokens: int, reps: int) -> dict:
    from ember.bench.agentic_bench import run_cluster
    out: dict = {}

    def body(make):
        async def go():
            system = make()
            from ember.model.files import model_folder
            from ember.model.tokenizer import Tokenizer
            from ember.v1 import common_pb2, router_pb2
            tokenizer = Tokenizer.from_folder(model_folder(model))
            try:
                for name, text in PROMPTS.items():
                    ids = _chat_ids(tokenizer, text)
                    runs: dict[str, list] = {"off": [], "on": []}
                    outputs: dict[str, list] = {"off": [], "on": []}
                    for rep in range(reps + 1):
                        for mode in ("off", "on"):
                            sampling = common_pb2.SamplingParams(max_tokens=max_tokens, speculative=mode == "on")
                            # a fresh last token per rep: the prompt's blocks are cached, its answer is not
                            request = router_pb2.GenerateRequest(tokens=router_pb2.TokenInput(token_ids=ids),
                                                                 sampling=sampling)
                            stamps, tokens = [], []
                            async for m in system.stub.Generate(request, timeout=600):
                                if m.token_ids:
                                    stamps.append(time.perf_counter())
                                    tokens += m.token_ids
                            if rep:  # the first pair warms up
                                runs[mode].append((len(tokens) - 1) / (stamps[-1] - stamps[0]))
                            outputs[mode].append(tokens)
                    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
                    out[name] = {"off_tok_per_s": round(off, 2), "on_tok_per_s": round(on, 2),
                                 "speedup": round(on / off, 3), "tokens": len(outputs["on"][-1]),
                                 "identical_tokens": all(a == b for a, b in zip(outputs["off"], outputs["on"])),
                                 "runs": runs}
                    progress(f"served {name}: off {off:.1f} tok/s, on {on:.1f} tok/s ({on / off:.2f}x), "
                             f"identical {out[name]['identical_tokens']}")
            finally:
                await system.close()
        asyncio.run(go())
    out["engine"] = run_cluster(model, body)
    return out


def main(args) -> int:
    model = str(Path(args.model).resolve())
    max_tokens, reps = (64, 1) if args.quick else (400, 3)
    progress("sweep: drafts per step, the default engine stepped directly")
    result = {"max_tokens": max_tokens, "sweep": sweep(model, max_tokens, QUICK_SWEEP if args.quick else SWEEP)}
    progress("served: the shipped local cluster, speculation off / on per request")
    result["served"] = served(model, max_tokens, reps)
    edit, free = result["served"]["edit"], result["served"]["free"]
    result["targets"] = {
        "edit: on / off decode tok/s": {"value": edit["speedup"], "target": 2.0, "met": edit["speedup"] >= 2.0},
        "free: on / off decode tok/s": {"value": free["speedup"], "target": 0.95, "met": free["speedup"] >= 0.95},
        "identical tokens": {"value": edit["identical_tokens"] and free["identical_tokens"], "target": True,
                             "met": edit["identical_tokens"] and free["identical_tokens"]}}
    write_result(result, args.output)
    return 0
