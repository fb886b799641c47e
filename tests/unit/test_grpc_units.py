"""Pieces of the Gemini gRPC surface that need no server: the service descriptor built for
reflection, error statuses, peer addresses and the configuration (address, TLS)."""

from __future__ import annotations

import argparse
import inspect
import re

import grpc
import pytest
from google.protobuf import descriptor_pool
from google.rpc import error_details_pb2

from gemel.api.errors import APIError
from gemel.api.grpc_server import grpc_code, peer_host, rpc_status
from gemel.api.grpc_service import SERVICE_NAME, json_name, methods, service_file_proto, service_pool
from gemel.api.server import add_serve_arguments, apply_overrides
from gemel.config import GemelConfig, GrpcConfig


def test_method_paths_are_the_official_clients():
    from google.ai.generativelanguage_v1beta.services.generative_service.transports import grpc as transport

    official = set(re.findall(r'"(/google\.ai\.generativelanguage\.v1beta\.GenerativeService/\w+)"', inspect.getsource(transport)))
    ours = {m.path for m in methods()}
    assert ours <= official
    assert {p.rsplit("/", 1)[1] for p in ours} == {
        "GenerateContent", "StreamGenerateContent", "CountTokens", "EmbedContent", "BatchEmbedContents",
    }


def test_service_pool_resolves_the_service_and_its_messages():
    pool = service_pool()
    service = pool.FindServiceByName(SERVICE_NAME)
    by_name = {m.name: m for m in service.methods}
    assert by_name["StreamGenerateContent"].server_streaming
    assert not by_name["GenerateContent"].server_streaming
    assert by_name["GenerateContent"].input_type.full_name == "google.ai.generativelanguage.v1beta.GenerateContentRequest"
    assert by_name["EmbedContent"].output_type.full_name == "google.ai.generativelanguage.v1beta.EmbedContentResponse"
    # every dependency is in the pool, as reflection clients will ask for them by file name
    seen, todo = set(), [pool.FindFileContainingSymbol(SERVICE_NAME)]
    while todo:
        f = todo.pop()
        if f.name in seen:
            continue
        seen.add(f.name)
        todo.extend(pool.FindFileByName(d.name) for d in f.dependencies)
    assert "google/protobuf/struct.proto" in seen
    # fields carry protoc's camelCase JSON names
    resp = pool.FindMessageTypeByName("google.ai.generativelanguage.v1beta.GenerateContentResponse")
    assert resp.fields_by_name["usage_metadata"].json_name == "usageMetadata"


def test_default_pool_is_untouched():
    service_pool()
    with pytest.raises(KeyError):
        descriptor_pool.Default().FindServiceByName(SERVICE_NAME)


def test_service_file_depends_on_the_package_files():
    fd = service_file_proto()
    assert fd.package == "google.ai.generativelanguage.v1beta"
    assert list(fd.dependency) == ["google/ai/generativelanguage_v1beta/types/generative_service.proto"]


def test_json_name():
    assert json_name("usage_metadata") == "usageMetadata"
    assert json_name("candidates") == "candidates"
    assert json_name("output_dimensionality") == "outputDimensionality"


@pytest.mark.parametrize(
    "status,code",
    [
        (400, grpc.StatusCode.INVALID_ARGUMENT),
        (401, grpc.StatusCode.UNAUTHENTICATED),
        (403, grpc.StatusCode.PERMISSION_DENIED),
        (404, grpc.StatusCode.NOT_FOUND),
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (499, grpc.StatusCode.CANCELLED),
        (500, grpc.StatusCode.INTERNAL),
        (503, grpc.StatusCode.UNAVAILABLE),
        (504, grpc.StatusCode.DEADLINE_EXCEEDED),
        (418, grpc.StatusCode.UNKNOWN),
    ],
)
def test_grpc_code(status, code):
    assert grpc_code(status) is code


def test_rpc_status_carries_the_rest_details():
    st = rpc_status(APIError(400, "topK must be >= 0", param="generationConfig.topK"))
    assert st.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and st.message == "topK must be >= 0"
    bad = error_details_pb2.BadRequest()
    assert st.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "generationConfig.topK"

    st = rpc_status(APIError(429, "slow down", retry_after_s=7))
    retry = error_details_pb2.RetryInfo()
    assert st.details[0].Unpack(retry) and retry.retry_delay.seconds == 7

    info = {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "API_KEY_INVALID", "domain": "googleapis.com"}
    st = rpc_status(APIError(400, "API key not valid.", details=[info]))
    ei = error_details_pb2.ErrorInfo()
    assert st.details[0].Unpack(ei) and ei.reason == "API_KEY_INVALID"


def test_peer_host():
    assert peer_host("ipv4:127.0.0.1:5555") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5555") == "::1"
    assert peer_host("ipv6:[fe80::1%25eth0]:80") == "fe80::1%eth0"
    assert peer_host("unix:/tmp/sock") is None
    assert peer_host(None) is None


def test_grpc_config_and_flags():
    assert GemelConfig().grpc.enabled and GemelConfig().grpc.port == 50051
    with pytest.raises(ValueError, match="set both or neither"):
        GrpcConfig(tls_cert_file="cert.pem")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    c = apply_overrides(GemelConfig(), parser.parse_args(["--grpc-port", "6000"]))
    assert c.grpc.enabled and c.grpc.port == 6000
    c = apply_overrides(GemelConfig(), parser.parse_args(["--no-grpc"]))
    assert not c.grpc.enabled


def test_tls_paths_relative_to_the_config(tmp_path):
    from gemel.config import load_config

    (tmp_path / "g.yaml").write_text("grpc:\n  tls_cert_file: certs/c.pem\n  tls_key_file: certs/k.pem\n")
    c = load_config(str(tmp_path / "g.yaml"))
    assert c.grpc.tls_cert_file == str(tmp_path / "certs/c.pem")
    assert c.grpc.tls_key_file == str(tmp_path / "certs/k.pem")


def test_grpc_problem(tmp_path):
    from gemel.api.server import grpc_problem

    c = GemelConfig.model_validate({"grpc": {"tls_cert_file": str(tmp_path / "no.pem"), "tls_key_file": str(tmp_path / "no.key")}})
    assert "missing or unreadable" in grpc_problem(c)
    c = GemelConfig.model_validate({"grpc": {"host": "0.0.0.0", "port": 0}})
    assert "without authentication" in grpc_problem(c)
    c = GemelConfig.model_validate({"grpc": {"host": "0.0.0.0", "port": 0}, "gateway": {"insecure": True}})
    assert grpc_problem(c) is None
    assert grpc_problem(GemelConfig.model_validate({"grpc": {"enabled": False, "host": "0.0.0.0"}})) is None


def test_port_in_use_is_refused_before_start():
    import socket

    from gemel.api.server import grpc_problem, port_unavailable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_unavailable("127.0.0.1", port)
        problem = grpc_problem(GemelConfig.model_validate({"grpc": {"port": port}}))
        assert f"127.0.0.1:{port} is unavailable" in problem and "--grpc-port" in problem
    assert port_unavailable("127.0.0.1", port) is None
