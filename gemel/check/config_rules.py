"""Rules over gemel.yaml and the tenants file: gateway, network, engine, observability.

Settings that other parts of gemel may not have yet are read with ``getattr`` and the
server's defaults, so the check works with either version of the configuration.
"""

from __future__ import annotations

import ipaddress
import json
import os
import stat
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

from gemel.check.rules import Inputs, Result, failed, passed, rule, skipped

# -- helpers --------------------------------------------------------------------------------

WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def is_loopback(host: str | None) -> bool:
    """Whether an address accepts only local connections. Names other than localhost count as
    reachable from outside (no DNS lookup: the check must give the same answer everywhere)."""
    if host is None:
        return True
    if host.lower() in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Listener:
    name: str  # "REST" or "gRPC"
    key: str  # the config key that sets its address
    host: str


def listeners(inp: Inputs) -> list[Listener]:
    c = inp.config
    out = [Listener("REST", "server.host", c.server.host)]
    if c.grpc.enabled:
        out.append(Listener("gRPC", "grpc.host" if c.grpc.host else "server.host (grpc.host unset)", c.grpc.host or c.server.host))
    return out


def public(inp: Inputs) -> list[Listener]:
    return [lst for lst in listeners(inp) if not is_loopback(lst.host)]


def rest_tls(inp: Inputs) -> tuple[str | None, str | None]:
    s = inp.config.server
    return getattr(s, "ssl_certfile", None), getattr(s, "ssl_keyfile", None)


def has_keys(inp: Inputs) -> bool:
    return bool(inp.config.gateway.tenants_file)


def _where(listeners_: list[Listener]) -> str:
    return ", ".join(f"{lst.name} on {lst.key}={lst.host or '(all)'}" for lst in listeners_)


def _tenant_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _every_tenant(inp: Inputs, bad, what: str) -> Result:
    tenants = inp.tenants.tenants
    if not tenants:
        return skipped(f"{inp.tenants_source} has no tenants")
    missing = [tid for tid, t in tenants.items() if bad(t)]
    if missing:
        return failed(f"{inp.tenants_source}: tenants without {what}: {_tenant_list(missing)}")
    return passed(f"{inp.tenants_source}: all {len(tenants)} tenant(s) have {what}")


# -- gateway --------------------------------------------------------------------------------


@rule("GW001", "gateway", "high", "config", "API keys are required when a listener is reachable beyond loopback",
      "Without a tenants file gemel has one anonymous tenant with no limits: anyone who reaches the port can generate.",
      "Create keys with `gemel keys create --tenants tenants.yaml ...` and set `gateway.tenants_file`, or listen on 127.0.0.1.")  # fmt: skip
def _gw_keys(inp: Inputs) -> Result:
    outside = public(inp)
    if not outside:
        return passed("every listener is on loopback (" + _where(listeners(inp)) + ")")
    if has_keys(inp):
        return passed(f"gateway.tenants_file={inp.config.gateway.tenants_file} guards {_where(outside)}")
    return failed(f"gateway.tenants_file is unset while {_where(outside)}")


@rule("GW002", "gateway", "high", "config", "Anonymous access is off beyond loopback (`gateway.insecure`)",
      "`gateway.insecure: true` (or `--insecure`) lets the anonymous tenant serve a public address.",
      "Remove `gateway.insecure` (or `--insecure`) and give a tenants file.")  # fmt: skip
def _gw_insecure(inp: Inputs) -> Result:
    gw = inp.config.gateway
    if not gw.insecure:
        return passed("gateway.insecure=false")
    if has_keys(inp):
        return passed("gateway.insecure=true has no effect: gateway.tenants_file is set")
    outside = public(inp)
    if outside:
        return failed(f"gateway.insecure=true with no tenants file while {_where(outside)}: anonymous, unlimited access")
    return passed("gateway.insecure=true, but every listener is on loopback")


PUBLIC_OK = ("/healthz", "/readyz", "/metrics", "/docs", "/redoc", "/openapi.json", "/dashboard")


@rule("GW003", "gateway", "high", "config", "`gateway.public_paths` opens no API path",
      "Paths listed there (and everything below them) are served without credentials or rate limits.",
      "Keep only health, readiness, metrics, API docs and (if wanted) /dashboard in `gateway.public_paths`.")  # fmt: skip
def _gw_public_paths(inp: Inputs) -> Result:
    paths = inp.config.gateway.public_paths
    bad = [p for p in paths if p.rstrip("/") not in PUBLIC_OK]
    if bad:
        return failed(f"gateway.public_paths opens {', '.join(repr(p) for p in bad)} without a key")
    return passed(f"gateway.public_paths={paths}")


