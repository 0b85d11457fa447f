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
