"""Limits on what one request may ask of the server, checked before any expensive work.

A request body is refused while it arrives (``RequestLimitsMiddleware``): more than
``server.max_body_mb`` is a 413 (from Content-Length before reading, or as a chunked body
passes the limit); JSON nested deeper than ``server.max_json_depth`` or holding more than
``server.max_json_values`` values is a 400. The JSON checks scan the raw bytes as they come
(brackets and commas outside strings), so ``json.loads`` never recurses too deep and its
cost has a bound. Lists a client controls (stop sequences, contents, parts, messages, schema
sizes) are checked by each surface on the decoded JSON, before protobuf parsing, templates
or tokenisation; the limits are here so one table documents them (docs/api.md).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sized
from itertools import accumulate
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gemel.api.errors import APIError, error_body, invalid, surface_of

# Per-field limits: Google's and OpenAI's documented ones where they exist, else generous
# bounds that no real conversation reaches but that keep one request's work in check.
GEMINI_MAX_STOP_SEQUENCES = 5  # generationConfig.stopSequences (Gemini API reference)
OPENAI_MAX_STOP = 4  # stop (OpenAI API reference)
MAX_CONTENTS = 10_000  # Gemini contents / OpenAI messages of one request
MAX_PARTS = 10_000  # parts of all contents (or content parts of all messages) of one request
MAX_SCHEMA_VALUES = 10_000  # JSON values in one response schema (each costs grammar and metaschema work)
MAX_TOOLS = 128  # OpenAI's documented limit of tools per request

_OFF_LOOP_SLICE = 1 << 20  # a body piece larger than this is scanned in slices, yielding to the loop between
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


def check_count(items: Any, limit: int, field: str, what: str = "entries") -> None:
    """400 naming ``field`` when the list ``items`` holds more than ``limit`` entries."""
    if isinstance(items, Sized) and not isinstance(items, (str, bytes, dict)) and len(items) > limit:
        raise invalid(f"{field} may hold at most {limit} {what} (got {len(items)})", param=field)


def count_values(value: Any, limit: int) -> int:
    """JSON values in ``value`` (containers and scalars), counting stops past ``limit``."""
    n, stack = 0, [value]
    while stack and n <= limit:
        v = stack.pop()
        n += 1
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return n


def check_schema_size(schema: Any, field: str) -> None:
    n = count_values(schema, MAX_SCHEMA_VALUES)
    if n > MAX_SCHEMA_VALUES:
        raise invalid(f"{field} is too large: a schema may hold at most {MAX_SCHEMA_VALUES} values", param=field)


# -- JSON shape from the raw bytes ------------------------------------------------------------
class JsonShape:
    """Nesting depth and value count of a JSON text read in pieces, without parsing it.

    Strings are cut out first (escaped backslashes and quotes removed, which is exact for valid
    JSON: escapes pair left to right), then brackets and commas outside strings are counted. A
    text that is not valid JSON may be misjudged, but only after the point where ``json.loads``
    stops reading it, so the depth its parser reaches is still bounded.
    """

    def __init__(self, max_depth: int, max_values: int):
        self.max_depth = max_depth
        self.max_values = max_values
        self.in_string = False
        self.escaped = False  # the last piece ended on an unpaired backslash: the next byte is escaped
        self.depth = 0
        self.values = 0
        self.head = b""  # the first bytes, to tell the encoding as json.loads does
        self.problem: str | None = None

    def feed(self, data: bytes) -> str | None:
        """Read the next piece; returns the problem once a limit is passed (and keeps it)."""
        if self.problem or not data:
            return self.problem
        if len(self.head) < 4:
            self.head += data[: 4 - len(self.head)]
            if len(self.head) == 4 and self._check_encoding():
                return self.problem
        if self.escaped:
            data, self.escaped = data[1:], False
        s = data.replace(b"\\\\", b"")
        if s.endswith(b"\\"):
            s, self.escaped = s[:-1], True
        pieces = s.replace(b'\\"', b"").split(b'"')
        outside = b"".join(pieces[1::2] if self.in_string else pieces[0::2])
        if len(pieces) % 2 == 0:
            self.in_string = not self.in_string
        opens = outside.count(b"[") + outside.count(b"{")
        self.values += opens + outside.count(b",")
        if self.values > self.max_values:
            self.problem = f"Invalid JSON payload received. The body holds more than {self.max_values} values."
            return self.problem
        if self.depth + opens > self.max_depth:  # only then can this piece go too deep
            deepest = max(accumulate(map(_STEP.__getitem__, outside.translate(None, _NOT_BRACKETS)), initial=self.depth))
            if deepest > self.max_depth:
                self.problem = (
                    f"Invalid JSON payload received. Nesting too deep: arrays and objects may nest at most "
                    f"{self.max_depth} levels."
                )
                return self.problem
        self.depth += opens - outside.count(b"]") - outside.count(b"}")
        return None

    async def feed_yielding(self, data: bytes) -> str | None:
        """``feed`` in slices, letting other requests run between them (one large piece)."""
        if len(data) <= _OFF_LOOP_SLICE:
            return self.feed(data)
        view = memoryview(data)
        for start in range(0, len(data), _OFF_LOOP_SLICE):
            if self.feed(bytes(view[start : start + _OFF_LOOP_SLICE])):
                break
            await asyncio.sleep(0)
        return self.problem

    def finish(self) -> str | None:
        if not self.problem and 0 < len(self.head) < 4:
            self._check_encoding()
        return self.problem

    def _check_encoding(self) -> str | None:
        if json.detect_encoding(self.head) not in ("utf-8", "utf-8-sig"):
            self.problem = "Invalid JSON payload received. The body must be JSON encoded as UTF-8."
        return self.problem


def json_problem(raw: bytes, max_depth: int, max_values: int) -> str | None:
    """What is wrong with the shape of the JSON body ``raw``, or None."""
    shape = JsonShape(max_depth, max_values)
    shape.feed(raw)
    return shape.finish()


def too_large(limit_bytes: int, size: int | None = None) -> APIError:
    got = f" (got {size} bytes)" if size is not None else ""
    return APIError(413, f"the request body is larger than the limit of {limit_bytes} bytes{got}")


# -- the middleware -----------------------------------------------------------------------------
class RequestLimitsMiddleware:
    """Reads a request body before the app does, refusing it as soon as it breaks a limit.

    A plain ASGI middleware: a refused body never reaches the gateway or a handler, and the
    answer is in the surface's own error format. The rest of a refused body is left to the
    server, which discards it on a kept-alive connection so the client reads the answer.
    """

    def __init__(self, app: ASGIApp, max_body_mb: float = 20.0, max_json_depth: int = 64, max_json_values: int = 1_000_000):
        self.app = app
        self.max_body = int(max_body_mb * 1024 * 1024)
        self.max_depth = max_json_depth
        self.max_values = max_json_values

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if length is None and not chunked:  # no body
            await self.app(scope, receive, send)
            return
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            await self._refuse(scope, send, too_large(self.max_body, int(length)))
            return
        chunks: list[bytes] = []
        size = 0
        shape = JsonShape(self.max_depth, self.max_values)
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await self._refuse(scope, send, too_large(self.max_body))
                return
            chunks.append(chunk)
            if await shape.feed_yielding(chunk):
                break
            if not message.get("more_body", False):
                break
        if shape.finish():
            await self._refuse(scope, send, invalid(shape.problem))
            return
        body = b"".join(chunks)
        scope.setdefault("state", {})["body_checked"] = True  # read_json need not scan it again
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope: Scope, send: Send, err: APIError) -> None:
        response = JSONResponse(error_body(err, surface_of(scope.get("path", ""))), err.status)
        await response(scope, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}
