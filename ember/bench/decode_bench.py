"""`ember bench decode`: where a decode step of the shipped default engine goes, and what the C++
paged-attention kernel changed, side by side in one run.

- breakdown: a batch-1 decode step at a ~570- and a ~2,000-token context (ember.bench.step_breakdown),
  op by op (int4 linears, output layer, attention, the rest) and captured (the default: the layers in
  one call, output layer, the rest), against the time to read the weights once;
- attention: the C++ kernel (ember.kernels.cpu_attention) against the torch recipe it replaced
  (`PagedAttention(kernel=False)`), the same shapes and data, alternated, best of `reps`: decode at
  566 and 2,048 keys, batch 1 and 16; prefill of 2,048 uncached tokens;
- int4: every layer linear of the model (121 calls, weights streamed from memory as in a step) in
  the C++ int4 kernel (ember.kernels.cpu_q4) against torch's int4 kernel, 1 to 256 rows, alternated.
Served single-stream and 16-stream decode against llama-server are `ember bench agentic --phases
single_stream,streams16` (one run, the shipped default config).
"""
from __future__ import annotations

import time

from ember.bench.measure import progress, write_result

CONTEXTS = (566, 2048)


def _attention_pair(context: int, batch: int, prefill: bool, reps: int) -> dict:
    import torch

    from ember.engine.attention import DecodeBatch, PagedAttention, PrefillChunk
    from ember.engine.kv_cache import PagedKVCache
    from ember.kv.block_hash import KVLayout
    block, kv_heads, heads, dim = 16, 3, 9, 64  # SmolLM2's
    per_seq = -(-context // block)
    cache = PagedKVCache(KVLayout("bench", "bfloat16", block, 1, kv_heads, dim), per_seq * batch + 1)
    cache.kv.normal_()
    tables = torch.arange(per_seq * batch).view(batch, per_seq)
    rows = context if prefill else batch
    q = torch.randn(rows, heads, dim).to(torch.bfloat16)
    k = torch.randn(rows, kv_heads, dim).to(torch.bfloat16)
    if prefill:
        slots = torch.arange(context)
        args = ([PrefillChunk(0, context, 0, tables[0])], None)
    else:
        slots = tables[:, -1] * block + (context - 1) % block
        args = ([], DecodeBatch(torch.arange(batch), tables, torch.full((batch,), context)))
    best = {}
    for _ in range(reps):
        for name, kernel in (("cpp", True), ("torch", False)):
            attend = PagedAttention(cache, slots, *args, dim ** -0.5, kernel=kernel)  # once a step: not timed
            start = time.perf_counter()
            attend(0, q, k, k)  # one layer: cache write and attention
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    return {"cpp_ms": round(1000 * best["cpp"], 3), "torch_ms": round(1000 * best["torch"], 3),
            "speedup": round(best["torch"] / best["cpp"], 2)}


INT4_ROWS = (1, 4, 16, 64, 256)


def _int4_pair(model_path, reps: int) -> dict:
    import torch

    from ember.kernels.cpu_int4 import Int4Linear
    from ember.model.gguf_quant import Q4Weight, read_q4_1
    from ember.model.loader import Q4_FUSED
    q4 = read_q4_1(model_path)
    layers = {"cpp": [], "torch": []}
    for i in sorted({int(n.split(".")[2]) for n in q4}):
        for sources in Q4_FUSED.values():  # the linears as the loader fuses them
            w = Q4Weight.concat([q4[f"model.layers.{i}.{source}.weight"] for source in sources])
            for kind in layers:
                layers[kind].append(Int4Linear(w.codes, w.scale, w.low, native=kind == "cpp"))
    result = {}
    for rows in INT4_ROWS:
        x = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {lay.in_features for lay in layers["cpp"]}}
        best = {}
        for _ in range(reps):
            for kind, stack in layers.items():
                start = time.perf_counter()
                for layer in stack:
                    layer(x[layer.in_features])
                best[kind] = min(best.get(kind, float("inf")), time.perf_counter() - start)
        result[f"rows_{rows}"] = {"cpp_ms": round(1000 * best["cpp"], 2), "torch_ms": round(1000 * best["torch"], 2),
                                  "speedup": round(best["torch"] / best["cpp"], 2)}
    return result


def main(args) -> int:
    import torch

    from ember.bench.step_breakdown import breakdown
    from ember.cluster.launcher import default_config
    from ember.config.load import load_config
    from ember.config.services import engine_settings
    from ember.kernels import cpu_attention
    threads = args.threads or 2
    torch.set_num_threads(threads)
    assert cpu_attention.available(), "the C++ kernel did not build (see the log)"
    reps = 2 if args.quick else 7
    result: dict = {"threads": threads, "attention": {}, "breakdown": {}}
    for context in CONTEXTS:
        for batch in (1, 16):
            progress(f"attention: decode, {context} keys, batch {batch}")
            result["attention"][f"decode_{context}_b{batch}"] = _attention_pair(context, batch, False, reps)
    progress("attention: prefill 2,048 tokens")
    result["attention"]["prefill_2048"] = _attention_pair(2048, 1, True, max(1, reps // 3))
    config = load_config(default_config())
    config.model = args.model
    from ember.kernels import cpu_q4
    if cpu_q4.fits(64, 32) and str(args.model).endswith(".gguf"):
        progress("int4 linears: the C++ kernel against torch's, 1-256 rows")
        result["int4"] = _int4_pair(args.model, max(2, reps // 2))
    settings = engine_settings(config, "decode", config.placement.decode_site)[1]
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_folder(model_folder(args.model))
    sentence = "The keeper wrote down every ship that passed the lighthouse, its flag and its cargo. "
    ids = tokenizer.encode(sentence * 200)
    for context in CONTEXTS[:1] if args.quick else CONTEXTS:  # (--quick: a smoke run)
        progress(f"decode step breakdown at {context} tokens of context")
        prompt = tokenizer.decode(ids[:context])
        for eager in (True, False):  # the two alternate nowhere: each is a run of its own steps
            mode = "eager" if eager else "captured"
            result["breakdown"][f"{context}_{mode}"] = breakdown(settings, prompt, steps=16 if args.quick else 40,
                                                                 eager=eager)
    step = result["breakdown"][f"{CONTEXTS[0]}_captured"]
    result["targets"] = {
        "batch-1 step over the weight-read limit": {"value": step["step_over_limit"], "target": "~1"},
        "captured over eager step time, batch 1": {
            "value": round(step["median_ms"]["step"] / result["breakdown"][f"{CONTEXTS[0]}_eager"]["median_ms"]["step"],
                           2), "target": "< 1"},
        "attention speedup, decode 2,048 keys, batch 1": {
            "value": result["attention"]["decode_2048_b1"]["speedup"], "target": "> 1"}}
    write_result(result, args.output)
    return 0