@rule("GW004", "gateway", "medium", "tenants", "The tenants file is private (mode 0600)",
      "It holds key hashes and signing keys; a readable file allows offline guessing and tampering by other users.",
      "`chmod 600` the tenants file (gemel keys writes it so); in Kubernetes mount its Secret with `defaultMode: 0400`.")  # fmt: skip
def _gw_tenants_mode(inp: Inputs) -> Result:
    if inp.tenants_mode is None:
        return skipped(f"{inp.tenants_source}: file mode unknown")
    if inp.tenants_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return failed(f"{inp.tenants_source} has mode {inp.tenants_mode:o}: readable or writable by other users")
    return passed(f"{inp.tenants_source} has mode {inp.tenants_mode:o}")


@rule("GW005", "gateway", "medium", "tenants", "Every tenant has a request rate limit (`rpm`)",
      "A tenant without one can flood the server with cheap calls (countTokens, model listing) and starve the others.",
      "`gemel keys set --tenants PATH --tenant T --rpm N` for each tenant named.")  # fmt: skip
def _gw_rpm(inp: Inputs) -> Result:
    return _every_tenant(inp, lambda t: t.rpm is None, "a requests/min limit (rpm)")


@rule("GW006", "gateway", "medium", "tenants", "Every tenant has a token rate limit (`tpm`)",
      "Tokens are what costs compute; without a tokens/min bucket one tenant's long generations fill the engine.",
      "`gemel keys set --tenants PATH --tenant T --tpm N` for each tenant named.")  # fmt: skip
def _gw_tpm(inp: Inputs) -> Result:
    return _every_tenant(inp, lambda t: t.tpm is None, "a tokens/min limit (tpm)")


@rule("GW007", "gateway", "low", "tenants", "Every tenant has a concurrency cap (`max_concurrent`)",
      "Rate limits refill over a minute; a burst of long streams can still hold every engine slot at once.",
      "`gemel keys set --tenants PATH --tenant T --max-concurrent N`.")  # fmt: skip
def _gw_concurrency(inp: Inputs) -> Result:
    return _every_tenant(inp, lambda t: t.max_concurrent is None, "max_concurrent")


@rule("GW008", "gateway", "low", "tenants", "With several tenants, each has an engine quota",
      "Without `engine.max_kv_blocks_share` or `engine.max_running_seqs` one tenant may take every KV block.",
      "`gemel keys set --tenants PATH --tenant T --kv-share 0.5` (or `--max-running-seqs N`).")  # fmt: skip
def _gw_quota(inp: Inputs) -> Result:
    if len(inp.tenants.tenants) < 2:
        return passed(f"{inp.tenants_source}: a single tenant owns the engine")
    return _every_tenant(inp, lambda t: t.engine.empty, "an engine quota (max_kv_blocks_share or max_running_seqs)")


@rule("GW009", "gateway", "medium", "tenants", "Privileged (P0) tenants require signed requests",
      "P0 requests preempt everyone else's; a leaked bearer key would carry that power, a signature needs the private key.",
      "`gemel keys ed25519 --tenants PATH --tenant T --out T.pem` then `gemel keys set ... --require-signature yes`.")  # fmt: skip
def _gw_p0_signed(inp: Inputs) -> Result:
    p0 = [tid for tid, t in inp.tenants.tenants.items() if t.priority == "P0"]
    if not p0:
        return passed(f"{inp.tenants_source}: no P0 tenant")
    return _every_tenant_of(inp, p0, lambda t: not (t.require_signature and t.ed25519_keys),
                            "require_signature with an Ed25519 key", "P0 tenants")  # fmt: skip


def _every_tenant_of(inp: Inputs, ids: list[str], bad, what: str, which: str) -> Result:
    missing = [tid for tid in ids if bad(inp.tenants.tenants[tid])]
    if missing:
        return failed(f"{inp.tenants_source}: {which} without {what}: {_tenant_list(missing)}")
    return passed(f"{inp.tenants_source}: {len(ids)} {which}, all with {what}")


@rule("GW010", "gateway", "medium", "tenants", "Tenants with signing keys require signatures",
      "A tenant that registered an Ed25519 key but still accepts API keys is only as safe as its weakest key.",
      "`gemel keys set --tenants PATH --tenant T --require-signature yes`, or revoke the unused signing key.")  # fmt: skip
def _gw_signing_required(inp: Inputs) -> Result:
    signing = [tid for tid, t in inp.tenants.tenants.items() if t.ed25519_keys]
    if not signing:
        return passed(f"{inp.tenants_source}: no tenant has signing keys")
    return _every_tenant_of(inp, signing, lambda t: not t.require_signature, "require_signature: true",
                            "tenants with signing keys")  # fmt: skip


@rule("GW011", "gateway", "low", "tenants", "Tenants that require signatures have a signing key",
      "`require_signature: true` without an Ed25519 key locks the tenant out: every request is refused.",
      "`gemel keys ed25519 --tenants PATH --tenant T --out T.pem`.")  # fmt: skip
