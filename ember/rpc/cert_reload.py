"""Certificates that change under a running process: re-read on SIGHUP and when their files change.

A `CertSource` is a certificate chain, its key and optionally a CA bundle (for verifying clients),
read from files. `watch(source)` puts it on this process's list; `run()` (started by
ember.rpc.server.Server.run) polls every watched source's files every POLL_S (mtime, size, inode:
a file replaced by a rename counts) and re-reads a source whose files changed; SIGHUP re-reads every
source at once. New material is taken only when it is whole: the certificate must parse and match
its key (a half-written pair is retried at the next poll, the old one served meanwhile).

Consumers see new material on their next TLS handshake, never in the middle of a connection, so
running streams keep their connection:
- gRPC servers: `grpc_credentials()` is grpc.dynamic_ssl_server_credentials, whose fetcher gRPC
  calls for each new handshake (it answers None while nothing changed);
- asyncio / aiohttp servers: `ssl_context()` is one SSLContext whose server-name callback (run for
  every ClientHello, with or without SNI) switches the connection to a context built from the
  current files (certificate and CA both: a CA removed is no longer trusted).

`watch_installed()` watches this process's own cluster folder (ember.rpc.security): on a change it
installs the new Credentials (same identity only), so channels opened afterwards dial with the new
files; open channels keep their connection.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc

log = logging.getLogger("ember.tls")
POLL_S = 1.0


def _stamp(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class CertSource:
    """A certificate chain + key (+ CA bundle), re-read when its files change (see the module)."""

    def __init__(self, cert: str | Path, key: str | Path, ca: str | Path | None = None, name: str = "",
                 client_auth: bool = False, alpn: tuple[str, ...] = (), tls12_data_plane: bool = False):
        self.cert, self.key = Path(cert), Path(key)
        self.ca = None if ca is None else Path(ca)
        self.name = name or str(self.cert)
        self.client_auth, self.alpn = client_auth, alpn
        self.tls12_data_plane = tls12_data_plane  # the kvstores' TCP data plane's suite (ember.rpc.security)
        self.generation = 0
        self.on_change: list[Callable[[CertSource], None]] = []
        self._stamps: tuple = ()
        self._failed: tuple = ()
        self._context: ssl.SSLContext | None = None
        self._current_context: ssl.SSLContext | None = None
        # (certificate, key, CA) PEM, replaced whole: gRPC's fetcher reads it from its own thread
        self.material: tuple[bytes, bytes, bytes | None] = (b"", b"", None)
        if not self.check(force=True):
            raise ValueError(f"{self.name}: {self.error}")

    @property
    def files(self) -> list[Path]:
        return [self.cert, self.key] + ([self.ca] if self.ca is not None else [])

    def check(self, force: bool = False) -> bool:
        """Re-read the files when they changed since the last read (or `force`); True when new
        material was taken. A failed read keeps the old material and is logged once per change."""
        stamps = tuple(_stamp(p) for p in self.files)
        if not force and stamps == self._stamps:
            return False
        try:
            cert_pem, key_pem = self.cert.read_bytes(), self.key.read_bytes()
            ca_pem = self.ca.read_bytes() if self.ca is not None else None
            context = self._build(cert_pem, key_pem, ca_pem)  # the pair must match, the CA parse
        except (OSError, ssl.SSLError, ValueError) as e:
            self.error = f"cannot load {', '.join(map(str, self.files))}: {e}"
            if self.generation and stamps != self._failed:
                log.error("%s: new certificate files not taken (the old ones stay in use): %s", self.name, self.error)
            self._failed = stamps
            return False
        if self.generation and (cert_pem, key_pem, ca_pem) == self.material:
            self._stamps = stamps  # touched, not changed
            return False
        self.material, self._stamps = (cert_pem, key_pem, ca_pem), stamps
        self._current_context = context
        self.generation += 1
        if self.generation > 1:
            log.info("%s: certificate files re-read (generation %d): new handshakes use them", self.name,
                     self.generation)
        for callback in self.on_change:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - one consumer's failure must not stop the others
                log.exception("%s: a consumer of the new certificate failed", self.name)
        return True

    # -- gRPC -------------------------------------------------------------------------------------
    def _grpc_config(self):
        cert_pem, key_pem, ca_pem = self.material
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)],
                                                         root_certificates=ca_pem if self.client_auth else None)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        served = [self.generation]

        def fetch():  # gRPC calls this before each new handshake: None keeps the current config
            if served[0] == self.generation:
                return None
            served[0] = self.generation
            return self._grpc_config()
        return grpc.dynamic_ssl_server_credentials(self._grpc_config(), fetch,
                                                   require_client_authentication=self.client_auth)

    # -- ssl (asyncio, aiohttp) ---------------------------------------------------------------------
    @property
    def cert_pem(self) -> bytes:
        return self.material[0]

    def _build(self, cert_pem: bytes, key_pem: bytes, ca_pem: bytes | None) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if self.tls12_data_plane:
            from ember.rpc.security import DATA_PLANE_CIPHERS
            ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_2
            ctx.set_ciphers(DATA_PLANE_CIPHERS)
        else:
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.alpn:
            ctx.set_alpn_protocols(list(self.alpn))
        if ca_pem is not None:
            ctx.load_verify_locations(cadata=ca_pem.decode())
            if self.client_auth:
                ctx.verify_mode = ssl.CERT_REQUIRED
        # load_cert_chain reads files only: the bytes just read go through a private temporary file
        with tempfile.NamedTemporaryFile(prefix="ember-tls-") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(cert_pem + b"\n" + key_pem)
            f.flush()
            ctx.load_cert_chain(f.name)
        return ctx

    def ssl_context(self) -> ssl.SSLContext:
        """A server context that hands each new connection the current files' context."""
        if self._context is None:
            base = self._build(*self.material)

            def switch(sslobj, server_name, _ctx):
                if self._current_context is not None and sslobj.context is not self._current_context:
                    sslobj.context = self._current_context
            base.sni_callback = switch
            self._context = base
        return self._context


