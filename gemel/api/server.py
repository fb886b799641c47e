"""``gemel serve``: arguments and the uvicorn run (SPEC F70).

``gemel/cli.py`` calls ``add_serve_arguments`` and ``run_serve``; ``python -m
gemel.api.server`` does the same on its own.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gemel.config import GemelConfig, default_model_entry, load_config


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="gemel.yaml (see docs/configuration.md); defaults serve without one")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000; 0 picks a free one)")
    parser.add_argument("--model", help="serve this model (packaged name, GGUF file or HF directory) as the default model")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="engine dtype")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level")
    parser.add_argument("--no-embeddings", action="store_true", help="do not load the embedding model")


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
    if args.model:
        first = data["models"][0]
        if first["id"] == config.engine.model and first["source"] == config.engine.model:
            data["models"][0] = default_model_entry(args.model).model_dump() | {"aliases": first["aliases"]}
        else:
            first["source"] = args.model
        data["engine"]["model"] = args.model
    return GemelConfig.model_validate(data)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gemel.api.app import create_app
    from gemel.loader.sources import ModelNotFound

    try:
        config = apply_overrides(load_config(args.config), args)
    except (OSError, ValueError) as e:
        print(f"gemel serve: bad configuration: {e}", file=sys.stderr)
        return 2
    level = config.server.log_level
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        app = create_app(config)
    except ModelNotFound as e:
        print(f"gemel serve: {e}", file=sys.stderr)
        return 2
    logging.getLogger("gemel").info(
        "serving %s on http://%s:%d", ", ".join(m.id for m in app.state.gemel.models), config.server.host, config.server.port
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level=level, timeout_graceful_shutdown=10)
    )
    server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gemel serve", description="Serve models over the Gemini and OpenAI APIs.")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
