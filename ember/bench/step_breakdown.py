"""Where a batch-1 decode step of the shipped default engine spends its time, against the limit
set by reading its weights once at the machine's memory bandwidth.

The engine runs plain decode (no speculation) on a ~600-token context; each step is timed whole.
Op by op (enforce_eager), the int4 linears of the decoder layers, the output layer (int4 nominate +
exact re-score) and attention (30 layers, cache writes included) are timed by wrapping those calls
(perf_counter, ~0.1 us each); "the rest" is the difference: norms, RoPE, residuals, the embedding,
building the step's tensors, sampling and scheduling, and every op's dispatch. Captured (the
default), the 30 layers are one call ("layers": the same linears and attention, plus the
elementwise ops, with no dispatch between them), and the rest is the step's tensors, the embedding,
the final norm, sampling and scheduling.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

READ_GBPS = 55.0  # both cores reading (../shared/FACTS.md: ~52-59 GB/s)


@contextmanager
def _timed(owner, name: str, totals: dict, key, *, instance: bool = False):
    """Add the time of every call of owner.name to totals[key(args)] (key: a name, or a function of
    the call's arguments giving one, or None for calls not to count)."""
    original = getattr(owner, name)
    pick = key if callable(key) else (lambda *_: key)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            which = pick(*args)
            if which is not None:
                totals[which] += time.perf_counter() - start
    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        if instance:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def weight_bytes(model) -> int:
    """Bytes a batch-1 step reads from the weights: every int4 layer's packed codes and scales (the
    output layer's int4 copy included; its exact re-score reads 64 rows) and the norms."""
    from ember.kernels.cpu_int4 import Int4Linear, Int4Logits
    total = sum(m.weight_bytes for m in model.modules() if isinstance(m, (Int4Linear, Int4Logits)))
    total += sum(p.numel() * p.element_size() for p in model.parameters() if p.ndim == 1)
    return total


def breakdown(settings, prompt: str, steps: int = 40, eager: bool = False) -> dict:
    """settings: an EngineConfig (the shipped decode engine's). Medians over `steps` steps, in ms.
    eager: op by op (the parts timed one by one), else the captured step."""
    from ember.engine.attention import PagedAttention
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    from ember.kernels import cpu_int4, cpu_step
    engine = LLMEngine(settings.model_copy(update={"speculative_tokens": 0, "enforce_eager": eager}))
    model = engine.loaded.model
    ids = engine.tokenizer.encode(prompt)
    engine.add_request(ids, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while not any(s.num_output_tokens for s in engine.seqs.values()):
        engine.step()  # the prefill
    for _ in range(4):
        engine.step()  # warm
    rows = []
    totals = {"linears": 0.0, "output_layer": 0.0, "attention": 0.0} if eager else {"layers": 0.0, "output_layer": 0.0}
    layer_key = lambda x, layer: "linears" if isinstance(layer, cpu_int4.Int4Linear) else None  # noqa: E731
    with _timed(cpu_int4, "_int4_mm", totals, layer_key), \
            _timed(PagedAttention, "__call__", totals, "attention"), \
            _timed(cpu_step.CapturedStep, "__call__", totals, "layers"), \
            _timed(model, "compute_logits", totals, "output_layer", instance=True):
        for _ in range(steps):
            before = dict(totals)
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            part = {k: totals[k] - before[k] for k in totals}
            rows.append({"step": step, **part, "rest": step - sum(part.values())})
    median = {k: round(1000 * statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    limit_ms = weight_bytes(model) / (READ_GBPS * 1e9) * 1000
    return {"mode": "eager" if eager else "captured", "context_tokens": len(ids), "steps": steps, "median_ms": median,
            "weight_bytes": weight_bytes(model), "limit_ms": round(limit_ms, 3),
            "step_over_limit": round(median["step"] / limit_ms, 2),
            "decode_tok_per_s": round(1000 / median["step"], 1), "kernels": engine.kernels}
