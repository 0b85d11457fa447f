"""Engine configuration: one frozen dataclass, validated when built."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ember.model.fetch import DEFAULT_MODEL_PATH
from ember.model.files import check_weights


@dataclass(frozen=True)
class EngineConfig:
    model: str = str(DEFAULT_MODEL_PATH)
    dtype: str = "float32"  # serving dtype of weights, activations and KV
    # "dense": weights in `dtype`; "q4": a GGUF's Q4_1 codes served by int4 kernels (needs bfloat16)
    weights: str = "dense"
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes when set
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024  # per-step budget; bounds a prefill chunk
    max_model_len: int | None = None  # default: the model's context length
    num_threads: int = 0  # torch intra-op threads; 0 = one per core
    optimize: bool = True  # swap in the fastest available kernels (ember.kernels)

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        check_weights(self.model, self.dtype, self.weights)
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")

    @property
    def threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1
