"""Request inputs -> chat messages for the model's template (text models).

Both surfaces end here: Gemini ``contents`` / ``systemInstruction`` and OpenAI ``messages``
become ``[{"role": "system"|"user"|"assistant", "content": str}]``. Media parts are checked
(MIME type, base64) and then refused by name, because gemel's models take text only; an
inline ``text/*`` part is decoded and used as text.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from gemel.api.errors import invalid

_B64 = re.compile(r"^[A-Za-z0-9+/_-]*={0,2}$")
_MIME = re.compile(r"^[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*$")
MEDIA_PREFIXES = ("image/", "audio/", "video/", "application/pdf")


def decode_base64(data: str, where: str) -> bytes:
    """Standard or URL-safe base64 (proto3 JSON accepts both, padding optional); else 400."""
    s = re.sub(r"\s+", "", data)
    if not _B64.match(s) or len(s.rstrip("=")) % 4 == 1:
        raise invalid(f"{where}: invalid base64 data", param=where)
    s = s.replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{where}: invalid base64 data", param=where) from None


def _inline_text(mime: str, data: bytes, where: str, model_id: str) -> str:
    mime = mime.strip().lower()
    if not mime:
        raise invalid(f"{where}.mimeType: required", param=f"{where}.mimeType")
    if not _MIME.match(mime.split(";")[0].strip()):
        raise invalid(f"{where}.mimeType: {mime!r} is not a MIME type", param=f"{where}.mimeType")
    if mime.startswith("text/"):
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid(f"{where}: {mime} data is not valid UTF-8", param=where) from None
    kind = "media" if not mime.startswith(MEDIA_PREFIXES) else mime.split("/")[0]
    raise invalid(
        f"{where}: model {model_id} takes text only; {kind} input ({mime}) is not supported",
        param=where,
    )


# -- Gemini ------------------------------------------------------------------------------
def check_gemini_base64(body: Any) -> None:
    """Validate every inlineData.data of the raw JSON before protobuf's lenient decoder sees it."""
    if not isinstance(body, dict):
        return
    for key in ("contents", "systemInstruction", "system_instruction"):
        value = body.get(key)
        contents = value if isinstance(value, list) else [value]
        field = "systemInstruction" if key != "contents" else "contents"
        for i, content in enumerate(contents):
            if not isinstance(content, dict) or not isinstance(content.get("parts"), list):
                continue
            for j, part in enumerate(content["parts"]):
                if not isinstance(part, dict):
                    continue
                blob = part.get("inlineData", part.get("inline_data"))
                if isinstance(blob, dict) and isinstance(blob.get("data"), str):
                    where = f"{field}[{i}].parts[{j}].inlineData.data" if key == "contents" else f"{field}.parts[{j}].inlineData.data"
                    decode_base64(blob["data"], where)
    inner = body.get("generateContentRequest", body.get("generate_content_request"))
    if isinstance(inner, dict):
        check_gemini_base64(inner)


def gemini_parts_text(content, where: str, model_id: str) -> str:
    """The text of one Content (a ``google.ai.generativelanguage`` Content protobuf)."""
    texts = []
    for j, part in enumerate(content.parts):
        kind = part.WhichOneof("data")
        at = f"{where}.parts[{j}]"
        if kind == "text":
            if not part.thought:  # a thinking model's thoughts are not sent back to the model
                texts.append(part.text)
        elif kind == "inline_data":
            texts.append(_inline_text(part.inline_data.mime_type, part.inline_data.data, f"{at}.inlineData", model_id))
        elif kind == "file_data":
            raise invalid(f"{at}.fileData: file references are not supported; send inlineData or text", param=at)
        elif kind is None:
            raise invalid(f"{at}: a part must have one data field (e.g. text)", param=at)
        else:
            camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), kind)
            raise invalid(f"{at}.{camel}: {camel} parts are not supported by gemel yet", param=f"{at}.{camel}")
    return "".join(texts)


def gemini_messages(contents, system_instruction, model_id: str) -> list[dict]:
    """Gemini contents (roles user/model) and an optional system instruction -> chat messages."""
    if not contents:
        raise invalid("contents is not specified", param="contents")
    messages = []
    if system_instruction is not None and system_instruction.parts:
        messages.append({"role": "system", "content": gemini_parts_text(system_instruction, "systemInstruction", model_id)})
    for i, content in enumerate(contents):
        role = content.role or "user"
        if role not in ("user", "model"):
            raise invalid(f"contents[{i}].role: please use a valid role: user, model (got {role!r})", param=f"contents[{i}].role")
        if not content.parts:
            raise invalid(f"contents[{i}].parts: must not be empty", param=f"contents[{i}].parts")
        messages.append(
            {"role": "assistant" if role == "model" else "user", "content": gemini_parts_text(content, f"contents[{i}]", model_id)}
        )
    return messages


# -- OpenAI ------------------------------------------------------------------------------
_DATA_URL = re.compile(r"^data:([^;,]*)(;[^,]*)?,(.*)$", re.S)


def _openai_part_text(part: Any, where: str, model_id: str) -> str:
    if not isinstance(part, dict):
        raise invalid(f"{where}: expected an object with a 'type'", param=where)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}.text: expected a string", param=f"{where}.text")
        return part["text"]
    if kind == "image_url":
        url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
        m = _DATA_URL.match(url or "")
        if m and ";base64" in (m.group(2) or ""):
            decode_base64(m.group(3), f"{where}.image_url.url")
        raise invalid(f"{where}: model {model_id} takes text only; image input is not supported", param=where)
    if kind == "input_audio":
        audio = part.get("input_audio") if isinstance(part.get("input_audio"), dict) else {}
        if isinstance(audio.get("data"), str):
            decode_base64(audio["data"], f"{where}.input_audio.data")
        raise invalid(f"{where}: model {model_id} takes text only; audio input is not supported", param=where)
    if kind == "file":
        raise invalid(f"{where}: model {model_id} takes text only; file input is not supported", param=where)
    raise invalid(f"{where}.type: unknown content part type {kind!r}", param=f"{where}.type")


def openai_messages(messages: list[dict], model_id: str) -> list[dict]:
    """OpenAI chat messages (system/developer/user/assistant) -> chat messages of plain text."""
    if not messages:
        raise invalid("messages: at least one message is required", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role")
        if role == "developer":
            role = "system"
        if role == "tool" or role == "function" or msg.get("tool_calls") or msg.get("function_call"):
            raise invalid(f"{where}: tool calls are not supported by gemel yet", param=where)
        if role not in ("system", "user", "assistant"):
            raise invalid(f"{where}.role: expected system, developer, user or assistant (got {role!r})", param=f"{where}.role")
        content = msg.get("content")
        if content is None and role != "assistant":  # as OpenAI: only an assistant's turn may be null
            raise invalid(f"{where}.content: expected a string or a list of parts, got null", param=f"{where}.content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "".join(_openai_part_text(p, f"{where}.content[{j}]", model_id) for j, p in enumerate(content))
        else:
            raise invalid(f"{where}.content: expected a string or a list of parts", param=f"{where}.content")
        out.append({"role": role, "content": text})
    return out
