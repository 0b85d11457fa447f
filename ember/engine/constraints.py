"""Grammar-constrained decoding with llguidance (torch-free).

A request's `Constraint` (ember.engine.sampling_params) becomes an llguidance grammar
(`grammar_of`); `Grammars` compiles each distinct one once per engine (a pristine matcher per
constraint, LRU-cached, deep-copied per request: a cached request costs a copy, not a compile)
and hands every request its own matcher, which the engine advances token by token and asks for
the next token mask (`fill_mask`) every step. The sampler applies the masks of the constrained
rows of a batch together (ember.engine.sampler.apply_masks); the other rows are untouched.

Why llguidance, not xgrammar (`python -m ember.bench.grammar_libs`, BENCHMARKS.md): it compiles
a schema 5-10x faster (< 1.5 ms, on the request's critical path); xgrammar fills a structured
mask 4-6x faster, but that is ~10 us a row, under 1% of a decode step. And llguidance needs
neither transformers nor torch at run time, takes the tokenizer's special tokens from
tokenizer.json as they are, allows only the canonical tokenization of forced text, and its Lark
grammars embed JSON schemas (the tool-call grammar, services/router/tools.py).

JSON output is pinned to one layout (`JSON_OPTIONS`: no free whitespace, ", " and ": " as
`json.dumps` writes them): a small model at temperature 1 otherwise wanders into whitespace
that never ends. A router validates a constraint before placing the request (`check`, off its
event loop) and the engine compiles it and computes its first mask when the request arrives, so
a bad grammar is INVALID_ARGUMENT before any work; one that fails only later (a lexer budget
exceeded mid-answer, `LIMITS`) ends its request with INVALID_ARGUMENT too, never with a token
outside it.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from ember.engine.sampling_params import Constraint
from ember.errors import InvalidRequestError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled constraints kept per engine
# llguidance's lexer budgets, a fifth of its defaults: a pathological grammar (a regex like
# (a{1000}){1000}) costs at most ~0.1 s of the engine's step before it fails, not ~1.3 s; real
# schemas (a 2,000-property object, the tool grammars) stay far inside them.
LIMITS = {"initial_lexer_fuel": 200_000, "step_lexer_fuel": 50_000, "max_lexer_states": 50_000}


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON form) for `constraint`; InvalidRequestError for a spec
    that is not even well-formed (a schema that is not a JSON object)."""
    kind, spec = constraint.kind, constraint.spec
    if kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(spec) if kind == "json_schema" else {"type": "object"}
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be a JSON object (or true/false)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema was refused: {e}") from e
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    return llguidance.LLMatcher.grammar_from_lark(spec)


def check(constraint: Constraint) -> None:
    """InvalidRequestError naming the problem when `constraint` cannot be compiled (no tokenizer
    needed: what a router can check before any work is placed)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_of(constraint))
    if error:
        raise InvalidRequestError(f"the {constraint.kind.replace('_', ' ')} constraint is invalid: {error}")


class Grammars:
    """Compiled constraints of one engine, and a fresh matcher per request."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int, cache_size: int = CACHE_SIZE):
        self._source = (tokenizer_json, vocab_size, eos_token_id)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self.cache_size = cache_size
        self.compiles = self.hits = 0

    def prepare(self) -> None:
        """Build the tokenizer on a thread now (~0.3 s for a 49k vocabulary), off the start-up path
        and before the first constrained request needs it."""
        self._building = threading.Thread(target=lambda: self.tokenizer, name="grammar-tokenizer", daemon=True)
        self._building.start()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (or by `prepare`), then shared by every grammar."""
        with self._lock:
            if self._tokenizer is None:
                text, vocab_size, eos = self._source
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        return self._tokenizer

    def matcher(self, constraint: Constraint, output_prefix: list[int] = ()) -> llguidance.LLMatcher:
        """A matcher for a new request, advanced over `output_prefix` (tokens generated elsewhere:
        the prefill's first token, or all a failed decode worker streamed), its next mask computed;
        InvalidRequestError when the constraint does not compile, the prefix does not follow it, or
        that mask fails (a lexer budget, `LIMITS`)."""
        template = self._compiled.get(constraint)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, grammar_of(constraint), log_level=0,
                                            limits=llguidance.LLParserLimits(**LIMITS))
            if template.is_error():
                raise InvalidRequestError(f"the {constraint.kind.replace('_', ' ')} constraint is invalid: "
                                          f"{template.get_error()}")
            self.compiles += 1
            self._compiled[constraint] = template
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self.hits += 1
            self._compiled.move_to_end(constraint)
        matcher = template.deep_copy()
        if output_prefix and not matcher.consume_tokens(list(output_prefix)):
            raise InvalidRequestError("the tokens already generated (output_prefix) do not follow the request's "
                                      f"constraint: {matcher.get_error()}")
        matcher.compute_bitmask()  # its next mask, now: a grammar that cannot even start fails here
        if matcher.is_error():
            raise InvalidRequestError(f"the {constraint.kind.replace('_', ' ')} constraint is invalid: "
                                      f"{matcher.get_error()}")
        return matcher


def fill_mask(matcher: llguidance.LLMatcher, row) -> None:
    """Write `matcher`'s allowed next tokens as a bitmask into `row`, a contiguous int32 tensor of
    ceil(vocab / 32) words (bit i of word w: token 32 w + i)."""
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
