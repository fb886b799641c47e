"""``gemel serve``: arguments and the uvicorn run.

``gemel/cli.py`` calls ``add_serve_arguments`` and ``run_serve``; ``python -m
gemel.api.server`` does the same on its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from gemel.config import GemelConfig, default_model_entry, load_config

SHUTDOWN_GRACE_S = 5.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="gemel.yaml (see docs/configuration.md); defaults serve without one")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000; 0 picks a free one)")
    parser.add_argument("--model", help="serve this model (packaged name, GGUF file or HF directory) as the default model")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="engine dtype")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level")
    parser.add_argument("--no-embeddings", action="store_true", help="do not load the embedding model")
    parser.add_argument("--grpc-port", type=int, metavar="N", help="Gemini gRPC port (default 50051; 0 picks a free one)")
    parser.add_argument("--no-grpc", action="store_true", help="do not serve the Gemini gRPC API")
    parser.add_argument("--tenants", metavar="PATH", help="tenants file: API keys, signing keys, limits (see `gemel keys`)")
    parser.add_argument(
        "--insecure", action="store_true", help="allow serving without authentication on a non-loopback address"
    )
    parser.add_argument("--ssl-certfile", metavar="PATH", help="PEM certificate chain: serve HTTPS (with --ssl-keyfile)")
    parser.add_argument("--ssl-keyfile", metavar="PATH", help="PEM private key of --ssl-certfile")
    parser.add_argument(
        "--replicas", type=int, metavar="N",
        help="engine replicas per generative model on Ray Serve (default 1: one in-process engine, no Ray); see docs/scaling.md",
    )
    parser.add_argument(
        "--routing", choices=["prefix", "round_robin"], help="how requests pick a replica (default prefix: prefix-cache aware)"
    )
    parser.add_argument(
        "--verify-weights", choices=["off", "fast", "full"],
        help="check weight files before serving: fast (default) hashes on first sight or when a file's size/mtime "
        "changed, full on every start, off never (see gemel verify)",
    )


def apply_overrides(config: GemelConfig, args: argparse.Namespace) -> GemelConfig:
    """Command-line flags win over the file."""
    data = config.model_dump()
    if args.host:
        data["server"]["host"] = args.host
    if args.port is not None:
        data["server"]["port"] = args.port
    if args.log_level:
        data["server"]["log_level"] = args.log_level
    if args.dtype:
        data["engine"]["dtype"] = args.dtype
    if getattr(args, "no_embeddings", False):
        data["embeddings"] = None
    if getattr(args, "grpc_port", None) is not None:
        data["grpc"]["port"] = args.grpc_port
        data["grpc"]["enabled"] = True
    if getattr(args, "no_grpc", False):
        data["grpc"]["enabled"] = False
    if getattr(args, "tenants", None):
        data["gateway"]["tenants_file"] = os.path.abspath(args.tenants)
    if getattr(args, "insecure", False):
        data["gateway"]["insecure"] = True
    for name in ("ssl_certfile", "ssl_keyfile"):
        if getattr(args, name, None):
            data["server"][name] = os.path.abspath(os.path.expanduser(getattr(args, name)))
    if getattr(args, "verify_weights", None):
        data["server"]["verify_weights"] = args.verify_weights
    if getattr(args, "replicas", None) is not None:  # a fixed count wins over the file's autoscaling bounds
        data["scale"].update(replicas=args.replicas, min_replicas=None, max_replicas=None)
    if getattr(args, "routing", None):
        data["scale"]["routing"] = args.routing
    if args.model:
        first = data["models"][0]
        if first["id"] == config.engine.model and first["source"] == config.engine.model:
            data["models"][0] = default_model_entry(args.model).model_dump() | {"aliases": first["aliases"]}
        else:
            first["source"] = args.model
        data["engine"]["model"] = args.model
    return GemelConfig.model_validate(data)


def gateway_problem(config: GemelConfig) -> str | None:
    """Why the gateway settings cannot serve, or None: no auth on a public address."""
    from gemel.gateway.gateway import binds_loopback_only

    gw = config.gateway
    if gw.tenants_file:
        if not os.path.exists(gw.tenants_file):
            return f"tenants file {gw.tenants_file} does not exist (create it with `gemel keys create`)"
        from gemel.gateway.tenants import load_tenants

        try:
            load_tenants(gw.tenants_file)
        except (OSError, ValueError) as e:
            return f"bad tenants file {gw.tenants_file}: {e}"
        return None
    if not gw.insecure and not binds_loopback_only(config.server.host):
        return (
            f"refusing to serve {config.server.host} without authentication: give a tenants file "
            "(--tenants PATH, see `gemel keys create`) or pass --insecure"
        )
    return None


def port_unavailable(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now (e.g. in use), or None. A friendly early
    check; the listener's own bind still decides."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        return str(e)
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listener does
        try:
            s.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None


def resolve_server_paths(config: GemelConfig, config_path: str | None) -> GemelConfig:
    """The REST TLS files of a config file are relative to that file, as the gRPC ones,
    so a config works wherever ``gemel serve`` is started from."""
    if config_path is None:
        return config
    base = os.path.dirname(os.path.abspath(config_path))
    for name in ("ssl_certfile", "ssl_keyfile"):
        value = getattr(config.server, name)
        if value:
            setattr(config.server, name, os.path.join(base, os.path.expanduser(value)))
    return config


def tls_problem(config: GemelConfig) -> str | None:
    """Why the HTTPS settings cannot serve (one file without the other, a file that cannot
    be read or does not hold a matching certificate and key), or None; checked before binding."""
    s = config.server
    if bool(s.ssl_certfile) != bool(s.ssl_keyfile):
        return (
            "server.ssl_certfile and server.ssl_keyfile (--ssl-certfile, --ssl-keyfile) go together: "
            "set both or neither"
        )
    if not s.ssl_certfile:
        return None
    for what, path in (("certificate", s.ssl_certfile), ("key", s.ssl_keyfile)):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            return f"TLS {what} file {path} is missing or unreadable"
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(s.ssl_certfile, s.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        return f"TLS files {s.ssl_certfile} and {s.ssl_keyfile} are unusable: {e}"
    return None


def grpc_problem(config: GemelConfig) -> str | None:
    """Why the gRPC listener cannot serve as configured (its address or TLS files), or None."""
    g = config.grpc
    if not g.enabled:
        return None
    for what, path in (("certificate", g.tls_cert_file), ("key", g.tls_key_file)):
        if path and not os.access(path, os.R_OK):
            return f"grpc: TLS {what} file {path} is missing or unreadable"
    if g.tls_cert_file:
        import grpc

        from gemel.api.grpc_server import server_credentials

        try:
            server_credentials(g)
        except (OSError, ValueError, grpc.RpcError) as e:
            return f"grpc: TLS files unusable: {e}"
    host = g.host or config.server.host
    if g.port:
        busy = port_unavailable(host, g.port)
        if busy:
            return f"gRPC port {host}:{g.port} is unavailable ({busy}); choose another with --grpc-port N, or --no-grpc"
    if g.host and not config.gateway.tenants_file and not config.gateway.insecure:
        from gemel.gateway.gateway import binds_loopback_only

        if not binds_loopback_only(host):
            return (
                f"refusing to serve gRPC on {host} without authentication: give a tenants file "
                "(--tenants PATH) or pass --insecure"
            )
    return None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gemel.api.app import create_app
    from gemel.api.drain import DrainingServer
    from gemel.engine.core_proc import freeze_heap
    from gemel.loader.sources import ModelNotFound
    from gemel.observability.tracing import OTLPExporterMissing

    try:
        config = apply_overrides(resolve_server_paths(load_config(args.config), args.config), args)
    except (OSError, ValueError) as e:
        print(f"gemel serve: bad configuration: {e}", file=sys.stderr)
        return 2
    problem = tls_problem(config) or gateway_problem(config) or grpc_problem(config)
    if problem:
        print(f"gemel serve: {problem}", file=sys.stderr)
        return 2
    level = config.server.log_level
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        app = create_app(config, grpc=True)
    except (ModelNotFound, OTLPExporterMissing) as e:
        print(f"gemel serve: {e}", file=sys.stderr)
        return 2
    s = config.server
    scheme = "https" if s.ssl_certfile else "http"
    host = f"[{s.host}]" if ":" in s.host else s.host
    logging.getLogger("gemel").info(
        "serving %s on %s://%s:%d", ", ".join(m.id for m in app.state.gemel.models), scheme, host, s.port
    )
    uv_config = uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        log_level=level,
        ssl_certfile=s.ssl_certfile,
        ssl_keyfile=s.ssl_keyfile,
        # After the drain (gemel.api.drain) only requests past drain_timeout_s remain; they
        # get this long more, then are cancelled (which aborts them in the engine).
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    freeze_heap()  # the app and everything imported: the collector need not walk them again
    DrainingServer(uv_config, app.state.drain).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gemel serve", description="Serve models over the Gemini and OpenAI APIs.")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
