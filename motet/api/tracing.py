"""OpenTelemetry traces of requests (`--otlp-traces-endpoint URL`, as vLLM's flag): a span per chat,
completions or responses request, exported over OTLP/HTTP by the SDK's batch processor (its own thread).

The request's span (`POST /v1/chat/completions`, kind server) continues the client's W3C `traceparent` when
there is one, and carries the tenant and the model (the base model or an adapter, `gen_ai.request.model`),
the status, and the prompt and completion tokens. When a choice ends, its phases as the engine measured them
(motet/engine/outputs.py RequestTimings) become the span's children: `queue` (arrival to first scheduled),
`prefill` (to the first token) and `decode` (to the last), each placed at its own start and end; before them
the ingress's own phases, `adapter_load` (reading and packing the adapter's files, or finding them cached) and
`grammar_compile` (the request's schema, tool or regex grammar). Nothing is done on the step's path: the
children are made from timings the engine and the ingress record anyway, once the request was admitted or its
choice has ended.
"""

from __future__ import annotations

import contextvars
import time

from motet.api.asgi import StatusRecorder, request_headers

TRACER = "motet"
_span: contextvars.ContextVar = contextvars.ContextVar("motet_span", default=None)


def setup(endpoint: str):
    """A tracer exporting to `endpoint` (OTLP/HTTP, e.g. http://collector:4318/v1/traces)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "motet"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def annotate(**attributes) -> None:
    """Attributes of the current request's span (none: not traced)."""
    current = _span.get()
    if current is not None:
        for key, value in attributes.items():
            if value is not None:
                current[0].set_attribute(key, value)


def _wall_ns(perf_seconds: float) -> int:
    """A perf_counter time as wall-clock nanoseconds (the spans' clock)."""
    return int(perf_seconds * 1e9) + time.time_ns() - time.perf_counter_ns()


def _children(phases) -> None:
    """(name, start, end, attributes) with perf_counter seconds, as children of the request's span."""
    current = _span.get()
    if current is None:
        return
    from opentelemetry import trace

    span, tracer = current
    context = trace.set_span_in_context(span)
    for name, start, end, attributes in phases:
        child = tracer.start_span(name, context=context, start_time=_wall_ns(start), attributes=attributes)
        child.end(end_time=_wall_ns(end))


def admitted(phases) -> None:
    """The ingress's phases of an admitted request (motet/actors/messages.py Admission.phases)."""
    if phases:
        _children(phases)


def choice_ended(arrival: float, timings) -> None:
    """The engine's phases of a finished choice as children of the request's span (`arrival`: perf_counter
    time)."""
    if timings is None:
        return
    phases, at = [], arrival
    for name, seconds in (
        ("queue", timings.queue_s),
        ("prefill", timings.prefill_s),
        ("decode", timings.decode_s),
    ):
        phases.append((name, at, at + seconds, {}))
        at += seconds
    _children(phases)


class Tracing:
    """Pure ASGI middleware: the span of each request to `paths`."""

    def __init__(self, app, provider, paths: frozenset[str]):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app, self.provider, self.paths = app, provider, paths
        self.tracer = trace.get_tracer(TRACER, tracer_provider=provider)
        self.propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = self.propagator.extract(request_headers(scope))
        span = self.tracer.start_span(
            f"{scope['method']} {scope['path']}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "http.route": scope["path"]},
        )
        token = _span.set((span, self.tracer))
        sent = StatusRecorder(send)
        try:
            await self.app(scope, receive, sent)
        finally:
            _span.reset(token)
            span.set_attribute("http.response.status_code", sent.status)
            if sent.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
