"""This process's identity on the cluster's internal hops: its TLS material and what it may do.

Every internal hop (gRPC between services, the kvstores' TCP data plane) is mutual TLS under
one cluster CA. A service's certificate names its role and site in a URI SAN,
`spiffe://ember/<role>/<site>` (`spiffe://ember/router`, `spiffe://ember/operator` for CLI tools
and tests), and servers authorize calls by that identity (ember.rpc.authz).

A service folder (what `ember certs` / `ember up` writes, or a mounted Kubernetes Secret in
cert-manager's layout) holds ca.crt, tls.crt, tls.key and, for the KV producers (prefill,
decode) only, kv-mac.key: the cluster secret that keys every KV frame's MAC. With TLS on, a
producer without it fails closed (`require_kv_mac`) unless the config opts out (`security:
{kv_mac: off}`): a forged frame would otherwise be imported unchecked into an engine's cache.

`install()` runs once at a process's edge (services/common.py, the engine core); with nothing
installed (`security: {tls: plaintext}`) every hop is plaintext and nothing is authorized.
"""
from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

SPIFFE_PREFIX = "spiffe://ember/"
ROLES = ("router", "prefill", "decode", "kvstore", "operator")
DATA_PLANE_CIPHERS = "ECDHE-ECDSA-AES128-GCM-SHA256"
KV_PRODUCERS = ("prefill", "decode")  # they hold kv-mac.key: they sign the KV frames they export, verify imports
MAC_KEY_FILE = "kv-mac.key"


@dataclass(frozen=True)
class Identity:
    role: str
    site: str | None = None

    @property
    def uri(self) -> str:
        return SPIFFE_PREFIX + self.role + (f"/{self.site}" if self.site else "")

    @classmethod
    def parse(cls, uri: str) -> Identity | None:
        """The identity a SAN URI names, or None when it is not one of ours."""
        if not uri.startswith(SPIFFE_PREFIX):
            return None
        role, _, site = uri[len(SPIFFE_PREFIX):].partition("/")
        return cls(role, site or None) if role in ROLES else None

    def __str__(self) -> str:
        return self.role + (f"@{self.site}" if self.site else "")


@dataclass(frozen=True)
class Credentials:
    folder: Path
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    mac_key: bytes | None  # only the KV producers hold it
    identity: Identity
    unsigned_kv: bool = False  # a producer without mac_key that the config let run (`security: {kv_mac: off}`)

    @classmethod
    def load(cls, folder: str | Path) -> Credentials:
        folder = Path(folder)
        missing = [n for n in ("ca.crt", "tls.crt", "tls.key") if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: no {', '.join(missing)} (a service's TLS folder holds ca.crt, "
                                    "tls.crt and tls.key; `ember certs --config FILE --out DIR` writes them)")
        cert_pem = (folder / "tls.crt").read_bytes()
        identity = identity_of_pem(cert_pem)
        if identity is None:
            raise ValueError(f"{folder}/tls.crt names no Ember identity (a SAN URI {SPIFFE_PREFIX}<role>[/<site>])")
        mac = folder / MAC_KEY_FILE
        return cls(folder, (folder / "ca.crt").read_bytes(), cert_pem, (folder / "tls.key").read_bytes(),
                   mac.read_bytes() if mac.is_file() else None, identity)

    # -- gRPC ----------------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    # -- the TCP data plane ----------------------------------------------------------------------
    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._load(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server's certificate and host name
        self._load(ctx)
        return ctx

    def _load(self, ctx: ssl.SSLContext) -> None:
        # The data plane moves hundreds of MB: TLS 1.2 with ECDHE + AES-128-GCM (forward secret,
        # authenticated) streamed 0.72 GB/s here against 0.51-0.55 for TLS 1.3's AES-256-GCM, and
        # Python cannot choose TLS 1.3's cipher suites. gRPC hops keep gRPC's TLS 1.3.
        ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_ciphers(DATA_PLANE_CIPHERS)
        ctx.load_verify_locations(cadata=self.ca_pem.decode())
        ctx.load_cert_chain(self.folder / "tls.crt", self.folder / "tls.key")


def require_kv_mac(creds: Credentials, kv_mac: str) -> Credentials:
    """Fail closed on a KV producer's missing MAC key: FileNotFoundError naming the file and the
    opt-out, unless `kv_mac` (security.kv_mac) is "off", which lets it run with unsigned frames
    (a warning; the returned credentials say so, and the engine core is told: `unsigned_kv`)."""
    if creds.identity.role not in KV_PRODUCERS or creds.mac_key is not None:
        return creds
    path = creds.folder / MAC_KEY_FILE
    if kv_mac != "off":
        raise FileNotFoundError(
            f"{path}: missing. With TLS on, {creds.identity.role} signs and verifies every KV frame with this "
            "cluster secret (`ember up` makes it with `tls: auto`; `ember certs --force` writes it for `tls: "
            "files`); to run without it, KV frames unsigned and imported unchecked, say `security: {kv_mac: off}`")
    logging.getLogger("ember.security").warning(
        "%s: missing and `security.kv_mac: off`: KV frames go unsigned and are imported unchecked", path)
    return replace(creds, unsigned_kv=True)


def identity_of_pem(cert_pem: bytes) -> Identity | None:
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    return next((i for u in san.get_values_for_type(x509.UniformResourceIdentifier)
                 if (i := Identity.parse(u)) is not None), None)


def identity_of_peercert(peercert: dict | None) -> Identity | None:
    """The identity in an `ssl` peer certificate (SSLSocket.getpeercert())."""
    for kind, value in (peercert or {}).get("subjectAltName", ()):
        if kind == "URI" and (i := Identity.parse(value)) is not None:
            return i
    return None


def peer_has_role(peercert: dict | None, roles: set[str]) -> bool:
    identity = identity_of_peercert(peercert)
    return identity is not None and identity.role in roles


def identity_of_context(context) -> Identity | None:
    """The verified identity of a gRPC call's peer; None on a plaintext port or without one."""
    auth = context.auth_context()
    for value in auth.get("x509_subject_alternative_name", ()) + auth.get("peer_uri", ()):
        identity = Identity.parse(value.decode() if isinstance(value, bytes) else value)
        if identity is not None:
            return identity
    return None


_installed: Credentials | None = None


def install(credentials: Credentials | None) -> None:
    """Make `credentials` this process's identity on every internal hop (None: plaintext)."""
    global _installed
    _installed = credentials


def current() -> Credentials | None:
    return _installed


def dial(address: str, credentials: Credentials | None = None, options=None) -> grpc.Channel:
    """A blocking channel to an internal service: mTLS with `credentials` (or what is installed),
    plaintext when there are none. For CLI tools and tests; services use ember.rpc.server.channel."""
    creds = credentials or _installed
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds.channel_credentials(), options=options)
