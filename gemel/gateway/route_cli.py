"""``gemel route``: a running server's routes, read and changed through ``/admin/routes``.

    gemel route show     [NAME]                     --url URL [--key KEY] [--json]
    gemel route set      NAME MODEL=WEIGHT [...]    --url URL [--key KEY]
    gemel route promote  NAME [MODEL]               --url URL [--key KEY]
    gemel route rollback NAME [MODEL]               --url URL [--key KEY]

``promote`` and ``rollback`` act on the route's canary unless a target is named. The key
(``--key`` or ``$GEMEL_API_KEY``) must belong to a tenant marked admin (``gemel keys set
--admin yes``); a server without tenants takes any key, or none, from loopback. Changes last
until the server restarts. Exit status: 0 done, 1 the server refused (its message is
printed), 2 the server could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_URL = "http://127.0.0.1:8000"


def _err(msg: str) -> None:
    print(f"gemel route: {msg}", file=sys.stderr)


def _weights(pairs: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pair in pairs:
        model, sep, value = pair.rpartition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not model or weight < 0:
            raise argparse.ArgumentTypeError(f"expected MODEL=WEIGHT with a weight >= 0, got {pair!r}")
        out[model] = weight
    return out


def _call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
    """(exit status, the answer's JSON)."""
    import httpx

    headers = {"x-goog-api-key": args.key} if args.key else {}
    url = args.url.rstrip("/") + path
    try:
        r = httpx.request(method, url, json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as e:
        _err(f"cannot reach {args.url}: {e}")
        return 2, None
    try:
        data = r.json()
    except ValueError:
        data = None
    if r.status_code >= 400:
        message = data.get("error", {}).get("message") if isinstance(data, dict) and isinstance(data.get("error"), dict) else None
        _err(f"{r.status_code}: {message or r.text[:300]}")
        return 1, data
    return 0, data


def _fmt(v, suffix: str = "") -> str:
    return "-" if v is None else f"{v:g}{suffix}"


def render(route: dict) -> str:
    """A route's state as a few lines of text."""
    lines = [
        f"route {route['name']}: sticky {route['sticky']}, fallback {route.get('fallback') or '-'}, "
        f"{route['requests']} requests"
    ]
    slo = route.get("slo")
    if slo:
        lines.append(
            f"  slo: ttft_p99_ms {_fmt(slo.get('ttft_p99_ms'))}, error_rate {_fmt(slo.get('error_rate'))}, window {slo['window']}"
        )
    lines.append(f"  {'target':<28}{'weight':>8}{'share':>8}{'requests':>10}  {'engine':<11}{'status':<13}window")
    for t in route["targets"]:
        name = t["model"] + (" (canary)" if t["canary"] else "")
        w = t.get("slo_window")
        window = (
            f"{w['seen']}/{w['size']}: TTFT p99 {_fmt(w['ttft_p99_ms'], ' ms')}, errors {_fmt(w['error_rate'])}" if w else ""
        )
        lines.append(
            f"  {name:<28}{t['weight']:>8g}{100 * t['share']:>7.1f}%{t['requests']:>10}  {t.get('engine', ''):<11}"
            f"{t['status']:<13}{window}"
        )
        if t.get("reason"):
            lines.append(f"    {t['status']}: {t['reason']}")
        if t.get("rollbacks"):
            lines.append(f"    automatic rollbacks: {t['rollbacks']}")
    if route.get("fallbacks"):
        lines.append("  fallbacks: " + ", ".join(f"{k} {n}" for k, n in sorted(route["fallbacks"].items())))
    return "\n".join(lines)


def _print(args: argparse.Namespace, routes: list[dict], one: bool) -> None:
    if args.json:
        print(json.dumps(routes[0] if one else routes, indent=2))
        return
    print("\n\n".join(render(r) for r in routes) if routes else "no routes")


def cmd_show(args: argparse.Namespace) -> int:
    path = f"/admin/routes/{args.name}" if args.name else "/admin/routes"
    rc, data = _call(args, "GET", path)
    if rc:
        return rc
    _print(args, [data["route"]] if args.name else data["routes"], one=bool(args.name))
    return 0


def _change(args: argparse.Namespace, body: dict) -> int:
    rc, data = _call(args, "POST", f"/admin/routes/{args.name}", body)
    if rc:
        return rc
    _print(args, [data["route"]], one=True)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    try:
        weights = _weights(args.weights)
    except argparse.ArgumentTypeError as e:
        _err(str(e))
        return 2
    return _change(args, {"weights": weights})


def cmd_promote(args: argparse.Namespace) -> int:
    return _change(args, {"promote": args.model or True})


def cmd_rollback(args: argparse.Namespace) -> int:
    return _change(args, {"rollback": args.model or True})


def add_route_arguments(subparsers) -> argparse.ArgumentParser:
    """Add ``route`` (and its subcommands) to the ``gemel`` command's subparsers."""
    route = subparsers.add_parser("route", help="show and change a running server's routes (weights, canary promotion, rollback)")
    sub = route.add_subparsers(dest="route_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", default=os.environ.get("GEMEL_URL", DEFAULT_URL), help=f"the server (default $GEMEL_URL or {DEFAULT_URL})")
        p.add_argument("--key", default=os.environ.get("GEMEL_API_KEY"), help="an admin tenant's API key (default $GEMEL_API_KEY)")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
        p.add_argument("--json", action="store_true", help="print the server's JSON")

    p = sub.add_parser("show", help="every route (or one): weights, requests per target, canary windows, fallbacks")
    p.add_argument("name", nargs="?", help="one route")
    common(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("set", help="set target weights: gemel route set chat smollm2-135m-instruct=80 gemma3-270m=20")
    p.add_argument("name")
    p.add_argument("weights", nargs="+", metavar="MODEL=WEIGHT")
    common(p)
    p.set_defaults(func=cmd_set)

    p = sub.add_parser("promote", help="give the canary (or MODEL) every request")
    p.add_argument("name")
    p.add_argument("model", nargs="?")
    common(p)
    p.set_defaults(func=cmd_promote)

    p = sub.add_parser("rollback", help="take the canary (or MODEL) out of the route now")
    p.add_argument("name")
    p.add_argument("model", nargs="?")
    common(p)
    p.set_defaults(func=cmd_rollback)
    return route


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gemel")
    add_route_arguments(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["route", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
