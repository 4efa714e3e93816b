#!/usr/bin/env bash
# The one command a Mac owner runs on a fresh clone to tell us how macinfer runs there.
#
# Usage: scripts/mac_check.sh [--dry-run] [--quick] [--no-install]
#   --dry-run     print every step it would run (and which this host would skip); change nothing
#   --quick       doctor --quick and one bench repeat (minutes instead of about half an hour)
#   --no-install  use the macinfer already installed (the interpreter: $PYTHON, .venv, else python3)
#
# Steps: the install (scripts/install.sh --test: the only one that uses the network), then
# `macinfer doctor --json`, the suite's Metal-only tests, the kernel emulator built with clang++,
# `xcrun metal` on the kernels' full Metal source, the kernel vs SDPA timing grid, and
# `macinfer bench --compare mlx-lm` on the embedded model and on a catalog model if one is on disk
# (scripts/mac_check.py). It writes one report, Markdown and JSON, under mac_check_report/ and
# prints its path. On Linux it runs what can run and says what it skipped.
# What each figure should be on an M-series chip: docs/platform.md, "The first Mac run".
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0; INSTALL=1; PASS=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1; PASS+=(--dry-run) ;;
    --quick) PASS+=(--quick) ;;
    --no-install) INSTALL=0 ;;
    *) echo "error: unknown option $arg (usage: scripts/mac_check.sh [--dry-run] [--quick] [--no-install])" >&2
       exit 2 ;;
  esac
done

if [ "$INSTALL" -eq 1 ]; then
  if [ "$DRY" -eq 1 ]; then
    echo "+ [install] bash scripts/install.sh --test"
  else
    echo "== install: bash scripts/install.sh --test"
    bash scripts/install.sh --test
  fi
fi

# The interpreter macinfer is in: install.sh's venv strategy puts it in .venv.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ "$DRY" -eq 0 ] && ! "$PY" -c "import macinfer" 2>/dev/null; then
  echo "error: $PY cannot import macinfer: run without --no-install, or set PYTHON to its interpreter" >&2
  exit 1
fi
exec "$PY" scripts/mac_check.py --python "$PY" ${PASS[@]+"${PASS[@]}"}
