"""Every family Ember serves gives transformers' own greedy tokens on the exact (fp32) path: a random
checkpoint of each (tests/families.py: DeepSeek-V3 / Kimi K2.5's latent attention and routed
experts, Qwen3's QK-norm, Qwen3-MoE, Llama 4's NoPE and chunked layers and its router), saved by
transformers and loaded by Ember from the folder. Alone, batched, chunked and from a cached prefix;
the last step's logits to 1e-4."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ember.engine.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.sampling_params import SamplingParams
from ember.model.args import read_model_args
from ember.model.families import args_from_config
from tests.conftest import PROMPTS
from tests.families import CONFIGS, build

STEPS = 32
KINDS = sorted(CONFIGS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_path):
    from ember.model.files import model_folder
    tokenizer = model_folder(str(model_path))
    root = tmp_path_factory.mktemp("families")
    return {kind: build(kind, root / kind, tokenizer) for kind in KINDS}


@pytest.fixture(scope="module")
def references(checkpoints):
    """kind -> (transformers model, memo of greedy runs)."""
    from transformers import AutoModelForCausalLM
    return {kind: (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), {})
            for kind, folder in checkpoints.items()}


def hf_greedy(references, kind, ids: list[int], steps: int = STEPS) -> list[int]:
    model, memo = references[kind]
    key = (tuple(ids), steps)
    if key not in memo:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        memo[key] = out[0, len(ids):].tolist()
    return memo[key]


def engine_for(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", weights="dense", threads=2, kv_cache_mb=64) | overrides
    return LLMEngine(EngineConfig(**config))


def greedy(steps: int = STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=steps, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(checkpoints):
    from ember.model.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_folder(next(iter(checkpoints.values())))
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("kind", KINDS)
def test_alone_each_prompt_gives_transformers_tokens_and_last_logits(kind, checkpoints, references, prompts):
    engine = engine_for(checkpoints[kind])
    logits = []
    execute = engine.runner.execute
    engine.runner.execute = lambda inputs: logits.append(execute(inputs)) or logits[-1]
    model, _ = references[kind]
    for ids in prompts:
        logits.clear()
        [out] = engine.generate([ids], greedy())
        expected = hf_greedy(references, kind, ids)
        assert out.token_ids == expected, f"{kind}: prompt of {len(ids)} tokens diverged"
        with torch.inference_mode():
            theirs = model(torch.tensor([ids + expected[:-1]])).logits[0, -1]
        ours = logits[-1][-1]
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), \
            f"{kind}: last-step logits differ by {(ours - theirs).abs().max():.2e}"


@pytest.mark.parametrize("kind", KINDS)
def test_batched_and_chunked_give_the_same_tokens(kind, checkpoints, references, prompts):
    # 64-token steps: every prompt past the first few is prefilled in chunks, beside decodes
    engine = engine_for(checkpoints[kind], max_num_batched_tokens=64)
    outs = engine.generate(prompts, greedy())
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(references, kind, ids), f"{kind}: prompt of {len(ids)} tokens diverged"


@pytest.mark.parametrize("kind", KINDS)
def test_from_a_cached_prefix_the_same_tokens(kind, checkpoints, references, prompts):
    engine = engine_for(checkpoints[kind])
    long = prompts[-1]
    engine.generate([long[:640]], greedy(4))  # caches 40 blocks of the long prompt
    [out] = engine.generate([long], greedy())
    assert out.cached_tokens >= 624, f"{kind}: only {out.cached_tokens} tokens came from the cache"
    assert out.token_ids == hf_greedy(references, kind, long)


def test_moe_request_alone_and_among_7_others_gives_identical_tokens(checkpoints, prompts):
    for kind in ("qwen3_moe", "deepseek_v3", "llama4"):
        [alone] = engine_for(checkpoints[kind]).generate([prompts[0]], greedy())
        others = [prompts[i % len(prompts)][:40 + 7 * i] for i in range(1, 8)]
        among = engine_for(checkpoints[kind]).generate([prompts[0], *others], greedy())[0]  # (a fresh cache)
        assert among.token_ids == alone.token_ids, kind


def test_experts_are_read_by_what_was_routed_to_them(checkpoints, prompts):
    engine = engine_for(checkpoints["qwen3_moe"])
    engine.generate([prompts[0]], greedy(8))
    moe = [layer.mlp for layer in engine.loaded.model.layers if hasattr(layer.mlp, "expert_tokens")]
    args = engine.loaded.args
    assert len(moe) == sum(args.moe.layers) == args.num_layers - 1  # mlp_only_layers=[0]
    tokens = len(prompts[0]) + 8 - 1  # every token but the last sampled one went through each layer
    for block in moe:
        assert int(block.expert_tokens.sum()) == tokens * args.moe.top_k


def test_the_latent_cache_holds_576_values_a_token_for_kimi_and_48_here(checkpoints):
    args = read_model_args(checkpoints["deepseek_v3"])
    engine = engine_for(checkpoints["deepseek_v3"])
    layout = engine.layout
    assert (layout.planes, layout.num_kv_heads, layout.head_dim) == (1, 1, 32 + 16)
    assert layout.bytes_per_token == args.num_layers * 48 * 4  # fp32; an MHA cache: 2 x 4 heads x 32 x 4 B
    assert engine.cache.kv.shape[:2] == (args.num_layers, 1)
    kimi = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840, "hidden_size": 7168,
            "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 64,
            "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048, "n_group": 1, "topk_group": 1}
    assert args_from_config(kimi).kv_cache_dim == 576


def test_llama4_reads_its_layers_as_transformers_does_for_scout_and_its_defaults():
    """Scout's text config (transformers' defaults; and the public one, configs/models): which layers
    are NoPE, chunked, MoE, as transformers derives them, whether the config lists them or leaves
    them to the defaults; its llama3 rope (low_freq_factor == high_freq_factor: no smoothed band)
    equals transformers' tables."""
    import transformers

    from ember.model.rope import rope_cos_sin
    text = transformers.Llama4TextConfig(num_hidden_layers=8).to_dict()
    text["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    wrapped = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text}
    args = args_from_config(wrapped)
    assert args.rope_layers == tuple(bool(r) for r in text["no_rope_layers"]) == (True, True, True, False) * 2
    assert args.attention_chunks == tuple(8192 if t == "chunked_attention" else 0 for t in text["layer_types"])
    assert args.moe.layers == tuple(i in text["moe_layers"] for i in range(8)) and args.moe.router == "llama4"
    assert (args.weights_prefix, args.mlp_name, args.qk_l2_norm, args.attn_temperature) == \
        ("language_model.", "feed_forward", True, (8192.0, 0.1))
    scout = args_from_config(json.loads((Path(__file__).parents[1] / "configs/models/llama-4-scout.json").read_text()))
    assert (sum(scout.rope_layers), set(scout.attention_chunks), sum(scout.moe.layers), scout.moe.num_experts,
            scout.moe.shared_intermediate_size, scout.moe.top_k) == (36, {0, 8192}, 48, 16, 8192, 1)
    assert scout.rope_scaling == args.rope_scaling and scout.attn_temperature == (8192.0, 0.1)  # (tuning: 4, truthy)
    bare = {k: v for k, v in text.items() if k not in ("no_rope_layers", "moe_layers", "layer_types")}
    assert args_from_config({"architectures": ["Llama4ForCausalLM"]} | bare) == replace(args, weights_prefix="")
    config = transformers.Llama4TextConfig(**{k: v for k, v in text.items() if k != "transformers_version"}
                                           | {"max_position_embeddings": 40000})
    freqs = transformers.models.llama4.modeling_llama4.Llama4TextRotaryEmbedding(config)(
        torch.empty(0), torch.arange(40000)[None])[0]
    cos, sin = rope_cos_sin(args.rope_dim, args.rope_theta, 40000, args.rope_scaling)
    half = args.head_dim // 2
    torch.testing.assert_close(cos[:, :half], freqs.real, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, :half], freqs.imag, rtol=0, atol=1e-6)