def _gw_signing_key_present(inp: Inputs) -> Result:
    req = [tid for tid, t in inp.tenants.tenants.items() if t.require_signature]
    if not req:
        return passed(f"{inp.tenants_source}: no tenant requires signatures")
    return _every_tenant_of(inp, req, lambda t: not t.ed25519_keys, "an Ed25519 key", "tenants requiring signatures")


@rule("GW012", "gateway", "low", "tenants", "Priority classes are sane: a class in use has queue room, P0 is the exception",
      "A class whose `gateway.queue_limits` is 0 refuses all its tenants' generations; when most tenants are P0 priority means nothing.",
      "Give every class in use a queue limit above 0, and keep P0 for the few tenants that must preempt others.")  # fmt: skip
def _gw_priorities(inp: Inputs) -> Result:
    tenants = inp.tenants.tenants
    problems = []
    if inp.config is not None:
        limits = inp.config.gateway.queue_limits
        for cls in sorted({t.priority for t in tenants.values()}):
            if getattr(limits, cls) == 0:
                users = [tid for tid, t in tenants.items() if t.priority == cls]
                problems.append(f"gateway.queue_limits.{cls}=0 closes the class of {_tenant_list(users)}")
    p0 = [tid for tid, t in tenants.items() if t.priority == "P0"]
    if len(tenants) >= 2 and len(p0) * 2 > len(tenants):
        problems.append(f"{len(p0)} of {len(tenants)} tenants are P0 ({_tenant_list(p0)})")
    if problems:
        return failed(f"{inp.tenants_source}: " + "; ".join(problems))
    counts = {c: sum(t.priority == c for t in tenants.values()) for c in ("P0", "P1", "P2")}
    return passed(f"{inp.tenants_source}: tenants per class {counts}")


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        value = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value


@rule("GW013", "gateway", "medium", "tenants", "Keys are dated, not expired and younger than the rotation age",
      "A key that never expires is valid for as long as anyone who ever saw it keeps it; gemel keys carry a `created` date and no expiry of their own.",
      "Rotate: `gemel keys create` a new key, move clients, `gemel keys revoke --key-id ID` the old one (default age limit 365 days, `--max-key-age-days`).")  # fmt: skip
def _gw_key_age(inp: Inputs) -> Result:
    limit = timedelta(days=inp.max_key_age_days)
    old, undated, expired, count = [], [], [], 0
    for tid, t in inp.tenants.tenants.items():
        for kind, keys in (("api key", t.api_keys), ("signing key", t.ed25519_keys)):
            for k in keys:
                count += 1
                name = f"{tid}/{kind} {k.id}"
                expires = _parse_time(getattr(k, "expires", None))  # a future expiry field is honoured
                if expires is not None and expires <= inp.now:
                    expired.append(name)
                created = _parse_time(k.created)
                if created is None:
                    undated.append(name)
                elif inp.now - created > limit:
                    old.append(f"{name} ({(inp.now - created).days} days)")
    if not count:
        return skipped(f"{inp.tenants_source} holds no keys")
    problems = [f"{what}: {_tenant_list(names, 5)}" for what, names in
                (("expired", expired), (f"older than {inp.max_key_age_days} days", old), ("without a created date", undated)) if names]  # fmt: skip
    if problems:
        return failed(f"{inp.tenants_source}: " + "; ".join(problems))
    return passed(f"{inp.tenants_source}: {count} key(s), all dated within {inp.max_key_age_days} days")


@rule("GW014", "gateway", "medium", "tenants", "Stored key hashes and signing keys are strong",
      "Key hashes must be salted scrypt of gemel's strength (N >= 2^14, r >= 8, 16-byte salt, 32-byte digest) so a copied file cannot be brute-forced cheaply; signing keys must be valid 32-byte Ed25519 keys.",
      "Re-issue weak or hand-edited keys with `gemel keys create` / `gemel keys ed25519` and revoke the old ones.")  # fmt: skip
def _gw_key_strength(inp: Inputs) -> Result:
    import base64

    def unb64(text: str) -> bytes:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))

    weak, count = [], 0
    for tid, t in inp.tenants.tenants.items():
        for k in t.api_keys:
            count += 1
            try:
                scheme, n, r, _p, salt, digest = k.hash.split("$")
                ok = (scheme == "scrypt" and int(n) >= 2**14 and int(r) >= 8 and len(unb64(salt)) >= 16
                      and len(unb64(digest)) >= 32)  # fmt: skip
            except ValueError:
                ok = False
            if not ok:
                weak.append(f"{tid}/api key {k.id}")
        for k in t.ed25519_keys:
            count += 1
            try:
                from gemel.gateway.tenants import load_public_key

                load_public_key(k.public_key)
            except Exception:  # noqa: BLE001 - any parse failure is a bad key
                weak.append(f"{tid}/signing key {k.id}")
    if not count:
        return skipped(f"{inp.tenants_source} holds no keys")
    if weak:
        return failed(f"{inp.tenants_source}: weak or malformed: {_tenant_list(weak)}")
    return passed(f"{inp.tenants_source}: {count} key(s), scrypt N>=2^14 hashes and valid Ed25519 keys")


