"""The tenants file: who may call, with which keys and limits.

A YAML file, written by ``gemel keys`` and read by ``gemel serve --tenants PATH`` (or
``gateway.tenants_file`` in gemel.yaml)::

    version: 1
    tenants:
      acme:
        priority: P1               # P0 critical | P1 standard | P2 batch
        rpm: 600                   # requests per minute (null: unlimited)
        tpm: 200000                # tokens per minute, prompt + output (null: unlimited)
        max_concurrent: 32         # requests in flight at once (null: unlimited)
        engine:                    # quotas inside the engine
          max_kv_blocks_share: 0.5 # at most this share of the KV blocks
          max_running_seqs: 16     # at most this many sequences running at once
        require_signature: false   # true: every request must carry a valid X-LLM-Signature
        admin: false               # true: its keys may change routes (/admin/routes, gemel route)
        api_keys:
          - id: 3f9a2b1c04d5       # the public key id inside the key (gml_<id>_<secret>)
            hash: scrypt$16384$8$1$<salt>$<digest>
            created: '2025-01-01T00:00:00Z'
        ed25519_keys:
          - id: acme-1a2b3c4d      # the `iss` of signed requests
            public_key: <base64url of the 32-byte raw public key>
            created: '2025-01-01T00:00:00Z'

API keys are never stored: a key is ``gml_<key id>_<secret>``; the file keeps the key id (so a
lookup is one dict access, not a scan of every hash) and a salted scrypt hash of the whole key,
checked with ``hmac.compare_digest``. The file is written atomically (temporary file +
``os.replace``) with mode 0600, under an advisory lock so two ``gemel keys`` runs cannot
lose each other's changes.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger("gemel.gateway")

PriorityClass = Literal["P0", "P1", "P2"]
PRIORITY_CLASSES: tuple[PriorityClass, ...] = ("P0", "P1", "P2")
PRIORITY_OF: dict[str, int] = {"P0": 0, "P1": 1, "P2": 2}  # -> SamplingParams.priority (engine scheduling)

KEY_PREFIX = "gml"
TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_KEY_ID = re.compile(r"^[0-9a-f]{12}$")

# scrypt: 16 MiB and ~50 ms per hash. Keys carry 256 random bits, so the cost guards the file
# against offline guessing rather than weak secrets; verified keys are cached in memory.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1


class ApiKeyRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="key id: the public part of the key (gml_<id>_<secret>)")
    hash: str = Field(description="scrypt$N$r$p$<salt b64>$<digest b64> of the whole key")
    created: str | None = None
    name: str | None = None


class SigningKeyRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="key id, the `iss` of signed requests")
    public_key: str = Field(description="Ed25519 public key: base64url of the 32 raw bytes")
    created: str | None = None
    name: str | None = None


class EngineQuotaSpec(BaseModel):
    """A tenant's share of the engine, enforced by the engine's scheduler."""

    model_config = ConfigDict(extra="forbid")

    max_kv_blocks_share: float | None = Field(None, gt=0, le=1, description="most of the KV blocks, as a share")
    max_running_seqs: int | None = Field(None, ge=1, description="most sequences running at once")

    @property
    def empty(self) -> bool:
        return self.max_kv_blocks_share is None and self.max_running_seqs is None


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field("", exclude=True, description="the tenant id (the key of the tenants mapping)")
    priority: PriorityClass = "P1"
    rpm: int | None = Field(None, ge=1, description="requests per minute")
    tpm: int | None = Field(None, ge=1, description="tokens per minute (prompt + output)")
    max_concurrent: int | None = Field(None, ge=1, description="requests in flight at once")
    engine: EngineQuotaSpec = Field(default_factory=EngineQuotaSpec)
    require_signature: bool = False
    admin: bool = Field(False, description="may read and change routes at run time (/admin/routes)")
    api_keys: list[ApiKeyRecord] = Field(default_factory=list)
    ed25519_keys: list[SigningKeyRecord] = Field(default_factory=list)

    @property
    def priority_value(self) -> int:
        return PRIORITY_OF[self.priority]


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = 1
    tenants: dict[str, Tenant] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> TenantsFile:
        api_ids: set[str] = set()
        signing_ids: set[str] = set()
        for tid, tenant in self.tenants.items():
            if not TENANT_ID.match(tid):
                raise ValueError(f"tenant id {tid!r}: use 1-64 letters, digits, '_', '.', '-'")
            tenant.id = tid
            for k in tenant.api_keys:
                if k.id in api_ids:
                    raise ValueError(f"API key id {k.id!r} appears twice")
                api_ids.add(k.id)
            for k in tenant.ed25519_keys:
                if k.id in signing_ids:
                    raise ValueError(f"Ed25519 key id {k.id!r} appears twice")
                signing_ids.add(k.id)
        return self

    def tenant(self, tenant_id: str, create: bool = False) -> Tenant:
        if tenant_id not in self.tenants:
            if not create:
                raise KeyError(tenant_id)
            if not TENANT_ID.match(tenant_id):
                raise ValueError(f"tenant id {tenant_id!r}: use 1-64 letters, digits, '_', '.', '-'")
            self.tenants[tenant_id] = Tenant(id=tenant_id)
        return self.tenants[tenant_id]

    def api_key_ids(self) -> set[str]:
        return {k.id for t in self.tenants.values() for k in t.api_keys}

    def signing_key_ids(self) -> set[str]:
        return {k.id for t in self.tenants.values() for k in t.ed25519_keys}

    def to_yaml(self) -> str:
        import yaml

        data = self.model_dump(mode="json", exclude_none=True)
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


# -- API keys ------------------------------------------------------------------------------
def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_api_key(taken: set[str] = frozenset()) -> tuple[str, str]:
    """A fresh key ``gml_<key id>_<secret>`` and its key id (unique among ``taken``)."""
    while True:
        key_id = secrets.token_hex(6)
        if key_id not in taken:
            break
    return f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}", key_id


def key_id_of(api_key: str) -> str | None:
    """The key id inside a gemel key, or None when the string is not shaped like one."""
    parts = api_key.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not _KEY_ID.match(parts[1]) or len(parts[2]) < 16:
        return None
    return parts[1]


def hash_api_key(api_key: str, n: int = SCRYPT_N, r: int = SCRYPT_R, p: int = SCRYPT_P) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(api_key.encode(), salt=salt, n=n, r=r, p=p, maxmem=128 * r * n * p * 2, dklen=32)
    return f"scrypt${n}${r}${p}${_b64(salt)}${_b64(digest)}"


def verify_api_key(api_key: str, stored: str) -> bool:
    """Whether ``api_key`` matches a stored hash (constant-time comparison of the digests)."""
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        n_, r_, p_ = int(n), int(r), int(p)
        expected = _unb64(digest)
        got = hashlib.scrypt(
            api_key.encode(), salt=_unb64(salt), n=n_, r=r_, p=p_, maxmem=128 * r_ * n_ * p_ * 2, dklen=len(expected)
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, expected)


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def add_api_key(tf: TenantsFile, tenant_id: str, name: str | None = None) -> str:
    """Register a new key for ``tenant_id`` (created if needed); returns the plaintext key,
    which exists nowhere else afterwards."""
    tenant = tf.tenant(tenant_id, create=True)
    api_key, key_id = new_api_key(tf.api_key_ids())
    tenant.api_keys.append(ApiKeyRecord(id=key_id, hash=hash_api_key(api_key), created=now_iso(), name=name))
    return api_key


# -- Ed25519 keys ----------------------------------------------------------------------------
def public_key_text(public_key) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _b64(raw)


def load_public_key(text: str):
    """An Ed25519 public key from the file's text: base64url raw bytes, or PEM."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_public_key(text.encode())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("not an Ed25519 public key")
        return key
    raw = _unb64(text)
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return Ed25519PublicKey.from_public_bytes(raw)


