"""Map exceptions to gRPC status codes in one interceptor, so servicers stay thin."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace

from ember.errors import CapacityError, FrameError, IntegrityError, InvalidRequestError, NotFoundError
from ember.rpc import logs, metrics, tracing

log = logging.getLogger("ember.rpc")


class RpcError(Exception):
    """Raise from a servicer to answer with a specific status."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s  # RESOURCE_EXHAUSTED: when to come back (grpc-retry-pushback-ms)

    def trailing_metadata(self) -> tuple:
        if self.retry_after_s is None:
            return ()
        return (("grpc-retry-pushback-ms", str(max(1, int(self.retry_after_s * 1000)))),)


def refuse(context, error: RpcError) -> None:
    """Answer `error`'s status from a handler that then returns, without raising: refusing under
    overload must stay cheap (a raised error is recorded, traceback and all, by the tracing
    interceptor and logged here). The caller counts the refusal in its own metric."""
    context.set_code(error.code)
    context.set_details(str(error))
    context.set_trailing_metadata(error.trailing_metadata())


def require_ready(engine) -> None:
    if engine is None:
        raise RpcError(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, RpcError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream call failed: pass its status on
        code = exc.code()
        if code == grpc.StatusCode.CANCELLED:
            code = grpc.StatusCode.UNAVAILABLE
        return code, f"{exc.details()}"
    if isinstance(exc, IntegrityError):
        return grpc.StatusCode.DATA_LOSS, str(exc)
    if isinstance(exc, FrameError):  # damaged -> DATA_LOSS, not ours / wrong layout -> INVALID_ARGUMENT
        return getattr(grpc.StatusCode, exc.status), f"KV block refused: {exc}"
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    if isinstance(exc, ConnectionError):  # a peer went away mid-transfer (the TCP data plane)
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):  # the data plane's peer is not who it should be
        return grpc.StatusCode.UNAUTHENTICATED, f"the peer's certificate did not verify: {exc}"
    if isinstance(exc, ssl.SSLError):  # the data plane's TLS connection broke (a cut link, a dead peer)
        return grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}"
    # anything else is a bug: INTERNAL, with its traceback logged (no blanket ValueError/KeyError
    # mapping that would hide one)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


# A downstream (service-to-service) status as the router answers its public callers: the code
# the router owns for it and a generic message (the downstream text stays in the router's log:
# it names internal addresses, workers and, for an authorization failure, the service identity).
# A worker that is gone (UNAVAILABLE, CANCELLED, UNKNOWN: the router retries those first) is
# UNAVAILABLE; an internal UNAUTHENTICATED / PERMISSION_DENIED is the cluster's misconfiguration,
# never the caller's credentials: INTERNAL (HTTP 500), as vLLM's and Dynamo's frontends answer an
# engine failure that is not the client's (503 would call a lasting fault a passing overload; and
# a 401 would tell the client its key is wrong). A worker's INVALID_ARGUMENT / OUT_OF_RANGE is
# about the request the router relayed: still the client's 400, with a generic message.
_WORKER_GONE = "a worker serving this request failed; retry"
DOWNSTREAM = {
    grpc.StatusCode.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, _WORKER_GONE),
    grpc.StatusCode.CANCELLED: (grpc.StatusCode.UNAVAILABLE, _WORKER_GONE),
    grpc.StatusCode.UNKNOWN: (grpc.StatusCode.UNAVAILABLE, _WORKER_GONE),
    grpc.StatusCode.DEADLINE_EXCEEDED: (grpc.StatusCode.DEADLINE_EXCEEDED,
                                        "the request's deadline passed before it finished"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         "the workers have no room for this request now; retry later"),
    grpc.StatusCode.INVALID_ARGUMENT: (grpc.StatusCode.INVALID_ARGUMENT, "a worker refused this request as invalid"),
    grpc.StatusCode.OUT_OF_RANGE: (grpc.StatusCode.INVALID_ARGUMENT, "a worker refused this request as invalid"),
}
INTERNAL_MESSAGE = "internal error: the server failed to answer this request"
# What the router's own exceptions (not RpcError) may tell a public caller in their own words:
# the request's fault (its validation, a model it does not serve) or its capacity.
_OWN_WORDS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


