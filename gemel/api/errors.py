"""One error type for every surface, rendered the way each surface's clients expect.

Gemini clients read ``{"error": {"code", "message", "status"}}`` with the HTTP status equal
to ``code``; OpenAI clients read ``{"error": {"message", "type", "param", "code"}}``. On the
two paths both surfaces share (``GET /v1/models[/id]``) the body carries both key sets.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from gemel.engine.async_llm import EngineDeadError, EngineNotReadyError, RequestRejected

log = logging.getLogger("gemel.api")

Surface = Literal["gemini", "openai", "both"]

GOOGLE_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
OPENAI_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    501: "server_error",
    503: "server_error",
    504: "timeout_error",
}


@dataclass
class APIError(Exception):
    """An error answer: HTTP status, a message that names the problem, the offending field."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None  # OpenAI's machine-readable code (e.g. "model_not_found")
    retry_after_s: float | None = None
    details: list[dict] | None = None  # extra google.rpc details on the Gemini surface (e.g. ErrorInfo)

    def __str__(self) -> str:
        return self.message


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; nothing is sent."""


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def surface_of(path: str) -> Surface:
    """Which clients call this path, to answer errors in their format."""
    p = path.rstrip("/")
    if p == "/v1/models" or (p.startswith("/v1/models/") and ":" not in p):
        return "both"
    if p.startswith(("/v1/chat/", "/v1/completions", "/v1/embeddings")):
        return "openai"
    return "gemini"


def gemini_error(err: APIError) -> dict:
    body: dict = {"code": err.status, "message": err.message, "status": GOOGLE_STATUS.get(err.status, "UNKNOWN")}
    details = list(err.details or [])
    if err.param:
        details.append(
            {
                "@type": "type.googleapis.com/google.rpc.BadRequest",
                "fieldViolations": [{"field": err.param, "description": err.message}],
            }
        )
    if err.retry_after_s is not None:
        details.append({"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": f"{err.retry_after_s:g}s"})
    if details:
        body["details"] = details
    return {"error": body}


def openai_error(err: APIError) -> dict:
    code = err.code
    if code is None and err.status >= 500:
        code = GOOGLE_STATUS.get(err.status, "internal").lower()
    return {
        "error": {
            "message": err.message,
            "type": OPENAI_TYPE.get(err.status, "api_error"),
            "param": err.param,
            "code": code,
        }
    }


def error_body(err: APIError, surface: Surface) -> dict:
    if surface == "gemini":
        return gemini_error(err)
    if surface == "openai":
        return openai_error(err)
    merged = openai_error(err)["error"] | gemini_error(err)["error"]  # Gemini's int code wins
    return {"error": merged}


def error_headers(err: APIError) -> dict[str, str]:
    if err.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, round(err.retry_after_s)))}


def error_response(request: Request, err: APIError) -> Response:
    return JSONResponse(error_body(err, surface_of(request.url.path)), err.status, headers=error_headers(err))


def as_api_error(exc: BaseException) -> APIError:
    """Map engine and library exceptions to answers; anything unknown is a 500."""
    if isinstance(exc, APIError):
        return exc
    if hasattr(exc, "to_api_error"):  # the gateway's refusals (429 / 503 with Retry-After)
        return exc.to_api_error()
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc))
    if isinstance(exc, EngineNotReadyError):
        return APIError(503, str(exc), retry_after_s=5)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), retry_after_s=1)
    if isinstance(exc, TimeoutError):
        return APIError(504, "the request's deadline was exceeded")
    if isinstance(exc, RecursionError):  # only a request's own nesting recurses this deep
        return APIError(400, "Invalid JSON payload received. Nesting too deep.")
    log.exception("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return f"Invalid JSON payload received: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's 422 and HTML-ish defaults with each surface's own error format."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return error_response(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(request, APIError(exc.status_code, message))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        return error_response(request, as_api_error(exc))

    for cls in (EngineDeadError, EngineNotReadyError, RequestRejected):
        app.add_exception_handler(cls, _unexpected)
