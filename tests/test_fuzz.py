"""Every RPC of every service, fuzzed against the real cluster processes.

For each method: FUZZ_EXAMPLES schema-valid random messages (hypothesis strategies built from
the message descriptors: hypothesis-pb pins protobuf < 4, so it cannot install next to
protobuf 7) and as many random byte strings sent as the request through a generic call. No
answer may be UNKNOWN or INTERNAL (a bad request is INVALID_ARGUMENT, FAILED_PRECONDITION,
NOT_FOUND, ...), every service must still say SERVING afterwards, and a greedy canary stream
running alongside the whole time must produce exactly its reference tokens every time.
"""
from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.client import RouterClient
from ember.config.derived import model_facts
from ember.config.load import load_config
from ember.kv.block_hash import chain_hashes, root_hash
from ember.model.tokenizer import Tokenizer
from ember.rpc.server import CHANNEL_OPTIONS
from ember.v1 import decode_pb2, directory_pb2, kvstore_pb2, prefill_pb2, router_pb2
from tests.cluster_fixture import dial
from tests.conftest import PROMPTS
from tests.test_cluster import cluster  # noqa: F401 - the module's own real cluster

FUZZ_EXAMPLES = int(os.environ.get("EMBER_FUZZ_EXAMPLES", "200"))
CALL_TIMEOUT_S = 5.0
STREAM_MESSAGES = 3  # read this many messages of a streamed answer, then cancel
FORBIDDEN = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
SERVICES = [(router_pb2, "Router", "router"), (directory_pb2, "BlockDirectory", "router_internal"),
            (prefill_pb2, "Prefill", "prefill"), (decode_pb2, "Decode", "decode"),
            (kvstore_pb2, "KVStore", "kv_edge")]
METHODS = [(module.DESCRIPTOR.services_by_name[name], method, where)
           for module, name, where in SERVICES for method in module.DESCRIPTOR.services_by_name[name].methods]
HEALTH_OF = ("router", "prefill", "decode", "kv_central", "kv_edge")
# whose certificate each channel holds: the role allowed the most of that service's methods
CALLER = {"router_internal": "kvstore-central", "prefill": "router", "decode": "router",
          "kv_central": "prefill-central", "kv_edge": "decode-edge"}
FUZZ_SETTINGS = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=False,
                         suppress_health_check=list(HealthCheck))


# -- strategies from descriptors ---------------------------------------------------------------
def _u32(pool):
    return st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 64), st.sampled_from(pool["u32"]))


def _scalar(field, pool):
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.text(max_size=24), st.sampled_from(pool["strings"]))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=24), st.binary(min_size=16, max_size=16), st.sampled_from(pool["hashes"]))
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return _u32(pool)
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 64), st.sampled_from([2**63 - 1, 2**63]))
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return st.integers(-2**31, 2**31 - 1)
    if t in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return st.integers(-2**63, 2**63 - 1)
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.floats(width=32), st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.floats(), st.sampled_from([0.0, 0.5, 1.0, 30.0]))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    raise NotImplementedError(f"field type {t} of {field.full_name}")


def _value(field, pool, depth: int):
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message(field.message_type, pool, depth + 1)
    return _scalar(field, pool)


def _field(field, pool, depth: int):
    if field.is_repeated:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            return st.dictionaries(_value(key, pool, depth), _value(value, pool, depth), max_size=3)
        size = 24 if field.type == FieldDescriptor.TYPE_UINT32 else 6
        return st.lists(_value(field, pool, depth), max_size=size)
    return _value(field, pool, depth)


def message(descriptor, pool, depth: int = 0) -> st.SearchStrategy:
    """Any message of `descriptor`'s type: each field set or not (a real oneof: at most one of
    its members), values over the whole range of their type plus some that reach further in
    (the cluster's addresses and site names, real block hashes, vocabulary and context edges)."""
    cls = GetMessageClass(descriptor)
    oneofs = [o for o in descriptor.oneofs if len(o.fields) > 1]  # (proto3 `optional` is a 1-field oneof)
    in_oneof = {f.name for o in oneofs for f in o.fields}
    plain = {f.name: _field(f, pool, depth) for f in descriptor.fields if f.name not in in_oneof}
    choices = [st.one_of(st.just({}), *[_field(f, pool, depth).map(lambda v, n=f.name: {n: v}) for f in o.fields])
               for o in oneofs]

    def build(parts):
        fields, picked = parts
        for p in picked:
            fields.update(p)
        return cls(**fields)
    return st.tuples(st.fixed_dictionaries({}, optional=plain), st.tuples(*choices)).map(build)


