"""A fresh serving process: time from process start to first token, then peak RSS.

Run as `python -m ember.bench.serve_probe`; prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import psutil

started = psutil.Process().create_time()
import torch  # noqa: E402,F401

import ember  # noqa: E402,F401

torch_imported = time.time()


def peak_rss_mb() -> float:
    """This process image's high-water RSS. (ru_maxrss is not it: Linux carries it over
    from the parent across fork + exec, so a probe started by a big benchmark process
    would report the parent's peak.)"""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--kv-cache-mb", type=int, default=512)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()

    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    from ember.model.loader import load_model

    config = EngineConfig(model=args.model, threads=args.threads, kv_cache_mb=args.kv_cache_mb)
    t0 = time.time()
    loaded = load_model(config.model, config.dtype, config.weights)
    t1 = time.time()
    engine = LLMEngine(config, loaded=loaded)
    t2 = time.time()
    engine.add_request("Hello, my name is", SamplingParams(max_tokens=1))
    while not engine.step():
        pass
    t3 = time.time()
    # then fill most of the pool with concurrent sequences so its pages are really touched
    per_seq = engine.max_model_len // 4
    count = max(1, engine.block_manager.num_blocks * engine.config.block_size // per_seq - 1)
    for i in range(count):
        engine.add_request([100 + i] * (per_seq - 8), SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    print(json.dumps({
        "startup_to_first_token_s": t3 - started,
        "phases_s": {"interpreter_and_torch_import": torch_imported - started, "load_weights": t1 - t0,
                     "engine_init_pack_and_pool": t2 - t1, "first_step": t3 - t2},
        "startup_excluding_torch_import_s": t3 - torch_imported,
        "peak_rss_mb": peak_rss_mb(),
        "weights_mb": engine.loaded.weights_bytes / 2**20,
        "kv_pool_mb": engine.cache.nbytes / 2**20,
        "sequences_filling_pool": count,
    }))


if __name__ == "__main__":
    main()
