"""The router's public TLS (router.tls): which certificate its public gRPC and HTTP ports serve.

- unset: plaintext (API keys then cross the network in clear unless something in front terminates TLS);
- `auto`: the folder `ember up` made from the cluster CA (ember.cluster.certs.write_router_public),
  named by EMBER_ROUTER_TLS_DIR; clients trust RUN_DIR/certs/ca.crt;
- `{cert, key[, ca]}`: files (paths relative to the config file).

Either way the files are re-read on SIGHUP and when they change (ember.rpc.cert_reload): new
handshakes get the new certificate, running streams keep their connection. gRPC negotiates HTTP/2
by ALPN (h2) as always; the HTTP API offers http/1.1 only (aiohttp's server speaks no HTTP/2).
"""
from __future__ import annotations

import os
from pathlib import Path

from ember.config.services import RouterSettings
from ember.rpc.cert_reload import CertSource

ENV_DIR = "EMBER_ROUTER_TLS_DIR"


def source(settings: RouterSettings, env: dict | None = None) -> CertSource | None:
    """The public ports' certificate, or None for plaintext. ValueError naming router.tls when its
    files are missing or do not load."""
    if settings.tls is None:
        return None
    if settings.tls == "auto":
        folder = (os.environ if env is None else env).get(ENV_DIR)
        if not folder:
            raise ValueError(f"router.tls: auto, but no certificate was made for this router ({ENV_DIR} is unset): "
                             "`ember up` makes one from the cluster CA (`ember certs` writes OUT/router-public/ "
                             f"for {ENV_DIR}); elsewhere give router.tls: {{cert: FILE, key: FILE}}")
        cert, key = Path(folder) / "tls.crt", Path(folder) / "tls.key"
    else:
        cert, key = Path(settings.tls_cert), Path(settings.tls_key)
    try:
        return CertSource(cert, key, name="router public TLS", alpn=("http/1.1",))
    except ValueError as e:
        raise ValueError(f"router.tls: {e}") from None
