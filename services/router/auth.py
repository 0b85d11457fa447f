"""API keys at the router's public API, and who each key's tenant is.

A key table maps API keys to tenant names: `router.api_keys_file` (YAML, `KEY: TENANT`) plus the
`EMBER_API_KEY` environment variable (tenant `default`), read once at the edge
(services/router/__main__.py). With any key configured, every public route but health needs one:
HTTP `Authorization: Bearer KEY` (OpenAI's convention), gRPC `authorization: Bearer KEY`
metadata. With none configured, nobody is asked (tenant ANONYMOUS: the plain, shared cache).

The file may instead hold two sections, the keys and each tenant's fair-share weight and quotas
(services/router/admission.py; every field optional, a tenant not listed has weight 1 and no
quota):

    keys: {KEY: TENANT, ...}
    tenants:
      TENANT: {weight: 2, max_inflight: 16, requests_per_s: 5, tokens_per_min: 60000}

A presented key is checked against every configured key in constant time: SHA-256 digests
compared with `hmac.compare_digest`, all of them, with no early exit, so the time taken tells
nothing about which key (or how much of one) matched. Only the digests are kept.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

import yaml

from ember.services.router.admission import TenantPolicy

ANONYMOUS = ""               # the tenant of every request when no key is configured
ENV_TENANT = "default"       # the tenant of EMBER_API_KEY
MAX_KEY_BYTES = 4096
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")


class Authenticated:
    """A call context from an in-process edge that authenticated its caller itself (the HTTP API):
    `RouterService` takes `tenant` from it instead of reading gRPC metadata."""
    tenant: str = ANONYMOUS


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyTable:
    """API key digests -> tenant names."""

    def __init__(self, keys: dict[str, str] | None = None, policies: dict[str, TenantPolicy] | None = None):
        self.policies = dict(policies or {})  # tenant -> weight and quotas (admission.py)
        self._entries: list[tuple[bytes, str]] = []
        for key, tenant in (keys or {}).items():
            if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY_BYTES or key != key.strip():
                raise ValueError(f"an API key must be a non-empty string of at most {MAX_KEY_BYTES} bytes without "
                                 "surrounding spaces")
            if not isinstance(tenant, str) or not _TENANT.match(tenant):
                raise ValueError(f"tenant name {tenant!r}: 1-128 characters of letters, digits and ._@:- "
                                 "(starting with a letter or digit)")
            self._entries.append((_digest(key), tenant))

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (else no request is asked for one)."""
        return bool(self._entries)

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self._entries}

    def tenant(self, key: str | None) -> str | None:
        """The tenant of `key`; None when it matches no configured key (or is missing). ANONYMOUS when
        no key is configured at all."""
        if not self._entries:
            return ANONYMOUS
        presented = _digest(key or "")
        found = None
        for digest, tenant in self._entries:  # every entry, whatever matched before
            match = hmac.compare_digest(digest, presented)
            found = tenant if match and found is None else found
        return found

    def check_authorization(self, header: str | None) -> str | None:
        """The tenant for an `Authorization` header value (`Bearer KEY`), None when it does not
        name a configured key."""
        return self.tenant(bearer(header))


def bearer(header: str | None) -> str | None:
    """KEY from `Bearer KEY` (scheme case-insensitive); None for anything else."""
    if not header:
        return None
    scheme, _, key = header.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key


def load(keys_file: str | Path | None, env_key: str | None = None) -> KeyTable:
    """The key table from `keys_file` (YAML mapping each key to its tenant) and `env_key`
    (EMBER_API_KEY: tenant `default`). ValueError naming the problem for a bad file."""
    keys: dict[str, str] = {}
    policies: dict[str, TenantPolicy] = {}
    if keys_file is not None:
        path = Path(keys_file)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as e:
            raise ValueError(f"router.api_keys_file: cannot read {path}: {e.strerror or e}") from e
        except yaml.YAMLError as e:
            raise ValueError(f"router.api_keys_file: {path} is not YAML: {e}") from e
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"router.api_keys_file: {path} must map each API key to a tenant name "
                             "(`KEY: TENANT`, one a line)")
        if isinstance(data.get("keys"), dict) or isinstance(data.get("tenants"), dict):  # the two-section form
            if set(data) - {"keys", "tenants"}:
                raise ValueError(f"router.api_keys_file: {path}: with sections, only `keys:` and `tenants:` "
                                 f"(found {sorted(set(data) - {'keys', 'tenants'})})")
            policies = _policies(path, data.get("tenants") or {})
            data = data.get("keys") or {}
        for key, tenant in data.items():
            if not isinstance(key, str) or not isinstance(tenant, str):
                raise ValueError(f"router.api_keys_file: {path}: keys and tenant names must be strings (quote "
                                 "a key YAML would read as a number or a boolean)")
        keys.update(data)
    if env_key is not None and env_key.strip():
        env_key = env_key.strip()
        if keys.get(env_key, ENV_TENANT) != ENV_TENANT:
            raise ValueError(f"EMBER_API_KEY is also in router.api_keys_file, for tenant {keys[env_key]!r}: one key "
                             f"names one tenant (EMBER_API_KEY's is {ENV_TENANT!r})")
        keys[env_key] = ENV_TENANT
    try:
        table = KeyTable(keys, policies)
    except ValueError as e:
        raise ValueError(f"router.api_keys_file: {e}") from e
    unknown = set(policies) - table.tenants
    if unknown:
        raise ValueError(f"router.api_keys_file: tenants {sorted(unknown)} have quotas but no key")
    return table


def _policies(path: Path, tenants: dict) -> dict[str, TenantPolicy]:
    fields = set(TenantPolicy.__dataclass_fields__)
    out = {}
    for name, spec in tenants.items():
        where = f"router.api_keys_file: {path}: tenants.{name}"
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: a mapping of {', '.join(sorted(fields))}")
        if set(spec) - fields:
            raise ValueError(f"{where}: unknown {sorted(set(spec) - fields)} (known: {', '.join(sorted(fields))})")
        try:
            out[str(name)] = TenantPolicy(**spec)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
    return out
