"""Where an engine runs, decided in one place: its torch device, each parallel rank's device, the
collective backend, the attention kernels and the memory its KV pool is sized from.

- CPU: the C++ kernels (ember.kernels) on the bf16 path, torch on the fp32 reference path; gloo.
- CUDA: dense weights (q4's int4 kernels are CPU code), the Triton paged decode-attention kernel
  (ember.kernels.triton_paged_attention) for decode steps, torch SDPA (flash) for prefill; NCCL when
  every rank has a GPU of its own, else gloo with the ranks sharing device 0 (collectives staged
  through host memory: gloo's CUDA support stops at broadcast and all-reduce).
- `attention_backend: triton` on CPU runs the Triton kernel under its interpreter
  (TRITON_INTERPRET=1, set before Triton is imported): how CI checks the GPU path's kernel wiring.
"""
from __future__ import annotations

import os

import torch


def resolve_device(setting: str) -> torch.device:
    """The engine's device for `engine.device` (auto: CUDA when torch sees a GPU)."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but torch sees no CUDA GPU (torch.cuda.is_available() is False): "
                         "set device: cpu, or auto")
    return torch.device(setting)


def rank_device(device: torch.device, rank: int, world: int) -> torch.device:
    """Rank `rank`'s device: its own GPU when there are enough, else GPU 0 shared (gloo)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank if torch.cuda.device_count() >= world else 0)


def collective_backend(device: torch.device, world: int) -> str:
    """nccl when every rank has its own GPU, else gloo."""
    return "nccl" if device.type == "cuda" and torch.cuda.device_count() >= world else "gloo"


def attention_backend(setting: str, device: torch.device, dtype: str) -> str:
    """'triton', 'cpp' (the batch-invariant C++ kernel, bf16 on CPU) or 'torch' (fp32 reference, SDPA)."""
    if setting == "auto":
        if device.type == "cuda":
            return "triton"
        return "torch" if dtype == "float32" else "cpp"
    if setting == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend 'triton' on CPU runs under Triton's interpreter: set "
                         "TRITON_INTERPRET=1 in the environment (slow; for checking the GPU path)")
    if setting == "cpp" and (device.type != "cpu" or dtype == "float32"):
        raise ValueError("attention_backend 'cpp' is the batch-invariant bf16 CPU kernel: use it with "
                         "device cpu and dtype bfloat16")
    return setting


def total_memory(device: torch.device) -> int:
    """The device's memory in bytes (the host's for CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    import psutil
    return psutil.virtual_memory().total


def memory_in_use(device: torch.device) -> int:
    """Bytes in use: on a GPU, all of it that is not free (this engine's and any other's: a pool
    sized against it never oversubscribes the card); on CPU, this process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    import psutil
    return psutil.Process().memory_info().rss


def host_staged(t: torch.Tensor) -> bool:
    """A collective on `t` must go through host memory (a CUDA tensor in a gloo group)."""
    import torch.distributed as dist
    return t.is_cuda and dist.get_backend() == "gloo"
