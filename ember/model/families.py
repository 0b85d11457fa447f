"""The model families Ember serves, by config.json's `architectures` (torch-free).

A family is what its config says about the shared decoder (ember.model.llama): which attention
(grouped-query, with or without QK-norm, or latent), which MLP per layer (dense or mixture of
experts, and its router), and which rope. Each reader below turns a family's config into one
`ModelArgs`; the modules are built from that, never from the family's name."""
from __future__ import annotations

from collections.abc import Callable

from ember.model.args import MLAArgs, ModelArgs, MoEArgs, RopeScaling


def _rope(cfg: dict, allowed: tuple[str, ...] = ("default",)) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers >= 5's `rope_parameters` or the older `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    params = {**legacy, **params}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if kind not in allowed:
        raise ValueError(f"rope_type {kind!r} is not supported for {cfg.get('architectures')} "
                         f"(supported: {', '.join(allowed)})")
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, RopeScaling(
            factor=float(params["factor"]), original_max_position=int(params["original_max_position_embeddings"]),
            kind="llama3", low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]))
    return theta, RopeScaling(
        factor=float(params["factor"]),
        original_max_position=int(params.get("original_max_position_embeddings")
                                  or cfg.get("max_position_embeddings", 2048)),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))


def _refuse(cfg: dict, **unsupported) -> None:
    """Fields whose non-default values this implementation does not serve."""
    for key, default in unsupported.items():
        value = cfg.get(key, default)
        if value not in (default, None):
            raise ValueError(f"config.json sets {key}={value!r}, which Ember does not serve yet "
                             f"for {cfg.get('architectures')}")


def _base(cfg: dict, family: str, allowed_rope=("default",), **extra) -> ModelArgs:
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    theta, scaling = _rope(cfg, allowed_rope)
    fields = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_position=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        family=family, rope_scaling=scaling)
    return ModelArgs(**(fields | extra))


def _check_act(cfg: dict) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU with silu only)")


def llama(cfg: dict) -> ModelArgs:
    _check_act(cfg)
    _refuse(cfg, attention_bias=False, mlp_bias=False)
    return _base(cfg, "llama")


def qwen3(cfg: dict) -> ModelArgs:
    _check_act(cfg)
    _refuse(cfg, attention_bias=False, use_sliding_window=False)
    return _base(cfg, "qwen3", qk_norm=True)


def qwen3_moe(cfg: dict) -> ModelArgs:
    _check_act(cfg)
    _refuse(cfg, attention_bias=False, use_sliding_window=False)
    n = cfg["num_hidden_layers"]
    step, dense_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # renamed in transformers 5
    layers = tuple(i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(n))
    moe = MoEArgs(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                  intermediate_size=cfg["moe_intermediate_size"], layers=layers, router="softmax",
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return _base(cfg, "qwen3_moe", qk_norm=True, moe=moe)


def deepseek_v3(cfg: dict) -> ModelArgs:
    if "text_config" in cfg:  # Kimi K2.5: a multimodal wrapper whose text model is DeepSeek-V3
        cfg = cfg["text_config"]
    _check_act(cfg)
    _refuse(cfg, attention_bias=False)
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError("DeepSeek-V3 routing other than sigmoid scores with noaux_tc top-k is not served")
    n = cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 0)
    freq = cfg.get("moe_layer_freq", 1)
    layers = tuple(i >= first_dense and i % freq == 0 for i in range(n))
    mla = MLAArgs(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                  qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                  v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)))
    moe = MoEArgs(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                  intermediate_size=cfg["moe_intermediate_size"], layers=layers, router="sigmoid",
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), num_groups=cfg.get("n_group") or 1,
                  topk_groups=cfg.get("topk_group") or 1,
                  scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                  shared_intermediate_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0))
    # the latent attention has one "head" in the cache; num_kv_heads keeps the config's (all heads)
    return _base(cfg, "deepseek_v3", allowed_rope=("default", "yarn"), mla=mla, moe=moe,
                 head_dim=mla.qk_head_dim)


