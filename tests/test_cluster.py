"""The disaggregated path across real processes: router -> prefill -> kvstores -> decode."""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from ember.client import RouterClient
from ember.cluster import traces
from ember.cluster.launcher import wait_serving
from ember.cluster.status import scrape
from ember.cluster.traces import request_spans
from ember.engine.sampling_params import SamplingParams
from ember.kv import wire
from ember.kv.block_hash import chain_hashes
from ember.kv.chunks import split
from ember.rpc.server import CHANNEL_OPTIONS
from ember.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from tests.cluster_fixture import AT_ONCE_S, dial, wait_until, write_config
from tests.conftest import LONG_TEXT, PROMPTS


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster  # (conftest: one cluster for the modules that only send it requests)


@pytest.fixture(scope="module")
def client(cluster):
    with RouterClient(cluster["router"]) as c:
        yield c


def kv_stats(cluster: dict, key: str) -> kvstore_pb2.StatsResponse:
    with dial(cluster, key, options=CHANNEL_OPTIONS) as ch:
        return kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=10)


def decode_stats(cluster: dict, key: str = "decode") -> decode_pb2.DecodeStatsResponse:
    with dial(cluster, key) as ch:
        return decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.DecodeStatsRequest(), timeout=10)


def local_greedy(engine, ids: list[int], max_tokens: int) -> list[int]:
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0].token_ids


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[-1]], ids=["short", "long"])
def test_disaggregated_greedy_equals_local_engine_and_transformers(client, engine, hf_greedy, prompt):
    ids = engine.tokenizer.encode(prompt)
    out = client.complete(token_ids=ids, max_tokens=16, timeout=120)
    assert out.token_ids == local_greedy(engine, ids, 16)
    assert out.token_ids == hf_greedy(ids, 16)[:len(out.token_ids)]
    final = out.final
    assert final.finished and final.usage.prompt_tokens == len(ids)
    assert final.usage.completion_tokens == len(out.token_ids)
    assert final.placement.prefill_site == "central" and final.placement.decode_site == "edge"
    assert final.timings.ttft_s > 0 and final.timings.e2e_s >= final.timings.ttft_s
    if len(ids) > 1000:
        assert final.timings.transfer_s > 0


def test_chat_text_matches_local_engine(client, engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.complete(messages=messages, max_tokens=20, timeout=60)
    [want] = engine.generate([engine.tokenizer.apply_chat_template(messages)], SamplingParams(max_tokens=20))
    assert out.token_ids == want.token_ids and out.text == want.text and "Paris" in out.text


def test_16_concurrent_streams_are_all_correct(client, engine):
    prompts = [engine.tokenizer.encode(f"Fact number {i}: the {w} is") for i, w in
               enumerate(["sun", "moon", "sea", "river", "forest", "desert", "city", "mountain"] * 2)]
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda ids: client.complete(token_ids=ids, max_tokens=12, timeout=180), prompts))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == local_greedy(engine, ids, 12)


