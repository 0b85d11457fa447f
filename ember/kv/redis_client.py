"""Connections to the block directory's Redis (ember.kv.directory, the routers' shared worker view).

A `rediss://` URL is TLS: the server's certificate is checked against `tls_ca` (unset: the cluster
CA this service holds, ember.rpc.security) and its host name, and the service presents its own
cluster certificate when redis-server asks for one (`tls-auth-clients yes|optional`). A `user` is
the Redis ACL user of the service's role (ember.kv.redis_acl): its password is read from a file or
an environment variable when a connection opens (a rotated file is picked up by the next one), and
never from the config file, never logged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RedisUser:
    username: str
    password_file: str | None = None  # absolute path
    password_env: str | None = None   # name of the environment variable holding it
    field: str = "directory.users"    # the config key it came from, for errors

    def password(self) -> str:
        """The password, read now. Raises ValueError naming the config field when it cannot be."""
        if self.password_file is not None:
            try:
                value = Path(self.password_file).read_text().strip()
            except OSError as e:
                raise ValueError(f"{self.field}.password_file: cannot read {self.password_file}: "
                                 f"{e.strerror or e}") from None
            if not value:
                raise ValueError(f"{self.field}.password_file: {self.password_file} is empty")
            return value
        value = os.environ.get(self.password_env or "", "").strip()
        if not value:
            raise ValueError(f"{self.field}.password_env: ${self.password_env} is not set (or empty)")
        return value

    def __repr__(self) -> str:  # never the password: only where it is read from
        where = self.password_file if self.password_file is not None else f"${self.password_env}"
        return f"RedisUser({self.username!r}, password from {where})"


@dataclass(frozen=True)
class RedisSettings:
    url: str                          # redis://, rediss:// (TLS) or unix://; never with a password in it
    tls_ca: str | None = None         # rediss: the CA file of redis-server's certificate; None: the cluster CA
    client_cert: bool = True          # rediss: present this service's cluster certificate when asked
    user: RedisUser | None = None     # None: Redis's default user

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://")


def connect(target: RedisSettings | str, timeout_s: float = 0.5, credentials=None):
    """A redis.asyncio.Redis for `target` (settings, or a bare URL: no TLS options, no user).
    `credentials`: the cluster identity to use (default: what this process installed)."""
    import redis.asyncio as redis
    from redis.credentials import CredentialProvider

    from ember.rpc import security

    class UserCredentials(CredentialProvider):
        """redis-py asks at every new connection: the file (or variable) is read again then."""

        def __init__(self, user: RedisUser):
            self.user = user

        def get_credentials(self) -> tuple[str, str]:
            return self.user.username, self.user.password()

        async def get_credentials_async(self) -> tuple[str, str]:
            return self.get_credentials()
    s = RedisSettings(target) if isinstance(target, str) else target
    # short timeouts: a dead Redis must cost a request milliseconds, not seconds
    options: dict = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if s.user is not None:
        s.user.password()  # fail at start, naming the field, rather than at every connection
        options["credential_provider"] = UserCredentials(s.user)
    if s.tls:
        creds = credentials if credentials is not None else security.current()
        if s.tls_ca is not None:
            options["ssl_ca_certs"] = s.tls_ca
        elif creds is not None:  # (files, read at each new connection: rotated ones are picked up)
            options["ssl_ca_certs"] = str(creds.folder / "ca.crt")
        if s.client_cert and creds is not None:
            options["ssl_certfile"] = str(creds.folder / "tls.crt")
            options["ssl_keyfile"] = str(creds.folder / "tls.key")
    return redis.Redis.from_url(s.url, **options)
