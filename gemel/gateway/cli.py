"""``gemel keys``: tenants, API keys and signing keys in a tenants file.

    gemel keys create  --tenants PATH --tenant T [--priority P0|P1|P2] [--rpm N] [--tpm N]
    gemel keys ed25519 --tenants PATH --tenant T --out KEYFILE
    gemel keys set     --tenants PATH --tenant T [limits...]
    gemel keys list    --tenants PATH
    gemel keys revoke  --tenants PATH --key-id ID

``create`` creates the tenant if needed (applying any limits given) and prints one new API key
on stdout - the only place it ever appears; the file keeps its salted hash. ``ed25519`` writes
a new private key (PEM, mode 0600) to KEYFILE, registers the public key and prints the key id
to use as ``iss``. Everything else goes to stderr, so ``KEY=$(gemel keys create ...)`` works.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

UNLIMITED = "none"


def _limit(text: str):
    if text.strip().lower() in ("none", "unlimited", "0"):
        return UNLIMITED
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def _share(text: str):
    if text.strip().lower() in ("none", "unlimited"):
        return UNLIMITED
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] or 'none', got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError("must be in (0, 1]")
    return value


def _yes_no(text: str) -> bool:
    t = text.strip().lower()
    if t in ("yes", "true", "1", "on"):
        return True
    if t in ("no", "false", "0", "off"):
        return False
    raise argparse.ArgumentTypeError("expected yes or no")


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--priority", choices=["P0", "P1", "P2"], help="priority class: P0 critical, P1 standard, P2 batch")
    p.add_argument("--rpm", type=_limit, help="requests per minute ('none' or 0: unlimited)")
    p.add_argument("--tpm", type=_limit, help="tokens per minute, prompt + output ('none' or 0: unlimited)")
    p.add_argument("--max-concurrent", type=_limit, help="requests in flight at once ('none': unlimited)")
    p.add_argument("--kv-share", type=_share, help="engine quota: most of the KV blocks, a share in (0, 1]")
    p.add_argument("--max-running-seqs", type=_limit, help="engine quota: most sequences running at once")
    p.add_argument("--require-signature", type=_yes_no, metavar="yes|no", help="refuse requests without X-LLM-Signature")
    p.add_argument("--admin", type=_yes_no, metavar="yes|no", help="its keys may change routes (/admin/routes, gemel route)")


def _apply_limits(tenant, args: argparse.Namespace) -> list[str]:
    changed = []

    def put(obj, attr: str, value, label: str) -> None:
        if value is None:
            return
        setattr(obj, attr, None if value == UNLIMITED else value)
        changed.append(f"{label}={'unlimited' if value == UNLIMITED else value}")

    if args.priority:
        tenant.priority = args.priority
        changed.append(f"priority={args.priority}")
    put(tenant, "rpm", args.rpm, "rpm")
    put(tenant, "tpm", args.tpm, "tpm")
    put(tenant, "max_concurrent", args.max_concurrent, "max_concurrent")
    put(tenant.engine, "max_kv_blocks_share", args.kv_share, "kv_share")
    put(tenant.engine, "max_running_seqs", args.max_running_seqs, "max_running_seqs")
    if args.require_signature is not None:
        tenant.require_signature = args.require_signature
        changed.append(f"require_signature={'yes' if args.require_signature else 'no'}")
    if getattr(args, "admin", None) is not None:
        tenant.admin = args.admin
        changed.append(f"admin={'yes' if args.admin else 'no'}")
    return changed


def _err(msg: str) -> None:
    print(f"gemel keys: {msg}", file=sys.stderr)


def cmd_create(args: argparse.Namespace) -> int:
    from gemel.gateway.tenants import add_api_key, editing

    try:
        with editing(args.tenants) as tf:
            new = args.tenant not in tf.tenants
            tenant = tf.tenant(args.tenant, create=True)
            changed = _apply_limits(tenant, args)
            api_key = add_api_key(tf, args.tenant, name=args.name)
    except (OSError, ValueError) as e:
        _err(str(e))
        return 1
    what = "created tenant" if new else "tenant"
    extra = f" ({', '.join(changed)})" if changed else ""
    _err(f"{what} {args.tenant}{extra}: new API key {api_key.split('_')[1]} saved (hashed) in {args.tenants}; "
         "the key below is shown only once")
    print(api_key)
    return 0


def cmd_ed25519(args: argparse.Namespace) -> int:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gemel.gateway.tenants import add_signing_key, editing

    private_key = Ed25519PrivateKey.generate()
    pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if args.force else os.O_EXCL)
    try:
        fd = os.open(args.out, flags, 0o600)
    except FileExistsError:
        _err(f"{args.out} exists; pass --force to overwrite it")
        return 1
    except OSError as e:
        _err(f"cannot write {args.out}: {e}")
        return 1
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, pem)
    finally:
        os.close(fd)
    try:
        with editing(args.tenants) as tf:
            new = args.tenant not in tf.tenants
            tenant = tf.tenant(args.tenant, create=True)
            changed = _apply_limits(tenant, args)
            key_id = add_signing_key(tf, args.tenant, private_key.public_key(), name=args.name)
    except (OSError, ValueError) as e:
        with contextlib.suppress(OSError):
            os.unlink(args.out)
        _err(str(e))
        return 1
    what = "created tenant" if new else "tenant"
    extra = f" ({', '.join(changed)})" if changed else ""
    _err(f"{what} {args.tenant}{extra}: Ed25519 private key written to {args.out} (mode 600), public key "
         f"registered in {args.tenants}; sign requests with iss = the key id below")
    print(key_id)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    from gemel.gateway.tenants import editing

    try:
        with editing(args.tenants) as tf:
            new = args.tenant not in tf.tenants
            changed = _apply_limits(tf.tenant(args.tenant, create=True), args)
    except (OSError, ValueError) as e:
        _err(str(e))
        return 1
    _err(f"{'created tenant' if new else 'tenant'} {args.tenant}: {', '.join(changed) or 'nothing changed'}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from gemel.gateway.tenants import load_tenants

    try:
        tf = load_tenants(args.tenants)
    except (OSError, ValueError) as e:
        _err(str(e))
        return 1
    for t in tf.tenants.values():
        quota = []
        if t.engine.max_kv_blocks_share is not None:
            quota.append(f"kv_share={t.engine.max_kv_blocks_share:g}")
        if t.engine.max_running_seqs is not None:
            quota.append(f"max_running_seqs={t.engine.max_running_seqs}")
        print(
            f"{t.id}\t{t.priority}\trpm={t.rpm or '-'}\ttpm={t.tpm or '-'}\tmax_concurrent={t.max_concurrent or '-'}"
            f"\t{' '.join(quota) or '-'}\t{'signature required' if t.require_signature else '-'}"
            + ("\tadmin" if t.admin else "")
        )
        for k in t.api_keys:
            print(f"  api_key\t{k.id}\t{k.created or ''}\t{k.name or ''}")
        for k in t.ed25519_keys:
            print(f"  ed25519\t{k.id}\t{k.created or ''}\t{k.name or ''}")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from gemel.gateway.tenants import editing

    found = None
    try:
        with editing(args.tenants) as tf:
            for t in tf.tenants.values():
                for keys in (t.api_keys, t.ed25519_keys):
                    for k in list(keys):
                        if k.id == args.key_id:
                            keys.remove(k)
                            found = t.id
    except (OSError, ValueError) as e:
        _err(str(e))
        return 1
    if found is None:
        _err(f"no key {args.key_id!r} in {args.tenants}")
        return 1
    _err(f"revoked key {args.key_id} of tenant {found}")
    return 0


def add_keys_arguments(subparsers) -> argparse.ArgumentParser:
    """Add ``keys`` (and its subcommands) to the ``gemel`` command's subparsers."""
    keys = subparsers.add_parser("keys", help="manage tenants, API keys and request-signing keys")
    sub = keys.add_subparsers(dest="keys_command", required=True)

    def common(p: argparse.ArgumentParser, tenant: bool = True) -> None:
        p.add_argument("--tenants", required=True, metavar="PATH", help="the tenants file (created if missing)")
        if tenant:
            p.add_argument("--tenant", required=True, help="tenant id (created if needed)")

    p = sub.add_parser("create", help="create an API key (and the tenant if needed); prints the key once")
    common(p)
    _add_limit_arguments(p)
    p.add_argument("--name", help="a label for the key")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("ed25519", help="generate an Ed25519 signing key, register its public key; prints the key id")
    common(p)
    p.add_argument("--out", required=True, metavar="KEYFILE", help="where to write the private key (PEM, mode 600)")
    p.add_argument("--force", action="store_true", help="overwrite KEYFILE")
    p.add_argument("--name", help="a label for the key")
    _add_limit_arguments(p)
    p.set_defaults(func=cmd_ed25519)

    p = sub.add_parser("set", help="create a tenant or change its class, limits and engine quotas")
    common(p)
    _add_limit_arguments(p)
    p.set_defaults(func=cmd_set)

    p = sub.add_parser("list", help="list tenants and key ids (never keys)")
    common(p, tenant=False)
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("revoke", help="remove an API key or signing key by its id")
    common(p, tenant=False)
    p.add_argument("--key-id", required=True)
    p.set_defaults(func=cmd_revoke)
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gemel")
    add_keys_arguments(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["keys", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
