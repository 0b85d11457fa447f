"""`ember bench streaming`: KV streaming over a wide-area link (issue 19, item 1).

The shipped default cluster (configs/local.yaml: prefill at central, decode at edge, default engine)
with the router at the edge and a 60 ms / 1 Gbit/s emulated link between the sites. Remote prefill of
2,048-token prompts (distinct, nothing cached), 32 tokens each, one at a time; the client times every
message. The gap from token 1 (the prefill's) to token 2 (decode's first, after its KV arrived) is
measured with kvstore.stream_prefill on (the shipped default) and off, clusters alternating, in one run.
Target: the streamed gap <= RTT + 2 x TPOT (TPOT: the same run's decode step, token 2 to the last).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from ember.bench.kv_bench import english_prompt
from ember.bench.measure import progress, write_result

ROOT = Path(__file__).resolve().parents[2]
RTT_MS, GBPS, PROMPT_TOKENS, NEW_TOKENS = 60.0, 1.0, 2048, 32
QUICK_PROMPT_TOKENS = 384  # --quick: a smoke run (a 2,048-token prefill takes ~55 s on one thread of a slow host)


def linked_config(run_dir: Path, stream: bool, model: str | None, engine: dict | None = None) -> Path:
    """configs/local.yaml with the router at the edge and the emulated link between the sites, on free
    ports in `run_dir` (`engine`: that section instead of the shipped one; tests/test_kv_streaming_cluster.py)."""
    from ember.cluster.ports import on_free_ports
    data = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    data["router"]["site"] = "edge"
    data["placement"]["emulate_links"] = True
    data["placement"]["shared_host"] = "disaggregated"  # (the sites stand for two hosts behind the link)
    data["links"] = [{"a": "central", "b": "edge", "rtt_ms": RTT_MS, "bandwidth_gbps": GBPS}]
    data.setdefault("kvstore", {})["stream_prefill"] = stream
    if engine is not None:
        data["engine"] = engine
    (run_dir / "source.yaml").write_text(yaml.safe_dump(data))
    on_free_ports(run_dir / "source.yaml", run_dir / "cluster.yaml", model)
    return run_dir / "cluster.yaml"


def _prompts(config_path: Path, count: int, first: int, length: int) -> list[list[int]]:
    from ember.config.load import load_config
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(model_folder(load_config(config_path).model_path()))
    body = english_prompt(80)
    out = []
    for i in range(first, first + count):
        ids = tok.encode(f"Request {i}: read the log below.\n" + body)[:length]
        assert len(ids) == length, len(ids)
        out.append(ids)
    return out


def _timed(router: str, ids: list[int], request_id: str) -> dict:
    from ember.client import RouterClient
    times, final = [], None
    with RouterClient(router) as client:
        start = time.perf_counter()
        for msg in client.stream(token_ids=ids, max_tokens=NEW_TOKENS, ignore_eos=True, request_id=request_id,
                                 timeout=600):
            now = time.perf_counter()
            times += [now] * len(msg.token_ids)
            final = msg
    p = final.placement
    assert (p.prefill_site, p.decode_site) == ("central", "edge"), p.reason
    assert len(times) == NEW_TOKENS
    return {"ttft_s": times[0] - start, "gap_1_2_s": times[1] - times[0],
            "tpot_s": (times[-1] - times[1]) / (len(times) - 2), "transfer_s": final.timings.transfer_s}


def _decode_pulls(run_dir: Path, request_id: str) -> int | None:
    for f in run_dir.glob("decode-*.jsonl"):
        for line in f.read_text().splitlines():
            span = json.loads(line)
            attrs = span["attributes"]
            if span["kind"] == "SERVER" and attrs.get("ember.request_id") == request_id \
                    and "ember.blocks_pulled" in attrs:
                return attrs["ember.blocks_pulled"]
    return None


def _run(stream: bool, count: int, first: int, model: str | None, length: int) -> list[dict]:
    from ember.cluster.launcher import running
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        config_path = linked_config(run_dir, stream, model)
        prompts = _prompts(config_path, count + 1, first, length)
        with running(config_path, run_dir, timeout_s=300):
            from ember.config.load import load_config
            router = load_config(config_path).router.listen
            _timed(router, prompts[0], f"warm-{first}")  # (first-request costs out of the figures)
            rows = []
            for i, ids in enumerate(prompts[1:]):
                rid = f"r{first + i}"
                row = _timed(router, ids, rid)
                time.sleep(0.5)  # (the trace exporter batches: its spans land shortly after)
                row["decode_blocks_pulled"] = _decode_pulls(run_dir, rid)
                rows.append(row)
                progress(f"{'streamed' if stream else 'not streamed'}: gap {row['gap_1_2_s'] * 1e3:.0f} ms, "
                         f"TPOT {row['tpot_s'] * 1e3:.0f} ms, decode pulled {row['decode_blocks_pulled']} blocks")
            return rows


def main(args) -> int:
    count, rounds, length = (1, 1, QUICK_PROMPT_TOKENS) if args.quick else (3, 2, PROMPT_TOKENS)
    runs: dict[str, list[dict]] = {"streamed": [], "not_streamed": []}
    first = 0
    for r in range(rounds):
        for name, stream in (("streamed", True), ("not_streamed", False)):
            progress(f"round {r + 1}/{rounds}: {name}")
            runs[name] += _run(stream, count, first, args.model, length)
            first += count + 1
    summary = {name: {key: statistics.median(row[key] for row in rows)
                      for key in ("gap_1_2_s", "tpot_s", "ttft_s", "transfer_s")} for name, rows in runs.items()}
    s, n = summary["streamed"], summary["not_streamed"]
    bound = RTT_MS / 1e3 + 2 * s["tpot_s"]
    result = {"link": {"rtt_ms": RTT_MS, "gbps": GBPS}, "prompt_tokens": length, "new_tokens": NEW_TOKENS,
              "config": "configs/local.yaml (router at edge, emulated link)", "runs": runs, "median": summary,
              "targets": {"streamed gap token 1 -> 2 (s)": round(s["gap_1_2_s"], 3),
                          "RTT + 2 x TPOT (s)": round(bound, 3),
                          "not streamed gap (s)": round(n["gap_1_2_s"], 3),
                          "gap streamed / not": round(s["gap_1_2_s"] / n["gap_1_2_s"], 2),
                          "met": s["gap_1_2_s"] <= bound,
                          "TTFT streamed / not (its cost on this rig)": round(s["ttft_s"] / n["ttft_s"], 2)}}
    write_result(result, args.output)
    return 0