_watched: list[CertSource] = []


def watch(source: CertSource) -> CertSource:
    """Re-read `source` on SIGHUP and when its files change, while `run()` runs."""
    if source not in _watched:
        _watched.append(source)
    return source


def forget(source: CertSource) -> None:
    """Stop re-reading `source` (a server that stopped)."""
    if source in _watched:
        _watched.remove(source)


def reload_all(force: bool = True) -> int:
    """Re-read every watched source (force: even when its files look unchanged). How many took new material."""
    return sum(source.check(force) for source in list(_watched))


_installed: CertSource | None = None


def watch_installed() -> CertSource | None:
    """This process's cluster certificate folder (ember.rpc.security), watched: on a change the new
    Credentials are installed (the same identity only). None when it runs plaintext."""
    global _installed
    from ember.rpc import security
    creds = security.current()
    if creds is None:
        return None
    if _installed is not None and _installed.cert == creds.folder / "tls.crt":
        return _installed
    source = CertSource(creds.folder / "tls.crt", creds.folder / "tls.key", creds.folder / "ca.crt",
                        name=f"{creds.identity} ({creds.folder})", client_auth=True)

    def install(_source: CertSource) -> None:
        new = security.Credentials.load(creds.folder)
        if new.identity != creds.identity:
            log.error("%s now names %s, not %s: not installed for new channels", creds.folder, new.identity,
                      creds.identity)
            return
        security.install(new)
    source.on_change.append(install)
    _installed = watch(source)
    return source


async def run(every_s: float = POLL_S) -> None:
    """Poll the watched files every `every_s`, and re-read them all on SIGHUP, until cancelled."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):  # (not the main thread: no signals)
        loop.add_signal_handler(signal.SIGHUP, _on_sighup)
    try:
        while True:
            await asyncio.sleep(every_s)
            reload_all(force=False)
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGHUP)


def _on_sighup() -> None:
    log.info("SIGHUP: re-reading %d certificate source(s)", len(_watched))
    reload_all(force=True)