@rule("GW016", "gateway", "high", "tenants", "Admin tenants sign their requests",
      "An admin key changes routes at run time (where every model's traffic goes); as a bearer key it works for whoever copies it.",
      "`gemel keys ed25519 --tenants PATH --tenant T --out T.pem` and `gemel keys set ... --require-signature yes` for each admin tenant.")  # fmt: skip
def _gw_admin_signed(inp: Inputs) -> Result:
    admins = [tid for tid, t in inp.tenants.tenants.items() if getattr(t, "admin", False)]
    if not admins:
        return passed(f"{inp.tenants_source}: no admin tenant")
    return _every_tenant_of(inp, admins, lambda t: not (t.require_signature and t.ed25519_keys),
                            "require_signature with an Ed25519 key", "admin tenants")  # fmt: skip


# -- network --------------------------------------------------------------------------------


@rule("NET001", "network", "high", "config", "No listener beyond loopback without both keys and TLS",
      "A wildcard or public bind without keys serves anyone; without TLS keys, prompts and outputs cross the network in clear text.",
      "Set `gateway.tenants_file` and `server.ssl_certfile`/`ssl_keyfile` (and `grpc.tls_cert_file`/`tls_key_file`), or bind 127.0.0.1 behind a TLS proxy on the same host.")  # fmt: skip
def _net_bind(inp: Inputs) -> Result:
    outside = public(inp)
    if not outside:
        return passed("every listener is on loopback (" + _where(listeners(inp)) + ")")
    problems = []
    for lst in outside:
        missing = []
        if not has_keys(inp):
            missing.append("keys (gateway.tenants_file)")
        tls = all(rest_tls(inp)) if lst.name == "REST" else bool(inp.config.grpc.tls_cert_file)
        if not tls:
            missing.append("TLS (" + ("server.ssl_certfile" if lst.name == "REST" else "grpc.tls_cert_file") + ")")
        if missing:
            where = "all interfaces" if lst.host in WILDCARDS else lst.host
            problems.append(f"{lst.name} on {lst.key}={lst.host or '(all)'} ({where}) without {' and '.join(missing)}")
    if problems:
        return failed("; ".join(problems))
    return passed(f"{_where(outside)} with keys and TLS")


def _cert_problem(cert: str, key: str | None, now: datetime, min_days: int = 14) -> str | None:
    import ssl

    from cryptography import x509

    try:
        with open(cert, "rb") as f:
            data = f.read()
        certificate = x509.load_pem_x509_certificate(data)
    except (OSError, ValueError) as e:
        return f"{cert}: not a PEM certificate ({e})"
    if key:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            return f"{cert} with {key}: unusable ({e})"
    not_after = certificate.not_valid_after_utc
    if not_after <= now:
        return f"{cert}: expired on {not_after:%Y-%m-%d}"
    if not_after - now < timedelta(days=min_days):
        return f"{cert}: expires on {not_after:%Y-%m-%d}, in less than {min_days} days"
    return None


@rule("NET002", "network", "medium", "config", "TLS certificates load, match their keys and are not about to expire",
      "A broken or expired certificate stops `gemel serve` at start-up or makes every client refuse the connection.",
      "Renew the certificate (at least 14 days before it expires) and keep each certificate with its own private key.")  # fmt: skip
def _net_certs(inp: Inputs) -> Result:
    c = inp.config
    pairs = []
    cert, key = rest_tls(inp)
    if cert or key:
        pairs.append(("server.ssl_certfile", cert, "server.ssl_keyfile", key))
    if c.grpc.enabled and (c.grpc.tls_cert_file or c.grpc.tls_key_file):
        pairs.append(("grpc.tls_cert_file", c.grpc.tls_cert_file, "grpc.tls_key_file", c.grpc.tls_key_file))
    if not pairs:
        return skipped("no TLS configured (server.ssl_certfile, grpc.tls_cert_file); NET001 says whether it is needed")
    problems, absent, good = [], [], []
    for cert_key, cert_path, key_key, key_path in pairs:
        if not cert_path or not key_path:
            problems.append(f"{cert_key} and {key_key} go together: set both")
            continue
        if not os.path.exists(cert_path):
            absent.append(f"{cert_key}={cert_path}")
            continue
        problem = _cert_problem(cert_path, key_path if os.path.exists(key_path) else None, inp.now)
        if problem:
            problems.append(f"{cert_key}: {problem}")
        else:
            good.append(cert_key)
    if problems:
        return failed("; ".join(problems))
    if absent and not good:
        return skipped(f"certificate files are not on this machine: {', '.join(absent)}")
    return passed(f"{', '.join(good)} valid for 14+ days" + (f"; not on this machine: {', '.join(absent)}" if absent else ""))