def test_llama4_multimodal_checkpoint_serves_its_text_model(tmp_path, checkpoints, references, prompts):
    """Llama4ForConditionalGeneration (as Scout ships): its language_model's tensors are served, the
    vision tower's and projector's never read; the tokens are the text model's."""
    import transformers

    from ember.model.safetensors_io import read_safetensors
    text_model, _ = references["llama4"]
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, vision_output_dim=64, image_size=28, patch_size=14,
                                             projector_input_dim=64, projector_output_dim=64)
    config = transformers.Llama4Config(text_config=text_model.config.to_dict(), vision_config=vision.to_dict())
    wrapper = transformers.Llama4ForConditionalGeneration(config)
    wrapper.language_model.load_state_dict(text_model.state_dict())
    wrapper.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoints["llama4"] / name).read_bytes())
    engine = engine_for(tmp_path)
    assert engine.loaded.args.weights_prefix == "language_model."
    [out] = engine.generate([prompts[1]], greedy())
    assert out.token_ids == hf_greedy(references, "llama4", prompts[1])
    text_bytes = sum(t.numel() * t.element_size()
                     for f in checkpoints["llama4"].glob("*.safetensors") for t in read_safetensors(f).values())
    assert engine.loaded.weights_bytes == text_bytes  # (the vision tower was not read)