# -- the cluster, a canary, generic calls ----------------------------------------------------------
@pytest.fixture(scope="module")
def pool(cluster):  # noqa: F811
    config = load_config(cluster["config"])
    facts = model_facts(config)
    tokenizer = Tokenizer.from_folder(facts.folder)
    ids = tokenizer.encode(PROMPTS[-1])[:64]
    hashes = chain_hashes(ids, facts.kv_layout.block_size, root_hash(facts.kv_layout))
    vocab, context = facts.vocab_size, facts.max_model_len
    return {"strings": ["", "edge", "central", facts.model_id, cluster["kv_central"], cluster["kv_edge"],
                        "127.0.0.1:1", "fuzz", "\n", "<|im_end|>"],
            "hashes": hashes or [b"\0" * 16],
            "u32": [1, 2, 15, 16, 17, 4095, 4096, vocab - 1, vocab, vocab + 1, context - 1, context, context + 1,
                    2**31 - 1, 2**32 - 1]}


class Canary:
    """A greedy stream, run again and again alongside the fuzzing; every run must produce the
    reference tokens (those of the first, undisturbed run)."""

    def __init__(self, address: str, prompt: str):
        self.address, self.prompt = address, prompt
        self.runs, self.failures = 0, []
        self._stop = threading.Event()
        with RouterClient(address) as c:
            self.reference = c.complete(self.prompt, max_tokens=12, ignore_eos=True, timeout=120).token_ids
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with RouterClient(self.address) as c:
            while not self._stop.is_set():
                try:
                    got = c.complete(self.prompt, max_tokens=12, ignore_eos=True, timeout=120).token_ids
                    if got != self.reference:
                        self.failures.append(f"tokens {got} != reference {self.reference}")
                except grpc.RpcError as e:
                    self.failures.append(f"{e.code().name}: {e.details()}")
                self.runs += 1

    def check(self) -> None:
        assert not self.failures, self.failures[:5]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=180)


@pytest.fixture(scope="module")
def canary(cluster):  # noqa: F811
    c = Canary(cluster["router"], PROMPTS[2])
    yield c
    c.stop()
    c.check()
    assert c.runs >= 2


@pytest.fixture(scope="module")
def channels(cluster):  # noqa: F811
    chans = {k: grpc.insecure_channel(cluster[k], options=CHANNEL_OPTIONS) if k == "router" else  # the public API
             dial(cluster, k, CALLER[k], options=CHANNEL_OPTIONS) for k in HEALTH_OF + ("router_internal",)}
    yield chans
    for ch in chans.values():
        ch.close()


def call(channel: grpc.Channel, service, method, request, raw: bool = False) -> grpc.StatusCode:
    """Send `request` (a message, a list of them for a client stream, or bytes when `raw`) as
    `method`; the status it ended with (OK for a stream cut short after STREAM_MESSAGES)."""
    path = f"/{service.full_name}/{method.name}"
    serialize = None if raw else (lambda m: m.SerializeToString())
    kinds = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
             (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    stub = kinds[(method.client_streaming, method.server_streaming)](path, request_serializer=serialize,
                                                                     response_deserializer=None)
    payload = iter(request) if method.client_streaming else request
    try:
        if method.server_streaming:
            responses = stub(payload, timeout=CALL_TIMEOUT_S)
            try:
                for i, _ in enumerate(responses):
                    if i + 1 >= STREAM_MESSAGES:
                        break
            finally:
                responses.cancel()
        else:
            stub(payload, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        assert e.code() not in FORBIDDEN, f"{path}: {e.code().name}: {e.details()}\nrequest: {request!r}"
        return e.code()
    return grpc.StatusCode.OK


def assert_serving(channels) -> None:
    for name, ch in channels.items():
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"{name} is {status} after the fuzzing"


def _id(m) -> str:
    service, method, _ = m
    return f"{service.name}.{method.name}"


# -- the fuzz ------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", METHODS, ids=_id)
def test_schema_valid_random_messages(target, pool, channels, canary):
    service, method, where = target
    request = message(method.input_type, pool)
    strategy = st.lists(request, max_size=4) if method.client_streaming else request

    @FUZZ_SETTINGS
    @given(strategy)
    def fuzz(req):
        call(channels[where], service, method, req)
    fuzz()
    assert_serving(channels)
    canary.check()


@pytest.mark.parametrize("target", METHODS, ids=_id)
def test_random_bytes(target, channels, canary):
    service, method, where = target
    data = st.binary(max_size=96)
    strategy = st.lists(data, max_size=4) if method.client_streaming else data

    @FUZZ_SETTINGS
    @given(strategy)
    def fuzz(req):
        call(channels[where], service, method, req, raw=True)
    fuzz()
    assert_serving(channels)
    canary.check()


def test_canary_ran_alongside_and_stayed_exact(canary):
    deadline = time.monotonic() + 60
    while canary.runs < 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    canary.check()
