"""A killed engine process with restarting off: /readyz fails and requests answer 503
UNAVAILABLE at once, never hang. (With restarting on, the default, see
test_engine_restart_serve.py.)

Uses its own server instance, since it breaks it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from google.genai import errors, types

from conftest import start_server

pytestmark = pytest.mark.slow

MODEL = "gemini-2.0-flash"


@pytest.fixture(scope="module")
def doomed(tmp_path_factory):
    no_restarts = "embeddings: null\nserver:\n  stats_interval_s: 0.2\n  log_level: warning\n  engine_max_restarts: 0\n"
    srv = start_server(tmp_path_factory.mktemp("doomed"), name="doomed", extra_config=no_restarts)
    yield srv
    srv.stop()


def test_killed_engine(doomed):
    from google import genai
    from openai import OpenAI

    gclient = genai.Client(api_key="x", http_options=types.HttpOptions(base_url=doomed.url, api_version="v1beta"))
    oclient = OpenAI(api_key="x", base_url=f"{doomed.url}/v1", max_retries=0)
    assert gclient.models.generate_content(model=MODEL, contents="hi", config=types.GenerateContentConfig(max_output_tokens=2)).text is not None

    # a stream in flight when the engine dies ends with an in-band error instead of hanging
    events: list[str] = []
    started = threading.Event()

    def long_stream() -> None:
        body = {"model": "gpt-4o-mini", "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{doomed.url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=long_stream)
    reader.start()
    assert started.wait(60)
    pid = doomed.stats()["pid"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()

    reader.join(10)
    assert not reader.is_alive(), "the in-flight stream hung"
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]

    while httpx.get(f"{doomed.url}/readyz", timeout=5).status_code == 200:
        assert time.monotonic() - t0 < 3, "/readyz still green after the engine died"
        time.sleep(0.05)
    assert httpx.get(f"{doomed.url}/healthz", timeout=5).status_code == 200  # the front end lives on

    t1 = time.monotonic()
    with pytest.raises(errors.ServerError) as e:
        gclient.models.generate_content(model=MODEL, contents="hi")
    assert e.value.code == 503 and e.value.status == "UNAVAILABLE"
    with pytest.raises(openai.InternalServerError) as e2:
        oclient.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert e2.value.status_code == 503 and e2.value.response.headers.get("retry-after")
    r = httpx.post(f"{doomed.url}/v1beta/models/{MODEL}:streamGenerateContent?alt=sse",
                   json={"contents": [{"parts": [{"text": "hi"}]}]}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["status"] == "UNAVAILABLE"
    assert time.monotonic() - t1 < 3
