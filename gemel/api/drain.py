"""Graceful shutdown: on SIGTERM or SIGINT ``gemel serve`` drains before it stops.

uvicorn on its own closes the listener at once and gives running requests a fixed grace.
A load balancer that has not yet seen the instance leave would then get refused
connections, and long generations would be cut off. Draining instead keeps the port open:

* ``/readyz`` answers 503 at once (``/healthz`` stays 200: the process is alive);
* new API work (REST and gRPC) is refused with 503 / UNAVAILABLE and ``Retry-After``,
  in the calling surface's error format, so clients retry elsewhere;
* running requests, unary and streaming, finish, for up to ``server.drain_timeout_s``;
* then uvicorn's own shutdown runs (listener closed, gRPC stopped, engines stopped) and
  the process exits 0.

A second signal ends the wait at once.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gemel.api.errors import APIError, error_body, error_headers, surface_of

log = logging.getLogger("gemel.api")

RETRY_AFTER_S = 1.0


class Drain:
    """Whether the server is draining, and how much API work is still running.

    Everything runs on the event loop's thread (the signal handler too), so plain
    attributes suffice."""

    def __init__(self, timeout_s: float, retry_after_s: float = RETRY_AFTER_S):
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.draining = False
        self.started_at: float | None = None
        self.in_flight = 0

    def begin(self) -> bool:
        """Start draining; False when it had already begun. Only sets attributes, so a
        signal handler may call it."""
        if self.draining:
            return False
        self.started_at = time.monotonic()
        self.draining = True
        return True

    def expired(self) -> bool:
        return self.started_at is not None and time.monotonic() - self.started_at >= self.timeout_s

    def refusal(self) -> APIError:
        message = "the server is shutting down; retry the request (another instance will answer)"
        return APIError(503, message, retry_after_s=self.retry_after_s)

    def enter(self) -> None:
        """Count one request in; raises the refusal while draining."""
        if self.draining:
            raise self.refusal()
        self.in_flight += 1

    def exit(self) -> None:
        self.in_flight -= 1


def is_api_work(scope: Scope) -> bool:
    """Generation, embeddings and token counts: every such endpoint is a POST, and no
    other endpoint is."""
    return scope["type"] == "http" and scope["method"] == "POST"


class DrainMiddleware:
    """Counts running API requests (until their response, streamed or not, has been sent)
    and refuses new ones while draining. A plain ASGI middleware, so streams pass through."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not is_api_work(scope):
            await self.app(scope, receive, send)
            return
        try:
            self.drain.enter()
        except APIError as err:
            response = JSONResponse(error_body(err, surface_of(scope["path"])), err.status, headers=error_headers(err))
            await response(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.exit()


class DrainingServer(uvicorn.Server):
    """uvicorn's server that drains (see the module) before its own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: set flags only; on_tick logs and decides. The signal is not
        # recorded for uvicorn to raise again after its shutdown, so the process exits 0.
        if self.drain.begin():
            return
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # as uvicorn: a third Ctrl+C skips the graceful wait
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        d = self.drain
        if d.draining and not self.should_exit:
            if not self._announced:
                self._announced = True
                log.info("draining: %d requests in flight (waiting up to %gs)", d.in_flight, d.timeout_s)
            if d.in_flight <= 0:
                log.info("drained")
                self.should_exit = True
            elif d.expired():
                log.warning("drain timeout (%gs): stopping with %d requests still running", d.timeout_s, d.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)
