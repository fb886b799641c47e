"""Gemini gRPC surface: ``google.ai.generativelanguage.v1beta.GenerativeService``.

A ``grpc.aio`` server on the same event loop as the REST app, started by ``gemel serve``
(``grpc`` section of the config; ``--grpc-port``, ``--no-grpc``). It serves GenerateContent,
StreamGenerateContent, CountTokens, EmbedContent and BatchEmbedContents through a
``grpc.method_handlers_generic_handler``: requests arrive as bytes and are parsed with the
official ``google-ai-generativelanguage`` proto-plus types' ``deserialize``; responses are
the same types' ``serialize``. No servicer classes are generated and no ``.proto`` is copied.

Everything behind the wire format is shared with the REST surface: the engines and the
request path of ``gemel.api.pipeline`` and the request and response code of ``gemel.api.gemini``
(``generation_request``, ``ResponseBuilder``, countTokens and embeddings), the gateway (API key in ``x-goog-api-key`` metadata or a signature in
``x-llm-signature`` over the serialized request; tenants' limits, admission), deadlines,
metrics and traces.

* Deadlines: the call's gRPC deadline (``context.time_remaining()``, capped by
  ``server.max_request_timeout_s``; ``server.request_timeout_s`` without one) is the engine
  request's deadline. When it passes the engine aborts the request (its KV blocks are freed)
  and the call ends DEADLINE_EXCEEDED. A client that cancels also aborts the request.
* Errors: the REST surface's ``APIError`` statuses become gRPC codes by Google's mapping
  (400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 NOT_FOUND, 429
  RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED, ...), with a ``google.rpc.Status``
  in ``grpc-status-details-bin`` carrying the same details as the REST body (BadRequest
  field violations, RetryInfo, ErrorInfo), which ``google-api-core`` decodes.
* Metadata: initial metadata carries ``x-request-id``, ``x-model-id``, ``x-model-version``
  and ``traceparent`` (and ``x-gemel-fallback`` when a route's fallback model answers; a
  route's sticky user comes in ``x-gemel-user``; ``x-gemel-cache`` while the response cache is
  on, and ``cache-control: no-cache`` in the call's metadata skips its read; ``x-gemel-replica``
  when engine replicas serve the model, as the REST headers); trailing metadata
  ``x-inference-latency-ms`` (and ``retry-after`` on RESOURCE_EXHAUSTED / UNAVAILABLE, and
  ``x-gemel-replica`` again when another replica took the request over after the initial
  metadata went out). A generation's initial metadata goes out with its first message (unary:
  the answer), when the replica is known, as the REST headers go out with the first token.
* Reflection: served from gemel's own descriptor pool (``gemel.api.grpc_service``).
* Shutdown: while ``gemel serve`` drains (``gemel.api.drain``), new calls end UNAVAILABLE
  with ``retry-after`` and running ones count towards the drain.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import any_pb2, json_format
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from gemel.api.errors import GOOGLE_STATUS, APIError, as_api_error, gemini_error, invalid
from gemel.api.gemini import (
    batch_embed_result,
    count_tokens_result,
    embed_content_result,
    generation_request,
    response_builder,
)
from gemel.api.grpc_service import SERVICE_NAME, Method, methods, service_pool
from gemel.api.lifecycle import Deadline
from gemel.api.middleware import child_traceparent
from gemel.api.pipeline import Generation, Guard, ModelKind, deadline_guard, finish, route_or_resolve, start_generation
from gemel.api.routes import FALLBACK_HEADER, USER_HEADER, RouteDecision
from gemel.api.state import ServedModel, ServerState
from gemel.cache.keys import cache_directives
from gemel.config import GrpcConfig
from gemel.gateway.principal import Principal
from gemel.scale.context import REQUEST_STATE

log = logging.getLogger("gemel.grpc")

API_VERSION = "v1beta"
SHUTDOWN_GRACE_S = 5.0
DEADLINE_MARGIN_S = 0.05


# The detail types the REST error bodies use; importing them registers them for Any packing.
DETAIL_TYPES = (error_details_pb2.BadRequest, error_details_pb2.RetryInfo, error_details_pb2.ErrorInfo)


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    pass


def grpc_code(http_status: int) -> grpc.StatusCode:
    return grpc.StatusCode[GOOGLE_STATUS.get(http_status, "UNKNOWN")]


def rpc_status(err: APIError) -> status_pb2.Status:
    """The google.rpc.Status of an error: code, message and the REST body's details."""
    code = grpc_code(err.status)
    status = status_pb2.Status(code=code.value[0], message=err.message)
    for detail in gemini_error(err)["error"].get("details", []):
        packed = any_pb2.Any()
        try:
            json_format.ParseDict(detail, packed)
        except (json_format.ParseError, TypeError, KeyError):
            log.debug("error detail not packable: %r", detail)
            continue
        status.details.append(packed)
    return status


