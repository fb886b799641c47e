"""The Gemini gRPC surface of a real ``gemel serve``, with API keys, signatures and rate limits,
through the official ``GenerativeServiceClient`` over a gRPC channel, a reflection-only client,
grpcurl (when installed) and a TLS listener."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from google.ai.generativelanguage_v1beta import types
from google.ai.generativelanguage_v1beta.services.generative_service import GenerativeServiceClient
from google.ai.generativelanguage_v1beta.services.generative_service.transports import GenerativeServiceGrpcTransport
from google.api_core import exceptions as gexc

from conftest import free_port, start_server

pytestmark = pytest.mark.slow

MODEL = "models/gemini-2.0-flash"
EMBED_MODEL = "models/text-embedding-004"
SERVICE = "google.ai.generativelanguage.v1beta.GenerativeService"


# -- the server: tenants with keys, a tiny requests/min limit, a signing key ---------------------
@pytest.fixture(scope="module")
def grpc_env(tmp_path_factory):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gemel.gateway.tenants import TenantsFile, add_api_key, add_signing_key, save_tenants

    tmp = tmp_path_factory.mktemp("grpc")
    tf = TenantsFile()
    key = add_api_key(tf, "alice")
    tiny_key = add_api_key(tf, "tiny")
    tf.tenant("tiny").rpm = 2
    private = Ed25519PrivateKey.generate()
    signing_id = add_signing_key(tf, "signer", private.public_key())
    tenants = tmp / "tenants.yaml"
    save_tenants(tenants, tf)
    port = free_port()
    extra = f"gateway:\n  tenants_file: {tenants}\nobservability:\n  trace_memory_exporter: true\n"
    srv = start_server(tmp, name="grpc", extra_config=extra, grpc_port=port)
    env = {"server": srv, "port": port, "key": key, "tiny_key": tiny_key, "signing_id": signing_id, "private": private}
    yield env
    srv.stop()


@pytest.fixture(scope="module")
def channel(grpc_env):
    ch = grpc.insecure_channel(f"127.0.0.1:{grpc_env['port']}")
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def client(channel) -> GenerativeServiceClient:
    return GenerativeServiceClient(transport=GenerativeServiceGrpcTransport(channel=channel))


@pytest.fixture(scope="module")
def md(grpc_env) -> list[tuple[str, str]]:
    return [("x-goog-api-key", grpc_env["key"])]


def stats(grpc_env) -> dict:
    srv = grpc_env["server"]
    body = httpx.get(f"{srv.url}/internal/stats", headers={"x-goog-api-key": grpc_env["key"]}, timeout=5).json()
    return body["engines"][body["default_model"]]


def wait_kv_free(grpc_env, within: float) -> tuple[bool, dict]:
    end = time.monotonic() + within
    s = stats(grpc_env)
    while time.monotonic() < end:
        s = stats(grpc_env)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_blocks"]:
            return True, s
        time.sleep(0.05)
    return False, s


def wait_running(grpc_env, within: float) -> dict:
    end = time.monotonic() + within
    s = stats(grpc_env)
    while time.monotonic() < end:
        s = stats(grpc_env)
        if s["num_running"] >= 1 and s["num_free_blocks"] < s["num_blocks"]:
            return s
        time.sleep(0.02)
    raise AssertionError(f"the request never ran: {s}")


def request(text: str = "Say hello.", **gen) -> types.GenerateContentRequest:
    gen.setdefault("max_output_tokens", 12)
    return types.GenerateContentRequest(
        model=MODEL,
        contents=[types.Content(role="user", parts=[types.Part(text=text)])],
        generation_config=types.GenerationConfig(**gen),
    )


def text_of(resp: types.GenerateContentResponse) -> str:
    return "".join(p.text for c in resp.candidates for p in c.content.parts)


# -- generation --------------------------------------------------------------------------------
def test_generate_content(client, md):
    r = client.generate_content(request=request(temperature=0), metadata=md)
    assert text_of(r)
    cand = r.candidates[0]
    assert cand.finish_reason in (types.Candidate.FinishReason.STOP, types.Candidate.FinishReason.MAX_TOKENS)
    assert cand.content.role == "model"
    u = r.usage_metadata
    assert u.prompt_token_count > 0 and 0 < u.candidates_token_count <= 12
    assert u.total_token_count == u.prompt_token_count + u.candidates_token_count
    assert r.model_version == "smollm2-135m-instruct@1" and r.response_id


def test_logprobs_and_candidates(client, md):
    r = client.generate_content(
        request=request(temperature=0.8, seed=7, max_output_tokens=5, response_logprobs=True, logprobs=2, candidate_count=2),
        metadata=md,
    )
    assert [c.index for c in r.candidates] == [0, 1]
    for c in r.candidates:
        chosen = c.logprobs_result.chosen_candidates
        assert 0 < len(chosen) <= 5 and all(x.log_probability <= 0 for x in chosen)
        assert all(len(t.candidates) == 2 for t in c.logprobs_result.top_candidates)
        assert c.avg_logprobs <= 0


def test_stream_equals_unary_for_same_seed(client, md):
    req = request("Invent a word and explain it.", temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_output_tokens=16)
    unary = client.generate_content(request=req, metadata=md)
    chunks = list(client.stream_generate_content(request=req, metadata=md))
    assert len(chunks) > 1
    assert "".join(text_of(c) for c in chunks) == text_of(unary)
    last = chunks[-1]
    assert last.candidates[0].finish_reason == unary.candidates[0].finish_reason
    assert last.usage_metadata.candidates_token_count == unary.usage_metadata.candidates_token_count
    assert last.usage_metadata.prompt_token_count == unary.usage_metadata.prompt_token_count
    counts = [c.usage_metadata.candidates_token_count for c in chunks]
    assert counts == sorted(counts)  # cumulative usage on every chunk


def test_response_metadata(channel, md):
    """Response headers as gRPC metadata: initial (request id, model, traceparent), trailing (latency)."""
    call = channel.unary_unary(
        f"/{SERVICE}/GenerateContent",
        request_serializer=types.GenerateContentRequest.serialize,
        response_deserializer=types.GenerateContentResponse.deserialize,
    )
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    resp, c = call.with_call(
        request(max_output_tokens=3),
        metadata=[*md, ("x-request-id", "grpc-req-1"), ("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")],
        timeout=60,
    )
    assert text_of(resp)
    initial = dict(c.initial_metadata())
    assert initial["x-request-id"] == "grpc-req-1"
    assert initial["x-model-id"] == "smollm2-135m-instruct" and initial["x-model-version"] == "1"
    assert initial["traceparent"].startswith(f"00-{trace_id}-")
    assert float(dict(c.trailing_metadata())["x-inference-latency-ms"]) > 0



def test_server_span_in_callers_trace(channel, md, grpc_env):
    """A SERVER span per call, in the caller's trace, with the engine's phases under it (as REST)."""
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    client = GenerativeServiceClient(transport=GenerativeServiceGrpcTransport(channel=channel))
    client.generate_content(
        request=request(max_output_tokens=3), metadata=[*md, ("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")]
    )
    url = f"{grpc_env['server'].url}/internal/traces"
    end = time.monotonic() + 5
    while True:
        spans = [s for s in httpx.get(url, headers=dict(md), timeout=5).json()["spans"] if s["trace_id"] == trace_id]
        server = [s for s in spans if s["name"] == f"{SERVICE}/GenerateContent"]
        if (server and {"queue", "prefill", "decode"} <= {s["name"] for s in spans}) or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert len(server) == 1 and server[0]["kind"] == "SERVER", spans
    assert server[0]["attributes"]["rpc.system"] == "grpc"
    assert server[0]["attributes"]["rpc.grpc.status_code"] == 0
    phases = {s["name"]: s for s in spans if s["name"] in ("queue", "prefill", "decode")}
    assert set(phases) == {"queue", "prefill", "decode"}, spans
    assert all(p["parent_span_id"] == server[0]["span_id"] for p in phases.values())


def test_count_tokens_matches_usage(client, md):
    req = request("How many tokens is this?", temperature=0, max_output_tokens=2)
    n = client.count_tokens(request=types.CountTokensRequest(model=MODEL, contents=req.contents), metadata=md)
    r = client.generate_content(request=req, metadata=md)
    assert n.total_tokens == r.usage_metadata.prompt_token_count > 0
    wrapped = client.count_tokens(request=types.CountTokensRequest(model=MODEL, generate_content_request=req), metadata=md)
    assert wrapped.total_tokens == n.total_tokens


def test_embed_content(client, md, grpc_env):
    content = types.Content(parts=[types.Part(text="The quick brown fox")])
    e = client.embed_content(request=types.EmbedContentRequest(model=EMBED_MODEL, content=content), metadata=md)
    values = list(e.embedding.values)
    assert len(values) == 384
    assert abs(sum(v * v for v in values) - 1.0) < 1e-3
    # the same encoder as REST
    rest = httpx.post(
        f"{grpc_env['server'].url}/v1beta/{EMBED_MODEL}:embedContent",
        json={"content": {"parts": [{"text": "The quick brown fox"}]}},
        headers={"x-goog-api-key": grpc_env["key"]},
        timeout=30,
    ).json()["embedding"]["values"]
    assert max(abs(a - b) for a, b in zip(values, rest, strict=True)) < 1e-5

    texts = ["first text", "second text", "third"]
    b = client.batch_embed_contents(
        request=types.BatchEmbedContentsRequest(
            model=EMBED_MODEL,
            requests=[
                types.EmbedContentRequest(model=EMBED_MODEL, content=types.Content(parts=[types.Part(text=t)]), output_dimensionality=d)
                for t, d in zip(texts, (384, 64, 8), strict=True)
            ],
        ),
        metadata=md,
    )
    assert [len(x.values) for x in b.embeddings] == [384, 64, 8]


# -- errors ----------------------------------------------------------------------------------------
def test_error_codes(client, md):
    with pytest.raises(gexc.NotFound, match="models/no-such-model is not found"):
        client.generate_content(request=types.GenerateContentRequest(model="models/no-such-model", contents=request().contents), metadata=md)
    with pytest.raises(gexc.InvalidArgument) as e:
        client.generate_content(request=request(top_k=-1), metadata=md)
    violations = [v for d in e.value.details if hasattr(d, "field_violations") for v in d.field_violations]
    assert [v.field for v in violations] == ["generationConfig.topK"]
    with pytest.raises(gexc.InvalidArgument, match="model is not specified"):
        client.generate_content(request=types.GenerateContentRequest(contents=request().contents), metadata=md)
    with pytest.raises(gexc.InvalidArgument, match="embedding model"):
        client.generate_content(request=types.GenerateContentRequest(model=EMBED_MODEL, contents=request().contents), metadata=md)


def test_malformed_message_is_invalid_argument(channel, md):
    call = channel.unary_unary(f"/{SERVICE}/GenerateContent")
    with pytest.raises(grpc.RpcError) as e:
        call(b"\xff\xff\xff", metadata=md, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_auth_failures(client):
    with pytest.raises(gexc.Unauthenticated):
        client.count_tokens(request=types.CountTokensRequest(model=MODEL, contents=request().contents))
    # an unknown key: Google's answer, INVALID_ARGUMENT with ErrorInfo API_KEY_INVALID
    with pytest.raises(gexc.InvalidArgument) as e:
        client.count_tokens(
            request=types.CountTokensRequest(model=MODEL, contents=request().contents),
            metadata=[("x-goog-api-key", "gml_000000000000_notavalidkeynotavalidkey")],
        )
    assert e.value.reason == "API_KEY_INVALID"


def test_rate_limit_resource_exhausted(client, grpc_env):
    md = [("x-goog-api-key", grpc_env["tiny_key"])]
    req = types.CountTokensRequest(model=MODEL, contents=request().contents)
    for _ in range(2):  # the tenant's burst: 2 requests per minute
        client.count_tokens(request=req, metadata=md)
    with pytest.raises(gexc.ResourceExhausted, match="requests per minute") as e:
        client.count_tokens(request=req, metadata=md)
    delays = [d.retry_delay.seconds for d in e.value.details if hasattr(d, "retry_delay")]
    assert delays and delays[0] >= 1


def test_signed_request(client, grpc_env):
    from gemel.client import signature_header

    req = request(temperature=0, max_output_tokens=4)
    body = types.GenerateContentRequest.serialize(req)  # what the client sends: the signature covers it
    header = signature_header(body, grpc_env["signing_id"], grpc_env["private"])
    r = client.generate_content(request=req, metadata=[("x-llm-signature", header)])
    assert text_of(r)
    with pytest.raises(gexc.Unauthenticated, match="replay|nonce|seen"):  # the same signature again
        client.generate_content(request=req, metadata=[("x-llm-signature", header)])
    other = signature_header(body, grpc_env["signing_id"], grpc_env["private"])
    with pytest.raises(gexc.Unauthenticated):  # a signature over other bytes
        client.generate_content(request=request(temperature=0, max_output_tokens=5), metadata=[("x-llm-signature", other)])


# -- deadlines and cancellation ----------------------------------------------------------------------
def test_deadline_aborts_generation(client, md, grpc_env):
    """A client deadline ends the call DEADLINE_EXCEEDED and the engine frees the request's KV blocks."""
    req = request("Count from 1 to 1000, one number per line.", temperature=0, max_output_tokens=2000)
    outcome: dict = {}

    def call():
        t0 = time.monotonic()
        try:
            client.generate_content(request=req, metadata=md, timeout=3.0, retry=None)
        except Exception as e:  # noqa: BLE001
            outcome["error"] = e
        outcome["elapsed"] = time.monotonic() - t0
        outcome["ended"] = time.monotonic()

    t = threading.Thread(target=call)
    t.start()
    busy = wait_running(grpc_env, within=3.0)
    assert busy["num_running"] == 1, busy
    t.join(10)
    assert isinstance(outcome.get("error"), gexc.DeadlineExceeded), outcome
    assert outcome["elapsed"] < 4.0
    ok, s = wait_kv_free(grpc_env, within=1.0)
    assert ok, s


