"""What a cluster's Redis needs from `ember certs` when `directory.url` is a Redis: its TLS
certificate under the cluster CA, the ACL users of the roles (ember.kv.redis_acl), and each role's
password in the folders of that role's services.

    OUT/redis/ca.crt tls.crt tls.key   redis-server's certificate (for the URL's host), and the CA it
                                       asks clients for (`tls-auth-clients yes`)
    OUT/redis/users.acl                its `aclfile`: the default user off, one user per role with its
                                       password as a SHA-256 digest (no password in this folder)
    OUT/<router|kvstore-*>/redis-password   the role's password (0600), beside the service's certificate:
                                       point directory.users.<role>.password_file at it

A role whose user reads its password from the environment (password_env) gets no file: the
variable must be set when `ember certs` runs, and its value's digest goes into users.acl.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from ember.cluster.certs import CertificateAuthority, _write
from ember.config.schema import ClusterConfig
from ember.config.services import services
from ember.kv.redis_acl import ROLES, acl_file

PASSWORD_FILE = "redis-password"
FOLDER = "redis"


def needed(config: ClusterConfig) -> bool:
    """Whether the config's directory is a Redis this cluster sets up (TLS or ACL users)."""
    d = config.directory
    return d.url is not None and (d.url.startswith("rediss://") or any(getattr(d.users, r) for r in ROLES))


def write_redis_files(config: ClusterConfig, out: str | Path, ca: CertificateAuthority) -> Path | None:
    """Write OUT/redis and each role's password (see the module's docstring). None when not needed."""
    if not needed(config):
        return None
    out = Path(out)
    d = config.directory
    if d.url.startswith("rediss://"):
        host = urlsplit(d.url).hostname or "localhost"
        ca.write_service(out, FOLDER, None, [f"{host}:0"])
    users = {}
    for role in ROLES:
        user = getattr(d.users, role)
        if user is None:
            continue
        if user.password_env is not None:
            password = os.environ.get(user.password_env, "").strip()
            if not password:
                raise ValueError(f"directory.users.{role}.password_env: ${user.password_env} is not set: `ember "
                                 "certs` puts its digest in redis/users.acl")
        else:
            password = secrets.token_urlsafe(32)
            for svc in services(config):
                if svc.role == role:
                    _write(out / svc.name / PASSWORD_FILE, password.encode() + b"\n", private=True)
        users[role] = (user.username, password)
    _write(out / FOLDER / "users.acl", acl_file(users).encode(), private=False)
    return out / FOLDER
