"""`ember bench gpu`: the GPU path's figures, for when a device is lent (scripts/gpu-check.sh runs it).

- Decode attention: the Triton paged kernel's bytes of K and V read per second (64 sequences of
  4,096 tokens, the model's heads, bf16), against the device's memory bandwidth measured in the same
  run (a device-to-device copy: bytes read and written).
- Prefill MFU: one 2,048-token prompt through the engine (bf16, SDPA), its model FLOPs per second
  against a bf16 matmul's rate measured in the same run (8192^3).
- Tensor parallel 2 on one device with gloo: the same greedy tokens as TP=1, and 16-stream decode
  throughput of each.

`--model` may be a GGUF or an HF folder; a folder that does not exist is made with random weights in
the default model's shape (the device machine cannot fetch the model: speed does not depend on the
weights' values, and token equality is checked between configurations of the same weights).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ember.bench.measure import progress, write_result

PREFILL_TOKENS, STREAMS, TOKENS = 2048, 16, 32


def make_random_model(out: Path, like: Path, seed: int = 0) -> Path:
    """An HF folder at `out`: `like`'s config and tokenizer (a folder holding them), random weights."""
    import torch
    from safetensors.torch import save_file

    from ember.model.args import ModelArgs
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(like / name, out / name)
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    a = ModelArgs.from_hf_config(config)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.02
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    tensors = {"model.embed_tokens.weight": w(a.vocab_size, a.hidden_size),
               "model.norm.weight": torch.ones(a.hidden_size)}
    if not a.tie_word_embeddings:
        tensors["lm_head.weight"] = w(a.vocab_size, a.hidden_size)
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(a.hidden_size),
                    p + "post_attention_layernorm.weight": torch.ones(a.hidden_size),
                    p + "self_attn.q_proj.weight": w(q, a.hidden_size),
                    p + "self_attn.k_proj.weight": w(kv, a.hidden_size),
                    p + "self_attn.v_proj.weight": w(kv, a.hidden_size),
                    p + "self_attn.o_proj.weight": w(a.hidden_size, q),
                    p + "mlp.gate_proj.weight": w(a.intermediate_size, a.hidden_size),
                    p + "mlp.up_proj.weight": w(a.intermediate_size, a.hidden_size),
                    p + "mlp.down_proj.weight": w(a.hidden_size, a.intermediate_size)}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100)


def memory_bandwidth_gbs() -> float:
    import torch
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_ms(lambda: dst.copy_(src)) / 1000) / 1e9


def matmul_tflops() -> float:
    import torch
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192**3 / (_ms(lambda: a @ a) / 1000) / 1e12


def decode_attention(args, batch: int = 64, context: int = 4096, block_size: int = 16) -> dict:
    import torch

    from ember.kernels.triton_paged_attention import paged_decode_attention
    blocks_each = context // block_size
    k = torch.randn(batch * blocks_each, block_size, args.num_kv_heads, args.head_dim, dtype=torch.bfloat16,
                    device="cuda")
    v = torch.randn_like(k)
    tables = torch.randperm(batch * blocks_each, device="cuda", dtype=torch.int32).view(batch, blocks_each)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, args.num_heads, args.head_dim, dtype=torch.bfloat16, device="cuda")
    ms = _ms(lambda: paged_decode_attention(q, k, v, tables, lens, args.head_dim ** -0.5))
    read = 2 * k.numel() * k.element_size()
    return {"batch": batch, "context": context, "ms": round(ms, 4), "gb_per_s": round(read / (ms / 1000) / 1e9, 1)}


def _engine(model: str, dtype: str, **extra):
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(model=model, device="cuda", dtype=dtype, weights="dense", kv_cache_mb=4096,
                                  max_num_batched_tokens=PREFILL_TOKENS, **extra))


def prefill_mfu(model: str, peak_tflops: float) -> dict:
    import torch

    from ember.engine.sampling_params import SamplingParams
    engine = _engine(model, "bfloat16")
    a = engine.loaded.args
    times = []
    for i in range(4):  # a fresh prompt each time (no cached prefix); the first warms up
        prompt = [(7 * i + t) % 1000 + 100 for t in range(PREFILL_TOKENS)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times[1:])[1]
    layer_params = a.num_layers * (a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
                                   + a.num_heads * a.head_dim * a.hidden_size + 3 * a.hidden_size * a.intermediate_size)
    flops = 2 * layer_params * PREFILL_TOKENS + 2 * a.num_layers * a.num_heads * a.head_dim * PREFILL_TOKENS**2 \
        + 2 * a.hidden_size * a.vocab_size  # causal attention (QK and PV, half the square each), one logits row
    engine.close()
    tflops = flops / seconds / 1e12
    return {"tokens": PREFILL_TOKENS, "seconds": round(seconds, 4), "tflops": round(tflops, 2),
            "mfu_of_measured_matmul": round(tflops / peak_tflops, 4)}


def _decode_run(engine) -> tuple[list[list[int]], float]:
    from ember.engine.sampling_params import SamplingParams
    prompts = [[(13 * s + t) % 2000 + 50 for t in range(64 + s)] for s in range(STREAMS)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs], STREAMS * TOKENS / (time.perf_counter() - start)


def tensor_parallel_one_device(model: str) -> dict:
    result = {}
    tokens = {}
    for degree in (1, 2):
        progress(f"tensor parallel {degree} on one device (fp32)")
        engine = _engine(model, "float32", tensor_parallel=degree)
        tokens[degree], rate = _decode_run(engine)
        result[f"tp{degree}_tok_per_s"] = round(rate, 1)
        result[f"tp{degree}_kernels"] = engine.kernels
        engine.close()
    result["tp2_tokens_equal_tp1"] = tokens[1] == tokens[2]
    return result


def main(args) -> int:
    import torch
    if not torch.cuda.is_available():
        print("ember bench gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    from ember.model.args import ModelArgs
    from ember.model.fetch import DEFAULT_MODEL_PATH
    from ember.model.files import model_folder
    model = Path(args.model)
    if not model.exists():
        like = Path(args.like) if args.like else model_folder(DEFAULT_MODEL_PATH)
        progress(f"{model}: random weights in the shape of {like}")
        make_random_model(model, like)
    margs = ModelArgs.from_hf_config(json.loads((model_folder(model) / "config.json").read_text()))
    result: dict = {"device": torch.cuda.get_device_name(), "model": str(model)}
    progress("memory bandwidth and bf16 matmul rate")
    result["memory_gb_per_s"] = round(memory_bandwidth_gbs(), 1)
    result["matmul_bf16_tflops"] = round(matmul_tflops(), 1)
    progress("decode attention (Triton)")
    result["decode_attention"] = decode_attention(margs)
    progress(f"prefill of {PREFILL_TOKENS} tokens")
    result["prefill"] = prefill_mfu(str(model), result["matmul_bf16_tflops"])
    result["tensor_parallel"] = tensor_parallel_one_device(str(model))
    result["targets"] = {
        "decode attention / memory bandwidth": {
            "value": round(result["decode_attention"]["gb_per_s"] / result["memory_gb_per_s"], 3),
            "target": "reported"},
        "prefill MFU (of the measured bf16 matmul)": {"value": result["prefill"]["mfu_of_measured_matmul"],
                                                      "target": "reported"},
        "TP=2 on one device: tokens equal TP=1": {"value": result["tensor_parallel"]["tp2_tokens_equal_tp1"],
                                                  "target": True}}
    write_result(result, args.output)
    return 0 if result["tensor_parallel"]["tp2_tokens_equal_tp1"] else 1
