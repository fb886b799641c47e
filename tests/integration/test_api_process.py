"""The API process of `gemel serve` (HTTP, tokenizer, gateway) without embeddings: it reads
the model's metadata and tokenizer without its weights and never loads torch, which lives
in the engine process (about 180 MB of resident memory saved)."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]

MODEL = "smollm2-135m-instruct"


def _mapped_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1].rsplit("/", 1)[-1] for line in f if "/" in line}


def test_api_process_serves_without_loading_torch(obs_server):
    """After OpenAI and Gemini requests (with log-probs and a JSON-object grammar, whose
    specs the API process validates), the API process has no libtorch mapped, while the
    engine process it started has."""
    url = obs_server.url
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
        "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"}})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    gemini = httpx.post(f"{url}/v1beta/models/{MODEL}:generateContent", timeout=120, json={
        "contents": [{"parts": [{"text": "Say hi."}]}],
        "generationConfig": {"maxOutputTokens": 4, "responseLogprobs": True, "logprobs": 2}})
    assert gemini.status_code == 200, gemini.text
    assert gemini.json()["candidates"][0]["logprobsResult"]["topCandidates"]
    api = obs_server.proc.pid
    assert not any(name.startswith("libtorch") for name in _mapped_libraries(api))
    engines = [pid for pid in _children(api) if any(n.startswith("libtorch_cpu") for n in _mapped_libraries(pid))]
    assert len(engines) == 1  # the engine process: the model, and torch with it


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out
