"""Map exceptions to gRPC status codes in one interceptor, so servicers stay thin."""
from __future__ import annotations

import asyncio
import logging
from contextlib import nullcontext

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace

from ember.engine.errors import CapacityError, IntegrityError, InvalidRequestError
from ember.kv import wire
from ember.rpc import logs, metrics, tracing

log = logging.getLogger("ember.rpc")


class RpcError(Exception):
    """Raise from a servicer to answer with a specific status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


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
    if isinstance(exc, wire.FrameError):  # damaged -> DATA_LOSS, not ours / wrong layout -> INVALID_ARGUMENT
        return getattr(grpc.StatusCode, exc.status), f"KV block refused: {exc}"
    if isinstance(exc, (InvalidRequestError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
    if isinstance(exc, (ConnectionError, OSError)):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions escaping a handler into the right status and a log line."""

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
            await context.abort(code, message)

        traced = not method.startswith("/grpc.")  # health checks and reflection stay out of traces

        def span(context):
            return tracing.server_span(method, context.invocation_metadata()) if traced else nullcontext()

        def failed(exc) -> None:
            code, message = status_for(exc)
            tracing.annotate(status_code=code.name)
            trace.get_current_span().set_status(trace.Status(trace.StatusCode.ERROR, message))

        def wrap_unary(fn):
            async def wrapped(request, context):
                logs.request_id.set(getattr(request, "request_id", ""))
                with span(context):
                    try:
                        return await fn(request, context)
                    except asyncio.CancelledError:
                        raise
                    except grpc.aio.AbortError:
                        raise
                    except Exception as exc:  # noqa: BLE001
                        failed(exc)
                        await abort(context, exc)
            return wrapped

        def wrap_stream(fn):
            async def wrapped(request, context):
                # gRPC may drive each step of a streaming handler from a fresh context copy,
                # so the span is made current again around every step, not once
                span = tracing.start_server_span(method, context.invocation_metadata()) if traced else None
                current = trace.set_span_in_context(span) if span is not None else otel_context.get_current()
                logs.request_id.set(getattr(request, "request_id", ""))
                steps = fn(request, context)
                try:
                    while True:
                        token = otel_context.attach(current)
                        try:
                            item = await steps.__anext__()
                        except StopAsyncIteration:
                            return
                        except (asyncio.CancelledError, grpc.aio.AbortError):
                            raise
                        except Exception as exc:  # noqa: BLE001
                            failed(exc)
                            await abort(context, exc)
                        finally:
                            otel_context.detach(token)
                        yield item
                finally:
                    await steps.aclose()
                    if span is not None:
                        span.end()
            return wrapped

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                wrap_unary(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        return handler
