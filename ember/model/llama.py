"""The decoder every family shares (RMSNorm, rope, SwiGLU), with the parts a family's config picks:
grouped-query attention (with Qwen3's QK-norm; per layer, Llama 4's NoPE layers, interleaved rope,
L2 QK-norm and attention temperature) or latent attention (ember.model.mla), and per layer a dense
MLP or a mixture of experts (ember.model.moe). ember.model.families reads which. (Llama 4's chunked
local attention is the Attend's: ember.engine.attention.)

The model never touches the KV cache itself: attention over cached context is done by
an `Attend` callable handed in per forward, so paging, kernels and batching live
outside the model (ember.engine.attention).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ember.model.args import PRESETS, ModelArgs  # noqa: F401  (re-exported)
from ember.model.checkpoint import MissingTensorError
from ember.model.rope import apply_rope, apply_rope_interleaved, rope_cos_sin  # noqa: F401  (re-exported)


class Attend(Protocol):
    """Attention over this step's tokens plus their cached context.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim]. Also stores k, v in the KV cache.
    """

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # set by ember.kernels.optimize on bf16 models: kernel(x, weight, eps), the same formula in one call
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the serving dtype (as transformers does); one fused
        # op instead of six (this runs 61 times per step).
        if self.kernel is not None and x.dtype == torch.bfloat16:
            return self.kernel(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * h.to(x.dtype)


class TakeOnce:
    """A checkpoint's tensors by name, taken once each: `take(name)` pops it (sources are dropped as
    they are fused: one copy at a time); `take.has(name)`. A missing one raises MissingTensorError
    (ember.model.checkpoint says in which stored form it was looked for)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise MissingTensorError(f"checkpoint is missing tensor {name!r}", name)
        return self.tensors.pop(name)

    def has(self, name: str) -> bool:
        return name in self.tensors


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of x over its last dim scaled to unit RMS, no weight (Llama 4's QK-norm), in fp32."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention, q/k/v fused in one projection; qk_norm: RMSNorm over each head of
    q and k before rope (Qwen3). Llama 4, per layer: a rope layer rotates interleaved pairs and
    L2-normalises q and k after; a NoPE layer does not rotate and scales q by the step's
    `temperature` (per token, from its position)."""

    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.rope = args.uses_rope(layer_idx)
        self.rotate = apply_rope_interleaved if args.rope_interleave else apply_rope
        self.l2_eps = args.rms_norm_eps if args.qk_l2_norm and self.rope else None
        self.tempered = not self.rope and args.attn_temperature is not None
        self.reduce = None  # tensor parallel: the all-reduce of o_proj's partial sums (set_tensor_parallel)

    def forward(self, x, cos, sin, attend: Attend, layer_idx: int, temperature=None) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :heads]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        # rotate q and k heads in one go: [T, num_heads + num_kv_heads, D]
        if self.rope:
            qk = self.rotate(qk, cos, sin).to(x.dtype)
        if self.l2_eps is not None:
            qk = l2_norm(qk, self.l2_eps)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        if self.tempered:
            q = (q * temperature[:, None, None]).to(x.dtype)
        v = qkv[:, heads:]
        out = self.o_proj(attend(layer_idx, q, k, v).reshape(num_tokens, -1))
        return out if self.reduce is None else self.reduce(out)

    def hf_weights(self, take: TakeOnce, prefix: str, linears: bool = True) -> dict[str, torch.Tensor]:
        own = {}
        if self.q_norm is not None:
            own["q_norm.weight"], own["k_norm.weight"] = take(prefix + "q_norm.weight"), take(prefix + "k_norm.weight")
        if linears:
            own["qkv_proj.weight"] = torch.cat([take(prefix + f"{n}_proj.weight") for n in ("q", "k", "v")])
            own["o_proj.weight"] = take(prefix + "o_proj.weight")
        return own


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.reduce = None  # tensor parallel: the all-reduce of down_proj's partial sums

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.silu(gate) * up)
        return out if self.reduce is None else self.reduce(out)

    def hf_weights(self, take: TakeOnce, prefix: str, linears: bool = True) -> dict[str, torch.Tensor]:
        if not linears:
            return {}
        return {"gate_up_proj.weight": torch.cat([take(prefix + "gate_proj.weight"), take(prefix + "up_proj.weight")]),
                "down_proj.weight": take(prefix + "down_proj.weight")}


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.mla is not None:
            from ember.model.mla import LatentAttention
            self.self_attn = LatentAttention(args)
        else:
            self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.moe is not None and args.moe.layers[layer_idx]:
            from ember.model.moe import MoE
            self.mlp = MoE(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def forward(self, x, cos, sin, attend: Attend, layer_idx: int, **step) -> torch.Tensor:
        """step: what a family's attention takes per step beside rope (Llama 4: `temperature`)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, layer_idx, **step)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        cos, sin = rope_cos_sin(args.rope_dim, args.rope_theta, args.max_position, args.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # A kernel module may take over whole layers for steps of at most `small_step_rows`
        # tokens (decode): small_step(layer, x, cos, sin, attend, layer_idx) -> x.
        self.small_step = None
        self.small_step_rows = 0
        # tensor parallel (ember.parallel): this rank's embedding rows start here; reduce sums over ranks
        self.vocab_start, self.reduce = 0, None

    def set_tensor_parallel(self, reduce, vocab_start: int) -> None:
        """Make this model one rank's shard: `reduce(t)` sums t over the ranks in place of the
        missing parts (after o_proj, down_proj and the vocab-parallel embedding lookup)."""
        self.reduce, self.vocab_start = reduce, vocab_start
        for layer in self.layers:
            layer.self_attn.reduce = layer.mlp.reduce = reduce

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return self.embed_tokens(input_ids)
        # vocab-parallel: tokens outside this rank's rows look up zeros; one rank holds each token,
        # so the sum over ranks is that rank's row exactly
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))
        return self.reduce(x.masked_fill(~inside[:, None], 0.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """input_ids, positions: [num_tokens] (all sequences of the step, flattened).

        Returns final hidden states [num_tokens, hidden]; call `compute_logits` only on
        the rows that are sampled.
        """
        return self.norm(self.forward_layers(self.embed(input_ids), positions, attend))

    def forward_layers(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The decoder layers alone (a pipeline stage runs these on the hidden states it receives)."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        step = {}
        if self.args.attn_temperature is not None:  # Llama 4's NoPE layers: q scaled by position, fp32
            floor_scale, attn_scale = self.args.attn_temperature
            step["temperature"] = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        small_step = self.small_step if x.shape[0] <= self.small_step_rows else None
        for layer_idx, layer in enumerate(self.layers):
            if small_step is not None:
                x = small_step(layer, x, cos, sin, attend, layer_idx, **step)
            else:
                x = layer(x, cos, sin, attend, layer_idx, **step)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor], linears: bool = True) -> None:
        """Load weights named as in Hugging Face checkpoints of the family (each module maps its own
        names: fused qkv and gate/up, latent attention's split kv_b_proj, stacked experts).
        linears=False: the layers' linears are in place already (int4 modules) and not in `tensors`.

        Consumes `tensors` (entries are popped as they are used)."""
        take = TakeOnce(tensors)
        own = {}
        top = self.args.weights_prefix  # a multimodal wrapper's text model: its names under this
        own["embed_tokens.weight"] = take(top + "model.embed_tokens.weight")
        own["norm.weight"] = take(top + "model.norm.weight")
        if self.lm_head is not None:
            own["lm_head.weight"] = take(top + "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"{top}model.layers.{i}."
            own[f"layers.{i}.input_layernorm.weight"] = take(p + "input_layernorm.weight")
            own[f"layers.{i}.post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
            for part, name in (("self_attn", "self_attn"), ("mlp", self.args.mlp_name)):
                module = getattr(layer, part)
                kw = {"linears": linears} if isinstance(module, (Attention, MLP)) else {}
                own |= {f"layers.{i}.{part}.{k}": v for k, v in module.hf_weights(take, f"{p}{name}.", **kw).items()}
        self.load_state_dict(own, strict=True, assign=True)
