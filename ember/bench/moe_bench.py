"""`ember bench moe`: what the mixture-of-experts and latent-attention families cost here (issue 30).

- step: a decode step of a MoE model (Qwen3-MoE's structure: 32 experts, 4 active) against a
  dense model of the same active parameter count (Qwen3, intermediate = 4 x an expert's), same
  attention, same engine (bf16 dense weights, 2 threads), at batch 1 and 16. At batch 1 the MoE
  step reads its 4 experts' bytes, as the dense one reads its MLP's: the gap is routing and
  grouping. At batch 16 the 64 slots spread over most experts, so the MoE step reads several
  times the active bytes: that is the model class, not overhead, and the JSON says how many
  experts a step touched. The MoE runs its experts in one C++ call a step (ember.kernels.cpu_moe);
  `loop_s` is the per-expert torch loop it replaced (the same engine, the kernel switched off), and
  `int4_s` the same model with its routed experts quantized to symmetric int4 group-32 (Kimi K2.5's
  format) on the fused int4 kernel, with the weight bytes each step reads.
- expert_parallel: the same MoE model's decode step at EP = 2 against EP = 1 (2 cores: both ranks
  share the cores and the memory bandwidth, so it is honest, not flattering), and the tokens routed
  to each rank's experts with their imbalance (the busiest rank over the mean).
- latent: KV bytes per token of Kimi K2.5 (its public config's MLA: 576 values a layer) against the
  same model's expanded K/V (64 heads x (192 + 128)) and a GQA cache of 8 KV heads x 128; and the
  transfer time of a 4,096-token prompt's KV over the emulated 60 ms / 1 Gbit/s link (two kvstore
  processes, the `ember.cluster.wan` relay between them), latent against expanded, one layer's
  worth at Kimi's widths (the time scales with the layers).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from ember.bench.measure import progress, require, write_result

KIMI = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840, "hidden_size": 7168,
        "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1}


def shapes(quick: bool) -> tuple[dict, dict, dict]:
    """(common, MoE-only, dense-only) transformers config fields."""
    layers, experts = (4, 8) if quick else (12, 32)
    common = dict(vocab_size=49152, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  num_hidden_layers=layers, rms_norm_eps=1e-6, max_position_embeddings=8192, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6})
    moe = dict(num_experts=experts, num_experts_per_tok=4, moe_intermediate_size=512, intermediate_size=2048,
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    dense = dict(intermediate_size=4 * 512)
    return common, moe, dense


def decode_step_s(model: Path, batch: int, steps: int, ranks: list | None = None, prepare=None,
                  **engine) -> tuple[float, float]:
    """Median seconds of a decode step of `batch` sequences (64-token prompts), and how many experts
    a MoE layer ran per step, on average (0 for a dense model). `ranks`: an expert-parallel engine's
    per-rank expert stats are appended to it (ExpertParallelRunner.expert_stats). `prepare(moe)`: run
    on each MoE layer once loaded (e.g. to give it int4 experts)."""
    import random

    import torch

    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    from ember.model.moe import MoE
    # one token a sequence a step (no prompt-lookup drafts: a verify step is not a decode step)
    eng = LLMEngine(EngineConfig(model=str(model), dtype="bfloat16", weights="dense", threads=2, kv_cache_mb=256,
                                 speculative_tokens=0, **engine))
    try:
        driver = eng.loaded.model if eng.loaded.model is not None else eng.runner.me.loaded.model
        layers = [m for m in driver.modules() if isinstance(m, MoE)]
        for m in layers if prepare else ():
            prepare(m)
        rng = random.Random(batch)
        for _ in range(batch):
            eng.add_request([rng.randrange(100, 40000) for _ in range(64)],
                            SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        while any(s.num_computed_tokens < s.prompt_len for s in eng.seqs.values()):
            eng.step()  # prefill (and the first decodes beside it)
        eng.step()
        times, touched = [], 0
        for _ in range(steps):
            before = [m.expert_tokens.clone() for m in layers]
            start = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - start)
            touched += sum(int(torch.count_nonzero(m.expert_tokens - b)) for m, b in zip(layers, before))
        if ranks is not None:
            ranks.extend(eng.runner.expert_stats())
        return statistics.median(times), touched / steps / max(1, len(layers))
    finally:
        eng.close()


def step_bytes(common: dict, moe: dict | None, experts_run: float, intermediate: int,
               expert_bytes_per_weight: float = 2) -> float:
    """Weight bytes a decode step reads: attention, norms, the tied embedding as the output layer (bf16),
    and the MLP (the experts a layer ran, at `expert_bytes_per_weight`, or the dense MLP)."""
    h, layers = common["hidden_size"], common["num_hidden_layers"]
    q = common["num_attention_heads"] * common["head_dim"]
    kv = common["num_key_value_heads"] * common["head_dim"]
    attention = (2 * q + 2 * kv) * h
    expert = 3 * h * moe["moe_intermediate_size"] * expert_bytes_per_weight / 2 if moe else 0
    mlp = experts_run * expert if moe else 3 * h * intermediate
    router = moe["num_experts"] * h if moe else 0
    return 2 * (layers * (attention + mlp + router) + common["vocab_size"] * h)


INT4_BYTES_PER_WEIGHT = 0.5 + 2 * 2 / 32  # a code, and a float16 scale and low per 32 weights


def int4_experts(moe) -> None:
    """The MoE layer's routed experts as symmetric int4 group-32 with bf16 scales (Kimi K2.5's routed
    experts' format), on the fused int4 kernel."""
    from ember.kernels import cpu_moe
    inter = moe.intermediate_size
    experts = [tuple(cpu_moe.quantize_symmetric(w) for w in (moe.gate_up[e, :inter], moe.gate_up[e, inter:],
                                                             moe.down[e]))
               for e in range(moe.last - moe.first)]
    cpu_moe.use_int4_experts(moe, experts)


