"""`ember bench tenants`: one tenant's burst against another tenant's requests, and a quota.

The shipped default cluster (configs/local.yaml, or `--cluster-config`) on free ports with an API
keys file of three tenants: A (the burst), B (the interactive tenant) and Q (a tokens/min quota
sized from its prompt so that a second request must wait up to ~10 s). `--max-inflight` sets
router.max_inflight (default: the config's, 256 as shipped).

1. B alone: `--b-requests` (4) requests one after another, prompts nobody has sent (every prefill
   is real); client-side TTFT, from the call to the first token message.
2. A's burst: `--clients` (64) streams of A at once (`--a-tokens` tokens each, EOS ignored); an A
   stream refused with RESOURCE_EXHAUSTED honours its pushback and tries again, as a client
   would. Once A's first tokens flow, B sends its requests again, one after another.
3. Q's quota, over HTTP: two requests back to back; the second must be 429 with a Retry-After
   that, slept, lets the third succeed.

Figures: B's TTFT p50 under the burst over B alone (target <= 2), A's and B's refusals
(router's ember:tenant_throttled_total, by tenant and reason), A's streams finished and their
tokens/s, the quota's Retry-After and whether honouring it worked.
"""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from ember.bench.measure import progress, write_result
from ember.bench.overload import prompt_ids

KEYS = {"A": "bench-key-tenant-a-0123456789", "B": "bench-key-tenant-b-0123456789",
        "Q": "bench-key-tenant-q-0123456789"}
QUOTA_WAIT_S = 10.0  # how long Q's second request would wait right after the first (the quota is sized for it): the
# first request's own time comes off it, so it must outlast that on a loaded host


def quota_for(request_tokens: int, wait_s: float = QUOTA_WAIT_S) -> int:
    """tokens/min such that, after one request of `request_tokens` (prompt + max_tokens), a second
    one waits ~wait_s: a bucket C refilling C/60 a second is short 2x - C of the second's x."""
    return math.floor(2 * request_tokens / (1 + wait_s / 60))


def write_config(source: Path, run_dir: Path, model: str, max_inflight: int | None, quota: int) -> Path:
    from ember.cluster.ports import on_free_ports
    path = run_dir / "cluster.yaml"
    data = on_free_ports(source, path, model)
    keys_file = run_dir / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": {key: tenant for tenant, key in KEYS.items()},
                                         "tenants": {"Q": {"tokens_per_min": quota}}}))
    router = data.setdefault("router", {})
    router["api_keys_file"] = str(keys_file)
    if max_inflight is not None:
        router["max_inflight"] = max_inflight
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


async def _stream(channel, tenant: str, prompt: list[int], max_tokens: int, retry: bool) -> dict:
    """One Generate stream of `tenant`; with `retry`, a RESOURCE_EXHAUSTED refusal is retried after
    its pushback. Its TTFT, tokens and refusals."""
    import grpc

    from ember.v1 import common_pb2, router_pb2, router_pb2_grpc
    request = router_pb2.GenerateRequest(tokens=router_pb2.TokenInput(token_ids=prompt),
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    metadata = (("authorization", f"Bearer {KEYS[tenant]}"),)
    refused = 0
    while True:
        start, first, tokens, final = time.perf_counter(), None, 0, None
        try:
            async for m in router_pb2_grpc.RouterStub(channel).Generate(request, metadata=metadata, timeout=600):
                if m.token_ids and first is None:
                    first = time.perf_counter() - start
                tokens += len(m.token_ids)
                final = m
            p, t = final.placement, final.timings
            return {"ok": True, "ttft_s": first, "tokens": tokens, "refused": refused,
                    "e2e_s": time.perf_counter() - start,
                    "server": {"ttft_s": round(t.ttft_s, 4), "prefill_s": round(t.prefill_s, 4),
                               "transfer_s": round(t.transfer_s, 4), "prefill_site": p.prefill_site,
                               "decode_site": p.decode_site, "reason": p.reason[:120],
                               "estimated_queue_s": round(p.estimated_queue_s, 4)}}
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or not retry:
                return {"ok": False, "code": e.code().name, "details": e.details(), "refused": refused}
            refused += 1
            pushback = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
            await asyncio.sleep(int(pushback) / 1000 if pushback else 1.0)


async def _b_requests(router: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    import grpc
    async with grpc.aio.insecure_channel(router) as channel:
        return [await _stream(channel, "B", p, max_tokens, retry=False) for p in prompts]


async def _burst_and_b(router: str, metrics: dict | str, a_prompts: list[list[int]], a_tokens: int,
                       b_prompts: list[list[int]], b_tokens: int) -> tuple[list[dict], list[dict], float]:
    """A's streams at once (one channel each); once A's first tokens flow, B's requests one by one.
    (A's results, B's results, seconds from the burst to B's first call)."""
    import grpc
    channels = [grpc.aio.insecure_channel(router) for _ in a_prompts]
    try:
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in channels)), 60)
        started = time.perf_counter()
        burst = [asyncio.ensure_future(_stream(c, "A", p, a_tokens, retry=True)) for c, p in zip(channels, a_prompts)]
        first = asyncio.ensure_future(_first_token_of_a(metrics))
        done, _ = await asyncio.wait([first, *burst], return_when=asyncio.FIRST_COMPLETED)
        b_at = time.perf_counter() - started
        b = await _b_requests(router, b_prompts, b_tokens)
        a = await asyncio.gather(*burst)
        first.cancel()
        return a, b, b_at
    finally:
        await asyncio.gather(*(c.close() for c in channels))


