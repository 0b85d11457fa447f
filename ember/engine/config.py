"""Engine settings, defined once: the cluster YAML's `engine:` section, the `ember` CLI flags and
the in-process `EngineConfig` all take these fields, names and defaults.

`EngineConfig` is the settings plus the model to serve; "auto" values are resolved against the
model file when it is built (ember.model.files.resolve_serving).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from ember.config.section import Section
from ember.model.fetch import DEFAULT_MODEL_PATH
from ember.model.files import check_pair, int4_folder, resolve_serving


class EngineSettings(Section):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the engine runs; auto: CUDA when torch sees a GPU and the weights are dense "
                            "(Triton decode attention), else CPU: q4 runs on CPU int4 kernels (ember.engine.device)")
    attention_backend: Literal["auto", "torch", "cpp", "triton"] = Field(
        "auto", description="attention kernels; auto: triton on CUDA, the batch-invariant C++ kernel for bf16 "
                            "on CPU, torch for fp32 on CPU; triton on CPU needs TRITON_INTERPRET=1 (slow)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="activations and KV; auto: bfloat16 for q4 weights, else the checkpoint's "
                            "(float32 for a GGUF)")
    weights: Literal["auto", "dense", "q4"] = Field(
        "auto", description="auto: a Q4_1 GGUF serves its own codes on int4 kernels (q4); dense "
                            "dequantizes (with dtype float32: the exact path, token-equal to transformers)")
    block_size: int = Field(16, gt=0, description="tokens per KV block (a power of two); part of every block hash")
    kv_cache_mb: int | None = Field(None, gt=0, description="KV pool size in MiB; unset: what is left of the "
                                                             "engine's memory_utilization once its model is loaded")
    memory_utilization: float | None = Field(None, gt=0, le=0.95, description="share of the device's memory the "
                                             "engine may hold in all (weights, workspace, runtime, KV pool): the KV "
                                             "pool gets what is left of it after the model loads; unset: 0.9 of a "
                                             "GPU's, 0.1 of a CPU host's (shared with the other services there)")
    max_num_seqs: int = Field(64, gt=0, description="sequences in one batch")
    max_num_batched_tokens: int = Field(1024, gt=0, description="tokens per step; bounds a prefill chunk")
    max_model_len: int | None = Field(None, gt=0, description="longest prompt + output; unset: the model's "
                                                              "context length")
    threads: int = Field(0, ge=0, description="torch threads of the engine process; 0: one per core of its "
                                              "CPU set (cpus), else of the host")
    cpus: str | None = Field(None, description="CPUs the engine process is pinned to ('0', '2-3', '0,2'); "
                                               "auto: the engines sharing a host split its cores into disjoint "
                                               "sets (a cluster config; ember.util.cpus); unset: not pinned")
    speculative_tokens: int | None = Field(None, ge=0, description="prompt-lookup drafts verified per decode "
                                           "step (exact: tokens unchanged); 0: off; unset: 3 on the "
                                           "batch-invariant bf16 path, off on fp32 (its kernels are not)")
    speculative_max_batch: int = Field(4, gt=0, description="speculate only while at most this many sequences "
                                                            "decode: in bigger steps each draft costs about "
                                                            "what a token does")
    speculative_ngram_max: int = Field(4, gt=0, description="longest suffix (tokens) looked up in the context "
                                                            "to draft from")
    speculative_ngram_min: int = Field(2, gt=0, description="shortest suffix looked up")
    jump_forward: bool = Field(True, description="a grammar-constrained request's forced tokens (the only ones its "
                                                 "grammar allows next) are appended at once and computed in the "
                                                 "next step, not one step each (exact: tokens unchanged)")
    hybrid_kv: bool = Field(True, description="a model with chunked-attention layers (Llama 4) keeps, in those "
                                              "layers, only the KV blocks of each sequence's current chunk "
                                              "(ember.engine.block_manager: KV groups); off: every layer keeps every "
                                              "block. Only where one process holds the whole cache (no TP/PP/EP)")
    tensor_parallel: int = Field(1, ge=1, description="ranks (processes) each layer is split over, Megatron style "
                                                      "(ember.parallel); KV blocks stay whole-model")
    pipeline_parallel: int = Field(1, ge=1, description="stages the layers are split into, balanced by a measured "
                                                        "cost profile (ember.parallel); each stage is "
                                                        "tensor_parallel ranks (processes)")
    expert_parallel: int = Field(1, ge=1, description="ranks (processes) a mixture-of-experts model's routed "
                                                      "experts are split over, attention replicated "
                                                      "(ember.parallel.expert_parallel); tokens equal EP = 1's. "
                                                      "Equal to tensor_parallel: whole experts over its ranks")
    pipeline_partition: list[int] | None = Field(None, description="layers per stage (forces the split); unset: "
                                                                   "from the measured cost profile")
    pipeline_microbatches: int = Field(0, ge=0, description="micro-batches of disjoint sequences a step is split "
                                                            "into across the stages; 0: one per stage")
    enforce_eager: bool = Field(False, description="run every step op by op instead of the captured step "
                                                   "(same tokens: for debugging and comparison)")
    capture_sizes: list[int] = Field([1, 2, 4, 8, 16, 32, 64], min_length=1,
                                     description="batch-size buckets (tokens per step) of the captured decode step; "
                                                 "bigger steps (prefill chunks) run op by op")
    max_waiting_requests: int = Field(256, gt=0, description="requests queued (not yet running) at most; past "
                                                             "it: RESOURCE_EXHAUSTED")
    max_waiting_tokens: int = Field(262144, gt=0, description="prompt tokens queued at most; past it: "
                                                              "RESOURCE_EXHAUSTED")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, v: str | None) -> str | None:
        if v is not None and v != "auto":
            from ember.util.cpus import format_cpus, parse_cpus
            return format_cpus(parse_cpus(v))
        return v

    @field_validator("capture_sizes")
    @classmethod
    def _positive_sizes(cls, v: list[int]) -> list[int]:
        if any(size <= 0 for size in v):
            raise ValueError(f"capture_sizes must be positive, got {v}")
        return sorted(set(v))

    @model_validator(mode="after")
    def _pair(self):
        check_pair(self.dtype, self.weights)
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(f"speculative_ngram_min ({self.speculative_ngram_min}) must not exceed "
                             f"speculative_ngram_max ({self.speculative_ngram_max})")
        return self


class EngineConfig(EngineSettings):
    """What one engine runs: the settings, the model, and test-only knobs. Immutable."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = str(DEFAULT_MODEL_PATH)
    num_kv_blocks: int | None = Field(None, gt=0)  # overrides the pool size (tests)
    optimize: bool = True  # swap in the fastest available kernels (ember.kernels)
    # the step policy's objectives (ember.engine.step_policy); a cluster's engines take router.slo
    slo_ttft_s: float = Field(1.0, gt=0)
    slo_tpot_s: float = Field(0.25, gt=0)

    @model_validator(mode="after")
    def _resolve_auto(self):
        from ember.engine.device import attention_backend, resolve_device  # (torch: only engines build this)
        # the weights and dtype resolve as everywhere else (ember.config.derived.model_facts, which the
        # router hashes blocks with): the device follows them, never the other way round
        _, resolved_weights = resolve_serving(self.model, self.dtype, self.weights)
        # a GGUF's Q4_1 kernels are CPU code; a checkpoint's int4 experts also run on CUDA (Triton)
        if resolved_weights == "q4" and not int4_folder(Path(self.model)):
            if self.device == "cuda":
                raise ValueError("weights 'q4' (the default for a Q4_1 GGUF) runs on CPU int4 kernels: on CUDA set "
                                 "weights: dense (dtype: bfloat16 for speed), or device: cpu")
            device = resolve_device("cpu")
        else:
            device = resolve_device(self.device)
        object.__setattr__(self, "device", device.type)
        dtype, weights = resolve_serving(self.model, self.dtype, self.weights)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "attention_backend", attention_backend(self.attention_backend, device, dtype))
        return self

    def pinned_cpus(self) -> list[int] | None:
        """The CPU set this engine runs on, or None (not pinned; "auto" is resolved by the cluster config)."""
        if self.cpus is None or self.cpus == "auto":
            return None
        from ember.util.cpus import parse_cpus
        return parse_cpus(self.cpus)

    def torch_threads(self) -> int:
        return self.threads or len(self.pinned_cpus() or ()) or os.cpu_count() or 1

    def pool_bytes(self, pending_bytes: int = 0) -> int:
        """The KV pool's size: kv_cache_mb, else what is left of the engine's memory budget
        (memory_utilization of the device's memory) after what it holds now (its model loaded) and
        `pending_bytes` it will come to hold (mapped weights not yet read)."""
        if self.kv_cache_mb is not None:
            return self.kv_cache_mb * 2**20
        import torch

        from ember.engine.device import memory_in_use, total_memory
        device = torch.device(self.device)
        share = self.memory_utilization or (0.9 if device.type == "cuda" else 0.1)
        budget, held = int(total_memory(device) * share), memory_in_use(device) + pending_bytes
        if budget - held < 2**20:
            raise ValueError(f"memory_utilization {share} ({budget / 2**20:.0f} MiB of the {device.type} memory) "
                             f"leaves no room for a KV pool: the engine already holds {held / 2**20:.0f} MiB; "
                             "raise memory_utilization or set kv_cache_mb")
        return budget - held
