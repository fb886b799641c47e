"""OpenTelemetry tracing and the W3C ``traceparent`` header of every response.

``TracingMiddleware`` opens a SERVER span per HTTP request, continuing the caller's trace when
it sent a ``traceparent`` (its trace id is kept; its sampled flag is followed), makes it the
current span for the handler, and answers with the ``traceparent`` of that span. Health,
metrics and dashboard routes get a ``traceparent`` header but record no span, so scrapes
do not flood the trace store.

``TracingObserver`` (one per model's engine) captures that span when a request enters the
engine, and when the request ends sets the request's attributes on it (model id, tenant,
prompt and output tokens, sampling parameters, finish reason) and adds the child spans
``queue``, ``prefill`` and ``decode``, created after the fact with explicit start and end
times from the engine's monotonic stamps.

The tracer provider belongs to the app (not the global one). It exports over OTLP/HTTP only
when ``observability.otlp_endpoint`` is set (the exporter is the optional extra
``gemel[otlp]``), and keeps spans in memory for ``/internal/traces`` only when the test
switch ``observability.trace_memory_exporter`` is on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gemel import __version__
from gemel.api.middleware import child_traceparent
from gemel.observability.stats import EngineObserver, FinishedRequestStats

log = logging.getLogger("gemel.tracing")

# Routes that answer with a traceparent but record no span (probes, scrapes, the dashboard).
UNTRACED_PREFIXES = ("/metrics", "/healthz", "/readyz", "/dashboard", "/internal/")


class OTLPExporterMissing(RuntimeError):
    pass


def otlp_exporter(endpoint: str, headers: dict[str, str] | None = None):
    """The OTLP/HTTP span exporter; a clear error when the optional package is absent."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise OTLPExporterMissing(
            "observability.otlp_endpoint is set but the OTLP exporter is not installed: "
            "pip install 'gemel[otlp]' (opentelemetry-exporter-otlp-proto-http)"
        ) from e
    return OTLPSpanExporter(endpoint=endpoint, headers=dict(headers or {}))


def traceparent_of(span: trace.Span) -> str:
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def _mono_to_epoch_ns(t: float, offset_ns: int) -> int:
    return int(t * 1e9) + offset_ns


class Tracing:
    """The app's tracer provider and its exporters."""

    def __init__(self, cfg: Any, exporter: Any = None):
        """``cfg``: ObservabilityConfig. ``exporter``: an extra span exporter (tests)."""
        self.provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(cfg.trace_sample_ratio)),
            resource=Resource.create({"service.name": cfg.service_name, "service.version": __version__}),
            shutdown_on_exit=False,
        )
        self.memory = None
        if cfg.trace_memory_exporter:
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            self.memory = InMemorySpanExporter()
            self.provider.add_span_processor(SimpleSpanProcessor(self.memory))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.otlp_endpoint = cfg.otlp_endpoint
        if cfg.otlp_endpoint:
            self.provider.add_span_processor(BatchSpanProcessor(otlp_exporter(cfg.otlp_endpoint, cfg.otlp_headers)))
            log.info("exporting traces over OTLP/HTTP to %s", cfg.otlp_endpoint)
        self.tracer = self.provider.get_tracer("gemel", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def observer(self, model_id: str) -> TracingObserver:
        return TracingObserver(self, model_id)

    def shutdown(self) -> None:
        try:
            self.provider.shutdown()
        except Exception:
            log.exception("tracer provider shutdown failed")

    def finished_spans(self) -> list[dict]:
        """The spans kept by the in-memory exporter, as JSON-able dicts (test switch only)."""
        if self.memory is None:
            return []
        out = []
        for s in self.memory.get_finished_spans():
            ctx = s.get_span_context()
            out.append(
                {
                    "name": s.name,
                    "trace_id": f"{ctx.trace_id:032x}",
                    "span_id": f"{ctx.span_id:016x}",
                    "parent_span_id": f"{s.parent.span_id:016x}" if s.parent is not None else None,
                    "kind": s.kind.name,
                    "start_time_ns": s.start_time,
                    "end_time_ns": s.end_time,
                    "status": s.status.status_code.name,
                    "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (s.attributes or {}).items()},
                }
            )
        return out


class TracingMiddleware:
    """A SERVER span per HTTP request (plain ASGI, so streaming passes through untouched)."""

    def __init__(self, app: ASGIApp, tracing: Tracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        state = scope.setdefault("state", {})
        path = scope.get("path", "")
        if path.startswith(UNTRACED_PREFIXES):
            state["traceparent"] = child_traceparent(headers.get("traceparent"))
            await self.app(scope, receive, send)
            return
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := headers.get(k))}
        parent = self.tracing.propagator.extract(carrier)
        method = scope.get("method", "GET")
        span = self.tracing.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme", "http")},
        )
        state["traceparent"] = traceparent_of(span)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        status_code = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status_code
            if message["type"] == "http.response.start":
                status_code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as e:
            span.record_exception(e)
            raise
        finally:
            route = scope.get("route")
            if route is not None and getattr(route, "path", None):
                span.update_name(f"{method} {route.path}")
                span.set_attribute("http.route", route.path)
            span.set_attribute("http.response.status_code", status_code)
            if status_code >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
            otel_context.detach(token)