def peer_host(peer: str | None) -> str | None:
    """The address of ``context.peer()`` ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"); None
    for unix sockets and anything else, which the gateway counts as local."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]").replace("%25", "%")
    return None


def call_deadline(context: grpc.aio.ServicerContext, server_cfg) -> Deadline:
    """The engine deadline of a call: the client's gRPC deadline, capped by the config, a
    little early so the server ends the call (and says why) before the client gives up."""
    remaining = context.time_remaining()
    if remaining is None or not math.isfinite(remaining):
        timeout = server_cfg.request_timeout_s
    else:
        timeout = max(0.0, min(remaining - DEADLINE_MARGIN_S, server_cfg.max_request_timeout_s))
    return Deadline(timeout, time.monotonic() + timeout)


class Call:
    """One RPC: metadata in and out, deadline, principal, span, and how it fails."""

    def __init__(self, surface: GrpcSurface, context: grpc.aio.ServicerContext, method: str):
        self.surface = surface
        self.context = context
        self.method = method
        self.started = time.perf_counter()
        self.metadata = tuple(context.invocation_metadata() or ())
        self.headers: dict[str, str] = {}
        for k, v in self.metadata:
            if isinstance(v, str):
                self.headers.setdefault(k.lower(), v)
        self.request_id = self.headers.get("x-request-id") or uuid.uuid4().hex
        self.deadline = call_deadline(context, surface.state.config.server)
        self.model: ServedModel | None = None
        self.route: RouteDecision | None = None  # set when the call named a route
        self.cache: str | None = None  # x-gemel-cache of a generation (initial metadata)
        self.replica: str | None = None  # x-gemel-replica: noted by a replica pool (gemel.scale.context)
        self._replica_sent: str | None = None
        self.admission = None
        self.initial_sent = False
        self._span = None
        self._token = None
        self.traceparent = self._begin_span()

    # -- tracing ----------------------------------------------------------------------------
    def _begin_span(self) -> str:
        tracing = self.surface.tracing
        if tracing is None:
            return child_traceparent(self.headers.get("traceparent"))
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        from gemel.observability.tracing import traceparent_of

        carrier = {k: v for k in ("traceparent", "tracestate") if (v := self.headers.get(k))}
        parent = tracing.propagator.extract(carrier)
        self._span = tracing.tracer.start_span(
            f"{SERVICE_NAME}/{self.method}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": self.method},
        )
        self._token = otel_context.attach(trace.set_span_in_context(self._span, parent))
        return traceparent_of(self._span)

    def end_span(self, code: grpc.StatusCode, error: BaseException | None = None) -> None:
        if self._span is None:
            return
        from opentelemetry import context as otel_context
        from opentelemetry.trace import Status, StatusCode

        span, self._span = self._span, None
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if self.model is not None:
            span.set_attribute("gemel.model_id", self.model.id)
        if error is not None and code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        try:
            otel_context.detach(self._token)
        except ValueError:  # detached in another context (a generator closed elsewhere)
            pass

    # -- metadata -----------------------------------------------------------------------------
    def parse(self, method: Method, raw: bytes):
        """The request as the package's protobuf message (the raw pb, as the REST code uses)."""
        try:
            msg = method.request.deserialize(raw)
        except (DecodeError, TypeError, ValueError) as e:
            raise invalid(f"the request is not a valid {method.request.__name__}: {e}") from None
        return type(msg).pb(msg)

    async def serve_model(self, model: ServedModel) -> None:
        """Name the model serving the call; sends the initial metadata (the x-model-id headers)."""
        self.model = model
        await self.send_initial()

    async def send_initial(self) -> None:
        if self.initial_sent:
            return
        self.initial_sent = True
        md = [("x-request-id", self.request_id), ("traceparent", self.traceparent)]
        if self.model is not None:
            md += [("x-model-id", self.model.id), ("x-model-version", self.model.version)]
        if self.route is not None and self.route.fallback is not None:
            md.append((FALLBACK_HEADER, self.route.fallback.id))
        if self.cache:
            md.append(("x-gemel-cache", self.cache))
        if self.replica:
            md.append(("x-gemel-replica", self.replica))
            self._replica_sent = self.replica
        await self.context.send_initial_metadata(md)

    def _trailing(self) -> list[tuple[str, str]]:
        md = [("x-inference-latency-ms", f"{(time.perf_counter() - self.started) * 1000:.1f}")]
        if not self.initial_sent:
            md.append(("x-request-id", self.request_id))
        if self.replica and self.replica != self._replica_sent:  # resumed on another replica after the headers
            md.append(("x-gemel-replica", self.replica))
        return md

    def succeed(self) -> None:
        self.context.set_trailing_metadata(self._trailing())
        self.end_span(grpc.StatusCode.OK)

    async def fail(self, exc: BaseException, progress: str = "") -> None:
        """End the call with the status of ``exc`` (raises grpc's AbortError); the model that
        took the call is named in initial metadata even when it failed before answering."""
        if self.model is not None:
            await self.send_initial()
        err = self.surface.api_error(exc, self.deadline, progress)
        code = grpc_code(err.status)
        status = rpc_status(err)
        md = self._trailing() + [("grpc-status-details-bin", status.SerializeToString())]
        if err.retry_after_s is not None:
            md.append(("retry-after", str(max(1, round(err.retry_after_s)))))
        if err.status >= 500 and code is not grpc.StatusCode.DEADLINE_EXCEEDED:
            log.warning("%s %s: %s %s", self.method, self.request_id, code.name, err.message)
        self.end_span(code, exc)
        await self.context.abort_with_status(_Status(code, err.message, tuple(md)))

    def cancelled(self) -> None:
        self.end_span(grpc.StatusCode.CANCELLED)


