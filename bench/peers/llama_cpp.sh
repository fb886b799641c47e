#!/usr/bin/env bash
# Build and start llama.cpp's server as the benchmark peer.
#
# The llama.cpp sources come from the PyPI sdist of llama-cpp-python (vendor/llama.cpp);
# the build lives in a cache directory outside the repository and is reused when present.
#
#   bench/peers/llama_cpp.sh build                      # build (or reuse) llama-server; prints its path
#   bench/peers/llama_cpp.sh start [--port P] [--parallel N] [--model GGUF] [--ctx C] [--threads T]
#                                                       # build if needed, then exec llama-server
#   bench/peers/llama_cpp.sh path                       # print the binary's path (exit 1 if not built)
#
# Environment: GEMEL_LLAMA_CPP_CACHE (default ~/.cache/gemel/llama.cpp), PYTHON (default: the
# repository's .venv/bin/python, else python3), JOBS (default 2), LLAMA_CPP_PYTHON_VERSION (pin
# the sdist, default: latest), LLAMA_CPP_ISA (which build, below).
#
# Builds, one per CPU (model and flags) and kind, cached side by side:
#   LLAMA_CPP_ISA=auto (default): native (GGML_NATIVE=ON) on CPUs without AMX; on CPUs with AMX,
#     GGML_NATIVE=OFF with AVX-512/VNNI/BF16 on and AMX off (a -march=native build includes
#     ggml's AMX path, which died with a general protection fault on the Xeons measured).
#   LLAMA_CPP_ISA=avx2: GGML_NATIVE=OFF with AVX/AVX2/FMA/F16C on, AVX-512 and AMX off: what an
#     AVX2-only CPU (AMD Zen 3, Intel before Ice Lake) runs, to compare gemel's cpu_isa=avx2
#     plan against it on any x86 machine.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${GEMEL_LLAMA_CPP_CACHE:-$HOME/.cache/gemel/llama.cpp}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
JOBS="${JOBS:-2}"
ISA="${LLAMA_CPP_ISA:-auto}"
CPU_FLAGS="$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true)"
CPU_KEY="$( { grep -m1 'model name' /proc/cpuinfo 2>/dev/null; echo "$CPU_FLAGS"; } | sha256sum | cut -c1-12)"
case "$ISA" in
  auto)
    if [[ " $CPU_FLAGS " == *" amx_tile "* ]]; then
      KIND=avx512-noamx
      ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                 -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
                 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    else
      KIND=native
      ISA_FLAGS=(-DGGML_NATIVE=ON)
    fi ;;
  avx2)
    KIND=avx2
    ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
               -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  *) echo "LLAMA_CPP_ISA must be auto or avx2, not $ISA" >&2; exit 2 ;;
esac
BUILD="$CACHE/build-$KIND-$CPU_KEY"
BIN="$BUILD/bin/llama-server"

log() { echo "[llama_cpp.sh] $*" >&2; }

build() {
  if [[ -x "$BIN" ]]; then
    log "reusing $BIN"
    echo "$BIN"
    return 0
  fi
  mkdir -p "$CACHE"
  local src="$CACHE/src"
  if [[ ! -f "$src/CMakeLists.txt" ]]; then
    local dl="$CACHE/sdist"
    rm -rf "$dl" && mkdir -p "$dl"
    local spec="llama-cpp-python"
    [[ -n "${LLAMA_CPP_PYTHON_VERSION:-}" ]] && spec="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    log "downloading the $spec sdist"
    "$PYTHON" -m pip download --no-deps --no-binary :all: "$spec" -d "$dl" >&2
    local tarball=""
    local f
    for f in "$dl"/llama_cpp_python-*.tar.gz "$dl"/llama-cpp-python-*.tar.gz; do
      [[ -f "$f" ]] && { tarball="$f"; break; }
    done
    [[ -n "$tarball" ]] || { log "no sdist found in $dl"; exit 1; }
    tar -xzf "$tarball" -C "$dl"
    local vendored
    vendored="$(find "$dl" -maxdepth 3 -type d -path '*/vendor/llama.cpp' -print -quit)"
    [[ -n "$vendored" && -f "$vendored/CMakeLists.txt" ]] || { log "vendor/llama.cpp not found in $tarball"; exit 1; }
    rm -rf "$src"
    mv "$vendored" "$src"
    basename "$tarball" >"$CACHE/SOURCE"
    rm -rf "$dl"
  fi
  log "configuring (sources from $(cat "$CACHE/SOURCE" 2>/dev/null || echo '?'))"
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  log "build kind $KIND (${ISA_FLAGS[*]})"
  nice -n 19 cmake -S "$src" -B "$BUILD" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    "${ISA_FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
  log "building llama-server with -j$JOBS (several minutes)"
  nice -n 19 cmake --build "$BUILD" --target llama-server -j "$JOBS" >&2
  [[ -x "$BIN" ]] || { log "build finished but $BIN is missing"; exit 1; }
  echo "$BIN"
}

default_model() {
  (cd "$REPO" && "$PYTHON" -c "from gemel.loader.sources import resolve; print(resolve('smollm2-135m-instruct'))")
}

start() {
  local port=8081 parallel=1 model="" ctx="" threads=2 host=127.0.0.1
  local extra=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --port) port="$2"; shift 2 ;;
      --parallel|-np) parallel="$2"; shift 2 ;;
      --model|-m) model="$2"; shift 2 ;;
      --ctx|-c) ctx="$2"; shift 2 ;;
      --threads|-t) threads="$2"; shift 2 ;;
      --host) host="$2"; shift 2 ;;
      --) shift; extra=("$@"); break ;;
      *) log "unknown option $1"; exit 2 ;;
    esac
  done
  [[ -n "$model" ]] || model="$(default_model)"
  # every slot gets ctx/parallel tokens: 512 per slot covers 128-256 in + out with room
  [[ -n "$ctx" ]] || ctx=$(( parallel * 512 ))
  local bin
  bin="$(build)"
  log "exec $bin -m $model --host $host --port $port -t $threads -tb $threads -np $parallel -cb -c $ctx ${extra[*]:-}"
  exec "$bin" -m "$model" --host "$host" --port "$port" -t "$threads" -tb "$threads" \
    -np "$parallel" -cb -c "$ctx" "${extra[@]}"
}

case "${1:-}" in
  build) build ;;
  start) shift; start "$@" ;;
  path) [[ -x "$BIN" ]] && echo "$BIN" ;;
  *) echo "usage: $0 build | start [--port P] [--parallel N] [--model GGUF] [--ctx C] [--threads T] [-- extra llama-server args] | path" >&2; exit 2 ;;
esac
