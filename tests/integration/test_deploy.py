"""deploy/seccomp/gemel-engine.json, loaded for real: `gemel serve` runs under it (the front end,
the spawned engine process, the C++ kernels, uvicorn and gRPC) and answers a generation, while
a system call outside the allowlist is refused.

The filter is loaded with the system's libseccomp (through ctypes) in a small launcher that
then execs the command, as a container runtime does; seccomp filters survive execve.
Without libseccomp the tests skip.
"""

from __future__ import annotations

import ctypes.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import TEST_CONFIG, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "deploy" / "seccomp" / "gemel-engine.json"

# argv: PROFILE COMMAND...; loads the profile as an OCI runtime would, then execs COMMAND.
LAUNCHER = r"""
import ctypes, ctypes.util, json, os, sys
OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6,
       "SCMP_CMP_MASKED_EQ": 7}
class Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
lib = ctypes.CDLL(ctypes.util.find_library("seccomp"))
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(Arg)]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
def action(name, errno):
    return 0x7FFF0000 if name == "SCMP_ACT_ALLOW" else 0x00050000 | (errno & 0xFFFF)
profile = json.load(open(sys.argv[1]))
assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
ctx = lib.seccomp_init(action("SCMP_ACT_ERRNO", profile.get("defaultErrnoRet", 1)))
for entry in profile["syscalls"]:
    args = entry.get("args") or []
    arr = (Arg * max(1, len(args)))(*[Arg(a["index"], OPS[a["op"]], a["value"], a.get("valueTwo", 0)) for a in args])
    for name in entry["names"]:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            continue  # not a system call of this architecture
        rc = lib.seccomp_rule_add_array(ctx, action(entry["action"], entry.get("errnoRet", 1)), nr, len(args), arr)
        assert rc == 0, (name, rc)
assert lib.seccomp_load(ctx) == 0, "seccomp_load failed"
os.execv(sys.argv[2], sys.argv[2:])
"""

PROBE = r"""
import ctypes, multiprocessing, socket
def child(q):
    q.put(42)
if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start(); assert q.get(timeout=60) == 42; p.join()
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); s.close()
    libc = ctypes.CDLL(None, use_errno=True)
    print("personality", libc.personality(0xFFFFFFFF), ctypes.get_errno())
"""


def confined(*command: str) -> list[str]:
    if not ctypes.util.find_library("seccomp"):
        pytest.skip("needs libseccomp (Debian: libseccomp2)")
    return [sys.executable, "-c", LAUNCHER, str(PROFILE), *command]


def test_profile_allows_python_and_refuses_the_rest(tmp_path):
    probe = tmp_path / "probe.py"  # a file: spawned children import their target from it
    probe.write_text(PROBE)
    free = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=120)
    assert free.returncode == 0 and "personality 0 0" in free.stdout, free.stderr  # allowed without the filter
    out = subprocess.run(confined(sys.executable, str(probe)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "personality -1 1" in out.stdout  # EPERM: not in the allowlist


def test_gemel_serve_under_the_profile(tmp_path):
    config = tmp_path / "gemel.yaml"
    config.write_text(TEST_CONFIG)
    port, grpc_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        confined(sys.executable, "-m", "gemel.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
                 "--port", str(port), "--grpc-port", str(grpc_port)),  # fmt: skip
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError("not ready:\n" + log.read_text()[-4000:])
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert "Seccomp:\t2" in status  # the server really ran filtered
        assert "C++ CPU kernels unavailable" not in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text()[-4000:]
