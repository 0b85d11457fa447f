"""Each service's Prometheus /metrics endpoint, who may read it (`security.metrics`), and how Ember's
own tools read it (`ember status`, the chaos harness, benchmarks, tests).

- mtls: HTTPS with the service's cluster certificate, and only a scraper presenting a certificate of
  the cluster CA that names the operator role (spiffe://ember/operator: `ember status`, tests,
  Prometheus) is served;
- token: `Authorization: Bearer TOKEN`, compared as SHA-256 digests in constant time, over HTTPS
  with the service's certificate unless the cluster runs plaintext;
- none: plain HTTP, open.

Refusals count in ember:auth_failures_total{reason, protocol="metrics"}: `metrics_tls` (no TLS
session: a plaintext client, no certificate or another CA's), `metrics_role` (a cluster certificate
of another role), `metrics_token` (no token or a wrong one). The TLS handshake runs on the
connection's own thread under a timeout, so a client that stalls it holds no other scrape up; the
certificate files and the token are read per connection, so rotated ones serve the next scrape.

A scraper's view of an endpoint is services.json's "metrics" entry (`endpoint()`): its address, the
scheme, and the files it authenticates with (never a secret itself).
"""
from __future__ import annotations

import hashlib
import hmac
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

HANDSHAKE_TIMEOUT_S = 5.0
SCRAPER_ROLE = "operator"


@dataclass(frozen=True)
class MetricsAccess:
    auth: str = "none"              # mtls, token, none
    tls_dir: str | None = None      # the service's certificate folder: HTTPS (None: plain HTTP)
    token_file: str | None = None   # token: the file holding the bearer token

    def __post_init__(self):
        if self.auth not in ("mtls", "token", "none"):
            raise ValueError(f"security.metrics.auth: {self.auth!r} is not mtls, token or none")
        if self.auth == "mtls" and self.tls_dir is None:
            raise ValueError("security.metrics.auth: mtls needs the service's certificate folder (security.tls)")
        if self.auth == "token" and self.token_file is None:
            raise ValueError("security.metrics.token_file: required with `auth: token`")


def access_of(settings) -> MetricsAccess:
    """The /metrics policy of a service's SecuritySettings (ember.config.services): HTTPS with its
    certificate unless auth is none or the cluster runs plaintext."""
    auth = settings.metrics_auth
    return MetricsAccess(auth, None if auth == "none" else settings.tls_dir, settings.metrics_token_file)


_access = MetricsAccess()


def install(access: MetricsAccess) -> None:
    """This process's /metrics policy (services/common.py, from its security settings)."""
    global _access
    if access.token_file is not None:
        read_token(access.token_file)  # unreadable or empty: fail at start, naming the field
    _access = access


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"security.metrics.token_file: cannot read {path}: {e.strerror or e}") from None
    if not token:
        raise ValueError(f"security.metrics.token_file: {path} is empty")
    return token


def _refused(reason: str) -> None:
    from ember.rpc import metrics
    metrics.AUTH_FAILURES.labels(reason, "metrics").inc()


def _server_context(access: MetricsAccess) -> ssl.SSLContext:
    folder = Path(access.tls_dir)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(folder / "tls.crt", folder / "tls.key")
    if access.auth == "mtls":
        ctx.load_verify_locations(cafile=str(folder / "ca.crt"))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class _Quiet(WSGIRequestHandler):
    timeout = 30  # a connection that stops sending is dropped

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


class _Server(ThreadingWSGIServer):
    """prometheus_client's threading WSGI server, its TLS handshake moved into each connection's thread."""
    access: MetricsAccess

    def finish_request(self, request, client_address):
        if self.access.tls_dir is None:
            return super().finish_request(request, client_address)
        from ember.rpc import security
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            tls = _server_context(self.access).wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return _refused("metrics_tls")
        try:
            if self.access.auth == "mtls" and not security.peer_has_role(tls.getpeercert(), {SCRAPER_ROLE}):
                return _refused("metrics_role")
            tls.settimeout(_Quiet.timeout)
            super().finish_request(tls, client_address)
        finally:
            tls.close()


def _classic_text(app):
    """Prometheus asks for OpenMetrics first, and prometheus_client's OpenMetrics exposition spells the
    `ember:` names with underscores (`ember_...`): the classic text format is served whatever the
    Accept header, so a scrape stores the names the dashboard, the docs and `ember status` use."""
    def serve(environ, start_response):
        environ = {k: v for k, v in environ.items() if k != "HTTP_ACCEPT"}
        return app(environ, start_response)
    return serve


def _guarded(app, access: MetricsAccess):
    """The metrics WSGI app behind the bearer token (mtls and none: the connection decided)."""
    if access.auth != "token":
        return app

    def check(environ, start_response):
        want = hashlib.sha256(read_token(access.token_file).encode()).digest()
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = header.partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        if not (hmac.compare_digest(given, want) and scheme.lower() == "bearer"):
            _refused("metrics_token")
            start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                ("WWW-Authenticate", 'Bearer realm="metrics"')])
            return [b"a bearer token is required (security.metrics)\n"]
        return app(environ, start_response)
    return check


def serve(address: str, registry=REGISTRY, access: MetricsAccess | None = None) -> ThreadingWSGIServer:
    """Serve `registry` on http(s)://ADDRESS/metrics under `access` (default: what is installed), from a
    daemon thread. Returns the server (its port: server.server_port)."""
    import threading
    access = access or _access
    host, port = address.rsplit(":", 1)
    server = _Server((host.strip("[]"), int(port)), _Quiet)
    server.access = access
    server.set_app(_guarded(_classic_text(make_wsgi_app(registry)), access))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


# -- scraping ----------------------------------------------------------------------------------
def endpoint(address: str, access: MetricsAccess, scraper_tls_dir: str | None) -> dict:
    """services.json's view of a service's /metrics: where, and with which files a scraper (the
    operator, whose certificate folder is `scraper_tls_dir`) authenticates."""
    out = {"address": address, "scheme": "https" if access.tls_dir else "http"}
    if access.tls_dir:
        if scraper_tls_dir is None:
            raise ValueError("an HTTPS /metrics needs the operator's certificate folder to be scraped")
        out["ca"] = str(Path(scraper_tls_dir) / "ca.crt")
    if access.auth == "mtls":
        out |= {"cert": str(Path(scraper_tls_dir) / "tls.crt"), "key": str(Path(scraper_tls_dir) / "tls.key")}
    if access.auth == "token":
        out["token_file"] = access.token_file
    return out


def fetch(target: str | dict, timeout_s: float) -> str:
    """The exposition text of a /metrics endpoint: `target` is services.json's entry (endpoint()) or a
    bare HOST:PORT of an open one. Raises OSError (urllib's errors included) when it does not answer."""
    e = {"address": target, "scheme": "http"} if isinstance(target, str) else target
    request = urllib.request.Request(f"{e['scheme']}://{e['address']}/metrics")
    if e.get("token_file"):
        request.add_header("Authorization", "Bearer " + read_token(e["token_file"]))
    context = None
    if e["scheme"] == "https":
        context = ssl.create_default_context(cafile=e.get("ca"))
        if e.get("cert"):
            context.load_cert_chain(e["cert"], e["key"])
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
        return response.read().decode()
