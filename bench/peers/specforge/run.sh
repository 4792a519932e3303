#!/usr/bin/env bash
# bench/peers/specforge/run.sh DATA_DIR OUT_DIR [--steps N] [--seconds S] [--seed K] [--peer-defaults] [...]
# (run.py --help). Needs install.sh first (.venv-peers/specforge) and the project venv (.venv) for the dump.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
exec "$HERE/../../../.venv-peers/specforge/bin/python" "$HERE/run.py" "$@"
