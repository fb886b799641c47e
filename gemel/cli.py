"""The ``gemel`` command: ``serve``, ``generate`` and the tools built on them (``info``, ``verify``, ``keys``, ``route``, ``check``, ``bench``)."""

from __future__ import annotations

import argparse
import sys


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="GGUF file, HF directory or packaged model name")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--cpu-isa", default="auto", choices=["auto", "portable", "avx2", "avx512", "amx"],
                   help="instruction-set level of the CPU kernels (default: this CPU's)")


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one completion to the terminal as the engine produces it."""
    from gemel.config import EngineConfig
    from gemel.engine.llm_engine import LLMEngine
    from gemel.sampling_params import SamplingParams

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.seed,
            stop=args.stop or [],
        )
        engine = LLMEngine(
            EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                         cpu_isa=args.cpu_isa)
        )
        request = [{"role": "user", "content": prompt}] if args.chat else prompt
        engine.add_request("cli", request, params)
    except (ValueError, FileNotFoundError) as exc:
        print(f"gemel generate: {exc}", file=sys.stderr)
        return 2
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gemel", description="Self-hosted inference for open LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion for one prompt to the terminal")
    gen.add_argument("prompt", nargs="?", help="prompt text (default: read standard input)")
    _add_engine_arguments(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)

    try:
        from gemel.api.server import add_serve_arguments, run_serve
    except ImportError:  # the server's dependencies are part of the package; this guards partial installs
        add_serve_arguments = run_serve = None
    if add_serve_arguments is not None:
        serve = sub.add_parser("serve", help="serve the Gemini and OpenAI APIs")
        add_serve_arguments(serve)
        serve.set_defaults(func=run_serve)

    from gemel.info import add_info_arguments, run_info

    info = sub.add_parser("info", help="CPU, instruction-set level, threads, kernel plan and kernel cache")
    add_info_arguments(info)
    info.set_defaults(func=run_info)

    from gemel.loader.integrity import add_verify_arguments, run_verify

    verify = sub.add_parser(
        "verify",
        help="check weight files: chunked SHA-256 (64 MiB chunks) against the package RECORD or a manifest",
        description="Check every weight file of each model: SHA-256 of the whole file and of each chunk (64 MiB by "
        "default), against the pip RECORD of a packaged model's distribution or the manifest of a file or directory "
        "(write one with --write-manifest). With no model named, every model of the catalogue (--config) is checked. "
        "Exit status: 0 intact; 1 a file differs or is missing (the byte range of each bad chunk is named where chunk "
        "digests are known); 2 nothing to check against (unknown model, missing path, no manifest).",
    )
    add_verify_arguments(verify)
    verify.set_defaults(func=run_verify)

    from gemel.gateway.cli import add_keys_arguments  # gemel keys create | ed25519 | set | list | revoke

    add_keys_arguments(sub)

    from gemel.gateway.route_cli import add_route_arguments  # gemel route show | set | promote | rollback

    add_route_arguments(sub)

    from gemel.check.cli import DESCRIPTION as CHECK_DESCRIPTION, add_check_arguments, run_check

    check = sub.add_parser("check", help="audit a configuration, tenants, Kubernetes manifests or a running server",
                           description=CHECK_DESCRIPTION)  # fmt: skip
    add_check_arguments(check)
    check.set_defaults(func=run_check)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser(
        "serve", help="load-test any OpenAI-compatible server (vllm bench serve's metrics)"
    )
    from gemel.benchmark.serve import add_bench_serve_arguments, run_bench_serve

    add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(func=run_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
