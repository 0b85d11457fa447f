"""Input limits: what every RPC refuses before doing the work (ember.rpc.validate), the router's
text cap, the OpenAI API's caps, and, on a real cluster, huge requests (10,000 stop strings,
8 MiB of text) refused fast (REFUSED_FAST_S) while a co-running stream's inter-token p90 stays within 2x."""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from ember.errors import InvalidRequestError
from ember.rpc import validate
from ember.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.cluster_fixture import AT_ONCE_S
from tests.conftest import PROMPTS
from tests.test_cluster import cluster  # noqa: F401 - this module's own real cluster

EIGHT_MIB_TEXT = "word " * (8 * 2**20 // 5)
# A refusal does none of the work it refuses: tokenizing EIGHT_MIB_TEXT alone takes ~7 s on this host,
# a refusal 5-100 ms when it is quiet; the bound leaves a loaded CI host room and still tells them apart.
REFUSED_FAST_S = 2.0
MANY_STOPS = [f"stop{i}" for i in range(10_000)]


# -- ember.rpc.validate ---------------------------------------------------------------------------
@pytest.mark.parametrize("sampling, field", [
    (dict(max_tokens=4, stop=MANY_STOPS), "sampling.stop"),
    (dict(max_tokens=4, stop=["x" * 300]), "sampling.stop[0]"),
    (dict(max_tokens=4, stop_token_ids=list(range(300))), "sampling.stop_token_ids"),
    (dict(max_tokens=4, stop_token_ids=[100]), "outside the vocabulary"),
    (dict(max_tokens=4, temperature=float("inf")), "sampling.temperature"),
    (dict(max_tokens=4, top_p=float("nan")), "sampling.top_p"),
    (dict(max_tokens=5000), "context length"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=4, seed=2**63), "seed"),
])
def test_sampling_caps(sampling, field):
    with pytest.raises(InvalidRequestError) as e:
        validate.sampling(common_pb2.SamplingParams(**sampling), vocab_size=100, max_model_len=4096)
    assert field in str(e.value)


def test_sampling_within_the_caps_is_accepted():
    pb = common_pb2.SamplingParams(max_tokens=4096, stop=["x" * 256] * 64, stop_token_ids=[99] * 256, seed=7)
    p = validate.sampling(pb, vocab_size=100, max_model_len=4096)
    assert p.max_tokens == 4096 and len(p.stop) == 64 and p.seed == 7


def test_hashes_addresses_ids_leases():
    assert validate.block_hashes([b"\1" * 16]) == [b"\1" * 16]
    for bad in ([b"\1" * 15], [b"\1" * 17], [b""]):
        with pytest.raises(InvalidRequestError, match="a block hash is 16"):
            validate.block_hashes(bad)
    with pytest.raises(InvalidRequestError, match="at most"):
        validate.block_hashes([b"\1" * 16] * 3, limit=2)
    for good in ("", "127.0.0.1:5000", "kvstore-edge.default.svc:50051", "[::1]:7"):
        assert validate.address(good, "source") == good
    for bad in ("nowhere", "a:b", "x:0", "x:70000", "a b:1", "\0:1"):
        with pytest.raises(InvalidRequestError, match="HOST:PORT"):
            validate.address(bad, "source")
    assert validate.token_ids([0, 99], 100, "ids") == [0, 99]
    with pytest.raises(InvalidRequestError, match=r"token id 100 is outside the vocabulary \[0, 100\)"):
        validate.token_ids([0, 100], 100, "ids")
    with pytest.raises(InvalidRequestError, match="context length is 2"):
        validate.token_ids([0, 1, 2], 100, "ids", max_len=2)
    with pytest.raises(InvalidRequestError, match="request_id"):
        validate.name("r" * 257, "request_id")
    for bad in (0.0, 0.001, -1.0, float("nan")):
        with pytest.raises(InvalidRequestError, match="lease_s"):
            validate.lease_s(bad)
    assert validate.lease_s(0.2) == 0.2


def test_text_cap_is_what_could_fit_the_context(model_path):
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    from ember.services.router.service import text_cap
    tokenizer = Tokenizer.from_folder(model_folder(model_path))
    cap, why = text_cap(tokenizer, 8192)
    assert cap == 8192 * (81 + 4) and "8192 tokens" in why  # SmolLM2: "\n" + 80 spaces is its longest token
    assert text_cap(tokenizer, 10**6)[0] == validate.MAX_TEXT_BYTES
    # the densest text there is, the longest token repeated, still needs a token per longest + 4 bytes
    longest = max(tokenizer.backend.decode_batch([[i] for i in range(tokenizer.vocab_size)],
                                                 skip_special_tokens=False), key=lambda t: len(t.encode()))
    assert len((longest * 100).encode()) / len(tokenizer.encode(longest * 100)) <= cap / 8192


