"""Tenants file, API key hashing and the `gemel keys` command."""

from __future__ import annotations

import stat

import pytest
import yaml

from gemel.gateway import cli as keys_cli
from gemel.gateway.tenants import (
    TenantsFile,
    add_api_key,
    add_signing_key,
    hash_api_key,
    key_id_of,
    load_public_key,
    load_tenants,
    new_api_key,
    save_tenants,
    verify_api_key,
)


def test_key_shape_and_hash():
    key, key_id = new_api_key()
    assert key.startswith(f"gml_{key_id}_") and key_id_of(key) == key_id
    stored = hash_api_key(key)
    assert key not in stored and key.split("_", 2)[2] not in stored
    assert stored.startswith("scrypt$")
    assert verify_api_key(key, stored)
    assert not verify_api_key(key + "x", stored)
    assert not verify_api_key(key, "scrypt$garbage")
    assert not verify_api_key(key, "md5$x$y$z$a$b")
    # two hashes of one key differ (salted)
    assert hash_api_key(key) != stored


@pytest.mark.parametrize("text", ["", "gml", "gml_abc_defghijklmnopqrstuvwxyz", "sk-123", "gml_0123456789ab_short", "xyz_0123456789ab_" + "a" * 40])
def test_key_id_of_rejects_other_shapes(text):
    assert key_id_of(text) is None


def test_save_load_roundtrip_mode_0600_and_no_plaintext(tmp_path):
    path = tmp_path / "sub" / "tenants.yaml"
    tf = TenantsFile()
    key = add_api_key(tf, "acme")
    tf.tenants["acme"].priority = "P0"
    tf.tenants["acme"].engine.max_running_seqs = 4
    save_tenants(path, tf)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert key not in text and key.split("_", 2)[2] not in text
    back = load_tenants(path)
    t = back.tenants["acme"]
    assert t.id == "acme" and t.priority == "P0" and t.priority_value == 0 and t.engine.max_running_seqs == 4
    assert verify_api_key(key, t.api_keys[0].hash)
    assert "id: acme" not in text  # the tenant id is the mapping key, not repeated
    assert not list(path.parent.glob(".*.tmp"))  # the temporary file was renamed away


def test_validation(tmp_path):
    with pytest.raises(ValueError, match="tenant id"):
        TenantsFile.model_validate({"tenants": {"bad id!": {}}})
    dup = {"id": "0123456789ab", "hash": "scrypt$1$1$1$a$b"}
    with pytest.raises(ValueError, match="appears twice"):
        TenantsFile.model_validate({"tenants": {"a": {"api_keys": [dup]}, "b": {"api_keys": [dup]}}})
    with pytest.raises(ValueError):
        TenantsFile.model_validate({"tenants": {"a": {"priority": "P3"}}})
    with pytest.raises(ValueError):
        TenantsFile.model_validate({"tenants": {"a": {"engine": {"max_kv_blocks_share": 1.5}}}})
    with pytest.raises(ValueError):
        TenantsFile.model_validate({"tenants": {"a": {"rpm_typo": 3}}})
    assert load_tenants(tmp_path / "missing.yaml", missing_ok=True).tenants == {}


def test_signing_key_registration():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    tf = TenantsFile()
    priv = Ed25519PrivateKey.generate()
    kid = add_signing_key(tf, "acme", priv.public_key())
    assert kid.startswith("acme-")
    pub = load_public_key(tf.tenants["acme"].ed25519_keys[0].public_key)
    sig = priv.sign(b"x")
    pub.verify(sig, b"x")


def test_cli_create_prints_only_the_key(tmp_path, capsys):
    path = tmp_path / "tenants.yaml"
    assert keys_cli.main(["create", "--tenants", str(path), "--tenant", "acme", "--priority", "P2", "--rpm", "60", "--tpm", "1000"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert out == key + "\n" and key_id_of(key) is not None
    assert "acme" in err and key not in err
    data = yaml.safe_load(path.read_text())
    assert data["tenants"]["acme"]["priority"] == "P2" and data["tenants"]["acme"]["rpm"] == 60
    assert key not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # a second key for the same tenant keeps the first, and the limits unless given
    assert keys_cli.main(["create", "--tenants", str(path), "--tenant", "acme"]) == 0
    key2 = capsys.readouterr().out.strip()
    tf = load_tenants(path)
    assert key2 != key and len(tf.tenants["acme"].api_keys) == 2 and tf.tenants["acme"].rpm == 60
    # set: change limits and quotas; 'none' clears a limit
    assert keys_cli.main(["set", "--tenants", str(path), "--tenant", "acme", "--rpm", "none", "--kv-share", "0.25",
                          "--max-running-seqs", "8", "--require-signature", "yes"]) == 0
    t = load_tenants(path).tenants["acme"]
    assert t.rpm is None and t.engine.max_kv_blocks_share == 0.25 and t.engine.max_running_seqs == 8 and t.require_signature
    # revoke by key id
    kid = key_id_of(key)
    assert keys_cli.main(["revoke", "--tenants", str(path), "--key-id", kid]) == 0
    assert kid not in {k.id for k in load_tenants(path).tenants["acme"].api_keys}
    assert keys_cli.main(["revoke", "--tenants", str(path), "--key-id", kid]) == 1
    capsys.readouterr()
    assert keys_cli.main(["list", "--tenants", str(path)]) == 0
    listing = capsys.readouterr().out
    assert "acme" in listing and key2 not in listing


def test_cli_ed25519_writes_private_key_0600(tmp_path, capsys):
    from gemel.client import load_private_key

    path, pem = tmp_path / "tenants.yaml", tmp_path / "client.pem"
    assert keys_cli.main(["ed25519", "--tenants", str(path), "--tenant", "signer", "--out", str(pem)]) == 0
    kid = capsys.readouterr().out.strip()
    assert stat.S_IMODE(pem.stat().st_mode) == 0o600
    assert pem.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    priv = load_private_key(pem)
    rec = load_tenants(path).tenants["signer"].ed25519_keys[0]
    assert rec.id == kid
    load_public_key(rec.public_key).verify(priv.sign(b"m"), b"m")
    assert "PRIVATE" not in path.read_text()
    # refuses to overwrite without --force
    assert keys_cli.main(["ed25519", "--tenants", str(path), "--tenant", "signer", "--out", str(pem)]) == 1
    assert keys_cli.main(["ed25519", "--tenants", str(path), "--tenant", "signer", "--out", str(pem), "--force"]) == 0
    assert len(load_tenants(path).tenants["signer"].ed25519_keys) == 2


def test_gemel_cli_has_keys_subcommand():
    from gemel.cli import build_parser

    args = build_parser().parse_args(["keys", "create", "--tenants", "t.yaml", "--tenant", "a", "--priority", "P0"])
    assert args.func is keys_cli.cmd_create and args.priority == "P0"
    args = build_parser().parse_args(["serve", "--tenants", "t.yaml", "--insecure"])
    assert args.tenants == "t.yaml" and args.insecure
