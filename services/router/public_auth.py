"""API keys on every call to the router's public gRPC port, before any handler runs.

With API keys configured (services/router/auth.py), a call without a valid `authorization: Bearer
KEY` is refused UNAUTHENTICATED whatever it names: `ember.v1.Router`, server reflection, a method
that does not exist (so an unauthenticated caller learns nothing, not even which services are
registered: UNIMPLEMENTED is for callers with a key). Health stays open. A call whose peer holds
a cluster certificate (the router's internal mTLS port, the same gRPC server: kvstores publishing
to the block directory) is identified by it (ember.rpc.authz checks its role) and never asked for
a key. Every refusal is counted in `ember:auth_failures_total{reason,protocol}`; no key ever
reaches a log line (only the reason).
"""
from __future__ import annotations

import logging

import grpc

from ember.rpc import metrics, security
from ember.rpc.authz import guarded
from ember.services.router.auth import KeyTable, bearer

log = logging.getLogger("ember.router")
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def refusal(keys: KeyTable, header: str | None) -> str | None:
    """Why an `Authorization` value is refused (missing_key, malformed_header, invalid_key), or None
    when it names a configured key (or no key is configured)."""
    if not keys.enabled:
        return None
    if header is None or not header.strip():
        return "missing_key"
    key = bearer(header)
    if key is None:
        return "malformed_header"
    return None if keys.tenant(key) is not None else "invalid_key"


def count(reason: str, protocol: str) -> None:
    metrics.AUTH_FAILURES.labels(reason, protocol).inc()


MESSAGES = {"missing_key": "a valid API key is required: send the metadata `authorization: Bearer KEY`",
            "malformed_header": "the `authorization` metadata must be `Bearer KEY`",
            "invalid_key": "invalid API key"}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses UNAUTHENTICATED every call but health from a caller without a valid API key and
    without a cluster certificate (see the module). Sits innermost, inside ErrorInterceptor."""

    def __init__(self, keys: KeyTable):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if not self.keys.enabled or details.method.startswith(OPEN_PREFIXES):
            return handler
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        reason = refusal(self.keys, header)
        if reason is None:
            return handler
        method = details.method

        async def refuse(context) -> None:
            count(reason, "grpc")
            log.info("refused %s from %s: %s (no key is logged)", method, context.peer(), reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, MESSAGES[reason])

        def cluster_peer(context) -> bool:
            return security.identity_of_context(context) is not None

        if handler is None:  # no such method: UNIMPLEMENTED is only for callers who may know that
            async def unknown(requests, context):
                if cluster_peer(context):
                    await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")
                await refuse(context)
                yield  # (an async generator: gRPC reads no request first)
            return grpc.stream_stream_rpc_method_handler(unknown)

        async def key_or_cluster_peer(context) -> None:
            if not cluster_peer(context):
                await refuse(context)
        return guarded(handler, key_or_cluster_peer)
