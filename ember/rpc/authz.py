"""Who may call what: every internal RPC names the roles allowed to make it, and the caller's
role is the one its mTLS certificate names (ember.rpc.security). Anything else is
PERMISSION_DENIED; a method missing from the table is denied too (a new RPC must say who
calls it). The router's public API (ember.v1.Router), health and reflection are open here: API
keys guard the first and the last at the router's public port (services/router/public_auth.py), and
health says nothing a caller could use.

With no credentials installed (`security: {tls: plaintext}`) nothing is checked.
"""
from __future__ import annotations

import contextlib

import grpc

from ember.rpc import security
from ember.rpc.errors import RpcError

OPEN = None  # anyone who reaches the port
ANY = frozenset(security.ROLES)
ENGINES = frozenset({"prefill", "decode"})

POLICY: dict[str, frozenset[str] | None] = {
    "/ember.v1.Router/": OPEN,
    "/grpc.health.v1.Health/": OPEN,
    # reflection tells what the protos say: open here (an internal port's TLS handshake already asks
    # for a cluster certificate); at the router's public port API keys guard it (services/router/public_auth.py)
    "/grpc.reflection.v1alpha.ServerReflection/": OPEN,
    "/grpc.reflection.v1.ServerReflection/": OPEN,
    # a kvstore: engines read and write blocks; peers stream blocks from it; anyone reads stats
    "/ember.v1.KVStore/Lookup": ANY,
    "/ember.v1.KVStore/Stats": ANY,
    "/ember.v1.KVStore/Put": ENGINES,            # only KV producers write blocks
    "/ember.v1.KVStoreBulk/Put": ENGINES,
    "/ember.v1.KVStore/Get": ENGINES | {"kvstore"},
    "/ember.v1.KVStoreBulk/Get": ENGINES | {"kvstore"},  # a peer's Pull over gRPC
    "/ember.v1.KVStore/Pull": ENGINES,
    "/ember.v1.KVStore/Acquire": ENGINES,
    "/ember.v1.KVStore/Renew": ENGINES,
    "/ember.v1.KVStore/Release": ENGINES,
    # model weight chunks: workers fetch a model through their site's store, stores from each other
    "/ember.v1.WeightStore/GetManifest": ENGINES | {"kvstore"},
    "/ember.v1.WeightStore/GetWeightChunks": ENGINES | {"kvstore"},
    "/ember.v1.WeightStore/PullModel": ENGINES,
    "/ember.v1.WeightStore/RenewModel": ENGINES,
    "/ember.v1.WeightStore/WeightStats": ANY,
    # engines take work from the router only
    "/ember.v1.Prefill/Prefill": frozenset({"router"}),
    "/ember.v1.Decode/Decode": frozenset({"router"}),
    "/ember.v1.Decode/Stats": frozenset({"router", "operator"}),
    # the router's in-memory block directory: kvstores publish what they hold
    "/ember.v1.BlockDirectory/Publish": frozenset({"kvstore"}),
    "/ember.v1.BlockDirectory/Lookup": frozenset({"router", "operator"}),
}


def allowed_roles(method: str) -> frozenset[str] | None:
    """The roles that may call `method` (None: open); unknown methods allow nobody."""
    if method in POLICY:
        return POLICY[method]
    for prefix, roles in POLICY.items():
        if prefix.endswith("/") and method.startswith(prefix):
            return roles
    return frozenset()


def check(method: str, context) -> None:
    roles = allowed_roles(method)
    if roles is OPEN:
        return
    identity = security.identity_of_context(context)
    if identity is None:
        raise RpcError(grpc.StatusCode.UNAUTHENTICATED, f"{method} needs a cluster certificate (mTLS)")
    if identity.role not in roles:
        allowed = ", ".join(sorted(roles)) or "no one"
        raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                       f"{identity} may not call {method} (allowed: {allowed})")


def guarded(handler, before):
    """`handler` (a gRPC method handler of any kind) with `await before(context)` run ahead of it: a
    `before` that raises or aborts refuses the call before the handler starts. A streaming handler is
    closed with its call."""
    def unary(fn):
        async def wrapped(request, context):
            await before(context)
            return await fn(request, context)
        return wrapped

    def streaming(fn):
        async def wrapped(request, context):
            await before(context)
            async with contextlib.aclosing(fn(request, context)) as items:
                async for item in items:
                    yield item
        return wrapped

    args = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), *args)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), *args)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), *args)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), *args)
    return handler


class AuthzInterceptor(grpc.aio.ServerInterceptor):
    """Checks the caller's role before the handler runs. Sits inside ErrorInterceptor, which
    turns the refusal into its status."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        async def authorized(context) -> None:
            check(method, context)
        return guarded(handler, authorized)
