"""The operators' endpoints: routes' state and their changes at run time.

``GET /admin/routes`` (every route) and ``GET /admin/routes/{name}`` answer each route's
targets (weights, share, requests, engine state, the canary's SLO window, rollbacks) and its
fallbacks. ``POST /admin/routes/{name}`` applies one change, with a JSON body of one of::

    {"weights": {"smollm2-135m-instruct": 80, "gemma3-270m": 20}}
    {"promote": true}          # the canary takes every request (or name a target: {"promote": "gemma3-270m"})
    {"rollback": true}         # the canary's weight drops to 0 (or name a target)

Changes live in the server's memory: a restart serves the routes of gemel.yaml again.
Callers must be admins: with a tenants file, a key (or signature) of a tenant marked
``admin: true`` (``gemel keys set --admin yes``); without one, callers on loopback only
(even with ``--insecure``). ``gemel route`` (``gemel.gateway.route_cli``) is their client.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from gemel.api.errors import APIError, invalid
from gemel.api.routes import Routing, principal_of
from gemel.api.state import state_of
from gemel.gateway.gateway import is_loopback_host
from gemel.gateway.routes import RouteError

router = APIRouter(prefix="/admin", tags=["admin"])


class RouteChange(BaseModel):
    """One change to a route: new weights, a promotion or a rollback."""

    model_config = ConfigDict(extra="forbid")

    weights: dict[str, float] | None = Field(None, description="new weights of the targets named (others keep theirs)")
    promote: bool | str | None = Field(None, description="true: the canary; or a target's model id")
    rollback: bool | str | None = Field(None, description="true: the canary; or a target's model id")


def require_admin(request: Request) -> None:
    """403 unless the caller may change routes."""
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is not None and gateway.auth_enabled:
        principal = principal_of(request.scope.get("state", {}))
        tenant = gateway.tenant_of(principal) if principal is not None else None
        if tenant is None or not tenant.admin:
            raise APIError(
                403, "the admin endpoints need a key of an admin tenant (gemel keys set --admin yes)", code="permission_denied"
            )
        return
    client = request.client
    if not is_loopback_host(client.host if client else None):
        raise APIError(403, "without a tenants file the admin endpoints answer loopback callers only", code="permission_denied")


def _routing(request: Request) -> Routing:
    return state_of(request).routes


def _one(routing: Routing, name: str) -> dict:
    for route in routing.snapshot():
        if route["name"] == name:
            return route
    raise APIError(404, f"no route {name!r} (routes: {', '.join(routing.table.routes) or 'none'})")


@router.get("/routes", summary="every route: weights, requests per target, canary windows, rollbacks, fallbacks")
async def list_routes(request: Request) -> Response:
    require_admin(request)
    return JSONResponse({"routes": _routing(request).snapshot()}, headers={"Cache-Control": "no-store"})


@router.get("/routes/{name}", summary="one route's state")
async def get_route(name: str, request: Request) -> Response:
    require_admin(request)
    return JSONResponse({"route": _one(_routing(request), name)}, headers={"Cache-Control": "no-store"})


@router.post("/routes/{name}", summary="change a route: weights, promote or rollback")
async def change_route(name: str, change: RouteChange, request: Request) -> Response:
    require_admin(request)
    routing = _routing(request)
    route = routing.get(name)
    if route is None:
        _one(routing, name)  # the 404
    given = [k for k in ("weights", "promote", "rollback") if getattr(change, k) not in (None, False)]
    if len(given) != 1:
        raise invalid("give exactly one of weights, promote, rollback")
    try:
        if change.weights is not None:
            route.set_weights(change.weights)
        elif change.promote is not None:
            route.promote(None if change.promote is True else change.promote)
        else:
            route.rollback(None if change.rollback is True else change.rollback)
    except RouteError as e:
        raise invalid(str(e)) from None
    return JSONResponse({"route": _one(routing, name)})
