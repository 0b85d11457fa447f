"""Spans a local cluster exported to its run directory (`EMBER_TRACE_DIR`, which `ember up` sets:
one JSON object per line in RUN_DIR/<service>-<pid>.jsonl, ember.rpc.tracing), read back."""
from __future__ import annotations

import json
from pathlib import Path


def read_spans(run_dir: str | Path, service: str | None = None) -> list[dict]:
    """Every span the cluster's services (or `service` alone: "decode", "kvstore-edge", ...) exported,
    in file order. A line still being written is skipped (it is whole at the next read)."""
    spans = []
    for path in sorted(Path(run_dir).glob(f"{service}-*.jsonl" if service else "*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except ValueError:
                pass
    return spans


def request_spans(run_dir: str | Path, request_id: str, service: str | None = None,
                  kind: str | None = "SERVER") -> list[dict]:
    """The spans (of `kind`; None: any) that carry `ember.request_id` = `request_id`."""
    return [s for s in read_spans(run_dir, service) if s["attributes"].get("ember.request_id") == request_id
            and (kind is None or s["kind"] == kind)]


def trace(run_dir: str | Path, trace_id: str) -> list[dict]:
    """Every span of one trace, across all services."""
    return [s for s in read_spans(run_dir) if s["trace_id"] == trace_id]


# What `ember trace` prints of a span's attributes (`ember.` dropped), in this order: what moved and
# over which link, tokens, queue wait, steps. Everything else is in the span files (and `--all`).
KEY_ATTRIBUTES = (
    "prefill_site", "decode_site", "site", "link", "source", "source_site", "pull_from", "to", "relay", "via",
    "read_via", "data_address", "codec", "blocks", "blocks_requested", "blocks_pulled", "blocks_read",
    "blocks_imported", "blocks_stored", "bytes", "bytes_pulled", "bytes_read", "wire_bytes",
    "prompt_tokens", "tokens", "tokens_computed", "tokens_cached", "chunk", "prompt_tokens_done",
    "batch_seqs", "completion_tokens", "queue_wait_s", "waiting_ahead", "steps", "step_s_mean", "step_s_max",
    "tpot_s", "transfer_s", "finish_reason", "aborted", "failed")


def request_traces(run_dir: str | Path, request_id: str) -> dict[str, list[dict]]:
    """trace id -> its spans, for every trace a span of which carries `ember.request_id` = `request_id`."""
    spans = read_spans(run_dir)
    ids = {s["trace_id"] for s in spans if s["attributes"].get("ember.request_id") == request_id}
    return {t: [s for s in spans if s["trace_id"] == t] for t in sorted(ids)}


def _value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_trace(spans: list[dict], all_attributes: bool = False) -> list[str]:
    """One trace as a tree: a line per span, indented under its parent (a span whose parent is not in
    the files, a remote caller's say, is a root), children by start time: when it started (ms after
    the trace's first span), its duration, service, name and key attributes."""
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str | None, list[dict]] = {}
    for s in spans:
        parent = s["parent_id"] if s["parent_id"] in by_id else None
        children.setdefault(parent, []).append(s)
    for group in children.values():
        group.sort(key=lambda s: (s["start_ns"], s["end_ns"]))
    t0 = min(s["start_ns"] for s in spans)
    lines = []

    def show(span: dict, depth: int) -> None:
        a = span["attributes"]
        if all_attributes:
            keys = sorted(k.removeprefix("ember.") for k in a)
        else:
            keys = [k for k in KEY_ATTRIBUTES if f"ember.{k}" in a]
        shown = " ".join(f"{k}={_value(a.get(f'ember.{k}', a.get(k)))}" for k in keys)
        service = span["service"] + ("/core" if span.get("process") == "engine-core" else "")
        kind = "" if span["kind"] == "INTERNAL" else f" [{span['kind'].lower()}]"
        error = " ERROR" if span.get("status") == "ERROR" else ""
        lines.append(f"{(span['start_ns'] - t0) / 1e6:9.1f} {(span['end_ns'] - span['start_ns']) / 1e6:9.1f} ms  "
                     f"{'  ' * depth}{service}: {span['name']}{kind}{error}" + (f"  {shown}" if shown else ""))
        for child in children.get(span["span_id"], []):
            show(child, depth + 1)
    for root in children.get(None, []):
        show(root, 0)
    return lines


def render_request(run_dir: str | Path, request_id: str, all_attributes: bool = False) -> str:
    """`ember trace REQUEST_ID`: each trace of the request as a tree (LookupError: no span carries it)."""
    traces = request_traces(run_dir, request_id)
    if not traces:
        raise LookupError(f"no span in {run_dir} carries request id {request_id!r} (is it this cluster's, "
                          "and were its spans exported here? `ember up` writes them to its run directory "
                          "unless OTEL_EXPORTER_OTLP_ENDPOINT sends them to a collector)")
    out = []
    for trace_id, spans in traces.items():
        services = sorted({s["service"] for s in spans})
        out.append(f"trace {trace_id}  request {request_id}  {len(spans)} spans  {', '.join(services)}")
        out.append(f"{'start':>9} {'duration':>12}  service: span  attributes")
        out += render_trace(spans, all_attributes)
    return "\n".join(out)
