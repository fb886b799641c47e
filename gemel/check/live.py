"""A running server (``--url``): what it answers on a few paths, and the rules over that.

The probe sends only GET requests without credentials (health, readiness, metrics, the model
list), so it is safe against production and proves what an anonymous client gets.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gemel.check.config_rules import is_loopback
from gemel.check.rules import Inputs, Result, failed, passed, rule, skipped

PATHS = ("/healthz", "/readyz", "/metrics", "/v1/models")


@dataclass(frozen=True)
class Answer:
    status: int | None
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: str = ""  # the first 64 KiB
    error: str | None = None


@dataclass
class Probe:
    url: str
    answers: dict[str, Answer] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    def get(self, path: str) -> Answer:
        return self.answers.get(path) or Answer(None, error="not probed")


def probe(url: str, timeout_s: float = 10.0, ca_cert: str | None = None) -> Probe:
    """GET each of ``PATHS`` once, without credentials."""
    import httpx

    base = url.rstrip("/")
    p = Probe(base)
    verify: bool | ssl.SSLContext = ssl.create_default_context(cafile=ca_cert) if ca_cert else True
    with httpx.Client(timeout=timeout_s, verify=verify, follow_redirects=False, trust_env=False) as client:
        for path in PATHS:
            try:
                r = client.get(base + path)
                p.answers[path] = Answer(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.text[:65536])
            except httpx.HTTPError as e:
                p.answers[path] = Answer(None, error=f"{type(e).__name__}: {e}")
    return p


def _unreachable(p: Probe, path: str) -> Result | None:
    a = p.get(path)
    return failed(f"GET {p.url}{path}: {a.error}") if a.status is None else None


@rule("ENG006", "engine", "high", "url", "The running server is ready (`/readyz` is 200)",
      "/readyz is red while a model loads, fails verification, or its engine is silent or restarting: clients get 503s.",
      "Read the answer's `problems` and the server log; `gemel verify` for weight failures.")  # fmt: skip
def _live_ready(inp: Inputs) -> Result:
    p = inp.probe
    a = p.get("/readyz")
    if a.status is None:
        return failed(f"GET {p.url}/readyz: {a.error}")
    if a.status != 200:
        return failed(f"GET {p.url}/readyz answered {a.status}: {a.body[:300]}")
    return passed(f"GET {p.url}/readyz answered 200")


@rule("ENG007", "engine", "info", "url", "The running server is alive (`/healthz` is 200)",
      "/healthz is the liveness probe: it answers as long as the front end runs, while loading and draining too.",
      "Check that the URL points at gemel and the process is running.")  # fmt: skip
def _live_alive(inp: Inputs) -> Result:
    p = inp.probe
    a = p.get("/healthz")
    if a.status != 200:
        return failed(f"GET {p.url}/healthz: {a.error or a.status}")
    return passed(f"GET {p.url}/healthz answered 200")


@rule("OBS008", "observability", "medium", "url", "The running server's `/metrics` is reachable without a key",
      "Prometheus scrapes without credentials; a 401 or an empty page means no alerts and no dashboards.",
      "Keep `/metrics` in `gateway.public_paths`; check the URL reaches gemel's port.")  # fmt: skip
def _live_metrics(inp: Inputs) -> Result:
    p = inp.probe
    a = p.get("/metrics")
    if a.status is None:
        return failed(f"GET {p.url}/metrics: {a.error}")
    if a.status != 200:
        return failed(f"GET {p.url}/metrics answered {a.status}")
    if "gemel:" not in a.body:
        return failed(f"GET {p.url}/metrics answered 200 without gemel: metrics")
    return passed(f"GET {p.url}/metrics answered 200 with gemel: metrics")


@rule("NET009", "network", "high", "url", "The URL uses TLS unless it is loopback",
      "Over plain http beyond loopback keys, prompts and outputs cross the network readable by anyone on the path.",
      "Serve HTTPS (`server.ssl_certfile`/`ssl_keyfile`) or put a TLS proxy in front, and check that URL.")  # fmt: skip
def _live_tls(inp: Inputs) -> Result:
    p = inp.probe
    if p.scheme == "https":
        return passed(f"{p.url} uses https")
    if is_loopback(p.host):
        return passed(f"{p.url}: plain http on loopback")
    return failed(f"{p.url}: plain {p.scheme} to {p.host}")


@rule("GW015", "gateway", "high", "url", "Unauthenticated API requests are refused beyond loopback",
      "Whether an anonymous client can use the API is what matters in the end, whatever the files say.",
      "Give the server a tenants file (`gateway.tenants_file`); only loopback may serve the anonymous tenant.")  # fmt: skip
def _live_anonymous(inp: Inputs) -> Result:
    p = inp.probe
    unreachable = _unreachable(p, "/v1/models")
    if unreachable:
        return skipped(unreachable.detail)
    status = p.get("/v1/models").status
    if status in (401, 403):
        return passed(f"GET {p.url}/v1/models without a key answered {status}: unauthenticated requests are refused")
    if status != 200:
        return skipped(f"GET {p.url}/v1/models without a key answered {status}; cannot tell")
    if is_loopback(p.host):
        return passed(f"GET {p.url}/v1/models without a key answered 200: unauthenticated requests are accepted (loopback)")
    return failed(f"GET {p.url}/v1/models without a key answered 200: unauthenticated requests are accepted on {p.host}")


@rule("NET010", "network", "low", "url", "Responses carry security headers",
      "`X-Content-Type-Options: nosniff` stops browsers from executing a response as another type; over https `Strict-Transport-Security` stops downgrades to http.",
      "Add the headers where gemel's responses leave your network: the TLS proxy or the ingress in front of it.")  # fmt: skip
def _live_headers(inp: Inputs) -> Result:
    p = inp.probe
    answered = [(path, a) for path in ("/v1/models", "/healthz") if (a := p.get(path)).status is not None]
    if not answered:
        return skipped(f"{p.url} did not answer")
    path, a = answered[0]
    missing = []
    if a.headers.get("x-content-type-options", "").lower() != "nosniff":
        missing.append("X-Content-Type-Options: nosniff")
    if p.scheme == "https" and "strict-transport-security" not in a.headers:
        missing.append("Strict-Transport-Security")
    if missing:
        return failed(f"GET {p.url}{path} lacks {', '.join(missing)}")
    return passed(f"GET {p.url}{path} sends " + ("nosniff and HSTS" if p.scheme == "https" else "nosniff"))
