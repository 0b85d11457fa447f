"""Prompt-lookup (n-gram) drafting for exact speculative decoding (torch-free).

Agentic answers quote their context: file paths, code, tool output. So the tokens that
followed the latest earlier occurrence of a sequence's last n tokens (prompt and output
alike) are a good guess at what comes next. The engine runs the guesses ("drafts") through
the model in one step with the sequence's real last token, samples every position as it
would have without speculation, and keeps the drafts up to the first that differs from
what was sampled, plus that sampled token. Sampling depends only on the logits, the seed
and the position (ember.engine.sampler), and on the batch-invariant path the logits of a
position are the same bits in a verify step as in a plain decode step, so the output is
token for token the one without speculation, greedy or seeded (a seeded draft is accepted
exactly when the target's own draw equals it: the draw's distribution is untouched).
"""
from __future__ import annotations


class NgramIndex:
    """One sequence's n-grams (n in [ngram_min, ngram_max]) by the position of their last token,
    the latest occurrence kept; built incrementally as the sequence grows (tokens are only appended)."""

    def __init__(self, ngram_min: int, ngram_max: int):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the latest earlier occurrence of the longest
        suffix of `tokens` (at least ngram_min long) seen before; [] when there is none."""
        if max_drafts <= 0:
            return []
        last = len(tokens) - 1
        for end in range(self.indexed, last):  # the suffix itself (ending at `last`) is never a match
            for n in range(self.ngram_min, min(self.ngram_max, end + 1) + 1):
                self.ends[tuple(tokens[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + max_drafts]
        return []


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts stand: the leading ones equal to the token sampled at their position
    (`sampled` has one more entry than `drafts`: the token after the last draft)."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return n
