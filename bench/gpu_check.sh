#!/usr/bin/env bash
# The device check for one lent GPU (H100 or H200, no internet), under 10 minutes: flex vs SDPA
# (bf16, relative tolerance), compiled vs eager block masks, a torchrun colocated training run
# with stop + bit-exact resume and a recompile count, peak memory at the 8B config, trainer MFU.
# One ok / FAILED line per check; JSON in bench/results/gpu_check_<gpu>.json (and $OUT/);
# exit 1 if any check failed. Usage (repo root, CUDA torch 2.13 in .venv): bash bench/gpu_check.sh
# Extra arguments go to bench/gpu_check.py (e.g. --only flex_vs_sdpa,block_masks).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the per-check limits sum to 590 s; this one only guards the driver itself
exec timeout 600 "$PY" bench/gpu_check.py "$@"