class TracingObserver(EngineObserver):
    """Request attributes and queue/prefill/decode child spans for one model's engine."""

    def __init__(self, tracing: Tracing, model_id: str):
        self.tracing = tracing
        self.model_id = model_id

    def begin_request(self, request_id: str, tenant: str, params: Any) -> Any:
        span = trace.get_current_span()
        if not span.get_span_context().is_valid:
            return None  # not inside a traced HTTP request (offline use): end_request opens a root span
        return span, otel_context.get_current()

    def end_request(self, handle: Any, fs: FinishedRequestStats) -> None:
        offset_ns = time.time_ns() - time.monotonic_ns()
        tracer = self.tracing.tracer
        own_root = None
        if handle is None:
            own_root = tracer.start_span(
                f"generate {self.model_id}", kind=SpanKind.INTERNAL, start_time=_mono_to_epoch_ns(fs.arrival, offset_ns)
            )
            span, ctx = own_root, trace.set_span_in_context(own_root)
        else:
            span, ctx = handle
        if not span.is_recording():
            return
        self._annotate(span, fs)
        end = fs.end
        phases = [("queue", fs.arrival, fs.scheduled if fs.scheduled is not None else end)]
        if fs.scheduled is not None:
            phases.append(("prefill", fs.scheduled, fs.first_token if fs.first_token is not None else end))
        if fs.first_token is not None:
            phases.append(("decode", fs.first_token, fs.last_token if fs.last_token is not None else end))
        for name, start, stop in phases:
            child = tracer.start_span(
                name,
                context=ctx,
                kind=SpanKind.INTERNAL,
                start_time=_mono_to_epoch_ns(start, offset_ns),
                attributes={"gemel.request_id": fs.request_id},
            )
            if name == "prefill":
                child.set_attribute("gemel.prompt_tokens", fs.num_prompt_tokens)
                child.set_attribute("gemel.cached_tokens", fs.num_cached_tokens)
                if fs.num_tier_tokens:  # where the cached prefix came from
                    child.set_attribute("gemel.kv_tier_tokens", fs.num_tier_tokens)
            elif name == "decode":
                child.set_attribute("gemel.output_tokens", fs.num_generation_tokens)
            child.end(end_time=_mono_to_epoch_ns(max(start, stop), offset_ns))
        if own_root is not None:
            own_root.end(end_time=_mono_to_epoch_ns(end, offset_ns))

    def _annotate(self, span: Any, fs: FinishedRequestStats) -> None:
        """Set the request's attributes; a request of several prompts adds its token counts up."""
        prev = dict(getattr(span, "attributes", None) or {})
        reasons = list(prev.get("gen_ai.response.finish_reasons", ())) + [fs.finish_reason]
        ids = list(prev.get("gemel.request_ids", ())) + [fs.request_id]
        attrs: dict[str, Any] = {
            "gen_ai.system": "gemel",
            "gen_ai.request.model": self.model_id,
            "gemel.model_id": self.model_id,
            "gemel.tenant": fs.tenant,
            "gen_ai.usage.input_tokens": int(prev.get("gen_ai.usage.input_tokens", 0)) + fs.num_prompt_tokens,
            "gen_ai.usage.output_tokens": int(prev.get("gen_ai.usage.output_tokens", 0)) + fs.num_generation_tokens,
            "gemel.cached_tokens": int(prev.get("gemel.cached_tokens", 0)) + fs.num_cached_tokens,
            "gemel.num_preemptions": int(prev.get("gemel.num_preemptions", 0)) + fs.num_preemptions,
            "gen_ai.response.finish_reasons": reasons,
            "gemel.finish_reason": fs.finish_reason,
            "gemel.request_ids": ids,
        }
        p = fs.params
        if p is not None:
            attrs.update(
                {
                    "gen_ai.request.max_tokens": p.max_tokens,
                    "gen_ai.request.temperature": float(p.temperature),
                    "gen_ai.request.top_p": float(p.top_p),
                    "gen_ai.request.top_k": int(p.top_k),
                    "gen_ai.request.presence_penalty": float(p.presence_penalty),
                    "gen_ai.request.frequency_penalty": float(p.frequency_penalty),
                    "gen_ai.request.choice.count": int(p.n),
                    "gemel.sampling.min_p": float(p.min_p),
                    "gemel.sampling.repetition_penalty": float(p.repetition_penalty),
                    "gemel.sampling.priority": int(p.priority),
                    "gemel.sampling.structured_output": p.structured_output is not None,
                }
            )
            if p.seed is not None:
                attrs["gen_ai.request.seed"] = int(p.seed)
            if p.stop:
                attrs["gen_ai.request.stop_sequences"] = list(p.stop)
        span.set_attributes(attrs)
