"""Engine configuration: one frozen dataclass, validated (and its "auto" values resolved) when built."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ember.model.fetch import DEFAULT_MODEL_PATH
from ember.model.files import resolve_serving


@dataclass(frozen=True)
class EngineConfig:
    model: str = str(DEFAULT_MODEL_PATH)
    # Serving dtype of activations and KV, and how weights are served: "auto" takes the file's
    # default (a Q4_1 GGUF: its codes on int4 kernels, bf16; see ember.model.files.resolve_serving).
    # weights="dense", dtype="float32" is the exact path, token-equal to transformers.
    dtype: str = "auto"
    weights: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None  # default: kv_cache_memory_fraction of the memory available at start
    kv_cache_memory_fraction: float = 0.1  # like vLLM's gpu_memory_utilization, for the KV pool alone
    num_kv_blocks: int | None = None  # overrides both when set
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
        if not 0 < self.kv_cache_memory_fraction <= 0.9:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 0.9], got {self.kv_cache_memory_fraction}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        dtype, weights = resolve_serving(self.model, self.dtype, self.weights)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "weights", weights)
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")

    @property
    def threads(self) -> int:
        return self.num_threads or os.cpu_count() or 1

    def pool_bytes(self) -> int:
        """The KV pool's size: kv_cache_bytes, else the fraction of memory available now."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        import psutil
        return int(psutil.virtual_memory().available * self.kv_cache_memory_fraction)
