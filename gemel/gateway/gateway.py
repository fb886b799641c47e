"""The gateway's decisions, independent of HTTP: who is calling, and may they come in.

``Gateway.authenticate(Credentials)`` turns what a caller presented (an API key and where it
came from, an ``X-LLM-Signature`` with the body it signs, the peer address) into a
``Principal`` or raises ``AuthError``. The REST middleware builds ``Credentials`` from headers
and the query string; the gRPC surface can call ``authenticate_metadata`` with its call
metadata and the serialized request.

``Gateway.admit(principal)`` applies the tenant's concurrency cap and requests/min bucket and
returns an ``Admission`` (released with ``release``), which the handlers use through the
principal for the class queue bound and the tokens/min reservation (``admit_generation``,
``meter``). Refusals raise ``Refusal`` (429 or 503, with a retry delay). Every refusal is
counted in ``Gateway.counters`` (see ``gemel.gateway.counters``).

All of it runs on the server's event loop; the in-process state needs no locks.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from gemel.engine.protocol import TenantQuota
from gemel.gateway.counters import GatewayCounters
from gemel.gateway.principal import ANONYMOUS, Principal
from gemel.gateway.ratelimit import InProcessRateLimiter, RateLimiter
from gemel.gateway.signing import SIGNATURE_HEADER, SignatureError, SignatureVerifier, SigningKey
from gemel.gateway.tenants import PRIORITY_CLASSES, Tenant, TenantsFile, key_id_of, load_public_key, load_tenants, verify_api_key

if TYPE_CHECKING:
    from gemel.config import GatewayConfig
    from gemel.engine.output_processor import RequestOutput

log = logging.getLogger("gemel.gateway")

KeySource = Literal["header", "query", "bearer"]


class AuthError(Exception):
    """The caller is not let in: ``reason`` names the case (counters, status), ``message`` says why."""

    def __init__(self, reason: str, message: str, tenant: str | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.tenant = tenant


class Refusal(Exception):
    """A known caller turned away for now: 429 (its own limits) or 503 (its class queue is full)."""

    def __init__(self, status: int, message: str, retry_after_s: float, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.code = code

    def to_api_error(self):
        from gemel.api.errors import APIError

        return APIError(self.status, self.message, code=self.code, retry_after_s=self.retry_after_s)


@dataclass
class Credentials:
    api_key: str | None = None
    source: KeySource | None = None  # how the key came: x-goog-api-key, ?key=, Authorization: Bearer
    signature: str | None = None  # the X-LLM-Signature value
    body: bytes = b""  # the exact request body (what body_sha256 covers)
    client_host: str | None = None


def credentials_from(headers, query_key: str | None = None, body: bytes = b"", client_host: str | None = None) -> Credentials:
    """Credentials from HTTP headers / gRPC metadata (any mapping with lower-case ``get``)."""
    creds = Credentials(signature=headers.get(SIGNATURE_HEADER), body=body, client_host=client_host)
    key = headers.get("x-goog-api-key")
    if key:
        creds.api_key, creds.source = key.strip(), "header"
    elif query_key:
        creds.api_key, creds.source = query_key.strip(), "query"
    else:
        auth = headers.get("authorization") or ""
        if auth[:7].lower() == "bearer " and auth[7:].strip():
            creds.api_key, creds.source = auth[7:].strip(), "bearer"
    return creds


def is_loopback_host(host: str | None) -> bool:
    """Whether a client address is loopback; names that are not IP addresses (a unix socket,
    Starlette's test client) count as local."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return True


def binds_loopback_only(host: str) -> bool:
    """Whether listening on ``host`` accepts only local connections."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    import socket

    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


# -- the tenants, indexed --------------------------------------------------------------------
class TenantIndex:
    """One loaded tenants file, indexed by API key id and signing key id."""

    def __init__(self, tf: TenantsFile):
        self.tenants: dict[str, Tenant] = dict(tf.tenants)
        self.api_keys = {k.id: (t, k) for t in tf.tenants.values() for k in t.api_keys}
        self.signing: dict[str, SigningKey] = {}
        for t in tf.tenants.values():
            for k in t.ed25519_keys:
                try:
                    self.signing[k.id] = SigningKey(t.id, k.id, load_public_key(k.public_key))
                except ValueError as e:
                    log.error("tenant %s: Ed25519 key %s is unusable: %s", t.id, k.id, e)
        self.quotas: dict[str, TenantQuota | None] = {
            t.id: None if t.engine.empty else TenantQuota(t.engine.max_running_seqs, t.engine.max_kv_blocks_share)
            for t in tf.tenants.values()
        }


class TenantStore:
    """The tenants file, re-read when it changes (checked at most every ``interval_s``), so
    keys created with ``gemel keys`` work without a restart."""

    def __init__(self, path: str | os.PathLike, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.interval_s = interval_s
        self.clock = clock
        self._stamp = self._file_stamp()
        self.index = TenantIndex(load_tenants(self.path))  # a broken file at start-up is fatal
        self._checked = clock()
        self.generation = 0  # bumped at every reload (caches key on it)

    def _file_stamp(self):
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def current(self) -> TenantIndex:
        now = self.clock()
        if now - self._checked >= self.interval_s:
            self._checked = now
            stamp = self._file_stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self.index = TenantIndex(load_tenants(self.path))
                    self.generation += 1
                    log.info("tenants file %s reloaded: %d tenants", self.path, len(self.index.tenants))
                except (OSError, ValueError) as e:
                    log.error("tenants file %s not reloaded (keeping the previous one): %s", self.path, e)
        return self.index


# -- admission ---------------------------------------------------------------------------------
@dataclass
class Admission:
    """One request's hold on the gateway, from admission to the end of its response."""

    gateway: Gateway
    principal: Principal
    tenant: Tenant | None
    queued_class: str | None = None  # set while the request waits for its first token
    reserved_tokens: float = 0.0
    prompt_tokens: int = 0
    generated: dict[int, int] = field(default_factory=dict)
    released: bool = False

    async def admit_generation(self, prompt_tokens: int, max_new_tokens: int, overflow: bool = False) -> None:
        """``overflow``: past a full class queue (a route's fallback, which waits on another engine)."""
        gw, tenant_id, cls = self.gateway, self.principal.tenant, self.principal.priority_class
        limit = gw.queue_limits[cls]
        if gw.queued[cls] >= limit and not overflow:
            gw.counters.admission_rejected(tenant_id, "queue_full")
            raise Refusal(
                503,
                f"The server is overloaded: the {cls} queue is full ({limit} requests waiting); retry shortly",
                gw.queue_retry_after_s,
            )
        tpm = self.tenant.tpm if self.tenant is not None else None
        if tpm is not None:
            want = prompt_tokens + max_new_tokens
            d = await gw.limiter.acquire(f"{tenant_id}:tokens", want, tpm)
            if not d.allowed:
                gw.counters.rate_limited(tenant_id, "tokens")
                raise Refusal(
                    429,
                    f"Quota exceeded: tenant {tenant_id} is limited to {tpm} tokens per minute and this request "
                    f"reserves {min(want, tpm)} (prompt {prompt_tokens} + maximum output {max_new_tokens}); "
                    f"retry in {d.retry_after_s:g} s or ask for fewer output tokens",
                    d.retry_after_s,
                    "rate_limit_exceeded",
                )
            self.reserved_tokens += d.charged
        self.prompt_tokens += prompt_tokens
        gw.queued[cls] += 1
        self.queued_class = cls

    def started(self) -> None:
        if self.queued_class is not None:
            self.gateway.queued[self.queued_class] -= 1
            self.queued_class = None

    async def meter(self, stream: AsyncIterator[RequestOutput], index: int = 0) -> AsyncIterator[RequestOutput]:
        try:
            async for out in stream:
                self.started()
                self.generated[index] = sum(len(c.token_ids) for c in out.outputs)
                yield out
        finally:
            await stream.aclose()

    @property
    def used_tokens(self) -> int:
        return self.prompt_tokens + sum(self.generated.values())


def make_limiter(config: GatewayConfig) -> RateLimiter:
    """Buckets shared through Redis when ``redis_url`` is set (several front ends, replicas),
    else in this process."""
    if config.redis_url:
        from gemel.gateway.redis_ratelimit import RedisRateLimiter

        return RedisRateLimiter(config.redis_url, on_unavailable=config.redis_unavailable)
    return InProcessRateLimiter()


class Gateway:
    """Authentication and admission for one server; ``tenants_file=None`` is the anonymous mode."""

    def __init__(
        self,
        config: GatewayConfig | None = None,
        limiter: RateLimiter | None = None,
        clock: Callable[[], float] = time.time,
    ):
        from gemel.config import GatewayConfig

        self.config = config or GatewayConfig()
        self.counters = GatewayCounters()
        self.limiter: RateLimiter = limiter or make_limiter(self.config)
        self.store = TenantStore(self.config.tenants_file, self.config.reload_interval_s) if self.config.tenants_file else None
        self.verifier = SignatureVerifier(self._signing_key, clock)
        self.queue_limits: dict[str, int] = {c: getattr(self.config.queue_limits, c) for c in PRIORITY_CLASSES}
        self.queue_retry_after_s = self.config.queue_retry_after_s
        self.queued: dict[str, int] = dict.fromkeys(PRIORITY_CLASSES, 0)  # waiting for a first token
        self.in_flight: dict[str, int] = {}  # per tenant
        self._public = tuple(self.config.public_paths)
        # Verified keys, by HMAC of the presented key under a per-process secret (the plaintext
        # key is not kept), and recently refused ones, so neither pays for scrypt again.
        self._cache_secret = secrets.token_bytes(32)
        self._good: OrderedDict[bytes, str] = OrderedDict()
        self._bad: OrderedDict[bytes, None] = OrderedDict()
        self._cache_generation = 0
        self._cache_size = 4096

    @property
    def auth_enabled(self) -> bool:
        return self.store is not None

    def is_public(self, path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self._public)

    def _index(self) -> TenantIndex | None:
        if self.store is None:
            return None
        index = self.store.current()
        if self.store.generation != self._cache_generation:
            self._cache_generation = self.store.generation
            self._good.clear()
            self._bad.clear()
        return index

    def _signing_key(self, key_id: str) -> SigningKey | None:
        index = self._index()
        return index.signing.get(key_id) if index is not None else None

    # -- authentication ----------------------------------------------------------------------
    def authenticate(self, creds: Credentials) -> Principal:
        index = self._index()
        if index is None:
            if not self.config.insecure and not is_loopback_host(creds.client_host):
                self.counters.auth_failure(ANONYMOUS, "not_loopback")
                raise AuthError("not_loopback", "gemel serves unauthenticated callers on loopback only; configure tenants")
            return Principal()
        if creds.signature is not None:
            try:
                key = self.verifier.verify(creds.signature, creds.body)
            except SignatureError as e:
                self.counters.auth_failure(e.tenant, e.reason)
                raise AuthError(e.reason, e.message, e.tenant) from None
            tenant = index.tenants.get(key.tenant)
            if tenant is None:  # removed by a reload since the lookup
                self.counters.auth_failure(None, "signature_unknown_key")
                raise AuthError("signature_unknown_key", "X-LLM-Signature: the signing key's tenant no longer exists")
            return self._principal(index, tenant, "signature", key.key_id)
        if not creds.api_key:
            self.counters.auth_failure(None, "missing_key")
            raise AuthError(
                "missing_key",
                "Method doesn't allow unregistered callers (callers without established identity). Please use "
                "an API key (x-goog-api-key, ?key= or Authorization: Bearer) or a signed request (X-LLM-Signature).",
            )
        tenant, key_id = self._check_key(index, creds.api_key)
        if tenant.require_signature:
            self.counters.auth_failure(tenant.id, "signature_required")
            raise AuthError(
                "signature_required",
                f"Tenant {tenant.id} requires signed requests: send an X-LLM-Signature header",
                tenant.id,
            )
        return self._principal(index, tenant, "api_key", key_id)

    def _check_key(self, index: TenantIndex, api_key: str) -> tuple[Tenant, str]:
        digest = hmac.new(self._cache_secret, api_key.encode("utf-8", "surrogateescape"), hashlib.sha256).digest()
        key_id = self._good.get(digest)
        if key_id is not None and key_id in index.api_keys:
            self._good.move_to_end(digest)
            return index.api_keys[key_id][0], key_id
        key_id = key_id_of(api_key)
        entry = index.api_keys.get(key_id) if key_id else None
        if entry is None or digest in self._bad or not verify_api_key(api_key, entry[1].hash):
            tenant_id = entry[0].id if entry is not None else None
            if entry is not None:
                self._remember(self._bad, digest, None)
            self.counters.auth_failure(tenant_id, "invalid_key")
            raise AuthError("invalid_key", "API key not valid. Please pass a valid API key.", tenant_id)
        self._remember(self._good, digest, key_id)
        return entry[0], key_id

    def _remember(self, cache: OrderedDict, digest: bytes, value) -> None:
        cache[digest] = value
        cache.move_to_end(digest)
        while len(cache) > self._cache_size:
            cache.popitem(last=False)

    def _principal(self, index: TenantIndex, tenant: Tenant, via: str, key_id: str) -> Principal:
        return Principal(
            tenant=tenant.id,
            priority_class=tenant.priority,
            priority=tenant.priority_value,
            quota=index.quotas.get(tenant.id),
            via=via,  # type: ignore[arg-type]
            key_id=key_id,
        )

    def authenticate_metadata(
        self, metadata: Iterable[tuple[str, str | bytes]], body: bytes = b"", peer: str | None = None
    ) -> Principal:
        """For the gRPC surface: ``metadata`` as ``context.invocation_metadata()`` gives it,
        ``body`` the serialized request message (what a signature's body_sha256 covers)."""
        headers: dict[str, str] = {}
        for k, v in metadata:
            if isinstance(v, bytes):
                continue
            headers.setdefault(k.lower(), v)
        return self.authenticate(credentials_from(headers, body=body, client_host=peer))

    def tenant_of(self, principal: Principal) -> Tenant | None:
        index = self._index()
        return index.tenants.get(principal.tenant) if index is not None else None

    # -- admission ---------------------------------------------------------------------------
    async def admit(self, principal: Principal) -> Admission:
        """The tenant's concurrency cap and requests/min bucket; the admission must be released."""
        tenant = self.tenant_of(principal)
        tid = principal.tenant
        if tenant is not None:
            if tenant.max_concurrent is not None and self.in_flight.get(tid, 0) >= tenant.max_concurrent:
                self.counters.rate_limited(tid, "concurrent")
                raise Refusal(
                    429,
                    f"Quota exceeded: tenant {tid} may have {tenant.max_concurrent} requests in flight at once",
                    1.0,
                    "rate_limit_exceeded",
                )
            if tenant.rpm is not None:
                d = await self.limiter.acquire(f"{tid}:requests", 1, tenant.rpm)
                if not d.allowed:
                    self.counters.rate_limited(tid, "requests")
                    raise Refusal(
                        429,
                        f"Quota exceeded: tenant {tid} is limited to {tenant.rpm} requests per minute; "
                        f"retry in {d.retry_after_s:g} s",
                        d.retry_after_s,
                        "rate_limit_exceeded",
                    )
        self.in_flight[tid] = self.in_flight.get(tid, 0) + 1
        admission = Admission(self, principal, tenant)
        principal.admission = admission
        return admission

    async def release(self, admission: Admission) -> None:
        if admission.released:
            return
        admission.released = True
        admission.started()
        tid = admission.principal.tenant
        n = self.in_flight.get(tid, 0) - 1
        if n > 0:
            self.in_flight[tid] = n
        else:
            self.in_flight.pop(tid, None)
        tenant = admission.tenant
        if admission.reserved_tokens and tenant is not None and tenant.tpm is not None:
            await self.limiter.adjust(f"{tid}:tokens", admission.used_tokens - admission.reserved_tokens, tenant.tpm)

    def snapshot(self) -> dict:
        """Live state for operators and tests: queues per class, requests in flight per tenant."""
        return {
            "auth": "tenants" if self.auth_enabled else "anonymous",
            "queued": dict(self.queued),
            "queue_limits": dict(self.queue_limits),
            "in_flight": dict(self.in_flight),
            "counters": self.counters.as_dict(),
        }
