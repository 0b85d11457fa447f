"""A checkpoint's shape, read from its HF config.json (torch-free: the router and the config's
derived values read it without loading the model).

One `ModelArgs` describes every family Ember serves: the dense Llama decoder and its variants
(ember.model.families names them by `architectures`), with optional parts: QK-norm (Qwen3),
Multi-head Latent Attention (`mla`, DeepSeek-V3 / Kimi K2.5), mixture-of-experts MLPs (`moe`),
yarn or llama3 rope scaling (`rope_scaling`), and Llama 4's per-layer attention (NoPE layers,
chunked local attention, L2 QK-norm, attention temperature)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class MLAArgs:
    """Multi-head Latent Attention (DeepSeek-V2/V3): keys and values come from a per-token latent
    of `kv_lora_rank` values plus one shared rope key of `qk_rope_head_dim`; the KV cache holds
    only those (kv_lora_rank + qk_rope_head_dim values per token and layer)."""
    q_lora_rank: int | None  # None: q is one projection (q_proj); else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rope over interleaved pairs (x0, x1), (x2, x3), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """What the KV cache holds per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    layers: tuple[bool, ...]  # per decoder layer: True where its MLP is the MoE block
    # "softmax" (Qwen3-MoE: softmax, top-k), "sigmoid" (DeepSeek-V3: sigmoid + bias, groups) or "llama4"
    # (top-k of the logits, sigmoid of the chosen; each routed expert's input is scaled by its score)
    router: str = "softmax"
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
    num_groups: int = 1  # sigmoid router: experts in groups, only `topk_groups` groups are candidates
    topk_groups: int = 1
    scaling_factor: float = 1.0  # routed_scaling_factor: the routed experts' sum is scaled by it
    shared_intermediate_size: int = 0  # a dense shared expert beside the routed ones (0: none)
    local_experts: tuple[int, int] | None = None  # expert parallelism: this rank's [first, last) experts


@dataclass(frozen=True)
class RopeScaling:
    """A scaled rope. kind "yarn" (DeepSeek-V3 / Kimi K2.5): frequencies interpolated between the
    original and `factor`-times-longer wavelengths, cos/sin scaled by attention_factor. kind "llama3"
    (Llama 3.1 / Llama 4): wavelengths past original_max_position / low_freq_factor divided by
    `factor`, those under original_max_position / high_freq_factor kept, the band between smoothed."""
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    kind: str = "yarn"
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    family: str = "llama"  # ember.model.families.FAMILIES
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3)
    mla: MLAArgs | None = None
    moe: MoEArgs | None = None
    rope_scaling: RopeScaling | None = field(default=None)
    # Llama 4's per-layer attention (None / False / 0: every layer as above)
    rope_layers: tuple[bool, ...] | None = None  # per layer: False for a NoPE layer (no rotation at all)
    rope_interleave: bool = False  # rope over interleaved pairs (x0, x1), (x2, x3), ... (Llama 4's complex form)
    attention_chunks: tuple[int, ...] | None = None  # per layer: n > 0: a query sees only keys in its own n-chunk
    qk_l2_norm: bool = False  # rope layers: q and k L2-normalised per head (no weight) after rope
    # NoPE layers: q scaled by log1p(floor((position + 1) / floor_scale)) * attn_scale + 1
    attn_temperature: tuple[float, float] | None = None  # (floor_scale, attn_scale)
    weights_prefix: str = ""  # the text model's names under a multimodal wrapper ("language_model.")
    mlp_name: str = "mlp"  # each layer's MLP in the checkpoint (Llama 4: "feed_forward")

    def for_layers(self, first: int, last: int) -> ModelArgs:
        """The shape of decoder layers [first, last) alone, renumbered from 0 (a pipeline stage): every
        per-layer field sliced with them."""
        def cut(per_layer):
            return None if per_layer is None else tuple(per_layer[first:last])
        moe = None if self.moe is None else replace(self.moe, layers=cut(self.moe.layers))
        return replace(self, num_layers=last - first, moe=moe, rope_layers=cut(self.rope_layers),
                       attention_chunks=cut(self.attention_chunks))

    def uses_rope(self, layer_idx: int) -> bool:
        return self.rope_layers is None or bool(self.rope_layers[layer_idx])

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        from ember.model.families import args_from_config
        return args_from_config(cfg)

    # what the paged KV cache holds per token and layer: `kv_planes` planes (K and V; or MLA's one
    # latent plane) of kv_cache_heads x kv_cache_dim values
    @property
    def kv_planes(self) -> int:
        return 1 if self.mla is not None else 2

    @property
    def kv_cache_heads(self) -> int:
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def kv_cache_dim(self) -> int:
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale of attention scores."""
        if self.mla is None:
            return self.head_dim ** -0.5
        scale = self.mla.qk_head_dim ** -0.5
        r = self.rope_scaling
        if r is not None and r.mscale_all_dim:  # DeepSeek's yarn: scores scaled by mscale(all_dim)^2
            scale *= yarn_mscale(r.factor, r.mscale_all_dim) ** 2
        return scale

    @property
    def rope_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def to_hf_config(self) -> dict:
        if self.family != "llama":
            raise ValueError(f"to_hf_config writes Llama configs only (this is {self.family})")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    import math
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


PRESETS: dict[str, ModelArgs] = {
    "smollm2-135m": ModelArgs(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
}


def read_model_args(folder: str | Path) -> ModelArgs:
    """The shape of the HF-layout model folder `folder`."""
    return ModelArgs.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))
