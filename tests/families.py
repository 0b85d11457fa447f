"""Small random-weight checkpoints of each family Ember serves, written by transformers itself.

Each keeps every structural field of the real config (DeepSeek-V3 / Kimi K2.5's latent attention,
group-limited sigmoid routing with its correction bias, shared and routed experts, dense first
layers, yarn rope; Qwen3's QK-norm; Qwen3-MoE's softmax router and sparse step; Llama 4's NoPE
and chunked layers, L2 QK-norm, temperature tuning, llama3 rope, input-scaling router and shared
expert) with layers and widths scaled down, and the default model's tokenizer beside it, so Ember
loads the folder as it would a real checkpoint and transformers is the reference."""
from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_hidden_layers=4, rms_norm_eps=1e-6,
              max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              initializer_range=0.1)

CONFIGS = {
    "qwen3": ("Qwen3Config", dict(intermediate_size=128, num_key_value_heads=2, head_dim=32,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=128, num_key_value_heads=2, head_dim=32,
                                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # DeepSeek-V3's (and Kimi K2.5's text model's) structure: q_lora_rank / kv_lora_rank latents, a rope
    # key apart, 8 routed experts in 4 groups (2 candidate groups), 1 shared, the first layer dense, yarn
    "deepseek_v3": ("DeepseekV3Config", dict(
        intermediate_size=128, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 512, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
    # Llama 4 Scout's text model: a NoPE layer every 4th (no_rope_layers), the rope layers chunked
    # (attention_chunk_size, 32 here: the prompts cross chunks) with L2 QK-norm, attention temperature
    # on the NoPE layers (floor_scale 16, so it moves at these lengths; Scout's 8192), llama3 rope
    # (Scout's factor, its band smoothed here: low 1 / high 4), top-1 sigmoid-routed experts with a
    # shared expert; every 2nd layer MoE (Maverick's interleave) so dense layers of intermediate_size_mlp too
    "llama4": ("Llama4TextConfig", dict(
        intermediate_size=32, intermediate_size_mlp=128, num_key_value_heads=2, head_dim=32,
        num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0],
        attention_chunk_size=32, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=16, attn_scale=0.1,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}


def build(kind: str, folder: Path, tokenizer_folder: Path, seed: int = 0) -> Path:
    """A random `kind` checkpoint saved with save_pretrained in `folder` (made once: kept if there)."""
    from ember.bench.random_models import save_random
    cls, fields = CONFIGS[kind]
    return save_random(cls, COMMON | fields, folder, tokenizer_folder, seed)
