"""llguidance vs xgrammar on CPU: JSON-schema constrained decoding with the project's tokenizer.

Run: `python -m ember.bench.grammar_libs [--reps N] [--json PATH]`. A library that is not
installed is skipped with the reason printed. Per library and schema it measures:

- tokenizer preprocessing, once (llguidance: LLTokenizer from the tokenizer.json text; xgrammar:
  the vocabulary list + TokenizerInfo + GrammarCompiler);
- schema compile, cold (xgrammar's cache cleared each time; llguidance has none), and what a
  second request for the same schema costs (llguidance: deep_copy of a template matcher;
  xgrammar: a compiler-cache hit + a new GrammarMatcher);
- the token-mask fill along a fixed valid document (tok.encode of a valid instance, then EOS):
  the whole first pass on a freshly compiled grammar, then warm passes (median / p90 per step),
  and 16 matchers in lockstep filling 16 rows of one bitmask, row by row and with the library's
  parallel batch API (total per step). llguidance builds its lexer lazily, and deep copies share
  what it built, so its first pass is the slow one; xgrammar does that work in the compile.

A sanity check compares the two libraries' masks at every step of each document (first passes).
Note that `import xgrammar` imports transformers (and torch), whichever tokenizer path is used.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from importlib.metadata import version

from ember.bench.measure import median_time, progress

N_VOCAB = 49152  # the model's logits width (SmolLM2-135M)
EOS = 2          # <|im_end|>
BATCH = 16

SCHEMAS = {
    "small_tool_args": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False,
    },
    "medium_nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "active": {"type": "boolean"},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "address": {"type": "object", "additionalProperties": False, "required": ["street", "city"],
                        "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                       "zip": {"type": "string"}}},
            "orders": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                               "price": {"type": "number"}}}},
            "status": {"enum": ["new", "active", "suspended"]},
            "notes": {"type": ["string", "null"]},
            "created": {"type": "string"},
        },
        "required": ["id", "name", "active", "score", "tags", "address", "orders", "status"],
        "additionalProperties": False,
    },
    "json_object": {"type": "object"},
}
_MEDIUM_DOC = {  # properties in schema order (xgrammar's default is declared order); "created" left out
    "id": 4821, "name": "Ada Lovelace", "active": True, "score": 97.25,
    "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "orders": [{"sku": "AE-001", "qty": 2, "price": 19.99}, {"sku": "NB-17", "qty": 1}],
    "status": "active", "notes": None,
}
DOCS = {"small_tool_args": {"city": "San Francisco", "unit": "fahrenheit"},
        "medium_nested": _MEDIUM_DOC, "json_object": _MEDIUM_DOC}


def load_tokenizer():
    """The default model's tokenizer, fetching and converting the model on first use."""
    from ember.model.fetch import DEFAULT_MODEL_PATH, fetch_default_model
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    folder = model_folder(DEFAULT_MODEL_PATH)
    if not (folder / "tokenizer.json").exists():
        from ember.model.files import ensure_gguf_cache
        folder = ensure_gguf_cache(fetch_default_model())
    return Tokenizer.from_folder(folder)


def allowed(bitmask_row):
    """The allowed tokens of one int32 bitmask row, as a bool array over the vocabulary."""
    import numpy as np
    return np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:N_VOCAB].astype(bool)


def _us(ns: list[int]) -> tuple[float, float]:
    """Median and p90, in µs, of durations in ns."""
    xs = sorted(n / 1000 for n in ns)
    return statistics.median(xs), xs[min(len(xs) - 1, int(0.9 * len(xs)))]