def test_llama4_refuses_what_it_does_not_serve(checkpoints):
    cfg = json.loads((checkpoints["llama4"] / "config.json").read_text())
    for change, name in (({"layer_types": ["sliding_attention"] * 4}, "sliding_attention"),
                         ({"attention_bias": True}, "attention_bias"),
                         ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, "quantization_config"),
                         ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
                         ({"hidden_act": "gelu"}, "hidden_act")):
        with pytest.raises(ValueError, match=name):
            args_from_config(cfg | change)
    from ember.model.loader import load_model
    from ember.parallel.shard import plan
    shard = plan(read_model_args(checkpoints["llama4"]), 2)[0]
    rank = load_model(checkpoints["llama4"], "float32", "dense", shard=shard)
    assert rank.model.args.num_heads == 2  # a tensor-parallel rank: served (tests/test_tensor_parallel_families.py)


def test_an_unknown_architecture_is_refused_naming_those_served():
    with pytest.raises(ValueError, match="MambaForCausalLM.*Ember serves LlamaForCausalLM, Qwen3ForCausalLM"):
        args_from_config({"architectures": ["MambaForCausalLM"], "vocab_size": 10})


def test_a_family_model_refuses_what_it_cannot_be_served_with(checkpoints):
    from ember.model.loader import load_model
    # q4 serves a file's own 4-bit codes (a Q4_1 GGUF, an int4 group-32 checkpoint): this folder has none
    with pytest.raises(ValueError, match="weights 'q4' serves a file's own 4-bit codes.*is unquantized"):
        load_model(checkpoints["qwen3"], "bfloat16", "q4")
    from ember.parallel.shard import plan
    args = read_model_args(checkpoints["qwen3_moe"])
    rank = load_model(checkpoints["qwen3_moe"], "float32", "dense", shard=plan(args, 2)[0])  # a TP shard: served
    assert rank.model.args.num_heads == 2 and rank.model.args.moe.intermediate_size == 16
    stage = load_model(checkpoints["qwen3_moe"], "float32", "dense", layers=(1, 3))  # a pipeline stage: served
    assert stage.model.args.num_layers == 2 and stage.model.args.moe.layers == (True, True)
    cfg = json.loads((checkpoints["qwen3"] / "config.json").read_text()) | {"use_sliding_window": True}
    with pytest.raises(ValueError, match="use_sliding_window"):
        args_from_config(cfg)


