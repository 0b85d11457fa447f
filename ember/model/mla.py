"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2.5) over a latent paged KV cache.

Per token and layer the cache holds only the compressed latent c (kv_lora_rank values, after its
norm) and the shared rope key k_pe (qk_rope_head_dim): 576 values for DeepSeek-V3 / Kimi K2.5,
where an MHA cache of that width would hold 2 x 128 heads x 128. Heads are never expanded: with
kv_b_proj split into W_UK [H, nope, rank] and W_UV [H, v, rank], a head's score is

    q_nope . (W_UK c) + q_pe . k_pe  =  (W_UK^T q_nope) . c + q_pe . k_pe

so the query is absorbed into latent space ([W_UK^T q_nope, q_pe], one 576-wide query per head),
attention runs against the cache as one shared key head (multi-query attention with values = the
first kv_lora_rank columns of the keys), and W_UV maps each head's latent output to its value
width. Prefill and decode both run this form: a step reads the latent only.

DeepSeek's interleaved rope ((x0, x1), (x2, x3) pairs) is folded into the weights at load (the
rope rows of q and k_pe permuted to the rotate-half layout, ember.model.rope.deinterleave_order):
the same scores, and `apply_rope` serves it."""
from __future__ import annotations

import torch
from torch import nn

from ember.model.args import ModelArgs
from ember.model.rope import apply_rope, deinterleave_order


class LatentAttention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        from ember.model.llama import RMSNorm
        m = self.spec = args.mla
        self.num_heads = args.num_heads
        q_out = args.num_heads * m.qk_head_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(args.hidden_size, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, args.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(args.hidden_size, q_out, bias=False)
        self.kv_a_proj = nn.Linear(args.hidden_size, m.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, args.rms_norm_eps)
        self.w_uk = nn.Parameter(torch.empty(args.num_heads, m.qk_nope_head_dim, m.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(args.num_heads, m.v_head_dim, m.kv_lora_rank))
        self.o_proj = nn.Linear(args.num_heads * m.v_head_dim, args.hidden_size, bias=False)
        self.reduce = None

    def forward(self, x, cos, sin, attend, layer_idx: int) -> torch.Tensor:
        m, tokens = self.spec, x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m.q_lora_rank else self.q_proj(x)
        q = q.view(tokens, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q.split((m.qk_nope_head_dim, m.qk_rope_head_dim), dim=-1)
        latent, k_pe = self.kv_a_proj(x).split((m.kv_lora_rank, m.qk_rope_head_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = apply_rope(q_pe, cos, sin).to(x.dtype)
        k_pe = apply_rope(k_pe[:, None, :], cos, sin).to(x.dtype)
        # [T, H, rank]: each head's nope query carried into latent space
        q_latent = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)
        query = torch.cat((q_latent, q_pe), dim=-1)
        key = torch.cat((latent[:, None, :], k_pe), dim=-1)  # [T, 1, rank + rope]: what the cache keeps
        out = attend(layer_idx, query, key, key[..., :m.kv_lora_rank])  # [T, H, rank]
        out = torch.einsum("thr,hvr->thv", out, self.w_uv).reshape(tokens, -1)
        out = self.o_proj(out)
        return out if self.reduce is None else self.reduce(out)

    def hf_weights(self, take, prefix: str) -> dict[str, torch.Tensor]:
        m, heads = self.spec, self.num_heads
        rope_rows = deinterleave_order(m.qk_rope_head_dim) if m.rope_interleave else None

        def q_rows(w: torch.Tensor) -> torch.Tensor:  # each head's rope rows to rotate-half order
            if rope_rows is None:
                return w
            w = w.view(heads, m.qk_head_dim, -1).clone()
            w[:, m.qk_nope_head_dim:] = w[:, m.qk_nope_head_dim:][:, rope_rows]
            return w.view(heads * m.qk_head_dim, -1)
        own = {}
        if m.q_lora_rank:
            own["q_a_proj.weight"] = take(prefix + "q_a_proj.weight")
            own["q_a_layernorm.weight"] = take(prefix + "q_a_layernorm.weight")
            own["q_b_proj.weight"] = q_rows(take(prefix + "q_b_proj.weight"))
        else:
            own["q_proj.weight"] = q_rows(take(prefix + "q_proj.weight"))
        kv_a = take(prefix + "kv_a_proj_with_mqa.weight")
        if rope_rows is not None:
            kv_a = torch.cat((kv_a[:m.kv_lora_rank], kv_a[m.kv_lora_rank:][rope_rows]))
        own["kv_a_proj.weight"] = kv_a
        own["kv_a_layernorm.weight"] = take(prefix + "kv_a_layernorm.weight")
        kv_b = take(prefix + "kv_b_proj.weight").view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        own["w_uk"] = kv_b[:, :m.qk_nope_head_dim].contiguous()
        own["w_uv"] = kv_b[:, m.qk_nope_head_dim:].contiguous()
        own["o_proj.weight"] = take(prefix + "o_proj.weight")
        return own
