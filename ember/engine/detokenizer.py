"""Incremental detokenization with stop strings (torch-free)."""
from __future__ import annotations

from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import Sequence


def update_text(seq: Sequence, decode, final: bool) -> tuple[str, bool]:
    """Refresh seq.output_text; return (text newly safe to emit, whether a stop string hit).

    Text is held back while it could still be the start of a stop string or ends in an
    incomplete UTF-8 character, so a client never sees text that is later retracted.
    """
    text = decode(seq.output_token_ids)
    stop_hit = False
    for stop in seq.params.stop:
        idx = text.find(stop, max(0, seq.num_text_emitted - len(stop)))
        if idx != -1:
            text, stop_hit = text[:idx], True
    seq.output_text = text
    safe_len = len(text)
    if not stop_hit and not final:
        if text.endswith("\ufffd"):
            safe_len = len(text.rstrip("\ufffd"))
        holdback = max((len(s) - 1 for s in seq.params.stop), default=0)
        safe_len = max(seq.num_text_emitted, min(safe_len, len(text) - holdback))
    new_text = text[seq.num_text_emitted:safe_len]
    seq.num_text_emitted = max(seq.num_text_emitted, safe_len)
    return new_text, stop_hit


def streamed_text(output_token_ids: list[int], params: SamplingParams, decode) -> str:
    """The text a stream of these output tokens has sent while not yet finished.

    A prefill server that hands decoding on sends exactly this with the first token; the
    decode server's engine recomputes it (add_request's output_prefix) and continues, so
    the joined stream equals a colocated one, multi-byte characters and stop strings included.
    """
    seq = Sequence("", list(output_token_ids), 0, params, seed=0)
    return update_text(seq, decode, final=False)[0]
