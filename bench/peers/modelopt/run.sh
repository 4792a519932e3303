#!/usr/bin/env bash
# run.sh DATA_DIR OUT_DIR [--steps N] [--seconds S] [--seed K] [--peer-defaults] [--seq-len L] [--threads T]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
V=${MODELOPT_VENV:-$ROOT/.venv-peers/modelopt}
[ -f "$V/.installed" ] || bash "$HERE/install.sh"
exec "$V/bin/python" "$HERE/run.py" "$@"