def llama4(cfg: dict) -> ModelArgs:
    """Llama 4's text model (Llama4ForCausalLM; Llama4ForConditionalGeneration's `text_config`, its
    tensors under `language_model.`, the vision tower not read): MoE every `interleave_moe_layer_step`
    layers (or `moe_layers`), a top-k sigmoid router scaling each routed expert's input and a shared
    expert; the dense layers' MLP of `intermediate_size_mlp`. NoPE layers (`no_rope_layers` 0) attend
    over the whole causal context with temperature tuning; rope layers (interleaved pairs, llama3
    scaling) attend within chunks of `attention_chunk_size` positions, with L2 QK-norm."""
    wrapper = "text_config" in cfg
    _refuse(cfg, quantization_config=None)
    if wrapper:
        cfg = {"architectures": cfg.get("architectures"), **cfg["text_config"]}
    _check_act(cfg)
    _refuse(cfg, attention_bias=False, quantization_config=None)
    n = cfg["num_hidden_layers"]
    rope = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
    rope = tuple(bool(r) for r in rope[:n])  # (the list may be longer than the layers)
    chunk = cfg.get("attention_chunk_size", 8192)
    types = cfg.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                       for r in rope]
    unknown = sorted(set(types) - {"chunked_attention", "full_attention"})
    if unknown:
        raise ValueError(f"config.json sets layer_types {unknown}, which Ember does not serve for Llama 4 "
                         "(full_attention and chunked_attention only)")
    if "chunked_attention" in types and not chunk:
        raise ValueError("config.json has chunked_attention layers but no attention_chunk_size")
    chunks = tuple(int(chunk) if t == "chunked_attention" else 0 for t in types[:n])
    step = cfg.get("interleave_moe_layer_step", 1)
    moe_layers = cfg.get("moe_layers")
    moe_layers = set(range(step - 1, n, step) if moe_layers is None else moe_layers)
    experts = cfg.get("num_local_experts", 16)
    layers = tuple(i in moe_layers and experts > 0 for i in range(n))
    moe = MoEArgs(num_experts=experts, top_k=cfg.get("num_experts_per_tok", 1),
                  intermediate_size=cfg["intermediate_size"], layers=layers, router="llama4",
                  norm_topk_prob=False, shared_intermediate_size=cfg["intermediate_size"])
    temperature = None
    if cfg.get("attn_temperature_tuning", True) and not all(rope):
        temperature = (float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1)))
    return _base(cfg, "llama4", allowed_rope=("default", "llama3"), moe=moe if any(layers) else None,
                 intermediate_size=cfg.get("intermediate_size_mlp", 16384), rope_layers=rope, rope_interleave=True,
                 attention_chunks=chunks if any(chunks) else None, qk_l2_norm=bool(cfg.get("use_qk_norm", True)),
                 attn_temperature=temperature, weights_prefix="language_model." if wrapper else "",
                 mlp_name="feed_forward")


FAMILIES: dict[str, Callable[[dict], ModelArgs]] = {
    "LlamaForCausalLM": llama,
    "Qwen3ForCausalLM": qwen3,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "DeepseekV3ForCausalLM": deepseek_v3,
    "Llama4ForCausalLM": llama4,
    "Llama4ForConditionalGeneration": llama4,  # its text model (the vision tower is not served)
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k25": "DeepseekV3ForCausalLM",
               "llama4_text": "Llama4ForCausalLM", "llama4": "Llama4ForConditionalGeneration"}


def architecture_of(cfg: dict) -> str:
    names = cfg.get("architectures") or []
    for name in names:
        if name in FAMILIES:
            return name
    if not names and cfg.get("model_type") in MODEL_TYPES:  # a config without architectures (older files)
        return MODEL_TYPES[cfg["model_type"]]
    if cfg.get("model_type") == "kimi_k25" or (cfg.get("text_config") or {}).get("model_type") == "deepseek_v3":
        return "DeepseekV3ForCausalLM"
    raise ValueError(f"architecture {names or cfg.get('model_type')!r} is not supported; "
                     f"Ember serves {', '.join(FAMILIES)}")


def args_from_config(cfg: dict) -> ModelArgs:
    return FAMILIES[architecture_of(cfg)](cfg)
