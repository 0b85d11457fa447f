"""Helpers of the service tests: a real local cluster's config on free ports, channels to its
services, and waiting on a condition with a deadline."""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from pathlib import Path

from ember.cluster.ports import free_port, write_local_config
from ember.model.fetch import DEFAULT_MODEL_PATH

__all__ = ["AT_ONCE_S", "dial", "free_port", "wait_until", "wait_until_async", "write_config"]

# "At once", for what a test observes through real processes on a loaded 2-core CI host: far past any
# scheduling stall seen there (0.5 s), far short of the timeouts a hang would run into (30 s and up).
# Tests print the measured figure; the product's own budgets are asserted from its counters and spans.
AT_ONCE_S = 10.0


def write_config(path: Path, directory: str | None = None, shared_memory: bool = True, overrides: dict | None = None,
                 **engine) -> dict[str, str]:
    """The two-site cluster on free ports, serving the exact path (fp32 dense: its tokens are checked
    against transformers) unless `engine` says otherwise; `overrides`: any other settings, section by
    section ({"router": {"require_api_key": True}})."""
    engine.setdefault("dtype", "float32")
    engine.setdefault("weights", "dense")
    return write_local_config(path, str(DEFAULT_MODEL_PATH), directory=directory, shared_memory=shared_memory,
                              overrides=overrides, **engine)


def dial(cluster: dict, key: str, as_service: str = "operator", options=None):
    """A blocking channel to `cluster[key]` (an internal service of a test cluster) holding the
    certificate of `as_service` from the run folder (`operator`, `router`, `prefill-central`, ...):
    mTLS as the cluster's own services use it, plaintext when the cluster runs plaintext."""
    from ember.cluster.launcher import credentials
    from ember.rpc import security
    return security.dial(cluster[key], credentials(Path(cluster["config"]).parent, as_service), options)


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.05):
    """`condition()`'s first truthy value, polled every `every_s`; fails naming `what` after `timeout_s`
    (a hang is a failure, never a slow pass)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(every_s)
    return value


async def wait_until_async(condition: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.02):
    """wait_until inside an event loop: `condition()` (or what it returns, awaited, when that is a
    coroutine) polled without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(every_s)


def decode_span(run_dir, final) -> dict:
    """The attributes of decode's SERVER span for the request whose last message is `final`."""
    from ember.cluster.traces import request_spans
    [span] = wait_until(lambda: [s for s in request_spans(run_dir, final.request_id, "decode")
                                 if "ember.blocks_imported" in s["attributes"]], 10,
                        f"decode exporting its span for {final.request_id}")
    return span["attributes"]