def test_client_cancel_aborts_stream(client, md, grpc_env):
    req = request("Count from 1 to 1000, one number per line.", temperature=0, max_output_tokens=2000)
    stream = client.stream_generate_content(request=req, metadata=md, retry=None)
    received = 0
    for _chunk in stream:
        received += 1
        if received == 3:
            break
    busy = stats(grpc_env)
    assert busy["num_running"] == 1, busy
    stream.cancel()  # the underlying grpc call (api_core's iterator wraps it)
    ok, s = wait_kv_free(grpc_env, within=1.0)
    assert ok, s


# -- reflection ----------------------------------------------------------------------------------
def test_reflection_only_client(channel, md):
    """List the service, resolve its descriptors by reflection alone, and call GenerateContent
    with messages built from them: no generated code, no .proto files."""
    from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    def ask(**kw) -> reflection_pb2.ServerReflectionResponse:
        return next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**kw)]), metadata=md)))

    services = [s.name for s in ask(list_services="").list_services_response.service]
    assert SERVICE in services

    pool = descriptor_pool.DescriptorPool()
    protos: dict[str, descriptor_pb2.FileDescriptorProto] = {}

    def collect(resp):
        for raw in resp.file_descriptor_response.file_descriptor_proto:
            fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
            protos.setdefault(fd.name, fd)

    collect(ask(file_containing_symbol=SERVICE))
    added: set[str] = set()

    def add(name: str) -> None:
        if name in added:
            return
        if name not in protos:
            collect(ask(file_by_filename=name))
        for dep in protos[name].dependency:
            add(dep)
        pool.Add(protos[name])
        added.add(name)

    for name in list(protos):
        add(name)
    service = pool.FindServiceByName(SERVICE)
    assert {m.name for m in service.methods} >= {"GenerateContent", "StreamGenerateContent", "CountTokens", "EmbedContent", "BatchEmbedContents"}
    method = service.methods_by_name["GenerateContent"]
    Request = message_factory.GetMessageClass(method.input_type)
    Response = message_factory.GetMessageClass(method.output_type)
    req = json_format.ParseDict(
        {"model": MODEL, "contents": [{"parts": [{"text": "Hello"}]}], "generationConfig": {"maxOutputTokens": 4}}, Request()
    )
    call = channel.unary_unary(
        f"/{SERVICE}/{method.name}", request_serializer=Request.SerializeToString, response_deserializer=Response.FromString
    )
    resp = call(req, metadata=md, timeout=60)
    body = json_format.MessageToDict(resp)
    assert body["candidates"][0]["content"]["parts"][0]["text"]
    assert body["usageMetadata"]["candidatesTokenCount"] <= 4


