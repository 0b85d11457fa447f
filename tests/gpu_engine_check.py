"""The engine on the GPU path's kernels: greedy tokens of a batch, then a prompt that reuses a cached
prefix (prefill over gathered context), then a block exported and imported into a second engine.
Prints one JSON line (run by test_gpu_path: on CUDA, and on CPU under Triton's interpreter)."""
from __future__ import annotations

import json
import os
import sys

from ember.engine.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Q: What is 17 times 3?\nA:", "The three primary colours are"]
SHARED = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def main(device: str, attention: str, dtype: str, max_tokens: int) -> None:
    model = {"model": os.environ["EMBER_TEST_MODEL"]} if os.environ.get("EMBER_TEST_MODEL") else {}
    config = EngineConfig(**model, device=device, attention_backend=attention, dtype=dtype, weights="dense",
                          kv_cache_mb=64, threads=2)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=max_tokens)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    batch = [out.token_ids for out in engine.generate(prompts, params)]
    first = engine.tokenizer.encode(SHARED)
    [warm] = engine.generate([first], SamplingParams(max_tokens=1))  # (its blocks cached: no decode needed)
    longer = first + engine.tokenizer.encode(" caught a silver fish every morning")
    short = SamplingParams(max_tokens=max(2, max_tokens // 2))  # (under the interpreter every step costs ~3 s)
    [reused] = engine.generate([longer], short)
    # a block out of this engine and into a fresh one, which continues from it
    hashes = warm.block_hashes[:1]
    frames = engine.export_frames(hashes)
    other = LLMEngine(config)
    from ember.kv import wire
    payloads = [wire.decode_frame(f, other.frame_template, block_hash=h) for f, h in zip(frames, hashes)]
    imported = other.import_blocks(first, hashes, payloads)
    [continued] = other.generate([longer], short)
    print(json.dumps({"kernels": engine.kernels, "device": str(engine.cache.kv.device), "prompts": prompts,
                      "batch": batch, "longer": longer, "reused": reused.token_ids,
                      "reused_cached": reused.cached_tokens, "imported": imported,
                      "continued": continued.token_ids, "continued_cached": continued.cached_tokens}))
    engine.close()
    other.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
