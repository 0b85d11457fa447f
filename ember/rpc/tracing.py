"""OpenTelemetry for every service: one request is one trace across router, prefill,
kvstores and decode.

The W3C trace context travels in gRPC metadata (`traceparent`): `TracingClientInterceptor`
injects the current context into every outgoing call of a channel made by
`ember.rpc.server.channel`; the server side (`server_span`, used by the error interceptor)
extracts it and runs the handler in a SERVER span. Handlers add the attributes that tell the
story (placement, tokens computed/cached, KV blocks/bytes/codec, tokens/TPOT).

Exporters: OTLP over gRPC when OTEL_EXPORTER_OTLP_ENDPOINT is set; else JSON lines in
$EMBER_TRACE_DIR/<service>-<pid>.jsonl when that is set (`ember up` sets it to the run dir);
else spans are not exported.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult

tracer = trace.get_tracer("ember")


class JsonLinesExporter(SpanExporter):
    """One compact JSON object per span, appended with a single write."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            ctx, parent = span.get_span_context(), span.parent
            record = {"name": span.name, "service": span.resource.attributes.get("service.name"),
                      "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                      "parent_id": f"{parent.span_id:016x}" if parent else None, "kind": span.kind.name,
                      "start_ns": span.start_time, "end_ns": span.end_time, "status": span.status.status_code.name,
                      "attributes": dict(span.attributes or {})}
            os.write(self.fd, (json.dumps(record, default=str) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        os.close(self.fd)


def setup(service_name: str) -> None:
    """Install the tracer provider for this process (call once, at start-up)."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif os.environ.get("EMBER_TRACE_DIR"):
        path = os.path.join(os.environ["EMBER_TRACE_DIR"], f"{service_name}-{os.getpid()}.jsonl")
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    trace.set_tracer_provider(provider)


def _parent(metadata):
    return propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})


def server_span(method: str, metadata):
    """A context manager: the SERVER span of one incoming call, child of the caller's span."""
    return tracer.start_as_current_span(method.rsplit("/", 1)[-1], context=_parent(metadata),
                                        kind=trace.SpanKind.SERVER, attributes={"rpc.method": method})


def start_server_span(method: str, metadata) -> trace.Span:
    """The same span, not made current (streaming handlers make it current step by step)."""
    return tracer.start_span(method.rsplit("/", 1)[-1], context=_parent(metadata), kind=trace.SpanKind.SERVER,
                             attributes={"rpc.method": method})


def annotate(**attributes) -> None:
    """Attributes on the current span (None values skipped)."""
    span = trace.get_current_span()
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(f"ember.{key}", value)


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


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=otel_context.get_current())
    if not carrier:
        return details
    metadata = list(details.metadata or ()) + list(carrier.items())
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_context(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_context(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_context(details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_context(details), request_iterator)


def client_interceptors() -> list:
    """One per call shape: grpc.aio files each interceptor under a single shape only."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]
