"""The OpenAI-compatible HTTP API, driven by the official `openai` client against a real cluster: the
session's default cluster (configs/local.yaml, the GGUF's Q4_1 codes), its tokens checked against an
in-process engine on the same weights."""
from __future__ import annotations

import openai
import pytest

from ember.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def cluster(default_cluster):
    return default_cluster.as_dict()


@pytest.fixture(scope="module")
def api(cluster):
    from tests.conftest import openai_client
    return openai_client(cluster["router_http"])


@pytest.fixture(scope="module")
def engine(q4_engine):
    """The reference: an engine on the cluster's own weights and settings (the q4 path)."""
    return q4_engine()


def local_chat(engine, messages, max_tokens):
    prompt = engine.tokenizer.apply_chat_template(messages)
    out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]
    return out.text, out.finish_reason


def test_models_lists_the_served_model(api):
    models = api.models.list().data
    assert len(models) == 1 and models[0].id == "SmolLM2-135M-Instruct.Q4_1"


def test_chat_completion_equals_the_engine(api, engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = api.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=12,
                                      temperature=0)
    text, reason = local_chat(engine, messages, 12)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text and out.choices[0].finish_reason == reason
    assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streaming_chat_multi_turn(api, engine):
    history = [{"role": "user", "content": "Name a colour."}]
    first = api.chat.completions.create(model="", messages=history, max_tokens=8)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And another one?"}]
    chunks = list(api.chat.completions.create(model="", messages=history, max_tokens=10, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    want, reason = local_chat(engine, history, 10)
    assert text == want and reasons == [reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, "turn 2 reuses turn 1's KV"


def test_text_completion(api, engine):
    out = api.completions.create(model="", prompt="The capital of France is", max_tokens=6)
    want = engine.generate(["The capital of France is"], SamplingParams(max_tokens=6))[0].text
    assert out.object == "text_completion" and out.choices[0].text == want


def test_bad_requests_are_openai_errors(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="", messages=[], max_tokens=5)
    assert "messages" in str(e.value)
    with pytest.raises(openai.NotFoundError) as e:  # OpenAI's 404 model_not_found
        api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert "not served here" in str(e.value) and e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="", prompt="x", max_tokens=9000)  # past the context length


def test_tools_reach_the_chat_template(model_path):
    """A template that renders tools gets them (SmolLM2's own template has no tool section, so this
    checks the router's template branch with one that does; the HTTP path into SmolLM2's template
    is tests/test_openai_tools.py)."""
    import json

    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    from ember.services.router.service import RouterService, text_cap
    from ember.v1 import router_pb2
    base = Tokenizer.from_folder(model_folder(model_path))
    template = "{% for t in tools or [] %}TOOL:{{ t.function.name }};{% endfor %}{{ messages[-1].content }}"
    tokenizer = Tokenizer(base.backend, template, bos_token=base.bos_token, eos_token=base.eos_token)
    service = RouterService.__new__(RouterService)
    service.tokenizer, service.vocab_size = tokenizer, base.vocab_size
    service.max_text_bytes, service.text_cap_reason = text_cap(tokenizer, 8192)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    request = router_pb2.GenerateRequest(chat=router_pb2.ChatInput(
        messages=[router_pb2.ChatMessage(role="user", content="Rain?")], tools_json=json.dumps(tools)))
    import asyncio
    ids, _grammar = asyncio.run(service._prompt(request))
    assert tokenizer.decode(ids) == "TOOL:get_weather;Rain?"


def test_a_tools_request_is_accepted(api):
    out = api.chat.completions.create(model="", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                      max_tokens=4, tools=[{"type": "function", "function": {
                                          "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}])
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": 42}], "max_tokens": 4}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "warm"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, "n"),
    ({"model": ""}, "messages"),
    (b"this is not JSON", None),
], ids=["wrong-type", "negative-max-tokens", "temperature-string", "n=17", "missing-messages", "not-json"])
def test_bad_bodies_are_400_naming_the_field(cluster, body, param):
    import json
    import urllib.error
    import urllib.request
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{cluster['router_http']}/v1/chat/completions", data=raw,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == 400
    error = json.loads(e.value.read())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_a_bad_body_through_the_openai_client(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"


def test_one_http_chat_request_is_one_trace(cluster, api):
    """The HTTP request is the router's SERVER span (its trace context taken from `traceparent`),
    and everything it causes, in every service, is in that trace."""
    import secrets
    import time

    from tests.conftest import LONG_TEXT
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    messages = [{"role": "user", "content": "Trace this chat: " + LONG_TEXT[:400]}]
    out = api.chat.completions.create(model="", messages=messages, max_tokens=4, extra_body={"ignore_eos": True},
                                      extra_headers={"traceparent": f"00-{trace_id}-{caller}-01"})
    assert out.usage.completion_tokens == 4

    from ember.cluster.traces import trace as spans_of_trace

    def spans():
        return spans_of_trace(cluster["run_dir"], trace_id)
    wanted = {("router", "POST /v1/chat/completions", "SERVER"), ("router", "placement", "INTERNAL"),
              ("prefill", "/ember.v1.Prefill/Prefill", "SERVER"), ("decode", "/ember.v1.Decode/Decode", "SERVER"),
              ("router", "/ember.v1.Prefill/Prefill", "CLIENT"), ("router", "/ember.v1.Decode/Decode", "CLIENT")}

    def landed(trace) -> bool:  # every service's spans written, none waiting for its parent's
        ids = {s["span_id"] for s in trace}
        return wanted <= {(s["service"], s["name"], s["kind"]) for s in trace} \
            and {"kvstore-central", "kvstore-edge"} <= {s["service"] for s in trace} \
            and all(s["parent_id"] in ids for s in trace if s["name"] != "POST /v1/chat/completions")
    deadline = time.monotonic() + 10
    while not landed(trace := spans()):
        assert time.monotonic() < deadline, f"the trace did not land: {[(s['service'], s['name']) for s in trace]}"
        time.sleep(0.05)
    [http] = [s for s in trace if s["kind"] == "SERVER" and s["name"] == "POST /v1/chat/completions"]
    assert http["service"] == "router" and http["parent_id"] == caller
    assert http["attributes"]["ember.completion_tokens"] == 4 and http["attributes"]["ember.request_id"]
    assert {"router", "prefill", "kvstore-central", "kvstore-edge", "decode"} <= {s["service"] for s in trace}
    by_id = {s["span_id"]: s for s in trace}
    for s in trace:
        if s is not http:
            assert s["parent_id"] in by_id, f"{s['service']}:{s['name']} hangs off nothing in the trace"
    named = {(s["service"], s["name"], s["kind"]): s for s in trace}
    assert named[("router", "placement", "INTERNAL")]["parent_id"] == http["span_id"]
    for service, method in (("prefill", "/ember.v1.Prefill/Prefill"), ("decode", "/ember.v1.Decode/Decode")):
        call = named[("router", method, "CLIENT")]
        assert call["parent_id"] == http["span_id"]
        assert named[(service, method, "SERVER")]["parent_id"] == call["span_id"]
