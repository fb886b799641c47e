"""HTTPS on the REST port of a real ``gemel serve``, with a throw-away CA made here: both
SDKs trusting that CA get answers; plain HTTP and clients that do not trust the CA fail;
bad TLS settings stop ``gemel serve`` before it binds."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from google import genai
from google.genai import types

from conftest import TEST_CONFIG, Server, free_port, serve_command

from gemel.cli import main as cli_main


# -- a CA and a server certificate for 127.0.0.1 / localhost -------------------------------------
def make_pki(tmp: Path) -> dict[str, Path]:
    """A CA certificate and a server certificate (with its key) that the CA signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gemel test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": tmp / "ca.pem", "cert": tmp / "server.pem", "key": tmp / "server.key", "other_key": tmp / "other.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    for name, k in (("key", key), ("other_key", ec.generate_private_key(ec.SECP256R1()))):
        paths[name].write_bytes(
            k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        os.chmod(paths[name], 0o600)
    return paths


def launch_https(tmp: Path, server_settings: dict, ca_ctx: ssl.SSLContext, ready_timeout: float = 240) -> Server:
    """``gemel serve`` with TLS settings in its config file; ready once /readyz answers over HTTPS."""
    cfg = yaml.safe_load(TEST_CONFIG)
    cfg["server"].update(server_settings)
    cfg["embeddings"] = None
    config = tmp / "tls.yaml"
    config.write_text(yaml.safe_dump(cfg))
    port = free_port()
    log_path = tmp / "tls.log"
    proc = subprocess.Popen(
        [*serve_command(), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--no-grpc"],
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    server = Server(f"https://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gemel serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/readyz", timeout=2, verify=ca_ctx).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"gemel serve not ready after {ready_timeout}s:\n{server.log()}")


def connect_errors() -> tuple[type[Exception], ...]:
    """What a failed TLS handshake raises in google-genai: httpx's error, or httpx2's where
    google-genai runs on httpx2."""
    errors: tuple[type[Exception], ...] = (httpx.ConnectError,)
    try:
        import httpx2
    except ImportError:
        return errors
    return (*errors, httpx2.ConnectError)


@pytest.mark.slow
def test_https_with_both_sdks(tmp_path):
    pki = make_pki(tmp_path)
    trust = ssl.create_default_context(cafile=str(pki["ca"]))
    # Paths relative to the config file, as the gRPC TLS files.
    settings = {"ssl_certfile": pki["cert"].name, "ssl_keyfile": pki["key"].name, "log_level": "info"}
    srv = launch_https(tmp_path, settings, trust)
    try:
        assert "https://127.0.0.1" in srv.log_path.read_text()  # the scheme is logged at start

        gclient = genai.Client(
            api_key="x",
            http_options=types.HttpOptions(base_url=srv.url, api_version="v1beta", client_args={"verify": trust}),
        )
        r = gclient.models.generate_content(
            model="gemini-2.0-flash", contents="Say hello.", config=types.GenerateContentConfig(max_output_tokens=4, temperature=0)
        )
        assert r.text
        streamed = "".join(
            c.text or ""
            for c in gclient.models.generate_content_stream(
                model="gemini-2.0-flash", contents="Say hello.", config=types.GenerateContentConfig(max_output_tokens=4, temperature=0)
            )
        )
        assert streamed == r.text

        oclient = openai.OpenAI(
            api_key="x", base_url=f"{srv.url}/v1", http_client=httpx.Client(verify=trust), max_retries=0, timeout=120
        )
        chat = oclient.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].message.content

        # Plain HTTP to the TLS port gets no answer.
        plain = openai.OpenAI(api_key="x", base_url=srv.url.replace("https://", "http://") + "/v1", max_retries=0, timeout=10)
        with pytest.raises(openai.APIConnectionError):
            plain.models.list()

        # Clients that trust only the public CAs refuse the certificate.
        untrusting = openai.OpenAI(api_key="x", base_url=f"{srv.url}/v1", max_retries=0, timeout=10)
        with pytest.raises(openai.APIConnectionError) as err:
            untrusting.models.list()
        assert "CERTIFICATE_VERIFY_FAILED" in repr(err.value.__cause__)
        g_untrusting = genai.Client(api_key="x", http_options=types.HttpOptions(base_url=srv.url, api_version="v1beta"))
        with pytest.raises(connect_errors(), match="CERTIFICATE_VERIFY_FAILED"):
            g_untrusting.models.generate_content(model="gemini-2.0-flash", contents="Say hello.")
    finally:
        srv.stop()


# -- settings refused before binding ---------------------------------------------------------------
def serve_problem(capsys, *args: str) -> str:
    """Run ``gemel serve`` in this process; it must refuse (exit 2) before loading anything."""
    port = free_port()
    assert cli_main(["serve", "--host", "127.0.0.1", "--port", str(port), "--no-grpc", *args]) == 2
    return capsys.readouterr().err


def test_certificate_without_key_is_refused(tmp_path, capsys):
    pki = make_pki(tmp_path)
    assert "set both or neither" in serve_problem(capsys, "--ssl-certfile", str(pki["cert"]))
    assert "set both or neither" in serve_problem(capsys, "--ssl-keyfile", str(pki["key"]))


def test_unreadable_or_mismatched_files_are_refused(tmp_path, capsys):
    pki = make_pki(tmp_path)
    missing = tmp_path / "missing.pem"
    err = serve_problem(capsys, "--ssl-certfile", str(missing), "--ssl-keyfile", str(pki["key"]))
    assert f"TLS certificate file {missing} is missing or unreadable" in err
    err = serve_problem(capsys, "--ssl-certfile", str(pki["cert"]), "--ssl-keyfile", str(pki["other_key"]))
    assert "unusable" in err
    err = serve_problem(capsys, "--ssl-certfile", str(pki["key"]), "--ssl-keyfile", str(pki["key"]))  # a key is no certificate
    assert "unusable" in err


def test_tls_paths_from_the_file_are_relative_to_it_and_flags_to_the_working_directory(tmp_path, monkeypatch):
    import argparse

    from gemel.api.server import add_serve_arguments, apply_overrides, resolve_server_paths
    from gemel.config import load_config

    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "g.yaml"
    path.write_text("server:\n  ssl_certfile: certs/c.pem\n  ssl_keyfile: certs/k.pem\n")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = apply_overrides(resolve_server_paths(load_config(str(path)), str(path)), parser.parse_args([]))
    assert (config.server.ssl_certfile, config.server.ssl_keyfile) == (
        str(tmp_path / "conf/certs/c.pem"), str(tmp_path / "conf/certs/k.pem")
    )
    monkeypatch.chdir(tmp_path)
    args = parser.parse_args(["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"])
    config = apply_overrides(resolve_server_paths(load_config(str(path)), str(path)), args)
    assert (config.server.ssl_certfile, config.server.ssl_keyfile) == (str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
