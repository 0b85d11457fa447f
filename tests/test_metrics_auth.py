"""/metrics behind mTLS or a bearer token (security.metrics, ember.rpc.metrics_http), served by the
real server on a free port: a scrape without the operator's certificate, with another role's, in
plaintext, without the token or with a wrong one is refused and counted in
ember:auth_failures_total{reason}; the right one is served, through the scraper `ember status`,
the chaos harness and the benchmarks use (ember.cluster.status.scrape)."""
from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter

from ember.cluster.certs import write_cluster_certs
from ember.cluster.status import scrape
from ember.config.load import config_from_dict, load_config
from ember.config.services import security_settings
from ember.rpc import metrics, metrics_http
from tests.cluster_fixture import free_port, write_config

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "metrics-token-5f1c0e9a7d3b"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("metrics-auth")
    write_config(folder / "cluster.yaml")
    return write_cluster_certs(load_config(folder / "cluster.yaml"), folder / "certs")


def serve(access: metrics_http.MetricsAccess) -> str:
    registry = CollectorRegistry()
    Counter("ember_test_scraped", "a sample only an authorized scraper sees", registry=registry).inc()
    server = metrics_http.serve(f"127.0.0.1:{free_port()}", registry, access)
    return f"127.0.0.1:{server.server_port}"


def refusals(reason: str) -> float:
    return metrics.AUTH_FAILURES.labels(reason, "metrics")._value.get()


def fetch_raw(url: str, context=None, headers: dict | None = None) -> int:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def client_context(certs, name: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if name is not None:
        ctx.load_cert_chain(certs / name / "tls.crt", certs / name / "tls.key")
    return ctx


def test_mtls_metrics_serve_only_the_operator_certificate(certs):
    address = serve(metrics_http.MetricsAccess("mtls", str(certs / "kvstore-edge")))
    before = {r: refusals(r) for r in ("metrics_tls", "metrics_role")}
    with pytest.raises(OSError):  # no client certificate: no TLS session (URLError, SSLError)
        fetch_raw(f"https://{address}/metrics", client_context(certs, None))
    with pytest.raises(OSError):  # plaintext to the TLS port
        fetch_raw(f"http://{address}/metrics")
    with pytest.raises(OSError):  # a cluster certificate, not the operator's
        fetch_raw(f"https://{address}/metrics", client_context(certs, "router"))
    assert refusals("metrics_tls") - before["metrics_tls"] == 2
    assert refusals("metrics_role") - before["metrics_role"] == 1
    assert fetch_raw(f"https://{address}/metrics", client_context(certs, "operator")) == 200
    endpoint = metrics_http.endpoint(address, metrics_http.MetricsAccess("mtls", str(certs / "kvstore-edge")),
                                     str(certs / "operator"))
    assert scrape(endpoint)["ember_test_scraped_total"] == 1.0, "ember status' scraper authenticates"
    assert scrape(address) == {} and scrape(endpoint | {"cert": str(certs / "router" / "tls.crt"),
                                                        "key": str(certs / "router" / "tls.key")}) == {}


@pytest.mark.parametrize("tls", [True, False], ids=["https", "plaintext-cluster"])
def test_token_metrics_need_the_bearer_token(certs, tmp_path, tls):
    (tmp_path / "metrics.token").write_text(TOKEN + "\n")
    folder = str(certs / "router") if tls else None
    access = metrics_http.MetricsAccess("token", folder, str(tmp_path / "metrics.token"))
    address = serve(access)
    url, context = (f"https://{address}/metrics", client_context(certs, None)) if tls else \
        (f"http://{address}/metrics", None)
    before = refusals("metrics_token")
    assert fetch_raw(url, context) == 401
    assert fetch_raw(url, context, {"Authorization": f"Bearer {TOKEN}x"}) == 401
    assert fetch_raw(url, context, {"Authorization": f"Basic {TOKEN}"}) == 401
    assert refusals("metrics_token") - before == 3
    assert fetch_raw(url, context, {"Authorization": f"Bearer {TOKEN}"}) == 200
    endpoint = metrics_http.endpoint(address, access, str(certs / "operator") if tls else None)
    assert scrape(endpoint)["ember_test_scraped_total"] == 1.0
    (tmp_path / "wrong.token").write_text("not-it\n")
    assert scrape(endpoint | {"token_file": str(tmp_path / "wrong.token")}) == {}
    (tmp_path / "metrics.token").write_text("rotated-token\n")  # read per request: the new one serves
    assert fetch_raw(url, context, {"Authorization": "Bearer rotated-token"}) == 200


def test_metrics_auth_config_defaults_and_errors(certs, tmp_path):
    raw = yaml.safe_load((certs.parent / "cluster.yaml").read_text())
    config = config_from_dict(raw, certs.parent)
    assert security_settings(config, "router", env={"EMBER_TLS_DIR": str(certs / "router")}).metrics_auth == "mtls"
    plain = config_from_dict(raw | {"security": {"tls": "plaintext"}}, certs.parent)
    assert metrics_http.access_of(security_settings(plain, "router")) == metrics_http.MetricsAccess("none")
    with pytest.raises(ValueError, match="security.metrics.token_file: required with `auth: token`"):
        config_from_dict(raw | {"security": {"metrics": {"auth": "token"}}}, certs.parent)
    with pytest.raises(ValueError, match="security.metrics.auth: mtls needs the cluster's certificates"):
        config_from_dict(raw | {"security": {"tls": "plaintext", "metrics": {"auth": "mtls"}}}, certs.parent)
    with pytest.raises(ValueError, match="security.metrics.token_file: cannot read"):
        metrics_http.install(metrics_http.MetricsAccess("token", None, str(tmp_path / "missing")))
    secure = load_config(ROOT / "configs" / "local-secure.yaml").security  # no open /metrics there
    assert secure.metrics.auth == "mtls" and secure.metrics.mode(secure.tls) == "mtls"
