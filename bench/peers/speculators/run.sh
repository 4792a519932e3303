#!/usr/bin/env bash
# usage: run.sh DATA_DIR OUT_DIR [--steps N] [--seconds S] [--seed K] [--threads T] [--peer-defaults]
#               [--target DIR] [--reuse-data PREPARED_DIR]
# Trains speculators 0.9.0's DFlash drafter on CPU (see NOTES.md) and exports OUT_DIR/export for vLLM.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
[ -f "$ROOT/.venv-peers/speculators/.installed" ] || bash "$HERE/install.sh"
exec "$ROOT/.venv-peers/speculators/bin/python" "$HERE/run.py" "$@"
