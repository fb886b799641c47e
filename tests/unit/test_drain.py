"""Draining without a model: the middleware's refusals and counting over HTTP in-process,
and ``DrainingServer`` in a real uvicorn process receiving real signals (the drain
timeout, a second signal)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from fastapi import FastAPI
from starlette.responses import StreamingResponse

from gemel.api.drain import Drain, DrainMiddleware
from gemel.api.errors import install_error_handlers


def make_app(drain: Drain) -> tuple[FastAPI, asyncio.Event]:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(DrainMiddleware, drain=drain)
    gate = asyncio.Event()

    @app.post("/v1/chat/completions")
    async def chat():
        async def body():
            yield b"data: first\n\n"
            await gate.wait()
            yield b"data: last\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1beta/models/{model}:generateContent")
    async def generate(model: str):
        return {"candidates": []}

    @app.get("/healthz")
    async def healthz():
        return {"status": "OK"}

    return app, gate


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_refusals_speak_each_surface_format():
    asyncio.run(refusals())


async def refusals():
    drain = Drain(timeout_s=30)
    app, _ = make_app(drain)
    async with client(app) as c:
        assert (await c.post("/v1beta/models/m:generateContent", json={})).status_code == 200
        drain.begin()
        r = await c.post("/v1/chat/completions", json={})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("server_error", "unavailable") and "shutting down" in err["message"]
        r = await c.post("/v1beta/models/m:generateContent", json={})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert (err["code"], err["status"]) == (503, "UNAVAILABLE")
        assert err["details"] == [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1s"}]
        assert (await c.get("/healthz")).status_code == 200  # not API work: answered while draining
    assert drain.in_flight == 0


def test_a_stream_counts_until_its_last_byte():
    asyncio.run(stream_counts())


async def stream_counts():
    # Driven as ASGI directly: httpx's in-process transport waits for the whole body.
    drain = Drain(timeout_s=30)
    app, gate = make_app(drain)
    sent: asyncio.Queue = asyncio.Queue()
    disconnect = asyncio.Event()

    async def receive():
        if not getattr(receive, "done", False):
            receive.done = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("test", 80),
    }
    task = asyncio.create_task(app(scope, receive, sent.put))
    while (m := await sent.get())["type"] != "http.response.body" or not m.get("body"):
        pass
    assert b"first" in m["body"] and drain.in_flight == 1
    drain.begin()
    async with client(app) as c:
        assert (await c.post("/v1/chat/completions", json={})).status_code == 503  # refused, not counted
    assert drain.in_flight == 1
    gate.set()
    await task
    bodies = []
    while not sent.empty():
        bodies.append((await sent.get()).get("body", b""))
    assert b"last" in b"".join(bodies)
    assert drain.in_flight == 0
    disconnect.set()


# -- a real uvicorn process ------------------------------------------------------------------------
SERVER = """
import asyncio, logging, sys
import uvicorn
from fastapi import FastAPI
from starlette.responses import StreamingResponse
from gemel.api.drain import Drain, DrainMiddleware, DrainingServer

logging.basicConfig(level="INFO")  # as gemel serve: the drain's lines
port, timeout_s = int(sys.argv[1]), float(sys.argv[2])
drain = Drain(timeout_s)
app = FastAPI()
app.add_middleware(DrainMiddleware, drain=drain)

@app.post("/v1/chat/completions")
async def chat():
    async def body():
        while True:  # never ends on its own
            yield b"data: tick\\n\\n"
            await asyncio.sleep(0.05)
    return StreamingResponse(body(), media_type="text/event-stream")

@app.get("/healthz")
async def healthz():
    return {"status": "OK"}

config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="info", timeout_graceful_shutdown=1)
DrainingServer(config, drain).run()
print("exited normally", flush=True)
"""


def start(tmp_path, drain_timeout_s: float) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(SERVER))
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(port), str(drain_timeout_s)], stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        try:
            httpx.get(f"{url}/healthz", timeout=2)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("test server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_log(tmp_path) -> str:
    return (tmp_path / "server.log").read_text()


@pytest.mark.parametrize("second_signal", [False, True], ids=["drain-timeout", "second-signal"])
def test_a_stuck_request_cannot_hold_the_process(tmp_path, second_signal):
    # drain-timeout: the drain gives up after its timeout. second-signal: with a drain
    # timeout far beyond the wait below, a second SIGTERM ends the drain.
    proc, url = start(tmp_path, drain_timeout_s=600 if second_signal else 1)
    try:
        with httpx.Client(timeout=30) as c, c.stream("POST", f"{url}/v1/chat/completions") as r:
            ticks = r.iter_lines()
            assert next(ticks).startswith("data: tick")
            os.kill(proc.pid, signal.SIGTERM)
            while "draining: 1 requests in flight" not in read_log(tmp_path):
                assert proc.poll() is None
                next(ticks)  # the stream keeps flowing while the server drains
            if second_signal:
                os.kill(proc.pid, signal.SIGTERM)
            with pytest.raises(httpx.HTTPError):  # cut off when the server stops
                for _ in ticks:
                    pass
        assert proc.wait(timeout=30) == 0, read_log(tmp_path)
        log = read_log(tmp_path)
        assert "exited normally" in log and "drained" not in log
        if not second_signal:
            assert "drain timeout (1s): stopping with 1 requests still running" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
