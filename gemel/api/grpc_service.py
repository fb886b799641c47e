"""The descriptor of ``google.ai.generativelanguage.v1beta.GenerativeService``.

``google-ai-generativelanguage`` ships proto-plus message classes whose file descriptors it
registers in protobuf's default pool, but no service descriptor and no ``.proto`` sources
(nor does any other PyPI package). Server reflection (grpcurl, grpcui, Postman) needs the
service's descriptor, so gemel builds one here, at import time, from what the package does
register:

* every file the request/response messages live in is copied, with its dependencies, out
  of the default pool into gemel's own ``DescriptorPool`` (``service_pool()``), each field
  given the ``json_name`` protoc would have written (camelCase), which proto-plus omits;
* one more file, ``gemel/google/ai/generativelanguage/v1beta/generative_service.proto``, is
  added to that pool: package ``google.ai.generativelanguage.v1beta`` (so the service's
  full name, and with it the method paths of Google's own clients, are unchanged), one
  ``ServiceDescriptorProto`` whose methods name the package's message types, and a
  dependency on the package's file that defines them.

Nothing is added to the default pool: a future package release that registers the service
itself cannot collide with gemel's copy. The message types are the package's own, so a
reflection client and the official client send the very same bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.descriptor_pool import DescriptorPool

PACKAGE = "google.ai.generativelanguage.v1beta"
SERVICE_NAME = f"{PACKAGE}.GenerativeService"
SERVICE_FILE = "gemel/google/ai/generativelanguage/v1beta/generative_service.proto"


@dataclass(frozen=True)
class Method:
    name: str  # as in the method path /google.ai.generativelanguage.v1beta.GenerativeService/<name>
    request: type  # the proto-plus class
    response: type
    server_streaming: bool = False

    @property
    def path(self) -> str:
        return f"/{SERVICE_NAME}/{self.name}"


@functools.cache
def methods() -> tuple[Method, ...]:
    """The methods gemel serves (GenerateAnswer and BidiGenerateContent are not among them:
    they answer UNIMPLEMENTED, and reflection does not list them)."""
    from google.ai.generativelanguage_v1beta import types

    return (
        Method("GenerateContent", types.GenerateContentRequest, types.GenerateContentResponse),
        Method("StreamGenerateContent", types.GenerateContentRequest, types.GenerateContentResponse, True),
        Method("CountTokens", types.CountTokensRequest, types.CountTokensResponse),
        Method("EmbedContent", types.EmbedContentRequest, types.EmbedContentResponse),
        Method("BatchEmbedContents", types.BatchEmbedContentsRequest, types.BatchEmbedContentsResponse),
    )


def _descriptor(cls: type):
    return cls.pb().DESCRIPTOR  # proto-plus class -> protobuf Descriptor


def service_file_proto() -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto of the service, depending on the package's message files."""
    fd = descriptor_pb2.FileDescriptorProto(name=SERVICE_FILE, package=PACKAGE, syntax="proto3")
    deps: list[str] = []
    service = fd.service.add(name="GenerativeService")
    for m in methods():
        for cls in (m.request, m.response):
            d = _descriptor(cls)
            if d.file.package != PACKAGE:
                raise RuntimeError(f"{d.full_name} is not in package {PACKAGE}")
            if d.file.name not in deps:
                deps.append(d.file.name)
        service.method.add(
            name=m.name,
            input_type=f".{_descriptor(m.request).full_name}",
            output_type=f".{_descriptor(m.response).full_name}",
            server_streaming=m.server_streaming,
        )
    fd.dependency.extend(deps)
    return fd


def json_name(field_name: str) -> str:
    """protoc's default JSON name: underscores dropped, the letter after each capitalised."""
    out, upper = [], False
    for ch in field_name:
        if ch == "_":
            upper = True
        elif upper:
            out.append(ch.upper())
            upper = False
        else:
            out.append(ch)
    return "".join(out)


def _fill_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    """Set ``json_name`` as protoc would have (the copies of proto-plus descriptors lack it),
    so reflection clients print and accept camelCase JSON, as Google's REST API does."""
    for field in message.field:
        if not field.HasField("json_name"):
            field.json_name = json_name(field.name)
    for nested in message.nested_type:
        _fill_json_names(nested)


@functools.cache
def service_pool() -> DescriptorPool:
    """gemel's pool: the package's message files (and theirs, transitively), the service file,
    and the reflection service's own file, for reflection to serve."""
    from grpc_reflection.v1alpha import reflection_pb2

    pool = DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dep in file.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        for message in proto.message_type:
            _fill_json_names(message)
        pool.AddSerializedFile(proto.SerializeToString())
        added.add(file.name)

    for m in methods():
        add(_descriptor(m.request).file)
        add(_descriptor(m.response).file)
    add(reflection_pb2.DESCRIPTOR)
    pool.AddSerializedFile(service_file_proto().SerializeToString())
    return pool
