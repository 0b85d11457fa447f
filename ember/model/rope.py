"""Rotary position tables: the default rope, yarn (DeepSeek-V3 / Kimi K2.5's long context) and
llama3 (Llama 4), computed as transformers computes them (tests hold the two to the same tokens)."""
from __future__ import annotations

import math

import torch

from ember.model.args import RopeScaling, yarn_mscale


def inv_frequencies(dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2], the factor cos and sin are scaled by)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    s = scaling
    if s.kind == "llama3":
        return _llama3_frequencies(1.0 / pos_freqs, s), 1.0
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = (yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
                            if s.mscale and s.mscale_all_dim else yarn_mscale(s.factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 for high frequencies (kept), 0 for low ones (interpolated)
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def _llama3_frequencies(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 / Llama 4: long wavelengths divided by `factor`, short ones kept, the band between
    smoothed (transformers' _compute_llama3_parameters, op for op; with low_freq_factor ==
    high_freq_factor, as Llama 4 Scout sets, the band is empty: its inf/nan is never chosen)."""
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(head_dim: int, theta: float, max_position: int,
                 scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_position, head_dim] in fp32 (rotate-half layout)."""
    inv_freq, factor = inv_frequencies(head_dim, theta, scaling)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope over interleaved pairs (x0, x1), (x2, x3), ... as complex numbers, Llama 4's form (its
    apply_rotary_emb: x viewed complex, times cos + i sin): x [T, H, D]; cos, sin the rotate-half
    tables [T, D] (their first half holds each pair's angle). Returns fp32."""
    half = x.shape[-1] // 2
    angles = torch.complex(cos[:, :half].float(), sin[:, :half].float())[:, None, :]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], half, 2))
    return torch.view_as_real(pairs * angles).flatten(-2)


def deinterleave_order(dim: int) -> torch.Tensor:
    """The permutation taking interleaved rope pairs (x0, x1), (x2, x3), ... to the rotate-half layout
    (x0, x2, ..., x1, x3, ...): applied to a projection's output rows, the interleaved rope becomes
    `apply_rope` (transformers' apply_rotary_pos_emb_interleave computes exactly this)."""
    return torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))
