#!/usr/bin/env bash
# Idempotent install of the peer trainer speculators 0.9.0 (vllm-project) in its own venv,
# without letting anything replace the CPU torch: torch first, then every package --no-deps, exact pins.
# torchvision / torchaudio (Requires-Dist of speculators, never imported on the train path) are left out.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
VENV="$ROOT/.venv-peers/speculators"
PY="$VENV/bin/python"
if [ -f "$VENV/.installed" ]; then echo "speculators venv already installed: $VENV"; exit 0; fi
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install torch==2.13.0            # resolves to 2.13.0+cpu from the local find-links dir
"$PY" -m pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0
# Pure-Python (and a few binary: pyarrow, pandas, xxhash, ...) dependencies of speculators, transformers and
# datasets, as resolved by pip for `transformers==5.19.0` (the highest speculators 0.9.0 allows) + the rest.
"$PY" -m pip install --no-deps \
  transformers==5.19.0 tokenizers==0.23.3 huggingface_hub==2.4.0 hf-xet==1.8.0 safetensors==0.8.0 \
  regex==2026.12.2 PyYAML==6.0.4 packaging==26.4 tqdm==4.70.1 numpy==2.4.6 \
  datasets==5.1.0 pyarrow==26.0.1 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6 dill==0.4.1 \
  multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.7.0 \
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 \
  propcache==0.5.4 yarl==1.25.1 idna==3.21 \
  httpx==0.29.0 httpcore==1.0.9 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 \
  certifi==2026.10.19.post1 truststore==0.10.5 \
  openai==3.63.0 jiter==0.19.0 \
  pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 \
  typing-inspection==0.4.5 python-dotenv==1.2.4 \
  click==8.5.1 typer==0.29.2 shellingham==1.5.4 annotated-doc==0.0.7 rich==15.0.0 markdown-it-py==4.3.0 \
  mdurl==0.1.2 Pygments==2.21.0 \
  loguru==0.7.3 protobuf==7.36.2 psutil==7.2.2
"$PY" -m pip check | grep -v -E "torchaudio|torchvision" || true   # only the two never-imported ones are missing
"$PY" -c "import importlib.metadata, torch, speculators, transformers, datasets; assert torch.__version__ == '2.13.0+cpu', torch.__version__; print('torch', torch.__version__, 'speculators', importlib.metadata.version('speculators'), 'transformers', transformers.__version__)"
touch "$VENV/.installed"