class Llg:
    """llguidance behind the few calls this benchmark makes."""
    name = "llguidance"

    def __init__(self, tok, threads: int):
        import llguidance
        import llguidance.torch as lt
        self.llg, self.lt, self.backend = llguidance, lt, tok.backend
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def prepare_tokenizer(self):
        self.lltok = self.llg.LLTokenizer(self.backend.to_str(), n_vocab=N_VOCAB, eos_token=EOS)

    def compile_cold(self, schema: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def template(self, schema: str):  # what a server would keep per schema
        return self.compile_cold(schema)

    def new_request(self, schema: str, template):
        return template.deep_copy()

    def allocate(self, n: int):
        return self.lt.allocate_token_bitmask(n, N_VOCAB)

    def fill(self, matcher, bitmask, row: int = 0):
        self.lt.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers, bitmask):
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class Xgr:
    """xgrammar behind the same calls."""
    name = "xgrammar"

    def __init__(self, tok, threads: int):
        import xgrammar
        self.xgr, self.backend, self.threads = xgrammar, tok.backend, threads
        self.batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def prepare_tokenizer(self):
        # Not TokenizerInfo.from_huggingface: xgrammar masks out only tokens whose text is empty,
        # so from_huggingface would let <|im_start|> & co. appear inside JSON strings. Blanking the
        # special tokens masks them as llguidance does, and needs no transformers wrapper.
        spec = json.loads(self.backend.to_str())
        assert spec["decoder"]["type"] == "ByteLevel", spec["decoder"]
        vocab = [""] * N_VOCAB
        for text, i in self.backend.get_vocab(with_added_tokens=True).items():
            vocab[i] = text
        for i, added in self.backend.get_added_tokens_decoder().items():
            if added.special:
                vocab[i] = ""
        info = self.xgr.TokenizerInfo(vocab, self.xgr.VocabType.BYTE_LEVEL, vocab_size=N_VOCAB,
                                      stop_token_ids=[EOS], add_prefix_space=False)
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=self.threads)

    def compile_cold(self, schema: str):
        self.compiler.clear_cache()
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(schema))

    def template(self, schema: str):
        self.compiler.compile_json_schema(schema)  # leaves it in the compiler's cache

    def new_request(self, schema: str, template):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(schema))

    def allocate(self, n: int):
        return self.xgr.allocate_token_bitmask(n, N_VOCAB)

    def fill(self, matcher, bitmask, row: int = 0):
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers, bitmask):
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def available_libs(tok, threads: int) -> list:
    libs = []
    for cls in (Llg, Xgr):
        try:
            libs.append(cls(tok, threads))
        except ImportError as e:
            print(f"skipping {cls.name}: not installed ({e})")
    return libs


def measure_tokenizer_prep(lib, reps: int) -> float:
    """Seconds to build the library's tokenizer state (the last build is kept for the rest)."""
    return median_time(lib.prepare_tokenizer, reps=reps, warmup=0)


def measure_compile(lib, schema: str, reps: int) -> dict:
    """Cold compile (median ms), the first mask on that fresh grammar (µs), a cached request (µs)."""
    compile_ns, first_mask_ns = [], []
    bitmask = lib.allocate(1)
    for _ in range(reps):
        start = time.perf_counter_ns()
        matcher = lib.compile_cold(schema)
        compile_ns.append(time.perf_counter_ns() - start)
        start = time.perf_counter_ns()
        lib.fill(matcher, bitmask)
        first_mask_ns.append(time.perf_counter_ns() - start)
    template = lib.template(schema)
    cached_ns = []
    for _ in range(reps * 20):
        start = time.perf_counter_ns()
        lib.new_request(schema, template)
        cached_ns.append(time.perf_counter_ns() - start)
    return {"compile_ms": statistics.median(compile_ns) / 1e6, "first_mask_us": statistics.median(first_mask_ns) / 1e3,
            "cached_request_us": statistics.median(cached_ns) / 1e3}


def trajectory(lib, matcher, tokens: list[int], masks: list | None = None) -> list[int]:
    """Drive one matcher through `tokens`: fill time (ns) at each step; the masks go to `masks`."""
    bitmask = lib.allocate(1)
    times = []
    for token in tokens:
        start = time.perf_counter_ns()
        lib.fill(matcher, bitmask)
        times.append(time.perf_counter_ns() - start)
        if masks is not None:
            masks.append(allowed(bitmask[0]))
        if not lib.accept(matcher, token):
            raise RuntimeError(f"{lib.name} rejected token {token} at step {len(times) - 1}")
    return times


def measure_first_pass(lib, schema: str, tokens: list[int], masks: list) -> dict:
    """The whole document on a freshly compiled grammar: total fill ms (its masks go to `masks`)."""
    return {"first_pass_ms": sum(trajectory(lib, lib.compile_cold(schema), tokens, masks)) / 1e6}


def measure_batch1(lib, schema: str, template, tokens: list[int], reps: int) -> dict:
    """Warm passes, each on a new request from the cached template: per-step fill µs."""
    warm_ns = []
    for _ in range(reps):
        warm_ns += trajectory(lib, lib.new_request(schema, template), tokens)
    median, p90 = _us(warm_ns)
    return {"mask_median_us": median, "mask_p90_us": p90}


def measure_batch16(lib, schema: str, template, tokens: list[int], reps: int) -> dict:
    """16 matchers in lockstep on the same document: µs per step to fill all 16 rows."""
    bitmask = lib.allocate(BATCH)
    result = {}
    for mode in ("rows", "batch_api"):
        step_ns = []
        for _ in range(reps):
            matchers = [lib.new_request(schema, template) for _ in range(BATCH)]
            for token in tokens:
                start = time.perf_counter_ns()
                if mode == "rows":
                    for row, matcher in enumerate(matchers):
                        lib.fill(matcher, bitmask, row)
                else:
                    lib.fill_batch(matchers, bitmask)
                step_ns.append(time.perf_counter_ns() - start)
                for matcher in matchers:
                    if not lib.accept(matcher, token):
                        raise RuntimeError(f"{lib.name} rejected token {token} at batch 16 ({mode})")
        result[f"b16_{mode}_median_us"], result[f"b16_{mode}_p90_us"] = _us(step_ns)
    return result