@rule("NET003", "network", "high", "config", "gRPC beyond loopback speaks TLS",
      "The gRPC port serves the same generation API; without TLS its keys and prompts cross the network in clear text.",
      "Set `grpc.tls_cert_file` and `grpc.tls_key_file`, set `grpc.host: 127.0.0.1`, or `grpc.enabled: false`.")  # fmt: skip
def _net_grpc_tls(inp: Inputs) -> Result:
    g = inp.config.grpc
    if not g.enabled:
        return passed("grpc.enabled=false")
    host = g.host or inp.config.server.host
    if is_loopback(host):
        return passed(f"gRPC listens on loopback ({host})")
    if g.tls_cert_file and g.tls_key_file:
        return passed(f"grpc.tls_cert_file={g.tls_cert_file}")
    return failed(f"gRPC on {host} (grpc.host={g.host}, server.host={inp.config.server.host}) without grpc.tls_cert_file")


@rule("NET004", "network", "low", "config", "gRPC reflection is off beyond loopback",
      "Reflection answers without credentials and lists every service and message, which helps an attacker map the API.",
      "Set `grpc.reflection: false` on public listeners (grpcurl can use the .proto files instead).")  # fmt: skip
def _net_reflection(inp: Inputs) -> Result:
    g = inp.config.grpc
    host = g.host or inp.config.server.host
    if not g.enabled or not g.reflection or is_loopback(host):
        return passed(f"grpc.enabled={g.enabled}, grpc.reflection={g.reflection}, gRPC host {host}")
    return failed(f"grpc.reflection=true on {host}")


MAX_BODY_MB = 64


@rule("NET005", "network", "medium", "config", "Request bodies are bounded (`server.max_body_mb` <= 64)",
      "Bodies are read into memory before the gateway's token limits apply; a huge body is a cheap way to exhaust the front end.",
      "Set `server.max_body_mb` to what clients need (default 20, Gemini's own inline limit).")  # fmt: skip
def _net_body(inp: Inputs) -> Result:
    value = getattr(inp.config.server, "max_body_mb", 20.0)
    if value is None or value > MAX_BODY_MB:
        return failed(f"server.max_body_mb={value} (above {MAX_BODY_MB})")
    return passed(f"server.max_body_mb={value}")


@rule("NET006", "network", "medium", "config", "gRPC messages are bounded (`grpc.max_message_mb` <= 64)",
      "The gRPC server allocates up to the limit per message before any check; a large limit invites memory exhaustion.",
      "Set `grpc.max_message_mb` to 64 or less.")  # fmt: skip
def _net_grpc_message(inp: Inputs) -> Result:
    g = inp.config.grpc
    if not g.enabled:
        return passed("grpc.enabled=false")
    if g.max_message_mb > MAX_BODY_MB:
        return failed(f"grpc.max_message_mb={g.max_message_mb} (above {MAX_BODY_MB})")
    return passed(f"grpc.max_message_mb={g.max_message_mb}")


CORS_KEYS = ("cors_allow_origins", "cors_origins", "allow_origins")


@rule("NET007", "network", "medium", "config", "CORS, if configured, names its origins (no `*`)",
      "A wildcard origin lets any web page a user visits call the API with the browser's reach (and its network position).",
      "List the exact origins that need the API; without a CORS setting browsers keep to same-origin, which is the safe default.")  # fmt: skip
def _net_cors(inp: Inputs) -> Result:
    sections = {"server": inp.config.server, "gateway": inp.config.gateway}
    found = [(f"{sec}.{k}", getattr(obj, k)) for sec, obj in sections.items() for k in CORS_KEYS if getattr(obj, k, None)]
    if not found:
        return passed("no CORS setting: browsers on other origins cannot read responses")
    wild = [key for key, value in found if "*" in (value if isinstance(value, (list, tuple)) else [value])]
    if wild:
        return failed(f"{', '.join(wild)} allows any origin ('*')")
    return passed("; ".join(f"{k}={v}" for k, v in found))


@rule("NET008", "network", "low", "config", "Request deadlines are bounded",
      "A client may ask for up to `server.max_request_timeout_s`; very long deadlines let slow streams pin engine slots and connections.",
      "Keep `server.request_timeout_s` <= `server.max_request_timeout_s` <= 3600.")  # fmt: skip
def _net_deadlines(inp: Inputs) -> Result:
    s = inp.config.server
    if s.max_request_timeout_s > 3600:
        return failed(f"server.max_request_timeout_s={s.max_request_timeout_s:g} (above 3600)")
    if s.request_timeout_s > s.max_request_timeout_s:
        return failed(f"server.request_timeout_s={s.request_timeout_s:g} above server.max_request_timeout_s={s.max_request_timeout_s:g}")
    return passed(f"server.request_timeout_s={s.request_timeout_s:g}, server.max_request_timeout_s={s.max_request_timeout_s:g}")


