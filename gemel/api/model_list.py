"""Model listing for both surfaces (SPEC F5, F30, F32).

``GET /v1/models[/id]`` is an OpenAI route and, for google-genai >= 3 (default API version
v1), a Gemini route too: there the body carries both shapes (OpenAI's ``data`` /
``id`` / ``object`` and Gemini's ``models`` / ``name`` / ``nextPageToken``), and each SDK
reads its own keys. ``/v1beta`` answers Gemini's shape only.
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import JSONResponse, Response

from gemel.api.auth import Principal, authenticate
from gemel.api.errors import invalid
from gemel.api.state import ServedModel, mark_model, state_of

router = APIRouter(tags=["models"])

GENERATE_METHODS = ["generateContent", "streamGenerateContent", "countTokens"]
EMBED_METHODS = ["embedContent", "batchEmbedContents", "countTokens"]


def gemini_model(m: ServedModel, name: str) -> dict:
    body = {
        "name": f"models/{name}",
        "baseModelId": m.id,
        "version": m.version,
        "displayName": m.display_name if name == m.id else f"{name} (alias of {m.id})",
        "description": m.description,
        "inputTokenLimit": m.input_token_limit,
        "outputTokenLimit": m.max_output_tokens,
        "supportedGenerationMethods": GENERATE_METHODS if m.kind == "generate" else EMBED_METHODS,
    }
    if m.kind == "generate":
        body |= {"temperature": 1.0, "maxTemperature": 2.0, "topP": 1.0, "topK": 0}
    return body


def openai_model(m: ServedModel, name: str) -> dict:
    return {"id": name, "object": "model", "created": m.created, "owned_by": "gemel", "root": m.id,
            "max_model_len": m.input_token_limit or None}


def _names(request: Request) -> list[tuple[ServedModel, str]]:
    models = state_of(request).models
    return [(m, m.id) for m in models] + [(m, a) for m in models for a in m.aliases]


def _page(names: list, page_size: int | None, page_token: str | None) -> tuple[list, str | None]:
    start = 0
    if page_token:
        try:
            start = int(base64.urlsafe_b64decode(page_token.encode()).decode())
        except ValueError:
            raise invalid("pageToken is not a token this server issued", param="pageToken") from None
    size = 50 if not page_size else min(page_size, 1000)
    if page_size is not None and page_size < 0:
        raise invalid("pageSize must not be negative", param="pageSize")
    end = start + size
    token = base64.urlsafe_b64encode(str(end).encode()).decode() if end < len(names) else None
    return names[start:end], token


def _list(request: Request, page_size: int | None, page_token: str | None, with_openai: bool) -> Response:
    names = _names(request)
    page, token = _page(names, page_size, page_token)
    body: dict = {"models": [gemini_model(m, n) for m, n in page]}
    if token:
        body["nextPageToken"] = token
    if with_openai:
        body = {"object": "list", "data": [openai_model(m, n) for m, n in names]} | body
    return JSONResponse(body)


def _get(request: Request, model: str, with_openai: bool) -> Response:
    surface = "both" if with_openai else "gemini"
    m = state_of(request).resolve(model, surface, "v1" if with_openai else "v1beta")
    mark_model(request, m)
    name = model.removeprefix("models/")
    body = gemini_model(m, name)
    if with_openai:
        body = openai_model(m, name) | body
    return JSONResponse(body)


@router.get("/v1beta/models", summary="Gemini models.list")
async def list_v1beta(request: Request, pageSize: int | None = Query(None), pageToken: str | None = Query(None),
                      principal: Principal = Depends(authenticate)) -> Response:
    return _list(request, pageSize, pageToken, with_openai=False)


@router.get("/v1/models", summary="models.list for both surfaces (OpenAI `data`, Gemini `models`)")
async def list_v1(request: Request, pageSize: int | None = Query(None), pageToken: str | None = Query(None),
                  principal: Principal = Depends(authenticate)) -> Response:
    return _list(request, pageSize, pageToken, with_openai=True)


@router.get("/v1beta/models/{model}", summary="Gemini models.get")
async def get_v1beta(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    return _get(request, model, with_openai=False)


@router.get("/v1/models/{model}", summary="models.get for both surfaces")
async def get_v1(model: str, request: Request, principal: Principal = Depends(authenticate)) -> Response:
    return _get(request, model, with_openai=True)
