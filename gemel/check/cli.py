"""``gemel check``: its arguments and its run (the modules doing the work load on use)."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = (
    "Audit a gemel deployment: the configuration (--config, default gemel's own defaults), the tenants file, "
    "Kubernetes manifests (--k8s DIR; a ConfigMap's gemel.yaml key serves as the configuration when --config is "
    "absent) and a running server (--url). Each rule passes, fails or is skipped with the reason. Exit status: 0 "
    "nothing above info fails; 1 low or medium rules fail; 2 a high rule fails, or an input cannot be read."
)


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH", help="gemel.yaml to check")
    p.add_argument("--tenants", metavar="PATH", help="tenants file (as gemel serve --tenants)")
    p.add_argument("--k8s", metavar="DIR", help="directory of Kubernetes manifests")
    p.add_argument("--url", metavar="URL", help="a running gemel serve, e.g. http://127.0.0.1:8000")
    p.add_argument("--format", choices=["text", "json", "html", "markdown"], default="text",
                   help="output format (markdown: only with --list-rules)")  # fmt: skip
    p.add_argument("--out", metavar="FILE", help="write the report to FILE instead of standard output")
    p.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    p.add_argument("--memory-mb", type=float, metavar="N",
                   help="memory of the machine the server runs on (default: the pod's memory limit, else this machine's)")  # fmt: skip
    p.add_argument("--max-key-age-days", type=int, default=365, metavar="N", help="age after which keys must be rotated")
    p.add_argument("--ca-cert", metavar="PATH", help="CA bundle that verifies an https --url")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="per-request timeout of the --url probe")


def _emit(text: str, out: str | None) -> None:
    if out:
        with open(out, "w") as f:
            f.write(text)
        print(f"gemel check: wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def run_check(args: argparse.Namespace) -> int:
    from gemel.check import report as rep
    from gemel.check.audit import CheckError, Request, run
    from gemel.check.rules import all_rules

    if args.list_rules:
        rules = all_rules()
        render = {"text": rep.rules_text, "json": rep.rules_json, "markdown": rep.rules_markdown}.get(args.format)
        if render is None:
            print("gemel check: --list-rules takes --format text, json or markdown", file=sys.stderr)
            return 2
        _emit(render(rules), args.out)
        return 0
    if args.format == "markdown":
        print("gemel check: --format markdown lists the rules (with --list-rules); reports are text, json or html",
              file=sys.stderr)  # fmt: skip
        return 2
    req = Request(config=args.config, tenants=args.tenants, k8s=args.k8s, url=args.url, memory_mb=args.memory_mb,
                  max_key_age_days=args.max_key_age_days, ca_cert=args.ca_cert, timeout_s=args.timeout)  # fmt: skip
    try:
        report = run(req)
    except CheckError as e:
        print(f"gemel check: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        text = rep.to_json(report)
    elif args.format == "html":
        from gemel.check.html import render_html

        text = render_html(report)
    else:
        text = rep.to_text(report)
    _emit(text, args.out)
    return report.exit_code
