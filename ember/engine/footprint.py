"""An engine's memory by part, for `ember status` and /metrics (ember.util.memory does the measuring).

The engine names its tensors' memory: the model's (parameters, buffers and what the kernels hold
beside them: int4 packs, oneDNN-packed weights, rope tables), the KV pool, and the step's
workspace (the captured step's static buffers and its plan). Ranks of a parallel engine are
processes of their own: this reports the driver's.
"""
from __future__ import annotations

import torch

from ember.util import memory


def _tensors_of(value, depth: int = 0):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)) and depth < 2:
        for v in value:
            yield from _tensors_of(v, depth + 1)
    elif depth < 1 and hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
        for v in vars(value).values():  # a kernel's pack (ember.kernels.cpu_q4.Q4Pack and the like)
            yield from _tensors_of(v, depth + 1)


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for module in model.modules():
        out.extend(module.parameters(recurse=False))
        out.extend(module.buffers(recurse=False))
        for name, value in vars(module).items():
            if not name.startswith("_"):
                out.extend(_tensors_of(value))
    return out


def weights_not_resident(model: torch.nn.Module) -> int:
    """Bytes of the model's host-memory weights not resident yet (mapped files are read as they are
    first used): what its resident size will grow by once it has served."""
    ranges = memory.tensor_ranges(t for t in model_tensors(model) if t.device.type == "cpu")
    seen: set[int] = set()
    return sum(nbytes - memory.resident_bytes(address, nbytes) for address, nbytes in ranges
               if address > 0 and not (address in seen or seen.add(address)))


def tracked_ranges(engine) -> dict[str, list[tuple[int, int]]]:
    """{part: [(address, nbytes), ...]} of the engine's own tensors in this process."""
    tracked: dict[str, list[tuple[int, int]]] = {"weights": [], "kv_pool": [], "workspace": []}
    runner = engine.runner
    model = getattr(runner, "model", None)
    if model is not None:
        tracked["weights"] = memory.tensor_ranges(t for t in model_tensors(model) if t.device.type == "cpu")
    if engine.cache.kv.device.type == "cpu":
        tracked["kv_pool"] = memory.tensor_ranges([engine.cache.kv])
    captured = getattr(runner, "captured", None)
    if captured is not None:
        tracked["workspace"] = memory.tensor_ranges([*captured.workspaces.values(), captured.plan])
    return tracked


def engine_memory(engine) -> dict[str, int]:
    """This process's resident memory split into parts (ember.util.memory.report)."""
    return memory.report(tracked_ranges(engine))