def per_expert_loop():
    """The fused kernel switched off for the engine built inside (the per-expert loop it replaced)."""
    import contextlib

    from ember.kernels import cpu_moe

    @contextlib.contextmanager
    def off():
        cpu_moe.ENABLED = False
        try:
            yield
        finally:
            cpu_moe.ENABLED = True
    return off()


def latent_bytes() -> dict:
    from ember.model.families import args_from_config
    args = args_from_config(KIMI)
    latent = args.kv_cache_dim * args.num_layers * 2  # bf16, one plane
    heads, qk, v = KIMI["num_attention_heads"], args.mla.qk_head_dim, args.mla.v_head_dim
    expanded = heads * (qk + v) * args.num_layers * 2
    gqa8 = 2 * 8 * 128 * args.num_layers * 2
    context = 4096
    return {"values_per_token_per_layer": args.kv_cache_dim, "bytes_per_token": latent,
            "expanded_bytes_per_token": expanded, "gqa8_bytes_per_token": gqa8,
            "read_per_decode_token_at_4k_MB": round(latent * context / 1e6, 1),
            "expanded_read_at_4k_MB": round(expanded * context / 1e6, 1),
            "gqa8_read_at_4k_MB": round(gqa8 * context / 1e6, 1),
            "expanded_over_latent": round(expanded / latent, 2), "gqa8_over_latent": round(gqa8 / latent, 2)}