def grpcurl_path() -> str | None:
    found = shutil.which("grpcurl")
    if found:
        return found
    beside = Path(sys.executable).with_name("grpcurl")
    return str(beside) if beside.exists() else None


def test_grpcurl(grpc_env):
    exe = grpcurl_path()
    if exe is None:
        pytest.skip("grpcurl is not installed (scripts/install.sh installs it on x86-64 Linux)")
    addr = f"127.0.0.1:{grpc_env['port']}"
    key = ["-H", f"x-goog-api-key: {grpc_env['key']}"]
    listed = subprocess.run([exe, "-plaintext", *key, addr, "list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert SERVICE in listed.stdout.split()
    body = {"model": MODEL, "contents": [{"parts": [{"text": "Hello"}]}], "generationConfig": {"maxOutputTokens": 4}}
    out = subprocess.run(
        [exe, "-plaintext", *key, "-d", json.dumps(body), addr, f"{SERVICE}/GenerateContent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    resp = json.loads(out.stdout)
    assert resp["candidates"][0]["content"]["parts"][0]["text"]
    assert resp["usageMetadata"]["candidatesTokenCount"] <= 4  # camelCase, as Google's JSON
    bad = subprocess.run(
        [exe, "-plaintext", "-d", json.dumps(body), addr, f"{SERVICE}/GenerateContent"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "Unauthenticated" in bad.stderr


# -- TLS -------------------------------------------------------------------------------------------
def self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    os.chmod(key_path, 0o600)
    return cert_path, key_path


def test_tls(tmp_path):
    cert, key = self_signed(tmp_path)
    port = free_port()
    extra = f"embeddings: null\ngrpc:\n  tls_cert_file: {cert.name}\n  tls_key_file: {key.name}\n"  # relative to the config
    srv = start_server(tmp_path, name="tls", extra_config=extra, grpc_port=port)
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
            client = GenerativeServiceClient(transport=GenerativeServiceGrpcTransport(channel=ch))
            r = client.generate_content(request=request(temperature=0, max_output_tokens=3), timeout=120)
            assert text_of(r)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # plaintext to a TLS port fails
            client = GenerativeServiceClient(transport=GenerativeServiceGrpcTransport(channel=ch))
            with pytest.raises(gexc.GoogleAPICallError):
                client.count_tokens(request=types.CountTokensRequest(model=MODEL, contents=request().contents), timeout=10, retry=None)
    finally:
        srv.stop()