async def _first_token_of_a(metrics: dict | str) -> None:
    """Until the router has streamed a first token to A (its per-tenant TTFT histogram counts one)."""
    from ember.cluster.status import scrape
    while True:
        families = await asyncio.to_thread(scrape, metrics)
        if _sample(families, "ember:tenant_time_to_first_token_seconds_count", tenant="A") >= 1:
            return
        await asyncio.sleep(0.05)


def _sample(samples: dict[str, float], name: str, **labels) -> float:
    """The sum of `name`'s samples (ember.cluster.status.scrape's keys) carrying `labels`."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(value for key, value in samples.items()
               if key.startswith(name + "{") and all(w in key[len(name) + 1:-1].split(",") for w in wanted))


def quota_check(http: str, prompt_text_tokens: list[int], tok) -> dict:
    """Q's requests over HTTP: the second refused 429 with Retry-After; honoured, the third succeeds."""
    import urllib.error
    import urllib.request
    headers = {"Authorization": f"Bearer {KEYS['Q']}", "Content-Type": "application/json"}

    def call(method: str, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
        request = urllib.request.Request(f"http://{http}{path}", method=method, headers=headers,
                                         data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read() or b"{}")
    model = call("GET", "/v1/models")[2]["data"][0]["id"]
    body = {"model": model, "prompt": tok.decode(prompt_text_tokens), "max_tokens": 1}
    first, second = call("POST", "/v1/completions", body), call("POST", "/v1/completions", body)
    out = {"first_status": first[0], "second_status": second[0], "retry_after_s": second[1].get("Retry-After"),
           "second_error_code": (second[2].get("error") or {}).get("code")}
    if second[0] == 429 and second[1].get("Retry-After"):
        time.sleep(float(second[1]["Retry-After"]))  # honoured, as a client would
        out["after_retry_status"] = call("POST", "/v1/completions", body)[0]
    return out


def measure(router: str, http: str, metrics: str, tok, clients: int, a_tokens: int, b_requests: int,
            b_tokens: int, quota_prompt: list[int]) -> dict:
    from ember.cluster.status import scrape
    tag = time.strftime("%H%M%S")
    asyncio.run(_b_requests(router, prompt_ids(tok, f"warm{tag}", 2), b_tokens))  # one-time costs
    progress(f"B alone: {b_requests} requests one after another")
    alone = asyncio.run(_b_requests(router, prompt_ids(tok, f"balone{tag}", b_requests), b_tokens))
    progress(f"A's burst of {clients} streams x {a_tokens} tokens, B's {b_requests} requests meanwhile")
    before = scrape(metrics)
    started = time.perf_counter()
    a, b, b_at = asyncio.run(_burst_and_b(router, metrics, prompt_ids(tok, f"a{tag}", clients), a_tokens,
                                          prompt_ids(tok, f"bload{tag}", b_requests), b_tokens))
    burst_s = time.perf_counter() - started
    after = scrape(metrics)

    def throttled(tenant: str) -> dict[str, int]:
        return {reason: int(_sample(after, "ember:tenant_throttled_total", tenant=tenant, reason=reason)
                            - _sample(before, "ember:tenant_throttled_total", tenant=tenant, reason=reason))
                for reason in ("capacity", "max_inflight", "requests_per_s", "tokens_per_min")}
    progress("Q's tokens/min quota over HTTP")
    quota = quota_check(http, quota_prompt, tok)
    ok_alone = [r["ttft_s"] for r in alone if r["ok"]]
    ok_loaded = [r["ttft_s"] for r in b if r["ok"]]
    alone_p50 = statistics.median(ok_alone) if ok_alone else None
    loaded_p50 = statistics.median(ok_loaded) if ok_loaded else None
    a_ok = [r for r in a if r["ok"]]
    return {
        "clients": clients, "a_tokens": a_tokens, "b_requests": b_requests, "b_tokens": b_tokens,
        "b_alone_ttft_s": [round(r["ttft_s"], 4) for r in alone if r["ok"]],
        "b_loaded_ttft_s": [round(r["ttft_s"], 4) for r in b if r["ok"]],
        "b_alone_server": [r["server"] for r in alone if r["ok"]],
        "b_loaded_server": [r["server"] for r in b if r["ok"]],
        "b_alone_ttft_p50_s": round(alone_p50, 4) if alone_p50 else None,
        "b_loaded_ttft_p50_s": round(loaded_p50, 4) if loaded_p50 else None,
        "b_ttft_p50_ratio": round(loaded_p50 / alone_p50, 3) if alone_p50 and loaded_p50 else None,
        "b_errors": [f"{r.get('code')}: {r.get('details')}"[:200] for r in alone + b if not r["ok"]],
        "b_started_after_s": round(b_at, 3),
        "a_finished": len(a_ok), "a_errors": sorted({f"{r.get('code')}: {r.get('details')}"[:200]
                                                     for r in a if not r["ok"]}),
        "a_refusals_seen_by_clients": sum(r["refused"] for r in a),
        "a_tokens_per_s": round(sum(r["tokens"] for r in a_ok) / burst_s, 1),
        "burst_s": round(burst_s, 2),
        "throttled": {"A": throttled("A"), "B": throttled("B")},
        "quota": quota,
    }


def main(args) -> int:
    from ember.cluster.launcher import default_config, running
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    model = str(Path(args.model).resolve())
    source = Path(args.cluster_config).resolve() if args.cluster_config else default_config()
    tok = Tokenizer.from_folder(model_folder(model))
    clients, a_tokens, b_requests = (16, 16, 2) if args.quick else (args.clients or 64, 64, 4)
    quota_prompt = tok.encode("Count: " + " ".join(str(i) for i in range(60)))  # ~200 tokens
    quota = quota_for(len(quota_prompt) + 1)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        config = write_config(source, run_dir, model, args.max_inflight, quota)
        with running(config, run_dir, timeout_s=300) as cfg:
            services = json.loads((run_dir / "services.json").read_text())
            router = services["router"]["address"]
            metrics = services["router"]["metrics"]
            result = measure(router, cfg.router.http, metrics, tok, clients, a_tokens, b_requests, 16, quota_prompt)
    result |= {"config": str(source), "model": model, "router_max_inflight": args.max_inflight or "as configured",
               "quota_tokens_per_min": quota, "quota_request_tokens": len(quota_prompt) + 1,
               "wall_s": round(time.monotonic() - started, 1)}
    q = result["quota"]
    result["targets"] = {
        "B's TTFT p50 under A's burst / B alone": {"value": result["b_ttft_p50_ratio"], "target": 2.0,
                                                  "met": result["b_ttft_p50_ratio"] is not None
                                                  and result["b_ttft_p50_ratio"] <= 2.0},
        "B never refused, every B request served": {"value": sum(result["throttled"]["B"].values()),
                                                    "target": 0, "met": not result["b_errors"]
                                                    and sum(result["throttled"]["B"].values()) == 0},
        "over-quota request: 429 + Retry-After, honoured it succeeds": {
            "value": q, "target": "429 then 200",
            "met": q.get("second_status") == 429 and q.get("after_retry_status") == 200},
    }
    write_result(result, args.output)
    return 0
