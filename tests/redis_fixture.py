"""A real redis-server on a free port, started and stopped by the tests (no persistence).

`tls`: a folder of ca.crt, tls.crt, tls.key (ember.cluster.certs' layout): the server listens only
on TLS (`--port 0 --tls-port`) and asks every client for a certificate of that CA
(`tls-auth-clients yes`). `aclfile`: its users (ember.kv.redis_acl), the default user off."""
from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class RedisServer:
    def __init__(self, port: int, workdir: Path, tls: Path | None = None, aclfile: Path | None = None):
        self.port, self.workdir, self.tls, self.aclfile = port, workdir, tls, aclfile
        self.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}/0"
        self.log = workdir / f"redis-{port}.log"  # what the server says, refusals included
        self.proc: subprocess.Popen | None = None

    def argv(self, binary: str) -> list[str]:
        argv = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--logfile", str(self.log)]
        if self.tls is None:
            argv += ["--port", str(self.port)]
        else:
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls / "tls.crt"),
                     "--tls-key-file", str(self.tls / "tls.key"), "--tls-ca-cert-file", str(self.tls / "ca.crt"),
                     "--tls-auth-clients", "yes"]
        if self.aclfile is not None:
            argv += ["--aclfile", str(self.aclfile)]
        return argv

    def start(self, timeout_s: float = 10) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: `apt-get install redis-server` (.ci/run does this)")
        self.proc = subprocess.Popen(self.argv(binary), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not come up on port {self.port}")
            time.sleep(0.05)
        return self

    def ping(self, client_cert: Path | None = None) -> bool:
        """Whether it answers a PING (with TLS: as a client holding `client_cert`'s folder, default the
        server's own; NOAUTH counts: it answered)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                s = raw
                if self.tls is not None:
                    folder = client_cert or self.tls
                    ctx = ssl.create_default_context(cafile=str(self.tls / "ca.crt"))
                    ctx.load_cert_chain(folder / "tls.crt", folder / "tls.key")
                    s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> None:
        """Kill it outright (as a crash would): no shutdown, no save."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


# -- a cluster's Redis with TLS and its ACL users, from the cluster's own config (`ember certs`) --------
USERS = {"router": "ember-router", "kvstore": "ember-kvstore"}


def secure_overrides(url: str) -> dict:
    """Config sections (ember.cluster.ports.merge) for a cluster whose directory is the rediss:// `url`
    with one ACL user per role, its certificates (and the users' passwords) in CONFIG_DIR/certs."""
    users = {role: {"username": name, "password_file": "certs/{name}/redis-password"} for role, name in USERS.items()}
    return {"directory": {"url": url, "users": users}, "security": {"tls": "files", "tls_dir": "certs/{name}"}}


def write_secure_files(config_path: Path) -> Path:
    """What `ember certs` writes for the config: the CA, every service's folder, redis/ (its certificate and
    users.acl) and each role's redis-password, in CONFIG_DIR/certs."""
    from ember.cluster.certs import CertificateAuthority, write_cluster_certs
    from ember.cluster.redis_files import write_redis_files
    from ember.config.load import load_config
    config = load_config(config_path)
    out = write_cluster_certs(config, config_path.parent / "certs")
    write_redis_files(config, out, CertificateAuthority.load(out))
    return out


def secure_server(port: int, certs: Path) -> RedisServer:
    """A RedisServer over TLS with the cluster's users (not started)."""
    return RedisServer(port, certs.parent, tls=certs / "redis", aclfile=certs / "redis" / "users.acl")


@contextmanager
def installed(folder: Path) -> Iterator[None]:
    """Within the block this process holds the cluster certificate in `folder` (ember.rpc.security), as
    the service it belongs to does; what was installed before comes back after."""
    from ember.rpc import security
    before = security.current()
    security.install(security.Credentials.load(folder))
    try:
        yield
    finally:
        security.install(before)
