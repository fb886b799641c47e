"""A request's life around the engine: its deadline and its client's departure.

Unary answers run under ``guarded``: the work is cancelled, and so aborted in the engine,
when the deadline passes or the client disconnects. Streams are cancelled by Starlette
when the client goes and check the deadline themselves.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from gemel.api.errors import APIError, ClientDisconnected
from gemel.config import ServerConfig
from gemel.engine.output_processor import RequestOutput

T = TypeVar("T")

TIMEOUT_MS_HEADER = "x-gemel-timeout-ms"
SERVER_TIMEOUT_HEADER = "x-server-timeout"  # seconds; what google-genai sends for HttpOptions.timeout


@dataclass
class Deadline:
    timeout_s: float
    at: float  # time.monotonic()

    @classmethod
    def from_request(cls, request: Request, server: ServerConfig) -> Deadline:
        """The client's timeout header if any (capped by the config), else the config default."""
        timeout = server.request_timeout_s
        for header, scale in ((TIMEOUT_MS_HEADER, 1e-3), (SERVER_TIMEOUT_HEADER, 1.0)):
            raw = request.headers.get(header)
            if raw is None:
                continue
            try:
                value = float(raw) * scale
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value <= 0:
                raise APIError(400, f"header {header}: expected a positive number, got {raw!r}", param=header)
            timeout = min(value, server.max_request_timeout_s)
            break
        return cls(timeout, time.monotonic() + timeout)

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def exceeded(self, what: str = "") -> APIError:
        suffix = f" ({what})" if what else ""
        return APIError(504, f"the request's deadline of {self.timeout_s:g}s was exceeded{suffix}")


async def wait_disconnect(request: Request) -> None:
    """Return when the client has gone (call only once the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def guarded(request: Request, work: Awaitable[T], deadline: Deadline) -> T:
    """Await ``work``; cancel it on deadline (-> 504) or disconnect (-> ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=deadline.remaining(), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        try:
            return task.result()
        except TimeoutError:
            raise deadline.exceeded() from None
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    if watcher in done:
        raise ClientDisconnected()
    raise deadline.exceeded()


class Collector:
    """Drains a request's stream; keeps the latest output so a deadline can say what was known."""

    def __init__(self) -> None:
        self.last: RequestOutput | None = None

    async def run(self, stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        async for out in stream:
            self.last = out
        if self.last is None:
            raise RuntimeError("the engine stream ended without output")
        return self.last

    def progress(self) -> str:
        if self.last is None:
            return "before the first token"
        n = sum(len(c.token_ids) for c in self.last.outputs)
        return f"after {n} generated token{'s' if n != 1 else ''}"


async def collect(request: Request, stream: AsyncIterator[RequestOutput], deadline: Deadline) -> RequestOutput:
    """The finished output of a unary request, under its deadline and its client's presence."""
    collector = Collector()
    try:
        return await guarded(request, collector.run(stream), deadline)
    except APIError as e:
        if e.status == 504:
            raise deadline.exceeded(collector.progress()) from None
        raise


async def first_output(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await stream.__anext__()
