#!/usr/bin/env bash
# GPU check for one H200 (finishes within 8 minutes): compiled FlexAttention vs
# SDPA, `bench` at the 8b shape in bf16, a 50-step CUDA training run; one table.
# Usage (repo root, CUDA torch 2.13 installed): bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 470 "$PY" bench/gpu_check.py