# -- the OpenAI HTTP API, before anything reaches the router ---------------------------------------
class _Router:
    model_id, max_model_len = "fake-model", 2048

    def __init__(self):
        self.requests = []

    async def Generate(self, request, context):
        self.requests.append(request)
        yield router_pb2.GenerateResponse(text="ok", finished=True, finish_reason="stop",
                                          usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1))


async def _post(service, body: bytes) -> tuple[int, dict, float]:
    from aiohttp.test_utils import TestClient, TestServer

    from ember.services.router.openai_http import OpenAIApp
    async with TestClient(TestServer(OpenAIApp(service).app)) as client:
        start = time.perf_counter()
        response = await client.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        return response.status, await response.json(), time.perf_counter() - start


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "stop": MANY_STOPS}, "stop"),
    ({"messages": USER, "stop": ["x" * 1000]}, "stop.0"),
    ({"messages": USER, "logit_bias": {str(i): 1 for i in range(10_000)}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"5": 1000}}, "logit_bias.5"),
    ({"messages": USER * 5000}, "messages"),
    ({"messages": USER, "tools": [{}] * 1000}, "tools"),
    ({"messages": USER, "user": "u" * 1000}, "user"),
    ({"messages": USER, "session_id": "s" * 1000}, "session_id"),
    ({"messages": [{"role": "user", "content": EIGHT_MIB_TEXT}]}, None),
])
def test_oversized_openai_bodies_are_400_fast(body, param):
    # the fastest of three: work the refusal does is in all three, a stall of this shared host in one
    service, data, times = _Router(), json.dumps(body).encode(), []
    for _ in range(3):
        status, answer, seconds = asyncio.run(_post(service, data))
        assert status == 400, answer
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["param"] == param
        times.append(seconds)
    assert min(times) < REFUSED_FAST_S and service.requests == [], times
    if param is None:
        assert "larger than" in answer["error"]["message"]


def test_undecodable_request_bytes_are_invalid_argument():
    """gRPC answers UNKNOWN for a request that is not a valid message; the error interceptor makes it
    INVALID_ARGUMENT (unary and client-streaming calls alike)."""
    from ember.cluster.ports import free_port
    from ember.kv.directory import MemoryDirectory
    from ember.rpc.directory import DirectoryService
    from ember.rpc.server import Server
    from ember.v1 import directory_pb2_grpc

    async def go():
        address = f"127.0.0.1:{free_port()}"
        server = Server(address, ["ember.v1.BlockDirectory"])
        directory_pb2_grpc.add_BlockDirectoryServicer_to_server(DirectoryService(MemoryDirectory()), server.server)
        await server.server.start()
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                lookup = ch.unary_unary("/ember.v1.BlockDirectory/Lookup")
                for garbage in (b"\xff\xff\xff", b"\x12\x02\xff\xfe"):  # corrupt; bad UTF-8 in a string
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await lookup(garbage, timeout=5)
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await lookup(b"\x0a\x03abc", timeout=5)  # parses: one 3-byte hash
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "16" in e.value.details()
                assert (await lookup(b"", timeout=5)) == b""  # the empty message is valid
        finally:
            await server.server.stop(0)
    asyncio.run(go())


# -- on the real cluster ------------------------------------------------------------------------------
def _gaps(stub, prompt: str, tokens: int) -> list[float]:
    """Inter-arrival times of a greedy stream's tokens (after its first two)."""
    request = router_pb2.GenerateRequest(text=prompt, sampling=common_pb2.SamplingParams(max_tokens=tokens,
                                                                                          ignore_eos=True))
    arrivals = []
    for msg in stub.Generate(request, timeout=120):
        arrivals += [time.perf_counter()] * len(msg.token_ids)
    assert len(arrivals) == tokens
    return [b - a for a, b in zip(arrivals[2:], arrivals[3:])]


def _p90(values: list[float]) -> float:
    """(The p99 of ~100 gaps is their slowest: one stall of a loaded host would decide it.)"""
    return statistics.quantiles(values, n=10)[8]