def compare_masks(tok, llg: list, xgr: list) -> dict:
    """Steps where the allowed-token counts agree, and the tokens only one library allows."""
    only_llg, only_xgr = set(), set()
    for a, b in zip(llg, xgr):
        only_llg.update((a & ~b).nonzero()[0].tolist())
        only_xgr.update((b & ~a).nonzero()[0].tolist())

    def show(ids):
        texts = [repr(tok.decode([i], skip_special_tokens=False)) for i in sorted(ids)]
        return ", ".join(texts[:8]) + (f" ... ({len(texts)} in all)" if len(texts) > 8 else "")
    return {"steps": len(llg), "equal_count": sum(int(a.sum()) == int(b.sum()) for a, b in zip(llg, xgr)),
            "identical": sum(bool((a == b).all()) for a, b in zip(llg, xgr)),
            "count_diffs": [(i, int(a.sum()), int(b.sum())) for i, (a, b) in enumerate(zip(llg, xgr))
                            if a.sum() != b.sum()][:4],
            "only_llguidance": show(only_llg), "only_xgrammar": show(only_xgr)}


def run(reps: int) -> dict:
    tok = load_tokenizer()
    threads = os.cpu_count() or 1
    libs = available_libs(tok, threads)
    out = {"threads": threads, "n_vocab": N_VOCAB, "libs": {}, "results": {}, "sanity": {}}
    for lib in libs:
        progress(f"{lib.name}: tokenizer preprocessing")
        prep_ms = 1e3 * measure_tokenizer_prep(lib, 3)
        out["libs"][lib.name] = {"version": version(lib.name), "tokenizer_prep_ms": prep_ms}
    for schema_name, schema_dict in SCHEMAS.items():
        schema = json.dumps(schema_dict)
        tokens = tok.encode(json.dumps(DOCS[schema_name])) + [EOS]
        masks = {}
        for lib in libs:
            progress(f"{lib.name}: {schema_name} ({len(tokens)} tokens)")
            row = {"tokens": len(tokens), **measure_compile(lib, schema, reps)}
            first = measure_first_pass(lib, schema, tokens, masks.setdefault(lib.name, []))
            template = lib.template(schema)
            trajectory(lib, lib.new_request(schema, template), tokens)  # one warm-up pass, not counted
            row.update(first, **measure_batch1(lib, schema, template, tokens, reps),
                       **measure_batch16(lib, schema, template, tokens, max(1, reps // 2)))
            out["results"].setdefault(schema_name, {})[lib.name] = row
        if len(masks) == 2:
            out["sanity"][schema_name] = compare_masks(tok, masks["llguidance"], masks["xgrammar"])
    return out


def markdown(out: dict) -> str:
    lines = [f"threads: {out['threads']} (LLExecutor / BatchGrammarMatcher / GrammarCompiler), vocab {out['n_vocab']}",
             "", "| library | version | tokenizer prep ms |", "| --- | --- | ---: |"]
    lines += [f"| {name} | {v['version']} | {v['tokenizer_prep_ms']:.0f} |" for name, v in out["libs"].items()]
    lines += ["", "| schema | library | tokens | compile cold ms | 1st mask µs | cached request µs | 1st pass ms |"
              " mask b1 med µs | b1 p90 µs | b16 rows med µs/step | b16 batch-API med µs/step | b16 batch-API p90 |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for schema_name, per_lib in out["results"].items():
        for name, r in per_lib.items():
            cells = [schema_name, name, r["tokens"], f"{r['compile_ms']:.2f}", f"{r['first_mask_us']:.0f}",
                     f"{r['cached_request_us']:.1f}", f"{r['first_pass_ms']:.2f}", f"{r['mask_median_us']:.1f}",
                     f"{r['mask_p90_us']:.1f}", f"{r['b16_rows_median_us']:.0f}",
                     f"{r['b16_batch_api_median_us']:.0f}", f"{r['b16_batch_api_p90_us']:.0f}"]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    if out["sanity"]:
        lines += ["", "| schema | equal allowed count | identical mask | first count diffs (step, llg, xgr) |"
                  " tokens only llguidance allows | tokens only xgrammar allows |",
                  "| --- | ---: | ---: | --- | --- | --- |"]
        lines += [f"| {name} | {s['equal_count']}/{s['steps']} | {s['identical']}/{s['steps']} | {s['count_diffs']} |"
                  f" {s['only_llguidance']} | {s['only_xgrammar']} |" for name, s in out["sanity"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="cold compiles and warm passes per schema")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    out = run(args.reps)
    print(markdown(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
