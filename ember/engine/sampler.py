"""Token sampling: greedy, temperature, top-k, top-p, reproducible per request; the logit
processors before it (logit bias, presence/frequency penalties, grammar masks) and logprobs.

A sampled token depends only on the logits, the request's params and seed, and the
token's position: its random draw comes from a generator seeded with (seed, position).
So a request gives the same tokens however it was batched, preempted or split between
a prefill and a decode server.
"""
from __future__ import annotations

import numpy as np
import torch

from ember.engine.outputs import TokenLogprob
from ember.engine.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant to spread (seed, position) pairs


def position_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position) % (2**63 - 1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] fp32 -> logits with excluded tokens at -inf."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the tokens ranked above it already cover top_p
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """logits: [B, V] fp32; returns one token id per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        row_logits = apply_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = row_logits.softmax(-1)
        gen = torch.Generator().manual_seed(position_seed(seeds[row], positions[row]))
        # argmax(p / Exp(1)) draws from p (exponential race) with one generator call
        noise = torch.empty_like(probs).exponential_(generator=gen)
        tokens[row] = int((probs / noise).argmax())
    return tokens


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """OpenAI's logit_bias, presence and frequency penalties (over each row's output tokens so far),
    applied in place to the rows that ask for them; the others are untouched."""
    for row, (p, output) in enumerate(zip(params, outputs)):
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias)
            ids_t = torch.tensor(ids)
            keep = ids_t < logits.shape[1]
            logits[row, ids_t[keep]] += torch.tensor(biases, dtype=logits.dtype)[keep]
        if p.penalized and output:
            counts = torch.bincount(torch.tensor(output), minlength=logits.shape[1])[:logits.shape[1]]
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


# What a grammar-forbidden token's logit becomes: far below any real logit, yet finite, so the
# mask is one add (masked_fill over a [16, 49152] batch costs ~7x more on CPU) and no softmax
# ever sees inf - inf. The mask math runs in numpy, on one thread: each parallel torch op wakes
# the OpenMP pool, which under OMP_WAIT_POLICY=PASSIVE (ember/__init__.py) costs ~0.1 ms.
MASKED = np.float32(-1e30)


def apply_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Tokens a row's grammar forbids drop to MASKED: `bitmask` [len(rows), ceil(V / 32)] int32 (bit i
    of word w allows token 32 w + i), one mask row per entry of `rows`; `logits` a contiguous fp32
    CPU tensor, changed in place."""
    vocab = logits.shape[1]
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    penalty = np.subtract(allowed, 1, dtype=np.float32)
    penalty *= -MASKED
    values = logits.numpy()
    if rows == list(range(rows[0], rows[0] + len(rows))):  # (the common case)
        values[rows[0]:rows[0] + len(rows)] += penalty
    else:
        values[rows] += penalty


def token_logprobs(raw: torch.Tensor, row: int, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability under the model (`raw`: the unprocessed logits) and the
    `top` most likely tokens."""
    logprobs = raw[row].log_softmax(-1)
    top_ids, top_lps = ([], [])
    if top:
        values, ids = logprobs.topk(top)
        top_ids, top_lps = ids.tolist(), values.tolist()
    return TokenLogprob(token, float(logprobs[token]), top_ids, top_lps)
