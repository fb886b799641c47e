"""Tracing without a model: the server span, traceparent handling, child spans, OTLP export."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gemel.api.middleware import ResponseHeadersMiddleware
from gemel.config import ObservabilityConfig
from gemel.observability.stats import FinishedRequestStats
from gemel.observability.tracing import OTLPExporterMissing, Tracing, TracingMiddleware, otlp_exporter
from gemel.sampling_params import SamplingParams

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def make_app(cfg: ObservabilityConfig | None = None):
    exporter = InMemorySpanExporter()
    tracing = Tracing(cfg or ObservabilityConfig(), exporter=exporter)
    observer = tracing.observer("m")
    app = FastAPI()

    @app.get("/gen")
    async def gen(request: Request):
        handle = observer.begin_request("rid", "acme", None)
        now = time.monotonic()
        fs = FinishedRequestStats(
            "rid", "acme", "stop", arrival=now - 0.3, end=now, num_prompt_tokens=7, num_generation_tokens=4,
            scheduled=now - 0.25, first_token=now - 0.2, last_token=now - 0.01,
            params=SamplingParams(temperature=0.5, top_p=0.9, max_tokens=4, seed=3),
        )  # fmt: skip
        observer.end_request(handle, fs)
        return {"ok": True}

    @app.get("/healthz")
    async def healthz():
        return {"status": "OK"}

    app.add_middleware(ResponseHeadersMiddleware, default_model_id="m", default_model_version="1")
    app.add_middleware(TracingMiddleware, tracing=tracing)
    return app, exporter, tracing


def call(app, path: str, headers: dict | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get(path, headers=headers or {})

    return asyncio.run(go())


def test_span_tree_and_incoming_trace_id_kept():
    app, exporter, _ = make_app()
    resp = call(app, "/gen", {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    tp = resp.headers["traceparent"]
    version, trace_id, span_id, flags = tp.split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01") and span_id != PARENT_ID
    spans = {s.name: s for s in exporter.get_finished_spans()}
    server = spans["GET /gen"]
    assert server.parent.span_id == int(PARENT_ID, 16)
    assert f"{server.context.span_id:016x}" == span_id
    attrs = server.attributes
    assert attrs["gemel.tenant"] == "acme" and attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.usage.input_tokens"] == 7 and attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.request.temperature"] == 0.5 and attrs["gen_ai.request.seed"] == 3
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["stop"]
    for name in ("queue", "prefill", "decode"):
        child = spans[name]
        assert child.parent.span_id == server.context.span_id and child.context.trace_id == server.context.trace_id
    assert spans["queue"].end_time <= spans["prefill"].start_time + 1000
    assert spans["prefill"].end_time <= spans["decode"].start_time + 1000
    assert spans["decode"].end_time - spans["decode"].start_time == pytest.approx(0.19e9, rel=0.01)


def test_new_trace_without_traceparent_and_unsampled_parent():
    app, exporter, _ = make_app()
    resp = call(app, "/gen")
    _, trace_id, _, flags = resp.headers["traceparent"].split("-")
    assert len(trace_id) == 32 and trace_id != "0" * 32 and int(flags, 16) & 1  # sampled (0x02: random id)
    root = next(s for s in exporter.get_finished_spans() if s.name == "GET /gen")
    assert root.parent is None
    exporter.clear()
    resp = call(app, "/gen", {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"})
    assert resp.headers["traceparent"].startswith(f"00-{TRACE_ID}-") and resp.headers["traceparent"].endswith("-00")
    assert exporter.get_finished_spans() == ()  # the caller did not sample it: nothing recorded


def test_untraced_routes_still_answer_a_traceparent():
    app, exporter, _ = make_app()
    resp = call(app, "/healthz", {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert resp.headers["traceparent"].startswith(f"00-{TRACE_ID}-")
    resp = call(app, "/missing")
    assert resp.status_code == 404 and resp.headers["traceparent"].startswith("00-")
    assert [s.name for s in exporter.get_finished_spans()] == ["GET /missing"]


def test_observer_without_http_span_opens_its_own_root():
    exporter = InMemorySpanExporter()
    tracing = Tracing(ObservabilityConfig(), exporter=exporter)
    obs = tracing.observer("m")
    handle = obs.begin_request("r", "anonymous", None)
    assert handle is None
    now = time.monotonic()
    obs.end_request(handle, FinishedRequestStats("r", "anonymous", "abort", now - 0.1, now, 3, 0))
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == ["generate m", "queue"]  # aborted before it was scheduled


class _Collector(http.server.BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        _Collector.received.append((self.path, self.headers.get("content-type"), self.headers.get("x-tenant"), body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_otlp_export_to_a_local_collector():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    server = http.server.HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
        cfg = ObservabilityConfig(otlp_endpoint=endpoint, otlp_headers={"x-tenant": "ops"}, service_name="gemel-test")
        tracing = Tracing(cfg)
        with tracing.tracer.start_as_current_span("hello"):
            pass
        tracing.shutdown()  # flushes the batch processor
        assert _Collector.received, "no OTLP request arrived"
        path, ctype, header, body = _Collector.received[0]
        assert path == "/v1/traces" and ctype == "application/x-protobuf" and header == "ops"
        assert b"hello" in body and b"gemel-test" in body
    finally:
        server.shutdown()


def test_otlp_off_by_default_and_clear_error_when_missing(monkeypatch):
    assert ObservabilityConfig().otlp_endpoint is None
    import builtins

    real_import = builtins.__import__

    def no_otlp(name, *args, **kwargs):
        if name.startswith("opentelemetry.exporter.otlp"):
            raise ImportError("no module")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_otlp)
    with pytest.raises(OTLPExporterMissing, match=r"pip install 'gemel\[otlp\]'"):
        otlp_exporter("http://127.0.0.1:1/v1/traces")