def link_transfer(tokens: int, reps: int) -> dict:
    """Seconds to pull `tokens` tokens' KV of one layer at Kimi's widths (latent vs expanded) from a
    central kvstore through the emulated link; fresh content addresses each rep."""
    from ember.kv.block_hash import KVLayout
    heads, qk, v = KIMI["num_attention_heads"], 192, 128
    layouts = {"latent": KVLayout("bench", "bfloat16", 16, 1, 1, 576, planes=1),
               "expanded": KVLayout("bench", "bfloat16", 16, 1, heads, (qk + v) // 2)}  # K 192 + V 128 a head
    out = {name: _pull_over_link(layout, tokens // 16, reps) for name, layout in layouts.items()}
    out["expanded_over_latent_s"] = round(out["expanded"]["seconds"] / out["latent"]["seconds"], 2)
    from ember.bench.link_bench import GBPS, RTT_MS
    out["link"] = {"rtt_ms": RTT_MS, "gbps": GBPS, "tokens": tokens, "layers": 1}
    return out


def _pull_over_link(layout, blocks: int, reps: int) -> dict:
    """A central and an edge kvstore (a store holds one block size), the relay between them; the edge
    pulls `blocks` fresh blocks of `layout`, `reps` times."""
    from ember.bench.kv_bench import KVStoreProcess
    from ember.bench.link_bench import central_behind_link, edge_config, timed_pull
    from ember.kv import wire
    capacity = int(wire.frame_bytes(layout.block_bytes) * blocks * (reps + 1) / 2**20) + 64
    template = wire.layout_header(layout, b"\x01" * 16)
    payloads = [os.urandom(layout.block_bytes)] * blocks  # (raw codec: the bytes on the wire are what is timed)
    with tempfile.TemporaryDirectory() as tmp, central_behind_link(Path(tmp), capacity) as link:
        dst = KVStoreProcess(Path(tmp), "edge", config=edge_config(Path(tmp), "edge", "raw", capacity, link.address),
                             site="edge", routes=link.routes)
        link.stores.append(dst)
        for store in link.stores:
            store.wait()
        runs = [timed_pull(link, dst, template, payloads, timeout=600)[0] for _ in range(reps)]
    return {"bytes": layout.block_bytes * blocks, "seconds": round(statistics.median(runs), 3),
            "runs": [round(x, 3) for x in runs]}


def main(args) -> int:
    require("transformers", "the MoE bench (its random checkpoints are written by transformers)")
    from ember.bench.random_models import save_random
    from ember.model.files import model_folder
    quick = args.quick
    steps = 4 if quick else 16
    tokenizer = model_folder(str(Path(args.model).resolve()))
    common, moe_fields, dense_fields = shapes(quick)
    result: dict = {"shapes": {"common": common, "moe": moe_fields, "dense": dense_fields}, "steps": steps}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        progress("writing random bf16 checkpoints (transformers)")
        moe = save_random("Qwen3MoeConfig", common | moe_fields, Path(tmp) / "moe", tokenizer, dtype="bfloat16")
        dense = save_random("Qwen3Config", common | dense_fields, Path(tmp) / "dense", tokenizer, dtype="bfloat16")
        step = {}
        for batch in (1, 16):
            progress(f"decode step, batch {batch}: MoE (fused, per-expert loop, int4 experts), dense, MoE at EP = 2")
            moe_s, touched = decode_step_s(moe, batch, steps)
            with per_expert_loop():
                loop_s, _ = decode_step_s(moe, batch, steps)
            int4_s, int4_touched = decode_step_s(moe, batch, steps, prepare=int4_experts)
            dense_s, _ = decode_step_s(dense, batch, steps)
            ranks: list[dict] = []
            ep2_s, _ = decode_step_s(moe, batch, steps, ranks, expert_parallel=2)
            load = [r["routed_tokens"] for r in ranks]  # since the engine started: prefill and decode
            moe_bytes = step_bytes(common, moe_fields, touched, 0)
            dense_bytes = step_bytes(common, None, 0, dense_fields["intermediate_size"])
            int4_bytes = step_bytes(common, moe_fields, int4_touched, 0, INT4_BYTES_PER_WEIGHT)
            step[f"batch_{batch}"] = {
                "moe_s": round(moe_s, 5), "dense_s": round(dense_s, 5), "moe_over_dense": round(moe_s / dense_s, 3),
                "loop_s": round(loop_s, 5), "loop_over_dense": round(loop_s / dense_s, 3),
                "loop_over_fused": round(loop_s / moe_s, 3),
                "int4_s": round(int4_s, 5), "int4_over_bf16_experts": round(int4_s / moe_s, 3),
                "weight_mb_read_int4": round(int4_bytes / 1e6, 1),
                "expert_mb_read_bf16": round((moe_bytes - step_bytes(common, moe_fields, 0, 0)) / 1e6, 1),
                "expert_mb_read_int4": round((int4_bytes - step_bytes(common, moe_fields, 0, 0)) / 1e6, 1),
                "experts_run_per_layer": round(touched, 2), "of_experts": moe_fields["num_experts"],
                "weight_mb_read_moe": round(moe_bytes / 1e6, 1), "weight_mb_read_dense": round(dense_bytes / 1e6, 1),
                # the step time a byte of weights costs, MoE against dense: routing and grouping's share
                "moe_over_dense_per_byte_read": round(moe_s / moe_bytes / (dense_s / dense_bytes), 3),
                "ep2_s": round(ep2_s, 5), "ep2_over_ep1": round(ep2_s / moe_s, 3), "ep2_ranks": ranks,
                # the busiest rank's routed tokens over the mean: 1.0 is a perfect balance
                "ep2_imbalance": round(max(load) / (sum(load) / len(load)), 3) if sum(load) else None}
        result["step"] = step
    if not quick:
        progress("a Kimi-format checkpoint (int4 experts) loaded as int4, against its bf16 dequantization")
        from ember.bench.checkpoint_load import int4_against_bf16
        with tempfile.TemporaryDirectory() as tmp:
            result["checkpoint_load"] = int4_against_bf16(Path(tmp), tokenizer)
    result["latent"] = latent_bytes()
    progress("KV of a 4,096-token prompt over the emulated 60 ms / 1 Gbit/s link: latent, expanded")
    result["transfer"] = link_transfer(1024 if quick else 4096, 1 if quick else 3)
    result["wall_s"] = round(time.monotonic() - started, 1)
    b1, b16 = step["batch_1"], step["batch_16"]
    result["targets"] = {
        "MoE / dense decode step, batch 1": {"value": b1["moe_over_dense"], "target": "<= 1.2",
                                             "met": b1["moe_over_dense"] <= 1.2},
        "MoE / dense decode step, batch 16": {"value": b16["moe_over_dense"], "target": "<= 1.3",
                                              "met": b16["moe_over_dense"] <= 1.3},
        "per-expert loop / fused MoE decode step, batch 1": {"value": b1["loop_over_fused"], "target": "reported",
                                                             "met": True},
        "int4 / bf16 experts decode step, batch 16": {"value": b16["int4_over_bf16_experts"], "target": "< 1",
                                                      "met": b16["int4_over_bf16_experts"] < 1},
        "Kimi K2.5 KV bytes a token, expanded / latent": {"value": result["latent"]["expanded_over_latent"],
                                                          "target": "> 1", "met": True},
        "KV transfer on the link, expanded / latent": {"value": result["transfer"]["expanded_over_latent_s"],
                                                       "target": "> 1",
                                                       "met": result["transfer"]["expanded_over_latent_s"] > 1},
        "MoE / dense time per weight byte read, batch 16": {"value": b16["moe_over_dense_per_byte_read"],
                                                            "target": "<= 1.2",
                                                            "met": b16["moe_over_dense_per_byte_read"] <= 1.2},
        "EP = 2 expert load imbalance (busiest rank / mean), batch 16": {"value": b16["ep2_imbalance"],
                                                                          "target": "reported", "met": True},
        "EP = 2 / EP = 1 decode step, batch 16 (2 cores)": {"value": b16["ep2_over_ep1"], "target": "reported",
                                                             "met": True},
    }
    write_result(result, args.output)
    return 0