@pytest.mark.timeout(600)
def test_a_latent_moe_model_through_the_disaggregated_cluster_gives_transformers_tokens(
        tmp_path, checkpoints, prompts):
    """DeepSeek-V3's structure (latent KV, routed experts) in Kimi K2.5's published format (int4 experts,
    compressed-tensors pack-quantized, sharded: tests/published_formats.py) through real processes on the
    exact path: prefill at the central site, its one-plane latent blocks through the kvstores to decode
    at the edge; a second turn's prefill reuses the first turn's blocks. Tokens equal transformers' on
    the dequantized weights both turns."""
    from transformers import AutoModelForCausalLM

    from ember.bench.published_formats import write_published
    from ember.client import RouterClient
    from ember.cluster.launcher import running
    from ember.cluster.ports import write_local_config
    from ember.kv import wire
    from ember.model.files import layout_of
    from tests.cluster_fixture import decode_span
    kimi, dequantized = write_published(checkpoints["deepseek_v3"], tmp_path / "published", "int4")
    references = {"deepseek_v3": (AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval(), {})}
    config = tmp_path / "cluster.yaml"
    addr = write_local_config(config, str(kimi), dtype="float32", weights="dense")
    turn1 = prompts[-1][:300]
    with running(config, tmp_path, timeout_s=300):
        with RouterClient(addr["router"]) as client:
            first = client.complete(token_ids=turn1, max_tokens=12, ignore_eos=True, timeout=240)
            turn2 = turn1 + first.token_ids + prompts[0]
            second = client.complete(token_ids=turn2, max_tokens=12, ignore_eos=True, timeout=240)
        central, edge = (_kvstore_stats(addr | {"config": str(config)}, key) for key in ("kv_central", "kv_edge"))
    assert first.token_ids == hf_greedy(references, "deepseek_v3", turn1, 12)
    assert second.token_ids == hf_greedy(references, "deepseek_v3", turn2, 12)
    final = first.final
    assert final.placement.prefill_site == "central" and final.placement.decode_site == "edge"
    # the prefill's latent blocks crossed to the decode site: decode imported every full block
    span = decode_span(tmp_path, final)
    assert span["ember.blocks_imported"] == len(turn1) // 16 and span["ember.recomputed_tokens"] <= 16, span
    assert second.final.usage.cached_tokens == (len(turn1) // 16) * 16
    # the central store holds both turns' full blocks, each one latent plane: 16 tokens x 48 values
    # (kv_lora_rank 32 + rope 16) x 4 layers in fp32, 12 KiB, where K and V of 4 heads would be 64 KiB
    args = read_model_args(checkpoints["deepseek_v3"])
    layout = layout_of(args, "-", "float32", 16)
    assert (layout.planes, layout.num_kv_heads, layout.head_dim) == (1, 1, 48)
    assert central.blocks >= len(turn2) // 16
    print(f"kvstores: central {central.blocks} blocks, {central.bytes} B; edge {edge.blocks} blocks, "
          f"{edge.bytes} B; a block is {layout.block_bytes} B")
    assert central.bytes <= central.blocks * (layout.block_bytes + 4096)  # (4 KiB: a frame's header, generously)
    # the bytes that crossed are latent frames: one plane of 48 values a token and layer, a 104-byte header
    assert span["ember.bytes_pulled"] == span["ember.blocks_pulled"] * wire.frame_bytes(layout.block_bytes)
    # every block was filed: a frame the stores could not read used to fail its write-back and its
    # import, silently recomputed (the tokens were still right)
    logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
    assert "write-back to the site kvstore failed" not in logs and "failed (computing" not in logs


def _kvstore_stats(cluster: dict, key: str):
    from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
    from tests.cluster_fixture import dial
    with dial(cluster, key) as ch:
        return kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=10)
