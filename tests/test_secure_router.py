"""API keys and tenants at a real cluster's public ports (one cluster for the module, started as
configs/local-secure.yaml is: `router.tls: auto`, so every client here speaks TLS trusting the CA
file `ember up` made): 401 and UNAUTHENTICATED without a valid key, the official `openai` client and
RouterClient with one, health open, tenants that never see each other's cache, and a declared
shared prefix that they do share; reflection needs a key like everything else, refusals are
counted and no key reaches the router's log. Unit tests: tests/test_api_keys.py,
tests/test_tenants.py, tests/test_cert_reload.py."""
from __future__ import annotations

import contextlib
import json
import ssl
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ember.client import RouterClient, router_channel
from ember.cluster.launcher import running
from tests.cluster_fixture import write_config

KEYS = {"sk-alpha-8f2c1d9e7b6a5f4e3d2c1b0a": "alpha", "sk-beta-1a2b3c4d5e6f7a8b9c0d1e2f": "beta"}
ALPHA, BETA = list(KEYS)
ENV_KEY = "sk-env-0f1e2d3c4b5a69788796a5b4"  # EMBER_API_KEY: tenant `default`
SYSTEM = ("You are the archivist of the harbour town of Eastmere. Answer questions about its records, its "
          "fishing boats, its merchant ships and the lighthouse keeper's weather notes, briefly and accurately, "
          "and say so when the records do not tell you.")
MODEL = "SmolLM2-135M-Instruct.Q4_1"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path):
    """Private: API keys required at its router, whose block directory (the kvstores publish to it)
    the tenant tests read; a second router in front of a session cluster would have an empty one."""
    run_dir = tmp_path_factory.mktemp("secure-router")
    path = run_dir / "cluster.yaml"
    (run_dir / "keys.yaml").write_text(yaml.safe_dump(KEYS))
    addr = write_config(path, overrides={"router": {"api_keys_file": "keys.yaml", "require_api_key": True,
                                                    "shared_prefixes": [SYSTEM], "tls": "auto"}})
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:  # the services read it at start-up; this process after
            env.setenv("EMBER_API_KEY", ENV_KEY)
            stack.enter_context(running(path, run_dir, timeout_s=240))
        yield addr | {"run_dir": run_dir, "ca": str(run_dir / "certs" / "ca.crt")}  # (the CA `ember up` prints)


def client(cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"https://{cluster['router_http']}/v1", api_key=key, max_retries=0,
                         timeout=TIMEOUT_S, http_client=openai.DefaultHttpxClient(verify=trust(cluster)))


def trust(cluster) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cluster["ca"])


def http(cluster, method: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(f"https://{cluster['router_http']}{path}", method=method, headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=trust(cluster)) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}


# -- API keys ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [None, "sk-wrong", ALPHA[:-1]], ids=["no-key", "wrong-key", "truncated-key"])
def test_http_without_a_valid_key_is_401_on_every_route(cluster, key):
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
                               ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})):
        status, out = http(cluster, method, path, body, key)
        assert status == 401, (path, out)
        error = out["error"]
        assert error["code"] == "invalid_api_key" and error["param"] is None and error["message"]
        assert error["type"] in ("invalid_request_error", "authentication_error")
    api = client(cluster, key or "sk-none")
    with pytest.raises(openai.AuthenticationError):
        api.models.list()
    with pytest.raises(openai.AuthenticationError):
        api.chat.completions.create(model="", **CHAT)
    with pytest.raises(openai.AuthenticationError):
        list(api.chat.completions.create(model="", stream=True, **CHAT))


def test_health_needs_no_key(cluster):
    assert http(cluster, "GET", "/health") == (200, {"status": "ok"})
    with router_channel(cluster["router"], cluster["ca"]) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status
    assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("key", [None, "sk-wrong", BETA + "x"], ids=["no-key", "wrong-key", "longer-key"])
def test_grpc_without_a_valid_key_is_unauthenticated(cluster, key):
    with RouterClient(cluster["router"], api_key=key, ca=cluster["ca"]) as c:
        for call in (lambda: c.complete("Hi", max_tokens=2, timeout=TIMEOUT_S), lambda: c.models(timeout=TIMEOUT_S)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_openai_client_with_the_key(cluster):
    api = client(cluster, ALPHA)
    assert [m.id for m in api.models.list().data] == [MODEL]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens <= 8
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, "alpha's second request hits alpha's cache"
    text = api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4)
    assert text.choices[0].text


