"""SIGTERM to a real ``gemel serve`` while unary and streaming requests run on both REST
surfaces and gRPC: it stops being ready, refuses new work with 503 / UNAVAILABLE and a
retry hint, lets every running request finish in full, and exits 0."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import yaml
from google import genai
from google.ai.generativelanguage_v1beta import types as gl
from google.ai.generativelanguage_v1beta.services.generative_service import GenerativeServiceClient
from google.ai.generativelanguage_v1beta.services.generative_service.transports import GenerativeServiceGrpcTransport
from google.api_core import exceptions as gexc
from google.genai import errors as genai_errors
from google.genai import types

from conftest import TEST_CONFIG, free_port, launch

pytestmark = pytest.mark.slow

# Long enough that the requests are still running while the test checks the refusals.
LONG = 96
PROMPT = "Count from one to one thousand, one number per line."


def wait_for(predicate, within: float, what: str):
    end = time.monotonic() + within
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {within}s")


def test_sigterm_drains_running_requests_and_exits_0(tmp_path):
    cfg = yaml.safe_load(TEST_CONFIG)
    cfg["server"]["drain_timeout_s"] = 120  # generous: the test waits for every answer in full
    cfg["embeddings"] = None
    config = tmp_path / "drain.yaml"
    config.write_text(yaml.safe_dump(cfg))
    port, grpc_port = free_port(), free_port()
    log_path = tmp_path / "drain.log"
    args = ["--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port)]
    srv = launch([*args, "--log-level", "info"], port, log_path)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        oai = openai.OpenAI(api_key="x", base_url=f"{srv.url}/v1", max_retries=0, timeout=120)
        gem = genai.Client(api_key="x", http_options=types.HttpOptions(base_url=srv.url, api_version="v1beta"))
        grpc_client = GenerativeServiceClient(transport=GenerativeServiceGrpcTransport(channel=channel))
        gen_config = types.GenerateContentConfig(max_output_tokens=LONG, temperature=0)
        first_chunk = {name: threading.Event() for name in ("openai_stream", "gemini_stream", "grpc_stream")}

        def openai_unary():
            r = oai.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": PROMPT}], max_tokens=LONG,
                temperature=0, extra_body={"ignore_eos": True},
            )
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

        def openai_stream():
            text, finish, usage = "", None, None
            for chunk in oai.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": PROMPT}], max_tokens=LONG,
                temperature=0, extra_body={"ignore_eos": True}, stream=True, stream_options={"include_usage": True},
            ):
                first_chunk["openai_stream"].set()
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            return text, finish, usage

        def gemini_unary():
            r = gem.models.generate_content(model="gemini-2.0-flash", contents=PROMPT, config=gen_config)
            return r.text, r.candidates[0].finish_reason

        def gemini_stream():
            text, finish = "", None
            for chunk in gem.models.generate_content_stream(model="gemini-2.0-flash", contents=PROMPT, config=gen_config):
                first_chunk["gemini_stream"].set()
                text += chunk.text or ""
                finish = chunk.candidates[0].finish_reason or finish if chunk.candidates else finish
            return text, finish

        def grpc_stream():
            req = gl.GenerateContentRequest(
                model="models/gemini-2.0-flash",
                contents=[gl.Content(role="user", parts=[gl.Part(text=PROMPT)])],
                generation_config=gl.GenerationConfig(max_output_tokens=LONG, temperature=0),
            )
            text = ""
            for chunk in grpc_client.stream_generate_content(request=req, timeout=120):
                first_chunk["grpc_stream"].set()
                text += "".join(p.text for c in chunk.candidates for p in c.content.parts)
            return text

        with ThreadPoolExecutor(5) as pool:
            running = {f.__name__: pool.submit(f) for f in (openai_unary, openai_stream, gemini_unary, gemini_stream, grpc_stream)}

            def all_started() -> bool:
                # Every request is in the engine (or, if the model stopped early, done).
                if not all(e.is_set() or running[n].done() for n, e in first_chunk.items()):
                    return False
                done = sum(f.done() for f in running.values())
                return srv.stats()["num_requests_in_flight"] + done >= len(running)

            wait_for(all_started, 60, "all five requests starting")
            os.kill(srv.proc.pid, signal.SIGTERM)

            ready = wait_for(
                lambda: (r := httpx.get(f"{srv.url}/readyz", timeout=5)).status_code == 503 and r, 10, "/readyz turning 503"
            )
            assert ready.json()["status"] == "DRAINING" and ready.headers["retry-after"]
            assert httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200  # alive, only not ready

            # New work is refused in each surface's own format, with a retry hint.
            with pytest.raises(openai.InternalServerError) as refused:
                oai.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
            assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
            assert refused.value.body["type"] == "server_error"
            with pytest.raises(genai_errors.ServerError) as g_refused:
                gem.models.generate_content(model="gemini-2.0-flash", contents="Hi")
            assert g_refused.value.code == 503 and g_refused.value.status == "UNAVAILABLE"
            assert g_refused.value.response.headers["retry-after"] == "1"
            with pytest.raises(gexc.ServiceUnavailable) as grpc_refused:
                grpc_client.count_tokens(
                    request=gl.CountTokensRequest(
                        model="models/gemini-2.0-flash", contents=[gl.Content(role="user", parts=[gl.Part(text="Hi")])]
                    ),
                    timeout=10,
                    retry=None,
                )
            assert ("retry-after", "1") in grpc_refused.value.response.trailing_metadata()

            answers = {name: f.result(timeout=120) for name, f in running.items()}

        for name in ("openai_unary", "openai_stream"):
            text, finish, tokens = answers[name]
            assert text and finish == "length" and tokens == LONG, (name, finish, tokens)
        for name in ("gemini_unary", "gemini_stream"):
            text, finish = answers[name]
            assert text and finish in (types.FinishReason.STOP, types.FinishReason.MAX_TOKENS), (name, finish)
        assert answers["grpc_stream"]

        assert srv.proc.wait(timeout=60) == 0, srv.log()
        log = log_path.read_text()
        assert "draining: " in log and "drained" in log, log[-3000:]
    finally:
        channel.close()
        srv.stop()