def test_second_turn_moves_only_new_blocks(client, cluster, engine):
    turn1 = engine.tokenizer.encode(LONG_TEXT[:1600] + "\nQ: How many boats?")
    before, decode_before = kv_stats(cluster, "kv_edge"), decode_stats(cluster)
    first = client.complete(token_ids=turn1, max_tokens=8, ignore_eos=True, timeout=120)
    mid = kv_stats(cluster, "kv_edge")
    turn2 = turn1 + first.token_ids + engine.tokenizer.encode("\nQ: And what rose higher than anyone remembered?")
    second = client.complete(token_ids=turn2, max_tokens=8, ignore_eos=True, timeout=120)
    after = kv_stats(cluster, "kv_edge")
    block_bytes = wire.frame_bytes(16 * 46080)  # fp32 KV + the frame header
    assert mid.blocks_pulled - before.blocks_pulled == len(turn1) // 16
    # Turn 2 needs its new full blocks. The first of them (turn 1's tail + its answer) was
    # computed by decode itself and is still in its pool, so at most the rest crosses.
    new_blocks = len(turn2) // 16 - len(turn1) // 16
    pulled = after.blocks_pulled - mid.blocks_pulled
    assert 1 <= pulled <= new_blocks, "only the delta crosses sites"
    assert after.bytes_pulled - mid.bytes_pulled == pulled * block_bytes
    # prefill computed only what was not cached: all of turn 1's full blocks were reused
    assert second.final.usage.cached_tokens == (len(turn1) // 16) * 16
    [want] = engine.generate([turn2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert second.token_ids == want.token_ids
    # same host: decode read every pulled frame straight out of its kvstore's shared arena
    decode_after = decode_stats(cluster)
    assert decode_after.blocks_shared_memory - decode_before.blocks_shared_memory == after.blocks_pulled - \
        before.blocks_pulled
    assert decode_after.blocks_grpc == decode_before.blocks_grpc
    assert after.pinned_blocks == 0 and after.leases == 0, "decode released its lease"
    # the router read the (in-memory) block directory: both sites hold turn 1's blocks (the edge perhaps one
    # more: decode's background write-back of the block its answer filled may land before turn 2's lookup)
    cached = dict(second.final.placement.cached_blocks)
    assert cached["central"] == len(turn1) // 16 and cached["edge"] in (len(turn1) // 16, len(turn1) // 16 + 1), cached


@pytest.mark.parametrize("kwargs, field", [
    ({"text": ""}, "input"),
    ({"token_ids": [5] * 8190, "max_tokens": 50}, "context length"),
    ({"text": "hi", "temperature": -1.0}, "temperature"),
    ({"text": "hi", "top_p": 1.5}, "top_p"),
    ({"text": "hi", "max_tokens": 0}, "max_tokens"),
    ({}, "input"),
    ({"text": "hi", "json_schema": '{"type": "bogus"}'}, "constraint"),
    ({"text": "hi", "regex": "(unclosed"}, "constraint"),
    ({"text": "hi", "logprobs": 21}, "logprobs"),
    ({"text": "hi", "logit_bias": {10**6: 1.0}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": "x"}], "tool_choice": "required"},
     "tool"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x", "function": "x"}]},
                   {"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "chat"),
])
def test_invalid_requests_are_invalid_argument(client, kwargs, field):
    with pytest.raises(grpc.RpcError) as e:
        list(client.stream(**kwargs, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}


def test_constrained_output_over_grpc_through_prefill_and_decode(client, engine):
    """Prefill samples the first token under the grammar, decode continues its state: the disaggregated
    answer equals the local engine's, token for token, and parses; logprobs come along."""
    import json

    from ember.engine.sampling_params import Constraint
    ask = [{"role": "user", "content": "Weather in Oslo, as JSON."}]
    out = client.complete(messages=ask, json_schema=WEATHER, temperature=1.0, seed=9, max_tokens=80, logprobs=2,
                          timeout=120)
    prompt = engine.tokenizer.apply_chat_template(ask)
    want = engine.generate([prompt], SamplingParams(max_tokens=80, temperature=1.0, seed=9, logprobs=2,
                                                    constraint=Constraint("json_schema", json.dumps(WEATHER))))[0]
    assert out.token_ids == want.token_ids and out.final.finish_reason == "stop"
    assert json.loads(out.text)["unit"] in ("celsius", "fahrenheit")
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-3)


def test_tool_calls_over_grpc(client):
    import json
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    out = client.complete(messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=tools,
                          tool_choice="get_weather", temperature=1.0, seed=4, max_tokens=80, timeout=120)
    assert out.final.finish_reason == "tool_calls" and out.text == ""
    [call] = out.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(json.loads(call["arguments"])) == {"city", "unit"}


def test_unknown_model_is_not_found(cluster):
    from ember.v1 import common_pb2, router_pb2, router_pb2_grpc
    with grpc.insecure_channel(cluster["router"]) as ch:
        req = router_pb2.GenerateRequest(model="gpt-17", text="hi", sampling=common_pb2.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.RpcError) as e:
            list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "model" in e.value.details()


def spans_of(cluster, request_id: str, service: str, timeout_s: float = 10) -> list[dict]:
    """The SERVER spans `service` exported for `request_id` (ember.request_id), once there are any."""
    return wait_until(lambda: request_spans(cluster["run_dir"], request_id, service), timeout_s,
                      f"{service} exporting a span for {request_id}")


def aborted(cluster, reason: str) -> float:
    import json
    services = json.loads((Path(cluster["config"]).parent / "services.json").read_text())
    metrics = scrape(services["decode-edge"]["metrics"], AT_ONCE_S)
    return metrics.get(f'ember:requests_aborted_total{{reason="{reason}"}}', 0)


def test_the_clients_deadline_reaches_prefill_and_decode_and_ends_the_stream_there(client, cluster):
    """The router forwards the caller's time left: prefill and decode receive a deadline within the
    client's, decode's handler ends at it (aborted: deadline) and the engine frees the sequence
    at once, whatever the length of the request (2000 tokens would take minutes here)."""
    before, timeout_s = aborted(cluster, "deadline"), 5.0  # (router, prefill and decode's call inside it, loaded)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(client.stream(text="Count from one to one thousand:", max_tokens=2000, ignore_eos=True,
                           request_id="deadline-1", timeout=timeout_s))
    ended_s = time.monotonic() - start
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and ended_s < timeout_s + AT_ONCE_S, ended_s
    wait_for_idle_decode(cluster, timeout_s=AT_ONCE_S)
    [prefill] = spans_of(cluster, "deadline-1", "prefill")
    [decode] = spans_of(cluster, "deadline-1", "decode")
    got_prefill, got_decode = prefill["attributes"]["ember.deadline_s"], decode["attributes"]["ember.deadline_s"]
    # (gRPC rounds a timeout up a little on the wire: 5 s left can arrive as 5.009)
    assert 0 < got_decode < got_prefill <= timeout_s + 0.1, (got_prefill, got_decode)
    # decode was called once prefill had answered: its deadline is prefill's, less the time gone by
    gap_s = (decode["start_ns"] - prefill["start_ns"]) / 1e9
    assert abs(got_decode - (got_prefill - gap_s)) < 1.0, (got_prefill, got_decode, gap_s)
    assert decode["attributes"]["ember.aborted"] == "deadline" and "ember.finish_reason" not in decode["attributes"]
    assert decode["attributes"]["ember.tokens_sent"] < 2000
    assert aborted(cluster, "deadline") - before == 1


def test_client_cancel_mid_stream_aborts_the_sequence_at_decode_at_once(client, cluster):
    before = aborted(cluster, "cancelled")
    stream = client.stream(text="Write a long story about a dragon.", max_tokens=2000, ignore_eos=True,
                           request_id="cancel-1", timeout=120)
    got = 0
    for msg in stream:
        got += len(msg.token_ids)
        if got >= 5:
            break
    busy = decode_stats(cluster)
    assert busy.running == 1 and busy.used_blocks > 0
    cancelled_at = time.monotonic()
    stream.cancel()
    wait_for_idle_decode(cluster, timeout_s=AT_ONCE_S)  # sequence and blocks freed, at once (not after 2000 tokens)
    print(f"decode idle {time.monotonic() - cancelled_at:.2f} s after the cancel")
    [decode] = spans_of(cluster, "cancel-1", "decode")
    assert decode["attributes"]["ember.aborted"] == "cancelled" and decode["attributes"]["ember.tokens_sent"] < 2000
    assert aborted(cluster, "cancelled") - before == 1


def wait_for_idle_decode(cluster: dict, timeout_s: float = 20) -> None:
    wait_until(lambda: (s := decode_stats(cluster)).running == 0 and s.waiting == 0 and s.used_blocks == 0,
               timeout_s, "decode back to idle (no sequence running or waiting, no block used)")


def test_decode_refuses_a_block_made_for_another_model_imports_nothing_and_recomputes(cluster, engine):
    ids = engine.tokenizer.encode("A block forged for another model must never be imported. " * 6)
    hashes = chain_hashes(ids, 16, engine.block_manager.root_hash)[:2]
    foreign = replace(engine.frame_template, root_hash=b"\x99" * 16)  # same shapes, another model
    frames = [(h, wire.encode_frame(foreign, h, bytes(engine.layout.block_bytes))) for h in hashes]
    with dial(cluster, "kv_edge", "prefill-central", options=CHANNEL_OPTIONS) as ch:  # a KV producer's certificate
        chunks = (kvstore_pb2.BlockChunk(block_hash=h, block_bytes=n, offset=o, data=d) for h, n, o, d in split(frames))
        assert kvstore_pb2_grpc.KVStoreStub(ch).Put(chunks, timeout=30).blocks_stored == 2  # bytes to the store
    before = decode_stats(cluster)
    request = decode_pb2.DecodeRequest(request_id="forged", prompt_token_ids=ids, first_token=5, block_hashes=hashes,
                                       source_kvstore=cluster["kv_central"],
                                       sampling=common_pb2.SamplingParams(max_tokens=4))
    with dial(cluster, "decode", "router") as ch:  # kvstore.on_transfer_failure: recompute (the default)
        out = list(decode_pb2_grpc.DecodeStub(ch).Decode(request, timeout=60))
    rid = engine.add_request(ids, SamplingParams(max_tokens=4), output_prefix=[5])  # the same forced first token
    want = []
    while engine.has_unfinished():
        want += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert [t for m in out for t in m.token_ids] == want, "the foreign blocks were refused, the prompt computed"
    assert out[0].recomputed_tokens == len(ids) + 1 and out[0].blocks_pulled == 0
    after = decode_stats(cluster)
    assert after.used_blocks == before.used_blocks == 0 and after.running == 0
    assert kv_stats(cluster, "kv_edge").leases == 0, "the lease was released on the error path"


def test_decode_refuses_token_ids_outside_the_vocabulary(cluster, engine):
    """A first token or prompt token past the vocabulary is INVALID_ARGUMENT (it was INTERNAL: IndexError)."""
    ids, vocab = engine.tokenizer.encode("hello there"), engine.loaded.args.vocab_size
    bad = [dict(prompt_token_ids=ids, first_token=vocab), dict(prompt_token_ids=ids, output_prefix=[5, vocab + 7]),
           dict(prompt_token_ids=ids[:1] + [vocab], first_token=5)]
    with dial(cluster, "decode", "router") as ch:
        for fields in bad:
            request = decode_pb2.DecodeRequest(request_id="bad-token", sampling=common_pb2.SamplingParams(max_tokens=4),
                                               **fields)
            with pytest.raises(grpc.RpcError) as e:
                list(decode_pb2_grpc.DecodeStub(ch).Decode(request, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and str(vocab) in e.value.details(), fields
    assert decode_stats(cluster).running == 0


def test_a_pull_naming_a_source_outside_the_config_is_refused_and_never_dialled(cluster):
    """A kvstore dials only the kvstores its config names: a Pull whose source is any other
    address is PERMISSION_DENIED, and that address sees no connection at all."""
    import socket
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        elsewhere = f"127.0.0.1:{listener.getsockname()[1]}"
        with dial(cluster, "kv_edge", "decode-edge") as ch:  # the engine that may ask for pulls
            with pytest.raises(grpc.RpcError) as e:
                kvstore_pb2_grpc.KVStoreStub(ch).Pull(
                    kvstore_pb2.PullRequest(block_hashes=[b"\x01" * 16], source=elsewhere, lease_s=5), timeout=20)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not a kvstore" in e.value.details()
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody ever connected
    assert kv_stats(cluster, "kv_edge").leases == 0


def test_concurrent_streams_survive_one_cancel(client, engine):
    ids = engine.tokenizer.encode(PROMPTS[2])
    results = {}

    def run():
        results["out"] = client.complete(token_ids=ids, max_tokens=12, timeout=120)
    t = threading.Thread(target=run)
    t.start()
    stream = client.stream(text="Another request that will be cancelled", max_tokens=100, timeout=60)
    next(iter(stream))
    stream.cancel()
    t.join(timeout=120)
    assert results["out"].token_ids == local_greedy(engine, ids, 12)


def test_router_with_a_dead_prefill_answers_unavailable_not_a_hang(tmp_path, model_path):
    from ember.cluster.certs import write_cluster_certs
    from ember.cluster.launcher import spawn
    from ember.config.load import load_config
    addr = write_config(tmp_path / "cluster.yaml")  # only the router runs: its peers are dead ports
    write_cluster_certs(load_config(tmp_path / "cluster.yaml"), tmp_path / "certs")
    argv = [sys.executable, "-m", "ember.services.router", "--config", str(tmp_path / "cluster.yaml")]
    proc = spawn(tmp_path, "router", argv, {"EMBER_TLS_DIR": str(tmp_path / "certs" / "router")})
    try:
        wait_serving(addr["router"], time.monotonic() + 60, proc, tmp_path / "router.log")
        start = time.monotonic()
        with RouterClient(addr["router"]) as c, pytest.raises(grpc.RpcError) as e:
            list(c.stream(text="hello", max_tokens=4, timeout=30))
        answered_s = time.monotonic() - start
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and answered_s < 20, answered_s  # (its deadline: 30 s)
    finally:
        proc.kill()
        proc.wait(timeout=20)


def test_sigterm_drains_the_router(exact_cluster, tmp_path, engine):
    """NOT_SERVING at once, still served for the notice, then new calls refused while the in-flight
    stream runs to completion with the undisturbed tokens; exit 0 (tests/test_drain.py: the others).
    A second router in front of the same cluster (no HTTP)."""
    from tests.test_drain import drain, engine_core
    ids = engine.tokenizer.encode(PROMPTS[2])
    core = engine_core(exact_cluster.cluster, "decode-edge")
    with exact_cluster.cluster.second_router(tmp_path) as (router, proc), RouterClient(router["listen"]) as c:
        def probe():  # a new call, answered by the router itself (no tokens spent)
            try:
                c.complete(text="", max_tokens=4, timeout=AT_ONCE_S)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
        stream = c.stream(token_ids=ids, max_tokens=40, ignore_eos=True, timeout=60)
        tokens = list(next(stream).token_ids)
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(lambda: [msg for msg in stream])
            # held (decode's engine core frozen) until the refusal is seen: however fast this machine
            # decodes the 40 tokens, the stream is still in flight when new calls are refused
            core.suspend()
            try:
                print(drain(proc, router["listen"], in_flight, probe, public=True, finish=core.resume))
            finally:
                core.resume()
            rest = in_flight.result()
    tokens += [t for msg in rest for t in msg.token_ids]
    assert len(tokens) == 40 and rest[-1].finished, "the in-flight stream ran to completion"
    [want] = engine.generate([ids], SamplingParams(max_tokens=40, ignore_eos=True))
    assert tokens == want.token_ids


def test_one_request_is_one_trace_across_all_four_services(client, cluster, engine):
    run_dir = Path(cluster["config"]).parent
    ids = engine.tokenizer.encode("Tracing one request through every service: " + LONG_TEXT[:500])
    out = client.complete(token_ids=ids, max_tokens=4, request_id="traced-1", timeout=120)
    assert len(out.token_ids) == 4

    [root] = wait_until(lambda: request_spans(run_dir, "traced-1", "router"), 10, "the router's span exported")

    def whole():  # (decode's write-back of its answer may still be finishing: its spans land last)
        spans = traces.trace(run_dir, root["trace_id"])
        ids = {s["span_id"] for s in spans}
        return spans if all(s["parent_id"] in ids for s in spans if s["span_id"] != root["span_id"]) else None
    trace = wait_until(whole, AT_ONCE_S, "every span of the trace exported")
    services = {s["service"] for s in trace}
    assert {"router", "prefill", "kvstore-central", "kvstore-edge", "decode"} <= services, services
    by_id = {s["span_id"]: s for s in trace}
    # span names are opentelemetry-instrumentation-grpc's: the full method, a SERVER span per
    # call received and a CLIENT span per call made
    assert root["parent_id"] is None and root["name"] == "/ember.v1.Router/Generate" and root["kind"] == "SERVER"
    for s in trace:
        if s["span_id"] != root["span_id"]:
            assert s["parent_id"] in by_id, f"{s['service']}:{s['name']} hangs off nothing in the trace"
    named = {(s["service"], s["name"], s["kind"]): s for s in trace}
    placement = named[("router", "placement", "INTERNAL")]["attributes"]
    assert placement["ember.prefill_site"] == "central" and placement["ember.decode_site"] == "edge"
    prefill = named[("prefill", "/ember.v1.Prefill/Prefill", "SERVER")]
    call = named[("router", "/ember.v1.Prefill/Prefill", "CLIENT")]
    assert prefill["parent_id"] == call["span_id"] and call["parent_id"] == root["span_id"]
    assert prefill["attributes"]["ember.tokens_computed"] + prefill["attributes"]["ember.tokens_cached"] == len(ids)
    pull = named[("kvstore-edge", "/ember.v1.KVStore/Pull", "SERVER")]
    assert pull["attributes"]["ember.blocks_requested"] == len(ids) // 16 and "ember.codec" in pull["attributes"]
    assert by_id[pull["parent_id"]]["service"] == "decode", "decode's call to its kvstore is a child of decode"
    decode_span = named[("decode", "/ember.v1.Decode/Decode", "SERVER")]
    assert by_id[decode_span["parent_id"]]["parent_id"] == root["span_id"], "router -> Decode call -> decode"
    decode = decode_span["attributes"]
    assert decode["ember.completion_tokens"] == 4 and decode["ember.tpot_s"] > 0
    assert root["attributes"]["ember.completion_tokens"] == 4


def test_ember_trace_prints_the_disaggregated_request_span_by_span(client, cluster, engine):
    """`ember trace REQUEST_ID` on a request prefilled at central and decoded at edge: one trace holding
    the router, prefill (its queue wait, each chunk, the KV write to its site store), the edge kvstore's
    pull of the blocks from central (bytes, link) and decode (import, admission, its decode phase as
    one span with its step count), the engine cores' spans joined through the carried context."""
    import subprocess
    import uuid

    from ember.engine.config import EngineConfig
    run_dir = Path(cluster["run_dir"])
    rid = f"traced-tree-{uuid.uuid4().hex[:8]}"
    # uncached (a fresh prefix) and longer than a step's token budget (1024): two prefill chunks at least
    ids = engine.tokenizer.encode(f"Trace {rid}: " + LONG_TEXT)[:1400]
    assert len(ids) > EngineConfig.model_fields["max_num_batched_tokens"].default  # (the cluster's step budget)
    out = client.complete(token_ids=ids, max_tokens=8, ignore_eos=True, request_id=rid, timeout=180)
    assert len(out.token_ids) == 8 and out.final.placement.decode_site == "edge"

    def landed():  # every span written (the cores' too), none waiting for its parent's
        found = traces.request_traces(run_dir, rid)
        if len(found) != 1:
            return None
        [spans] = found.values()
        names = {(s["service"], s["name"]) for s in spans}
        ids_ = {s["span_id"] for s in spans}
        wanted = {("router", "/ember.v1.Router/Generate"), ("prefill", "engine.prefill_chunk"),
                  ("prefill", "kv.store"), ("kvstore-edge", "kv.pull"), ("decode", "kv.import"),
                  ("decode", "engine.decode"), ("kvstore-central", "/ember.v1.KVStoreBulk/Put")}
        if wanted <= names and all(s["parent_id"] in ids_ for s in spans if s["name"] != "/ember.v1.Router/Generate"):
            return spans
        return None
    spans = wait_until(landed, AT_ONCE_S, f"the spans of {rid} exported")
    by_id = {s["span_id"]: s for s in spans}

    def one(service: str, name: str, kind: str = "INTERNAL") -> dict:
        [span] = [s for s in spans if (s["service"], s["name"], s["kind"]) == (service, name, kind)]
        return span

    def under(span: dict, ancestor: dict) -> bool:
        while span["parent_id"] is not None:
            span = by_id[span["parent_id"]]
            if span is ancestor:
                return True
        return False
    root = one("router", "/ember.v1.Router/Generate", "SERVER")
    prefill = one("prefill", "/ember.v1.Prefill/Prefill", "SERVER")
    decode = one("decode", "/ember.v1.Decode/Decode", "SERVER")
    assert under(prefill, root) and under(decode, root)
    # prefill: queued, then its chunks (all its prompt, computed), then its blocks written to its site store
    queue = one("prefill", "engine.queue")
    assert queue["process"] == "engine-core" and queue["parent_id"] == prefill["span_id"]
    assert queue["attributes"]["ember.queue_wait_s"] >= 0
    chunks = sorted((s for s in spans if s["name"] == "engine.prefill_chunk" and s["service"] == "prefill"),
                    key=lambda s: s["attributes"]["ember.chunk"])
    assert len(chunks) >= 2 and all(c["parent_id"] == prefill["span_id"] for c in chunks)
    assert sum(c["attributes"]["ember.tokens"] for c in chunks) == len(ids)
    assert chunks[-1]["attributes"]["ember.prompt_tokens_done"] == len(ids)
    store = one("prefill", "kv.store")
    assert under(store, prefill) and store["attributes"]["ember.blocks"] == len(ids) // 16
    assert store["attributes"]["ember.bytes"] > 0 and store["attributes"]["ember.blocks_stored"] == len(ids) // 16
    assert under(one("kvstore-central", "/ember.v1.KVStoreBulk/Put", "SERVER"), store)
    # the edge kvstore pulls the blocks from central, inside decode's load
    load = one("decode", "kv.load")
    assert load["parent_id"] == decode["span_id"] and load["process"] == "engine-core"
    pull = one("kvstore-edge", "kv.pull")
    assert under(pull, one("kvstore-edge", "/ember.v1.KVStore/Pull", "SERVER")) and under(pull, load)
    a = pull["attributes"]
    assert a["ember.link"] == "central -> edge" and a["ember.source_site"] == "central"
    assert a["ember.source"] == cluster["kv_central"] and a["ember.blocks"] == len(ids) // 16
    assert a["ember.bytes"] > 0 and a["ember.bytes"] == load["attributes"]["ember.bytes_pulled"]
    assert a["ember.via"] in ("data plane", "grpc")
    imported = one("decode", "kv.import")
    assert imported["attributes"]["ember.blocks"] == len(ids) // 16 and imported["attributes"]["ember.bytes"] > 0
    admitted = one("decode", "engine.queue")
    assert imported["start_ns"] <= admitted["start_ns"] and "ember.queue_wait_s" in admitted["attributes"]
    steps = one("decode", "engine.decode")  # one span for the whole decode phase, not one per step
    assert steps["parent_id"] == decode["span_id"] and steps["attributes"]["ember.tokens"] == 8
    assert 1 <= steps["attributes"]["ember.steps"] <= 7 and steps["attributes"]["ember.step_s_max"] > 0

    cli = subprocess.run([sys.executable, "-m", "ember.cli", "trace", rid, "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    print(cli.stdout)
    lines = cli.stdout.splitlines()
    assert lines[0].startswith(f"trace {root['trace_id']}  request {rid}") and sum(
        line.startswith("trace ") for line in lines) == 1, "one trace, the router's"

    def line_of(text: str) -> tuple[int, str]:
        [found] = [(i, line) for i, line in enumerate(lines) if text in line]
        return found

    def depth(line: str) -> int:
        body = line.split(" ms  ", 1)[1]
        return (len(body) - len(body.lstrip(" "))) // 2
    _, router_line = line_of("router: /ember.v1.Router/Generate [server]")
    i, prefill_line = line_of("prefill: /ember.v1.Prefill/Prefill [server]")
    _, queue_line = line_of("prefill/core: engine.queue")
    chunk_lines = [line for line in lines if "prefill/core: engine.prefill_chunk" in line]
    _, pull_line = line_of("kvstore-edge: kv.pull")
    _, steps_line = line_of("decode/core: engine.decode")
    assert depth(router_line) == 0 and depth(prefill_line) == 2 and depth(queue_line) == 3
    assert len(chunk_lines) == len(chunks) and all(depth(c) == 3 and "tokens=" in c for c in chunk_lines)
    assert "queue_wait_s=" in queue_line and f"blocks={len(ids) // 16}" in line_of("prefill/core: kv.store")[1]
    assert "link=central -> edge" in pull_line and f"bytes={a['ember.bytes']}" in pull_line
    assert f"bytes_pulled={a['ember.bytes']}" in line_of("decode/core: kv.load")[1]
    assert "decode/core: kv.import" in cli.stdout and "decode/core: engine.queue" in cli.stdout
    assert f"steps={steps['attributes']['ember.steps']}" in steps_line and "tokens=8" in steps_line

    unknown = subprocess.run([sys.executable, "-m", "ember.cli", "trace", "no-such-request", "--run-dir", str(run_dir)],
                             capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 1 and "no span" in unknown.stderr and "no-such-request" in unknown.stderr


def test_metrics_move_with_a_request(client, cluster, engine):
    import json
    services = json.loads((Path(cluster["config"]).parent / "services.json").read_text())
    names = ("router", "prefill-central", "decode-edge", "kvstore-central", "kvstore-edge")
    before = {n: scrape(services[n]["metrics"], AT_ONCE_S) for n in names}
    ids = engine.tokenizer.encode("Metrics should move: " + LONG_TEXT[900:1400])
    out = client.complete(token_ids=ids, max_tokens=5, ignore_eos=True, timeout=120)
    assert len(out.token_ids) == 5
    after = {n: scrape(services[n]["metrics"], AT_ONCE_S) for n in names}

    def moved(service: str, key: str) -> float:
        return after[service].get(key, 0) - before[service].get(key, 0)
    assert moved("router", "ember:time_to_first_token_seconds_count") == 1
    assert moved("router", "ember:e2e_request_latency_seconds_count") == 1
    assert moved("router", "ember:time_per_output_token_seconds_count") == 1
    assert moved("router", "ember:generation_tokens_total") == 5
    assert moved("router", "ember:prompt_tokens_total") == len(ids)
    assert moved("router", 'ember:request_success_total{finished_reason="length"}') == 1
    assert moved("router", "ember:inter_token_latency_seconds_count") >= 1
    assert moved("prefill-central", "ember:prefix_cache_queries_total") == len(ids)
    assert moved("decode-edge", "ember:prefix_cache_hits_total") >= len(ids) // 16 * 16
    assert "ember:kv_cache_usage_perc" in after["decode-edge"] and "ember:num_requests_running" in after["decode-edge"]
    assert moved("kvstore-central", 'ember:kvstore_bytes_in_total{via="put"}') > 0
    assert moved("kvstore-edge", 'ember:kvstore_bytes_in_total{via="pull"}') > 0
    assert moved("kvstore-central", "ember:kvstore_bytes_out_total") > 0
    assert moved("kvstore-edge", "ember:kvstore_pull_throughput_bytes_per_second_count") == 1


def test_errors_are_counted_by_status(client, cluster):
    import json
    services = json.loads((Path(cluster["config"]).parent / "services.json").read_text())
    key = 'ember:request_errors_total{code="INVALID_ARGUMENT",method="/ember.v1.Router/Generate"}'
    before = scrape(services["router"]["metrics"], AT_ONCE_S).get(key, 0)
    with pytest.raises(grpc.RpcError):
        client.complete(text="", max_tokens=4, timeout=30)
    assert scrape(services["router"]["metrics"], AT_ONCE_S).get(key, 0) - before == 1


def test_ember_status_shows_health_load_and_kv(cluster):

    from ember.cli import main
    run_dir = Path(cluster["config"]).parent
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "--run-dir", str(run_dir)]) == 0
    health, memory = out.getvalue().split("\n\n")
    lines = health.splitlines()
    assert lines[0].split()[:3] == ["service", "address", "health"]
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert set(by_name) == {"router", "prefill-central", "decode-edge", "kvstore-central", "kvstore-edge"}
    assert all(" SERVING " in line for line in by_name.values())
    assert "%" in by_name["decode-edge"], "decode shows its KV pool usage"
    # resident memory by part: every service's own process, and each engine service's core
    rows = [line.split() for line in memory.splitlines()[2:]]
    assert {(r[0], r[1]) for r in rows} == {(n, "service") for n in by_name} | {
        ("prefill-central", "engine-core"), ("decode-edge", "engine-core")}
    weights = {r[0]: float(r[3]) for r in rows if r[1] == "engine-core"}
    assert all(w > 0 for w in weights.values()), weights
    # every table above came over /metrics behind mTLS (tls: auto's default): the operator's certificate
    import json
    endpoints = [i["metrics"] for i in json.loads((run_dir / "services.json").read_text()).values() if i["metrics"]]
    assert endpoints and all(e["scheme"] == "https" and e["cert"].endswith("operator/tls.crt") for e in endpoints)
    assert all(scrape(e["address"], AT_ONCE_S) == {} for e in endpoints), "no plaintext, unauthenticated scrape"


def test_service_logs_are_json_with_request_ids(client, cluster):
    import json
    client.complete(text="Log this request.", max_tokens=3, request_id="logged-1", timeout=60)
    records = [json.loads(line) for line in (Path(cluster["config"]).parent / "router.log").read_text().splitlines()
               if line.startswith("{")]
    mine = [r for r in records if r.get("request_id") == "logged-1"]
    assert mine and all(r["service"] == "router" for r in mine)
    assert any("prefill@central decode@edge" in r["message"] for r in mine)
