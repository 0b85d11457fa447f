"""API keys at the router (no cluster): the key table, its constant-time check, the keys file,
the HTTP API's 401s, the gRPC servicer's UNAUTHENTICATED, and a router that needs a key refusing
to start without one. tests/test_secure_router.py drives a real cluster."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import yaml

from ember.services.router import auth
from ember.services.router.auth import ANONYMOUS, KeyTable
from ember.v1 import common_pb2, router_pb2

KEYS = {"key-alpha-0123456789": "alpha", "key-beta-0123456789": "beta", "key-gamma-0123456789": "gamma"}


def test_key_table_maps_keys_to_tenants():
    table = KeyTable(KEYS)
    assert table.enabled and table.tenants == {"alpha", "beta", "gamma"}
    assert table.tenant("key-beta-0123456789") == "beta"
    assert table.tenant("key-beta-012345678") is None and table.tenant("key-beta-0123456789x") is None
    assert table.tenant("") is None and table.tenant(None) is None
    assert table.check_authorization("Bearer key-alpha-0123456789") == "alpha"
    assert table.check_authorization("bearer  key-alpha-0123456789 ") == "alpha"
    for header in (None, "", "key-alpha-0123456789", "Basic key-alpha-0123456789", "Bearer", "Bearer wrong"):
        assert table.check_authorization(header) is None, header


def test_no_keys_means_no_authentication():
    table = KeyTable()
    assert not table.enabled
    assert table.tenant(None) == table.tenant("anything") == table.check_authorization(None) == ANONYMOUS


@pytest.mark.parametrize("presented", ["key-alpha-0123456789", "key-gamma-0123456789", "nope", None])
def test_every_key_is_compared_in_constant_time(monkeypatch, presented):
    """hmac.compare_digest over SHA-256 digests (equal lengths whatever was sent), every configured
    key each time: no early exit on a match, none on a miss."""
    calls = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)
    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    KeyTable(KEYS).tenant(presented)
    assert calls == [(32, 32)] * len(KEYS)


def test_only_digests_are_kept():
    table = KeyTable(KEYS)
    assert not any(key in repr(vars(table)) for key in KEYS)


def test_bad_keys_and_tenants_are_refused():
    for keys in ({"": "alpha"}, {" padded ": "alpha"}, {"k" * 5000: "alpha"}, {"key": ""}, {"key": "has space"},
                 {"key": "-leading-dash"}):
        with pytest.raises(ValueError):
            KeyTable(keys)


def test_keys_file_and_environment(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(KEYS))
    table = auth.load(path, "env-key-0123456789")
    assert table.tenant("key-gamma-0123456789") == "gamma" and table.tenant("env-key-0123456789") == "default"
    assert auth.load(None, "env-key").tenants == {"default"}
    assert not auth.load(None, None).enabled and not auth.load(None, "  ").enabled
    with pytest.raises(ValueError, match="EMBER_API_KEY is also in router.api_keys_file"):
        auth.load(path, "key-alpha-0123456789")
    path.write_text("")
    assert not auth.load(path).enabled
    for text, why in (("- a\n- b\n", "must map"), ("1234: alpha\n", "strings"), ("key: [x]\n", "strings"),
                      ("key: 'a b'\n", "tenant name"), ("{unclosed: ", "not YAML")):
        path.write_text(text)
        with pytest.raises(ValueError, match=why):
            auth.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        auth.load(tmp_path / "missing.yaml")


def test_a_router_that_requires_a_key_refuses_to_start_without_one(tmp_path, monkeypatch):
    import argparse

    from ember.config.load import config_from_dict
    from ember.services.router.__main__ import main
    from tests.cluster_fixture import write_config

    def config(**router):
        write_config(tmp_path / "cluster.yaml", overrides={"router": router})
        data = yaml.safe_load((tmp_path / "cluster.yaml").read_text())
        return argparse.Namespace(cluster=config_from_dict(data, tmp_path), route=[])
    monkeypatch.delenv("EMBER_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="require_api_key is set but no API key is configured"):
        asyncio.run(main(config(require_api_key=True)))
    (tmp_path / "keys.yaml").write_text("- not a mapping\n")
    with pytest.raises(SystemExit, match="router.api_keys_file"):
        asyncio.run(main(config(api_keys_file="keys.yaml")))


# -- the HTTP API: every route but health needs the key --------------------------------------------
class _Router:
    """What OpenAIApp needs of RouterService; records the tenant each request came with."""
    model_id, max_model_len = "fake-model", 2048

    def __init__(self):
        self.tenants = []

    async def Generate(self, request, context):
        self.tenants.append(context.tenant)
        yield router_pb2.GenerateResponse(text="ok", finished=True, finish_reason="stop",
                                          usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1))


CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
          ("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode()),
          ("GET", "/v1/nowhere", None)]


async def _calls(service, keys, calls):
    from aiohttp.test_utils import TestClient, TestServer

    from ember.services.router.openai_http import OpenAIApp
    out = []
    async with TestClient(TestServer(OpenAIApp(service, keys=keys).app)) as client:
        for method, path, body, headers in calls:
            response = await client.request(method, path, data=body, headers=headers)
            body = await (response.json() if response.content_type == "application/json" else response.text())
            out.append((response.status, body, response.headers))
    return out


def test_http_routes_need_the_key():
    service, keys = _Router(), KeyTable(KEYS)
    calls = [(m, p, b, h) for m, p, b in ROUTES
             for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-alpha-0123456789"})]
    for status, body, headers in asyncio.run(_calls(service, keys, calls)):
        assert status == 401, body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
        assert body["error"]["param"] is None and body["error"]["message"]
        assert headers["WWW-Authenticate"].startswith("Bearer")
    assert service.tenants == [], "nothing reached the router"


def test_http_with_the_key_and_health_without():
    service, keys = _Router(), KeyTable(KEYS)
    beta = {"Authorization": "Bearer key-beta-0123456789"}
    calls = [(m, p, b, beta) for m, p, b in ROUTES] + [("GET", "/health", None, {})]
    out = asyncio.run(_calls(service, keys, calls))
    assert [status for status, _, _ in out] == [200, 200, 200, 404, 200]
    assert out[0][1]["data"][0]["id"] == "fake-model" and out[-1][1] == {"status": "ok"}
    assert service.tenants == ["beta", "beta"], "the key's tenant went with each request"


def test_http_without_keys_is_open():
    service = _Router()
    out = asyncio.run(_calls(service, None, [(m, p, b, {}) for m, p, b in ROUTES[:3]]))
    assert [status for status, _, _ in out] == [200, 200, 200] and service.tenants == [ANONYMOUS, ANONYMOUS]


# -- gRPC: the Router servicer's entry points --------------------------------------------------------
class _Context:
    def __init__(self, metadata=()):
        self.metadata, self.aborted = tuple(metadata), None

    def invocation_metadata(self):
        return self.metadata

    def peer(self):
        return "ipv4:127.0.0.1:1"

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def _service(keys):
    from ember.services.router.service import RouterService
    service = RouterService.__new__(RouterService)  # only what the entry points read first
    service.keys, service.model_id, service.max_model_len = keys, "m", 2048
    return service


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("x-api-key", "key-beta-0123456789"),),
                                      (("authorization", "key-beta-0123456789"),)])
def test_grpc_calls_without_a_valid_key_are_unauthenticated(metadata):
    service = _service(KeyTable(KEYS))

    async def calls():
        for call in (lambda c: service.ListModels(router_pb2.ListModelsRequest(), c),
                     lambda c: anext(service.Generate(router_pb2.GenerateRequest(text="hi"), c))):
            context = _Context(metadata)
            with pytest.raises(grpc.aio.AbortError):
                await call(context)
            assert context.aborted[0] == grpc.StatusCode.UNAUTHENTICATED
    asyncio.run(calls())


def test_grpc_with_the_key_or_without_keys():
    async def models(service, metadata):
        return (await service.ListModels(router_pb2.ListModelsRequest(), _Context(metadata))).models[0].id
    assert asyncio.run(models(_service(KeyTable(KEYS)), [("authorization", "Bearer key-beta-0123456789")])) == "m"
    assert asyncio.run(models(_service(KeyTable()), [])) == "m"
    tenant = asyncio.run(_service(KeyTable(KEYS))._authenticate(_Context([("authorization",
                                                                            "Bearer key-gamma-0123456789")])))
    assert tenant == "gamma"