class GrpcSurface:
    """The GenerativeService handlers over one app's state."""

    def __init__(self, app: Any):
        self.app = app
        self.state: ServerState = app.state.gemel
        self.gateway = getattr(app.state, "gateway", None)
        obs = getattr(app.state, "observability", None)
        self.tracing = getattr(obs, "tracing", None)
        self.drain = getattr(app.state, "drain", None)  # gemel.api.drain: refuse new calls while shutting down

    # -- plumbing ---------------------------------------------------------------------------
    def generic_handler(self) -> grpc.GenericRpcHandler:
        behaviours: dict[str, Callable] = {
            "GenerateContent": self.generate_content,
            "StreamGenerateContent": self.stream_generate_content,
            "CountTokens": self.count_tokens,
            "EmbedContent": self.embed_content,
            "BatchEmbedContents": self.batch_embed_contents,
        }
        handlers = {}
        for m in methods():
            behaviour = behaviours[m.name]
            factory = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
            # no request_deserializer: the handler gets the bytes (a signature covers them,
            # and a malformed message answers INVALID_ARGUMENT rather than INTERNAL)
            handlers[m.name] = factory(behaviour, response_serializer=m.response.serialize)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    def api_error(self, exc: BaseException, deadline: Deadline, progress: str = "") -> APIError:
        if isinstance(exc, TimeoutError):
            return deadline.exceeded(progress)
        return as_api_error(exc)

    async def authenticate(self, call: Call, raw: bytes) -> Principal:
        """The gateway's verdict on the call's metadata (x-goog-api-key, authorization: Bearer,
        x-llm-signature over the serialized request), then admission (the tenant's
        concurrency cap and requests/min); released by ``release``."""
        if self.gateway is None:
            return Principal()
        from gemel.gateway.gateway import AuthError, credentials_from
        from gemel.gateway.middleware import auth_api_error

        creds = credentials_from(call.headers, body=raw, client_host=peer_host(call.context.peer()))
        try:
            principal = self.gateway.authenticate(creds)
        except AuthError as e:
            raise auth_api_error(e, "gemini", creds) from None
        call.admission = await self.gateway.admit(principal)
        return principal

    async def release(self, call: Call) -> None:
        if call.admission is not None and self.gateway is not None:
            admission, call.admission = call.admission, None
            await self.gateway.release(admission)

    async def _unary(self, method: str, raw: bytes, context: grpc.aio.ServicerContext, body: Callable) -> Any:
        call = Call(self, context, method)
        counted = False
        try:
            if self.drain is not None:
                self.drain.enter()  # UNAVAILABLE while draining
                counted = True
            result = await body(call, raw)
        except asyncio.CancelledError:  # the client cancelled, or its deadline passed
            call.cancelled()
            raise
        except Exception as e:
            await call.fail(e)
        finally:
            if counted:
                self.drain.exit()
            await self.release(call)
        call.succeed()
        return result

    # -- generation -------------------------------------------------------------------------
    async def _served(
        self, call: Call, raw: bytes, method: str, kind: ModelKind, announce: bool = True
    ) -> tuple[Principal, Any, ServedModel]:
        """Authenticate the call, parse its request and resolve its model (named in the
        initial metadata from here on; ``announce=False``: the caller sends it)."""
        principal = await self.authenticate(call, raw)
        req = call.parse(_method(method), raw)
        model, call.route = route_or_resolve(
            self.state, _model_name(req), "gemini", API_VERSION, kind, _lower(method), principal, call.headers.get(USER_HEADER)
        )
        if announce:
            await call.serve_model(model)
        else:
            call.model = model
        return principal, req, model

    async def _start_generation(self, call: Call, raw: bytes, method: str) -> tuple[Generation, Guard]:
        """Start the call's generation. The caller sends the initial metadata with the first
        message, once the response cache (x-gemel-cache) and a replica pool (x-gemel-replica,
        noted on ``call`` through ``REQUEST_STATE``, as for a REST request) have said their part;
        ``Call.fail`` sends it when the call fails first."""
        REQUEST_STATE.set(call)  # this call's task (and the tasks it starts) only
        principal, req, model = await self._served(call, raw, method, "generate", announce=False)
        guard = deadline_guard(call.deadline)
        gen_req = generation_request(model, req, call.deadline)
        gen_req.route = call.route
        gen_req.no_cache, gen_req.no_store = cache_directives(call.headers.get("cache-control"))
        gen = await start_generation(self.state, gen_req, principal, guard)
        call.cache = gen.cache
        return gen, guard

    async def generate_content(self, raw: bytes, context: grpc.aio.ServicerContext):
        async def body(call: Call, raw: bytes):
            gen, guard = await self._start_generation(call, raw, "GenerateContent")
            (out,) = await finish(gen, guard)
            await call.send_initial()
            return _response(response_builder(gen).unary(out))

        return await self._unary("GenerateContent", raw, context, body)

    async def stream_generate_content(self, raw: bytes, context: grpc.aio.ServicerContext):
        call = Call(self, context, "StreamGenerateContent")
        gen: Generation | None = None
        outputs = None
        counted = False
        try:
            if self.drain is not None:
                self.drain.enter()  # UNAVAILABLE while draining
                counted = True
            gen, _ = await self._start_generation(call, raw, "StreamGenerateContent")
            builder = response_builder(gen)
            outputs = gen.outputs()
            sent = 0
            async for _, out in outputs:
                chunk = builder.chunk(out)
                if chunk is None and out.finished and sent == 0:
                    chunk = builder.unary(out)
                if chunk is not None:
                    await call.send_initial()  # the first output named the replica
                    yield _response(chunk)
                    sent += 1
            await call.send_initial()  # a stream without chunks still names its model
        except asyncio.CancelledError:
            call.cancelled()
            raise
        except GeneratorExit:
            call.cancelled()
            raise
        except Exception as e:
            await call.fail(e, gen.progress() if gen is not None and isinstance(e, TimeoutError) else "")
        finally:
            if outputs is not None:
                await outputs.aclose()
            if counted:
                self.drain.exit()
            await self.release(call)
        call.succeed()

    # -- tokens and embeddings ----------------------------------------------------------------
    async def _answer(self, method: str, kind: ModelKind, raw: bytes, context: grpc.aio.ServicerContext, result: Callable):
        """A unary call answered by ``result(state, model, request, deadline, guard)`` (the
        REST surface's JSON, which becomes the method's response message)."""

        async def body(call: Call, raw: bytes):
            _, req, served = await self._served(call, raw, method, kind)
            return _message(method, await result(self.state, served, req, call.deadline, deadline_guard(call.deadline)))

        return await self._unary(method, raw, context, body)

    async def count_tokens(self, raw: bytes, context: grpc.aio.ServicerContext):
        return await self._answer("CountTokens", "any", raw, context, count_tokens_result)

    async def embed_content(self, raw: bytes, context: grpc.aio.ServicerContext):
        return await self._answer("EmbedContent", "embed", raw, context, embed_content_result)

    async def batch_embed_contents(self, raw: bytes, context: grpc.aio.ServicerContext):
        def result(state: ServerState, served: ServedModel, req, deadline: Deadline, guard: Guard):
            outer = f"the request's model ({req.model})"
            return batch_embed_result(state, served, req, deadline, guard, API_VERSION, outer)

        return await self._answer("BatchEmbedContents", "embed", raw, context, result)