def test_grpc_with_the_key_and_the_environment_key(cluster):
    for key in (BETA, ENV_KEY):
        with RouterClient(cluster["router"], api_key=key, ca=cluster["ca"]) as c:
            assert [m.id for m in c.models(timeout=TIMEOUT_S)] == [MODEL]
            out = c.complete("The capital of France is", max_tokens=3, timeout=TIMEOUT_S)
            assert out.final.finished and out.token_ids


def test_ember_generate_takes_the_key(cluster, capsys, monkeypatch):
    from ember.cli import main
    monkeypatch.delenv("EMBER_API_KEY", raising=False)
    monkeypatch.delenv("EMBER_ROUTER_CA", raising=False)
    router = ["generate", "--router", cluster["router"], "--max-tokens", "2"]
    assert main([*router, "--ca", cluster["ca"], "Hello"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main([*router, "--ca", cluster["ca"], "--api-key", ALPHA, "Hello"]) == 0
    assert main([*router, "--api-key", ALPHA, "Hello"]) == 2, "a plaintext client is refused"
    assert "UNAVAILABLE" in capsys.readouterr().err
    monkeypatch.setenv("EMBER_ROUTER_CA", cluster["ca"])  # the CA from the environment
    monkeypatch.setenv("EMBER_API_KEY", BETA)
    assert main([*router, "Hello"]) == 0
    assert "completion tokens" in capsys.readouterr().err


# -- tenants -------------------------------------------------------------------------------------------
PROMPT = ("Ledger of the Eastmere quay, spring season. The harbour master counted forty-two fishing boats, "
          "nine merchant ships and a lighthouse tender, and wrote that the west wind kept the herring fleet in "
          "port for three days while the tide rose higher than anyone remembered. The keeper noted fog")


def grpc_complete(cluster, key, prompt, **kwargs):
    with RouterClient(cluster["router"], api_key=key, ca=cluster["ca"]) as c:
        return c.complete(prompt, max_tokens=4, timeout=TIMEOUT_S, **kwargs)


def test_a_tenant_never_sees_another_tenants_cache(cluster):
    first = grpc_complete(cluster, ALPHA, PROMPT)
    blocks = first.final.usage.prompt_tokens // 16
    assert blocks >= 3 and first.final.usage.cached_tokens == 0
    # alpha's repeats hit its own cache at once, and the directory learns of its blocks shortly
    deadline = time.monotonic() + 60
    while True:
        again = grpc_complete(cluster, ALPHA, PROMPT)
        assert again.final.usage.cached_tokens >= blocks * 16 - 16 and again.token_ids == first.token_ids
        if again.final.placement.cached_blocks.get("central", 0) >= blocks:
            break
        assert time.monotonic() < deadline, f"alpha's blocks never reached the directory: {again.final.placement}"
    # beta sends alpha's exact prompt: nothing cached, no block shown, the same tokens
    other = grpc_complete(cluster, BETA, PROMPT)
    assert other.final.usage.cached_tokens == 0
    assert not any(other.final.placement.cached_blocks.values()), other.final.placement
    assert other.token_ids == first.token_ids
    # nor does alpha with a cache_salt of its own (vLLM's extension)
    salted = grpc_complete(cluster, ALPHA, PROMPT, cache_salt="alpha-private-salt")
    assert salted.final.usage.cached_tokens == 0 and not any(salted.final.placement.cached_blocks.values())
    assert salted.token_ids == first.token_ids


def test_over_http_too(cluster):
    prompt = PROMPT.replace("spring", "autumn")
    alpha, beta = client(cluster, ALPHA), client(cluster, BETA)
    a1 = alpha.completions.create(model="", prompt=prompt, max_tokens=3, temperature=0)
    a2 = alpha.completions.create(model="", prompt=prompt, max_tokens=3, temperature=0)
    b1 = beta.completions.create(model="", prompt=prompt, max_tokens=3, temperature=0)
    assert a1.usage.prompt_tokens_details.cached_tokens == 0 and a2.usage.prompt_tokens_details.cached_tokens > 0
    assert b1.usage.prompt_tokens_details.cached_tokens == 0
    assert a1.choices[0].text == a2.choices[0].text == b1.choices[0].text


def test_a_declared_shared_prefix_is_reused_across_tenants(cluster, model_path):
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_folder(model_folder(model_path))
    system = tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                            add_generation_prompt=False))
    shared = len(system) // 16 * 16
    assert shared >= 32

    def chat(api, question):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        out = api.chat.completions.create(model="", messages=messages, max_tokens=3, temperature=0)
        return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens
    alpha, beta = client(cluster, ALPHA), client(cluster, BETA)
    question = "How many merchant ships came in this spring, and did the west wind keep any of them in port?"
    cached, prompt_tokens = chat(alpha, question)
    assert cached in (0, shared) and prompt_tokens >= shared + 32
    assert chat(beta, "Which ship was the largest that year?")[0] == shared, "beta reuses the system prompt's KV"
    assert chat(beta, question)[0] == shared, "alpha's exact chat: only the shared blocks are beta's to reuse"
    assert chat(alpha, question)[0] >= prompt_tokens - 16, "alpha's own repeat hits all of it"


