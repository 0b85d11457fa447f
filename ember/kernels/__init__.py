"""Kernel choices, made in one place: `optimize(model)` swaps in the fastest available ops."""
from __future__ import annotations

import torch

from ember.kernels import cpu_norm
from ember.kernels.cpu_int4 import Int4Linear
from ember.kernels.cpu_linear import pack_linears


def optimize(model) -> list[str]:
    """Apply every available speed-up to `model` in place; returns what is in use."""
    applied = []
    if pack_linears(model):
        applied.append("onednn-packed-linear")
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]  # the loader put them in (weights="q4")
    if int4:
        applied.append("int4-batch-invariant")
    if any(m.native is not None for m in int4):
        applied.append("cpp-int4-linear")
    norms = [m for m in model.modules() if hasattr(m, "kernel") and isinstance(getattr(m, "weight", None), torch.Tensor)
             and cpu_norm.fits(m.weight)]  # the bf16 RMSNorms (the fp32 path keeps F.rms_norm: = transformers)
    for m in norms:
        m.kernel = cpu_norm.rms_norm
    if norms:
        applied.append("cpp-rms-norm")
    return applied