def public_error(exc: BaseException, retry_after_s: float | None = None, request_id: str = "") -> RpcError:
    """`exc`, raised while a public edge (the router's Generate, its HTTP API) served a request, as
    the error its caller gets. An RpcError is the router's own answer (its API-key check, quotas,
    validation): unchanged. A downstream call's status maps by DOWNSTREAM (else INTERNAL), with a
    generic message; any other exception keeps status_for's code, and its message only when that is
    the request's fault (_OWN_WORDS): anything else is a bug, INTERNAL with a generic message (the
    caller logs `exc`, traceback and all: the result is raised `from exc`). `retry_after_s` goes
    with a RESOURCE_EXHAUSTED; `request_id`, when known, is named so a caller can quote it."""
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        code, message = DOWNSTREAM.get(exc.code(), (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE))
    else:
        code, message = status_for(exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            message = DOWNSTREAM[code][1]
        elif code == grpc.StatusCode.UNAVAILABLE:
            message = _WORKER_GONE
        elif code not in _OWN_WORDS:
            code, message = grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE
    if code == grpc.StatusCode.INTERNAL and request_id:
        message += f" (request id {request_id}; the router logged the cause)"
    return RpcError(code, message, retry_after_s if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None)


class _Undecodable:
    """What a request that is not a valid message of its type deserializes to: the handler then
    answers INVALID_ARGUMENT (gRPC itself would answer UNKNOWN)."""

    def __init__(self, error: Exception):
        self.error = error


def _safe(deserializer):
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(e)
    return deserialize


def _decoded(request):
    if isinstance(request, _Undecodable):
        raise InvalidRequestError(f"the request is not a valid message of its type: {request.error}")
    return request


async def _decoded_stream(requests):
    async for request in requests:
        yield _decoded(request)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a handler into the right status and a log line.

    It runs inside the instrumentation's SERVER span (`tracing.server_interceptor` comes first
    on the server), so the status it records lands on that span. A request that does not parse
    as its message type is INVALID_ARGUMENT, not gRPC's UNKNOWN: the handler's deserializer
    is wrapped."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        async def abort(context, exc):
            code, message = status_for(exc)
            metrics.RPC_ERRORS.labels(method, code.name).inc()
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method)
            else:
                log.info("%s -> %s: %s", method, code.name, message)
            tracing.annotate(status_code=code.name)
            trace.get_current_span().set_status(trace.Status(trace.StatusCode.ERROR, message))
            trailing = exc.trailing_metadata() if isinstance(exc, RpcError) else ()
            await context.abort(code, message, trailing_metadata=trailing)

        def wrap_unary(fn, streaming_request: bool = False):
            async def wrapped(request, context):
                logs.request_id.set(getattr(request, "request_id", ""))
                try:
                    request = _decoded_stream(request) if streaming_request else _decoded(request)
                    return await fn(request, context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:  # noqa: BLE001
                    await abort(context, exc)
            return wrapped

        def wrap_stream(fn, streaming_request: bool = False):
            async def wrapped(request, context):
                logs.request_id.set(getattr(request, "request_id", ""))
                # aclosing: a stream closed early closes the handler now (its finally cancels
                # downstream calls, frees the sequence), not whenever it is collected
                if isinstance(request, _Undecodable):
                    await abort(context, InvalidRequestError(
                        f"the request is not a valid message of its type: {request.error}"))
                if streaming_request:
                    request = _decoded_stream(request)
                async with contextlib.aclosing(fn(request, context)) as steps:
                    try:
                        async for item in steps:
                            yield item
                    except (asyncio.CancelledError, grpc.aio.AbortError):
                        raise
                    except Exception as exc:  # noqa: BLE001
                        await abort(context, exc)
            return wrapped

        deserializer = _safe(handler.request_deserializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary, streaming_request=True), deserializer, handler.response_serializer)
        if handler.stream_stream:  # (reflection: an authorization refusal there is its status, not UNKNOWN)
            return grpc.stream_stream_rpc_method_handler(
                wrap_stream(handler.stream_stream, streaming_request=True), deserializer, handler.response_serializer)
        return handler
