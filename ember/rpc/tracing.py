"""OpenTelemetry for every service: one request is one trace across router, prefill,
kvstores and decode.

The W3C trace context travels in gRPC metadata (`traceparent`), carried by
opentelemetry-instrumentation-grpc: its aio client interceptors (`client_interceptors`, on
every channel made by `ember.rpc.server.channel`) make a CLIENT span per outgoing call and
inject it; its aio server interceptor (`server_interceptor`, outermost on every
`ember.rpc.server.Server`) extracts it and runs the handler in a SERVER span named after the
full method (`/ember.v1.Prefill/Prefill`). Health checks and reflection (`/grpc.*`) stay out
of traces. Handlers add the attributes that tell the story (placement, tokens computed/cached,
KV blocks/bytes/codec, tokens/TPOT). The router's OpenAI HTTP API is traced by
opentelemetry-instrumentation-aiohttp-server (services/router/openai_http.py).

Exporters: OTLP over gRPC when OTEL_EXPORTER_OTLP_ENDPOINT is set; else JSON lines in
$EMBER_TRACE_DIR/<service>-<pid>.jsonl when that is set (`ember up` sets it to the run dir);
else spans are not exported.

Besides the gRPC spans, the work itself has spans where it happens (docs/ARCHITECTURE.md, "Traces"):
the engine core, a process of its own, sets up its tracer as its service's (`setup(name,
"engine-core")`) and joins each request's trace through the W3C context its AddRequest carries
(ember.serving.core_spans: queue wait, prefill chunks, import, the decode phase), its KV connector's
calls are `kv.load` / `kv.store` / `kv.stream` / `kv.push` spans, and a kvstore's pull from
another site is a `kv.pull` span with the link's sites and addresses.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Sequence

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.instrumentation.grpc._aio_server import (
    OpenTelemetryAioServerInterceptor,
    _OpenTelemetryAioServicerContext,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult

tracer = trace.get_tracer("ember")
exporting = False  # whether this process exports its spans (setup found an exporter to use)


class JsonLinesExporter(SpanExporter):
    """One compact JSON object per span, appended with a single write."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            ctx, parent = span.get_span_context(), span.parent
            resource = span.resource.attributes
            record = {"name": span.name, "service": resource.get("service.name"),
                      "process": resource.get("ember.process"),
                      "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                      "parent_id": f"{parent.span_id:016x}" if parent else None, "kind": span.kind.name,
                      "start_ns": span.start_time, "end_ns": span.end_time, "status": span.status.status_code.name,
                      "attributes": dict(span.attributes or {})}
            os.write(self.fd, (json.dumps(record, default=str) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        os.close(self.fd)


def setup(service_name: str, process: str | None = None) -> None:
    """Install the tracer provider for this process (call once, at start-up). `process`: what part
    of the service this process is ("engine-core"; the resource's `ember.process`)."""
    global exporting
    attributes = {"service.name": service_name} | ({"ember.process": process} if process else {})
    provider = TracerProvider(resource=Resource.create(attributes))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        exporting = True
    elif os.environ.get("EMBER_TRACE_DIR"):
        path = os.path.join(os.environ["EMBER_TRACE_DIR"], f"{service_name}-{os.getpid()}.jsonl")
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
        exporting = True
    trace.set_tracer_provider(provider)


def span_between(name: str, parent: otel_context.Context | None, start_ns: int, end_ns: int, **attributes) -> None:
    """A span already over (its times measured by the caller: time.time_ns()), child of `parent`
    (a context from `context_of`), with `ember.` attributes (None values skipped)."""
    span = tracer.start_span(name, context=parent, start_time=start_ns,
                             attributes={f"ember.{k}": v for k, v in attributes.items() if v is not None})
    span.end(end_time=max(start_ns, end_ns))


@contextlib.contextmanager
def child_span(name: str, **attributes):
    """A span `name` under the current one, made current (`ember.` attributes); nothing (None) when
    no trace is current: work no request caused makes no root span."""
    if not trace.get_current_span().get_span_context().is_valid:
        yield None
        return
    with tracer.start_as_current_span(name) as span:
        annotate(**attributes)
        yield span


def context_of(carrier: dict[str, str] | None) -> otel_context.Context | None:
    """The context a `current_carrier` handed over (None when it carries no trace)."""
    if not carrier:
        return None
    ctx = propagate.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def _traced():
    """Health checks and reflection (`/grpc.health.v1.Health/Check`, ...) stay out of traces."""
    return filters.negate(filters.service_prefix("grpc."))


def client_interceptors() -> list:
    """CLIENT spans for, and trace context in the metadata of, every call of a channel."""
    return [_cancels_its_call(i) for i in aio_client_interceptors(filter_=_traced())]


def _cancels_its_call(interceptor):
    """The instrumentation's interceptor, but a unary-response call whose caller is cancelled is
    cancelled too. Upstream awaits the call's status inside the interceptor (`await call.code()`):
    cancelling the caller cancelled that wait and left the call itself running, unseen by anyone, so
    a client that gave up on a request (the router's Prefill call of a cancelled Generate) kept the
    worker computing it to the end."""
    wrap = interceptor._wrap_unary_response

    async def wrapped(continuation, span):
        started = []

        async def start():
            call = await continuation()
            started.append(call)
            return call
        try:
            return await wrap(start, span)
        except asyncio.CancelledError:
            for call in started:
                call.cancel()
            raise
    interceptor._wrap_unary_response = wrapped
    return interceptor


class _ClosingServerInterceptor(OpenTelemetryAioServerInterceptor):
    """The instrumentation's server interceptor, with a response stream that ends inside its span.

    Upstream wraps a streaming handler in an async generator that neither closes the handler's
    generator nor is closed by gRPC: a call cancelled while gRPC writes (a client that stopped
    reading, or cancelled between tokens) left both to the garbage collector, which closed them
    later in another context, after the span had ended (the handler's last attributes lost, a
    "Failed to detach context" logged). Here the stream is a coroutine that writes each message
    itself (gRPC's reader/writer form) and closes the handler, in the call's own task, before
    the span ends."""

    def _intercept_aio_server_stream(self, behavior, handler_call_details):
        async def stream(request_or_iterator, context):
            with self._set_remote_context(context), \
                    self._start_span(handler_call_details, context, set_status_on_exception=False) as span:
                wrapped = _OpenTelemetryAioServicerContext(context, span)
                async with contextlib.aclosing(behavior(request_or_iterator, wrapped)) as responses:
                    try:
                        async for response in responses:
                            await context.write(response)
                    except Exception as error:
                        if type(error) is not Exception:  # a bare Exception is an abort (upstream's rule)
                            span.record_exception(error)
                        raise
        return stream


def server_interceptor() -> grpc.aio.ServerInterceptor:
    """The SERVER span of each incoming call, child of the caller's span (put it first, so the
    interceptors after it, and the handler, run inside the span)."""
    upstream = aio_server_interceptor(filter_=_traced())  # its tracer (name, version, schema)
    return _ClosingServerInterceptor(upstream._tracer, filter_=upstream._filter)


def annotate(**attributes) -> None:
    """Attributes on the current span (None values skipped)."""
    span = trace.get_current_span()
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(f"ember.{key}", value)


def received(context, request_id: str = "") -> float | None:
    """Note on the SERVER span what a call arrived with: `ember.request_id` and `ember.deadline_s`
    (the caller's time left when the handler started; absent when it set no deadline). The
    seconds left, or None."""
    left = context.time_remaining()
    annotate(request_id=request_id or None, deadline_s=None if left is None else round(left, 3))
    return left


def current_carrier() -> dict[str, str]:
    """The current trace context as W3C headers, to hand to another process."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=otel_context.get_current())
    return carrier


@contextlib.contextmanager
def carried(carrier: dict[str, str] | None):
    """Make a context handed over by `current_carrier` current (outgoing calls join its trace)."""
    if not carrier:
        yield
        return
    token = otel_context.attach(propagate.extract(carrier))
    try:
        yield
    finally:
        otel_context.detach(token)
