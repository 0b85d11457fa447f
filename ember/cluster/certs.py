"""A throwaway CA and one certificate per service of a cluster config (`tls: auto`, `ember certs`).

Layout written under OUT (one folder per service, cert-manager's Secret keys, so a Kubernetes
Secret or a Compose volume mounts the same files):

    OUT/ca.crt, OUT/ca.key                 the cluster CA (the key never leaves OUT)
    OUT/<service>/ca.crt tls.crt tls.key   e.g. OUT/kvstore-central/, OUT/router/
    OUT/<prefill|decode ...>/kv-mac.key    the KV frame MAC secret: KV producers only
    OUT/operator/                          for `ember status`, benchmarks and tests
    OUT/router-public/ca.crt tls.crt tls.key  the router's public ports' server certificate
                                           (router.tls: auto): clients trust OUT/ca.crt

Each certificate names its service's role and site in a SAN URI (ember.rpc.security) and is
valid for the host names and IPs of the service's addresses, plus localhost and its own name.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ember.config.schema import ClusterConfig
from ember.config.services import services
from ember.rpc.security import Identity

ROUTER_PUBLIC = "router-public"  # the folder of the router's public server certificate (router.tls: auto)
VALID_DAYS = 30  # `ember up` makes fresh ones on every start; `ember certs --days` for mounted ones
MAC_KEY_BYTES = 32
KV_PRODUCERS = ("prefill", "decode")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # P-256: the cheapest handshake gRPC and OpenSSL share


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _hosts(addresses: list[str | None], name: str) -> list[x509.GeneralName]:
    names: dict[str, x509.GeneralName] = {}
    for host in ["localhost", "127.0.0.1", name] + [a.rsplit(":", 1)[0] for a in addresses if a]:
        host = host.strip("[]")
        try:
            names[host] = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            names[host] = x509.DNSName(host)
    return list(names.values())


class CertificateAuthority:
    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, valid_days: int = VALID_DAYS):
        self.key, self.cert, self.valid_days = key, cert, valid_days

    @classmethod
    def create(cls, name: str = "ember cluster CA", valid_days: int = VALID_DAYS) -> CertificateAuthority:
        key = _key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=valid_days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, encipher_only=False,
                                             decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert, valid_days)

    @classmethod
    def load(cls, folder: Path) -> CertificateAuthority:
        key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
        return cls(key, x509.load_pem_x509_certificate((folder / "ca.crt").read_bytes()))

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, identity: Identity | None, addresses: list[str | None] = ()) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for one service: server and client use, its SANs (no Ember
        identity for a server that is not an Ember service: redis-server)."""
        uris = [x509.UniformResourceIdentifier(identity.uri)] if identity else []
        return self._sign(name, uris + _hosts(list(addresses), name),
                          [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])

    def issue_server(self, name: str, addresses: list[str | None]) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) of a plain TLS server (the router's public ports): no cluster
        identity, server use only, valid for the addresses' hosts plus localhost and 127.0.0.1."""
        return self._sign(name, _hosts(list(addresses), "localhost"), [ExtendedKeyUsageOID.SERVER_AUTH])

    def _sign(self, name: str, sans: list, usages: list) -> tuple[bytes, bytes]:
        """A new key and its certificate, signed by this CA for `valid_days`: (certificate PEM, key PEM)."""
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=self.valid_days))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                .sign(self.key, hashes.SHA256()))
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def write_server(self, folder: Path, name: str, addresses: list[str | None]) -> Path:
        cert, key = self.issue_server(name, addresses)
        _write(folder / "ca.crt", self.cert_pem)
        _write(folder / "tls.key", key, private=True)  # the key first: a watcher never sees a new cert with the old key
        _write(folder / "tls.crt", cert)
        return folder

    def write_service(self, out: Path, name: str, identity: Identity | None, addresses: list[str | None] = (),
                      mac_key: bytes | None = None) -> Path:
        folder = out / name
        cert, key = self.issue(name, identity, addresses)
        _write(folder / "ca.crt", self.cert_pem)
        _write(folder / "tls.crt", cert)
        _write(folder / "tls.key", key, private=True)
        if mac_key is not None:
            _write(folder / "kv-mac.key", mac_key, private=True)
        return folder


def service_addresses(config: ClusterConfig, role: str, site: str | None, address: str) -> list[str | None]:
    if role == "router":
        return [config.router.listen, config.router.internal, config.router.http]
    if role == "kvstore":
        return [address, config.site(site).kvstore_data]
    return [address]


def write_cluster_certs(config: ClusterConfig, out: str | Path, valid_days: int = VALID_DAYS) -> Path:
    """A fresh CA, a certificate per service of `config` and the operator's, and the KV MAC secret
    (in the producers' folders only), under `out`, valid for `valid_days`. Returns `out`."""
    out = Path(out)
    ca = CertificateAuthority.create(valid_days=valid_days)
    _write(out / "ca.crt", ca.cert_pem)
    _write(out / "ca.key", _pem_key(ca.key), private=True)
    mac_key = os.urandom(MAC_KEY_BYTES)
    for svc in services(config):
        ca.write_service(out, svc.name, Identity(svc.role, svc.site),
                         service_addresses(config, svc.role, svc.site, svc.address),
                         mac_key if svc.role in KV_PRODUCERS else None)
    ca.write_service(out, "operator", Identity("operator"))
    if config.router.tls == "auto":
        write_router_public(config, out, ca)
    return out


def write_router_public(config: ClusterConfig, out: str | Path, ca: CertificateAuthority | None = None) -> Path:
    """OUT/router-public: the router's public server certificate (router.tls: auto) for the hosts of
    router.listen and router.http, from the CA in OUT (made there first when OUT has none: a cluster
    whose internal hops are not `tls: auto`). Clients trust OUT/ca.crt. Returns the folder."""
    out = Path(out)
    if ca is None:
        if (out / "ca.key").is_file():
            ca = CertificateAuthority.load(out)
        else:
            ca = CertificateAuthority.create()
            _write(out / "ca.crt", ca.cert_pem)
            _write(out / "ca.key", _pem_key(ca.key), private=True)
    return ca.write_server(out / ROUTER_PUBLIC, "ember router", [config.router.listen, config.router.http])
