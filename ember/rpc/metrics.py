"""Prometheus metrics of every service, named after vLLM's where one exists (`vllm:` -> `ember:`).

Each process serves its registry on `/metrics` (`serve(address)`, a small thread; who may read it:
ember.rpc.metrics_http). Gauges that mirror engine or store state are read at scrape time.
"""
from __future__ import annotations

import os

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ember.util import memory

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)

# router: the user's view
TTFT = Histogram("ember:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY)
AUTH_FAILURES = Counter("ember:auth_failures", "Calls refused for their credentials, by reason and protocol: the "
                        "router's public ports for their API key (grpc, http: missing_key, malformed_header, "
                        "invalid_key; HTTP 401, gRPC UNAUTHENTICATED) and any service's /metrics (metrics: "
                        "metrics_tls, metrics_role, metrics_token; ember.rpc.metrics_http)", ["reason", "protocol"])
TPOT = Histogram("ember:time_per_output_token_seconds", "Mean time per output token of a request", buckets=_TOKEN)
INTER_TOKEN = Histogram("ember:inter_token_latency_seconds", "Gap between streamed tokens", buckets=_TOKEN)
E2E = Histogram("ember:e2e_request_latency_seconds", "Request latency, received to last token", buckets=_LATENCY)
REQUEST_SUCCESS = Counter("ember:request_success", "Finished requests", ["finished_reason"])
PROMPT_TOKENS = Counter("ember:prompt_tokens", "Prompt tokens received")
GENERATION_TOKENS = Counter("ember:generation_tokens", "Tokens generated")
PLACEMENTS = Counter("ember:placements", "Placement decisions", ["prefill_site", "decode_site"])
MIGRATIONS = Counter("ember:decode_migrations", "Decode streams moved to another worker after one failed")
ABORTED = Counter("ember:requests_aborted", "Decode streams ended before they finished: the caller cancelled or "
                  "its deadline passed (the engine frees the sequence)", ["reason"])
REJECTED = Counter("ember:requests_rejected", "Requests refused at admission (RESOURCE_EXHAUSTED with pushback)")
# router, per tenant (the keys file's tenants; "-" when no API key is configured)
TENANT_REQUESTS = Counter("ember:tenant_requests", "Requests admitted, by tenant", ["tenant"])
TENANT_THROTTLED = Counter("ember:tenant_throttled", "Requests refused at admission, by tenant and reason: capacity "
                           "(its fair share of router.max_inflight), max_inflight, requests_per_s, tokens_per_min "
                           "(its quotas)", ["tenant", "reason"])
TENANT_TTFT = Histogram("ember:tenant_time_to_first_token_seconds", "Time to first token, by tenant", ["tenant"],
                        buckets=_LATENCY)
# every service
RPC_ERRORS = Counter("ember:request_errors", "Calls that ended in an error: gRPC calls by method (/package.Service/"
                     "Method) and status name; the router's HTTP API by route ('POST /v1/chat/completions') and "
                     "HTTP status ('503'), a failure after an SSE answer started under the status it would have had",
                     ["method", "code"])
# engine services (prefill, decode)
RUNNING = Gauge("ember:num_requests_running", "Sequences in the running batch, and finished ones whose answer waits "
                "on its KV write-back (prefill's)")
WAITING = Gauge("ember:num_requests_waiting", "Requests at this worker not running yet: queued, loading their KV, or "
                "on their way to the engine core (counted from their arrival, also during a long step)")
KV_USAGE = Gauge("ember:kv_cache_usage_perc", "Fraction of the paged KV pool referenced by sequences")
CORE_PID = Gauge("ember:engine_core_pid", "The engine core's process id (forked by the engine template, "
                 "ember.serving.template, it is not this service's child)")
KV_CAPACITY = Gauge("ember:kv_cache_capacity_tokens", "Tokens the paged KV pool holds (blocks x block size)")
PROMPT_TOKENS_BY_TIER = Gauge("ember:prompt_tokens_by_tier", "Prompt tokens by where their KV came from: l1 (engine "
                              "pool), l2 (site kvstore) at a request's first step, computed chunk by chunk", ["tier"])
KV_BLOCKS = Gauge("ember:kv_cache_blocks", "Blocks of the paged KV pool referenced by sequences (used) and not (free)",
                  ["state"])
STEP_PREFILL = Gauge("ember:engine_step_prefill_tokens", "Prompt tokens the engine step in progress computes "
                     "(0 between steps)")
QUEUED_PREFILL = Gauge("ember:engine_queued_prefill_tokens", "Prompt tokens queued and running requests still need "
                       "beyond the step in progress (a queued one's before its prefix-cache hits are known)")
STEP_SECONDS = Gauge("ember:engine_step_running_seconds", "How long the engine step in progress has run (0 between "
                     "steps)")
STATE_AGE = Gauge("ember:engine_state_age_seconds", "Age of the engine core's latest state at scrape time (it "
                  "publishes at least every 0.25 s, also during a long step)")
# an engine service reads these off its core's snapshot instead (_EngineCounters: counted as the work is done)
PREFIX_QUERIES = Counter("ember:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = Counter("ember:prefix_cache_hits", "Prompt tokens found in the prefix cache")
# kvstore (its counters live in BlockStore.stats and are read at scrape time)
KV_PULL_BYTES = Counter("ember:kvstore_pull_bytes", "Frame bytes pulled from another site's kvstore, by link "
                        "(SOURCE->THIS site)", ["link"])
KV_PULL_WIRE_BYTES = Counter("ember:kvstore_pull_wire_bytes", "Bytes those pulls put on the wire (after the link "
                             "codec), by link", ["link"])
KV_PULL_SECONDS = Counter("ember:kvstore_pull_seconds", "Seconds spent pulling from another site's kvstore, by link",
                          ["link"])
KV_PULL_THROUGHPUT = Histogram("ember:kvstore_pull_throughput_bytes_per_second", "Throughput of pulls",
                               buckets=(1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2e9, 4e9, 8e9))
KV_FRAMES_REFUSED = Counter("ember:kv_frames_refused", "Connections the TCP data plane dropped, by reason "
                            "(ember.kv.transfer.REFUSALS): unauthorized, bad_magic, unknown_codec, truncated, "
                            "bad_frame, stalled", ["reason"])


class _StoreCollector:
    def __init__(self, store):
        self.store = store

    def collect(self):
        store, stats = self.store, self.store.stats
        bytes_in = CounterMetricFamily("ember:kvstore_bytes_in", "Frame bytes stored", labels=["via"])
        bytes_in.add_metric(["put"], stats.bytes_put)
        bytes_in.add_metric(["pull"], stats.bytes_pulled)
        yield bytes_in
        yield CounterMetricFamily("ember:kvstore_bytes_out", "Frame bytes served to readers", value=stats.bytes_served)
        yield CounterMetricFamily("ember:kvstore_evictions", "Blocks evicted", value=stats.evictions)
        for name, doc, value in (("ember:kvstore_blocks", "Blocks held", len(store.blocks)),
                                 ("ember:kvstore_bytes", "Bytes held", store.bytes),
                                 ("ember:kvstore_pinned_blocks", "Blocks pinned by transfers or leases",
                                  len(store.pins)),
                                 ("ember:kvstore_leases", "Leases held", len(store.leases))):
            yield GaugeMetricFamily(name, doc, value=value)


class _WorkerCollector:
    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        live = GaugeMetricFamily("ember:worker_live", "1 while the router counts the worker live (health SERVING)",
                                 labels=["role", "site", "address"])
        running = GaugeMetricFamily("ember:worker_running", "This router's calls in flight on the worker",
                                    labels=["role", "site", "address"])
        for workers in self.pool.workers.values():
            for w in workers:
                live.add_metric([w.role, w.site, w.address], int(w.live))
                running.add_metric([w.role, w.site, w.address], w.running)
        yield live
        yield running


class _EngineCounters:
    """Counters kept by the engine core, read off its latest snapshot (the client watch_engine names).
    Prompt, generation and prefix-cache tokens advance per step (a request's cached tokens at its first
    step, computed ones per chunk, sampled ones per step), not when a request ends."""
    client = None

    def collect(self):
        if self.client is None:
            return
        snap = self.client.snapshot
        cached = snap.tokens_l1 + snap.tokens_l2
        yield CounterMetricFamily("ember:prompt_tokens", "Prompt tokens the engine has served: cached (at a "
                                  "request's first step) and computed (per chunk)", value=cached + snap.tokens_computed)
        yield CounterMetricFamily("ember:generation_tokens", "Tokens the engine has sampled (per step)",
                                  value=snap.generation_tokens)
        yield CounterMetricFamily("ember:prefix_cache_queries", "Tokens of requests looked up in the prefix cache "
                                  "(at their first step)", value=snap.prefix_queries)
        yield CounterMetricFamily("ember:prefix_cache_hits", "Of those, found cached (engine pool or site kvstore)",
                                  value=cached)
        yield CounterMetricFamily("ember:spec_decode_num_draft_tokens", "Prompt-lookup drafts verified",
                                  value=snap.draft_tokens)
        yield CounterMetricFamily("ember:spec_decode_num_accepted_tokens", "Drafts kept (each a decode step saved)",
                                  value=snap.accepted_tokens)
        yield CounterMetricFamily("ember:jump_forward_tokens", "Grammar-forced tokens appended without a decode "
                                  "step of their own (jump-forward decoding)", value=snap.forced_tokens)
        steps = CounterMetricFamily("ember:scheduler_steps", "Engine steps by what the TTFT/TPOT step policy "
                                    "chose (ember.engine.step_policy)", labels=["choice"])
        for choice, count in snap.step_choices:
            steps.add_metric([choice], count)
        if snap.step_choices:
            yield steps
        if snap.expert_tokens:  # a mixture-of-experts model: the load on each expert (and its rank)
            experts = CounterMetricFamily("ember:moe_expert_tokens", "Tokens routed to each expert, over all "
                                          "MoE layers, since start", labels=["expert", "rank"])
            for expert, (tokens, rank) in enumerate(zip(snap.expert_tokens, snap.expert_ranks)):
                experts.add_metric([str(expert), str(rank)], tokens)
            yield experts


_ENGINE_COUNTERS = _EngineCounters()


class _MemoryCollector:
    """Resident memory by part (ember.util.memory) of this process ("service") and, for an engine
    service, of its engine core's process ("engine-core", off the core's latest snapshot)."""
    client = None
    registered = False

    def collect(self):
        resident = GaugeMetricFamily("ember:memory_resident_bytes", "Resident set size of the process",
                                     labels=["process"])
        parts = GaugeMetricFamily("ember:memory_bytes", "Resident memory by part: weights, kv_pool, workspace, "
                                  "kv_arena_maps, code, heap, allocator_slack, python, stack, unaccounted "
                                  "(docs/ARCHITECTURE.md, Start-up and memory)", labels=["process", "part"])
        reports = [("service", memory.report())]
        client = self.client
        if client is not None and client.info is not None and client.info.pid != os.getpid() \
                and client.snapshot.memory:
            reports.append(("engine-core", dict(client.snapshot.memory)))
        for process, report in reports:
            resident.add_metric([process], report["rss"])
            for part in memory.PARTS:
                parts.add_metric([process, part], report.get(part, 0))
        yield resident
        yield parts


_MEMORY = _MemoryCollector()


def watch_workers(pool) -> None:
    """The router's view of its prefill and decode workers, read at scrape time."""
    REGISTRY.register(_WorkerCollector(pool))


def watch_engine(client) -> None:
    """Engine gauges from the latest snapshot the engine core sent (no round trip per scrape): the core
    sends one at least every 0.25 s, during a long step too (ember.serving.engine_client.serve_loop), and
    a request counts as waiting from its arrival here (EngineClient.current)."""
    import time
    RUNNING.set_function(lambda: client.snapshot.running)
    WAITING.set_function(lambda: client.current().waiting)
    KV_USAGE.set_function(lambda: client.snapshot.used_blocks / max(1, client.snapshot.total_blocks))
    KV_BLOCKS.labels("used").set_function(lambda: client.snapshot.used_blocks)
    KV_BLOCKS.labels("free").set_function(lambda: client.snapshot.total_blocks - client.snapshot.used_blocks)
    STEP_PREFILL.set_function(lambda: client.snapshot.step_prefill_tokens)
    QUEUED_PREFILL.set_function(lambda: client.snapshot.queued_prefill_tokens)
    STEP_SECONDS.set_function(lambda: time.monotonic() - s.step_since if (s := client.snapshot).step_since else 0.0)
    STATE_AGE.set_function(lambda: time.monotonic() - s.at if (s := client.snapshot).at else 0.0)
    KV_CAPACITY.set_function(lambda: client.snapshot.total_blocks * client.info.block_size)
    CORE_PID.set_function(lambda: client.info.pid)
    for tier in ("l1", "l2", "computed"):
        PROMPT_TOKENS_BY_TIER.labels(tier).set_function(lambda t=tier: getattr(client.snapshot, f"tokens_{t}"))
    if _ENGINE_COUNTERS.client is None:
        for counter in (PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_QUERIES, PREFIX_HITS):  # the core's, per step
            REGISTRY.unregister(counter)
        REGISTRY.register(_ENGINE_COUNTERS)
    _ENGINE_COUNTERS.client = client
    _MEMORY.client = client


def watch_store(store) -> None:
    REGISTRY.register(_StoreCollector(store))


def serve(address: str | None) -> None:
    """Serve /metrics on `address` under this process's policy (security.metrics: ember.rpc.metrics_http)."""
    if address:
        from ember.rpc import metrics_http
        if not _MEMORY.registered:
            REGISTRY.register(_MEMORY)
            _MEMORY.registered = True
        metrics_http.serve(address)