def add_signing_key(tf: TenantsFile, tenant_id: str, public_key, name: str | None = None) -> str:
    """Register an Ed25519 public key for ``tenant_id`` (created if needed); returns its key id."""
    tenant = tf.tenant(tenant_id, create=True)
    taken = tf.signing_key_ids()
    while True:
        key_id = f"{tenant_id}-{secrets.token_hex(4)}"
        if key_id not in taken:
            break
    tenant.ed25519_keys.append(SigningKeyRecord(id=key_id, public_key=public_key_text(public_key), created=now_iso(), name=name))
    return key_id


# -- the file --------------------------------------------------------------------------------
def load_tenants(path: str | os.PathLike, missing_ok: bool = False) -> TenantsFile:
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        if missing_ok:
            return TenantsFile()
        raise
    try:
        mode = p.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("tenants file %s is readable by other users (mode %o); chmod 600 it", p, mode & 0o777)
    except OSError:
        pass
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping at the top level")
    return TenantsFile.model_validate(data)


def save_tenants(path: str | os.PathLike, tf: TenantsFile) -> None:
    """Write atomically with mode 0600: readers see the old file or the new one, never half."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(tf.to_yaml())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


@contextlib.contextmanager
def locked(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive advisory lock for a read-modify-write of the tenants file."""
    import fcntl

    lock_path = Path(f"{path}.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def editing(path: str | os.PathLike) -> Iterator[TenantsFile]:
    """Load (or start) the tenants file, let the caller change it, save it, under the lock."""
    with locked(path):
        tf = load_tenants(path, missing_ok=True)
        yield tf
        save_tenants(path, tf)
