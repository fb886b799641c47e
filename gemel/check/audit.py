"""Gathering the inputs once and running every rule over them.

The configuration is the one given with ``--config``; without it, the ``gemel.yaml`` key of a
ConfigMap in ``--k8s DIR``; without either (and no ``--url``), gemel's defaults, which is
what a plain ``gemel serve`` runs. ``--tenants`` acts as ``gemel serve --tenants`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime

from gemel.check.report import Report
from gemel.check.rules import Inputs, all_rules


class CheckError(Exception):
    """An input that cannot be read at all (the check then exits 2 without findings)."""


@dataclass
class Request:
    """What to check: the ``gemel check`` arguments, without argparse."""

    config: str | None = None
    tenants: str | None = None
    k8s: str | None = None
    url: str | None = None
    memory_mb: float | None = None
    max_key_age_days: int = 365
    ca_cert: str | None = None
    timeout_s: float = 10.0
    now: datetime | None = None
    meminfo: str = "/proc/meminfo"


def mem_total_mb(path: str = "/proc/meminfo") -> float | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _load_config(req: Request, inp: Inputs) -> None:
    import yaml
    from pydantic import ValidationError

    from gemel.config import GemelConfig, load_config

    try:
        if req.config:
            config = load_config(req.config)
            base = os.path.dirname(os.path.abspath(req.config))
            for name in ("ssl_certfile", "ssl_keyfile"):  # relative to the config file, as gemel serve reads them
                value = getattr(config.server, name, None)
                if value:
                    setattr(config.server, name, os.path.join(base, os.path.expanduser(value)))
            source = req.config
        elif inp.manifests is not None and (found := inp.manifests.gemel_config()):
            text, source = found
            config = GemelConfig.model_validate(yaml.safe_load(text) or {})
        elif req.url is None and req.k8s is None:
            config, source = GemelConfig(), "gemel's defaults (no --config)"
        else:
            inp.missing["config"] = "no configuration given (--config, or a ConfigMap with a gemel.yaml key in --k8s)"
            return
    except (OSError, ValueError, ValidationError, yaml.YAMLError) as e:
        raise CheckError(f"bad configuration {req.config or ''}: {e}") from None
    if req.tenants:
        config.gateway.tenants_file = os.path.abspath(req.tenants)
    inp.config, inp.config_source = config, source


def _load_tenants(req: Request, inp: Inputs) -> None:
    from pydantic import ValidationError

    from gemel.gateway.tenants import load_tenants

    path = req.tenants or (inp.config.gateway.tenants_file if inp.config is not None else None)
    if not path:
        inp.missing["tenants"] = "no tenants file (gateway.tenants_file unset; give --tenants)"
        return
    if not os.path.exists(path):
        if req.tenants:
            raise CheckError(f"tenants file {path} does not exist")
        inp.missing["tenants"] = f"gateway.tenants_file={path} is not on this machine (give --tenants)"
        return
    try:
        inp.tenants = load_tenants(path)
        inp.tenants_mode = os.stat(path).st_mode & 0o777
    except (OSError, ValueError, ValidationError) as e:
        raise CheckError(f"bad tenants file {path}: {e}") from None
    inp.tenants_source = path


def gather(req: Request) -> Inputs:
    """Read every input named in ``req`` (and probe the URL) into ``Inputs``."""
    inp = Inputs(max_key_age_days=req.max_key_age_days)
    if req.now is not None:
        inp.now = req.now
    if req.k8s:
        from gemel.check.k8s import load_manifests

        try:
            inp.manifests = load_manifests(req.k8s)
        except (OSError, ValueError) as e:
            raise CheckError(str(e)) from None
        if inp.manifests.errors:
            raise CheckError("unreadable manifests: " + "; ".join(inp.manifests.errors))
    else:
        inp.missing["k8s"] = "no Kubernetes manifests given (--k8s DIR)"
    _load_config(req, inp)
    _load_tenants(req, inp)
    if req.memory_mb is not None:
        inp.memory_mb, inp.memory_source = req.memory_mb, "--memory-mb"
    elif inp.manifests is not None and (limit := inp.manifests.memory_limit_mb()):
        inp.memory_mb, inp.memory_source = limit
    elif (total := mem_total_mb(req.meminfo)) is not None:
        inp.memory_mb, inp.memory_source = total, f"MemTotal of this machine ({req.meminfo})"
    if req.url:
        from gemel.check.live import probe

        inp.probe = probe(req.url, req.timeout_s, req.ca_cert)
    else:
        inp.missing["url"] = "no running server given (--url)"
    return inp


def describe_inputs(inp: Inputs, req: Request) -> dict[str, str | None]:
    return {
        "config": inp.config_source or None,
        "tenants": inp.tenants_source or None,
        "k8s": req.k8s,
        "url": req.url,
        "memory": f"{inp.memory_mb:.0f} MiB ({inp.memory_source})" if inp.memory_mb is not None else None,
    }


def run(req: Request) -> Report:
    """Gather and check: one finding per rule, in the registry's order."""
    inp = gather(req)
    rules = all_rules()
    return Report(rules, [r.run(inp) for r in rules], describe_inputs(inp, req))