# -- helpers ------------------------------------------------------------------------------------
def _method(name: str) -> Method:
    return next(m for m in methods() if m.name == name)


def _lower(method: str) -> str:
    return method[0].lower() + method[1:]


def _model_name(req) -> str:
    if not req.model:
        raise invalid("model is not specified (e.g. models/gemini-2.0-flash)", param="model")
    return req.model


def _message(method: str, body: dict):
    """A response dict (the REST JSON) -> the method's response protobuf."""
    return json_format.ParseDict(body, _method(method).response.pb()(), ignore_unknown_fields=True)


def _response(body: dict):
    return _message("GenerateContent", body)


# -- the server ---------------------------------------------------------------------------------
def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def server_credentials(cfg: GrpcConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files , or None for plaintext."""
    if not cfg.tls_cert_file:
        return None
    cert = Path(cfg.tls_cert_file).read_bytes()
    key = Path(cfg.tls_key_file).read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])


class GrpcServer:
    """The gRPC listener of one app: ``bind`` (fails fast on a bad port or TLS file), then
    ``start`` once the state has started, ``stop`` before it stops."""

    def __init__(self, server: grpc.aio.Server, host: str, port: int, tls: bool):
        self.server = server
        self.host = host
        self.port = port
        self.tls = tls

    @classmethod
    def bind(cls, app: Any, cfg: GrpcConfig | None = None) -> GrpcServer:
        """Create the server and bind its port (call on the running loop)."""
        state: ServerState = app.state.gemel
        cfg = cfg or state.config.grpc
        host = cfg.host or state.config.server.host
        max_bytes = cfg.max_message_mb << 20
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", max_bytes),
                ("grpc.max_send_message_length", max_bytes),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a silently shared listener
            ]
        )
        surface = GrpcSurface(app)
        server.add_generic_rpc_handlers((surface.generic_handler(),))
        if cfg.reflection:
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server, pool=service_pool())
        creds = server_credentials(cfg)
        address = _address(host, cfg.port)
        hint = "choose another port with --grpc-port, or --no-grpc"
        try:
            port = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
        except RuntimeError as e:
            raise RuntimeError(f"gRPC: cannot listen on {address} ({e}); {hint}") from None
        if not port:
            raise RuntimeError(f"gRPC: cannot listen on {address}; {hint}")
        return cls(server, host, port, creds is not None)

    async def start(self) -> None:
        await self.server.start()
        log.info(
            "serving gRPC %s on %s (%s)", SERVICE_NAME, _address(self.host, self.port), "TLS" if self.tls else "plaintext"
        )

    async def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Refuse new calls, give running ones ``grace`` seconds, then cancel them (which
        aborts their engine requests)."""
        await self.server.stop(grace)
