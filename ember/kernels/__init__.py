"""Kernel choices, made in one place: `optimize(model)` swaps in the fastest available ops."""
from __future__ import annotations

from ember.kernels.cpu_linear import pack_linears


def optimize(model) -> list[str]:
    """Apply every available speed-up to `model` in place; returns what was applied."""
    applied = []
    if pack_linears(model):
        applied.append("onednn-packed-linear")
    return applied