def _redis_urls(inp: Inputs) -> list[tuple[str, str]]:
    c = inp.config
    found = []
    if getattr(c.gateway, "redis_url", None):
        found.append(("gateway.redis_url", c.gateway.redis_url))
    response = getattr(getattr(c, "cache", None), "response", None)
    if response is not None and getattr(response, "redis_url", None):
        found.append(("cache.response.redis_url", response.redis_url))
    return found


@rule("NET011", "network", "medium", "config", "Redis beyond loopback is reached with a password or TLS",
      "Redis holds the shared rate-limit buckets (and cached responses); whoever can write to it can lift every tenant's limits.",
      "Use `rediss://` or `redis://:PASSWORD@host` (Redis `requirepass` or an ACL user), or keep Redis on loopback.")  # fmt: skip
def _net_redis(inp: Inputs) -> Result:
    urls = _redis_urls(inp)
    if not urls:
        return passed("no Redis configured")
    bad = []
    for key, url in urls:
        u = urlsplit(url)
        if u.scheme != "rediss" and not u.password and not is_loopback(u.hostname) and u.scheme != "unix":
            bad.append(f"{key} reaches {u.hostname} without a password or TLS")
    return failed("; ".join(bad)) if bad else passed(", ".join(f"{k}={_without_password(v)}" for k, v in urls))


def _without_password(url: str) -> str:
    u = urlsplit(url)
    host = f"{u.hostname}:{u.port}" if u.port else (u.hostname or "")
    return u._replace(netloc=(f"{u.username}:***@" if u.password else "") + host).geturl()


# -- engine ---------------------------------------------------------------------------------

# Dimensions of the packaged models (read from their GGUFs), so the check needs neither the
# packages nor their files: layers, KV heads, head size, native context.
PACKAGED_DIMS = {
    "smollm2-135m-instruct": (30, 3, 64, 8192),
    "smollm2": (30, 3, 64, 8192),
    "default": (30, 3, 64, 8192),
    "gemma3-270m": (18, 1, 256, 32768),
    "gemma3": (18, 1, 256, 32768),
    "gemma-3-270m": (18, 1, 256, 32768),
}


def model_dims(source: str) -> tuple[int, int, int, int] | None:
    """(layers, KV heads, head size, native context) of a model source, or None when unknown here.
    GGUF metadata and HF config.json are read without torch."""
    if source.lower() in PACKAGED_DIMS:
        return PACKAGED_DIMS[source.lower()]
    path = os.path.expanduser(source)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        heads = cfg["num_attention_heads"]
        return (cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
                cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg.get("max_position_embeddings", 4096))  # fmt: skip
    if os.path.isfile(path) and path.endswith(".gguf"):
        from gemel.loader import gguf_loader

        arch = gguf_loader.arch_config(gguf_loader.open_gguf(path), path)
        return arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.max_position_embeddings
    return None


def _kv_elem(inp: Inputs, dtype: str) -> tuple[float, str]:
    """Bytes per cached value and how that was decided (dtype auto on CPU: float32, the larger case)."""
    if dtype == "auto":
        if inp.config.engine.device == "cuda":
            return 2, "bf16 (dtype auto on CUDA)"
        return 4, "float32 (dtype auto; CPUs with native bf16 fit twice as many)"
    return (4, "float32") if dtype == "float32" else (2, dtype)


@dataclass(frozen=True)
class KvPlan:
    model: str
    bytes_per_token: int | None
    cache_bytes: int | None
    capacity_tokens: int | None
    context: int | None
    note: str