# -- reflection, counted refusals, keys kept out of the log ----------------------------------------------
def reflection_list(channel, key: str | None = None) -> list[str] | grpc.StatusCode:
    """grpcurl's `list` (grpcio-reflection's client; grpcurl is not installable here): the services,
    or the status the call ended with."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    if key is None:  # (the database client sends no metadata)
        try:
            return sorted(ProtoReflectionDescriptorDatabase(channel).get_services())
        except grpc.RpcError as e:
            return e.code()
    try:
        [answer] = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT_S,
            metadata=(("authorization", f"Bearer {key}"),))
    except grpc.RpcError as e:
        return e.code()
    return sorted(s.name for s in answer.list_services_response.service)


def test_with_keys_reflection_needs_a_key_and_is_off_unless_configured(cluster, tmp_path):
    """Keys configured, router.reflection unset: `list` without a key is UNAUTHENTICATED (never
    UNKNOWN), with a key UNIMPLEMENTED (off); a router with `router.reflection: true` lists the
    services to a caller with a key, and still refuses one without."""
    from ember.cluster.chaos import Cluster
    with router_channel(cluster["router"], cluster["ca"]) as ch:
        assert reflection_list(ch) == grpc.StatusCode.UNAUTHENTICATED
        assert reflection_list(ch, "sk-wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert reflection_list(ch, ALPHA) == grpc.StatusCode.UNIMPLEMENTED
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump(KEYS))  # (paths are relative to the second router's file)
    with Cluster(cluster["run_dir"]).second_router(tmp_path, reflection=True, api_keys_file="keys.yaml",
                                                   tls=None) as (router, _):
        with grpc.insecure_channel(router["listen"]) as ch:
            assert reflection_list(ch) == grpc.StatusCode.UNAUTHENTICATED
            assert "ember.v1.Router" in reflection_list(ch, BETA)


def test_refusals_are_counted_and_no_key_reaches_the_log(cluster):
    from ember.cluster.status import scrape
    services = json.loads((cluster["run_dir"] / "services.json").read_text())

    def failures() -> dict[tuple[str, str], float]:
        m = scrape(services["router"]["metrics"], 10)
        return {(r, p): m.get(f'ember:auth_failures_total{{protocol="{p}",reason="{r}"}}', 0.0)
                for r in ("missing_key", "malformed_header", "invalid_key") for p in ("grpc", "http")}
    before = failures()
    bogus = "sk-bogus-7d1e9f0c2b4a6e8d"
    http(cluster, "GET", "/v1/models")
    http(cluster, "GET", "/v1/models", key=bogus)
    with RouterClient(cluster["router"], ca=cluster["ca"]) as c:
        with pytest.raises(grpc.RpcError):
            c.models(timeout=TIMEOUT_S)
    with RouterClient(cluster["router"], api_key=bogus, ca=cluster["ca"]) as c:
        with pytest.raises(grpc.RpcError):
            c.complete("Hi", max_tokens=2, timeout=TIMEOUT_S)
    with router_channel(cluster["router"], cluster["ca"]) as ch:
        with pytest.raises(grpc.RpcError):
            ch.unary_unary("/ember.v1.Router/ListModels")(b"", metadata=(("authorization", f"Basic {bogus}"),),
                                                          timeout=TIMEOUT_S)
    after = failures()
    assert {k: after[k] - before[k] for k in after} == {
        ("missing_key", "grpc"): 1, ("missing_key", "http"): 1, ("invalid_key", "grpc"): 1,
        ("invalid_key", "http"): 1, ("malformed_header", "grpc"): 1, ("malformed_header", "http"): 0}
    log = (cluster["run_dir"] / "router.log").read_text()
    assert "missing_key" in log and "invalid_key" in log, "refusals are logged (by reason)"
    written = {f.name: f.read_text(errors="replace") for f in cluster["run_dir"].iterdir()  # logs and spans
               if f.suffix in (".log", ".jsonl")}
    assert "router.log" in written and any(f.startswith("router-") for f in written)
    for key in [bogus, "sk-wrong", ALPHA[:-1], BETA + "x", ENV_KEY, *KEYS]:  # every key any test here sent
        assert not [name for name, text in written.items() if key in text], key