HAMMER = """
import json, sys, threading, time, urllib.error, urllib.request
import grpc
from ember.v1 import common_pb2, router_pb2, router_pb2_grpc
import os
os.nice(10)  # the refusals' senders yield the cores: what is measured is the router, not this loop
router, http = sys.argv[1], sys.argv[2]
text = "a" * (8 * 2**20)
stops = [f"stop-{i}" for i in range(10_000)]
bodies = [json.dumps({"prompt": text, "max_tokens": 4}).encode(),
          json.dumps({"prompt": "hi", "max_tokens": 4, "stop": stops}).encode()]
stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(router, options=[("grpc.max_send_message_length", 64 << 20)]))
requests = [router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=4, stop=stops)),
            router_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(max_tokens=4))]
print("started", flush=True)
for _ in range(3):  # 12 refusals, then it exits
    for request in requests:
        start = time.perf_counter()
        try:
            list(stub.Generate(request, timeout=30)); code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        print(json.dumps({"code": code, "seconds": time.perf_counter() - start}), flush=True)
    for body in bodies:
        start = time.perf_counter()
        try:
            headers = {"Content-Type": "application/json"}
            urllib.request.urlopen(urllib.request.Request(http, data=body, headers=headers), timeout=30)
            code = 200
        except urllib.error.HTTPError as e:
            code = e.code
        print(json.dumps({"code": code, "seconds": time.perf_counter() - start}), flush=True)
"""


def test_huge_requests_are_refused_fast_and_a_running_stream_keeps_its_pace(cluster):  # noqa: F811
    http = f"http://{cluster['router_http']}/v1/completions"

    def grpc_refusal(stub, **inputs) -> tuple[grpc.StatusCode, float]:
        start = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(router_pb2.GenerateRequest(**inputs), timeout=30))
        return e.value.code(), time.perf_counter() - start

    def http_refusal(body: bytes) -> tuple[int, float]:
        start = time.perf_counter()
        request = urllib.request.Request(http, data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        return e.value.code, time.perf_counter() - start

    many_stops = common_pb2.SamplingParams(max_tokens=4, stop=MANY_STOPS)
    huge_body = json.dumps({"prompt": EIGHT_MIB_TEXT, "max_tokens": 4}).encode()
    stops_body = json.dumps({"prompt": "hi", "max_tokens": 4, "stop": MANY_STOPS}).encode()
    with grpc.insecure_channel(cluster["router"], options=[("grpc.max_send_message_length", 64 * 2**20)]) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        refusals = [
            lambda: grpc_refusal(stub, text="hi", sampling=many_stops),
            lambda: grpc_refusal(stub, text=EIGHT_MIB_TEXT, sampling=common_pb2.SamplingParams(max_tokens=4)),
            lambda: grpc_refusal(stub, chat=router_pb2.ChatInput(messages=[router_pb2.ChatMessage(
                role="user", content=EIGHT_MIB_TEXT)]), sampling=common_pb2.SamplingParams(max_tokens=4)),
            lambda: http_refusal(huge_body),
            lambda: http_refusal(stops_body),
        ]
        for refuse in refusals:  # each alone: refused, and fast
            code, seconds = refuse()
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, 400) and seconds < REFUSED_FAST_S, (code, seconds)

        _gaps(stub, PROMPTS[2], 8)  # warm
        # Up to three rounds, each the stream alone then under the refusals: a router that does
        # the refused work on its event loop slows every round; a stall of this shared 2-core host
        # lands in one. The refusals come from another process (building and sending 8 MiB
        # requests in this one would hold the GIL the stream's reader needs, and time the client),
        # and the stream runs for as long as that process takes to send its 12.
        rounds = []
        for _ in range(3):
            unloaded = _gaps(stub, PROMPTS[2], 48) + _gaps(stub, PROMPTS[2], 48)
            hammer = subprocess.Popen([sys.executable, "-c", HAMMER, cluster["router"], http],
                                      stdout=subprocess.PIPE, text=True)
            try:
                assert hammer.stdout.readline().strip() == "started"
                loaded, deadline = [], time.monotonic() + 120
                while hammer.poll() is None or len(loaded) < len(unloaded):  # the stream, as long as they last
                    assert time.monotonic() < deadline, "the refusals did not end within 120 s"
                    loaded += _gaps(stub, PROMPTS[2], 48)
                out, _ = hammer.communicate(timeout=60)
            finally:
                if hammer.poll() is None:
                    hammer.kill()
            results = [json.loads(line) for line in out.splitlines() if line.strip()]
            assert len(results) == 12, out[-2000:]
            assert all(r["code"] in ("INVALID_ARGUMENT", 400) for r in results), results[:5]
            seconds = sorted(r["seconds"] for r in results)
            # none did the work it refused (that costs ~7 s each here); the slowest is printed
            assert statistics.median(seconds) < REFUSED_FAST_S and seconds[-1] < AT_ONCE_S, seconds
            rounds.append((_p90(loaded), _p90(unloaded), seconds[-1]))
            if rounds[-1][0] <= 2 * rounds[-1][1]:
                break
    print([f"inter-token p90 {a * 1e3:.1f} ms under the refusals, {b * 1e3:.1f} ms without; slowest refusal "
           f"{c:.3f} s" for a, b, c in rounds])
    assert rounds[-1][0] <= 2 * rounds[-1][1], rounds
