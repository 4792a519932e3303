#!/usr/bin/env bash
# SpecForge 0.2.0 (PyPI `specforge`, sgl-project) in its own venv, CPU torch kept.
# Idempotent: re-running re-checks the pins and changes nothing when they hold.
# specforge's wheel pins torch==2.11.0, transformers==5.8.1, sglang==0.5.14 (+ wandb, tensorboard, yunchang,
# openai-harmony); none of sglang / yunchang / wandb / tensorboard is imported on the offline DFlash path,
# so the wheel goes in with --no-deps and its pure-Python dependencies are named one by one below.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../../.." && pwd)"
VENV="$REPO/.venv-peers/specforge"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
# 1) the CPU torch first (pip finds torch 2.13.0+cpu in the local find-links dir)
"${PIP[@]}" torch==2.13.0
# 2) the peer itself, no dependencies
"${PIP[@]}" --no-deps specforge==0.2.0
# 3) its pure-Python dependencies (and theirs), all pinned, --no-deps so nothing can replace torch.
#    transformers 5.8.1 = the version specforge pins (it runs with torch 2.13 here).
"${PIP[@]}" --no-deps \
  transformers==5.8.1 tokenizers==0.22.2 huggingface_hub==1.33.0 hf-xet==1.8.0 safetensors==0.8.0 \
  accelerate==1.16.0 datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6 \
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0 \
  numpy==2.4.6 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 PyYAML==6.0.4 psutil==7.2.2 tqdm==4.70.1 regex==2026.12.2 packaging==26.4 \
  requests==2.34.2 urllib3==2.8.0 idna==3.21 charset-normalizer==3.5.3 certifi==2026.10.19.post1 \
  httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 click==8.5.1 typer==0.29.2 shellingham==1.5.4 \
  rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0 annotated-doc==0.0.7 \
  filelock==4.3.2 Jinja2==3.1.6 MarkupSafe==3.0.4 networkx==3.6.1 sympy==1.14.0 mpmath==1.3.0
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m, torch
assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert m.version("specforge") == "0.2.0"
assert m.version("transformers") == "5.8.1"
import specforge.cli, specforge.algorithms.builtin, specforge.modeling.draft.dflash  # noqa: F401
print("specforge", m.version("specforge"), "torch", torch.__version__, "transformers", m.version("transformers"))
PY
