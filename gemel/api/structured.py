"""Structured-output requests of both surfaces -> one StructuredOutputSpec (JSON mode and JSON-schema constrained decoding).

Gemini sends ``responseMimeType: application/json`` with ``responseSchema`` (an OpenAPI 3.0
subset with UPPERCASE types, ``nullable``, int64 bounds as strings) or ``responseJsonSchema``
(plain JSON Schema), or ``text/x.enum`` with an enum schema; OpenAI sends ``response_format``
``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": ...}}``.
A JSON Schema must pass its metaschema (with the ``jsonschema`` package, when installed) and
the grammar library must be able to use it; else a 400 names the field and the problem.
"""

from __future__ import annotations

import json
from typing import Any

from gemel.api.errors import invalid
from gemel.api.limits import check_schema_size
from gemel.engine.structured_output import StructuredOutputSpec, validate

_INT_KEYS = {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}


def openapi_to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Gemini's Schema (proto JSON, camelCase) -> JSON Schema."""
    out: dict[str, Any] = {}
    kind = schema.get("type")
    if isinstance(kind, str) and kind not in ("TYPE_UNSPECIFIED", ""):
        out["type"] = kind.lower()
    for key in ("title", "description", "pattern", "minimum", "maximum", "default"):
        if key in schema:
            out[key] = schema[key]
    for key in _INT_KEYS:
        if key in schema:
            out[key] = int(schema[key])
    if schema.get("enum"):
        out["enum"] = list(schema["enum"])
        out.pop("type", None) if out.get("type") == "string" and schema.get("format") == "enum" else None
    fmt = schema.get("format")
    if fmt and fmt != "enum" and out.get("type") == "string":
        out["format"] = fmt
    if "properties" in schema:
        out["properties"] = {k: openapi_to_json_schema(v) for k, v in schema["properties"].items()}
        order = schema.get("propertyOrdering")
        if order:
            out["properties"] = {k: out["properties"][k] for k in order if k in out["properties"]} | out["properties"]
    if "required" in schema:
        out["required"] = list(schema["required"])
    if "items" in schema:
        out["items"] = openapi_to_json_schema(schema["items"])
    if "anyOf" in schema:
        out["anyOf"] = [openapi_to_json_schema(s) for s in schema["anyOf"]]
    if schema.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


def integral_floats_to_ints(value: Any) -> Any:
    """protobuf's Value stores every number as a double: give JSON Schema back its integers."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: integral_floats_to_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [integral_floats_to_ints(v) for v in value]
    return value


def _checked(spec: StructuredOutputSpec, param: str) -> StructuredOutputSpec:
    try:
        problem = validate(spec)
    except RecursionError:
        problem = "nested too deeply"
    if problem:
        raise invalid(f"{param}: invalid schema: {problem}", param=param)
    return spec


def check_json_schema(schema: Any, param: str, at: str | None = None) -> None:
    """400 naming ``param`` when ``schema`` (found at ``at``, default ``param``) is not a valid
    JSON Schema by its metaschema (the draft its ``$schema`` names, else 2020-12); the message
    says where in the schema. Without ``jsonschema`` the grammar library's checks decide alone."""
    check_schema_size(schema, param)
    try:
        import jsonschema
    except ImportError:
        return
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    if declared is not None and not isinstance(declared, str):
        raise invalid(f"{param}: invalid JSON Schema: $schema must be a string", param=param)
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator = cls(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)
        error = jsonschema.exceptions.best_match(validator.iter_errors(schema))
    except RecursionError:
        raise invalid(f"{param}: invalid JSON Schema: nested too deeply", param=param) from None
    if error is not None:
        where = (at or param) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise invalid(f"{where}: invalid JSON Schema: {error.message}", param=param)


def gemini_spec(mime: str, response_schema: dict | None, response_json_schema: Any) -> StructuredOutputSpec | None:
    """From a generationConfig's fields (already converted to JSON-like dicts)."""
    mime = (mime or "").strip().lower()
    if response_schema is not None and response_json_schema is not None:
        raise invalid(
            "generationConfig: set responseSchema or responseJsonSchema, not both", param="generationConfig.responseSchema"
        )
    if mime in ("", "text/plain"):
        if response_schema is not None or response_json_schema is not None:
            raise invalid(
                "generationConfig.responseMimeType must be application/json (or text/x.enum) when a response "
                "schema is given",
                param="generationConfig.responseMimeType",
            )
        return None
    if mime == "text/x.enum":
        enum = (response_schema or {}).get("enum")
        if not enum:
            raise invalid(
                "generationConfig.responseSchema must be an enum schema when responseMimeType is text/x.enum",
                param="generationConfig.responseSchema",
            )
        return _checked(StructuredOutputSpec("choice", json.dumps([str(v) for v in enum])), "generationConfig.responseSchema")
    if mime != "application/json":
        raise invalid(
            f"generationConfig.responseMimeType {mime!r} is not supported; use text/plain, application/json or text/x.enum",
            param="generationConfig.responseMimeType",
        )
    if response_json_schema is not None:
        if not isinstance(response_json_schema, (dict, bool)):
            raise invalid("generationConfig.responseJsonSchema must be a JSON Schema object",
                          param="generationConfig.responseJsonSchema")
        response_json_schema = integral_floats_to_ints(response_json_schema)
        check_json_schema(response_json_schema, "generationConfig.responseJsonSchema")
        return _checked(StructuredOutputSpec("json_schema", json.dumps(response_json_schema)),
                        "generationConfig.responseJsonSchema")
    if response_schema is not None:
        check_schema_size(response_schema, "generationConfig.responseSchema")
        return _checked(StructuredOutputSpec("json_schema", json.dumps(openapi_to_json_schema(response_schema))),
                        "generationConfig.responseSchema")
    return StructuredOutputSpec("json_object")


def openai_spec(response_format: dict | None) -> StructuredOutputSpec | None:
    if not response_format:
        return None
    if not isinstance(response_format, dict):
        raise invalid("response_format must be an object", param="response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("response_format.json_schema must be an object with a 'schema' object",
                          param="response_format.json_schema")
        check_json_schema(spec.get("schema", {}), "response_format.json_schema", at="response_format.json_schema.schema")
        return _checked(StructuredOutputSpec("json_schema", json.dumps(spec.get("schema", {}))),
                        "response_format.json_schema")
    raise invalid(f"response_format.type {kind!r} is not supported (use text, json_object or json_schema)",
                  param="response_format.type")