def kv_plans(inp: Inputs) -> list[KvPlan]:
    """Per catalogue model: the KV cache's bytes and capacity and the context it must hold."""
    c = inp.config
    plans = []
    for entry in c.models:
        e = c.engine_config(entry)
        dims = model_dims(entry.source)
        if dims is None:
            cache = e.kv_cache_memory_mb * 2**20 if e.num_kv_blocks is None else None
            plans.append(KvPlan(entry.id, None, cache, None, None, f"dimensions of {entry.source} unknown here"))
            continue
        layers, kv_heads, head_dim, native = dims
        if e.kv_cache_dtype == "int8":
            row, note = head_dim + 4, "int8 KV"
        elif e.kv_cache_dtype == "float16":
            row, note = head_dim * 2, "float16 KV"
        else:
            elem, note = _kv_elem(inp, e.dtype)
            row = int(head_dim * elem)
        per_token = 2 * layers * kv_heads * row
        blocks = e.num_kv_blocks or max(1, e.kv_cache_memory_mb * 2**20 // (e.block_size * per_token))
        context = min(e.max_model_len or native, native)
        plans.append(KvPlan(entry.id, per_token, blocks * e.block_size * per_token, blocks * e.block_size, context, note))
    return plans


KV_MEMORY_SHARE = 0.5


@rule("ENG001", "engine", "high", "config", "The KV caches of all engines fit in half the memory",
      "Each catalogue model runs its own engine with its own KV cache, next to the weights, the tokenizers and the front end; a budget near the machine's (or container's) memory ends in the OOM killer.",
      "Lower `engine.kv_cache_memory_mb` (or `num_kv_blocks`), serve fewer models, or give the pod more memory (`--memory-mb` checks another machine).")  # fmt: skip
def _eng_kv_memory(inp: Inputs) -> Result:
    if inp.config.engine.device == "cuda":
        return skipped("engine.device=cuda: the KV cache lives in GPU memory")
    if inp.config.scale.attach:
        return skipped("scale.attach: the engines run as Ray Serve replicas on the Ray cluster's nodes, not beside this front end")
    if inp.memory_mb is None:
        return skipped("memory size unknown (no /proc/meminfo; give --memory-mb)")
    plans = kv_plans(inp)
    unknown = [p.model for p in plans if p.cache_bytes is None]
    if unknown:
        return skipped(f"KV size of {', '.join(unknown)} unknown (engine.num_kv_blocks with a model whose dimensions are unknown here)")
    total_mb = sum(p.cache_bytes for p in plans) / 2**20
    e = inp.config.engine
    each = f"engine.num_kv_blocks={e.num_kv_blocks}" if e.num_kv_blocks else f"engine.kv_cache_memory_mb={e.kv_cache_memory_mb}"
    detail = (f"{len(plans)} engine(s) with {each}: {total_mb:.0f} MiB of KV cache against {inp.memory_mb:.0f} MiB"
              f" ({inp.memory_source})")  # fmt: skip
    if total_mb > KV_MEMORY_SHARE * inp.memory_mb:
        return failed(detail + f", more than {KV_MEMORY_SHARE:.0%}")
    return passed(detail)


@rule("ENG002", "engine", "medium", "config", "Each model's longest context fits its KV cache",
      "A request at the full context that does not fit in the cache can never be scheduled whole: it is preempted again and again or cut short.",
      "Raise `engine.kv_cache_memory_mb` or cap the context with `models[].max_context` / `engine.max_model_len`.")  # fmt: skip
def _eng_kv_context(inp: Inputs) -> Result:
    plans = kv_plans(inp)
    known = [p for p in plans if p.capacity_tokens is not None]
    if not known:
        return skipped("; ".join(p.note for p in plans))
    short = [p for p in known if p.context > p.capacity_tokens]
    text = ", ".join(f"{p.model}: context {p.context} vs {p.capacity_tokens} KV tokens ({p.note})" for p in (short or known))
    unknown = [p.model for p in plans if p.capacity_tokens is None]
    if unknown:
        text += f"; not checked: {', '.join(unknown)}"
    return failed(text) if short else passed(text)


@rule("ENG003", "engine", "high", "config", "Weight files are verified before serving (`server.verify_weights` not off)",
      "A damaged or swapped weight file loads without complaint and serves wrong or manipulated tokens.",
      "Set `server.verify_weights: fast` (the default) or `full`; write manifests for path models with `gemel verify --write-manifest`.")  # fmt: skip
def _eng_verify(inp: Inputs) -> Result:
    value = getattr(inp.config.server, "verify_weights", "fast")
    if value == "off":
        return failed("server.verify_weights=off")
    return passed(f"server.verify_weights={value}")


@rule("ENG004", "engine", "medium", "config", "Crashed or stalled engines are restarted (`server.engine_max_restarts` > 0)",
      "With restarts off one engine crash leaves its model answering 503 until someone restarts the server.",
      "Set `server.engine_max_restarts` above 0 (default 5).")  # fmt: skip
def _eng_restarts(inp: Inputs) -> Result:
    value = getattr(inp.config.server, "engine_max_restarts", 5)
    if not value:
        return failed(f"server.engine_max_restarts={value}")
    return passed(f"server.engine_max_restarts={value}")


@rule("ENG005", "engine", "high", "config", "Fault injection is off (`engine.fault_injection` unset)",
      "It exists for tests: with $GEMEL_FAULT_INJECTION=1 it crashes or hangs the engine on purpose.",
      "Remove `engine.fault_injection` from production configurations.")  # fmt: skip
def _eng_faults(inp: Inputs) -> Result:
    value = getattr(inp.config.engine, "fault_injection", None)
    if value:
        return failed(f"engine.fault_injection={value!r}")
    return passed("engine.fault_injection unset")


# -- observability --------------------------------------------------------------------------


@rule("OBS001", "observability", "low", "config", "Prometheus can scrape `/metrics`",
      "Metrics are always served, but with a tenants file only `gateway.public_paths` are reachable without a key, and Prometheus sends none.",
      "Keep `/metrics` in `gateway.public_paths` (the default), or give the scrape job credentials.")  # fmt: skip
def _obs_metrics(inp: Inputs) -> Result:
    gw = inp.config.gateway
    if not has_keys(inp):
        return passed("/metrics is served and no keys are configured")
    if any(p.rstrip("/") == "/metrics" for p in gw.public_paths):
        return passed("/metrics is in gateway.public_paths")
    return failed("gateway.tenants_file is set and /metrics is not in gateway.public_paths: scrapes get 401")


@rule("OBS002", "observability", "info", "config", "Traces are exported (`observability.otlp_endpoint`)",
      "Without an exporter spans are made (for `traceparent`) but never leave the process.",
      "Set `observability.otlp_endpoint` to an OpenTelemetry collector and install `gemel[otlp]`.")  # fmt: skip
def _obs_tracing(inp: Inputs) -> Result:
    o = inp.config.observability
    if not o.otlp_endpoint:
        return failed("observability.otlp_endpoint unset")
    if o.trace_sample_ratio == 0:
        return failed(f"observability.otlp_endpoint={o.otlp_endpoint} but trace_sample_ratio=0")
    return passed(f"observability.otlp_endpoint={o.otlp_endpoint}, trace_sample_ratio={o.trace_sample_ratio}")


@rule("OBS003", "observability", "medium", "config", "The log level is not debug",
      "Debug logs are verbose enough to slow a busy server and may carry request details.",
      "Set `server.log_level: info` (or warning).")  # fmt: skip
def _obs_log_level(inp: Inputs) -> Result:
    level = inp.config.server.log_level
    if level == "debug":
        return failed("server.log_level=debug")
    return passed(f"server.log_level={level}")


@rule("OBS004", "observability", "medium", "config", "The dashboard is not open without a key beyond loopback",
      "The dashboard shows traffic, tenants' throughput and token timings to whoever reaches it.",
      "Give a tenants file and keep `/dashboard` out of `gateway.public_paths`, set `observability.dashboard: false`, or bind loopback.")  # fmt: skip
def _obs_dashboard(inp: Inputs) -> Result:
    c = inp.config
    if not c.observability.dashboard:
        return passed("observability.dashboard=false")
    if is_loopback(c.server.host):
        return passed(f"/dashboard on loopback ({c.server.host})")
    if not has_keys(inp):
        return failed(f"/dashboard served on server.host={c.server.host} with no keys (gateway.tenants_file unset)")
    if any(p.rstrip("/") == "/dashboard" for p in c.gateway.public_paths):
        return failed(f"/dashboard is in gateway.public_paths on server.host={c.server.host}")
    return passed("/dashboard needs a key")


@rule("OBS005", "observability", "medium", "config", "The in-memory trace store is off",
      "`observability.trace_memory_exporter` is for tests: it keeps every span in memory and serves it at /internal/traces.",
      "Remove `observability.trace_memory_exporter` and export traces with `otlp_endpoint` instead.")  # fmt: skip
def _obs_memory_traces(inp: Inputs) -> Result:
    if inp.config.observability.trace_memory_exporter:
        return failed("observability.trace_memory_exporter=true")
    return passed("observability.trace_memory_exporter=false")


@rule("OBS006", "observability", "medium", "config", "Credentials for the trace collector are not sent in clear text",
      "`observability.otlp_headers` usually carry an API key; over plain http to another host anyone on the path reads it.",
      "Use an https `otlp_endpoint`, or a collector on loopback (a sidecar).")  # fmt: skip
def _obs_otlp_tls(inp: Inputs) -> Result:
    o = inp.config.observability
    if not o.otlp_endpoint or not o.otlp_headers:
        return passed("no OTLP headers sent" if o.otlp_endpoint else "no OTLP export")
    url = urlsplit(o.otlp_endpoint)
    if url.scheme == "https" or is_loopback(url.hostname):
        return passed(f"observability.otlp_endpoint={o.otlp_endpoint}")
    return failed(f"observability.otlp_headers ({', '.join(o.otlp_headers)}) sent over {o.otlp_endpoint}")


@rule("OBS007", "observability", "info", "config", "The periodic stats log is on",
      "The one-line stats log is the quickest view of throughput and cache use when metrics are not scraped.",
      "Set `observability.log_stats_interval_s` above 0 (default 10).")  # fmt: skip
def _obs_stats_log(inp: Inputs) -> Result:
    value = inp.config.observability.log_stats_interval_s
    if value <= 0:
        return failed(f"observability.log_stats_interval_s={value:g}")
    return passed(f"observability.log_stats_interval_s={value:g}")
