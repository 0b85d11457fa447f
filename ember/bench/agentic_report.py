"""What `ember bench agentic` reports: percentiles, goodput, targets, plots, a progress bar."""
from __future__ import annotations

import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from ember.bench.agentic_systems import Record


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    return {p: v[min(len(v) - 1, int(q * len(v)))] for p, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def summarize(records: list[Record], wall_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    later = [r for r in records if r.turn >= 2]
    prompt = sum(r.prompt_tokens for r in records)
    good = [r for r in records if r.ttft_s <= slo_ttft_s and (r.tpot_s or 0.0) <= slo_tpot_s]
    return {
        "requests": len(records), "wall_s": wall_s,
        "ttft": percentiles([r.ttft_s for r in records]),
        "ttft_turn2plus": percentiles([r.ttft_s for r in later]),
        "tpot": percentiles([r.tpot_s for r in records if r.tpot_s is not None]),
        "itl": percentiles([g for r in records for g in r.gaps_s]),
        "e2e": percentiles([r.e2e_s for r in records]),
        "output_tok_per_s": sum(r.output_tokens for r in records) / wall_s,
        "prefix_hit_rate": sum(r.cached_tokens for r in records) / max(1, prompt),
        "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in records),
        "computed_prompt_tokens": prompt - sum(r.cached_tokens for r in records),
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s, "met_fraction": len(good) / max(1, len(records)),
                "goodput_req_per_s": len(good) / wall_s},
        "cache_hit_of_cacheable": cacheable_hit_rate(records),
        "ttft_by_turn": {str(t): statistics.median(r.ttft_s for r in records if r.turn == t)
                         for t in sorted({r.turn for r in records})},
        "records": [asdict(r) | {"tpot_s": r.tpot_s} for r in records],
    }


def cacheable_hit_rate(records: list[Record], block: int = 16) -> float | None:
    """Cached prompt tokens of turns >= 2 over what was cacheable: the previous turn's prompt and
    answer (all but this turn's new tokens), in whole blocks, leaving the last prompt token to compute."""
    prev, cacheable, hit = {}, 0, 0
    for r in sorted(records, key=lambda r: (r.session, r.turn)):
        p = prev.get(r.session)
        if r.turn >= 2 and p is not None:
            can = min((p.prompt_tokens + p.output_tokens - 1) // block, (r.prompt_tokens - 1) // block) * block
            cacheable += can
            hit += min(r.cached_tokens, can)
        prev[r.session] = r
    return hit / cacheable if cacheable else None


def _ratio(mine: dict, peer: dict, *keys) -> float | None:
    a, b = mine, peer
    for k in keys:
        a, b = (a or {}).get(k), (b or {}).get(k)
    return None if a is None or not b else a / b


def targets(result: dict) -> dict:
    """The issue's targets, each as value / target / met (None where a system was not run)."""
    replay, streams, single = (result.get(k, {}) for k in ("replay", "streams16", "single_stream"))
    peer = "llama-server"
    out = {}
    for name in ("ember-colocated", "ember-disagg"):
        r = _ratio(replay.get(name), replay.get(peer), "ttft_turn2plus", "p50")
        out[f"{name}: turn>=2 TTFT p50 / llama-server (8 sessions)"] = _target(r, 0.5, r is not None and r <= 0.5)
        r = _ratio(streams.get(name), streams.get(peer), "output_tok_per_s")
        out[f"{name}: output tok/s / llama-server (16 streams)"] = _target(r, 2.0, r is not None and r >= 2.0)
        r = _ratio(single.get(name), single.get(peer), "decode_tok_per_s")
        out[f"{name}: single-stream decode / llama-server"] = _target(r, 1.0, r is not None and r >= 1.0)
        r = _ratio(replay.get(name), replay.get(peer), "wall_s")
        out[f"{name}: whole replay / llama-server"] = _target(r, 0.5, r is not None and r <= 0.5)
        r = (replay.get(name) or {}).get("cache_hit_of_cacheable")
        out[f"{name}: cached / cacheable prompt tokens (turn>=2)"] = _target(r, 0.95, r is not None and r >= 0.95)
    roof = result.get("prefill_roofline", {})
    frac = roof.get("fraction_of_roofline")
    out["ember prefill / matmul roofline"] = _target(frac, 0.85, frac is not None and frac >= 0.85)
    return out


def _target(value, target, met) -> dict:
    return {"value": None if value is None else round(value, 3), "target": target,
            "met": None if value is None else bool(met)}


class _Lines:
    """A log (not a terminal) gets each tqdm redraw as a line of its own, not `\r` overwrites."""

    def __init__(self, stream):
        self.stream, self.last = stream, None

    def write(self, s: str) -> None:
        line = s.strip("\r\n").rstrip()
        if line and line != self.last:  # (closing redraws the last state once more)
            self.stream.write(line + "\n")
            self.last = line

    def flush(self) -> None:
        self.stream.flush()


class ProgressBar:
    """One updating stderr line per phase and system (tqdm): done/total requests, elapsed,
    latest TTFT. A terminal redraws in place; a log gets a line per eighth, not per request."""

    def __init__(self, label: str, total: int, stream=sys.stderr):
        tty = stream.isatty()
        self.bar = tqdm(total=total, desc=f"[bench] {label:<34}", file=stream if tty else _Lines(stream),
                        bar_format="{desc} |{bar:24}| {n_fmt}/{total_fmt} {elapsed_s:6.1f}s{postfix}",
                        ascii=".#", dynamic_ncols=False, leave=True,
                        **({} if tty else {"mininterval": 0, "miniters": max(1, total // 8)}))

    def step(self, note: str) -> None:
        self.bar.set_postfix_str(note, refresh=False)
        self.bar.update(1)
        if self.bar.n >= self.bar.total:
            self.bar.close()


def plot(result: dict, out_dir: Path) -> list[str]:
    """PNGs: TTFT / TPOT CDFs per system (agentic replay), and median TTFT by turn number."""
    from ember.bench.measure import require
    require("matplotlib", "the agentic bench's plots").use("Agg")
    import matplotlib.pyplot as plt
    replay = {k: v for k, v in result.get("replay", {}).items() if "records" in v}
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, summary in replay.items():
        for ax, key in zip(axes, ("ttft_s", "tpot_s")):
            values = sorted(r[key] for r in summary["records"] if r[key] is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    for ax, title in zip(axes, ("TTFT (s)", "time per output token (s)")):
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"agentic replay: {result['sessions']} sessions x {result['turns']} turns, latency CDFs")
    fig.tight_layout()
    written.append(_save(fig, out_dir / "agentic_latency_cdf.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, summary in replay.items():
        turns = sorted(summary["ttft_by_turn"], key=int)
        ax.plot([int(t) for t in turns], [summary["ttft_by_turn"][t] for t in turns], marker="o", label=name)
    ax.set_xlabel("turn")
    ax.set_ylabel("median TTFT (s)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("TTFT by turn (context grows every turn)")
    fig.tight_layout()
    written.append(_save(fig, out_dir / "agentic_ttft_by_turn.png"))
    plt.close("all")
    return written


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return str(path)
